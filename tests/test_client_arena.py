"""``MappedArena.copy_in``, the put's copy into the daemon's slabs, on real shared memory.

The slabs are real sealed-size memfd files, handed over as descriptors by a stand-in for the
session (only ``slab(uid)``: what the daemon would send for that uid)."""

from __future__ import annotations

import os

import pytest
import torch
import xxhash
from conftest import smaps_kib

from kvstore.client._common import MappedArena
from kvstore.errors import KVStoreError

KiB, MiB = 1 << 10, 1 << 20


class Slabs:
    """Slab files by uid, as a session hands them over: (a new descriptor, size, writable)."""

    def __init__(self, sizes: dict[int, int], read_only: frozenset[int] = frozenset()) -> None:
        self.fds = {}
        for uid, size in sizes.items():
            fd = os.memfd_create(f"slab-{uid}", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            self.fds[uid] = fd
        self.sizes, self.read_only = sizes, read_only

    def slab(self, uid: int) -> tuple[int, int, bool]:
        return os.dup(self.fds[uid]), self.sizes[uid], uid not in self.read_only

    def read(self, uid: int, offset: int, n: int) -> bytes:
        return os.pread(self.fds[uid], n, offset)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


@pytest.mark.parametrize("block", [64 * KiB, 2 * MiB])  # one thread / split, one-shot / pieces
def test_copy_in_writes_each_block_to_its_slot_and_sums_the_source(block: int) -> None:
    slabs = Slabs({3: 8 * block, 9: 8 * block})
    arena = MappedArena(slabs)  # type: ignore[arg-type]
    try:
        n = 6
        rows = torch.randint(0, 256, (n, block), dtype=torch.uint8)
        addresses = [3 << 32, -1, (9 << 32) | 2 * block, (3 << 32) | 5 * block, -1, 9 << 32]
        seeds = [11 * (i + 1) for i in range(n)]
        sums = arena.copy_in(rows, addresses, seeds)
        written = [i for i, a in enumerate(addresses) if a >= 0]
        assert sums == [xxhash.xxh3_64_intdigest(rows[i].numpy(), seed=seeds[i]) for i in written]
        for i in written:
            uid, offset = addresses[i] >> 32, addresses[i] & 0xFFFFFFFF
            assert slabs.read(uid, offset, block) == rows[i].numpy().tobytes()
        assert slabs.read(3, block, block) == bytes(block)  # slots not named stay untouched
        assert arena.mapped_slabs == 2
    finally:
        arena.close()
        slabs.close()


def test_copy_in_refuses_a_slot_outside_its_slab_or_in_read_only_memory_before_copying() -> None:
    block = 64 * KiB
    slabs = Slabs({1: 4 * block, 2: 4 * block}, read_only=frozenset({2}))
    arena = MappedArena(slabs)  # type: ignore[arg-type]
    try:
        rows = torch.full((2, block), 7, dtype=torch.uint8)
        with pytest.raises(KVStoreError, match="outside its slab"):
            arena.copy_in(rows, [1 << 32, (1 << 32) | 3 * block + 4096], [1, 2])
        with pytest.raises(KVStoreError, match="may only read"):
            arena.copy_in(rows, [1 << 32, 2 << 32], [1, 2])
        assert slabs.read(1, 0, block) == bytes(block)  # nothing was copied
    finally:
        arena.close()
        slabs.close()


def test_seeds_are_checksum_seed_of_each_key() -> None:
    """``seeds_for`` inlines ``checksum_seed``: the seeds a put and a get use must be the
    ones every other path computes, for each namespace and key."""
    from kvstore.checksum import checksum_seed
    from kvstore.client._common import seeds_for
    from kvstore.keys import Namespace
    from kvstore.layout import KVLayout

    keys = [os.urandom(32) for _ in range(5)]
    for model in ("a", "b"):
        ns = Namespace(model=model, layout=KVLayout(2, 4, 64, 16))
        for _ in range(2):  # the second time from the cached fingerprint
            assert seeds_for(ns, keys) == [checksum_seed(ns.fingerprint, k) for k in keys]
    assert seeds_for(Namespace(model="a", layout=KVLayout(2, 4, 64, 16)), [bytearray(keys[0])]) == [
        checksum_seed(Namespace(model="a", layout=KVLayout(2, 4, 64, 16)).fingerprint, keys[0])
    ]


def _address(buffer: object) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))  # type: ignore[arg-type]


