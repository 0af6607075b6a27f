"""The CPU tier's mechanism: a shared-memory arena of fixed-size slots.

The arena is one range of the daemon's address space carved into equal slabs (the last may be
shorter); each slab is its own unnamed shared-memory file, handed to same-host clients of its
tenant as a descriptor, and holds slots of one size, so layouts of different block sizes share
one arena. Clients copy blocks straight into and out of slots: a block crosses memory once.

This module knows nothing of keys, leases or eviction policy: it hands out and takes back slot
offsets, and says which slots of a slab are in use. The daemon's store decides which block lives
in which slot and which one goes.

Two modules: the memory itself (``SharedMemoryArena``, its slab files and their backing) is
``kvstore.tiers.cpu_arena``, re-exported here; this one holds the slot allocation
(``SlabAllocator``), which the GPU tier's pool uses too.

Backing (never SIGBUS). A page of a shared-memory file that cannot be backed kills whoever
touches it first with SIGBUS: a client, then the daemon. So no slot is handed out in memory
that is not backed: the allocator has each slab backed (``SharedMemoryArena.back``: a file
allocated with ``posix_fallocate``) before a class takes it, all of them at start-up with
``prefault``, and a slab that cannot be backed is set aside and never used until
``retry_backing``.

Mixed block sizes (what was chosen, and why). A slab whose last used slot is freed goes back to
a pool of unassigned slabs that any size class can take, as jemalloc and the kernel's SLUB
return empty slabs. A class allocates from its lowest-addressed slab that has a free slot, and
takes a new slab only when none has: address-ordered first fit keeps live slots packed into few
slabs (with best fit, the least fragmenting policy in Johnstone and Wilson's measurements;
jemalloc likewise takes the oldest, lowest-addressed of its non-full slabs), so the highest
slabs of a shrinking class empty on their own. That cannot bound fragmentation alone: one live
slot pins a whole slab, and only moving or evicting blocks frees it. memcached solves this with
a page mover (``slab_reassign``): a policy (``slab_automove``) picks a source class, either one
with more than 2.5 pages' worth of free chunks or the one whose items are oldest while another
class evicts young items; the mover stops handing out the chosen page's free chunks, then
rescues (copies into free chunks elsewhere in the class) or evicts each item of the page and
hands the empty page over. The same split is kept here: ``begin_drain(slab)`` is the mover's
first step (the slab's free slots stop being handed out and stop being counted),
``used_offsets(slab)`` says which blocks must be moved or evicted, and the slab returns to the
pool by itself when its last slot is freed; ``end_drain`` gives up. Which slab to drain and when
is the daemon's policy, as the daemon's eviction policy knows which blocks are cold and which
leased (memcached's retry of busy items).

Slab size. One size for all slabs keeps reassignment trivial (any slab fits any class), so the
size is a compromise: big slabs waste less to the tail a slot does not fill (under one slot per
slab, so under ``slot/slab`` of the capacity) and accept bigger blocks (``check_fits``); small
slabs let more classes share a small arena and make a drain cheaper. The configured size is an
upper bound: slabs are at most ``capacity / 16`` (so from 256 MiB up at least 16 classes can
hold memory at once), but not under ``min_slab_bytes`` (16 MiB by default), because the
largest block is not known when the arena is made and shrinking slabs further would refuse blocks
that the configured size accepts (a bf16 16-token block is 2 MiB for an 8B GQA model, 5 MiB for
70B, 12.5 MiB for a 13B model without GQA). A 64 MiB tier thus gets four 16 MiB slabs, a 256 MiB
tier sixteen; from 1 GiB up the 64 MiB default holds.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvstore.tiers.cpu_arena import (
    HEADER_BYTES,
    MEMORY_RESERVE_BYTES,
    SHMEM_THP_SETTING,
    SLOT_ALIGN,
    TOKEN_BYTES,
    SharedMemoryArena,
    SlabFile,
    huge_pages_on_advice,
    populate_huge,
    round_up,
    shmem_thp_mode,
)

__all__ = [
    "HEADER_BYTES",
    "MEMORY_RESERVE_BYTES",
    "MIN_SLABS",
    "MIN_SLAB_BYTES",
    "SHMEM_THP_SETTING",
    "SLOT_ALIGN",
    "TOKEN_BYTES",
    "SharedMemoryArena",
    "SlabAllocator",
    "SlabFile",
    "SlabInfo",
    "huge_pages_on_advice",
    "populate_huge",
    "shmem_thp_mode",
]

MIN_SLABS = 16
"""Slabs are at most ``capacity / MIN_SLABS`` (but see ``MIN_SLAB_BYTES``)."""
MIN_SLAB_BYTES = 16 << 20
"""The capacity/16 rule never shrinks slabs below this (nor above the configured size)."""


class _State(enum.Enum):
    POOL = "unassigned, backed"
    UNTRIED = "unassigned, never backed"
    UNBACKABLE = "unassigned, backing failed"
    CLASS = "assigned to a size class"


@dataclass(frozen=True)
class SlabInfo:
    """One slab as ``SlabAllocator.slab_info`` reports it."""

    index: int
    base: int
    """Arena offset of its first byte."""
    size_bytes: int
    slot_bytes: int
    """Its class's slot size; 0 when the slab is unassigned."""
    domain: int
    """Its class's memory domain (0 when unassigned or undivided)."""
    slots: int
    """Slots it holds for its class (0 when unassigned); the tail past them is waste."""
    used: int
    draining: bool
    backed: bool
    backing_failed: bool


