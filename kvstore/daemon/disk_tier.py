"""The NVMe tier as the daemon keeps it: which entry's record is in which slot of the slab file,
how many blocks it holds, its counters and its snapshot.

``DiskSlots`` is the disk's side of the contract every tier keeps with the store (place a copy,
vacate it, say who owns a slot, counters, snapshot); the IO itself (writes, reads, recovery)
is the ``NvmeTier`` it holds and ``movement.Mover`` drives. Like ``cpu_tier.CpuSlots`` it knows
nothing of keys, block states or eviction policy: the store, which owns the index, tells it.

Invariant (``invariants.check_store`` asserts it): ``owner`` maps exactly the slots of entries
with a disk copy, and ``blocks`` counts them. Event-loop only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.daemon.tierstats import TierCounters, TierSnapshot

if TYPE_CHECKING:
    from kvstore.tiers.nvme import NvmeTier


class DiskSlots:
    """See the module docstring. ``tier`` is None until the Mover opens it (or without NVMe)."""

    def __init__(self) -> None:
        self.tier: NvmeTier | None = None
        self.counters = TierCounters()
        self.blocks = 0
        self._owner: dict[int, int] = {}  # slot -> the entry whose record it holds

    def place(self, eid: int, slot: int) -> None:
        """Entry ``eid``'s record is in ``slot`` (written, or found at start-up)."""
        if slot in self._owner:
            raise AssertionError(f"disk slot {slot} already holds entry {self._owner[slot]}")
        self._owner[slot] = eid
        self.blocks += 1

    def vacate(self, slot: int) -> None:
        """The record in ``slot`` goes: the tier frees (and tombstones) the slot."""
        assert self.tier is not None
        del self._owner[slot]
        self.tier.free(slot)
        self.blocks -= 1

    def owner(self, slot: int) -> int | None:
        """The entry whose record is in ``slot`` (None: free, or a write in flight)."""
        return self._owner.get(slot)

    def snapshot(self) -> TierSnapshot | None:
        if self.tier is None:
            return None
        stats = self.tier.stats()
        extra = {
            k: float(v)
            for k, v in stats.items()
            if k not in ("capacity_bytes", "used_bytes", "blocks") and isinstance(v, int | float)
        }
        extra["prefetch_hits"] = float(self.counters.prefetch_hits)
        extra["io_errors"] = float(self.counters.io_errors)
        if self.counters.lossy_refused:
            extra["lossy_refused"] = float(self.counters.lossy_refused)
        return TierSnapshot(
            "nvme",
            int(stats["capacity_bytes"]),
            int(stats["used_bytes"]),
            self.blocks,
            self.counters,
            extra=extra,
            logical_bytes=int(stats["logical_bytes"]),
            stored_bytes=int(stats["used_bytes"]),  # whole slots: what capacity counts
        )
