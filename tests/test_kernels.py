"""kvstore.kernels: gather/scatter/copy are bit-exact moves, paged attention equals dense
attention, the device checksum follows its definition, bad inputs raise ValueError. CPU tests
run the torch (and numpy) reference; tests marked ``cuda`` run the CuPy kernels against it and
skip without a GPU and CuPy."""

from __future__ import annotations

import ast
import importlib.util
import math
import pathlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvstore import kernels
from kvstore.kernels import reference
from kvstore.tiers import codecs

COPY_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]
ATTN_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
ATTN_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and CuPy")


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(_RAW[t.element_size()])


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Every bit pattern, NaN payloads included: a value-converting copy would not survive."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return data.view(dtype).reshape(shape)


def make_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    block_major: bool = False,
    device: str = "cpu",
) -> list[torch.Tensor]:
    """Per-layer caches [2, nb, bs, H, D]; ``block_major`` stores them as [nb, 2, ...] (the
    layout some attention backends use) and hands out the transposed view."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_layers):
        if block_major:
            t = random_bytes((num_blocks, 2, block_size, heads, head_dim), dtype, gen)
            t = t.transpose(0, 1)
        else:
            t = random_bytes((2, num_blocks, block_size, heads, head_dim), dtype, gen)
        out.append(t.to(device))
    return out


def block_shape(caches: list[torch.Tensor]) -> tuple[int, ...]:
    _, _, bs, h, d = caches[0].shape
    return (len(caches), 2, bs, h, d)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(raw(a.cpu()), raw(b.cpu()))


# -- gather / scatter / copy (CPU reference path) --------------------------------------------


@pytest.mark.parametrize("dtype", COPY_DTYPES)
@pytest.mark.parametrize("block_major", [False, True])
def test_gather_matches_direct_indexing(dtype: torch.dtype, block_major: bool) -> None:
    caches = make_caches(3, 10, 4, 2, 8, dtype, block_major=block_major)
    ids = [7, 0, 3, 9]
    out = torch.empty(len(ids), *block_shape(caches), dtype=dtype)
    kernels.gather_blocks(caches, ids, out)
    for i, b in enumerate(ids):
        for layer, cache in enumerate(caches):
            assert same_bytes(out[i, layer], cache[:, b])


@pytest.mark.parametrize("dtype", COPY_DTYPES)
def test_gather_then_scatter_is_identity(dtype: torch.dtype) -> None:
    caches = make_caches(2, 12, 4, 2, 8, dtype, seed=1)
    original = [c.clone() for c in caches]
    ids = torch.tensor([5, 11, 2, 6], dtype=torch.int32)
    blocks = torch.empty(len(ids), *block_shape(caches), dtype=dtype)
    kernels.gather_blocks(caches, ids, blocks)
    for c in caches:  # wipe the gathered blocks so scatter has to restore them
        raw(c)[:, ids.long()] = 0
    assert not all(same_bytes(c, o) for c, o in zip(caches, original, strict=True))
    kernels.scatter_blocks(blocks, caches, ids)
    assert all(same_bytes(c, o) for c, o in zip(caches, original, strict=True))


@pytest.mark.parametrize("dtype", COPY_DTYPES)
def test_gather_into_list_equals_gather_into_tensor(dtype: torch.dtype) -> None:
    caches = make_caches(3, 9, 5, 3, 4, dtype, seed=2)
    ids = [8, 1, 1, 4]
    whole = torch.empty(len(ids), *block_shape(caches), dtype=dtype)
    kernels.gather_blocks(caches, ids, whole)
    # Separate per-block tensors, as views into one shared-memory arena would be.
    arena = torch.zeros(len(ids) * 2 + 1, *block_shape(caches), dtype=dtype)
    parts = [arena[2 * i + 1] for i in range(len(ids))]
    kernels.gather_blocks(caches, ids, parts)
    for i, p in enumerate(parts):
        assert same_bytes(p, whole[i])
    untouched = arena[0::2]
    assert not bool(raw(untouched).any())


@pytest.mark.parametrize("dtype", COPY_DTYPES)
def test_scatter_from_list_equals_scatter_from_tensor(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    a = make_caches(2, 8, 4, 2, 4, dtype, seed=4)
    b = [c.clone() for c in a]
    blocks = random_bytes((3, *block_shape(a)), dtype, gen)
    kernels.scatter_blocks(blocks, a, [6, 0, 3])
    kernels.scatter_blocks([blk.clone() for blk in blocks], b, [6, 0, 3])
    assert all(same_bytes(x, y) for x, y in zip(a, b, strict=True))
    assert same_bytes(a[1][:, 0], blocks[1, 1])


@pytest.mark.parametrize("dtype", COPY_DTYPES)
def test_copy_blocks_copies_exactly_and_touches_nothing_else(dtype: torch.dtype) -> None:
    caches = make_caches(3, 10, 4, 2, 8, dtype, seed=5, block_major=True)
    before = [c.clone() for c in caches]
    src, dst = [2, 2, 7], [0, 5, 9]
    kernels.copy_blocks(caches, src, dst)
    for c, old in zip(caches, before, strict=True):
        for s, d in zip(src, dst, strict=True):
            assert same_bytes(c[:, d], old[:, s])
        for b in set(range(10)) - set(dst):
            assert same_bytes(c[:, b], old[:, b])


def test_empty_id_lists_are_no_ops() -> None:
    caches = make_caches(2, 4, 2, 1, 4, torch.float16)
    before = [c.clone() for c in caches]
    kernels.gather_blocks(caches, [], torch.empty(0, *block_shape(caches), dtype=torch.float16))
    kernels.scatter_blocks([], caches, [])
    kernels.copy_blocks(caches, [], [])
    assert all(same_bytes(c, o) for c, o in zip(caches, before, strict=True))


# -- paged attention ---------------------------------------------------------------------------


def build_paged(
    seq_lens: list[int],
    heads_kv: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Dense per-sequence K/V, and the same data scattered into a paged cache through shuffled
    block tables by plain indexing (no kernel involved)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    max_blocks = max(blocks_per_seq) + 1
    cache = torch.randn(2, num_blocks, block_size, heads_kv, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    # Padding entries point at a valid block: the kernel must not read past seq_len anyway.
    tables = torch.full((len(seq_lens), max_blocks), perm[-1], dtype=torch.int32)
    dense = []
    for i, n in enumerate(seq_lens):
        k = torch.randn(n, heads_kv, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, heads_kv, head_dim, generator=gen).to(dtype)
        for j in range(blocks_per_seq[i]):
            b = perm.pop(0)
            tables[i, j] = b
            chunk = slice(j * block_size, min((j + 1) * block_size, n))
            cache[0, b, : chunk.stop - chunk.start] = k[chunk]
            cache[1, b, : chunk.stop - chunk.start] = v[chunk]
        dense.append((k, v))
    return cache, tables, torch.tensor(seq_lens, dtype=torch.int32), dense


def dense_attention(
    query: torch.Tensor, dense: list[tuple[torch.Tensor, torch.Tensor]], scale: float
) -> torch.Tensor:
    out = torch.zeros(query.shape, dtype=torch.float32)
    for i, (k, v) in enumerate(dense):
        if k.shape[0] == 0:
            continue
        q = query[i].float()[None, :, None, :]  # [1, Hq, 1, D]
        kk = k.float().transpose(0, 1)[None]  # [1, Hkv, n, D]
        vv = v.float().transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q, kk, vv, scale=scale, enable_gqa=True)
        out[i] = o[0, :, 0]
    return out


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize(
    ("heads", "heads_kv", "head_dim", "block_size"),
    [(4, 4, 16, 4), (8, 2, 32, 16), (6, 1, 24, 8)],
)
def test_paged_attention_equals_dense(
    dtype: torch.dtype, heads: int, heads_kv: int, head_dim: int, block_size: int
) -> None:
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 50]
    cache, tables, lens, dense = build_paged(seq_lens, heads_kv, head_dim, block_size, dtype, 7)
    query = torch.randn(len(seq_lens), heads, head_dim, generator=torch.Generator().manual_seed(8))
    query = query.to(dtype)
    scale = head_dim**-0.5
    got = kernels.paged_attention(query, cache, tables, lens, scale)
    assert got.shape == query.shape and got.dtype == dtype
    want = dense_attention(query, dense, scale)
    torch.testing.assert_close(got.float(), want, atol=ATTN_TOL[dtype], rtol=ATTN_TOL[dtype])


def test_paged_attention_empty_sequence_gives_zeros() -> None:
    cache, tables, lens, _ = build_paged([5, 0, 3], 2, 8, 4, torch.float32, 9)
    query = torch.randn(3, 4, 8)
    out = kernels.paged_attention(query, cache, tables, lens, 0.3)
    assert torch.equal(out[1], torch.zeros(4, 8))
    assert bool(out[0].abs().sum() > 0)


# -- validation --------------------------------------------------------------------------------


def _bad_copy_calls() -> list[tuple[str, object, str]]:
    c = make_caches(2, 6, 4, 2, 8, torch.float16)
    out = torch.empty(2, *block_shape(c), dtype=torch.float16)
    other = make_caches(2, 6, 4, 2, 8, torch.float32)
    return [
        ("ids out of range", lambda: kernels.gather_blocks(c, [0, 6], out), r"block_ids\[1\] = 6"),
        ("negative id", lambda: kernels.gather_blocks(c, [-1, 0], out), r"out of range"),
        ("float ids", lambda: kernels.gather_blocks(c, torch.tensor([0.0, 1.0]), out), "int32"),
        (
            "2-D ids",
            lambda: kernels.gather_blocks(c, torch.zeros(2, 1, dtype=torch.long), out),
            "1-D",
        ),
        ("too few out", lambda: kernels.gather_blocks(c, [0, 1, 2], out), "holds 2 blocks"),
        ("out dtype", lambda: kernels.gather_blocks(c, [0, 1], out.float()), "dtype"),
        ("out shape", lambda: kernels.gather_blocks(c, [0, 1], out[:, :1]), "shape"),
        ("list len", lambda: kernels.gather_blocks(c, [0, 1], [out[0]]), "holds 1 blocks"),
        ("list dtype", lambda: kernels.gather_blocks(c, [0], [out[0].float()]), "dtype"),
        (
            "non-contiguous block",
            lambda: kernels.gather_blocks(c, [0], [out[0].transpose(0, 1)]),
            "shape|contiguous",
        ),
        (
            "mixed layer dtypes",
            lambda: kernels.gather_blocks([c[0], other[1]], [0], out[:1]),
            "dtype",
        ),
        (
            "mixed layer shapes",
            lambda: kernels.gather_blocks([c[0], c[1][:, :3]], [0], out[:1]),
            "shape",
        ),
        ("no layers", lambda: kernels.gather_blocks([], [0], out[:1]), "empty"),
        ("one tensor not a list", lambda: kernels.gather_blocks(c[0], [0], out[:1]), "list"),  # type: ignore[arg-type]
        ("4-D layer", lambda: kernels.gather_blocks([c[0][0]], [0], out[:1]), "shape"),
        (
            "non-contiguous block in cache",
            lambda: kernels.gather_blocks([c[0].transpose(3, 4)], [0], out[:1]),
            "contiguous",
        ),
        ("scatter duplicates", lambda: kernels.scatter_blocks(out, c, [1, 1]), "duplicate"),
        ("copy length mismatch", lambda: kernels.copy_blocks(c, [0, 1], [2]), "pair"),
        ("copy overlap", lambda: kernels.copy_blocks(c, [0, 1], [1, 2]), "overlap"),
        ("copy dst duplicate", lambda: kernels.copy_blocks(c, [0, 1], [2, 2]), "duplicate"),
        ("copy dst range", lambda: kernels.copy_blocks(c, [0], [9]), r"dst_block_ids\[0\] = 9"),
    ]


@pytest.mark.parametrize(
    ("case", "call", "match"), _bad_copy_calls(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_bad_copy_inputs_raise_value_error(case: str, call: object, match: str) -> None:
    assert callable(call)
    with pytest.raises(ValueError, match=match):
        call()


def _bad_attention_calls() -> list[tuple[str, object, str]]:
    cache, tables, lens, _ = build_paged([5, 9], 2, 8, 4, torch.float16, 1)
    q = torch.randn(2, 4, 8).half()
    pa = kernels.paged_attention
    bad_table = tables.clone()
    bad_table[1, 1] = cache.shape[1]
    return [
        ("fp8 query", lambda: pa(q.to(torch.float8_e4m3fn), cache, tables, lens, 1.0), "dtype"),
        ("dtype mismatch", lambda: pa(q.float(), cache, tables, lens, 1.0), "dtype"),
        ("2-D query", lambda: pa(q[0], cache, tables, lens, 1.0), "query"),
        ("head_dim mismatch", lambda: pa(q[..., :4], cache, tables, lens, 1.0), "head_dim"),
        (
            "GQA ratio",
            lambda: pa(torch.randn(2, 3, 8).half(), cache, tables, lens, 1.0),
            "multiple",
        ),
        ("int64 tables", lambda: pa(q, cache, tables.long(), lens, 1.0), "int32"),
        ("int64 seq_lens", lambda: pa(q, cache, tables, lens.long(), 1.0), "int32"),
        ("table rows", lambda: pa(q, cache, tables[:1], lens, 1.0), "rows"),
        ("seq_lens count", lambda: pa(q, cache, tables, lens[:1], 1.0), "entries"),
        (
            "seq_len too long",
            lambda: pa(q, cache, tables, torch.tensor([5, 99], dtype=torch.int32), 1.0),
            r"seq_lens\[1\]",
        ),
        (
            "negative seq_len",
            lambda: pa(q, cache, tables, torch.tensor([5, -1], dtype=torch.int32), 1.0),
            r"seq_lens\[1\]",
        ),
        (
            "block id out of range",
            lambda: pa(q, cache, bad_table, lens, 1.0),
            r"block_tables\[1, 1\]",
        ),
        ("scale type", lambda: pa(q, cache, tables, lens, "1.0"), "scale"),  # type: ignore[arg-type]
    ]


@pytest.mark.parametrize(
    ("case", "call", "match"), _bad_attention_calls(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_bad_attention_inputs_raise_value_error(case: str, call: object, match: str) -> None:
    assert callable(call)
    with pytest.raises(ValueError, match=match):
        call()


def test_check_false_skips_only_value_checks() -> None:
    cache, tables, lens, _ = build_paged([5], 1, 8, 4, torch.float32, 2)
    q = torch.randn(1, 1, 8)
    padded = tables.clone()
    padded[0, -1] = -1  # past the sequence's last block: ignored with or without checks
    kernels.paged_attention(q, cache, padded, lens, 1.0)
    with pytest.raises(ValueError, match="int32"):
        kernels.paged_attention(q, cache, tables.long(), lens, 1.0, check=False)


# -- device checksum (CPU reference path) ------------------------------------------------------

MASK64 = (1 << 64) - 1


def oracle_checksum(data: bytes) -> int:
    """The definition in plain Python ints, word by word: what the numpy reference and the CUDA
    kernel must both reproduce."""

    def mix(x: int) -> int:
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & MASK64
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & MASK64
        return x ^ (x >> 31)

    total = 0
    for i in range(len(data) // 8):
        word = int.from_bytes(data[8 * i : 8 * i + 8], "little")
        total = (total + mix(word ^ ((i * 0x9E3779B97F4A7C15) & MASK64))) & MASK64
    return mix(total ^ ((len(data) * 0xD6E8FEB86659FD93) & MASK64))


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_checksum_known_answers() -> None:
    # Pinned: stored checksums must stay comparable across versions. Derived from the oracle.
    cases = [
        (bytes(8), 0x5E16F63D867F5800),
        (bytes(range(64)), 0x98C73EE58883127E),
        (b"kvstore!" * 4, 0x6D4D5B7524CA36EA),
    ]
    for data, want in cases:
        assert oracle_checksum(data) == want
        block = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        assert kernels.device_checksums([block]) == [want]


@pytest.mark.parametrize("nbytes", [8, 16, 24, 56, 200, 1032])
def test_checksum_reference_equals_python_oracle(nbytes: int) -> None:
    gen = torch.Generator().manual_seed(nbytes)
    blocks = torch.randint(0, 256, (5, nbytes), dtype=torch.uint8, generator=gen)
    got = kernels.device_checksums(blocks)
    assert got == [oracle_checksum(tensor_bytes(b)) for b in blocks]
    assert all(isinstance(v, int) and 0 <= v < 2**64 for v in got)


@pytest.mark.parametrize("dtype", [*COPY_DTYPES, torch.int64, torch.bool])
def test_checksum_counts_bytes_not_values(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    if dtype == torch.bool:  # only 0 and 1 are valid bool bytes
        data = torch.randint(0, 2, (3, 4, 16), generator=gen).bool()
    else:  # every bit pattern, NaN payloads included
        data = random_bytes((3, 4, 16), dtype, gen)
    as_bytes = [tensor_bytes(b) for b in data]
    assert kernels.device_checksums(data) == [oracle_checksum(b) for b in as_bytes]


def test_checksum_one_flipped_bit_changes_it() -> None:
    gen = torch.Generator().manual_seed(4)
    block = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    base = kernels.device_checksums([block])[0]
    # Every bit of the first and last word, and bits scattered over the rest.
    positions = [*range(64), *range(4096 * 8 - 64, 4096 * 8)]
    positions += torch.randint(0, 4096 * 8, (200,), generator=gen).tolist()
    flipped = block.repeat(len(positions), 1)
    for row, bit in enumerate(positions):
        flipped[row, bit // 8] ^= 1 << (bit % 8)
    sums = kernels.device_checksums(flipped)
    assert base not in sums


def test_checksum_swapping_two_words_changes_it() -> None:
    gen = torch.Generator().manual_seed(5)
    words = torch.randint(-(2**62), 2**62, (64,), dtype=torch.int64, generator=gen)
    base = kernels.device_checksums([words])[0]
    for i, j in [(0, 1), (0, 63), (10, 40), (62, 63)]:
        swapped = words.clone()
        swapped[i], swapped[j] = words[j], words[i]
        assert kernels.device_checksums([swapped])[0] != base, (i, j)


def test_checksum_identical_blocks_give_identical_sums() -> None:
    gen = torch.Generator().manual_seed(6)
    block = torch.randint(0, 256, (512,), dtype=torch.uint8, generator=gen)
    batch = torch.stack([block, block.clone(), torch.zeros_like(block), block])
    sums = kernels.device_checksums(batch)
    assert sums[0] == sums[1] == sums[3] != sums[2]
    # The same bytes under another dtype and shape, in a separate call.
    assert kernels.device_checksums([block.view(torch.float16).view(16, 16)]) == [sums[0]]


def test_checksum_zero_blocks_of_different_lengths_differ() -> None:
    sums = [
        kernels.device_checksums([torch.zeros(n, dtype=torch.uint8)])[0] for n in range(8, 2056, 8)
    ]
    assert len(set(sums)) == len(sums)


def test_checksum_batch_forms_agree() -> None:
    gen = torch.Generator().manual_seed(7)
    n, nbytes = 6, 264
    whole = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=gen)
    want = [oracle_checksum(tensor_bytes(b)) for b in whole]
    assert kernels.device_checksums(whole) == want
    assert kernels.device_checksums(list(whole)) == want
    assert kernels.device_checksums(tuple(whole.view(torch.int32))) == want
    assert kernels.device_checksums(whole.view(n, 3, 11, 2, 4)) == want
    # Slots of a pool at 8-aligned offsets (not 16-aligned), gaps between them.
    pool = torch.zeros(8 + n * (nbytes + 24), dtype=torch.uint8)
    slots = [pool[8 + i * (nbytes + 24) :][:nbytes] for i in range(n)]
    for slot, b in zip(slots, whole, strict=True):
        slot.copy_(b)
    assert kernels.device_checksums(slots) == want
    # Rows of a tensor with gaps between them: each row contiguous, the tensor not.
    padded = torch.zeros(n, nbytes + 16, dtype=torch.uint8)
    padded[:, :nbytes] = whole
    assert kernels.device_checksums(padded[:, :nbytes]) == want
    # Many rows in one call go through the reference in batches: order must hold.
    many = torch.randint(0, 256, (3000, 512), dtype=torch.uint8, generator=gen)
    got = kernels.device_checksums(many)
    assert [got[i] for i in (0, 1234, 2999)] == [
        oracle_checksum(tensor_bytes(many[i])) for i in (0, 1234, 2999)
    ]


def test_checksum_reference_batches_rows_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    # Force several rows per numpy pass and a ragged last pass.
    monkeypatch.setattr(reference, "_BATCH_WORDS", 3 * 5)
    gen = torch.Generator().manual_seed(8)
    blocks = torch.randint(0, 256, (11, 40), dtype=torch.uint8, generator=gen)
    assert kernels.device_checksums(blocks) == [oracle_checksum(tensor_bytes(b)) for b in blocks]


def test_checksum_of_nothing_is_an_empty_list() -> None:
    assert kernels.device_checksums([]) == []
    assert kernels.device_checksums(torch.empty(0, 16, dtype=torch.uint8)) == []


def test_checksum_leaves_the_blocks_alone() -> None:
    block = torch.arange(32, dtype=torch.float32, requires_grad=True)
    before = block.detach().clone()
    assert kernels.device_checksums([block]) == [oracle_checksum(tensor_bytes(before))]
    assert torch.equal(block.detach(), before)


def test_kernel_source_has_the_reference_constants() -> None:
    # The CUDA kernel runs only where a GPU is; its constants at least are checked everywhere.
    source = (pathlib.Path(kernels.__file__).resolve().parent / "block_checksum.cu").read_text()
    for value in (reference.CHECKSUM_WORD_KEY, reference.MIX64_MUL1, reference.MIX64_MUL2):
        assert f"0x{value:016X}ULL" in source
    for shift in (30, 27, 31):
        assert f"x >> {shift};" in source


def _bad_checksum_calls() -> list[tuple[str, object, str]]:
    cs = kernels.device_checksums
    b = torch.zeros(4, 16, dtype=torch.uint8)
    pool = torch.zeros(64, dtype=torch.uint8)
    return [
        ("odd byte count", lambda: cs(torch.zeros(2, 12, dtype=torch.uint8)), "multiple of 8"),
        ("odd byte count in list", lambda: cs([b[0], b[1, :12]]), r"blocks\[1\].*multiple of 8"),
        ("empty rows", lambda: cs(torch.zeros(3, 0)), "multiple of 8"),
        ("0-d tensor", lambda: cs(torch.tensor(1.0)), "0-d"),
        ("sizes differ", lambda: cs([b[0], torch.zeros(24, dtype=torch.uint8)]), "one size"),
        ("non-contiguous rows", lambda: cs(b.view(4, 2, 8).transpose(1, 2)), "contiguous"),
        ("non-contiguous block", lambda: cs([b[0], b[:, :2].t()]), r"blocks\[1\].*contiguous"),
        ("misaligned slot", lambda: cs([pool[4:20]]), "multiple of 8"),
        ("misaligned row stride", lambda: cs(pool[:60].view(5, 12)[:, :8]), "multiple of 8"),
        (
            "meta device mixed in",
            lambda: cs([b[0], torch.zeros(16, dtype=torch.uint8, device="meta")]),
            "is on meta",
        ),
        ("not tensors", lambda: cs([b[0], b"x" * 16]), "torch.Tensor"),  # type: ignore[list-item]
        ("bytes", lambda: cs(b"x" * 16), "tensor"),  # type: ignore[arg-type]
        ("sparse", lambda: cs(b.to_sparse()), "dense"),
    ]


@pytest.mark.parametrize(
    ("case", "call", "match"), _bad_checksum_calls(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_bad_checksum_inputs_raise_value_error(case: str, call: object, match: str) -> None:
    assert callable(call)
    with pytest.raises(ValueError, match=match):
        call()


# -- layering and optional CuPy ----------------------------------------------------------------


def test_kernels_package_imports_nothing_of_ours() -> None:
    folder = pathlib.Path(kernels.__file__).resolve().parent
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert not (node.module or "").startswith("kvstore"), f"{path.name} imports kvstore"
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("kvstore") for a in node.names), path.name


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
def test_cuda_module_imports_without_cupy_and_says_what_is_missing() -> None:
    from kvstore.kernels import cuda

    with pytest.raises(RuntimeError, match="CuPy"):
        cuda._cupy()


def test_cuda_sources_ship_with_the_package() -> None:
    folder = pathlib.Path(kernels.__file__).resolve().parent
    assert {p.name for p in folder.glob("*.cu")} == {
        "paged_copy.cu",
        "paged_attention.cu",
        "block_checksum.cu",
    }


# -- CUDA kernels against the reference --------------------------------------------------------


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", COPY_DTYPES)
@pytest.mark.parametrize("block_major", [False, True])
def test_cuda_copies_match_reference(dtype: torch.dtype, block_major: bool) -> None:
    host = make_caches(3, 20, 16, 4, 64, dtype, seed=11, block_major=block_major)
    dev = [c.cuda() for c in host]
    ids = [19, 0, 7, 3, 12]
    shape = (len(ids), *block_shape(host))
    want = torch.empty(shape, dtype=dtype)
    reference.gather_blocks(host, torch.tensor(ids), want)

    got = torch.empty(shape, dtype=dtype, device="cuda")
    kernels.gather_blocks(dev, ids, got)
    assert same_bytes(got, want)
    parts = [torch.empty(shape[1:], dtype=dtype, device="cuda") for _ in ids]
    kernels.gather_blocks(dev, torch.tensor(ids, device="cuda"), parts)
    assert all(same_bytes(p, want[i]) for i, p in enumerate(parts))

    fresh = random_bytes(shape, dtype, torch.Generator().manual_seed(12))
    kernels.scatter_blocks(fresh.cuda(), dev, [1, 2, 4, 5, 6])
    reference.scatter_blocks(fresh, host, torch.tensor([1, 2, 4, 5, 6]))
    kernels.copy_blocks(dev, [1, 1, 19], [8, 9, 10])
    reference.copy_blocks(host, torch.tensor([1, 1, 19]), torch.tensor([8, 9, 10]))
    torch.cuda.synchronize()
    assert all(same_bytes(d, h) for d, h in zip(dev, host, strict=True))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_cuda_gather_scatter_pinned_host_zero_copy(dtype: torch.dtype) -> None:
    host = make_caches(2, 10, 16, 2, 32, dtype, seed=13)
    dev = [c.cuda() for c in host]
    ids = [3, 9, 0]
    shape = (len(ids), *block_shape(host))
    want = torch.empty(shape, dtype=dtype)
    reference.gather_blocks(host, torch.tensor(ids), want)
    pinned = torch.empty(shape, dtype=dtype).pin_memory()
    kernels.gather_blocks(dev, ids, pinned)
    # A one-element offset into a pinned arena forces the narrow-vector kernels.
    arena = torch.zeros(math.prod(shape) + 1, dtype=dtype).pin_memory()
    parts = list(arena[1:].view(shape))
    kernels.gather_blocks(dev, ids, parts)
    torch.cuda.synchronize()
    assert same_bytes(pinned, want)
    assert all(same_bytes(p, want[i]) for i, p in enumerate(parts))
    kernels.scatter_blocks(parts, dev, [4, 5, 6])
    torch.cuda.synchronize()
    for i, b in enumerate([4, 5, 6]):
        for layer in range(2):
            assert same_bytes(dev[layer][:, b], want[i, layer])


@pytest.mark.cuda
@needs_cuda
def test_cuda_pageable_host_out_is_refused() -> None:
    dev = [c.cuda() for c in make_caches(1, 4, 16, 1, 32, torch.float16)]
    out = torch.empty(1, 1, 2, 16, 1, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="pageable"):
        kernels.gather_blocks(dev, [0], out)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize(("heads", "heads_kv", "head_dim"), [(8, 8, 64), (32, 8, 128), (4, 1, 80)])
def test_cuda_paged_attention_matches_reference(
    dtype: torch.dtype, heads: int, heads_kv: int, head_dim: int
) -> None:
    seq_lens = [1, 15, 16, 17, 0, 300, 1000]
    cache, tables, lens, _ = build_paged(seq_lens, heads_kv, head_dim, 16, dtype, 21)
    query = torch.randn(len(seq_lens), heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    want = reference.paged_attention(query, cache, tables, lens, scale)
    got = kernels.paged_attention(query.cuda(), cache.cuda(), tables.cuda(), lens.cuda(), scale)
    tol = ATTN_TOL[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("nbytes", [8, 24, 4104, 65536 + 8, 2 << 20])
def test_cuda_checksums_match_reference(nbytes: int) -> None:
    # Odd word counts (1, 3, 513, 8193) leave partial strides; 2 MiB spreads over 64 CTAs.
    n = 40 if nbytes < (1 << 20) else 6
    gen = torch.Generator().manual_seed(nbytes)
    host = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=gen)
    want = reference.device_checksums(host)
    dev = host.cuda()
    assert kernels.device_checksums(dev) == want
    assert kernels.device_checksums(list(dev)) == want
    assert kernels.device_checksums(dev.view(torch.float16)) == want


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("nbytes", [40, 2 << 20])
def test_cuda_checksums_of_pool_slots_at_8_byte_offsets(nbytes: int) -> None:
    n = 7
    # Slots a multiple of 16 apart from an offset of 8: every block is 8-aligned, none 16-aligned.
    slot = -(-(nbytes + 8) // 16) * 16
    gen = torch.Generator().manual_seed(31)
    host = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=gen)
    want = reference.device_checksums(host)
    pool = torch.zeros(8 + n * slot, dtype=torch.uint8, device="cuda")
    views = [pool[8 + i * slot :][:nbytes] for i in range(n)]
    for v, h in zip(views, host, strict=True):
        v.copy_(h)
    assert all(v.data_ptr() % 16 == 8 for v in views)
    assert kernels.device_checksums(views) == want
    # The same slots as one strided tensor (each row contiguous, gaps between rows).
    rows = pool[8:].view(n, slot)[:, :nbytes]
    assert kernels.device_checksums(rows) == want


@pytest.mark.cuda
@needs_cuda
def test_cuda_checksums_past_the_grid_y_limit() -> None:
    # More blocks than gridDim.y allows (65535): the kernel strides over blocks.
    host = torch.randint(0, 256, (70_001, 16), dtype=torch.uint8, generator=torch.Generator())
    want = reference.device_checksums(host)
    assert kernels.device_checksums(host.cuda()) == want


@pytest.mark.cuda
@needs_cuda
def test_cuda_checksums_run_on_the_current_stream() -> None:
    host = torch.randint(0, 256, (8, 1 << 20), dtype=torch.uint8, generator=torch.Generator())
    want = reference.device_checksums(host)
    src = host.cuda()
    dev = torch.zeros_like(src)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # The copy waits behind a spin of tens of milliseconds on `side`: a kernel queued on any
        # other stream would read the zeros.
        torch.cuda._sleep(50_000_000)
        dev.copy_(src)
        got = kernels.device_checksums(dev)
    assert got == want


@pytest.mark.cuda
@needs_cuda
def test_cuda_checksums_refuse_mixed_devices() -> None:
    with pytest.raises(ValueError, match="is on"):
        kernels.device_checksums([torch.zeros(16, device="cuda"), torch.zeros(16)])


# -- FP8 (scaled e4m3 cache: write_kv_fp8, paged_attention_fp8) --------------------------------

FP8 = torch.float8_e4m3fn


def kv_values(n: int, heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """K/V-like values: unit normal, with one head ten times larger (an outlier head) and a few
    outlier elements, so per-head scales matter."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, head_dim, generator=gen)
    x[:, -1] *= 10.0
    x[torch.rand(x.shape, generator=gen) < 0.01] *= 8.0
    return x


