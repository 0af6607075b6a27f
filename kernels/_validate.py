"""Input checks shared by every kernel entry point. Each raises ValueError naming the problem.

Shapes, dtypes and devices are always checked (host metadata, free). Values inside id tensors
(range, uniqueness) are checked when ``check=True``; for ids that live on a GPU that costs one
device sync, which is why callers on a hot path may turn it off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

IdsLike = Sequence[int] | torch.Tensor
BlocksLike = torch.Tensor | Sequence[torch.Tensor]

ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PAYLOAD_SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPE = torch.float8_e4m3fn
FP8_SCALE_ROWS = 1  # as reference.FP8_SCALE_ROWS (this module imports no implementation)


@dataclass(frozen=True)
class CacheGeometry:
    """What the kernels need to know about a list of per-layer caches ``[2, nb, bs, H, D]``.

    ``kv_stride`` and ``block_stride`` are element strides of dims 0 and 1, equal in every layer;
    the K or V part of one block (``block_size * H * D`` elements, a "chunk") is contiguous.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    kv_stride: int
    block_stride: int

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def chunk_elems(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_dim


def _check_layer(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 5 or t.shape[0] != 2:
        raise ValueError(
            f"{what} has shape {tuple(t.shape)}, expected [2, num_blocks, block_size, H, D]"
        )
    h, d = t.shape[3], t.shape[4]
    # The kernels move one (layer, K|V, block) chunk as one contiguous run of bytes.
    if t.stride()[2:] != (h * d, d, 1):
        raise ValueError(
            f"{what} has strides {t.stride()}: each block's [block_size, H, D] must be contiguous"
        )
    return t


def check_caches(kv_caches: Sequence[torch.Tensor]) -> CacheGeometry:
    """Validate per-layer caches: same shape, dtype, device and strides in every layer."""
    if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, Sequence):
        raise ValueError("kv_caches must be a list of per-layer tensors [2, nb, bs, H, D]")
    if len(kv_caches) == 0:
        raise ValueError("kv_caches is empty: need one tensor per layer")
    first = _check_layer(kv_caches[0], "kv_caches[0]")
    for i, t in enumerate(kv_caches[1:], start=1):
        _check_layer(t, f"kv_caches[{i}]")
        if t.shape != first.shape:
            raise ValueError(
                f"kv_caches[{i}] has shape {tuple(t.shape)}, kv_caches[0] {tuple(first.shape)}"
            )
        if t.dtype != first.dtype:
            raise ValueError(f"kv_caches[{i}] has dtype {t.dtype}, kv_caches[0] {first.dtype}")
        if t.device != first.device:
            raise ValueError(f"kv_caches[{i}] is on {t.device}, kv_caches[0] on {first.device}")
        if t.stride() != first.stride():
            raise ValueError(
                f"kv_caches[{i}] has strides {t.stride()}, kv_caches[0] {first.stride()}"
            )
    _, nb, bs, h, d = first.shape
    return CacheGeometry(
        num_layers=len(kv_caches),
        num_blocks=nb,
        block_size=bs,
        num_kv_heads=h,
        head_dim=d,
        dtype=first.dtype,
        device=first.device,
        kv_stride=first.stride(0),
        block_stride=first.stride(1),
    )


def as_ids(ids: IdsLike, what: str) -> torch.Tensor:
    """Block ids as a 1-D int64 tensor (on the device they came on; lists land on the CPU)."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise ValueError(f"{what} must be 1-D, got shape {tuple(ids.shape)}")
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{what} must be int32 or int64, got {ids.dtype}")
        return ids.to(torch.int64)
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise ValueError(f"{what} must be a sequence of ints or a 1-D int tensor")
    for i, b in enumerate(ids):
        if isinstance(b, bool) or not isinstance(b, int):
            raise ValueError(f"{what}[{i}] must be an int, got {type(b).__name__}")
    return torch.tensor(list(ids), dtype=torch.int64)


def check_id_range(ids: torch.Tensor, num_blocks: int, what: str) -> None:
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= num_blocks)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{what}[{i}] = {int(ids[i])} out of range [0, {num_blocks})")


def check_unique(ids: torch.Tensor, what: str) -> None:
    if ids.numel() > 1 and torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{what} has duplicate block ids; each destination block may appear once")


def check_blocks(blocks: BlocksLike, geom: CacheGeometry, n: int, what: str) -> None:
    """``blocks`` is ``[n, *block_shape]`` (each block contiguous) or n tensors of block_shape."""
    shape = geom.block_shape
    if isinstance(blocks, torch.Tensor):
        if blocks.dim() != 6 or tuple(blocks.shape[1:]) != shape:
            raise ValueError(f"{what} has shape {tuple(blocks.shape)}, expected [{n}, *{shape}]")
        if blocks.shape[0] != n:
            raise ValueError(f"{what} holds {blocks.shape[0]} blocks, block ids name {n}")
        if blocks.dtype != geom.dtype:
            raise ValueError(f"{what} has dtype {blocks.dtype}, kv_caches {geom.dtype}")
        if n > 0 and not blocks[0].is_contiguous():
            raise ValueError(f"{what}: each block [{n}, ...][i] must be contiguous")
        _check_block_device(blocks, geom, what)
        return
    if not isinstance(blocks, Sequence) or isinstance(blocks, str | bytes):
        raise ValueError(f"{what} must be a tensor or a sequence of per-block tensors")
    if len(blocks) != n:
        raise ValueError(f"{what} holds {len(blocks)} blocks, block ids name {n}")
    for i, b in enumerate(blocks):
        if not isinstance(b, torch.Tensor):
            raise ValueError(f"{what}[{i}] must be a torch.Tensor, got {type(b).__name__}")
        if tuple(b.shape) != shape:
            raise ValueError(f"{what}[{i}] has shape {tuple(b.shape)}, expected {shape}")
        if b.dtype != geom.dtype:
            raise ValueError(f"{what}[{i}] has dtype {b.dtype}, kv_caches {geom.dtype}")
        if not b.is_contiguous():
            raise ValueError(f"{what}[{i}] must be contiguous")
        _check_block_device(b, geom, f"{what}[{i}]")


def _check_block_device(t: torch.Tensor, geom: CacheGeometry, what: str) -> None:
    if geom.device.type == "cuda":
        # Host memory is allowed here; cuda.py checks it is pinned (device-accessible).
        if t.device.type == "cuda" and t.device != geom.device:
            raise ValueError(f"{what} is on {t.device}, kv_caches on {geom.device}")
        if t.device.type not in ("cuda", "cpu"):
            raise ValueError(f"{what} is on {t.device}, kv_caches on {geom.device}")
    elif t.device != geom.device:
        raise ValueError(f"{what} is on {t.device}, kv_caches on {geom.device}")


def check_fp8_payloads(payloads: object, geom: CacheGeometry, n: int, what: str) -> int:
    """``payloads`` is uint8 ``[n, >= P]`` with contiguous rows, for caches the fp8 payload
    can encode (bfloat16, float16, float32); returns P, the payload's bytes."""
    if geom.dtype not in PAYLOAD_SOURCE_DTYPES:
        raise ValueError(
            f"kv_caches have dtype {geom.dtype}; fp8 payloads encode bfloat16, float16 or float32"
        )
    layers, kv, bs, h, d = geom.block_shape
    size = 24 + 4 * layers * kv * h + layers * kv * bs * h * d  # as fp8.payload_bytes
    if not isinstance(payloads, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(payloads).__name__}")
    if payloads.dtype != torch.uint8 or payloads.dim() != 2:
        raise ValueError(
            f"{what} must be uint8 [n, >= {size}], got {payloads.dtype} {tuple(payloads.shape)}"
        )
    if payloads.shape[0] != n:
        raise ValueError(f"{what} holds {payloads.shape[0]} payloads, block ids name {n}")
    if payloads.shape[1] < size:
        raise ValueError(f"{what} rows hold {payloads.shape[1]} bytes; a payload needs {size}")
    if n > 0 and payloads.stride(1) != 1:
        raise ValueError(f"{what}: each row must be contiguous")
    _check_block_device(payloads, geom, what)
    return size


@dataclass(frozen=True)
class AttentionShape:
    num_seqs: int
    num_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    max_blocks: int


def check_attention(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    check: bool,
    fp8: bool = False,
) -> AttentionShape:
    """With ``fp8`` the layer is a scaled FP8 one (``reference.py``): e4m3fn, one scale row
    after each block's ``block_size`` token rows; otherwise it has the query's dtype."""
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        got = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise ValueError(f"query must be a tensor [num_seqs, num_heads, head_dim], got {got}")
    if query.dtype not in ATTENTION_DTYPES:
        raise ValueError(
            f"query has dtype {query.dtype}; paged_attention supports {ATTENTION_DTYPES}"
        )
    cache = _check_layer(kv_cache_layer, "kv_cache_layer")
    if fp8:
        check_fp8_layer(cache, "kv_cache_layer")
    elif cache.dtype != query.dtype:
        raise ValueError(f"kv_cache_layer has dtype {cache.dtype}, query {query.dtype}")
    s, hq, d = query.shape
    _, nb, bs, hkv, dc = cache.shape
    bs -= FP8_SCALE_ROWS if fp8 else 0
    if dc != d:
        raise ValueError(f"query head_dim {d} != kv_cache_layer head_dim {dc}")
    if bs == 0 or hkv == 0:
        raise ValueError(f"kv_cache_layer has shape {tuple(cache.shape)}: empty blocks or heads")
    if hq % hkv:
        raise ValueError(f"num_heads {hq} is not a multiple of num_kv_heads {hkv}")
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2:
        raise ValueError("block_tables must be a 2-D int32 tensor [num_seqs, max_blocks]")
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if block_tables.shape[0] != s:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, query {s} sequences")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1:
        raise ValueError("seq_lens must be a 1-D int32 tensor [num_seqs]")
    if seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32, got {seq_lens.dtype}")
    if seq_lens.shape[0] != s:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries, query {s} sequences")
    for name, t in (
        ("kv_cache_layer", cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
    ):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    if not isinstance(scale, int | float) or isinstance(scale, bool):
        raise ValueError(f"scale must be a float, got {type(scale).__name__}")
    max_blocks = block_tables.shape[1]
    if check and s > 0:
        lens = seq_lens.to(torch.int64)
        bad_len = (lens < 0) | (lens > max_blocks * bs)
        if bool(bad_len.any()):
            i = int(bad_len.nonzero()[0, 0])
            raise ValueError(
                f"seq_lens[{i}] = {int(lens[i])} outside [0, {max_blocks * bs}] "
                f"(max_blocks {max_blocks} x block_size {bs})"
            )
        used = (
            torch.arange(max_blocks, device=lens.device)[None, :] < (lens[:, None] + bs - 1) // bs
        )
        bad = used & ((block_tables < 0) | (block_tables >= nb))
        if bool(bad.any()):
            i, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"block_tables[{i}, {j}] = {int(block_tables[i, j])} out of range [0, {nb})"
            )
    return AttentionShape(s, hq, d, nb, bs, hkv, max_blocks)


def check_fp8_layer(cache: torch.Tensor, what: str) -> None:
    """A scaled FP8 cache layer: e4m3fn, at least one token row besides the scale row, and
    head_dim a multiple of 4 (the float32 scales sit 4-byte aligned in the scale row)."""
    if cache.dtype != FP8_DTYPE:
        raise ValueError(f"{what} has dtype {cache.dtype}; a scaled FP8 cache is {FP8_DTYPE}")
    if cache.shape[2] <= FP8_SCALE_ROWS:
        raise ValueError(
            f"{what} has {cache.shape[2]} rows per block: need block_size + {FP8_SCALE_ROWS}"
        )
    if cache.shape[4] % 4 or cache.shape[3] == 0:
        raise ValueError(f"{what}: head_dim {cache.shape[4]} must be a positive multiple of 4")
    if (cache.stride(0) | cache.stride(1)) % 4:
        raise ValueError(f"{what}: strides {cache.stride()} must keep the scales 4-byte aligned")


def check_write_fp8(
    kv_cache_layer: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: torch.Tensor,
    row_start: torch.Tensor,
    row_end: torch.Tensor,
    valid_rows: torch.Tensor,
    check: bool,
) -> int:
    """Validate a ``write_kv_fp8`` call; returns the number of blocks written."""
    cache = _check_layer(kv_cache_layer, "kv_cache_layer")
    check_fp8_layer(cache, "kv_cache_layer")
    _, nb, rows, h, d = cache.shape
    bs = rows - FP8_SCALE_ROWS
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != (h, d):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be [n, {h}, {d}], got {got}")
        if t.dtype not in ATTENTION_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; write_kv_fp8 takes {ATTENTION_DTYPES}")
        if t.device != cache.device:
            raise ValueError(f"{name} is on {t.device}, kv_cache_layer on {cache.device}")
    if k.shape[0] != v.shape[0] or k.dtype != v.dtype:
        raise ValueError(f"k is {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype}")
    m = block_ids.numel()
    for name, t in (("row_start", row_start), ("row_end", row_end), ("valid_rows", valid_rows)):
        if t.dim() != 1 or t.numel() != m:
            raise ValueError(f"{name} must be 1-D with one entry per block ({m})")
    if check and m:
        check_id_range(block_ids, nb, "block_ids")
        check_unique(block_ids, "block_ids")
        lo, hi, valid = (t.to(torch.int64) for t in (row_start, row_end, valid_rows))
        bad = (lo < 0) | (hi <= lo) | (valid < hi) | (valid > bs)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"block {i}: rows [{int(lo[i])}, {int(hi[i])}) valid {int(valid[i])}; need "
                f"0 <= row_start < row_end <= valid_rows <= block_size ({bs})"
            )
        if int((hi - lo).sum()) != k.shape[0]:
            raise ValueError(f"the blocks take {int((hi - lo).sum())} tokens, k has {k.shape[0]}")
    return m


