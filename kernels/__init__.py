"""Paged KV-cache kernels: gather, scatter, block copy, decode paged attention and a device
checksum of whole blocks.

Engine layout (per layer, as vLLM keeps it): ``kv_caches[l]`` is ``[2, num_blocks, block_size,
num_kv_heads, head_dim]`` (K then V); each block's ``[block_size, H, D]`` must be contiguous, the
strides of dims 0 and 1 are free but equal in every layer. Store layout: one contiguous block
``[num_layers, 2, block_size, H, D]``.

Every function validates its inputs (ValueError naming the problem) and dispatches on the
device of the caches: CUDA tensors go to the CuPy-launched kernels in ``cuda.py`` (imported only
then, so CuPy stays optional), anything else to the torch reference in ``reference.py``.
``check=False`` skips only the checks that read id values (range, uniqueness, seq_lens), which
cost a device sync when the ids live on a GPU.

This package imports nothing from kvstore: it is the lowest layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import fp8, reference
from ._validate import (
    BlocksLike,
    CacheGeometry,
    IdsLike,
    as_ids,
    check_attention,
    check_blocks,
    check_caches,
    check_checksum_blocks,
    check_fp8_payloads,
    check_id_range,
    check_unique,
    check_write_fp8,
)

__all__ = [
    "copy_blocks",
    "device_checksums",
    "fp8",
    "fp8_payload_bytes",
    "gather_blocks",
    "gather_fp8_payloads",
    "paged_attention",
    "paged_attention_fp8",
    "reference",
    "scatter_blocks",
    "scatter_fp8_payloads",
    "write_kv_fp8",
]


def _block_ids(
    kv_caches: Sequence[torch.Tensor],
    block_ids: IdsLike,
    check: bool,
    *,
    distinct: bool,
) -> tuple[CacheGeometry, torch.Tensor]:
    """The caches' geometry and ``block_ids`` as a tensor, range-checked (and, for a
    destination, checked distinct) with ``check``: the part every block launcher shares."""
    geom = check_caches(kv_caches)
    ids = as_ids(block_ids, "block_ids")
    if check:
        check_id_range(ids, geom.num_blocks, "block_ids")
        if distinct:
            check_unique(ids, "block_ids")
    return geom, ids


def _launch(name: str, geom: CacheGeometry, *args: Any) -> None:
    """Run kernel ``name`` where the caches live: the CUDA launcher (given ``geom`` first; CuPy
    imported only then) or the torch reference of the same name."""
    if geom.device.type == "cuda":
        from . import cuda

        getattr(cuda, name)(geom, *args)
    else:
        getattr(reference, name)(*args)


def gather_blocks(
    kv_caches: Sequence[torch.Tensor], block_ids: IdsLike, out: BlocksLike, *, check: bool = True
) -> None:
    """Copy physical blocks out of the paged cache: ``out[i][l] = kv_caches[l][:, block_ids[i]]``.

    ``out`` is one tensor ``[n, num_layers, 2, block_size, H, D]`` or n contiguous per-block
    tensors (e.g. views into shared-memory slots). With CUDA caches, ``out`` may be device memory
    or pinned host memory, written by the kernel directly (zero-copy); all layers go in one launch.
    """
    geom, ids = _block_ids(kv_caches, block_ids, check, distinct=False)
    check_blocks(out, geom, ids.numel(), "out")
    if ids.numel():
        _launch("gather_blocks", geom, kv_caches, ids, out)


def scatter_blocks(
    blocks: BlocksLike, kv_caches: Sequence[torch.Tensor], block_ids: IdsLike, *, check: bool = True
) -> None:
    """Copy contiguous blocks into the paged cache, the inverse of gather_blocks:
    ``kv_caches[l][:, block_ids[i]] = blocks[i][l]``.

    ``block_ids`` must be distinct (each destination written once).
    """
    geom, ids = _block_ids(kv_caches, block_ids, check, distinct=True)
    check_blocks(blocks, geom, ids.numel(), "blocks")
    if ids.numel():
        _launch("scatter_blocks", geom, blocks, kv_caches, ids)


def fp8_payload_bytes(kv_caches: Sequence[torch.Tensor]) -> int:
    """Bytes of one block's fp8 payload (layout in ``fp8.py``) for these caches."""
    return fp8.payload_bytes(check_caches(kv_caches).block_shape)


