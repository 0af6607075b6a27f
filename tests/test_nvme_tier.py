"""The NVMe tier's mechanism on real files: round trips, capacity, recovery after close and after
SIGKILL, damaged and truncated metadata, geometry mismatches, ``kvstore check`` (read-only unless
--fix), the write modes and ``sync``, mixed block sizes sharing slabs, corruption detection,
bound checksums, check(), the free rule, a full disk.

Run as a script (``python tests/test_nvme_tier.py DIR MODE``) this file is also the child
process that the crash tests kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import logging
import mmap
import os
import random
import resource
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import xxhash
from conftest import tmpfs
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.checksum import block_checksum
from kvstore.tiers.nvme import FILE_NAME, PAGE, NvmeFormatError, NvmeIOError, NvmeTier, ondisk
from kvstore.tiers.nvme.alloc import SlotAllocator
from kvstore.tiers.nvme.ondisk import Geometry

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
CHILD_SIZES = (16384, 65536 + 100, 262144)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def cs(i: int, data: bytes) -> int:
    """Block ``i``'s checksum: bound to its key and namespace."""
    return block_checksum(data, NS, key(i))


def block(i: int, n: int, compressible: bool = False) -> bytes:
    """Deterministic block ``i``: random bytes, or (compressible) runs of a few values."""
    rng = np.random.default_rng(i)
    if compressible:
        return np.repeat(rng.integers(0, 4, n // 64 + 1, dtype=np.uint8), 64)[:n].tobytes()
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def aligned(n: int) -> memoryview:
    """A page-aligned writable buffer of n bytes (what a CPU-tier slot looks like)."""
    return memoryview(mmap.mmap(-1, max(n, 1)))[:n]


async def put(
    tier: NvmeTier, i: int, n: int, compressible: bool = False, durable: bool = True
) -> tuple[int, bytes]:
    data = block(i, n, compressible)
    slot = tier.allocate(n)
    assert slot is not None
    await tier.write(slot, key(i), NS, data, cs(i, data), durable=durable)
    return slot, data


async def read(tier: NvmeTier, slot: int, i: int, n: int, checksum: int) -> bytes | None:
    out = bytearray(n)
    ok = await tier.read_into(slot, key(i), NS, checksum, out)
    return bytes(out) if ok else None


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.fixture
async def opened(tmp_path):
    """Factory for open tiers under tmp_path; closes whatever is still open at the end."""
    tiers: list[NvmeTier] = []

    async def make(**kw) -> tuple[NvmeTier, list]:
        kw.setdefault("slab_bytes", 1 << 20)
        tier = NvmeTier(kw.pop("directory", tmp_path / "nvme"), kw.pop("capacity", 16 << 20), **kw)
        records = await tier.open()
        tiers.append(tier)
        return tier, records

    yield make
    for tier in tiers:
        await tier.close()


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("codec", [None, "lz4"])
@pytest.mark.parametrize("direct_io", [True, False])
async def test_round_trip_bit_exact(opened, codec, direct_io):
    tier, records = await opened(
        codec=codec, direct_io=direct_io, capacity=24 << 20, slab_bytes=4 << 20
    )
    assert records == []
    if direct_io:
        assert tier.direct_io, "O_DIRECT should work on ext4 /tmp"
    sizes = [4096, 16384 + 123, 65536, (2 << 20) - 4096]
    written = []
    for i, n in enumerate(sizes * 2):
        compressible = i % 2 == 1
        data = block(i, n, compressible)
        src = aligned(n)  # the zero-copy path takes page-aligned sources
        src[:] = data
        slot = tier.allocate(n)
        await tier.write(slot, key(i), NS, src if i % 3 else data, cs(i, data))
        written.append((slot, i, data))
    for slot, i, data in written:
        assert await read(tier, slot, i, len(data), cs(i, data)) == data
        out = aligned(len(data))
        assert await tier.read_into(slot, key(i), NS, cs(i, data), out)
        assert out == data
    s = tier.stats()
    assert s["writes"] == len(written) and s["blocks"] == len(written)
    assert s["misses"] == 0 and s["reads"] == 2 * len(written)
    if codec == "lz4":
        assert s["compression_ratio"] > 1.5
        assert s["stored_bytes"] < s["used_bytes"] / 1.5
    else:
        assert s["compression_ratio"] <= 1.0
    assert tier.check().ok


async def test_concurrent_writes_share_flushes(opened):
    tier, _ = await opened(capacity=24 << 20)
    n = 65536
    slots = [tier.allocate(n) for _ in range(48)]
    datas = [block(i, n) for i in range(48)]
    await asyncio.gather(
        *(
            tier.write(s, key(i), NS, d, cs(i, d))
            for i, (s, d) in enumerate(zip(slots, datas, strict=True))
        )
    )
    reads = await asyncio.gather(
        *(read(tier, s, i, n, cs(i, d)) for i, (s, d) in enumerate(zip(slots, datas, strict=True)))
    )
    assert reads == datas
    # Two barriers per write one at a time would be 96 fdatasyncs; group commit shares them.
    assert tier.stats()["flushes"] < 60


# ---------------------------------------------------------------------------- capacity
async def test_capacity_never_exceeded_under_churn(opened, tmp_path):
    capacity = (12 << 20) + 12345  # not page-aligned on purpose
    tier, _ = await opened(capacity=capacity, slab_bytes=512 << 10)
    path = tmp_path / "nvme" / FILE_NAME
    assert os.stat(path).st_size == capacity
    assert os.stat(path).st_blocks * 512 <= capacity + PAGE
    rng = random.Random(7)
    sizes = [4096, 12288, 65536, 200_000]
    held: dict[int, int] = {}  # slot -> block size

    def check_layout() -> None:
        spans = sorted((s, s + NvmeTier.slot_bytes_for(n)) for s, n in held.items())
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "slots overlap"
        assert all(s % PAGE == 0 for s, _ in spans)
        assert spans[0][0] >= tier.geometry.data_start and spans[-1][1] <= capacity

    full_counts = []
    for _round in range(3):
        for n in rng.sample(sizes, len(sizes)):
            while (slot := tier.allocate(n)) is not None:
                assert slot not in held
                held[slot] = n
        check_layout()
        total = sum(NvmeTier.slot_bytes_for(n) for n in held.values())
        assert total <= capacity
        full_counts.append(len(held))
        for slot in rng.sample(sorted(held), len(held) // 2):
            tier.free(slot)
            del held[slot]
    assert full_counts[1] == full_counts[2], "freed slots were not all reusable"
    # Committed records count their whole slot against capacity.
    for i, slot in enumerate(sorted(held)[:6]):
        d = block(i, held[slot])
        await tier.write(slot, key(i), NS, d, cs(i, d))
    s = tier.stats()
    assert s["blocks"] == 6 and s["used_bytes"] <= capacity
    assert s["used_bytes"] == sum(NvmeTier.slot_bytes_for(held[x]) for x in sorted(held)[:6])
    assert s["reserved_slots"] == len(held) - 6
    assert os.stat(path).st_size == capacity


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 3, 17, 40]), st.booleans()), max_size=300))
def test_allocator_slots_disjoint_and_reusable(ops):
    """Property: under any allocate/free sequence, slots of all classes stay disjoint, inside the
    data region, and a freed slot comes back before a new slab is carved."""
    geo = Geometry.plan((2 << 20) + 5 * PAGE, 256 << 10)
    alloc = SlotAllocator(geo)
    held: dict[int, int] = {}
    for pages, do_free in ops:
        size = pages * PAGE
        if do_free and held:
            slot = next(iter(held))
            del held[slot]
            alloc.release(slot)
            carved = alloc.version
            again = alloc.allocate(alloc.slot_bytes_at(slot))
            assert again is not None and alloc.version == carved
            held[again] = alloc.slot_bytes_at(slot)
            continue
        got = alloc.allocate(size)
        if got is not None:
            held[got] = size
    spans = sorted((s, s + n) for s, n in held.items())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert all(geo.data_start <= s and e <= geo.capacity_bytes for s, e in spans)


