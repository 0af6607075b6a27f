"""The CPU tier's arena and slab allocator, on real shared memory.

Slabs are unnamed sealed files (``memfd``), one per slab, in the daemon's one mapping.
"""

from __future__ import annotations

import errno
import itertools
import os
from collections.abc import Iterator

import pytest
from conftest import smaps_kib
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.tiers.cpu import (
    HEADER_BYTES,
    SLOT_ALIGN,
    SharedMemoryArena,
    SlabAllocator,
    huge_pages_on_advice,
    shmem_thp_mode,
)

KiB, MiB = 1 << 10, 1 << 20

# ----------------------------------------------------------------- 1. never SIGBUS


class FailingBacking:
    """The arena's backing, failing (as when the machine is out of memory) after ``budget``
    slabs: what the allocator does then is what the daemon does when memory runs out."""

    def __init__(self, arena: SharedMemoryArena, budget: int) -> None:
        self.arena, self.budget, self.calls = arena, budget, 0

    def __call__(self, base: int, size: int, domain: int) -> None:
        if self.arena.backs(base, domain):
            return
        if self.budget <= 0:
            raise OSError(errno.ENOMEM, f"cannot back a {size}-byte slab (test budget)")
        self.budget -= 1
        self.calls += 1
        self.arena.back(base, size, domain)


def test_a_slab_that_cannot_be_backed_is_set_aside_never_touched() -> None:
    """Memory for a slab is allocated before any slot in it is handed out; when it cannot be,
    the allocator says why, stops counting the slabs that were never backed (the daemon then
    evicts instead of failing again) and takes them once memory comes back. Every slot handed
    out is real memory, written end to end."""
    arena = SharedMemoryArena(HEADER_BYTES + 32 * MiB)
    try:
        backing = FailingBacking(arena, budget=4)
        alloc = SlabAllocator(arena.size_bytes, 1 * MiB, back=backing)
        arena.slab_bytes = alloc.slab_bytes
        slot = 256 * KiB
        offsets = []
        while (off := alloc.allocate(slot)) is not None:
            arena.view[off : off + slot] = bytes([len(offsets) % 251 + 1]) * slot
            offsets.append(off)
        alloc.check()
        assert len(offsets) == 4 * 4  # slab 0 at construction and three more, then a failure
        assert alloc.unbackable_slabs == 32 - 4 and alloc.free_slots(slot) == 0
        assert alloc.backing_error is not None and "cannot back" in alloc.backing_error
        assert all(
            arena.view[o : o + slot] == bytes([i % 251 + 1]) * slot for i, o in enumerate(offsets)
        )
        backing.budget = 3  # memory comes back
        assert alloc.retry_backing() == 32 - 4
        more = 0
        while (off := alloc.allocate(slot)) is not None:
            arena.view[off : off + slot] = b"\7" * slot
            more += 1
        alloc.check()
        assert more == 12
    finally:
        arena.close()


