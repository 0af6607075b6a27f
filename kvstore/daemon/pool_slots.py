"""The GPU tier as the ledger keeps it: which entry holds which slot of the device pool, the
device checksum of each complete GPU copy, and the bytes those slots count.

``PoolSlots`` is to the pool what ``cpu_tier.CpuSlots`` is to the shared-memory arena and
``disk_tier.DiskSlots`` to the slab file: it knows nothing of keys, block states or eviction
policy, and only the ledger changes it. The copies themselves (the pool's bytes, the stream
they move on) are the ``DeviceTier``'s, which gives the ledger its slab allocator when it
starts; until then (and without a GPU tier) it has none and holds no block.

Invariants (``invariants.check_store`` asserts them against the index):
- ``offset`` maps exactly the entries with the GPU bit to their slots, and ``owner`` is its
  inverse (a quarantined slot has no owner);
- ``dsum`` holds the device checksum of exactly the GPU copies that are complete (a reserved
  GPU slot a worker is still writing has none);
- ``used_bytes`` = bytes of the slots entries hold + quarantined slots + slots handed out and
  not yet placed (none when the store is idle).
"""

from __future__ import annotations

from kvstore.tiers.cpu import SlabAllocator


class PoolSlots:
    """See the module docstring. Event-loop only."""

    def __init__(self) -> None:
        self.allocator: SlabAllocator | None = None  # the DeviceTier's, once it starts
        self.offset: dict[int, int] = {}  # entry -> pool slot
        self._owner: dict[int, int] = {}  # pool slot -> entry
        self.dsum: dict[int, int] = {}  # entry -> device checksum of its complete GPU copy
        self.used_bytes = 0
        self.quarantined_bytes = 0

    # ----------------------------------------------------------------- slots
    def alloc_many(self, block_bytes: int, n: int) -> list[int]:
        """Up to ``n`` free pool slots, counted as used; fewer when no more are free."""
        assert self.allocator is not None, "no GPU pool"
        offsets = self.allocator.allocate_many(block_bytes, n)
        self.used_bytes += len(offsets) * block_bytes
        return offsets

    def unalloc(self, offset: int, block_bytes: int) -> None:
        """Give back a slot from ``alloc_many`` that no entry holds."""
        assert self.allocator is not None, "no GPU pool"
        self.allocator.free(offset, block_bytes)
        self.used_bytes -= block_bytes

    def place(self, eid: int, offset: int) -> None:
        """Entry ``eid``'s GPU copy is (being written) in slot ``offset``, from ``alloc_many``."""
        if offset in self._owner:
            raise AssertionError(f"pool slot {offset} already holds entry {self._owner[offset]}")
        if eid in self.offset:
            raise AssertionError(f"entry {eid} already holds pool slot {self.offset[eid]}")
        self.offset[eid] = offset
        self._owner[offset] = eid

    def complete(self, eid: int, dsum: int) -> None:
        """The GPU copy in ``eid``'s slot is whole, with device checksum ``dsum``."""
        if eid not in self.offset:
            raise AssertionError(f"entry {eid} holds no pool slot")
        self.dsum[eid] = dsum

    def vacate(self, eid: int, block_bytes: int) -> None:
        """``eid``'s copy goes: its slot is free again."""
        self.unalloc(self.detach(eid), block_bytes)

    def detach(self, eid: int) -> int:
        """Take ``eid``'s slot from it without freeing it; returns the slot."""
        offset = self.offset.pop(eid)
        del self._owner[offset]
        self.dsum.pop(eid, None)
        return offset

    def quarantine(self, eid: int, block_bytes: int) -> int:
        """``detach`` for a quarantine: the slot stays counted used until
        ``release_quarantined``; returns it."""
        self.quarantined_bytes += block_bytes
        return self.detach(eid)

    def release_quarantined(self, offset: int, block_bytes: int) -> None:
        self.quarantined_bytes -= block_bytes
        self.unalloc(offset, block_bytes)

    def owner(self, offset: int) -> int | None:
        """The entry whose copy is in pool slot ``offset`` (None: free or quarantined)."""
        return self._owner.get(offset)

    # ----------------------------------------------------------------- reports
    @property
    def capacity_bytes(self) -> int:
        return self.allocator.capacity_bytes if self.allocator is not None else 0

    def owners(self) -> dict[int, int]:
        """Slot -> entry, a copy (for the invariant checker)."""
        return dict(self._owner)
