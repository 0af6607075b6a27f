"""The CPU tier as the daemon keeps it: the shared-memory arena, its slab allocator, which entry
holds which slot, and the bytes those slots count.

``CpuSlots`` is the tier's one contract with the store: allocate and give back slots, place an
entry in a slot and vacate it, quarantine a slot (taken from its entry but not reusable yet),
move a block to another slot, and report its counters and snapshot. It knows nothing of keys,
block states or eviction policy: the store (``kvstore.daemon.store``), which owns the index
and every block state transition, tells it what to do; the policy is the store's too.

Invariants (``check`` asserts them against the index):
- ``owner`` maps exactly the slots of entries that hold a CPU copy, each to its entry;
- ``used_bytes`` = bytes of the blocks in owned slots + quarantined bytes + slots handed out
  and not yet placed (none when the store is idle);
- ``clean_bytes`` = bytes of owned blocks that also have a copy on disk.

Event-loop only; copies on the daemon's side of the arena are the store's (bytes path, moves
between tiers), never a client's.
"""

from __future__ import annotations

from kvstore.checksum import block_checksum
from kvstore.config import CpuTierConfig
from kvstore.daemon.tierstats import TierCounters, TierSnapshot
from kvstore.tiers.cpu import HEADER_BYTES, SharedMemoryArena, SlabAllocator


class CpuSlots:
    """See the module docstring."""

    def __init__(self, config: CpuTierConfig) -> None:
        # The header page comes on top of the capacity, so all of it holds blocks.
        self.arena = SharedMemoryArena(config.capacity_bytes + HEADER_BYTES)
        try:
            # Each slab is its own backed file, made when a domain first takes it (all of them
            # at start-up with prefault): memory that cannot be had is a CapacityError naming
            # it, never a SIGBUS.
            self.allocator = SlabAllocator(
                self.arena.size_bytes,
                config.slab_bytes,
                back=self.arena.back,
                prefault=config.prefault,
            )
            self.arena.slab_bytes = self.allocator.slab_bytes
        except BaseException:
            self.arena.close()
            raise
        self.counters = TierCounters()
        self._owner: dict[int, int] = {}  # slot offset -> the entry whose copy is in it
        self.used_bytes = 0
        self.clean_bytes = 0  # bytes of blocks here that also have a disk copy
        # How much more its entries are as readers get them than as stored (fp8 payloads of a
        # ``cpu = "fp8"`` namespace): Stats' logical bytes are used bytes plus this.
        self.payload_savings = 0
        self.quarantined_bytes = 0

    def close(self) -> None:
        self.arena.close()

    # ----------------------------------------------------------------- slots
    def alloc(self, block_bytes: int, domain: int = 0) -> int | None:
        """A slot in memory ``domain``, counted as used; None when none is free (or its slab
        could not be backed)."""
        offset = self.allocator.allocate(block_bytes, domain)
        if offset is not None:
            self.used_bytes += block_bytes
        return offset

    def unalloc(self, offset: int, block_bytes: int) -> None:
        """Give back a slot from ``alloc`` that no entry took."""
        self.allocator.free(offset, block_bytes)
        self.used_bytes -= block_bytes

    def place(self, eid: int, offset: int, block_bytes: int, clean: bool) -> None:
        """Entry ``eid``'s copy is in slot ``offset`` (from ``alloc``)."""
        if offset in self._owner:
            raise AssertionError(f"slot {offset} already holds entry {self._owner[offset]}")
        self._owner[offset] = eid
        if clean:
            self.clean_bytes += block_bytes

    def place_dirty(self, eids: list[int], offsets: list[int]) -> None:
        """``place`` of each ``eids[j]`` in ``offsets[j]``, none with a disk copy yet."""
        owner = self._owner
        if not owner.keys().isdisjoint(offsets) or len(set(offsets)) != len(offsets):
            taken = next(o for o in offsets if o in owner or offsets.count(o) > 1)
            raise AssertionError(f"slot {taken} already holds entry {owner.get(taken)}")
        owner.update(zip(offsets, eids, strict=True))

    def vacate(self, offset: int, block_bytes: int, clean: bool) -> None:
        """The copy in ``offset`` goes: the slot is free again."""
        del self._owner[offset]
        if clean:
            self.clean_bytes -= block_bytes
        self.unalloc(offset, block_bytes)

    def quarantine(self, offset: int, block_bytes: int) -> None:
        """Take a slot from its entry without freeing it (``release_quarantined`` later)."""
        del self._owner[offset]
        self.quarantined_bytes += block_bytes

    def release_quarantined(self, offset: int, block_bytes: int) -> None:
        self.quarantined_bytes -= block_bytes
        self.unalloc(offset, block_bytes)

    def note_clean(self, block_bytes: int, clean: bool) -> None:
        """A block here gained (``clean``) or lost its disk copy."""
        self.clean_bytes += block_bytes if clean else -block_bytes

    def owner(self, offset: int) -> int | None:
        """The entry whose copy is in slot ``offset`` (None: free, quarantined, or reserved
        for a copy still in flight)."""
        return self._owner.get(offset)

    def relocate(
        self,
        eid: int,
        old: int,
        block_bytes: int,
        avoid_slab: int,
        fingerprint: bytes,
        key: bytes,
        checksum: int,
    ) -> int | None:
        """Move a block to a free slot of its class outside ``avoid_slab`` (a slab being
        drained), verifying the copy against its checksum. Returns the new slot (the old one
        is free), -1 when the copy did not verify (the new slot is given back; the old one
        still holds the damaged block), or None when the class has no such free slot: taking a
        new slab would defeat the drain."""
        allocator = self.allocator
        domain = allocator.slab_info(allocator.slab_of(old)).domain
        if not allocator.class_free_slots(block_bytes, domain):
            return None
        new = allocator.allocate(block_bytes, domain)
        if new is None:
            return None
        if allocator.slab_of(new) == avoid_slab:  # cannot happen while it drains; be sure
            allocator.free(new, block_bytes)
            return None
        view = self.arena.view
        view[new : new + block_bytes] = view[old : old + block_bytes]
        if block_checksum(view[new : new + block_bytes], fingerprint, key) != checksum:
            allocator.free(new, block_bytes)
            return -1
        allocator.free(old, block_bytes)
        del self._owner[old]
        self._owner[new] = eid
        return new

    # ----------------------------------------------------------------- reports
    @property
    def capacity_bytes(self) -> int:
        return self.allocator.capacity_bytes

    def owned(self) -> int:
        return len(self._owner)

    def snapshot(self, blocks: int, reserved_blocks: int) -> TierSnapshot:
        return TierSnapshot(
            "cpu",
            self.allocator.capacity_bytes,
            self.used_bytes,
            blocks,
            self.counters,
            logical_bytes=self.used_bytes + self.payload_savings,
            stored_bytes=self.used_bytes,
            extra={
                "reserved_blocks": float(reserved_blocks),
                "clean_bytes": float(self.clean_bytes),
            },
        )