def test_a_slab_passing_to_another_domain_gets_fresh_sealed_memory() -> None:
    """Tenants never share memory: a slab emptied by one domain and taken by another gets a new
    file (a new uid), and the old file's pages are freed, so a client that still maps it reads
    zeros, not the new tenant's blocks. Descriptors are sealed (no truncation, which would
    SIGBUS the daemon) and read-only ones cannot be mapped writable."""
    import mmap

    arena = SharedMemoryArena(HEADER_BYTES + 4 * MiB)
    try:
        alloc = SlabAllocator(arena.size_bytes, 1 * MiB, back=arena.back)
        arena.slab_bytes = alloc.slab_bytes
        a = alloc.allocate(1 * MiB, domain=1)
        assert a is not None
        arena.view[a : a + 1 * MiB] = b"A" * MiB
        uid_a = arena.address(a) >> 32
        fd = arena.export(uid_a, writable=True)
        client = mmap.mmap(fd, 1 * MiB)
        with pytest.raises(OSError) as err:
            os.ftruncate(fd, 0)
        assert err.value.errno == errno.EPERM
        os.close(fd)
        assert client[:4] == b"AAAA"
        alloc.free(a, 1 * MiB)  # the slab empties and goes back to the pool
        b = alloc.allocate(1 * MiB, domain=2)
        assert b == a  # the same slab, now another tenant's
        arena.view[b : b + 1 * MiB] = b"B" * MiB
        uid_b = arena.address(b) >> 32
        assert uid_b != uid_a and arena.file(uid_a) is None
        assert client[: 1 * MiB] == bytes(1 * MiB)  # zeros: the old pages are gone
        with pytest.raises(KeyError):
            arena.export(uid_a, writable=False)
        ro = arena.export(uid_b, writable=False)
        with pytest.raises(PermissionError):
            mmap.mmap(ro, 1 * MiB, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        view = mmap.mmap(ro, 1 * MiB, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        assert view[:4] == b"BBBB"
        view.close()
        os.close(ro)
        client.close()
        # The same domain again: no new file, the slab keeps its memory.
        alloc.free(b, 1 * MiB)
        c = alloc.allocate(1 * MiB, domain=2)
        assert c == b and arena.address(c) >> 32 == uid_b
        alloc.check()
    finally:
        arena.close()


def test_the_addresses_of_a_batch_are_each_slots_address() -> None:
    """A reply names its slots in one pass (``addresses``): each is the slot's own ``address``
    (its slab file's uid and the offset in it), across slabs, and a missing slot (-1) or a GPU
    pool slot is passed on as it is."""
    arena = SharedMemoryArena(HEADER_BYTES + 4 * MiB)
    try:
        alloc = SlabAllocator(arena.size_bytes, 1 * MiB, back=arena.back)
        arena.slab_bytes = alloc.slab_bytes
        slots = [alloc.allocate(256 * KiB, domain=0) for _ in range(9)]  # three slabs
        assert all(s is not None for s in slots)
        offsets = [s for s in slots if s is not None]
        assert len({arena.address(o) >> 32 for o in offsets}) == 3
        assert arena.addresses(offsets) == [arena.address(o) for o in offsets]
        mixed = [offsets[0], -1, 4096, offsets[5]]
        on_gpu = [False, False, True, False]
        assert arena.addresses(mixed, on_gpu) == [
            arena.address(offsets[0]),
            -1,
            4096,
            arena.address(offsets[5]),
        ]
    finally:
        arena.close()


# ----------------------------------------------------------------- 2. mixed block sizes


@pytest.fixture
def arena() -> Iterator[SharedMemoryArena]:
    a = SharedMemoryArena(HEADER_BYTES + 4 * MiB + 20 * KiB)
    yield a
    a.close()


def fill_class(alloc: SlabAllocator, block_bytes: int) -> list[int]:
    out = []
    while (off := alloc.allocate(block_bytes)) is not None:
        out.append(off)
    return out


def test_a_second_block_size_gets_the_slabs_the_first_gave_back(arena: SharedMemoryArena) -> None:
    """One model filled the tier, then a model with another block size came: once the first
    model's blocks are gone, its slabs serve the second (they used to stay with the first
    class for good, and every put of the second model failed)."""
    alloc = SlabAllocator(arena.size_bytes, 256 * KiB, back=arena.back)
    first = fill_class(alloc, 64 * KiB)
    assert len(first) == 16 * 4 and alloc.free_slots(96 * KiB) == 0
    assert alloc.allocate(96 * KiB) is None
    for off in first[-4:]:  # the top slab's four slots: it empties, and goes back to the pool
        alloc.free(off, 64 * KiB)
    assert alloc.free_slots(96 * KiB) == 2  # one slab's worth, not a slot more
    second = fill_class(alloc, 96 * KiB)
    top = HEADER_BYTES + 15 * 256 * KiB
    assert second == [top, top + 96 * KiB]
    alloc.check()
    assert alloc.slab_info(15).slot_bytes == 96 * KiB and alloc.unassigned_slabs == 1  # the tail
    for off in first[:-4]:
        alloc.free(off, 64 * KiB)
    alloc.check()
    # The tail slab (20 KiB) is too small for 96 KiB slots; each 256 KiB slab holds two.
    assert alloc.free_slots(96 * KiB) == 15 * 2
    second += fill_class(alloc, 96 * KiB)
    assert len(second) == 16 * 2
    for i, off in enumerate(second):  # every slot is real shared memory, and they are disjoint
        arena.view[off : off + 96 * KiB] = bytes([i + 1]) * (96 * KiB)
    for i, off in enumerate(second):
        assert arena.view[off : off + 96 * KiB] == bytes([i + 1]) * (96 * KiB)
    alloc.check()


def test_a_draining_slab_is_not_refilled_and_goes_to_another_class(
    arena: SharedMemoryArena,
) -> None:
    alloc = SlabAllocator(arena.size_bytes, 256 * KiB, back=arena.back)
    small = fill_class(alloc, 64 * KiB)
    victim = alloc.slab_of(small[5])
    assert alloc.class_slabs(64 * KiB) == list(range(16))
    assert alloc.slab_info(victim).slot_bytes == 64 * KiB
    alloc.begin_drain(victim)
    used = alloc.used_offsets(victim)
    assert used == [o for o in small if alloc.slab_of(o) == victim] and len(used) == 4
    alloc.free(used[0], 64 * KiB)
    # Its free slot is neither counted nor handed out while it drains...
    assert alloc.free_slots(64 * KiB) == 0 and alloc.allocate(64 * KiB) is None
    assert alloc.end_drain(victim)  # ...until the drain is given up,
    assert alloc.free_slots(64 * KiB) == 1 and alloc.allocate(64 * KiB) == used[0]
    alloc.begin_drain(victim)  # and then done: the daemon evicts what is left in it.
    alloc.check()
    for off in alloc.used_offsets(victim):
        alloc.free(off, 64 * KiB)
    assert not alloc.end_drain(victim)  # it emptied, so it left its class
    info = alloc.slab_info(victim)
    assert (info.slot_bytes, info.used, info.draining) == (0, 0, False)
    big = alloc.allocate(200 * KiB)
    assert big is not None and alloc.slab_of(big) == victim
    alloc.check()
    with pytest.raises(ValueError, match="belongs to no class"):
        alloc.begin_drain(alloc.num_slabs - 1)  # the tail slab was never taken


def test_a_small_tier_serves_several_block_sizes() -> None:
    """The slab adapts: at most capacity/16, not under 16 MiB, never over the configured size.
    A 64 MiB tier with the 64 MiB default used to be one slab: one block size only."""
    for capacity, configured, slab in (
        (64 * MiB, 64 * MiB, 16 * MiB),
        (256 * MiB, 64 * MiB, 16 * MiB),
        (1 << 30, 64 * MiB, 64 * MiB),
        (2 << 30, 64 * MiB, 64 * MiB),
        (8 * MiB, 64 * MiB, 8 * MiB),
        (64 * KiB, 16 * KiB, 16 * KiB),
    ):
        alloc = SlabAllocator(HEADER_BYTES + capacity, configured)
        assert alloc.slab_bytes == slab, (capacity, configured)
        assert alloc.num_slabs * slab == capacity
    alloc = SlabAllocator(HEADER_BYTES + 64 * MiB, 64 * MiB)
    offsets = [alloc.allocate(b) for b in (2 * MiB, 5 * MiB, 12 * MiB + 512 * KiB, 16 * MiB)]
    assert None not in offsets and len({alloc.slab_of(o) for o in offsets if o}) == 4
    alloc.check()
    with pytest.raises(ValueError, match="does not fit"):
        alloc.check_fits(16 * MiB + 1)
    with pytest.raises(ValueError, match="does not fit"):
        alloc.allocate(16 * MiB + 1)


def test_a_slot_freed_twice_or_with_the_wrong_size_is_refused(arena: SharedMemoryArena) -> None:
    alloc = SlabAllocator(arena.size_bytes, 256 * KiB)
    a, b = alloc.allocate(64 * KiB), alloc.allocate(64 * KiB)
    assert a is not None and b is not None
    alloc.free(a, 64 * KiB)
    with pytest.raises(AssertionError, match="not in use"):
        alloc.free(a, 64 * KiB)
    with pytest.raises(AssertionError, match="not in use"):
        alloc.free(b, 128 * KiB)
    with pytest.raises(AssertionError, match="not in use"):
        alloc.free(b + 4 * KiB, 64 * KiB)
    with pytest.raises(AssertionError, match="outside"):
        alloc.free(arena.size_bytes, 64 * KiB)
    alloc.check()
    with pytest.raises(AssertionError, match="not in use"):  # a batch naming a slot twice
        alloc.free_many([b, b], 64 * KiB)
    alloc.check()


# ----------------------------------------------------------------- 3. invariants, at random

SIZES = [4 * KiB, 12 * KiB, 20 * KiB, 28 * KiB, 40 * KiB]
"""Slot sizes against 64 KiB slabs and a 20 KiB tail: 16, 5, 3, 2 and 1 per slab; 28 and 40 KiB
never fit the tail."""
OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "alloc", "alloc", "alloc_many", "free", "free",
                               "free_many", "drain", "undrain"]),
              st.integers(0, 1 << 16)),
    max_size=90,
)  # fmt: skip


