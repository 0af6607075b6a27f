"""The CPU tier's arena and slab allocator, on real shared memory.

The backing tests need a filesystem that fills up: each runs in a child process, in its own
mount namespace (``unshare``) with a fresh small tmpfs, so a SIGBUS fails the test instead of
killing pytest and nothing is left mounted. The child loads ``tiers/cpu.py`` by path (it imports
only the standard library), which keeps each child at tens of milliseconds.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstore.tiers.cpu as cpu
from kvstore.tiers.cpu import HEADER_BYTES, SLOT_ALIGN, SharedMemoryArena, SlabAllocator

KiB, MiB = 1 << 10, 1 << 20

# ----------------------------------------------------------------- a small tmpfs per child

_UNSHARE = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "-r", "--mount"]
_PRELUDE = f"""
import importlib.util, json, mmap, os, sys
spec = importlib.util.spec_from_file_location("cpu_under_test", {cpu.__file__!r})
cpu = importlib.util.module_from_spec(spec)
sys.modules["cpu_under_test"] = cpu
spec.loader.exec_module(cpu)
MNT = sys.argv[1]
KiB, MiB = 1 << 10, 1 << 20


def fill(path):
    \"\"\"Write a file until its filesystem is full.\"\"\"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\\1" * (64 * KiB))
    except OSError:
        pass
    finally:
        os.close(fd)
