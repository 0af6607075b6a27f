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
    lossy_refused: int = 0  # lossy records of namespaces configured lossless: misses, dropped


@dataclass
class TierSnapshot:
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    counters: TierCounters
    up: bool = True
    extra: dict[str, float] = field(default_factory=dict)
    # The blocks as readers get them and as the tier stores (and counts) them, after its
    # codecs; -1: the same as ``used_bytes`` (a tier without codecs).
    logical_bytes: int = -1
    stored_bytes: int = -1

    def __post_init__(self) -> None:
        if self.logical_bytes < 0:
            self.logical_bytes = self.used_bytes
        if self.stored_bytes < 0:
            self.stored_bytes = self.used_bytes

    @property
    def ratio(self) -> float:
        """Logical bytes per stored byte (1.0 for an empty tier)."""
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 1.0
