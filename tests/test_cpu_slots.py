"""Which entry holds which CPU slot (``CpuSlots``), kept per slab in arrays of entry ids laid out
by the slab's size class, on a real shared-memory arena and its real slab allocator.

A slab changes class only once all its slots are free (it goes back to the pool, or is drained),
and its owner array must then follow the new class's slot size: these tests retire slabs and
hand them to other classes, and check every owner against a plain dict model.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.checksum import block_checksum
from kvstore.config import CpuTierConfig
from kvstore.daemon.cpu_tier import CpuSlots
from kvstore.tiers.cpu import HEADER_BYTES

KiB = 1 << 10
SLAB = 256 * KiB
# 16 slabs of 256 KiB and a 20 KiB tail: 64 KiB blocks fill four slots a slab, 96 KiB two.
CONFIG = CpuTierConfig(capacity_bytes=16 * SLAB + 20 * KiB, slab_bytes=SLAB, prefault=False)
FP = b"namespace-fingerprint"


@pytest.fixture
def slots() -> Iterator[CpuSlots]:
    s = CpuSlots(CONFIG)
    assert s.allocator.slab_bytes == SLAB and s.allocator.num_slabs == 17
    yield s
    s.close()


def alloc(slots: CpuSlots, block_bytes: int) -> int:
    off = slots.alloc(block_bytes)
    assert off is not None
    return off


def test_owners_follow_place_vacate_and_quarantine(slots: CpuSlots) -> None:
    a, b, c = (alloc(slots, 64 * KiB) for _ in range(3))
    assert slots.owned() == 0 and slots.owner(a) is None
    slots.place(7, a, 64 * KiB, clean=True)
    slots.place_dirty([8, 9], [b, c])
    assert [slots.owner(o) for o in (a, b, c)] == [7, 8, 9] and slots.owned() == 3
    assert slots.clean_bytes == 64 * KiB
    # Offsets that are no slot start, or outside the slabs, have no owner.
    for off in (a + 4096, HEADER_BYTES - 1, 0, HEADER_BYTES + 17 * SLAB, -1):
        assert slots.owner(off) is None
    with pytest.raises(AssertionError, match=f"slot {a} already holds entry 7"):
        slots.place(10, a, 64 * KiB, clean=False)
    slots.vacate(a, 64 * KiB, clean=True)
    assert slots.owner(a) is None and slots.clean_bytes == 0 and slots.owned() == 2
    slots.quarantine(b, 64 * KiB)
    assert slots.owner(b) is None and slots.quarantined_bytes == 64 * KiB
    assert slots.used_bytes == 2 * 64 * KiB  # b quarantined (still used), c placed
    with pytest.raises(KeyError):
        slots.vacate(b, 64 * KiB, clean=False)  # a quarantined slot has no entry to vacate
    slots.release_quarantined(b, 64 * KiB)
    slots.vacate(c, 64 * KiB, clean=False)
    assert slots.owned() == 0 and slots.used_bytes == 0
    slots.allocator.check()


def test_a_batch_with_a_taken_or_repeated_slot_places_nothing(slots: CpuSlots) -> None:
    a, b, c = (alloc(slots, 64 * KiB) for _ in range(3))
    slots.place(1, b, 64 * KiB, clean=False)
    with pytest.raises(AssertionError, match=f"slot {b} already holds entry 1"):
        slots.place_dirty([2, 3, 4], [a, b, c])
    with pytest.raises(AssertionError, match=f"slot {a} named twice"):
        slots.place_dirty([2, 3], [a, a])
    with pytest.raises(ValueError):
        slots.place_dirty([2, 3], [a])
    assert [slots.owner(o) for o in (a, b, c)] == [None, 1, None] and slots.owned() == 1
    with pytest.raises(AssertionError, match="not a slot of its slab"):
        slots.place(5, a + 4096, 64 * KiB, clean=False)


def test_a_slab_given_back_and_taken_by_another_class_gets_owners_of_its_slot_size(
    slots: CpuSlots,
) -> None:
    """The slab of four 64 KiB slots empties, goes back to the pool, and the 96 KiB class takes
    it: its owners are then laid out by 96 KiB slots (slot 1 at +96 KiB, where the old layout
    had slot 1 at +64 KiB), and none of the old class's entries is seen in it."""
    small = [alloc(slots, 64 * KiB) for _ in range(4 * 16)]  # every full slab
    slots.place_dirty(list(range(100, 164)), small)
    top = [o for o in small if slots.allocator.slab_of(o) == 15]
    assert len(top) == 4
    for off in top:
        slots.vacate(off, 64 * KiB, clean=False)
    assert slots.allocator.slab_info(15).slot_bytes == 0  # back in the pool
    big = [alloc(slots, 96 * KiB) for _ in range(2)]
    base = HEADER_BYTES + 15 * SLAB
    assert big == [base, base + 96 * KiB]
    slots.place_dirty([500, 501], big)
    assert slots.owner(base) == 500 and slots.owner(base + 96 * KiB) == 501
    for off in top[1:]:  # the old 64 KiB slot starts: no slot of the new class, no owner
        assert slots.owner(off) is None
    assert slots.owned() == 60 + 2
    for eid, off in zip(range(100, 160), small[:60], strict=True):  # the others kept theirs
        assert slots.owner(off) == eid
    for off in big:
        slots.vacate(off, 96 * KiB, clean=False)
    # And back to 64 KiB slots: slot 1 is at +64 KiB again.
    again = [alloc(slots, 64 * KiB) for _ in range(4)]
    assert again == top
    slots.place_dirty([600, 601, 602, 603], again)
    assert [slots.owner(o) for o in top] == [600, 601, 602, 603]
    slots.allocator.check()