@given(OPS)
@settings(max_examples=200, deadline=None)
def test_random_allocations_keep_every_invariant(ops: list[tuple[str, int]]) -> None:
    arena = SharedMemoryArena(HEADER_BYTES + 8 * 64 * KiB + 20 * KiB)
    try:
        alloc = SlabAllocator(arena.size_bytes, 64 * KiB, back=arena.back)
        end = HEADER_BYTES + alloc.capacity_bytes
        held: dict[int, tuple[int, int]] = {}  # offset -> (block bytes, stamp)
        for step, (op, n) in enumerate(ops):
            if op == "alloc":
                size = SIZES[n % len(SIZES)]
                expected_free = alloc.free_slots(size)
                off = alloc.allocate(size)
                assert (off is None) == (expected_free == 0), (step, size, expected_free)
                if off is None:
                    for i in range(alloc.num_slabs):  # nothing free, nothing it fits unassigned
                        info = alloc.slab_info(i)
                        if info.slot_bytes == size and not info.draining:
                            assert info.used == info.slots
                        assert info.slot_bytes or info.size_bytes < size
                else:
                    assert off % SLOT_ALIGN == 0 and HEADER_BYTES <= off <= end - size
                    assert off not in held
                    held[off] = (size, step)
                    arena.view[off : off + 8] = step.to_bytes(8, "little")
            elif op == "alloc_many":  # a batch for an eviction's room: as many as are free
                size, want = SIZES[n % len(SIZES)], n % 7
                expected_free = alloc.free_slots(size)
                offsets = alloc.allocate_many(size, want)
                assert len(offsets) == min(want, expected_free), (step, size, expected_free)
                for off in offsets:
                    assert off % SLOT_ALIGN == 0 and HEADER_BYTES <= off <= end - size
                    assert off not in held
                    held[off] = (size, step)
                    arena.view[off : off + 8] = step.to_bytes(8, "little")
            elif op == "free" and held:
                off = sorted(held)[n % len(held)]
                size, stamp = held.pop(off)
                assert arena.view[off : off + 8] == stamp.to_bytes(8, "little")
                alloc.free(off, size)
            elif op == "free_many" and held:  # an eviction's batch: slots of one size
                size = held[sorted(held)[n % len(held)]][0]
                batch = [o for o in sorted(held) if held[o][0] == size][: 1 + n % 4]
                for off in batch:
                    assert arena.view[off : off + 8] == held.pop(off)[1].to_bytes(8, "little")
                alloc.free_many(batch, size)
            elif op in ("drain", "undrain") and held:
                slab = alloc.slab_of(sorted(held)[n % len(held)])
                if op == "drain":
                    alloc.begin_drain(slab)
                else:
                    alloc.end_drain(slab)
            alloc.check()
            spans = sorted((o, o + s) for o, (s, _) in held.items())
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
            for i in range(alloc.num_slabs):
                mine = sorted(o for o in held if alloc.slab_of(o) == i)
                assert alloc.used_offsets(i) == mine
        for off, (size, _) in held.items():  # every slab comes back
            alloc.free(off, size)
        alloc.check()
        assert alloc.unassigned_slabs == alloc.num_slabs
    finally:
        arena.close()