def gather_fp8_payloads(
    kv_caches: Sequence[torch.Tensor], block_ids: IdsLike, out: torch.Tensor, *, check: bool = True
) -> None:
    """Gather blocks of a bfloat16, float16 or float32 paged cache as the tiers' fp8 record
    payloads, quantizing in the kernel: ``out[i, :P]`` is the payload the ``fp8`` codec writes
    for block ``block_ids[i]`` (byte for byte; P = ``fp8_payload_bytes``), ``out`` uint8
    ``[n, >= P]`` with contiguous rows. With CUDA caches ``out`` may be pinned host memory,
    written by the kernel directly, so only the payload (~0.53x the block) crosses PCIe."""
    geom, ids = _block_ids(kv_caches, block_ids, check, distinct=False)
    check_fp8_payloads(out, geom, ids.numel(), "out")
    if ids.numel():
        _launch("gather_fp8_payloads", geom, kv_caches, ids, out)


def scatter_fp8_payloads(
    payloads: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    block_ids: IdsLike,
    *,
    check: bool = True,
) -> None:
    """Decode fp8 record payloads into blocks of the paged cache, dequantizing in the kernel:
    the inverse of gather_fp8_payloads, and byte for byte what the ``fp8`` codec decodes.
    ``block_ids`` must be distinct. With ``check``, every payload's header must state this
    cache's block shape and dtype (ValueError otherwise; one copy of n headers to the host)."""
    geom, ids = _block_ids(kv_caches, block_ids, check, distinct=True)
    check_fp8_payloads(payloads, geom, ids.numel(), "payloads")
    if check:
        want = torch.frombuffer(
            bytearray(fp8.header(geom.block_shape, geom.dtype)), dtype=torch.uint8
        )
        heads = payloads[:, : fp8.HEADER.size].cpu()
        bad = (heads != want).any(dim=1).nonzero()
        if bad.numel():
            raise ValueError(
                f"payloads[{int(bad[0])}] is not the fp8 payload of a {geom.dtype} block of shape "
                f"{geom.block_shape}"
            )
    if ids.numel():
        _launch("scatter_fp8_payloads", geom, payloads, kv_caches, ids)


def copy_blocks(
    kv_caches: Sequence[torch.Tensor],
    src_block_ids: IdsLike,
    dst_block_ids: IdsLike,
    *,
    check: bool = True,
) -> None:
    """Copy whole physical blocks in every layer (for copy-on-write):
       ``kv_caches[l][:, dst[i]] = kv_caches[l][:, src[i]]``.
    Destinations must be distinct and disjoint from the sources, so that the
       result does not depend on the order the copies run in.
    """
    geom = check_caches(kv_caches)
    src = as_ids(src_block_ids, "src_block_ids")
    dst = as_ids(dst_block_ids, "dst_block_ids")
    if src.numel() != dst.numel():
        raise ValueError(
            f"src_block_ids has {src.numel()} entries, dst_block_ids {dst.numel()}; they pair up"
        )
    if check:
        check_id_range(src, geom.num_blocks, "src_block_ids")
        check_id_range(dst, geom.num_blocks, "dst_block_ids")
        check_unique(dst, "dst_block_ids")
        if src.numel() and bool(torch.isin(dst, src.to(dst.device)).any()):
            raise ValueError("dst_block_ids overlap src_block_ids; a block cannot be both")
    if src.numel():
        _launch("copy_blocks", geom, kv_caches, src, dst)


