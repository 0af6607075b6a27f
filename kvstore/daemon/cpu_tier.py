"""The CPU tier as the daemon keeps it: the shared-memory arena, its slab allocator, which entry
holds which slot, and the bytes those slots count.

``CpuSlots`` is the tier's one contract with the store: allocate and give back slots, place an
entry in a slot and vacate it, quarantine a slot (taken from its entry but not reusable yet),
move a block to another slot, and report its counters and snapshot. It knows nothing of keys,
block states or eviction policy: the store (``kvstore.daemon.store``), which owns the index
and every block state transition, tells it what to do; the policy is the store's too.

Which entry holds which slot is kept per slab, in one array of entry ids (``-1``: no entry)
indexed by slot number (offset - the slab's base) // its class's slot size: 4 bytes a slot
instead of a dict slot and a boxed offset (about 77 bytes a block at a million blocks). A slab
changes class only once all its slots are free, so its array is laid out again for its new
class when the first entry is placed in it after it held none.

Invariants (``check`` asserts them against the index):
- ``owner`` maps exactly the slots of entries that hold a CPU copy, each to its entry, and
  ``owned`` counts them;
- ``used_bytes`` = bytes of the blocks in owned slots + quarantined bytes + slots handed out
  and not yet placed (none when the store is idle);
- ``clean_bytes`` = bytes of owned blocks that also have a copy on disk.

Event-loop only; copies on the daemon's side of the arena are the store's (bytes path, moves
between tiers), never a client's.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from kvstore.checksum import block_checksum
from kvstore.config import CpuTierConfig
from kvstore.daemon.tierstats import TierCounters, TierSnapshot
from kvstore.tiers.cpu import HEADER_BYTES, SLOT_ALIGN, SharedMemoryArena, SlabAllocator

_NO_OWNERS: array[int] = array("i")  # a slab that never held an entry


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
        self._slab_bytes = self.allocator.slab_bytes
        # Per slab: (the entry in each slot, -1 for none; the slot size that array is laid out
        # for; the slab's base offset), and how many of its slots hold an entry. An array whose
        # slab holds no entry may be laid out for the slab's old class: all of it is -1, so
        # ``owner`` still reads None through it; ``_lay_out`` renews it before a placement.
        self._slabs: list[tuple[array[int], int, int]] = [
            (_NO_OWNERS, SLOT_ALIGN, HEADER_BYTES + i * self._slab_bytes)
            for i in range(self.allocator.num_slabs)
        ]
        self._held = [0] * self.allocator.num_slabs
        self._owned = 0
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
        offsets = self.alloc_many(block_bytes, 1, domain)
        return offsets[0] if offsets else None

    def alloc_many(self, block_bytes: int, n: int, domain: int = 0) -> list[int]:
        """Up to ``n`` slots (``alloc`` of each, as one batch); fewer when no more are free."""
        offsets = self.allocator.allocate_many(block_bytes, n, domain)
        self.used_bytes += len(offsets) * block_bytes
        return offsets

    def unalloc(self, offset: int, block_bytes: int) -> None:
        """Give back a slot from ``alloc`` that no entry took."""
        self.allocator.free(offset, block_bytes)
        self.used_bytes -= block_bytes

    def _slab(self, offset: int) -> int:
        """The slab of slot ``offset``, laid out for its class. AssertionError if ``offset`` is
        outside the slabs, or in a slab no class holds (no slot of it was handed out)."""
        s = (offset - HEADER_BYTES) // self._slab_bytes
        if offset < HEADER_BYTES or s >= len(self._slabs):
            raise AssertionError(f"offset {offset} is outside the arena's slabs")
        if not self._held[s]:
            self._lay_out(s)
        return s

    def _lay_out(self, s: int) -> None:
        """Lay slab ``s``'s array out for its current class. Only while none of its slots holds
        an entry: a slab changes class only once emptied (back to the pool, or drained)."""
        info = self.allocator.slab_info(s)
        if not info.slot_bytes:
            raise AssertionError(f"slab {s} belongs to no size class: no slot of it is handed out")
        owners, slot, base = self._slabs[s]
        if info.slot_bytes != slot or len(owners) != info.slots:
            self._slabs[s] = (array("i", [-1]) * info.slots, info.slot_bytes, base)

    def place(self, eid: int, offset: int, block_bytes: int, clean: bool) -> None:
        """Entry ``eid``'s copy is in slot ``offset`` (from ``alloc``)."""
        s = self._slab(offset)
        owners, slot, base = self._slabs[s]
        j, rest = divmod(offset - base, slot)
        if rest or j >= len(owners):
            raise AssertionError(f"offset {offset} is not a slot of its slab ({slot}-byte slots)")
        if owners[j] >= 0:
            raise AssertionError(f"slot {offset} already holds entry {owners[j]}")
        owners[j] = eid
        self._held[s] += 1
        self._owned += 1
        if clean:
            self.clean_bytes += block_bytes

    def place_dirty(self, eids: list[int], offsets: list[int]) -> None:
        """``place`` of each ``eids[j]`` in ``offsets[j]``, none with a disk copy yet. Nothing
        is placed if any slot is taken or named twice."""
        if len(eids) != len(offsets):
            raise ValueError(f"{len(eids)} entries for {len(offsets)} slots")
        slabs, held, slab_bytes = self._slabs, self._held, self._slab_bytes
        last, owners, slot, base = -1, _NO_OWNERS, SLOT_ALIGN, 0
        for i, (eid, offset) in enumerate(zip(eids, offsets, strict=True)):
            if last < 0 or not base <= offset < base + slab_bytes:  # another slab
                try:
                    last = self._slab(offset)
                except AssertionError:
                    self._unplace(offsets[:i])
                    raise
                owners, slot, base = slabs[last]
            j, rest = divmod(offset - base, slot)
            if rest or j >= len(owners) or owners[j] >= 0:
                self._unplace(offsets[:i])
                if rest or j >= len(owners):
                    raise AssertionError(
                        f"offset {offset} is not a slot of its slab ({slot}-byte slots)"
                    )
                if offset in offsets[:i]:
                    raise AssertionError(f"slot {offset} named twice in one placement")
                raise AssertionError(f"slot {offset} already holds entry {owners[j]}")
            owners[j] = eid
            held[last] += 1
        self._owned += len(eids)

    def _unplace(self, placed: list[int]) -> None:
        """Undo a ``place_dirty`` that placed ``placed`` (all free before it) and then failed."""
        self._take_many(placed)
        self._owned += len(placed)

    def _take(self, offset: int) -> None:
        """The entry in slot ``offset`` leaves it; KeyError if none is there."""
        self._take_many((offset,))

    def _take_many(self, offsets: Iterable[int]) -> None:
        """``_take`` of each of ``offsets`` in order (an eviction's batch); one with no entry
        raises KeyError with those before it taken."""
        slabs, held, slab_bytes = self._slabs, self._held, self._slab_bytes
        for offset in offsets:
            s = (offset - HEADER_BYTES) // slab_bytes
            if offset < HEADER_BYTES or s >= len(slabs):
                raise KeyError(offset)
            owners, slot, base = slabs[s]
            j, rest = divmod(offset - base, slot)
            if rest or j >= len(owners) or owners[j] < 0:
                raise KeyError(offset)
            owners[j] = -1
            held[s] -= 1
            self._owned -= 1

    def vacate(self, offset: int, block_bytes: int, clean: bool) -> None:
        """The copy in ``offset`` goes: the slot is free again."""
        self._take(offset)
        if clean:
            self.clean_bytes -= block_bytes
        self.unalloc(offset, block_bytes)

    def vacate_many(self, offsets: list[int], block_bytes: int) -> None:
        """``vacate`` of each of ``offsets`` (copies with no disk copy, of one block size), as
        one batch: an eviction's."""
        self._take_many(offsets)
        self.allocator.free_many(offsets, block_bytes)
        self.used_bytes -= len(offsets) * block_bytes

    def quarantine(self, offset: int, block_bytes: int) -> None:
        """Take a slot from its entry without freeing it (``release_quarantined`` later)."""
        self._take(offset)
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
        s = (offset - HEADER_BYTES) // self._slab_bytes
        if offset < HEADER_BYTES or s >= len(self._slabs):
            return None
        owners, slot, base = self._slabs[s]
        j, rest = divmod(offset - base, slot)
        if rest or j >= len(owners):
            return None
        eid = owners[j]
        return eid if eid >= 0 else None

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
        self._take(old)
        allocator.free(old, block_bytes)
        self.place(eid, new, block_bytes, clean=False)
        return new

    # ----------------------------------------------------------------- reports
    @property
    def capacity_bytes(self) -> int:
        return self.allocator.capacity_bytes

    def owned(self) -> int:
        """Slots that hold an entry. O(1)."""
        return self._owned

    def owner_bytes(self) -> int:
        """Bytes of the per-slab owner arrays (what ``owner`` costs in memory)."""
        return sum(owners.buffer_info()[1] * owners.itemsize for owners, _, _ in self._slabs)

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
