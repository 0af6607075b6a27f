"""Copies of small blocks out of the arena (``_copy_small_hashing_copy``, ``copy_out``'s path for
batches one thread copies): every copy checked against its key's checksum, the run ending at
the first block that does not verify, as the per-block path (``copy_hashing_copy``) decides."""

from __future__ import annotations

import numpy as np
import xxhash

from kvstore.client._common import _copy_small_hashing_copy, copy_hashing_copy


def _blocks(n: int, nbytes: int) -> tuple[list[np.ndarray], list[int], list[int]]:
    rng = np.random.default_rng(7)
    sources = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(n)]
    seeds = [int(s) for s in rng.integers(0, 2**63, n)]
    sums = [
        xxhash.xxh3_64_intdigest(src, seed=seed) for src, seed in zip(sources, seeds, strict=True)
    ]
    return sources, seeds, sums


def test_every_block_copied_and_verified() -> None:
    sources, seeds, sums = _blocks(8, 4096)
    rows = np.zeros((8, 4096), dtype=np.uint8)
    assert _copy_small_hashing_copy(rows, sources, sums, seeds, verify=True) == 8
    assert all(np.array_equal(rows[i], sources[i]) for i in range(8))
    want = np.zeros_like(rows)
    for i in range(8):
        assert copy_hashing_copy(want[i], sources[i], seeds[i]) == sums[i]
    assert np.array_equal(rows, want)


def test_the_run_ends_at_the_first_block_that_does_not_verify() -> None:
    sources, seeds, sums = _blocks(8, 4096)
    sources[5][100] ^= 1  # scribbled on after its checksum was bound
    sources[6][0] ^= 1
    rows = np.zeros((8, 4096), dtype=np.uint8)
    assert _copy_small_hashing_copy(rows, sources, sums, seeds, verify=True) == 5
    assert all(np.array_equal(rows[i], sources[i]) for i in range(5))


def test_a_key_checked_against_another_keys_seed_is_a_miss() -> None:
    sources, seeds, sums = _blocks(4, 4096)
    rows = np.zeros((4, 4096), dtype=np.uint8)
    seeds[0] ^= 1
    assert _copy_small_hashing_copy(rows, sources, sums, seeds, verify=True) == 0


def test_without_verify_every_block_is_copied() -> None:
    sources, seeds, _ = _blocks(4, 4096)
    rows = np.zeros((4, 4096), dtype=np.uint8)
    assert _copy_small_hashing_copy(rows, sources, [0] * 4, seeds, verify=False) == 4
    assert all(np.array_equal(rows[i], sources[i]) for i in range(4))
