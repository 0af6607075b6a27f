"""What ``Stats`` and the metrics show of each tier: its capacity, use, blocks and counters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.daemon.tierstats import TierSnapshot

if TYPE_CHECKING:
    from kvstore.daemon.device import DeviceTier
    from kvstore.daemon.ledger import Ledger
    from kvstore.daemon.namespaces import NamespaceRecord
    from kvstore.daemon.shared import SharedTier


def tier_snapshots(store: Ledger, device: DeviceTier, shared: SharedTier) -> list[TierSnapshot]:
    """Occupancy and counters of every tier, top down."""
    cpu_blocks = len(store.policy)
    snaps = []
    if device.enabled:
        pool = device.pool
        assert pool is not None
        snaps.append(
            TierSnapshot(
                "gpu",
                device.capacity_bytes(),
                store.gpu_slots.used_bytes,
                len(store.gpu_policy),
                device.counters,
                extra={
                    "clean_below_bytes": float(device.clean_bytes()),
                    "device": float(pool.device.index or 0),
                },
            )
        )
    snaps.append(store.cpu_slots.snapshot(cpu_blocks, store.reserved_blocks))
    disk = store.disk.snapshot()
    if disk is not None:
        snaps.append(disk)
    if shared.enabled:
        stats = shared.stats()
        c = store.redis_counters
        c.promotions = shared.promotions
        c.demotions = shared.demotions
        c.checksum_failures = int(stats.get("checksum_failures", 0))
        c.evictions = int(stats.get("evictions", 0))
        extra = {
            k: float(v)
            for k, v in stats.items()
            if k
            in (
                "bytes_written",
                "logical_bytes_written",
                "bytes_read",
                "errors",
                "reconnects",
                "unavailable",
                "mac_failures",
                "lossy_refused",
            )
        }
        extra["skipped_while_down"] = float(shared.skipped)
        extra["dropped_while_down"] = float(shared.dropped_while_down)
        bound = store.config.redis.max_bytes_per_namespace
        snaps.append(
            TierSnapshot(
                "redis",
                bound,
                int(stats.get("bytes_written", 0)),
                int(stats.get("puts", 0)),
                c,
                up=bool(stats.get("up", False)),
                extra=extra,
                logical_bytes=int(stats.get("logical_bytes_written", 0)),
                stored_bytes=int(stats.get("bytes_written", 0)),
            )
        )
    return snaps


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