class _Slab:
    """A slab's bookkeeping; only ``SlabAllocator`` touches it.

    Slots ``[0, fresh)`` have been handed out since the slab was assigned: each is either used
    (``used_map[i] == 1``) or on the ``freed`` stack, never both; slots ``[fresh, slots)`` are
    free and were never handed out, so assigning a slab costs O(1) whatever its slot count.
    """

    __slots__ = (
        "base", "domain", "draining", "freed", "fresh", "index", "size", "slot_bytes", "slots",
        "state", "used", "used_map",
    )  # fmt: skip

    def __init__(self, index: int, base: int, size: int, state: _State) -> None:
        self.index, self.base, self.size, self.state = index, base, size, state
        self._reset()

    def _reset(self) -> None:
        self.slot_bytes = 0
        self.domain = 0
        self.slots = 0
        self.fresh = 0
        self.freed: list[int] = []
        self.used_map = bytearray()
        self.used = 0
        self.draining = False


class _SizeClass:
    """The slabs of one slot size. ``partial`` is a heap of exactly the class's slabs that are
    not draining and have a free slot (lowest index first); ``free`` counts those slabs' free
    slots; ``used`` counts used slots in all its slabs; ``slabs`` is never empty (a class whose
    last slab goes back to the pool is dropped)."""

    __slots__ = ("domain", "free", "partial", "slabs", "slot_bytes", "used")

    def __init__(self, slot_bytes: int, domain: int) -> None:
        self.slot_bytes = slot_bytes
        self.domain = domain
        self.slabs: set[int] = set()
        self.partial: list[int] = []
        self.free = 0
        self.used = 0