# ---------------------------------------------------------------------------- recovery
@pytest.mark.parametrize("direct_io", [True, False])
async def test_restart_recovers_every_record_bit_exact(opened, tmp_path, direct_io):
    tier, _ = await opened(codec="lz4", direct_io=direct_io)
    written = {}
    for i in range(40):
        n = [8192, 30000, 131072][i % 3]
        slot, data = await put(tier, i, n, compressible=i % 2 == 0)
        written[i] = (slot, data)
    await tier.close()
    tier2, records = await opened(direct_io=direct_io)  # codec off: records say their codec
    assert [r.seq for r in records] == sorted(r.seq for r in records)
    by_key = {r.key: r for r in records}
    assert set(by_key) == {key(i) for i in written}
    for i, (slot, data) in written.items():
        r = by_key[key(i)]
        assert (r.slot, r.namespace, r.length, r.checksum) == (
            slot,
            NS,
            len(data),
            cs(i, data),
        )
        assert await read(tier2, slot, i, len(data), r.checksum) == data
        # lz4 keeps what it shrinks by a page or more; random bytes are stored raw.
        assert (r.stored_length < r.length) == (i % 2 == 0), (i, r.stored_length, r.length)
    # New writes after recovery get higher sequence numbers than anything recovered.
    _, _ = await put(tier2, 1000, 4096)
    assert tier2.stats()["blocks"] == 41
    assert tier2.check().ok


async def test_freed_slots_are_not_recovered(opened):
    tier, _ = await opened()
    slots = [(await put(tier, i, 20000))[0] for i in range(10)]
    for s in slots[::2]:
        tier.free(s)
    await tier.close()
    tier2, records = await opened()
    assert sorted(r.key for r in records) == [key(i) for i in range(1, 10, 2)]
    assert tier2.check().ok


async def test_newest_copy_of_a_key_wins(opened):
    tier, _ = await opened()
    _first, data = await put(tier, 5, 8192)
    second, _ = await put(tier, 5, 8192)  # the daemon re-demoted the block to another slot
    await tier.close()
    tier2, records = await opened()
    assert [(r.key, r.slot) for r in records] == [(key(5), second)]
    assert await read(tier2, second, 5, 8192, cs(5, data)) == data
    await tier2.drain()
    assert tier2.check().ok  # the older copy was tombstoned, not left as an orphan


async def test_second_open_of_a_directory_is_refused(opened, tmp_path):
    await opened()
    with pytest.raises(RuntimeError, match="in use"):
        await NvmeTier(tmp_path / "nvme", 16 << 20, slab_bytes=1 << 20).open()


def snapshot(path: Path) -> tuple[bytes, int, int]:
    """A file's bytes, size and modification time: what a reader must leave as it found."""
    st = os.stat(path)
    return path.read_bytes(), st.st_size, st.st_mtime_ns


@pytest.mark.parametrize(
    ("capacity", "slab_bytes", "named"),
    [
        (8 << 20, 1 << 20, "8388608 bytes (8MiB)"),
        (32 << 20, 1 << 20, "33554432 bytes (32MiB)"),
        (16 << 20, 2 << 20, "2097152 bytes (2MiB) slabs"),
    ],
)
async def test_a_geometry_change_is_refused_not_reformatted(
    opened, tmp_path, capacity, slab_bytes, named
):
    """The bug: a daemon started with another (mistyped) capacity reformatted the tier. It is
    refused, naming both geometries, and the file is left as it was."""
    tier, _ = await opened()
    await put(tier, 1, 8192)
    await tier.close()
    path = tmp_path / "nvme" / FILE_NAME
    before = snapshot(path)
    with pytest.raises(NvmeFormatError) as info:
        await opened(capacity=capacity, slab_bytes=slab_bytes)
    assert "16777216 bytes (16MiB) in 1048576 bytes (1MiB) slabs" in str(info.value)
    assert named in str(info.value) and "delete the file" in str(info.value)
    assert snapshot(path) == before
    _, records = await opened()  # the right geometry finds everything still there
    assert [r.key for r in records] == [key(1)]