def test_a_drained_slab_moves_its_blocks_and_serves_another_class(slots: CpuSlots) -> None:
    """``relocate`` moves an entry out of a draining slab (its owner follows it); the emptied
    slab then leaves its class and a larger block size takes it."""
    view = slots.arena.view
    small = [alloc(slots, 64 * KiB) for _ in range(8)]  # slabs 0 and 1
    sums = {}
    for eid, off in enumerate(small):
        key = eid.to_bytes(32, "little")
        view[off : off + 64 * KiB] = bytes([eid + 1]) * (64 * KiB)
        sums[eid] = block_checksum(view[off : off + 64 * KiB], FP, key)
    slots.place_dirty(list(range(8)), small)
    for off in small[6:]:  # two free slots in slab 1 to move into
        slots.vacate(off, 64 * KiB, clean=False)
    slots.allocator.begin_drain(0)
    moved = {}
    for eid in (2, 3):  # make room: two of slab 0's four go
        slots.vacate(small[eid], 64 * KiB, clean=False)
    for eid in (0, 1):
        key = eid.to_bytes(32, "little")
        new = slots.relocate(eid, small[eid], 64 * KiB, 0, FP, key, sums[eid])
        assert new is not None and new >= 0 and slots.allocator.slab_of(new) == 1
        moved[eid] = new
        assert slots.owner(new) == eid and slots.owner(small[eid]) is None
        assert view[new : new + 64 * KiB] == bytes([eid + 1]) * (64 * KiB)
    assert slots.allocator.slab_info(0).slot_bytes == 0  # drained: back in the pool
    assert slots.owned() == 4  # 0 and 1 moved, 4 and 5 stayed
    big = alloc(slots, 200 * KiB)
    assert slots.allocator.slab_of(big) == 0 and big == HEADER_BYTES
    slots.place(900, big, 200 * KiB, clean=False)
    assert slots.owner(HEADER_BYTES) == 900
    assert slots.owner(HEADER_BYTES + 64 * KiB) is None  # a 64 KiB slot start, no 200 KiB one
    # Within one slab too; and a copy that does not verify stays where it was, with its owner.
    slots.vacate(small[5], 64 * KiB, clean=False)
    key = (4).to_bytes(32, "little")
    assert slots.relocate(4, small[4], 64 * KiB, 0, FP, key, sums[4] ^ 1) == -1
    assert slots.owner(small[4]) == 4 and slots.owner(small[5]) is None
    assert slots.relocate(4, small[4], 64 * KiB, 0, FP, key, sums[4]) == small[5]
    assert slots.owner(small[5]) == 4 and slots.owner(small[4]) is None
    assert slots.owned() == 4  # 0, 1 and 4 in slab 1, 900 in slab 0
    slots.allocator.check()