"""


@pytest.fixture(scope="session")
def small_tmpfs_ok(tmp_path_factory: pytest.TempPathFactory) -> None:
    mnt = tmp_path_factory.mktemp("probe")
    try:
        probe = subprocess.run(
            [*_UNSHARE, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot make a small tmpfs in a mount namespace: {e}")
    if probe.returncode:
        pytest.skip(f"cannot make a small tmpfs in a mount namespace: {probe.stderr.strip()}")


def run_on_small_tmpfs(tmp_path: Path, size: str, body: str) -> dict:
    """Run ``body`` in a child with a fresh ``size`` tmpfs mounted at ``MNT``; its last line of
    output is JSON. A child killed by SIGBUS fails the test with that name."""
    script = tmp_path / "child.py"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    shell = 'mount -t tmpfs -o size="$1" tmpfs "$2" && exec "$3" "$4" "$2"'
    cmd = [*_UNSHARE, "sh", "-c", shell, "sh", size, str(mnt), sys.executable, str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode in (-signal.SIGBUS, 128 + signal.SIGBUS):
        pytest.fail(f"the child was killed by SIGBUS\n{proc.stdout}{proc.stderr}")
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------- 1. never SIGBUS


def test_slots_on_a_nearly_full_tmpfs_never_sigbus(small_tmpfs_ok: None, tmp_path: Path) -> None:
    """A 32 MiB arena without prefault on an 8 MiB tmpfs that is 3 MiB full: a client writes
    every byte of every slot it is handed. Before backing, the first write past what tmpfs
    could hold killed the writer with SIGBUS; now the allocator hands out only backed slabs,
    says why it stopped, and takes more once space comes back."""
    out = run_on_small_tmpfs(
        tmp_path,
        "8m",
        """
        ballast = os.path.join(MNT, "ballast")
        with open(ballast, "wb") as f:
            f.write(b"\\1" * (3 * MiB))
        arena = cpu.SharedMemoryArena(cpu.HEADER_BYTES + 32 * MiB, prefault=False, directory=MNT)
        alloc = cpu.SlabAllocator(arena.size_bytes, 1 * MiB, reserve_backing=arena.reserve_backing)
        fd = os.open(arena.path, os.O_RDWR)  # a client maps the arena as clients do
        client = mmap.mmap(fd, arena.size_bytes)
        os.close(fd)
        slot = 256 * KiB
        offsets = []
        while (off := alloc.allocate(slot)) is not None:
            client[off : off + slot] = bytes([len(offsets) % 251 + 1]) * slot
            offsets.append(off)
        alloc.check()
        out = {
            "slots": len(offsets),
            "backed": sum(alloc.slab_info(i).backed for i in range(alloc.num_slabs)),
            "unbackable": alloc.unbackable_slabs,
            "error": alloc.backing_error,
            "free_slots": alloc.free_slots(slot),
            "intact": all(
                arena.view[o : o + slot] == bytes([i % 251 + 1]) * slot
                for i, o in enumerate(offsets)
            ),
        }
        os.unlink(ballast)  # space comes back
        out["retried"] = alloc.retry_backing()
        more = 0
        while (off := alloc.allocate(slot)) is not None:
            client[off : off + slot] = b"\\7" * slot
            more += 1
        alloc.check()
        out["more"] = more
        client.close()
        arena.close()
        print(json.dumps(out))
        """,
    )
    # 5 MiB free, less the header page: four 1 MiB slabs of four slots, then a slab fails.
    assert out["slots"] == 16 and out["backed"] == 4 and out["intact"], out
    # The slab that failed and every other never-backed one are set aside at once, so that
    # free_slots stops counting them (the daemon then evicts instead of failing again).
    assert out["unbackable"] == 32 - 4 and out["free_slots"] == 0, out
    assert str(tmp_path / "mnt") in out["error"] and "bytes free" in out["error"], out
    assert out["retried"] == 32 - 4 and out["more"] == 12, out  # three more slabs fit now


def test_an_arena_its_directory_cannot_hold_is_refused_at_start(
    small_tmpfs_ok: None, tmp_path: Path
) -> None:
    """A clear OSError naming the directory and the sizes, never a SIGBUS: a prefaulted arena
    bigger than the directory's free space, a first slab that cannot be backed, a full
    directory (where the token write into the header page used to SIGBUS). Nothing is left."""
    out = run_on_small_tmpfs(
        tmp_path,
        "4m",
        """
        out = {}
        try:
            cpu.SharedMemoryArena(cpu.HEADER_BYTES + 8 * MiB, prefault=True, directory=MNT)
        except OSError as e:
            out["prefault"] = [e.errno, str(e)]
        arena = cpu.SharedMemoryArena(cpu.HEADER_BYTES + 8 * MiB, prefault=False, directory=MNT)
        try:
            cpu.SlabAllocator(arena.size_bytes, 8 * MiB, reserve_backing=arena.reserve_backing)
        except OSError as e:
            out["first_slab"] = [e.errno, str(e)]
        arena.close()
        fill(os.path.join(MNT, "ballast"))
        try:
            cpu.SharedMemoryArena(cpu.HEADER_BYTES + 1 * MiB, prefault=False, directory=MNT)
        except OSError as e:
            out["full"] = [e.errno, str(e)]
        out["left"] = [n for n in os.listdir(MNT) if n.startswith("kvstore-")]
        print(json.dumps(out))
        """,
    )
    mnt = str(tmp_path / "mnt")
    for case, needed in (("prefault", 8 * MiB + HEADER_BYTES), ("first_slab", 8 * MiB)):
        assert case in out, out
        code, message = out[case]
        assert code == 28 and mnt in message, out  # ENOSPC
        assert f"needs {needed} more" in message and "bytes free" in message, out
    assert out["full"][0] == 28 and mnt in out["full"][1], out
    assert out["left"] == [], out


# ----------------------------------------------------------------- 2. mixed block sizes


@pytest.fixture
def arena() -> Iterator[SharedMemoryArena]:
    a = SharedMemoryArena(HEADER_BYTES + 4 * MiB + 20 * KiB, prefault=False)
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
    alloc = SlabAllocator(arena.size_bytes, 256 * KiB, reserve_backing=arena.reserve_backing)
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
    alloc = SlabAllocator(arena.size_bytes, 256 * KiB, reserve_backing=arena.reserve_backing)
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


# ----------------------------------------------------------------- 3. invariants, at random

SIZES = [4 * KiB, 12 * KiB, 20 * KiB, 28 * KiB, 40 * KiB]
"""Slot sizes against 64 KiB slabs and a 20 KiB tail: 16, 5, 3, 2 and 1 per slab; 28 and 40 KiB
never fit the tail."""
OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "alloc", "alloc", "free", "free", "drain", "undrain"]),
              st.integers(0, 1 << 16)),
    max_size=90,
)  # fmt: skip


@given(OPS)
@settings(max_examples=200, deadline=None)
def test_random_allocations_keep_every_invariant(ops: list[tuple[str, int]]) -> None:
    arena = SharedMemoryArena(HEADER_BYTES + 8 * 64 * KiB + 20 * KiB, prefault=False)
    try:
        alloc = SlabAllocator(arena.size_bytes, 64 * KiB, reserve_backing=arena.reserve_backing)
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
            elif op == "free" and held:
                off = sorted(held)[n % len(held)]
                size, stamp = held.pop(off)
                assert arena.view[off : off + 8] == stamp.to_bytes(8, "little")
                alloc.free(off, size)
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


def test_class_free_slots_counts_only_the_slabs_a_class_holds() -> None:
    alloc = SlabAllocator(HEADER_BYTES + 4 * 16384, slab_bytes=16384)
    assert alloc.class_free_slots(4096) == 0  # no slab yet, though the pool has room
    a = alloc.allocate(4096)
    assert a is not None and alloc.class_free_slots(4096) == 3
    alloc.begin_drain(alloc.slab_of(a))
    assert alloc.class_free_slots(4096) == 0  # a draining slab's slots are not offered
    alloc.end_drain(alloc.slab_of(a))
    assert alloc.class_free_slots(4096) == 3