@pytest.mark.parametrize("damage", ["slab map", "page count", "magic", "both copies"])
async def test_damaged_metadata_and_a_mistyped_capacity_are_refused_not_reformatted(
    opened, tmp_path, damage
):
    """The bug: with copy A damaged, copy B was looked for where the configured geometry puts
    it; a mistyped capacity whose metadata is of another page count found neither copy nor a
    descriptor, took the file for a blank one and reformatted it: every record gone, and the
    right capacity refused from then on. B is now found where it is, and a file holding pages
    of this format that nothing vouches for is refused, never reformatted."""
    tier, _ = await opened()
    await put(tier, 1, 8192)
    await tier.close()
    path = tmp_path / "nvme" / FILE_NAME
    if damage == "both copies":  # every byte of both copies: only the descriptors are left
        with open(path, "r+b") as f:
            f.write(bytes(tier.geometry.data_start))
    else:
        flip(path, {"slab map": 100, "page count": 12, "magic": 0}[damage])
    before = snapshot(path)
    wrong = 4 << 30  # its metadata takes 5 pages, not 1
    assert Geometry.plan(wrong, 1 << 20).meta_pages != tier.geometry.meta_pages
    with pytest.raises(NvmeFormatError) as info:
        await opened(capacity=wrong)
    assert "delete the file" in str(info.value)
    assert snapshot(path) == before
    _, records = await opened()  # the right geometry finds the record still there
    assert [r.key for r in records] == [key(1)]


async def test_a_file_that_never_held_a_record_is_still_formatted(opened, tmp_path):
    """No slab or record page: a first format cut short (only copy A's first page reached
    the disk), an empty tier whose both copies are damaged. (The refusal above took them for
    tiers, and a power cut during a daemon's first start left it unable to start.)"""
    tier, _ = await opened()
    geo = tier.geometry
    await tier.close()
    path = tmp_path / "nvme" / FILE_NAME
    formatted = path.read_bytes()
    torn = bytearray(len(formatted))
    torn[:64] = formatted[:64]  # a torn first page of copy A; nothing else written
    path.write_bytes(bytes(torn))
    tier, records = await opened()
    assert records == []
    await tier.close()
    for copy in (0, 1):  # an empty tier, one byte of each copy damaged
        flip(path, geo.meta_offset(copy) + 100)
    tier, records = await opened()
    assert records == []
    await put(tier, 1, 8192)
    await tier.close()
    again, records = await opened()
    assert [r.key for r in records] == [key(1)]
    await again.close()


async def test_a_blank_or_foreign_file_is_still_formatted(opened, tmp_path):
    """What no page of this format is in: a file of zeros, or of other bytes."""
    for content in (bytes(1 << 20), b"not a tier " * 100_000):
        (tmp_path / "nvme").mkdir(exist_ok=True)
        (tmp_path / "nvme" / FILE_NAME).write_bytes(content)
        tier, records = await opened()
        assert records == []
        await put(tier, 2, 8192)
        await tier.close()
        again, records = await opened()
        assert [r.key for r in records] == [key(2)]
        await again.close()


# ---------------------------------------------------------------------------- mixed block sizes
async def test_a_slab_emptied_of_one_size_is_taken_by_another(opened):
    """The bug: a slab once carved for one slot size was never taken back, so after one block
    size had filled the tier a second size never got a slot."""
    tier, _ = await opened()
    a, b = 65536, 200_000
    written = await fill(tier, a)
    assert tier.allocate(b) is None
    victim = tier.slab_of(written[7][0])
    assert tier.carved_slabs()[victim] == NvmeTier.slot_bytes_for(a)
    in_victim = sorted(s for s, _ in written.values() if tier.slab_of(s) == victim)
    assert sorted(tier.live_slots(victim)) == in_victim
    for s in in_victim:
        tier.free(s)
    assert tier.live_slots(victim) == [] and victim not in tier.carved_slabs()
    new = {}
    while (slot := tier.allocate(b)) is not None:
        j = 1000 + len(new)
        data = block(j, b)
        await tier.write(slot, key(j), NS, data, cs(j, data))
        new[j] = slot
    assert len(new) == 5 and {tier.slab_of(s) for s in new.values()} == {victim}
    assert tier.allocate(a) is None  # every other slab is still full of size a
    assert tier.check().ok
    await tier.close()
    expected = {i: s for i, (s, _) in written.items() if tier.slab_of(s) != victim} | new
    tier2, found = await recovered(opened)
    assert found == expected
    assert tier2.carved_slabs()[victim] == NvmeTier.slot_bytes_for(b)
    assert tier2.check().ok


