"""The ``kvstore stat`` table: a Stats reply as a plain dict (``--json``) and as the text table
that ``kvstore stat`` and the demos print. Its own module so every face can show it without
importing another face."""

from __future__ import annotations

from typing import Any

from kvstore.units import format_size


def _bar(fraction: float, width: int = 24) -> str:
    fraction = min(max(fraction, 0.0), 1.0)
    full = round(fraction * width)
    if fraction > 0 and full == 0:
        full = 1  # a tier holding anything never looks empty
    return "█" * full + "░" * (width - full)


def stats_to_dict(reply: Any) -> dict[str, Any]:
    tiers = []
    for t in reply.tiers:
        lookups = t.hits + t.misses
        tiers.append(
            {
                "name": t.name,
                "up": t.up,
                "capacity_bytes": t.capacity_bytes,
                "used_bytes": t.used_bytes,
                "blocks": t.blocks,
                "hits": t.hits,
                "misses": t.misses,
                "hit_rate": (t.hits / lookups) if lookups else None,
                "evictions": t.evictions,
                "promotions": t.promotions,
                "demotions": t.demotions,
                "checksum_failures": t.checksum_failures,
                "logical_bytes": t.logical_bytes,
                "stored_bytes": t.stored_bytes,
                "ratio": (t.logical_bytes / t.stored_bytes) if t.stored_bytes else None,
                "extra": dict(t.extra),
            }
        )
    namespaces = []
    for n in reply.namespaces:
        lookups = n.hits + n.misses
        namespaces.append(
            {
                "name": n.name,
                "blocks": n.blocks,
                "used_bytes": n.used_bytes,
                "block_bytes": n.block_bytes,
                "lookup_hits": n.hits,
                "lookup_misses": n.misses,
                "hit_rate": (n.hits / lookups) if lookups else None,
                "tiers": [
                    {
                        "tier": b.tier,
                        "blocks": b.blocks,
                        "logical_bytes": b.logical_bytes,
                        "stored_bytes": b.stored_bytes,
                        "ratio": (b.logical_bytes / b.stored_bytes) if b.stored_bytes else None,
                        "codec": b.codec,
                    }
                    for b in n.tiers
                ],
            }
        )
    tenants = [
        {
            f.name: getattr(t, f.name)
            for f in t.DESCRIPTOR.fields  # every figure of TenantStats, by its proto name
        }
        for t in getattr(reply, "tenants", ())
    ]
    return {
        "version": reply.version,
        "uptime_s": reply.uptime_s,
        "active_leases": reply.active_leases,
        "active_reservations": reply.active_reservations,
        "tiers": tiers,
        "namespaces": namespaces,
        "tenants": tenants,
    }


_EXTRA_LABELS = {
    "clean_bytes": "clean (on disk too)",
    "clean_below_bytes": "clean (in a tier below too)",
    "device": "cuda device",
    "compression_ratio": "io ratio",
    "prefetch_hits": "prefetch hits",
    "io_errors": "io errors",
    "lossy_refused": "lossy records refused",
    "skipped_while_down": "calls skipped while down",
    "reconnects": "reconnects",
}


def _fmt_extra(key: str, value: float) -> str:
    if key.endswith("_bytes"):
        return format_size(value)
    if key.endswith("ratio"):
        return f"{value:.2f}x"
    return f"{value:.0f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def render_stats(d: dict[str, Any]) -> str:
    lines = [
        f"kvstore {d['version']}  up {d['uptime_s']:.0f}s  "
        f"leases {d['active_leases']}  reservations {d['active_reservations']}",
        "",
        f"{'TIER':<6} {'OCCUPANCY':<26} {'USED':>10} {'CAPACITY':>10} {'BLOCKS':>9} "
        f"{'HIT RATE':>8} {'HITS':>9} {'MISSES':>9} {'EVICTED':>9} {'PROMOTED':>9} {'DEMOTED':>9}",
    ]
    for t in d["tiers"]:
        frac = t["used_bytes"] / t["capacity_bytes"] if t["capacity_bytes"] else 0.0
        state = "" if t["up"] else "  DOWN"
        lines.append(
            f"{t['name']:<6} {_bar(frac)} {100 * frac:4.0f}% {format_size(t['used_bytes']):>9} "
            f"{format_size(t['capacity_bytes']):>10} {t['blocks']:>9} {_pct(t['hit_rate']):>8} "
            f"{t['hits']:>9} {t['misses']:>9} {t['evictions']:>9} {t['promotions']:>9} "
            f"{t['demotions']:>9}{state}"
        )
    for t in d["tiers"]:
        shown = {k: v for k, v in t["extra"].items() if k in _EXTRA_LABELS}
        if shown or t["checksum_failures"] or t["name"] in ("nvme", "redis"):
            parts = []
            if t["name"] in ("nvme", "redis"):
                parts.append(
                    f"logical {format_size(t['logical_bytes'])} stored "
                    f"{format_size(t['stored_bytes'])} ({_ratio(t['ratio'])})"
                )
            parts += [f"{_EXTRA_LABELS[k]} {_fmt_extra(k, v)}" for k, v in shown.items()]
            parts.append(f"checksum failures {t['checksum_failures']}")
            lines.append(f"{'':<6} {t['name']}: " + ", ".join(parts))
    if d["namespaces"]:
        lines += [
            "",
            f"{'NAMESPACE':<40} {'BLOCKS':>9} {'USED':>10} {'BLOCK':>9} {'LOOKUP HIT':>10}",
        ]
        for n in d["namespaces"]:
            lines.append(
                f"{n['name'][:40]:<40} {n['blocks']:>9} {format_size(n['used_bytes']):>10} "
                f"{format_size(n['block_bytes']):>9} {_pct(n['hit_rate']):>10}"
            )
            for b in n.get("tiers", ()):
                lines.append(
                    f"  {b['tier']:<6} {b['codec'] or '-':<8} {b['blocks']:>9} blocks, logical "
                    f"{format_size(b['logical_bytes'])} stored {format_size(b['stored_bytes'])} "
                    f"({_ratio(b['ratio'])})"
                )
    if d.get("tenants"):
        lines += ["", *_tenant_lines(d["tenants"])]
    return "\n".join(lines)


def _tenant_lines(tenants: list[dict[str, Any]]) -> list[str]:
    """Each tenant's usage against its quotas ([tenants.NAME]); "-" where nothing bounds it."""

    def of(used: int, bound: int) -> str:
        return format_size(used) + (f" / {format_size(bound)}" if bound else "")

    lines = [
        f"{'TENANT':<20} {'CPU / QUOTA':>22} {'GUARANTEED':>10} {'NVME / QUOTA':>22} "
        f"{'PINNED / MAX':>22} {'LEASES':>7} {'RESERV':>7} {'KEYS/S':>8} {'REFUSED':>8}"
    ]
    for t in tenants:
        rate = f"{t['keys_per_s']:g}" if t["keys_per_s"] else "-"
        lines.append(
            f"{(t['name'] or '(default)')[:20]:<20} "
            f"{of(t['cpu_bytes'], t['quota_cpu_bytes']):>22} "
            f"{format_size(t['guaranteed_cpu_bytes']):>10} "
            f"{of(t['nvme_bytes'], t['quota_nvme_bytes']):>22} "
            f"{of(t['pinned_bytes'], t['max_pinned_bytes']):>22} {t['leases']:>7} "
            f"{t['reservations']:>7} {rate:>8} {t['refused_keys']:>8}"
        )
    return lines