def test_owner_arrays_cost_four_bytes_a_slot(slots: CpuSlots) -> None:
    offs = [alloc(slots, 4 * KiB) for _ in range(64)]  # one slab of 64 slots
    slots.place_dirty(list(range(64)), offs)
    assert slots.owner_bytes() == 64 * 4


SIZES = (4 * KiB, 64 * KiB, 96 * KiB, 200 * KiB)
OPS = st.lists(
    st.tuples(st.sampled_from(["place", "vacate", "quarantine", "release", "drain"]),
              st.integers(0, 1 << 16)),
    max_size=120,
)  # fmt: skip


@given(OPS)
@settings(max_examples=60, deadline=None)
def test_random_slot_traffic_keeps_owners_equal_to_a_dict(ops: list[tuple[str, int]]) -> None:
    """Slabs empty and change class at random (several block sizes compete for 16 slabs);
    ``owner`` of every offset ever handed out, and ``owned``, match a plain dict."""
    slots = CpuSlots(CONFIG)
    try:
        model: dict[int, tuple[int, int]] = {}  # offset -> (entry, block bytes)
        quarantined: dict[int, int] = {}  # offset -> block bytes
        seen: set[int] = set()
        view = slots.arena.view
        for step, (op, n) in enumerate(ops):
            if op == "place":
                size = SIZES[n % len(SIZES)]
                batch = []
                for _ in range(1 + n % 3):
                    off = slots.alloc(size)
                    if off is None:
                        break
                    batch.append(off)
                eids = [step * 4 + j for j in range(len(batch))]
                if len(batch) == 1:
                    slots.place(eids[0], batch[0], size, clean=False)
                else:
                    slots.place_dirty(eids, batch)
                for eid, off in zip(eids, batch, strict=True):
                    model[off] = (eid, size)
                    view[off : off + 8] = eid.to_bytes(8, "little")
            elif op in ("vacate", "quarantine") and model:
                off = sorted(model)[n % len(model)]
                _, size = model.pop(off)
                if op == "vacate":
                    slots.vacate(off, size, clean=False)
                else:
                    slots.quarantine(off, size)
                    quarantined[off] = size
            elif op == "release" and quarantined:
                off = sorted(quarantined)[n % len(quarantined)]
                slots.release_quarantined(off, quarantined.pop(off))
            elif op == "drain" and model:
                # Move every entry of one slab elsewhere in its class, or let it go.
                victim = slots.allocator.slab_of(sorted(model)[n % len(model)])
                slots.allocator.begin_drain(victim)
                for off in slots.allocator.used_offsets(victim):
                    if off not in model:
                        continue  # quarantined: its release empties the slab
                    eid, size = model.pop(off)
                    key = eid.to_bytes(32, "little")
                    checksum = block_checksum(view[off : off + size], FP, key)
                    new = slots.relocate(eid, off, size, victim, FP, key, checksum)
                    if new is None:
                        slots.vacate(off, size, clean=False)
                    else:
                        assert new >= 0 and slots.allocator.slab_of(new) != victim
                        model[new] = (eid, size)
                slots.allocator.end_drain(victim)
            seen.update(model)
            seen.update(quarantined)
            assert slots.owned() == len(model)
            for off in seen:
                want = model.get(off)
                assert slots.owner(off) == (want[0] if want else None), (step, off)
        slots.allocator.check()
        for off, (_, size) in model.items():
            slots.vacate(off, size, clean=False)
        for off, size in quarantined.items():
            slots.release_quarantined(off, size)
        assert slots.owned() == 0 and slots.used_bytes == 0
        assert slots.allocator.unassigned_slabs == slots.allocator.num_slabs
    finally:
        slots.close()


def test_place_dirty_places_nothing_when_a_later_slot_is_in_no_class() -> None:
    """Review finding: a batch whose later slot lies in a slab no class holds raised before
    the undo, leaving the earlier slots owned and ``owned()`` short of them."""
    s = CpuSlots(CONFIG)
    try:
        a = alloc(s, 4096)
        last_slab = HEADER_BYTES + (s.allocator.num_slabs - 1) * s.allocator.slab_bytes
        with pytest.raises(AssertionError, match="size class"):
            s.place_dirty([1, 2], [a, last_slab])
        assert s.owner(a) is None and s.owned() == 0
        s.place_dirty([1], [a])  # the slot is still free to place
        assert s.owner(a) == 1 and s.owned() == 1
    finally:
        s.close()
