"""Slot allocation inside the slab file: size classes carved from slabs (the CPU tier's idea,
with a slab map that the tier persists and rebuilds at recovery). A slab's first page is its
descriptor; its slots follow."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.tiers.nvme.ondisk import PAGE, Geometry


@dataclass
class _SizeClass:
    slot_bytes: int
    free: list[int] = field(default_factory=list)
    next: int = 0  # bump pointer into the slab this class is carving
    end: int = 0


class SlotAllocator:
    """Which slab is carved into which slot size, and each size class's free slots.

    A class takes a whole uncarved slab when it runs out and carves it lazily (a bump pointer, so
    ``allocate`` is O(1)); a slab stays with its class. ``version`` counts carvings: the tier
    persists the slab map before a record in a newly carved slab may commit, because recovery
    finds headers only where the map says slots are. Every slot of a carved slab has an
    ordinal in ``[0, ordinals)``, dense, for per-slot arrays. Owned by the event loop; not
    thread-safe.
    """

    def __init__(self, geo: Geometry) -> None:
        self._geo = geo
        self.slab_slot_bytes = [0] * len(geo.slab_sizes)
        # A stack with the lowest slab on top; the short last slab, if any, sits at the bottom.
        self._free_slabs = list(range(len(geo.slab_sizes) - 1, -1, -1))
        self._classes: dict[int, _SizeClass] = {}
        self._first = [-1] * len(geo.slab_sizes)  # ordinal of each carved slab's first slot
        self.ordinals = 0
        self.version = 0

    def _class(self, slot_bytes: int) -> _SizeClass:
        cls = self._classes.get(slot_bytes)
        if cls is None:
            cls = self._classes[slot_bytes] = _SizeClass(slot_bytes)
        return cls

    def allocate(self, slot_bytes: int) -> int | None:
        cls = self._class(slot_bytes)
        if cls.free:
            return cls.free.pop()
        if cls.next + slot_bytes > cls.end:
            if not self._free_slabs:
                return None
            slab = self._free_slabs[-1]
            count = self._geo.slot_count(slab, slot_bytes)
            if count == 0:  # only the short tail slab is left and this class won't fit
                return None
            self._free_slabs.pop()
            self._carve(slab, slot_bytes)
            self.version += 1
            cls.next = self._geo.slab_start(slab) + PAGE
            cls.end = cls.next + count * slot_bytes
        slot = cls.next
        cls.next += slot_bytes
        return slot

    def _carve(self, slab: int, slot_bytes: int) -> None:
        self.slab_slot_bytes[slab] = slot_bytes
        self._first[slab] = self.ordinals
        self.ordinals += self._geo.slot_count(slab, slot_bytes)

    def ordinal(self, slot: int) -> int:
        """The dense index of ``slot``; ValueError if it is not a slot of a carved slab."""
        slab = self._geo.slab_of(slot)
        if 0 <= slab < len(self._first) and self._first[slab] >= 0:
            slot_bytes = self.slab_slot_bytes[slab]
            index, rest = divmod(slot - self._geo.slab_start(slab) - PAGE, slot_bytes)
            if rest == 0 and 0 <= index < self._geo.slot_count(slab, slot_bytes):
                return self._first[slab] + index
        raise ValueError(f"{slot} is not a slot of this tier")

    def release(self, slot: int) -> None:
        self._classes[self.slot_bytes_at(slot)].free.append(slot)

    def slot_bytes_at(self, slot: int) -> int:
        return self.slab_slot_bytes[self._geo.slab_of(slot)]

    def slots(self, slab: int) -> range:
        start, slot_bytes = self._geo.slab_start(slab) + PAGE, self.slab_slot_bytes[slab]
        return range(start, start + self._geo.slot_count(slab, slot_bytes) * slot_bytes, slot_bytes)

    def carved(self) -> list[int]:
        return [i for i, sb in enumerate(self.slab_slot_bytes) if sb]

    @classmethod
    def restore(cls, geo: Geometry, slab_slot_bytes: list[int], live: set[int]) -> SlotAllocator:
        """Rebuilt from a recovered slab map: every slot of a carved slab not in ``live`` is
        free."""
        alloc = cls(geo)
        for slab, slot_bytes in enumerate(slab_slot_bytes):
            if slot_bytes:
                alloc._carve(slab, slot_bytes)
        alloc._free_slabs = [i for i in alloc._free_slabs if not slab_slot_bytes[i]]
        for slab in reversed(alloc.carved()):
            sc = alloc._class(slab_slot_bytes[slab])
            sc.free.extend(s for s in reversed(alloc.slots(slab)) if s not in live)
        return alloc