def paged_attention(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Decode attention for one layer over a paged cache; returns ``[num_seqs, num_heads, D]``.

    query ``[num_seqs, num_heads, D]`` (fp16, bf16 or fp32); kv_cache_layer ``[2, num_blocks,
    block_size, num_kv_heads, D]`` of the same dtype; block_tables ``[num_seqs, max_blocks]``
    int32 (entries past a sequence's last block are ignored); seq_lens ``[num_seqs]`` int32.
    num_heads must be a multiple of num_kv_heads (GQA). Softmax and sums run in float32; a
    sequence of length 0 gets zeros.
    """
    shape = check_attention(query, kv_cache_layer, block_tables, seq_lens, scale, check)
    if query.device.type == "cuda":
        from . import cuda

        return cuda.paged_attention(shape, query, kv_cache_layer, block_tables, seq_lens, scale)
    return reference.paged_attention(query, kv_cache_layer, block_tables, seq_lens, float(scale))


def paged_attention_fp8(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    check: bool = True,
) -> torch.Tensor:
    """``paged_attention`` over a scaled FP8 layer (format in ``reference.py``): kv_cache_layer
    ``[2, num_blocks, block_size + 1, num_kv_heads, D]`` float8_e4m3fn, whose last row per
    (K|V, block) holds the blocks' per-head float32 scales. K and V are dequantized in the
    kernel as they are read; query and result are fp16, bf16 or fp32."""
    shape = check_attention(query, kv_cache_layer, block_tables, seq_lens, scale, check, fp8=True)
    if query.device.type == "cuda":
        from . import cuda

        return cuda.paged_attention(
            shape, query, kv_cache_layer, block_tables, seq_lens, scale, fp8=True
        )
    return reference.paged_attention_fp8(
        query, kv_cache_layer, block_tables, seq_lens, float(scale)
    )


def write_kv_fp8(
    kv_cache_layer: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: IdsLike,
    row_start: IdsLike,
    row_end: IdsLike,
    valid_rows: IdsLike,
    *,
    check: bool = True,
) -> None:
    """Quantize new tokens' K and V (``[n, H, D]``, fp16/bf16/fp32, packed in block order) into
    blocks of a scaled FP8 layer, keeping each group's scale covering its block (semantics in
    ``reference.write_kv_fp8``). Block ids must be distinct; ``0 <= row_start < row_end <=
    valid_rows <= block_size`` for each block and the blocks take exactly n tokens."""
    ids = as_ids(block_ids, "block_ids")
    lo, hi = as_ids(row_start, "row_start"), as_ids(row_end, "row_end")
    valid = as_ids(valid_rows, "valid_rows")
    if check_write_fp8(kv_cache_layer, k, v, ids, lo, hi, valid, check) == 0:
        return
    if kv_cache_layer.device.type == "cuda":
        from . import cuda

        cuda.write_kv_fp8(kv_cache_layer, k, v, ids, lo, hi, valid)
    else:
        reference.write_kv_fp8(kv_cache_layer, k, v, ids, lo, hi, valid)


def device_checksums(blocks: Sequence[torch.Tensor] | torch.Tensor) -> list[int]:
    """A 64-bit checksum of each block's bytes, one int in ``[0, 2**64)`` per block, computed
    where the blocks live: for KV blocks in a GPU memory pool (xxh3, used for host copies, is
    sequential and unfit for a GPU).

    ``blocks`` is one tensor ``[n, ...]`` (each row a contiguous block) or n contiguous tensors
    (e.g. views into slots of a pool), on one device, each of the same byte size, a positive
    multiple of 8, at an 8-byte aligned address; any dtype, only the bytes count. On CUDA, one
    kernel launch on torch's current stream and one copy of n integers to the host; elsewhere
    the numpy reference. The definition (bit for bit the same on both paths) is in
    ``block_checksum.cu``. The checksum detects changes, it is no cryptographic hash.
    """
    spec = check_checksum_blocks(blocks)
    if spec.n == 0 or spec.device is None:
        return []
    if spec.device.type == "cuda":
        from . import cuda

        return cuda.device_checksums(blocks, spec)
    return reference.device_checksums(blocks)