def _fault_around_is_64_kib() -> bool:
    """Whether one read of a written shared-memory page maps its 64 KiB (the kernel's default
    ``fault_around_bytes``; only debugfs says it outright)."""
    import mmap

    fd = os.memfd_create("probe", os.MFD_CLOEXEC)
    try:
        os.pwrite(fd, b"\x01" * (256 * KiB), 0)  # written pages: fault-around maps them
        mm = mmap.mmap(fd, 256 * KiB, flags=mmap.MAP_SHARED)
        try:
            mm[0]
            return smaps_kib("Rss", _address(mm)) == 64
        finally:
            mm.close()
    finally:
        os.close(fd)


class ArenaSlabs:
    """A session stand-in handing over a real daemon arena's slab files."""

    def __init__(self, arena: object) -> None:
        self.arena = arena

    def slab(self, uid: int) -> tuple[int, int, bool]:
        found = self.arena.file(uid)  # type: ignore[attr-defined]
        return self.arena.export(uid, writable=True), found[1].size, True  # type: ignore[attr-defined]


def test_a_slab_the_daemon_cleared_is_mapped_whole_and_round_trips_bytes() -> None:
    """The daemon clears each new slab's pages in the background (``ZeroAhead``), so a client's
    one read per 64 KiB maps the whole slab (the kernel's fault-around maps only pages already
    cleared: without the daemon's pass it mapped one page in 16 and the copies faulted the
    rest, each page cleared on the put's time). Blocks written then read back are exact."""
    from kvstore.tiers.cpu import HEADER_BYTES, SharedMemoryArena, SlabAllocator

    if not _fault_around_is_64_kib():
        pytest.skip("this kernel's fault-around is not 64 KiB")
    arena = SharedMemoryArena(HEADER_BYTES + 16 * MiB, huge_pages=False)
    client = MappedArena(ArenaSlabs(arena))  # type: ignore[arg-type]
    try:
        alloc = SlabAllocator(arena.size_bytes, 8 * MiB, back=arena.back, prefault=True)
        arena.slab_bytes = alloc.slab_bytes
        assert arena.zero_ahead.wait(30) and arena.zero_ahead.supported
        block = 2 * MiB
        offsets = [alloc.allocate(block) for _ in range(4)]
        addresses = arena.addresses([o for o in offsets if o is not None])
        slab = client._slab(addresses[0] >> 32)  # mapped, nothing copied yet
        assert smaps_kib("Rss", _address(slab.mm)) == slab.size // KiB
        rows = torch.randint(0, 256, (4, block), dtype=torch.uint8)
        client.copy_in(rows, addresses, [1, 2, 3, 4])
        for i, off in enumerate(offsets):
            assert off is not None
            assert bytes(arena.view[off : off + block]) == rows[i].numpy().tobytes()
        out = torch.empty_like(rows)
        sums = [xxhash.xxh3_64_intdigest(rows[i].numpy(), seed=i + 1) for i in range(4)]
        assert client.copy_out(addresses, sums, [1, 2, 3, 4], out, verify=True) == 4
        assert torch.equal(out, rows)
    finally:
        client.close()
        arena.close()


def test_a_read_only_slab_maps_and_reads_but_refuses_writes() -> None:
    slabs = Slabs({5: 1 * MiB}, read_only=frozenset({5}))
    fd = slabs.fds[5]
    os.pwrite(fd, b"\x07" * (1 * MiB), 0)
    arena = MappedArena(slabs)  # type: ignore[arg-type]
    try:
        view = arena.slot(5 << 32, 1 * MiB)
        assert bytes(view.numpy()) == b"\x07" * (1 * MiB)
        assert not arena._slab(5).writable
        with pytest.raises(TypeError):
            arena._slab(5).mm[0] = 1
    finally:
        arena.close()
        slabs.close()
