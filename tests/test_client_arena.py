"""``MappedArena.copy_in``, the put's copy into the daemon's slabs, on real shared memory.

The slabs are real sealed-size memfd files, handed over as descriptors by a stand-in for the
session (only ``slab(uid)``: what the daemon would send for that uid)."""

from __future__ import annotations

import os

import pytest
import torch
import xxhash

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