@contextlib.contextmanager
def writes_fail_from(offset: int):
    """Every write of this process at or past ``offset`` of any file fails with EFBIG while
    inside: RLIMIT_FSIZE, a real kernel failure (Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (offset, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


async def test_a_recarved_slab_settles_the_old_carvings_failed_tombstones(opened):
    """A slab whose last records were freed goes back to the pool even if their tombstones
    failed; those are retried before any byte of the new carving is written, never after (a
    late tombstone of the old carving would land inside a new record)."""
    tier, _ = await opened()
    a, b = 20000, 100_000
    written = await fill(tier, a)
    victim = max(tier.carved_slabs())
    limit = tier.geometry.slab_start(victim)
    with writes_fail_from(limit):
        for slot in tier.live_slots(victim):
            tier.free(slot)
        await tier.drain()
    assert tier.stats()["io_errors"] > 0  # the tombstones failed
    assert victim not in tier.carved_slabs()
    new = {}
    while (slot := tier.allocate(b)) is not None:
        j = 1000 + len(new)
        data = block(j, b)
        await tier.write(slot, key(j), NS, data, cs(j, data))
        new[j] = slot
    assert {tier.slab_of(s) for s in new.values()} == {victim}
    await tier.close()  # retries whatever tombstone is still failed
    _, found = await recovered(opened)  # reads every record back bit-exact
    assert found == {i: s for i, (s, _) in written.items() if s < limit} | new


async def test_mixed_sizes_churn_shares_the_tier(opened):
    """Four block sizes whose mix shifts over time, under a daemon-like policy: when a size is
    refused, empty the carved slab with the fewest live slots (``live_slots``) and ask again.
    Every refused size gets a slot that way, slabs change sizes, and the tier recovers exactly
    the live records."""
    tier, _ = await opened(capacity=12 << 20, slab_bytes=512 << 10)
    sizes = [8192, 30000, 100_000, 300_000]
    rng = random.Random(3)
    live: dict[int, tuple[int, int]] = {}  # slot -> (block, size)
    sizes_seen: dict[int, set[int]] = {}  # slab -> slot sizes it was carved for
    refused = 0
    for i in range(500):
        n = sizes[i // 125] if rng.random() < 0.8 else rng.choice(sizes)
        slot = tier.allocate(n)
        if slot is None:
            refused += 1
            victim = min(tier.carved_slabs(), key=lambda s: len(tier.live_slots(s)))
            for s in tier.live_slots(victim):
                tier.free(s)
                del live[s]
            slot = tier.allocate(n)
            assert slot is not None, "an emptied slab must take any size"
        data = block(i, n)
        await tier.write(slot, key(i), NS, data, cs(i, data), durable=i % 2 == 0)
        live[slot] = (i, n)
        for slab, slot_bytes in tier.carved_slabs().items():
            sizes_seen.setdefault(slab, set()).add(slot_bytes)
        if live and rng.random() < 0.3:
            gone = rng.choice(sorted(live))
            tier.free(gone)
            del live[gone]
    assert refused > 10 and max(len(v) for v in sizes_seen.values()) >= 3
    spans = sorted((s, s + NvmeTier.slot_bytes_for(n)) for s, (_, n) in live.items())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    st_ = tier.stats()
    assert st_["blocks"] == len(live) and st_["reserved_slots"] == 0
    assert st_["used_bytes"] == sum(NvmeTier.slot_bytes_for(n) for _, n in live.values())
    await tier.drain()
    assert tier.check().ok
    await tier.close()
    tier2, found = await recovered(opened, capacity=12 << 20, slab_bytes=512 << 10)
    assert found == {i: slot for slot, (i, _) in live.items()}
    assert tier2.check().ok


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 3, 17, 40]), st.booleans()), max_size=300))
def test_allocator_returns_empty_slabs_to_the_pool(ops):
    """Property: with empty slabs uncarved as soon as they empty, slots stay disjoint and inside
    the data region, each slab's use count is right, and a size that fits a slab is refused
    only when no slab is in the pool."""
    geo = Geometry.plan((2 << 20) + 5 * PAGE, 256 << 10)
    alloc = SlotAllocator(geo)
    held: dict[int, int] = {}
    for pages, do_free in ops:
        if do_free and held:
            slot = next(iter(held))
            del held[slot]
            if alloc.release(slot):
                alloc.uncarve(geo.slab_of(slot))
            continue
        got = alloc.allocate(pages * PAGE)
        if got is None:
            fits = [s for s in range(len(geo.slab_sizes)) if geo.slot_count(s, pages * PAGE)]
            assert all(alloc.slab_slot_bytes[s] for s in fits), "refused, a slab in the pool"
        else:
            held[got] = pages * PAGE
    spans = sorted((s, s + n) for s, n in held.items())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert all(geo.data_start <= s and e <= geo.capacity_bytes for s, e in spans)
    for slab in range(len(geo.slab_sizes)):
        mine = [s for s in held if geo.slab_of(s) == slab]
        assert alloc.used[slab] == len(mine)
        assert all(alloc.slot_bytes_at(s) == held[s] for s in mine)


# ---------------------------------------------------------------------------- damaged metadata
async def fill(tier: NvmeTier, n: int, count: int | None = None) -> dict[int, tuple[int, bytes]]:
    """Blocks 0, 1, ... of ``n`` bytes until the tier is full (or ``count`` are written)."""
    written: dict[int, tuple[int, bytes]] = {}
    for i in itertools.count():
        if i == count or (slot := tier.allocate(n)) is None:
            return written
        data = block(i, n)
        await tier.write(slot, key(i), NS, data, cs(i, data))
        written[i] = (slot, data)
    raise AssertionError("unreachable")


async def recovered(opened, **kw) -> tuple[NvmeTier, dict[int, int]]:
    """Reopen and read back every recovered record: {block number: slot}; asserts each is
    bit-exact."""
    tier, records = await opened(**kw)
    found = {int.from_bytes(r.key, "big"): r.slot for r in records}
    for r in records:
        i = int.from_bytes(r.key, "big")
        assert await read(tier, r.slot, i, r.length, r.checksum) == block(i, r.length)
    return tier, found


def slabs_of(tier: NvmeTier, slots) -> set[int]:
    return {tier.geometry.slab_of(s) for s in slots}


@pytest.mark.parametrize("copy", [0, 1])
async def test_a_damaged_metadata_byte_loses_no_record(opened, tmp_path, copy):
    """The bug: one damaged superblock byte (page 0) made the next open reformat the tier."""
    tier, _ = await opened()
    written = await fill(tier, 65536, 40)
    if copy:
        assert tier.geometry.meta_offset(copy) == PAGE
    await tier.close()
    for offset in (8, 60, 100):  # version, sequence hint, slab map: each voids the copy
        flip(tmp_path / "nvme" / FILE_NAME, copy * PAGE + offset)
        tier2, found = await recovered(opened)
        assert found == {i: slot for i, (slot, _) in written.items()}
        assert tier2.check().ok
        await tier2.close()  # the damaged copy was rewritten at open


async def test_both_metadata_copies_lost_rebuilt_from_slab_descriptors(opened, tmp_path):
    tier, _ = await opened()
    written = await fill(tier, 65536, 40)
    geo = tier.geometry
    assert len(slabs_of(tier, (s for s, _ in written.values()))) == 3
    await tier.close()
    with open(tmp_path / "nvme" / FILE_NAME, "r+b") as f:
        f.write(bytes(geo.data_start))
    tier2, found = await recovered(opened)
    assert found == {i: slot for i, (slot, _) in written.items()}
    await put(tier2, 100, 65536)  # and the tier goes on, with both copies written again
    await tier2.close()
    _, found = await recovered(opened)
    assert len(found) == 41


async def test_a_damaged_slab_descriptor_falls_back_to_the_metadata(opened, tmp_path):
    tier, _ = await opened()
    written = await fill(tier, 65536, 40)
    geo = tier.geometry
    await tier.close()
    path = tmp_path / "nvme" / FILE_NAME
    flip(path, geo.slab_start(1) + 40)
    tier2, found = await recovered(opened)
    assert found == {i: slot for i, (slot, _) in written.items()}
    await tier2.close()
    # The descriptor was rewritten at open: now the metadata copies may go too.
    with open(path, "r+b") as f:
        f.write(bytes(geo.data_start))
    _, found = await recovered(opened)
    assert len(found) == 40


async def test_descriptor_and_metadata_both_damaged_lose_only_that_slab(opened, tmp_path):
    tier, _ = await opened()
    written = await fill(tier, 65536, 40)
    geo = tier.geometry
    await tier.close()
    path = tmp_path / "nvme" / FILE_NAME
    with open(path, "r+b") as f:
        f.write(bytes(geo.data_start))
    flip(path, geo.slab_start(1) + 40)
    _, found = await recovered(opened)
    assert found == {i: slot for i, (slot, _) in written.items() if geo.slab_of(slot) != 1}


async def test_a_truncated_file_keeps_the_records_inside_it(opened, tmp_path):
    """The bug: a file cut by 4 KiB was reformatted. Records wholly inside the remaining bytes
    survive; the file grows back to its capacity and the tier goes on."""
    capacity = 4 << 20
    tier, _ = await opened(capacity=capacity, slab_bytes=256 << 10)
    n = 8192 - 100  # 12 KiB slots
    written = await fill(tier, n)
    last = max(slot for slot, _ in written.values())
    await tier.close()
    path = tmp_path / "nvme" / FILE_NAME
    os.truncate(path, capacity - PAGE)
    tier2, found = await recovered(opened, capacity=capacity, slab_bytes=256 << 10)
    inside = {i: slot for i, (slot, _) in written.items() if slot + 3 * PAGE <= capacity - PAGE}
    assert found == inside and len(found) >= len(written) - 1
    assert os.stat(path).st_size == capacity
    await tier2.close()
    cut = last + 2 * PAGE  # inside the last record's payload
    os.truncate(path, cut)
    tier3, found = await recovered(opened, capacity=4 << 20, slab_bytes=256 << 10)
    assert found == {i: slot for i, (slot, _) in written.items() if slot != last}
    assert tier3.check().ok  # the cut record's header was tombstoned, not left as an orphan
    assert tier3.allocate(n) == last  # its slot is free again and can be written
    data = block(999, n)
    await tier3.write(last, key(999), NS, data, cs(999, data))
    await tier3.close()
    _, found = await recovered(opened, capacity=4 << 20, slab_bytes=256 << 10)
    assert found[999] == last and len(found) == len(written)


# ---------------------------------------------------------------------------- kvstore check
def kvstore_check(directory: Path, capacity: str, *extra: str) -> tuple[int, str, str]:
    """``kvstore check`` run in a fresh process, as an operator runs it: (exit code, out, err)."""
    argv = [sys.executable, "-m", "kvstore", "check", "--nvme-path", str(directory), "--json"]
    argv += ["--nvme-capacity", capacity, "--nvme-slab-bytes", "1MiB", *extra]
    r = subprocess.run(argv, capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


async def damaged_tier(opened, tmp_path) -> tuple[Path, dict[int, int]]:
    """A closed tier with a damaged payload (block 7), a damaged metadata copy, a damaged slab
    descriptor and two copies of block 3 (a read-write open tombstones the older): everything
    a read-only check reports, and more that a read-write open would write."""
    tier, _ = await opened()
    written = {i: slot for i, (slot, _) in (await fill(tier, 65536, 40)).items()}
    written[3], _ = await put(tier, 3, 65536)
    await tier.close()
    path = tmp_path / "nvme" / FILE_NAME
    flip(path, written[7] + PAGE + 9)
    flip(path, PAGE + 60)  # metadata copy B
    flip(path, tier.geometry.slab_start(2) + 30)
    return path, written


async def test_check_without_fix_never_writes(opened, tmp_path):
    """The bug: ``kvstore check`` opened the tier read-write (state rewritten, duplicates
    tombstoned) even without --fix. It reads only: the bytes and mtime stay as they were."""
    path, written = await damaged_tier(opened, tmp_path)
    before = snapshot(path)
    code, out, err = kvstore_check(path.parent, "16MiB")
    assert snapshot(path) == before, err
    assert code == 1, err
    report = json.loads(out)
    kinds = sorted(p["kind"] for p in report["problems"])
    assert kinds == ["corrupt", "metadata", "metadata"], report
    assert report["records_ok"] == 39
    # --fix repairs: afterwards a read-only check finds nothing, and the records are there.
    code, out, err = kvstore_check(path.parent, "16MiB", "--fix")
    assert code == 0, out + err
    code, out, err = kvstore_check(path.parent, "16MiB")
    assert code == 0 and json.loads(out)["problems"] == [], out + err
    _, found = await recovered(opened)
    assert found == {i: s for i, s in written.items() if i != 7}


async def test_check_with_a_mistyped_capacity_is_an_error_not_a_format(opened, tmp_path):
    """The bug: ``check`` with a mistyped --nvme-capacity reformatted the file and exited 0."""
    tier, _ = await opened()
    await put(tier, 1, 8192)
    await tier.close()
    path = tmp_path / "nvme" / FILE_NAME
    before = snapshot(path)
    for extra in ((), ("--fix",)):
        code, _, err = kvstore_check(path.parent, "8MiB", *extra)
        assert code == 2, err
        assert "16777216 bytes (16MiB)" in err and "8388608 bytes (8MiB)" in err, err
        assert snapshot(path) == before
    code, _, err = kvstore_check(path.parent, "16MiB")
    assert code == 0, err


async def test_check_of_nothing_or_an_old_format_is_an_error_and_writes_nothing(tmp_path):
    code, _, err = kvstore_check(tmp_path / "absent", "16MiB")
    assert code == 2 and "No such file" in err
    assert not (tmp_path / "absent").exists()
    path = tmp_path / "old" / FILE_NAME
    write_version_1_file(path, 16 << 20, 1 << 20, block(1, 16384))
    before = snapshot(path)
    for extra in ((), ("--fix",)):
        code, _, err = kvstore_check(path.parent, "16MiB", *extra)
        assert code == 2 and "format version 1" in err, err
        assert snapshot(path) == before


async def test_check_while_the_tier_is_open_is_refused(opened, tmp_path):
    tier, _ = await opened()
    await put(tier, 1, 8192)
    code, _, err = kvstore_check(tmp_path / "nvme", "16MiB")
    assert code == 2 and "in use" in err, err


# ---------------------------------------------------------------------------- crashes
async def _child(directory: str, mode: str) -> None:
    tier = NvmeTier(directory, 16 << 20, slab_bytes=1 << 20)
    records = await tier.open()
    if mode == "free":
        slots = [(await put(tier, i, 20000))[0] for i in range(10)]
        for s in slots[::2]:
            tier.free(s)
        await tier.drain()
        print("DRAINED", flush=True)
        await asyncio.sleep(120)
        return
    if mode == "durable":
        # Each write mode, then a crash with the tier object never closed.
        for i in range(30):
            n = CHILD_SIZES[i % len(CHILD_SIZES)]
            slot = tier.allocate(n)
            assert slot is not None
            data = block(i, n)
            await tier.write(slot, key(i), NS, data, cs(i, data), durable=i < 10)
            if i == 19:
                await tier.sync()
        print("WRITTEN", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    # Churn: keys from the base up, every other write durable; what an earlier run left is
    # evicted oldest first too. "mixed:": the size mix shifts every 120 writes and eviction is
    # oldest first over every size, so slabs change sizes; else each size evicts its own.
    mixed, base = mode.startswith("mixed:"), int(mode.split(":")[-1])
    live: list[deque[tuple[int, int]]] = [deque() for _ in CHILD_SIZES]
    for r in sorted(records, key=lambda r: r.seq):
        k = 0 if mixed else CHILD_SIZES.index(r.length)
        live[k].append((int.from_bytes(r.key, "big"), r.slot))
    counter = iter(range(base, 1 << 40))
    rng = random.Random(base)

    async def writer() -> None:
        while True:
            i = next(counter)
            n = CHILD_SIZES[i % len(CHILD_SIZES)]
            if mixed and rng.random() < 0.8:
                n = CHILD_SIZES[(i - base) // 120 % len(CHILD_SIZES)]
            k = 0 if mixed else i % len(CHILD_SIZES)
            while (slot := tier.allocate(n)) is None:
                if live[k]:
                    j, old = live[k].popleft()
                    print(f"F {j}", flush=True)  # before the free: j may or may not come back
                    tier.free(old)
                else:
                    await asyncio.sleep(0.001)
            data = block(i, n)
            await tier.write(slot, key(i), NS, data, cs(i, data), durable=i % 2 == 0)
            print(f"W {i} {slot} {n}", flush=True)
            live[k].append((i, slot))

    await asyncio.gather(*(writer() for _ in range(8)))


def _run_and_kill(directory: Path, mode: str, until) -> list[str]:
    argv = [sys.executable, __file__, str(directory), mode]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 120
    try:
        assert proc.stdout is not None
        while not until(lines):
            line = proc.stdout.readline()
            assert line, f"child exited early with {proc.wait()}"
            lines.append(line.strip())
            assert time.monotonic() < deadline, "child too slow"
        time.sleep(random.uniform(0, 0.03))  # land the kill anywhere, not at a line boundary
        proc.send_signal(signal.SIGKILL)
        lines += proc.stdout.read().splitlines()  # completed writes still in the pipe count too
    finally:
        proc.kill()
        proc.wait()
    return lines


@pytest.mark.parametrize("mix", ["", "mixed:"])
async def test_sigkill_mid_write_recovers_every_acknowledged_block(tmp_path, mix):
    """Two rounds: a child churns writes (durable and plain) and frees, 8 in flight, and is
    SIGKILLed at a random moment; open() must return every block it acknowledged and not freed,
    each bit-exact, and nothing else that fails to read back. The second child starts from the
    first's wreckage. Mixed: slabs are emptied and carved for other sizes all along."""
    directory = tmp_path / "nvme"
    written: dict[int, tuple[int, int]] = {}
    freed: set[int] = set()
    for base in (0, 1 << 20):
        mode = f"{mix}{base}"
        lines = _run_and_kill(directory, mode, lambda ls: sum(x[0] == "W" for x in ls) >= 250)
        for line in lines:
            op, number, *where = line.split()
            if op == "W":
                written[int(number)] = (int(where[0]), int(where[1]))
            else:
                freed.add(int(number))
        assert len(written) >= 250 * (1 + (base > 0)) and freed, "the child should churn"
        tier = NvmeTier(directory, 16 << 20, slab_bytes=1 << 20)
        records = await tier.open()
        try:
            by_i = {int.from_bytes(r.key, "big"): r for r in records}
            missing = [i for i in written if i not in freed and i not in by_i]
            assert not missing, f"acknowledged writes lost: {missing[:10]}"
            for i, (slot, n) in written.items():
                if i not in freed:
                    assert (by_i[i].slot, by_i[i].length) == (slot, n)
            for i, r in by_i.items():  # every recovered record is whole, printed or not
                data = block(i, r.length)
                assert await read(tier, r.slot, i, len(data), r.checksum) == data
            assert tier.check().ok
        finally:
            await tier.close()