def test_allocate_many_hands_out_the_slots_allocate_would_in_turn() -> None:
    """An eviction's room is taken as one batch: the same slots, in the same order, as that
    many ``allocate`` calls, across slabs and past what is free (then fewer)."""
    one = SlabAllocator(HEADER_BYTES + 4 * 16384, slab_bytes=16384)
    many = SlabAllocator(HEADER_BYTES + 4 * 16384, slab_bytes=16384)
    for alloc in (one, many):  # holes in the first slab, freed in an order of their own
        taken = [alloc.allocate(4096) for _ in range(3)]
        alloc.free_many([taken[2], taken[0]], 4096)
    singles = [one.allocate(4096) for _ in range(20)]
    assert many.allocate_many(4096, 20) == [o for o in singles if o is not None]
    assert len(many.allocate_many(4096, 20)) == 0 and many.free_slots(4096) == 0
    one.check()
    many.check()


def test_class_free_slots_counts_only_the_slabs_a_class_holds() -> None:
    alloc = SlabAllocator(HEADER_BYTES + 4 * 16384, slab_bytes=16384)
    assert alloc.class_free_slots(4096) == 0  # no slab yet, though the pool has room
    a = alloc.allocate(4096)
    assert a is not None and alloc.class_free_slots(4096) == 3
    alloc.begin_drain(alloc.slab_of(a))
    assert alloc.class_free_slots(4096) == 0  # a draining slab's slots are not offered
    alloc.end_drain(alloc.slab_of(a))
    assert alloc.class_free_slots(4096) == 3