class SlabAllocator:
    """Hands out slot offsets inside ``[HEADER_BYTES, arena_bytes)``.

    The usable region is cut into slabs of ``slab_bytes`` (the last may be shorter); slab ``i``
    starts at ``HEADER_BYTES + i * slab_bytes``. A size class (slot size: block size rounded up
    to a page) allocates from its lowest-indexed slab with a free slot and takes a new slab from
    the pool only when it has none; a slab whose slots are all free goes back to the pool at
    once, so any class can take it. ``allocate`` returns None when the class has no free slot
    and no unassigned slab fits (or the one slab tried could not be backed): the caller then
    evicts a block of the same class, or drains a slab of another class (``begin_drain``,
    ``used_offsets``) to free a whole slab.

    ``reserve_backing(offset, nbytes)``, when given, must allocate the memory of a range or raise
    OSError (``SharedMemoryArena.reserve_backing``): slab 0 is backed at construction (so an
    arena that cannot hold even one slab refuses to start) and every other slab the first time a
    class takes it; without it (the GPU pool) all memory counts as backed.

    Invariants (``check`` verifies them all, raising AssertionError):
    - every slab is in exactly one state: in the pool (backed, unassigned), untried (never
      backed), unbackable (its backing failed) or assigned to exactly one class;
    - an assigned slab has at least one used slot, and its slots lie inside it; a slot is used
      or free, never both, and slots never overlap (slabs tile the usable region);
    - ``free_slots`` and the counters it reads (per-class free slots, pooled full-size slabs,
      whether the short tail slab is pooled) agree with the slabs themselves;
    - a draining slab is never allocated from and its free slots are not counted as free.

    Owned by the daemon's event loop; not thread-safe. Every method is O(1) or O(log slabs)
    except ``used_offsets`` (O(slots of the slab)), ``begin_drain`` and freeing a slab's last
    slot (O(slabs of its class)), a first backing (a ``posix_fallocate`` of one slab, which
    blocks for milliseconds) and ``check`` (everything).
    """

    def __init__(
        self,
        arena_bytes: int,
        slab_bytes: int,
        *,
        back: Callable[[int, int, int], None] | None = None,
        min_slab_bytes: int = MIN_SLAB_BYTES,
        prefault: bool = False,
    ) -> None:
        usable = (arena_bytes - HEADER_BYTES) // SLOT_ALIGN * SLOT_ALIGN
        if usable <= 0:
            raise ValueError(f"arena of {arena_bytes} bytes has no room for a slab")
        if slab_bytes <= 0:
            raise ValueError(f"slab size must be positive, got {slab_bytes}")
        self._min_slab_bytes = min_slab_bytes
        adaptive = max(usable // MIN_SLABS, min_slab_bytes, SLOT_ALIGN)
        self.slab_bytes = min(
            round_up(slab_bytes, SLOT_ALIGN), usable, adaptive // SLOT_ALIGN * SLOT_ALIGN
        )
        sizes = [self.slab_bytes] * (usable // self.slab_bytes)
        if usable % self.slab_bytes:
            sizes.append(usable % self.slab_bytes)
        self._capacity = usable
        self._tail = len(sizes) - 1 if sizes[-1] < self.slab_bytes else -1
        self._back = back
        state = _State.UNTRIED if back is not None else _State.POOL
        self._slabs = [
            _Slab(i, HEADER_BYTES + i * self.slab_bytes, size, state)
            for i, size in enumerate(sizes)
        ]
        self._classes: dict[tuple[int, int], _SizeClass] = {}  # (slot bytes, domain) -> class
        # Unassigned slabs, lowest index first: backed ones, then ones never backed.
        self._pool: list[int] = list(range(len(sizes))) if back is None else []
        self._untried: list[int] = list(range(len(sizes))) if back is not None else []
        self._unbackable: list[int] = []
        self._pooled_full = len(sizes) - (self._tail >= 0)  # full-size slabs in both heaps
        self._tail_pooled = self._tail >= 0
        self.backing_error: str | None = None
        """Why the last slab that could not be backed was not (None if none failed)."""
        if back is not None:
            # Slab 0 (every slab with ``prefault``) is backed now, in domain 0: OSError here
            # means the daemon cannot start.
            for s in self._slabs if prefault else self._slabs[:1]:
                back(s.base, s.size, 0)
                _heap_remove(self._untried, s.index)
                s.state = _State.POOL
                heapq.heappush(self._pool, s.index)

    # ----------------------------------------------------------------- sizes
    @property
    def num_slabs(self) -> int:
        return len(self._slabs)

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def unassigned_slabs(self) -> int:
        """Slabs no class holds that a class may still take (backed or not yet tried)."""
        return len(self._pool) + len(self._untried)

    @property
    def unbackable_slabs(self) -> int:
        """Slabs set aside because their memory could not be backed (see ``retry_backing``)."""
        return len(self._unbackable)

    @staticmethod
    def slot_bytes_for(block_bytes: int) -> int:
        return round_up(block_bytes, SLOT_ALIGN)

    def check_fits(self, block_bytes: int) -> None:
        """Raise ValueError unless a block of this size fits in one slab."""
        if self.slot_bytes_for(block_bytes) > self.slab_bytes:
            raise ValueError(
                f"a {block_bytes}-byte block does not fit a {self.slab_bytes}-byte slab "
                f"(slabs are at most the configured size, and at most capacity/{MIN_SLABS} "
                f"unless that is under {self._min_slab_bytes} bytes); raise the cpu slab size "
                "(and capacity)"
            )

    def slots_per_slab(self, block_bytes: int) -> int:
        return self.slab_bytes // self.slot_bytes_for(block_bytes)

    def free_slots(self, block_bytes: int, domain: int = 0) -> int:
        """Slots a class could still hand out without eviction: its own free slots (draining
        slabs' excluded) plus those of every unassigned slab it fits. O(1)."""
        slot = (block_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN  # slot_bytes_for
        if slot > self.slab_bytes:
            return 0
        cls = self._classes.get((slot, domain))
        n = (cls.free if cls is not None else 0) + self._pooled_full * (self.slab_bytes // slot)
        if self._tail_pooled:
            n += self._slabs[self._tail].size // slot
        return n

    def class_free_slots(self, block_bytes: int, domain: int = 0) -> int:
        """Free slots in the slabs this class already holds (draining slabs' excluded), not
        counting unassigned slabs: what a block can move into without taking a slab. O(1)."""
        cls = self._classes.get((self.slot_bytes_for(block_bytes), domain))
        return cls.free if cls is not None else 0

    # ----------------------------------------------------------------- slots
    def allocate(self, block_bytes: int, domain: int = 0) -> int | None:
        """A free slot's offset in a slab of ``domain`` (a tenant's memory: slabs are never
        shared between domains), or None (see the class docstring). ValueError if the block
        cannot fit a slab at all."""
        offsets = self.allocate_many(block_bytes, 1, domain)
        return offsets[0] if offsets else None

    def allocate_many(self, block_bytes: int, n: int, domain: int = 0) -> list[int]:
        """Up to ``n`` slots, as ``n`` calls of ``allocate`` would give them, in that order;
        fewer when no more can be had (a slab could not be backed). A batch's slots mostly
        come from one slab: each is taken there with no call of its own (an eviction's room
        is made a batch at a time). ValueError if the block cannot fit a slab at all."""
        slot = (block_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN  # slot_bytes_for
        if slot > self.slab_bytes:
            self.check_fits(block_bytes)  # raises, naming the sizes
        out: list[int] = []
        while len(out) < n:
            cls = self._class_with_room(slot, domain)
            if cls is None:
                break
            s = self._slabs[cls.partial[0]]
            k = min(n - len(out), s.slots - s.used)
            base, used_map, freed = s.base, s.used_map, s.freed
            for _ in range(k):
                if freed:
                    i = freed.pop()
                else:
                    i = s.fresh
                    s.fresh += 1
                used_map[i] = 1
                out.append(base + i * slot)
            s.used += k
            cls.used += k
            cls.free -= k
            if s.used == s.slots:
                heapq.heappop(cls.partial)
        return out

    def _class_with_room(self, slot: int, domain: int) -> _SizeClass | None:
        """The size class of ``slot`` in ``domain`` with a slab that has a free slot at the top
        of its ``partial`` heap, taking an unassigned slab for it when it has none; None when
        none can be had."""
        cls = self._classes.get((slot, domain))
        if cls is not None and cls.partial:
            return cls
        s = self._take_unassigned(slot, domain)
        if s is None:
            return None
        if cls is None:
            cls = self._classes[(slot, domain)] = _SizeClass(slot, domain)
        s.state, s.slot_bytes, s.slots = _State.CLASS, slot, s.size // slot
        s.domain = domain
        s.used_map = bytearray(s.slots)
        cls.slabs.add(s.index)
        cls.free += s.slots
        heapq.heappush(cls.partial, s.index)
        return cls

    def _take_unassigned(self, slot: int, domain: int) -> _Slab | None:
        """Take the lowest fitting unassigned slab, backed ones first; back it if it never was.
        (The short tail has the highest index, so it is at a heap's top only when alone.)"""
        for heap in (self._pool, self._untried):
            if heap and self._slabs[heap[0]].size >= slot:
                s = self._slabs[heapq.heappop(heap)]
                if s.index == self._tail:
                    self._tail_pooled = False
                else:
                    self._pooled_full -= 1
                if self._back is not None:
                    # Backs a slab never backed, and gives one that served another domain
                    # fresh memory (a no-op for a slab already backed in this domain).
                    try:
                        self._back(s.base, s.size, domain)
                    except OSError as e:
                        self.backing_error = str(e)
                        self._set_aside(s)
                        return None
                return s
        return None

    def _set_aside(self, s: _Slab) -> None:
        """``s`` could not be backed: set it aside, and with it every other never-backed slab
        at least as large (the filesystem had less room than one of them), so that
        ``free_slots`` stops counting them at once and the caller evicts instead."""
        failed = [s]
        if s.index != self._tail:
            failed += [self._slabs[i] for i in self._untried if i != self._tail]
            self._pooled_full -= len(failed) - 1
            self._untried = [i for i in self._untried if i == self._tail]
        for f in failed:
            f.state = _State.UNBACKABLE
            self._unbackable.append(f.index)

    def free(self, offset: int, block_bytes: int) -> None:
        """Take back a slot from ``allocate``. AssertionError if it is not a used slot of this
        block size's class (a double free, a wrong size, an offset never handed out)."""
        self.free_many((offset,), block_bytes)

    def free_many(self, offsets: Iterable[int], block_bytes: int) -> None:
        """``free`` of each of ``offsets``, slots of one block size, in order (an eviction
        frees a batch: the size's slot and the lookups are made once). A bad offset raises
        with those before it freed."""
        slot = self.slot_bytes_for(block_bytes)
        slabs, classes, slab_index = self._slabs, self._classes, self._slab_index
        for offset in offsets:
            s = slabs[slab_index(offset, AssertionError)]
            i, rest = divmod(offset - s.base, slot) if s.slot_bytes == slot else (0, 1)
            if rest or i >= s.slots or not s.used_map[i]:
                raise AssertionError(
                    f"free of slot {offset} ({block_bytes}-byte block), which is not in use "
                    f"(its slab holds {s.slot_bytes or 'no'}-byte slots)"
                )
            cls = classes[(slot, s.domain)]
            had_free = s.used < s.slots
            s.used_map[i] = 0
            s.freed.append(i)
            s.used -= 1
            cls.used -= 1
            if s.draining:
                if s.used == 0:
                    self._release(s, cls)
                continue
            cls.free += 1
            if s.used == 0:
                cls.free -= s.slots
                if had_free:
                    _heap_remove(cls.partial, s.index)
                self._release(s, cls)
            elif not had_free:
                heapq.heappush(cls.partial, s.index)

    def _release(self, s: _Slab, cls: _SizeClass) -> None:
        """An empty slab (already out of ``cls.partial`` and ``cls.free``) goes to the pool."""
        cls.slabs.discard(s.index)
        if not cls.slabs:
            del self._classes[(cls.slot_bytes, cls.domain)]
        s._reset()
        s.state = _State.POOL
        heapq.heappush(self._pool, s.index)
        if s.index == self._tail:
            self._tail_pooled = True
        else:
            self._pooled_full += 1

    def retry_backing(self) -> int:
        """Offer the slabs whose backing failed again (after space was freed in the arena's
        directory); returns how many. The next allocations that need a slab retry them."""
        for i in self._unbackable:
            self._slabs[i].state = _State.UNTRIED
            heapq.heappush(self._untried, i)
            if i == self._tail:
                self._tail_pooled = True
            else:
                self._pooled_full += 1
        n = len(self._unbackable)
        self._unbackable.clear()
        return n

    # ----------------------------------------------------------------- slabs, for the daemon
    def _slab_index(self, offset: int, error: type[Exception] = ValueError) -> int:
        if not HEADER_BYTES <= offset < HEADER_BYTES + self._capacity:
            raise error(f"offset {offset} is outside the arena's slabs")
        return (offset - HEADER_BYTES) // self.slab_bytes

    def slab_of(self, offset: int) -> int:
        """The index of the slab holding arena offset ``offset`` (ValueError if none does)."""
        return self._slab_index(offset)

    def slab_info(self, slab: int) -> SlabInfo:
        s = self._slabs[slab]
        return SlabInfo(
            index=s.index,
            base=s.base,
            size_bytes=s.size,
            slot_bytes=s.slot_bytes,
            domain=s.domain,
            slots=s.slots,
            used=s.used,
            draining=s.draining,
            backed=s.state in (_State.POOL, _State.CLASS),
            backing_failed=s.state is _State.UNBACKABLE,
        )

    def class_slabs(self, block_bytes: int, domain: int = 0) -> list[int]:
        """The slabs this block size's class holds, lowest index first."""
        cls = self._classes.get((self.slot_bytes_for(block_bytes), domain))
        return sorted(cls.slabs) if cls is not None else []

    def used_offsets(self, slab: int) -> list[int]:
        """Offsets of the slab's used slots, lowest first ([] if unassigned). O(slots)."""
        s = self._slabs[slab]
        out: list[int] = []
        i = s.used_map.find(1)
        while i >= 0:
            out.append(s.base + i * s.slot_bytes)
            i = s.used_map.find(1, i + 1)
        return out

    def begin_drain(self, slab: int) -> None:
        """Stop handing out the slab's free slots (they no longer count in ``free_slots``), so
        that freeing its used slots (``used_offsets``: the daemon evicts or moves those blocks)
        empties it; it then goes back to the pool by itself. ValueError if it is unassigned;
        a no-op if it already drains."""
        s = self._slabs[slab]
        if s.state is not _State.CLASS:
            raise ValueError(f"slab {slab} belongs to no class ({s.state.value}): nothing to drain")
        if s.draining:
            return
        cls = self._classes[(s.slot_bytes, s.domain)]
        s.draining = True
        if s.used < s.slots:
            cls.free -= s.slots - s.used
            _heap_remove(cls.partial, s.index)

    def end_drain(self, slab: int) -> bool:
        """Give up draining: the slab's free slots serve its class again. False (and nothing
        done) if it was not draining, e.g. because it emptied and went back to the pool."""
        s = self._slabs[slab]
        if not s.draining:
            return False
        s.draining = False
        if s.used < s.slots:
            cls = self._classes[(s.slot_bytes, s.domain)]
            cls.free += s.slots - s.used
            heapq.heappush(cls.partial, s.index)
        return True

    # ----------------------------------------------------------------- invariants
    def check(self) -> None:
        """Verify every invariant of the class docstring; AssertionError says which broke."""

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(f"slab allocator out of sync: {what}")

        n = len(self._slabs)
        need(sum(s.size for s in self._slabs) == self._capacity, "slabs do not tile the capacity")
        for s in self._slabs:
            need(s.base == HEADER_BYTES + s.index * self.slab_bytes, f"slab {s.index} misplaced")
            need(s.size == self.slab_bytes or s.index == self._tail, f"slab {s.index} short")
        where: dict[int, str] = {}
        for name, ids in (("pool", self._pool), ("untried", self._untried)):
            need(_is_heap(ids), f"{name} is not a heap")
        for name, ids, state in (
            ("pool", self._pool, _State.POOL),
            ("untried", self._untried, _State.UNTRIED),
            ("unbackable", self._unbackable, _State.UNBACKABLE),
        ):
            for i in ids:
                need(0 <= i < n and i not in where, f"slab {i} in {name} and {where.get(i)}")
                where[i] = name
                s = self._slabs[i]
                need(s.state is state, f"slab {i} in {name} but {s.state.value}")
                need(s.used == 0 and not s.draining and s.slot_bytes == 0, f"pooled slab {i} used")
        full = sum(1 for i in [*self._pool, *self._untried] if i != self._tail)
        need(full == self._pooled_full, f"{self._pooled_full} full slabs counted pooled, {full}")
        tail = self._tail >= 0 and self._tail in where and where[self._tail] != "unbackable"
        need(tail == self._tail_pooled, "pooled tail flag wrong")
        if self._back is None:
            need(not self._untried and not self._unbackable, "unbacked slabs without backing")
        for (slot, domain), cls in self._classes.items():
            need(cls.slot_bytes == slot and cls.domain == domain, f"class {slot} misfiled")
            need(bool(cls.slabs), f"class {slot} empty")
            need(_is_heap(cls.partial), f"class {slot}'s partial slabs are not a heap")
            partial, free, used = set(), 0, 0
            for i in cls.slabs:
                need(0 <= i < n and i not in where, f"slab {i} in class {slot} and {where.get(i)}")
                where[i] = f"class {slot}"
                s = self._slabs[i]
                need(s.state is _State.CLASS and s.slot_bytes == slot, f"slab {i} not of {slot}")
                need(s.domain == domain, f"slab {i} of domain {s.domain} in class {domain}")
                self._check_slots(s, need)
                used += s.used
                if not s.draining and s.used < s.slots:
                    partial.add(i)
                    free += s.slots - s.used
            need(sorted(cls.partial) == sorted(partial), f"class {slot} partial heap wrong")
            need(cls.free == free and cls.used == used, f"class {slot} counts wrong")
        for s in self._slabs:
            need(s.index in where, f"slab {s.index} ({s.state.value}) is nowhere")
        pooled = [self._slabs[i].size for i in [*self._pool, *self._untried]]
        for (slot, domain), cls in self._classes.items():
            free = cls.free + sum(size // slot for size in pooled)
            need(self.free_slots(slot, domain) == free, f"free_slots({slot}) is not {free}")

    @staticmethod
    def _check_slots(s: _Slab, need: Callable[[bool, str], None]) -> None:
        i = s.index
        need(1 <= s.slots == s.size // s.slot_bytes, f"slab {i} slot count wrong")
        need(s.slots * s.slot_bytes <= s.size, f"slab {i} slots overflow it")
        need(len(s.used_map) == s.slots and 0 <= s.fresh <= s.slots, f"slab {i} maps wrong")
        need(s.used >= 1 and s.used == s.used_map.count(1), f"slab {i} used count wrong")
        need(s.used_map.count(0) + s.used_map.count(1) == s.slots, f"slab {i} map not 0/1")
        freed = set(s.freed)
        need(len(freed) == len(s.freed), f"slab {i} has a slot freed twice")
        for j in freed:
            need(0 <= j < s.fresh and not s.used_map[j], f"slab {i} slot {j} free and used")
        need(not any(s.used_map[s.fresh :]), f"slab {i} uses a slot never handed out")
        need(s.used + len(freed) == s.fresh, f"slab {i} lost a slot")


def _heap_remove(heap: list[int], item: int) -> None:
    """Remove ``item`` from a heap: O(len). Used when a slab empties or starts draining."""
    heap.remove(item)
    heapq.heapify(heap)


def _is_heap(heap: list[int]) -> bool:
    return all(heap[(k - 1) // 2] <= heap[k] for k in range(1, len(heap)))