@dataclass(frozen=True)
class ChecksumBlocks:
    """What the device checksum needs to know about its blocks; ``device`` is None when n == 0."""

    n: int
    nbytes: int
    device: torch.device | None


def _check_block_bytes(nbytes: int, what: str) -> None:
    # The checksum reads whole 64-bit words.
    if nbytes <= 0 or nbytes % 8:
        raise ValueError(f"{what} holds {nbytes} bytes per block; need a positive multiple of 8")


def _check_aligned(address: int, what: str) -> None:
    # The kernel loads 8-byte words, which must be 8-byte aligned; the CPU reference does not
    # care, but refusing everywhere keeps a CPU test from passing what a GPU then rejects.
    if address % 8:
        raise ValueError(f"{what} is at an address that is not a multiple of 8 (8-byte words)")


def check_checksum_blocks(blocks: BlocksLike) -> ChecksumBlocks:
    """``blocks`` is ``[n, ...]`` (each row one contiguous block) or n contiguous tensors, on one
    device, each of the same byte size, a positive multiple of 8, at an 8-byte aligned address.
    Dtypes and shapes are free: only the bytes count."""
    if isinstance(blocks, torch.Tensor):
        if blocks.layout != torch.strided:
            raise ValueError(f"blocks must be a dense (strided) tensor, got {blocks.layout}")
        if blocks.dim() == 0:
            raise ValueError("blocks is a 0-d tensor; expected [n, ...], one row per block")
        n = blocks.shape[0]
        nbytes = math.prod(blocks.shape[1:]) * blocks.element_size()
        _check_block_bytes(nbytes, "blocks")
        if n > 0:
            if not blocks[0].is_contiguous():
                raise ValueError(
                    f"blocks has strides {blocks.stride()}: each block blocks[i] must be contiguous"
                )
            _check_aligned(blocks.data_ptr(), "blocks")
        if n > 1:
            _check_aligned(
                blocks.data_ptr() + blocks.stride(0) * blocks.element_size(), "blocks[1]"
            )
        return ChecksumBlocks(n, nbytes, blocks.device if n else None)
    if not isinstance(blocks, Sequence) or isinstance(blocks, str | bytes):
        raise ValueError("blocks must be a tensor [n, ...] or a sequence of per-block tensors")
    if len(blocks) == 0:
        return ChecksumBlocks(0, 0, None)
    first_bytes = 0
    device = None
    for i, b in enumerate(blocks):
        what = f"blocks[{i}]"
        if not isinstance(b, torch.Tensor):
            raise ValueError(f"{what} must be a torch.Tensor, got {type(b).__name__}")
        if b.layout != torch.strided:
            raise ValueError(f"{what} must be a dense (strided) tensor, got {b.layout}")
        if not b.is_contiguous():
            raise ValueError(f"{what} has strides {b.stride()}: it must be contiguous")
        nbytes = b.numel() * b.element_size()
        _check_block_bytes(nbytes, what)
        if i == 0:
            first_bytes, device = nbytes, b.device
        elif nbytes != first_bytes:
            raise ValueError(
                f"{what} holds {nbytes} bytes, blocks[0] {first_bytes}; blocks must be one size"
            )
        elif b.device != device:
            raise ValueError(f"{what} is on {b.device}, blocks[0] on {device}")
        _check_aligned(b.data_ptr(), what)
    return ChecksumBlocks(len(blocks), first_bytes, device)