# ----------------------------------------------------------------- huge pages


def test_the_shmem_thp_mode_is_the_marked_word() -> None:
    assert shmem_thp_mode("always within_size [advise] never deny force\n") == "advise"
    assert shmem_thp_mode("always within_size advise [never] deny force") == "never"
    assert shmem_thp_mode("[always] never") == "always"
    assert shmem_thp_mode("") == "never"


def test_a_slab_asked_for_huge_pages_holds_blocks_and_maps_them_with_few_entries() -> None:
    """A slab whose pages were allocated through a mapping advised ``MADV_HUGEPAGE`` is as
    any other: backed, sealed, its bytes the daemon's, zeros once retired. Where the kernel
    gives shared memory huge pages on advice (``shmem_enabled`` = ``advise``), a client then
    maps it 2 MiB a page-table entry (what made mapping a slab ~200x cheaper)."""
    import ctypes
    import mmap

    arena = SharedMemoryArena(HEADER_BYTES + 8 * MiB, huge_pages=True)
    try:
        alloc = SlabAllocator(arena.size_bytes, 4 * MiB, back=arena.back)
        arena.slab_bytes = alloc.slab_bytes
        a = alloc.allocate(4 * MiB, domain=1)
        assert a is not None
        arena.view[a : a + 4 * MiB] = bytes(range(256)) * (4 * MiB // 256)
        uid = arena.address(a) >> 32
        fd = arena.export(uid, writable=True)
        client = mmap.mmap(fd, 4 * MiB, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        os.close(fd)
        assert client[:] == bytes(range(256)) * (4 * MiB // 256)
        address = ctypes.addressof(ctypes.c_char.from_buffer(client))
        if huge_pages_on_advice() and address % (2 * MiB) == 0:
            assert smaps_kib("ShmemPmdMapped", address) == 4 * 1024
        alloc.free(a, 4 * MiB)
        b = alloc.allocate(4 * MiB, domain=2)  # another tenant: the old file's pages go
        assert b == a and arena.address(b) >> 32 != uid
        assert client[:] == bytes(4 * MiB)
        client.close()
        alloc.check()
    finally:
        arena.close()


# ----------------------------------------------------------------- clearing pages ahead


def test_slabs_are_cleared_ahead_keeping_every_byte_written_meanwhile() -> None:
    """The zeroing thread faults every page of each new slab file once, in the background; a
    page written before it gets there keeps its bytes (populating never writes), and its
    mapping is its own: the daemon's range stays unpopulated (no RSS for pages it never
    touched)."""
    import ctypes

    arena = SharedMemoryArena(HEADER_BYTES + 16 * MiB, huge_pages=False)
    try:
        alloc = SlabAllocator(arena.size_bytes, 4 * MiB, back=arena.back, prefault=True)
        arena.slab_bytes = alloc.slab_bytes
        a = alloc.allocate(64 * KiB)
        assert a is not None
        pattern = bytes(range(256)) * (64 * KiB // 256)
        arena.view[a : a + 64 * KiB] = pattern  # may land before or after the thread's pass
        assert arena.zero_ahead.wait(30)
        assert arena.zero_ahead.supported
        assert arena.zero_ahead.cleared_bytes == alloc.capacity_bytes
        assert bytes(arena.view[a : a + 64 * KiB]) == pattern
        base = ctypes.addressof(ctypes.c_char.from_buffer(arena.buffer))
        # The header page and the slot written, nothing else (over the header's and slabs' mappings)
        assert smaps_kib("Rss", base, base + arena.size_bytes) == 4 + 64
        alloc.check()
    finally:
        arena.close()


def test_a_kernel_without_populate_leaves_slabs_to_the_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before Linux 5.14 ``MADV_POPULATE_WRITE`` is EINVAL: the thread turns itself off and
    slabs are backed and hold blocks as before (their first toucher clears them)."""
    from kvstore.tiers import cpu_arena

    monkeypatch.setattr(cpu_arena, "_populate_write", lambda addr, size: errno.EINVAL)
    arena = SharedMemoryArena(HEADER_BYTES + 8 * MiB, huge_pages=False)
    try:
        alloc = SlabAllocator(arena.size_bytes, 4 * MiB, back=arena.back, prefault=True)
        arena.slab_bytes = alloc.slab_bytes
        assert arena.zero_ahead.wait(30)
        assert not arena.zero_ahead.supported
        assert arena.zero_ahead.cleared_bytes == 0
        offsets = [alloc.allocate(4 * MiB) for _ in range(2)]
        for i, off in enumerate(offsets):
            assert off is not None
            arena.view[off : off + 4 * MiB] = bytes([i + 1]) * (4 * MiB)
        for i, off in enumerate(offsets):
            assert off is not None
            assert bytes(arena.view[off : off + 4 * MiB]) == bytes([i + 1]) * (4 * MiB)
        alloc.check()
    finally:
        arena.close()


def test_a_slab_retired_before_its_clearing_is_skipped_and_its_successor_cleared() -> None:
    """A slab passing to another domain gets a new file; the old one, retired while queued,
    is never mapped again by the thread (its pages stay punched: a client still mapping it
    reads zeros), and the new file is cleared in its turn."""
    arena = SharedMemoryArena(HEADER_BYTES + 8 * MiB, huge_pages=False)
    try:
        alloc = SlabAllocator(arena.size_bytes, 4 * MiB, back=arena.back, prefault=True)
        arena.slab_bytes = alloc.slab_bytes
        a = alloc.allocate(4 * MiB, domain=1)  # retires slab 0's first file at once
        assert a is not None
        arena.view[a : a + 4 * MiB] = b"\x5a" * (4 * MiB)
        assert arena.zero_ahead.wait(30)
        # Three files made, one retired (perhaps before the thread reached it): at most all
        # three cleared, at least the two live ones.
        assert 8 * MiB <= arena.zero_ahead.cleared_bytes <= 12 * MiB
        assert bytes(arena.view[a : a + 4 * MiB]) == b"\x5a" * (4 * MiB)
        alloc.check()
    finally:
        arena.close()


def test_closing_an_arena_stops_its_clearing() -> None:
    arena = SharedMemoryArena(HEADER_BYTES + 64 * MiB, huge_pages=False)
    alloc = SlabAllocator(arena.size_bytes, 4 * MiB, back=arena.back, prefault=True)
    arena.slab_bytes = alloc.slab_bytes
    arena.close()  # joins the thread, whatever it was at
    assert arena.zero_ahead.wait(0)
    assert arena.zero_ahead.cleared_bytes <= 64 * MiB


def test_a_slab_retired_while_being_cleared_keeps_no_page(monkeypatch) -> None:
    """A slab passing to another domain while the thread is clearing it: ``retire`` frees the
    old file's pages while the chunk's fill is under way, and the fill allocates the rest of
    its chunk again. Those pages belong to no slab and stay while any client maps the file
    (up to 16 MiB each time, in a reviewer's run 19 of 20). The thread now frees its chunk
    once more when it finds the file retired after the fill."""
    from kvstore.tiers import cpu_arena

    arena = SharedMemoryArena(HEADER_BYTES + 8 * MiB, huge_pages=False)
    held: list[int] = []
    fill = cpu_arena._populate_write

    def retired_during_the_fill(addr: int, size: int) -> int:
        if not held:  # the first chunk of the first file: retire it now, mid-fill
            f = arena._files[HEADER_BYTES]
            held.append(arena.export(f.uid, writable=False))  # a client's hold on it
            arena.back(HEADER_BYTES, 4 * MiB, 1)  # another domain: the old file retires
        return fill(addr, size)  # then the fill runs on, allocating pages again

    monkeypatch.setattr(cpu_arena, "_populate_write", retired_during_the_fill)
    try:
        arena.slab_bytes = 4 * MiB
        arena.back(HEADER_BYTES, 4 * MiB, 0)
        assert arena.zero_ahead.wait(30)
        assert held, "the thread never cleared the slab"
        assert os.fstat(held[0]).st_blocks == 0  # the retired file holds no page
    finally:
        for fd in held:
            os.close(fd)
        arena.close()