def fp8_layer(num_blocks: int, block_size: int, heads: int, head_dim: int) -> torch.Tensor:
    return torch.zeros(2, num_blocks, block_size + reference.FP8_SCALE_ROWS, heads, head_dim).to(
        FP8
    )


def test_fp8_quantize_error_is_within_the_format_bound() -> None:
    x = kv_values(64, 3, 64, seed=1)
    scale = reference.fp8_scale(x.abs().amax(dim=(0, 2)))[None, :, None]  # one per head
    back = reference.dequantize_fp8(reference.quantize_fp8(x, scale), scale)
    err = (back - x).abs()
    # Per element: half an ulp of e4m3 (relative 2^-4, absolute 2^-10 * scale for subnormals).
    assert bool((err <= reference.fp8_error_bound(x, scale) * (1 + 1e-6)).all())
    # Per scale group: the largest element maps to 448 and back to itself (float32 rounding
    # aside), no error exceeds amax / 16, and the outlier head does not coarsen the others.
    amax = x.abs().amax(dim=(0, 2))
    assert torch.allclose(back.abs().amax(dim=(0, 2)), amax, rtol=1e-6, atol=0)
    assert bool((err.amax(dim=(0, 2)) <= amax / 16 * (1 + 1e-6)).all())
    assert float(err[:, 0].max()) < float(err[:, -1].max()) / 4
    # Zero groups stay zero; values over 448 * scale saturate rather than become NaN.
    zero = reference.quantize_fp8(torch.zeros(4), torch.zeros(()))
    assert torch.equal(reference.dequantize_fp8(zero, torch.zeros(())), torch.zeros(4))
    big = reference.quantize_fp8(torch.tensor([500.0, -470.0, 1e9]), torch.ones(()))
    assert big.float().tolist() == [448.0, -448.0, 448.0]