async def test_every_write_mode_survives_a_process_crash(opened, tmp_path):
    """A child writes 10 blocks with durable=True, 10 plain then sync(), 10 plain, and is
    SIGKILLed straight after, its tier never closed: all 30 come back bit-exact (a process crash
    is within every mode's promise)."""
    directory = tmp_path / "nvme"
    r = subprocess.run([sys.executable, __file__, str(directory), "durable"], capture_output=True)
    assert r.returncode == -signal.SIGKILL and b"WRITTEN" in r.stdout, r.stderr.decode()[-2000:]
    tier, found = await recovered(opened, directory=directory)
    assert sorted(found) == list(range(30))
    assert tier.check().ok


class PageCache:
    """Whether a file's pages are dirty in the page cache, i.e. not yet on the device, as the
    kernel says (``/proc/kpageflags`` of the pages a shared read-only mapping maps). Needs
    root; ``dirty`` is None where the kernel will not tell."""

    DIRTY, WRITEBACK = 1 << 4, 1 << 8

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self._map = mmap.mmap(self._fd, os.stat(path).st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)

    def dirty(self, offset: int) -> bool | None:
        int(self._bytes[offset])  # maps the page
        address = self._bytes.ctypes.data + offset
        try:
            with open("/proc/self/pagemap", "rb") as f:
                f.seek(address // PAGE * 8)
                entry = int.from_bytes(f.read(8), "little")
            pfn = entry & ((1 << 55) - 1)
            if not entry >> 63 or not pfn:
                return None
            with open("/proc/kpageflags", "rb") as f:
                f.seek(pfn * 8)
                flags = int.from_bytes(f.read(8), "little")
        except OSError:
            return None
        return bool(flags & (self.DIRTY | self.WRITEBACK))

    def close(self) -> None:
        del self._bytes
        self._map.close()
        os.close(self._fd)


async def test_durable_writes_and_sync_leave_nothing_in_the_page_cache(opened, tmp_path):
    """The bug: nothing but a write's own barriers made a record durable, so a daemon could
    not write plain and acknowledge after one barrier. Buffered IO, so the page cache shows
    what has not reached the device: a plain write leaves its pages dirty, ``sync`` cleans
    them; a durable write returns with its header, payload, slab descriptor and the metadata
    clean."""
    tier, _ = await opened(direct_io=False)
    geo = tier.geometry
    cache = PageCache(tmp_path / "nvme" / FILE_NAME)
    try:
        slot, _ = await put(tier, 1, 65536, durable=False)
        pages = [slot, slot + PAGE, slot + 16 * PAGE, geo.slab_start(geo.slab_of(slot))]
        pages += [geo.meta_offset(0), geo.meta_offset(1)]
        seen = [cache.dirty(p) for p in pages]
        if None in seen or not seen[0]:
            pytest.skip(f"the page cache's dirty pages cannot be seen here: {seen}")
        assert seen[:4] == [True] * 4  # header, payload, descriptor of a newly carved slab
        syncs = tier.stats()["flushes"]
        await asyncio.gather(*(tier.sync() for _ in range(8)))
        assert tier.stats()["flushes"] - syncs <= 2  # concurrent callers share fdatasyncs
        assert [cache.dirty(p) for p in pages] == [False] * len(pages)
        slot2, _ = await put(tier, 2, 100_000)  # durable, in a slab carved for it
        assert geo.slab_of(slot2) != geo.slab_of(slot)
        pages2 = [slot2, slot2 + PAGE, slot2 + 24 * PAGE, geo.slab_start(geo.slab_of(slot2))]
        pages2 += [geo.meta_offset(0), geo.meta_offset(1)]
        assert [cache.dirty(p) for p in pages2] == [False] * len(pages2)
        s = tier.stats()
        assert (s["writes"], s["durable_writes"], s["syncs"]) == (2, 1, 8)
    finally:
        cache.close()


async def test_sigkill_after_free_does_not_resurrect(opened, tmp_path):
    directory = tmp_path / "nvme"
    _run_and_kill(directory, "free", lambda ls: "DRAINED" in ls)
    _, records = await opened(directory=directory)
    assert sorted(r.key for r in records) == [key(i) for i in range(1, 10, 2)]


# ---------------------------------------------------------------------------- corruption
@pytest.mark.parametrize("codec", [None, "lz4"])
async def test_flipped_payload_byte_is_a_miss(opened, tmp_path, codec):
    tier, _ = await opened(codec=codec)
    put_ = [await put(tier, i, 65536, compressible=codec is not None) for i in range(5)]
    await tier.close()
    flip(tmp_path / "nvme" / FILE_NAME, put_[2][0] + PAGE + 100)
    tier2, records = await opened(codec=codec)
    assert len(records) == 5  # the header is intact: only reading finds the damage
    for i, (slot, data) in enumerate(put_):
        got = await read(tier2, slot, i, 65536, cs(i, data))
        assert got == (None if i == 2 else data)
    s = tier2.stats()
    assert s["checksum_failures"] == 1 and s["misses"] == 1
    tier2.free(put_[2][0])  # what the daemon does with a miss
    assert tier2.check().ok


async def test_flipped_header_byte_drops_the_record_at_recovery(opened, tmp_path):
    tier, _ = await opened()
    put_ = [await put(tier, i, 16384) for i in range(5)]
    await tier.close()
    flip(tmp_path / "nvme" / FILE_NAME, put_[3][0] + 60)  # inside the key field
    tier2, records = await opened()
    assert sorted(r.key for r in records) == [key(i) for i in (0, 1, 2, 4)]
    # The slot went back to the free pool: filling the tier hands it out again.
    handed = set()
    while (s := tier2.allocate(16384)) is not None:
        handed.add(s)
    assert put_[3][0] in handed and put_[0][0] not in handed


async def test_check_finds_and_fixes_corruption(opened, tmp_path):
    tier, _ = await opened()
    path = tmp_path / "nvme" / FILE_NAME
    put_ = [await put(tier, i, 16384) for i in range(6)]
    (a, _), (b, _), (c, _) = put_[0], put_[1], put_[2]
    with open(path, "rb") as f:
        f.seek(c)
        c_header = f.read(PAGE)
    tier.free(c)
    await tier.drain()  # its tombstone is on disk
    flip(path, a + PAGE + 7)  # payload
    flip(path, b + 70)  # header
    with open(path, "r+b") as f:  # a lost tombstone: c's old header is back
        f.seek(c)
        f.write(c_header)
    report = tier.check()
    kinds = {p.slot: p.kind for p in report.problems}
    assert kinds == {a: "corrupt", b: "torn", c: "orphan"}
    assert report.records_ok == 3 and not report.ok
    fixed = tier.check(fix=True)
    assert fixed.fixed and {p.key for p in fixed.problems} == {key(0), key(1), key(2)}
    assert tier.stats()["blocks"] == 3
    await tier.drain()
    assert tier.check().ok
    await tier.close()
    _, records = await opened()
    assert sorted(r.key for r in records) == [key(i) for i in (3, 4, 5)]


# ---------------------------------------------------------------------------- bound checksums
async def test_unbound_checksum_is_refused(opened):
    """A checksum of the bytes alone (or bound to another key) does not describe a block."""
    tier, _ = await opened()
    data = block(1, 8192)
    unbound = xxhash.xxh3_64_intdigest(data)
    for wrong in (unbound, cs(2, data), block_checksum(data, OTHER_NS, key(1))):
        slot = tier.allocate(8192)
        with pytest.raises(ValueError, match="checksum"):
            await tier.write(slot, key(1), NS, data, wrong)
    assert tier.stats()["reserved_slots"] == 0


async def test_header_naming_another_key_is_a_miss(opened, tmp_path):
    """The field bug: bytes served under a key they were not committed for. A header whose key
    was rewritten (and its header checksum made valid again) is recovered as a record of the
    other key, but its bytes never verify as that key's block."""
    tier, _ = await opened()
    s1, data = await put(tier, 1, 16384)
    await tier.close()
    path = tmp_path / "nvme" / FILE_NAME
    with open(path, "r+b") as f:
        f.seek(s1)
        h = ondisk.parse_header(f.read(PAGE))
        assert h is not None
        f.seek(s1)
        f.write(ondisk.pack_header(h._replace(key=key(7))))
    tier2, records = await opened()
    assert [(r.key, r.slot, r.checksum) for r in records] == [(key(7), s1, cs(1, data))]
    assert await read(tier2, s1, 7, 16384, records[0].checksum) is None
    assert tier2.stats()["checksum_failures"] == 1


def write_version_1_file(path: Path, capacity: int, slab_bytes: int, data: bytes) -> int:
    """A slab file as format version 1 wrote it (superblock, two state copies, slabs from page
    3): one committed record of block 1 in the first slot, with its unbound checksum. Returns
    the record's slot."""
    fid, slot_pages, slot = 12345, 1 + len(data) // PAGE, 3 * PAGE
    slabs = (capacity - slot) // slab_bytes + 1
    f = bytearray(capacity)

    def seal(fmt: str, offset: int, *fields) -> None:
        end = offset + struct.calcsize(fmt)
        struct.pack_into(fmt, f, offset, *fields)
        struct.pack_into("<Q", f, end, xxhash.xxh3_64_intdigest(bytes(f[offset:end])))

    seal("<8sIIQQQQ", 0, b"KVNVSUP1", 1, 1, fid, capacity, slab_bytes, slot)
    state = [slot_pages] + [0] * (slabs - 1)
    seal(f"<8sIIQQQ{slabs}I", 2 * PAGE, b"KVNVSTA1", 1, slabs, fid, 1, 2, *state)
    header = (b"KVNVREC1", 1, 1, 0, slot_pages, slot, 1, fid, key(1), NS, len(data), len(data))
    seal("<8sHBBIQQQ32s16sQQQ", slot, *header, xxhash.xxh3_64_intdigest(data))
    f[slot + PAGE : slot + PAGE + len(data)] = data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(f)
    return slot


async def test_a_file_of_format_version_1_is_reformatted_not_misread(opened, tmp_path, caplog):
    """Version 1 stored unbound checksums: its records are recognised by the version in the
    superblock and dropped, never read as records of this version."""
    write_version_1_file(tmp_path / "nvme" / FILE_NAME, 16 << 20, 1 << 20, block(1, 16384))
    with caplog.at_level(logging.WARNING):
        _, records = await opened()
    assert records == []
    assert "format version 1" in caplog.text


# ---------------------------------------------------------------------------- failures
async def test_write_with_a_wrong_checksum_is_refused(opened):
    tier, _ = await opened()
    slot = tier.allocate(8192)
    data = block(1, 8192)
    with pytest.raises(ValueError, match="checksum"):
        await tier.write(slot, key(1), NS, data, cs(1, data) ^ 1)
    assert tier.stats()["reserved_slots"] == 0
    with pytest.raises(ValueError):
        await tier.read_into(slot, key(1), NS, 0, bytearray(8192))
    assert tier.allocate(8192) == slot


async def test_free_or_cancel_during_a_write_frees_after_it(opened):
    tier, _ = await opened()
    data = block(1, 65536)
    slot = tier.allocate(65536)
    task = asyncio.ensure_future(tier.write(slot, key(1), NS, data, cs(1, data)))
    await asyncio.sleep(0)
    tier.free(slot)
    await task
    slot2 = tier.allocate(65536)
    task2 = asyncio.ensure_future(tier.write(slot2, key(2), NS, data, cs(2, data)))
    await asyncio.sleep(0)
    task2.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task2
    await tier.drain()
    s = tier.stats()
    assert s["blocks"] == 0 and s["reserved_slots"] == 0
    assert slot2 == slot  # the first slot was freed after its write, and handed out again
    assert tier.allocate(65536) == slot2  # and so was the cancelled write's
    # free() and then cancel() of one write: the slot is freed once, not twice.
    task3 = asyncio.ensure_future(tier.write(slot2, key(3), NS, data, cs(3, data)))
    await asyncio.sleep(0)
    tier.free(slot2)
    while tier.stats()["reserved_slots"]:  # until the write has committed and freed the slot
        await asyncio.sleep(0)
    task3.cancel()  # lands before write() resumes: it sees a finished write
    with contextlib.suppress(asyncio.CancelledError):
        await task3
    await tier.drain()
    assert tier.stats()["blocks"] == 0 and tier.stats()["reserved_slots"] == 0
    assert len({tier.allocate(65536) for _ in range(3)}) == 3


@pytest.fixture
def tiny_fs(tmp_path):
    """An 8 MiB tmpfs."""
    with tmpfs(tmp_path / "tiny", "8M") as mnt:
        yield mnt


async def test_full_disk_raises_and_leaves_the_tier_usable(opened, tiny_fs):
    n = 256 << 10
    tier, _ = await opened(directory=tiny_fs, capacity=32 << 20)
    assert not tier.stats()["preallocated"]  # 32 MiB cannot be reserved on 8 MiB
    good = []
    with pytest.raises(NvmeIOError) as info:
        for i in range(200):
            slot = tier.allocate(n)
            assert slot is not None, "ran out of slots before the disk filled"
            data = block(i, n)
            await tier.write(slot, key(i), NS, data, cs(i, data))
            good.append((i, slot, data))
    assert info.value.errno == errno.ENOSPC
    assert len(good) > 10
    s = tier.stats()
    assert s["reserved_slots"] == 0 and s["io_errors"] == 1 and s["blocks"] == len(good)
    assert tier.allocate(n) == slot  # the failed slot is free again
    tier.free(slot)
    for i, s_, data in good:
        assert await read(tier, s_, i, n, cs(i, data)) == data
    # Freeing a written record gives back space that is already on disk: writes succeed again.
    _, s0, _ = good.pop(0)
    tier.free(s0)
    reused = tier.allocate(n)
    new = block(999, n)
    await tier.write(reused, key(999), NS, new, cs(999, new))
    assert await read(tier, reused, 999, n, cs(999, new)) == new
    await tier.close()
    _, records = await opened(directory=tiny_fs, capacity=32 << 20)
    assert sorted(r.key for r in records) == sorted([key(i) for i, _, _ in good] + [key(999)])


if __name__ == "__main__":
    asyncio.run(_child(sys.argv[1], sys.argv[2]))
