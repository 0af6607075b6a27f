"""What ``Stats`` and the metrics show of each namespace in the tiers below the CPU tier (each
tier's own snapshot is its ``snapshot``, by the tier contract)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.daemon.ledger import Ledger
    from kvstore.daemon.namespaces import NamespaceRecord
    from kvstore.daemon.shared import SharedTier


def namespace_tier_bytes(
    store: Ledger, shared: SharedTier, namespaces: list[NamespaceRecord]
) -> dict[bytes, list[tuple[str, int, int, int, str]]]:
    """By namespace fingerprint: (tier, blocks, logical bytes, stored bytes, codec of new
    records) in the tiers below the CPU tier (redis: what this host wrote)."""
    from kvstore.tiers.codecs import NAME_OF

    out: dict[bytes, list[tuple[str, int, int, int, str]]] = {}
    records = {r.fingerprint: r for r in namespaces}
    sources = []
    if store.nvme is not None:
        sources.append(("nvme", store.nvme.namespace_bytes()))
    if shared.tier is not None:
        sources.append(("redis", shared.tier.namespace_bytes()))
    for tier, by_ns in sources:
        for fingerprint, (blocks, logical, stored) in by_ns.items():
            record = records.get(fingerprint)
            codec = NAME_OF[store.codec_of(record, tier)[0]] if record is not None else ""
            out.setdefault(fingerprint, []).append((tier, blocks, logical, stored, codec))
    return out