def _e4m3_bits_as_the_cuda_source_computes(x: np.ndarray) -> np.ndarray:
    """FP8::store of paged_attention.cu, step for step in numpy (x already clamped to 448)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    sign = (u >> 24) & 0x80
    u &= 0x7FFFFFFF
    a = u.astype(np.uint32).view(np.float32)
    sub = np.rint(a * np.float32(512.0)).astype(np.uint64)
    keep, rest = u >> 20, u & 0xFFFFF
    up = (rest > 0x80000) | ((rest == 0x80000) & (keep & 1 == 1))
    normal = keep + up - (120 << 3)
    out = np.where(a < np.float32(2.0**-6), sub, normal)
    return (sign | np.where(u > 0x7F800000, 0x7F, out)).astype(np.uint8)


def test_fp8_conversion_of_the_cuda_source_matches_torch() -> None:
    # Every finite e4m3 value, every midpoint between neighbours and the floats either side of
    # it (where round-to-nearest-even decides), and normal samples at several magnitudes.
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float().numpy()
    finite = np.unique(values[np.isfinite(values)])
    mids = ((finite[1:].astype(np.float64) + finite[:-1]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    samples = [rng.standard_normal(20000).astype(np.float32) * s for s in (1e-3, 1.0, 100.0)]
    near = [np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(999))]
    x = np.concatenate([finite, mids, *near, *samples])
    x = np.clip(x, -448, 448).astype(np.float32)
    want = torch.from_numpy(x).to(FP8).view(torch.uint8).numpy()
    assert np.array_equal(_e4m3_bits_as_the_cuda_source_computes(x), want)
    source = (pathlib.Path(kernels.__file__).parent / "paged_attention.cu").read_text()
    assert "0.001953125f" in source and "(120u << 3)" in source and "448.0f" in source


def test_write_kv_fp8_full_blocks_equal_quantize_per_group() -> None:
    bs, h, d = 8, 3, 16
    cache = fp8_layer(6, bs, h, d)
    k, v = kv_values(20, h, d, seed=2), kv_values(20, h, d, seed=3)
    # 20 tokens into blocks 4, 0, 2 (8 + 8 + 4), as a prefill writes them.
    kernels.write_kv_fp8(cache, k, v, [4, 0, 2], [0, 0, 0], [8, 8, 4], [8, 8, 4])
    scales = reference.fp8_scales(cache)
    for i, (b, n) in enumerate([(4, 8), (0, 8), (2, 4)]):
        for kv, x in enumerate((k, v)):
            part = x[8 * i : 8 * i + n]
            want_scale = reference.fp8_scale(part.abs().amax(dim=(0, 2)))
            assert torch.equal(scales[kv, b], want_scale)
            want = reference.quantize_fp8(part, want_scale[None, :, None])
            assert torch.equal(cache[kv, b, :n].view(torch.uint8), want.view(torch.uint8))
            assert not bool(cache[kv, b, n:bs].view(torch.uint8).any())  # rows past valid: 0
    # Untouched blocks stay zero; the padding of the scale row stays zero.
    assert not bool(cache[:, [1, 3, 5]].view(torch.uint8).any())
    assert not bool(cache[:, :, bs].view(torch.uint8).flatten(2)[:, :, 4 * h :].any())


def test_write_kv_fp8_decode_keeps_or_requantizes_earlier_tokens() -> None:
    bs, h, d = 8, 2, 8
    cache = fp8_layer(3, bs, h, d)
    k = kv_values(4, h, d, seed=4)
    kernels.write_kv_fp8(cache, k, k, [1], [0], [4], [4])
    before = cache[:, 1].clone()
    scale_before = reference.fp8_scales(cache)[:, 1].clone()
    # A smaller token: the scale and the earlier tokens' bytes stay as they were.
    small = k[:1] * 0.01
    kernels.write_kv_fp8(cache, small, small, [1], [4], [5], [5])
    assert torch.equal(reference.fp8_scales(cache)[:, 1], scale_before)
    assert torch.equal(cache[:, 1, :4].view(torch.uint8), before[:, :4].view(torch.uint8))
    # A larger one: the scale grows to cover it and earlier tokens are requantized to it,
    # each within one rounding at the old scale plus one at the new.
    big = k[:1] * 5.0
    kernels.write_kv_fp8(cache, big, big, [1], [5], [6], [6])
    new_scale = reference.fp8_scales(cache)[0, 1]
    assert torch.equal(new_scale, reference.fp8_scale(big.abs().amax(dim=(0, 2))))
    got = reference.fp8_dequantize_blocks(cache, torch.tensor([1]))[0, 0]
    bound = reference.fp8_error_bound(
        k, scale_before[0][None, :, None]
    ) + reference.fp8_error_bound(k, new_scale[None, :, None])
    assert bool(((got[:4] - k).abs() <= bound * (1 + 1e-6)).all())
    # Overwriting from row 0 keeps nothing: the scale follows the new tokens alone.
    kernels.write_kv_fp8(cache, small, small, [1], [0], [1], [1])
    assert torch.equal(
        reference.fp8_scales(cache)[0, 1], reference.fp8_scale(small.abs().amax(dim=(0, 2)))
    )


def build_paged_fp8(
    seq_lens: list[int], heads_kv: int, head_dim: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A scaled FP8 layer filled through write_kv_fp8 (whole sequences, shuffled blocks), and
    each sequence's K/V dequantized from it by plain indexing (no kernel involved)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    nb = sum(per_seq) + 2
    cache = fp8_layer(nb, block_size, heads_kv, head_dim)
    perm = torch.randperm(nb, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max(per_seq) + 1), perm[-1], dtype=torch.int32)
    dense = []
    for i, n in enumerate(seq_lens):
        k = kv_values(n, heads_kv, head_dim, seed=seed + 2 * i)
        v = kv_values(n, heads_kv, head_dim, seed=seed + 2 * i + 1)
        ids = [perm.pop(0) for _ in range(per_seq[i])]
        tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        if not n:
            dense.append((k, v))
            continue
        ends = [min(block_size, n - j * block_size) for j in range(len(ids))]
        kernels.write_kv_fp8(cache, k, v, ids, [0] * len(ids), ends, ends)
        s = reference.fp8_scales(cache)
        kd = torch.cat([cache[0, b, :block_size].float() * s[0, b][None, :, None] for b in ids])
        vd = torch.cat([cache[1, b, :block_size].float() * s[1, b][None, :, None] for b in ids])
        dense.append((kd[:n], vd[:n]))
    return cache, tables, torch.tensor(seq_lens, dtype=torch.int32), dense


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize(
    ("heads", "heads_kv", "head_dim", "block_size"), [(4, 4, 16, 4), (9, 3, 64, 16)]
)
def test_paged_attention_fp8_equals_dequantize_then_attend(
    dtype: torch.dtype, heads: int, heads_kv: int, head_dim: int, block_size: int
) -> None:
    seq_lens = [1, block_size - 1, block_size, 3 * block_size + 5, 0]
    cache, tables, lens, dense = build_paged_fp8(seq_lens, heads_kv, head_dim, block_size, 11)
    query = torch.randn(len(seq_lens), heads, head_dim, generator=torch.Generator().manual_seed(5))
    query = query.to(dtype)
    scale = head_dim**-0.5
    got = kernels.paged_attention_fp8(query, cache, tables, lens, scale)
    assert got.shape == query.shape and got.dtype == dtype
    want = dense_attention(query, dense, scale)
    torch.testing.assert_close(got.float(), want, atol=ATTN_TOL[dtype], rtol=ATTN_TOL[dtype])
    assert torch.equal(got[-1].float(), torch.zeros(heads, head_dim))


def _bad_fp8_calls() -> list[tuple[str, object, str]]:
    cache, tables, lens, _ = build_paged_fp8([5, 9], 2, 8, 4, 1)
    q = torch.randn(2, 4, 8)
    k = torch.randn(3, 2, 8)
    pa, w = kernels.paged_attention_fp8, kernels.write_kv_fp8
    plain = torch.zeros(2, 4, 5, 2, 8)
    odd = torch.zeros(2, 4, 5, 2, 6).to(FP8)
    return [
        ("plain cache", lambda: pa(q, plain, tables, lens, 1.0), "float8_e4m3fn"),
        ("head_dim % 4", lambda: w(odd, k[..., :6], k[..., :6], [0], [0], [3], [3]), "multiple"),
        ("seq_len past blocks", lambda: pa(q, cache, tables, lens * 9, 1.0), r"seq_lens\[0\]"),
        ("rows past block", lambda: w(cache, k, k, [0], [2], [5], [5]), "row_start"),
        ("empty range", lambda: w(cache, k[:0], k[:0], [0], [2], [2], [2]), "row_start"),
        ("valid < end", lambda: w(cache, k, k, [0], [0], [3], [2]), "valid_rows"),
        ("token count", lambda: w(cache, k, k, [0], [0], [2], [2]), "tokens"),
        ("repeated block", lambda: w(cache, k, k, [1, 1], [0, 2], [2, 3], [2, 3]), "duplicate"),
        ("k shape", lambda: w(cache, k[:, :1], k[:, :1], [0], [0], [3], [3]), "k must be"),
        ("k dtype", lambda: w(cache, k.to(FP8), k.to(FP8), [0], [0], [3], [3]), "dtype"),
    ]


@pytest.mark.parametrize(
    ("case", "call", "match"), _bad_fp8_calls(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_bad_fp8_inputs_raise_value_error(case: str, call: object, match: str) -> None:
    assert callable(call)
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", ATTN_DTYPES)
def test_cuda_write_kv_fp8_matches_reference_bit_for_bit(dtype: torch.dtype) -> None:
    bs, h, d = 16, 8, 128
    host = fp8_layer(12, bs, h, d)
    kv = [kv_values(40, h, d, seed=s).to(dtype) for s in (6, 7)]
    steps = [  # prefill of 40 tokens, then decode tokens that keep, grow and overwrite
        ([3, 7, 1], [0, 0, 0], [16, 16, 8], [16, 16, 8], slice(0, 40)),
        ([1], [8], [9], [9], slice(0, 1)),
        ([1, 5], [9, 0], [10, 1], [10, 1], slice(1, 3)),
    ]
    dev = host.cuda()
    for ids, lo, hi, valid, rows in steps:
        k, v = (x[rows] * (1 + 4 * (len(ids) == 2)) for x in kv)
        reference.write_kv_fp8(host, k, v, *(torch.tensor(t) for t in (ids, lo, hi, valid)))
        kernels.write_kv_fp8(dev, k.cuda(), v.cuda(), ids, lo, hi, valid)
        torch.cuda.synchronize()
        assert same_bytes(dev.cpu(), host)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", ATTN_DTYPES)
def test_cuda_paged_attention_fp8_matches_reference(dtype: torch.dtype) -> None:
    seq_lens = [1, 15, 16, 17, 0, 300]
    cache, tables, lens, _ = build_paged_fp8(seq_lens, 8, 128, 16, 21)
    query = torch.randn(len(seq_lens), 32, 128).to(dtype)
    want = reference.paged_attention_fp8(query, cache, tables, lens, 128**-0.5)
    got = kernels.paged_attention_fp8(
        query.cuda(), cache.cuda(), tables.cuda(), lens.cuda(), 128**-0.5
    )
    tol = ATTN_TOL[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


# -- fp8 record payloads straight from the cache ------------------------------------------------


def _payload_caches(dtype: torch.dtype, block_major: bool) -> list[torch.Tensor]:
    """3 layers of random bit patterns (NaN, infinities, subnormals: whatever the dtype holds),
    but for layer 1, which holds KV-like values with an outlier head."""
    caches = make_caches(3, 7, 16, 2, 8, dtype, seed=5, block_major=block_major)
    gen = torch.Generator().manual_seed(9)
    values = torch.randn(caches[1].shape, generator=gen)
    values[..., -1, :] *= 40.0
    caches[1].copy_(values.to(dtype))
    return caches


def _flat_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("block_major", [False, True])
def test_fp8_payloads_of_cache_blocks_are_the_codecs_bytes(
    dtype: torch.dtype, block_major: bool
) -> None:
    caches = _payload_caches(dtype, block_major)
    shape = block_shape(caches)
    ids = [4, 0, 6]
    size = kernels.fp8_payload_bytes(caches)
    assert size == codecs.fp8_payload_bytes(codecs.BlockFormat(str(dtype)[6:], shape))
    out = torch.full((3, size + 8), 0xAB, dtype=torch.uint8)  # rows wider than a payload
    kernels.gather_fp8_payloads(caches, ids, out)
    blocks = torch.empty((3, *shape), dtype=dtype)
    kernels.gather_blocks(caches, ids, blocks)
    fmt = codecs.BlockFormat(str(dtype)[6:], shape)
    payloads = []
    for i in range(3):
        want = bytearray(size)
        codecs.fp8_encode(_flat_bytes(blocks[i]), fmt, memoryview(want))
        assert bytes(out[i, :size].numpy()) == bytes(want)
        assert bool((out[i, size:] == 0xAB).all())  # past the payload: untouched
        payloads.append(want)
    # And back: each payload decodes into the cache as the codec decodes it.
    fresh = [torch.zeros_like(c) for c in caches]
    kernels.scatter_fp8_payloads(out, fresh, [1, 2, 3])
    got = torch.empty((3, *shape), dtype=dtype)
    kernels.gather_blocks(fresh, [1, 2, 3], got)
    for i in range(3):
        decoded = bytearray(blocks[i].numel() * blocks.element_size())
        assert codecs.fp8_decode(memoryview(payloads[i]), memoryview(decoded))
        assert bytes(_flat_bytes(got[i])) == bytes(decoded)
    untouched = [0, 4, 5, 6]
    assert all(not bool(raw(c[:, untouched]).any()) for c in fresh)


def test_bad_fp8_payload_calls_raise_value_error() -> None:
    caches = _payload_caches(torch.bfloat16, False)
    size = kernels.fp8_payload_bytes(caches)
    out = torch.zeros((2, size), dtype=torch.uint8)
    kernels.gather_fp8_payloads(caches, [1, 2], out)
    cases = [
        (lambda: kernels.gather_fp8_payloads(caches, [1, 2], out[:, :-1]), "needs"),
        (lambda: kernels.gather_fp8_payloads(caches, [1, 2], out.float()), "uint8"),
        (lambda: kernels.gather_fp8_payloads(caches, [1], out), "block ids name 1"),
        (lambda: kernels.gather_fp8_payloads(caches, [1, 9], out), "block_ids"),
        (lambda: kernels.gather_fp8_payloads([c.to(FP8) for c in caches], [1, 2], out), "fp8"),
        (lambda: kernels.scatter_fp8_payloads(out, caches, [3, 3]), "duplicate"),
        (lambda: kernels.scatter_fp8_payloads(out, [c.half() for c in caches], [3, 4]), "float16"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    bad = out.clone()
    bad[1, 0] ^= 1  # magic
    with pytest.raises(ValueError, match=r"payloads\[1\]"):
        kernels.scatter_fp8_payloads(bad, caches, [3, 4])


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", ATTN_DTYPES)
def test_cuda_fp8_payloads_match_reference_bit_for_bit(dtype: torch.dtype) -> None:
    host = _payload_caches(dtype, True)
    dev = [c.cuda() for c in host]
    size = kernels.fp8_payload_bytes(host)
    want = torch.zeros((3, size), dtype=torch.uint8)
    reference.gather_fp8_payloads(host, torch.tensor([4, 0, 6]), want)
    pinned = torch.zeros((3, size), dtype=torch.uint8).pin_memory()
    kernels.gather_fp8_payloads(dev, [4, 0, 6], pinned)  # straight into pinned host memory
    torch.cuda.synchronize()
    assert torch.equal(pinned, want)
    back_host = [torch.zeros_like(c) for c in host]
    back_dev = [c.cuda() for c in back_host]
    reference.scatter_fp8_payloads(want, back_host, torch.tensor([1, 2, 3]))
    kernels.scatter_fp8_payloads(want.cuda(), back_dev, [1, 2, 3])
    assert all(same_bytes(d, h) for d, h in zip(back_dev, back_host, strict=True))
