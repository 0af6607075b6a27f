"""Copy and checksum in one pass: the pieces' checksum is the block's, the checksum vouches for
the right bytes (the source on a put, the copy on a get and a load), and a block that is not
what its checksum says is a miss, on the arena path and on the paged path, with blocks large
enough to be copied in pieces."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
from conftest import SMALL_LAYOUT, random_blocks, same_bytes, tokens

from kvstore import KVLayout, KVStoreClient
from kvstore.client import _common, paged_io, presence_link
from kvstore.client._common import PASS_CHUNK_BYTES, copy_hashing_copy, copy_hashing_source

BIG = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, block_size=16)  # 512 KiB blocks
assert BIG.block_bytes > PASS_CHUNK_BYTES


@pytest.mark.parametrize(
    "n", [1000, PASS_CHUNK_BYTES, PASS_CHUNK_BYTES + 1, 2 << 20, (2 << 20) + 12345]
)
def test_copies_return_the_one_shot_checksum(n: int) -> None:
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    want = xxhash.xxh3_64_intdigest(src, seed=99)
    for copy in (copy_hashing_source, copy_hashing_copy):
        dst = np.zeros(n, dtype=np.uint8)
        assert copy(dst, src, 99) == want
        assert np.array_equal(dst, src)


def test_a_get_checks_the_copy_not_the_source(monkeypatch) -> None:
    # A slot rewritten between a piece's copy and its hash would pass a check of the slot.
    src = np.random.default_rng(1).integers(0, 256, 3 * PASS_CHUNK_BYTES, dtype=np.uint8)
    want = xxhash.xxh3_64_intdigest(src, seed=5)
    dst = np.zeros_like(src)
    real = np.copyto

    def copy_then_rewrite_source(d, s, *args, **kwargs):
        real(d, s, *args, **kwargs)
        s[:1] ^= 1  # the source changes right after this piece was copied

    monkeypatch.setattr(np, "copyto", copy_then_rewrite_source)
    assert copy_hashing_copy(dst, src.copy(), 5) == want  # the copy is intact: it matches


def big_client(daemon) -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=BIG, model="one-pass")


def test_large_blocks_round_trip_and_a_corrupt_one_is_a_miss(daemon) -> None:
    with big_client(daemon) as kv:
        keys = kv.hash_tokens(tokens(3))
        blocks = random_blocks(BIG, 3)
        assert kv.put(keys, blocks) == 3
        assert same_bytes(kv.get(keys), blocks)
        with kv.acquire(keys) as lease:
            slot = kv._arena.slot(lease.offsets[1], BIG.block_bytes)
        slot[-1] ^= 0xFF  # the last piece of block 1
        got = kv.get(keys)
        assert got.shape[0] == 1 and same_bytes(got, blocks[:1])


def test_a_write_into_a_slot_during_a_large_put_is_not_committed_as_valid(
    daemon, monkeypatch
) -> None:
    real = np.copyto

    def copy_then_scribble(dst, src, *args, **kwargs):  # a writer lands after each piece
        real(dst, src, *args, **kwargs)
        if dst.nbytes == PASS_CHUNK_BYTES:
            dst[:8] = 0xAB

    with big_client(daemon) as kv:
        keys = kv.hash_tokens(tokens(2))
        monkeypatch.setattr(_common.np, "copyto", copy_then_scribble)
        try:
            assert kv.put(keys, random_blocks(BIG, 2)) == 2
        finally:
            monkeypatch.setattr(_common.np, "copyto", real)
        assert kv.get(keys).shape[0] == 0  # the checksum was of the source: a miss


def paged(num_blocks: int, seed: int | None) -> list[torch.Tensor]:
    shape = (2, num_blocks, BIG.block_size, BIG.num_kv_heads, BIG.head_dim)
    if seed is None:
        return [torch.zeros(shape, dtype=BIG.dtype) for _ in range(BIG.num_layers)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(BIG.dtype) for _ in range(BIG.num_layers)]


def paged_block(kv_caches: list[torch.Tensor], b: int) -> torch.Tensor:
    return torch.stack([layer[:, b] for layer in kv_caches]).view(torch.uint8)


def test_a_paged_load_verifies_its_copies_and_stops_at_a_corrupt_block(daemon) -> None:
    src, dst = paged(4, seed=1), paged(4, seed=None)
    with big_client(daemon) as kv:
        keys = kv.hash_tokens(tokens(4))
        assert kv.offload(src, [0, 1, 2, 3], keys) == 4
        assert kv.load(dst, [3, 2, 1, 0], keys) == 4
        for i in range(4):
            assert torch.equal(paged_block(dst, 3 - i), paged_block(src, i))
        with kv.acquire(keys) as lease:
            slot = kv._arena.slot(lease.offsets[2], BIG.block_bytes)
        slot[BIG.block_bytes // 2] ^= 0x01
        fresh = paged(4, seed=None)
        assert kv.load(fresh, [0, 1, 2, 3], keys) == 2  # block 2 fails its check
        assert torch.equal(paged_block(fresh, 1), paged_block(src, 1))
        # Blocks past it may have been written (as a load that fails midway may): they are not
        # counted, and the engine recomputes them.


def test_a_load_of_a_prompts_prefix_is_one_acquire(daemon, monkeypatch) -> None:
    monkeypatch.setattr(presence_link, "FLUSH_S", 0.0)  # through the daemon, not the table
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, block_size=16)
    shape = (2, 130, layout.block_size, layout.num_kv_heads, layout.head_dim)
    src = [torch.randn(shape).to(layout.dtype) for _ in range(layout.num_layers)]
    dst = [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)]
    with KVStoreClient(daemon.address, layout=layout, model="prefix") as kv:
        keys = kv.hash_tokens(tokens(120))
        assert kv.offload(src, list(range(120)), keys) == 120
        calls = []
        acquire = kv._rpc.Acquire

        def counted(request, timeout):
            calls.append(len(request.keys) // 32)
            return acquire(request, timeout=timeout)

        kv._rpc.Acquire = counted
        assert kv.load(dst, list(range(120)), keys) == 120
        assert calls == [120]
        assert all(torch.equal(a[:, :120], b[:, :120]) for a, b in zip(src, dst, strict=True))


def test_a_large_batch_is_copied_by_two_threads_at_once() -> None:
    # Each of two blocks waits until the other is being copied too: only two threads at once
    # get past the barrier (its timeout guards against a hang, never decides the outcome).
    import threading

    from kvstore.client import _parallel

    if not _parallel._SPLIT:
        pytest.skip("one core: batches are copied on the calling thread")
    both = threading.Barrier(2, timeout=60)
    threads = set()

    def work(i: int) -> None:
        threads.add(threading.current_thread().name)
        both.wait()

    _parallel.each_block(2, _parallel.SPLIT_MIN_BYTES, work)
    assert len(threads) == 2


def test_an_error_in_a_split_copy_is_raised_after_both_threads_stopped() -> None:
    import threading
    import time

    from kvstore.client import _parallel

    running, done = [0], []
    lock = threading.Lock()

    def work(i: int) -> None:
        with lock:
            running[0] += 1
        try:
            if i == 3:
                raise ValueError("block 3")
            time.sleep(0.01)
            done.append(i)
        finally:
            with lock:
                running[0] -= 1

    with pytest.raises(ValueError, match="block 3"):
        _parallel.each_block(64, _parallel.SPLIT_MIN_BYTES, work)
    assert running[0] == 0  # nothing still writes into the caller's buffers
    assert len(done) < 63  # the other thread stopped taking blocks


def test_a_split_batch_round_trips_and_its_first_corrupt_block_ends_the_get(daemon) -> None:
    from kvstore.client import _parallel

    n = 12  # 6 MiB of 512 KiB blocks: copied by two threads
    assert n * BIG.block_bytes >= _parallel.SPLIT_MIN_BYTES
    with big_client(daemon) as kv:
        keys = kv.hash_tokens(tokens(n))
        blocks = random_blocks(BIG, n)
        assert kv.put(keys, blocks) == n
        assert same_bytes(kv.get(keys), blocks)
        with kv.acquire(keys) as lease:
            for b in (7, 10):
                kv._arena.slot(lease.offsets[b], BIG.block_bytes)[-1] ^= 0xFF
        got = kv.get(keys)
        assert got.shape[0] == 7 and same_bytes(got, blocks[:7])


def test_a_split_paged_load_counts_up_to_its_first_corrupt_block(daemon) -> None:
    # 24 blocks of 512 KiB (the test daemon holds 16 MiB): two runs of back-to-back slots,
    # scattered by two threads; the first bad block is the count, wherever the thread that
    # found it stood.
    n = 24
    src, dst = paged(n, seed=2), paged(n, seed=None)
    with big_client(daemon) as kv:
        keys = kv.hash_tokens(tokens(n))
        assert kv.offload(src, list(range(n)), keys) == n
        assert kv.load(dst, list(range(n)), keys) == n
        assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
        with kv.acquire(keys) as lease:
            for b in (19, 22):
                kv._arena.slot(lease.offsets[b], BIG.block_bytes)[BIG.block_bytes // 3] ^= 0x01
        fresh = paged(n, seed=None)
        assert kv.load(fresh, list(range(n)), keys) == 19
        assert all(torch.equal(paged_block(fresh, b), paged_block(src, b)) for b in range(19))


def test_a_paged_load_puts_each_block_where_its_id_says_in_any_order() -> None:
    """Slots back to back, block ids out of order but spanning a consecutive range: each
    block lands in its own id (a slice over the range would swap them, checksums intact)."""
    layout = SMALL_LAYOUT
    blocks = random_blocks(layout, 4, seed=17)  # one tensor: the slots lie back to back
    shape = (2, 8, layout.block_size, layout.num_kv_heads, layout.head_dim)
    seeds = [2000 + i for i in range(4)]
    sums = [
        xxhash.xxh3_64_intdigest(blocks[i].contiguous().view(torch.uint8).numpy(), seed=seeds[i])
        for i in range(4)
    ]
    for ids in ([0, 2, 1, 3], [3, 1, 2, 0], [4, 5, 6, 7], [5, 4, 7, 6]):
        caches = [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)]
        assert paged_io.scatter_with_checksums(list(blocks), caches, ids, sums, seeds) == 4
        for i, block_id in enumerate(ids):
            got = torch.stack([c[:, block_id] for c in caches])
            assert same_bytes(got, blocks[i]), (ids, i)


@pytest.mark.parametrize("nbytes", [4096, PASS_CHUNK_BYTES // 2])
def test_small_blocks_copied_in_runs_land_in_their_own_slots_hashed_from_the_source(
    monkeypatch, nbytes: int
) -> None:
    import mmap

    slabs = [_common._Slab(mmap.mmap(-1, 16 * nbytes), writable=True) for _ in range(2)]
    rows = np.random.default_rng(nbytes).integers(0, 256, (9, nbytes), dtype=np.uint8)
    seeds = list(range(100, 109))
    # Runs of back-to-back rows into back-to-back slots (longer than one copy may be when
    # the blocks are large), a gap, another slab, rows out of order, a lone block.
    places = [(0, slabs[0], 0), (1, slabs[0], nbytes), (2, slabs[0], 2 * nbytes)]
    places += [(3, slabs[0], 3 * nbytes), (4, slabs[0], 5 * nbytes), (5, slabs[1], 6 * nbytes)]
    places += [(7, slabs[1], 7 * nbytes), (6, slabs[1], 8 * nbytes), (8, slabs[0], 9 * nbytes)]
    real = np.copyto

    def copy_then_scribble(d, s, *args, **kwargs):
        real(d, s, *args, **kwargs)
        d[:1] ^= 0xFF  # a writer into the slot right after the copy

    monkeypatch.setattr(np, "copyto", copy_then_scribble)
    sums = _common._copy_runs_hashing_source(rows, places, seeds, nbytes)
    monkeypatch.setattr(np, "copyto", real)
    # Each checksum is of the source row (what the client meant to store), not of the slot.
    assert sums == [xxhash.xxh3_64_intdigest(rows[i], seed=seeds[i]) for i, _, _ in places]
    for i, slab, offset in places:
        got = slab.np[offset : offset + nbytes].copy()
        got[:1] = rows[i][:1]  # the scribbled byte (the first of each copy) aside
        assert np.array_equal(got[1:], rows[i][1:]), f"row {i} is not in its slot"
