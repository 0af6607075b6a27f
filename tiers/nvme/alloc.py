"""Slot allocation inside the slab file: size classes carved from slabs (the CPU tier's idea,
with a slab map that the tier persists and rebuilds at recovery). A slab's first page is its
descriptor; its slots follow. A slab whose slots are all free goes back to the pool of uncarved
slabs, so any mix of block sizes shares the file."""

from __future__ import annotations

import heapq

from kvstore.tiers.nvme.ondisk import PAGE, Geometry


class SlotAllocator:
    """Which slab is carved into which slot size, and which slots are free.

    A slab is either in the pool (uncarved) or carved into slots of one size. A size class
    takes the lowest-numbered slab of the pool when none of its slabs has a free slot, and hands
    out the slots of a fresh slab lazily (a bump pointer, so ``allocate`` is O(log slabs)).
    Allocation prefers the lowest-numbered slab with room, so the higher slabs of a class drain
    first. ``release`` of a slab's last used slot leaves it empty: the tier then calls
    ``uncarve`` (which it may only do once no IO of the old carving is left in flight) and the
    slab goes back to the pool for any size. ``version`` counts carvings and uncarvings: the
    tier persists the carving before a record in a newly carved slab may commit, because
    recovery finds headers only where a slab says its slots are. Owned by the event loop; not
    thread-safe.

    Invariants (asserted where they are maintained): ``used[s]`` is the number of slots of slab
    ``s`` handed out and not released; a slab in the pool has ``used == 0`` and no slot size.
    """

    def __init__(self, geo: Geometry) -> None:
        n = len(geo.slab_sizes)
        self._geo = geo
        self.slab_slot_bytes = [0] * n
        self.used = [0] * n
        self._count = [0] * n  # slots of each carved slab
        self._bump = [0] * n  # slots of the carving handed out at least once: a prefix
        self._free: list[list[int]] = [[] for _ in range(n)]  # released, below the bump
        self._pool = list(range(n))  # uncarved slabs: a min-heap
        # Per slot size, a min-heap of its slabs that may have room; ``_listed[s]`` says which
        # heap lists ``s`` (0: none), and entries whose slab has moved on are dropped lazily.
        self._room: dict[int, list[int]] = {}
        self._listed = [0] * n
        self.version = 0

    def allocate(self, slot_bytes: int) -> int | None:
        """A free slot of ``slot_bytes``, or None when no slab of that size has room and no
        uncarved slab can take the size."""
        heap = self._room.setdefault(slot_bytes, [])
        while heap:
            slab = heap[0]
            if self._listed[slab] == slot_bytes and self.slab_slot_bytes[slab] == slot_bytes:
                if self._free[slab] or self._bump[slab] < self._count[slab]:
                    return self._take(slab)
                self._listed[slab] = 0
            heapq.heappop(heap)
        if not self._pool or self._geo.slot_count(self._pool[0], slot_bytes) == 0:
            return None  # no slab left, or only the short tail slab and the size won't fit
        slab = heapq.heappop(self._pool)
        self._carve(slab, slot_bytes)
        self.version += 1
        self._list(slab)
        return self._take(slab)

    def _take(self, slab: int) -> int:
        self.used[slab] += 1
        if self._free[slab]:
            return self._free[slab].pop()
        index, self._bump[slab] = self._bump[slab], self._bump[slab] + 1
        return self._geo.slab_start(slab) + PAGE + index * self.slab_slot_bytes[slab]

    def _carve(self, slab: int, slot_bytes: int) -> None:
        assert self.used[slab] == 0 and not self.slab_slot_bytes[slab], f"slab {slab} is carved"
        self.slab_slot_bytes[slab] = slot_bytes
        self._count[slab] = self._geo.slot_count(slab, slot_bytes)
        self._bump[slab] = 0
        self._free[slab] = []

    def _list(self, slab: int) -> None:
        slot_bytes = self.slab_slot_bytes[slab]
        if self._listed[slab] != slot_bytes:
            self._listed[slab] = slot_bytes
            heapq.heappush(self._room.setdefault(slot_bytes, []), slab)

    def release(self, slot: int) -> bool:
        """Give a slot back; True if that left its slab with no slot in use."""
        slab, _ = self.locate(slot)
        assert self.used[slab] > 0, f"allocator out of sync: slot {slot} released twice"
        self.used[slab] -= 1
        self._free[slab].append(slot)
        self._list(slab)
        return self.used[slab] == 0

    def uncarve(self, slab: int) -> None:
        """Return an empty carved slab to the pool."""
        assert self.slab_slot_bytes[slab] and self.used[slab] == 0, f"slab {slab} is in use"
        self.slab_slot_bytes[slab] = self._count[slab] = self._bump[slab] = 0
        self._free[slab] = []
        self._listed[slab] = 0
        heapq.heappush(self._pool, slab)
        self.version += 1

    def locate(self, slot: int) -> tuple[int, int]:
        """(slab, index of the slot in it); ValueError if ``slot`` is not a slot of a carved
        slab."""
        slab = self._geo.slab_of(slot)
        if 0 <= slab < len(self.slab_slot_bytes) and self.slab_slot_bytes[slab]:
            index, rest = divmod(
                slot - self._geo.slab_start(slab) - PAGE, self.slab_slot_bytes[slab]
            )
            if rest == 0 and 0 <= index < self._count[slab]:
                return slab, index
        raise ValueError(f"{slot} is not a slot of this tier")

    def slot_bytes_at(self, slot: int) -> int:
        return self.slab_slot_bytes[self._geo.slab_of(slot)]

    def slot_count(self, slab: int) -> int:
        return self._count[slab]

    def slots(self, slab: int) -> range:
        start, slot_bytes = self._geo.slab_start(slab) + PAGE, self.slab_slot_bytes[slab]
        return range(start, start + self._count[slab] * slot_bytes, slot_bytes)

    def carved(self) -> list[int]:
        return [i for i, sb in enumerate(self.slab_slot_bytes) if sb]

    @classmethod
    def restore(cls, geo: Geometry, slab_slot_bytes: list[int], live: set[int]) -> SlotAllocator:
        """Rebuilt from a recovered slab map: every slot of a carved slab not in ``live`` is
        free. Slabs left empty stay carved: the tier uncarves them (its tombstones first)."""
        alloc = cls(geo)
        carved = [slab for slab, slot_bytes in enumerate(slab_slot_bytes) if slot_bytes]
        for slab in carved:
            alloc._carve(slab, slab_slot_bytes[slab])
            alloc._bump[slab] = alloc._count[slab]
            # Reversed, so the lowest free slot is handed out first.
            alloc._free[slab] = [s for s in reversed(alloc.slots(slab)) if s not in live]
            alloc.used[slab] = alloc._count[slab] - len(alloc._free[slab])
            alloc._list(slab)
        alloc._pool = [slab for slab in range(len(slab_slot_bytes)) if not slab_slot_bytes[slab]]
        heapq.heapify(alloc._pool)
        return alloc
