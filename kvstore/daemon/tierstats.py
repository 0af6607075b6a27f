"""What every tier reports: its counters and a snapshot for ``Stats`` and the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    promotions: int = 0
    demotions: int = 0
    checksum_failures: int = 0
    prefetch_hits: int = 0
    io_errors: int = 0


@dataclass
class TierSnapshot:
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    counters: TierCounters
    up: bool = True
    extra: dict[str, float] = field(default_factory=dict)
