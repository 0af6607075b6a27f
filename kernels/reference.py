"""Torch reference of every kernel. Runs on any device torch runs on; the CPU path of the public
API and the oracle the CUDA kernels are tested against.

Inputs are assumed validated by the public entry points in ``__init__``. Copies move bytes: each
tensor is viewed as the integer type of its element size, so every dtype (float8 included, NaN
payloads included) round-trips bit for bit. The device checksum runs in numpy uint64, whose
arithmetic wraps mod 2^64 exactly as the kernel's does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from . import fp8

_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer type of its element size (same storage, no copy)."""
    return t.view(_RAW[t.element_size()])


def _host(tensors: Sequence[torch.Tensor]) -> list[np.ndarray] | None:
    """Raw numpy views of CPU tensors (no copy), or None if any tensor is on another device.

    On CPU the copies below go through numpy: ``np.copyto`` of a block's per-layer chunk runs in
    the calling thread at ~0.8x memcpy, where torch's copy kernels measured 0.44x (thread-pool
    hand-offs per chunk) and stall when another process holds a core."""
    if any(t.device.type != "cpu" for t in tensors):
        return None
    return [raw(t.detach()).numpy() for t in tensors]


def gather_blocks(
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    out: torch.Tensor | Sequence[torch.Tensor],
) -> None:
    """``out[i][l] = kv_caches[l][:, block_ids[i]]`` for every block i and layer l."""
    caches = _host(kv_caches)
    dsts = _host(list(out)) if caches is not None else None
    if caches is not None and dsts is not None:
        for block, dst_np in zip(block_ids.tolist(), dsts, strict=True):
            for layer, cache_np in enumerate(caches):
                np.copyto(dst_np[layer], cache_np[:, block])
        return
    ids = block_ids.to(device=kv_caches[0].device, dtype=torch.int64)
    if isinstance(out, torch.Tensor):
        out_raw = raw(out)
        for layer, cache in enumerate(kv_caches):
            # [nb, 2, bs, H, D] view of the layer; index_select writes straight into the strided
            # [n, 2, bs, H, D] slice of out, so no temporary the size of the transfer.
            torch.index_select(raw(cache).transpose(0, 1), 0, ids, out=out_raw[:, layer])
        return
    raws = [raw(c) for c in kv_caches]
    for block, dst in zip(ids.tolist(), out, strict=True):
        torch.stack([r[:, block] for r in raws], out=raw(dst))


def scatter_blocks(
    blocks: torch.Tensor | Sequence[torch.Tensor],
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
) -> None:
    """``kv_caches[l][:, block_ids[i]] = blocks[i][l]``: the inverse of gather_blocks.
    Precondition: block_ids are distinct."""
    caches = _host(kv_caches)
    srcs_np = _host(list(blocks)) if caches is not None else None
    if caches is not None and srcs_np is not None:
        for block, src_np in zip(block_ids.tolist(), srcs_np, strict=True):
            for layer, cache_np in enumerate(caches):
                np.copyto(cache_np[:, block], src_np[layer])
        return
    raws = [raw(c) for c in kv_caches]
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for block, blk in zip(block_ids.tolist(), blocks, strict=True):
        b = raw(blk)
        for layer, r in enumerate(raws):
            dsts.append(r[:, block])
            srcs.append(b[layer])
    _copy_all(dsts, srcs)


def copy_blocks(
    kv_caches: Sequence[torch.Tensor], src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor
) -> None:
    """``kv_caches[l][:, dst[i]] = kv_caches[l][:, src[i]]`` in every layer. Precondition:
    destinations are distinct and disjoint from sources, so the copies are order-independent."""
    pairs = list(zip(src_block_ids.tolist(), dst_block_ids.tolist(), strict=True))
    caches = _host(kv_caches)
    if caches is not None:
        for cache in caches:
            for s, d in pairs:
                np.copyto(cache[:, d], cache[:, s])
        return
    raws = [raw(c) for c in kv_caches]
    _copy_all([r[:, d] for r in raws for _, d in pairs], [r[:, s] for r in raws for s, _ in pairs])


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    # One call for all n * num_layers chunk copies keeps per-call Python overhead, which rivals
    # the copy time of a 16-token block, out of the loop. Measured on CPU it also beats
    # index_copy_ over the strided K/V views by about 1.4x (benchmarks/bench_paged.py).
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def paged_attention(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention of one layer, float32 accumulation, one sequence at a time.

    query ``[S, Hq, D]``; kv_cache_layer ``[2, nb, bs, Hkv, D]``; block_tables ``[S, max_blocks]``;
    seq_lens ``[S]``. Query head h reads KV head ``h // (Hq // Hkv)`` (GQA). A sequence of length
    0 gets zeros. Returns ``[S, Hq, D]`` in the query's dtype.
    """
    s, hq, d = query.shape
    bs, hkv = kv_cache_layer.shape[2], kv_cache_layer.shape[3]
    group = hq // hkv
    out = torch.zeros_like(query)
    lens = seq_lens.tolist()
    for i in range(s):
        n = int(lens[i])
        if n == 0:
            continue
        blocks = block_tables[i, : (n + bs - 1) // bs].to(torch.int64)
        k = kv_cache_layer[0, blocks].reshape(-1, hkv, d)[:n].float()
        v = kv_cache_layer[1, blocks].reshape(-1, hkv, d)[:n].float()
        k = k.repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[i].float(), k) * scale
        probs = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", probs, v).to(query.dtype)
    return out


# -- FP8 KV cache (write_kv_fp8.cu, paged_attention.cu) ----------------------------------------
#
# The FP8 format's math (scale, quantize, dequantize, error bound) is defined once, in ``fp8.py``,
# shared with the tiers' fp8 codec; the names below are that module's. Scale groups here: one KV
# head of one (layer, K or V) chunk of one block. A scaled cache layer is
# ``[2, num_blocks, block_size + FP8_SCALE_ROWS, H, D]`` in e4m3fn: the last row of each
# (K|V, block) chunk holds the chunk's H float32 scales in its first 4*H bytes (the rest zero), so
# every byte copy of a block (gather, scatter, copy-on-write, the store) carries its scales with
# it. Needs head_dim % 4 == 0 (the scales are 4-byte aligned). A group of zeros has scale 0.

FP8_DTYPE = fp8.DTYPE
FP8_MAX = fp8.MAX
FP8_SCALE_ROWS = 1
FP8_REL_BOUND = fp8.REL_BOUND
FP8_SUBNORMAL_BOUND = fp8.SUBNORMAL_BOUND
fp8_scale = fp8.scale_of
quantize_fp8 = fp8.quantize
dequantize_fp8 = fp8.dequantize
fp8_error_bound = fp8.error_bound


def fp8_block_size(kv_cache_layer: torch.Tensor) -> int:
    """Tokens per block of a scaled cache layer (its rows less the scale row)."""
    return kv_cache_layer.shape[2] - FP8_SCALE_ROWS


def fp8_scales(kv_cache_layer: torch.Tensor) -> torch.Tensor:
    """``[2, num_blocks, H]`` float32 view (no copy) of a scaled cache layer's scales."""
    h = kv_cache_layer.shape[3]
    rows = raw(kv_cache_layer)[:, :, fp8_block_size(kv_cache_layer)]  # [2, nb, H, D] bytes
    return rows.flatten(2)[:, :, : 4 * h].view(torch.float32)


def fp8_dequantize_blocks(kv_cache_layer: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``[2, n, block_size, H, D]`` float32 values of the listed blocks of a scaled layer."""
    ids = block_ids.to(device=kv_cache_layer.device, dtype=torch.int64)
    bs = fp8_block_size(kv_cache_layer)
    q = kv_cache_layer[:, ids, :bs]
    return dequantize_fp8(q, fp8_scales(kv_cache_layer)[:, ids][:, :, None, :, None])


def write_kv_fp8(
    kv_cache_layer: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: torch.Tensor,
    row_start: torch.Tensor,
    row_end: torch.Tensor,
    valid_rows: torch.Tensor,
) -> None:
    """Quantize new tokens into blocks of a scaled layer. Block i = ``block_ids[i]`` (distinct)
    gets the next ``row_end[i] - row_start[i]`` tokens of ``k``/``v`` (``[n, H, D]``, packed in
    block order) at rows ``[row_start[i], row_end[i])``; rows ``[0, row_start[i])`` and
    ``[row_end[i], valid_rows[i])`` are kept, rows from ``valid_rows[i]`` on are zeroed.

    Per group (block, K|V, head): with kept rows the scale is ``max(old, amax_new / 448)``, else
    ``amax_new / 448``. When it grows, the kept rows are requantized from their dequantized
    values (one more rounding each); otherwise their bytes stay as they are."""
    dev = kv_cache_layer.device
    ids = block_ids.to(device=dev, dtype=torch.int64)
    lo, hi = row_start.to(dev, torch.int64), row_end.to(dev, torch.int64)
    valid = valid_rows.to(dev, torch.int64)
    m, bs = ids.numel(), fp8_block_size(kv_cache_layer)
    counts = hi - lo
    which = torch.repeat_interleave(torch.arange(m, device=dev), counts)  # token -> block i
    first = torch.cumsum(counts, 0) - counts
    rows = lo[which] + torch.arange(which.numel(), device=dev) - first[which]
    new = torch.zeros((2, m, bs, *k.shape[1:]), dtype=torch.float32, device=dev)
    new[0, which, rows] = k.float()
    new[1, which, rows] = v.float()
    r = torch.arange(bs, device=dev)[None, :]
    is_new = (r >= lo[:, None]) & (r < hi[:, None])  # [m, bs]
    is_kept = (r < valid[:, None]) & ~is_new  # [0, row_start) and [row_end, valid_rows)
    has_kept = is_kept.any(dim=1)[None, :, None]  # [1, m, 1]
    scales = fp8_scales(kv_cache_layer)
    old_scale = scales[:, ids]  # [2, m, H]
    amax = (new.abs() * is_new[None, :, :, None, None]).amax(dim=(2, 4))
    scale = torch.where(has_kept, torch.maximum(old_scale, fp8_scale(amax)), fp8_scale(amax))
    grown = has_kept & (scale > old_scale)  # [2, m, H]
    old_q = kv_cache_layer[:, ids, :bs]  # [2, m, bs, H, D]
    requant = quantize_fp8(
        dequantize_fp8(old_q, old_scale[:, :, None, :, None]), scale[:, :, None, :, None]
    )
    kept_q = torch.where(grown[:, :, None, :, None], raw(requant), raw(old_q))
    fresh = raw(quantize_fp8(new, scale[:, :, None, :, None]))
    out = torch.where(
        is_new[None, :, :, None, None],
        fresh,
        torch.where(is_kept[None, :, :, None, None], kept_q, torch.zeros_like(fresh)),
    )
    layer = raw(kv_cache_layer)
    layer[:, ids, :bs] = out
    scales[:, ids] = scale


def paged_attention_fp8(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``paged_attention`` over a scaled FP8 layer: each K/V element dequantized with its
    group's scale, then the same float32 attention."""
    s, hq, d = query.shape
    bs, hkv = fp8_block_size(kv_cache_layer), kv_cache_layer.shape[3]
    group = hq // hkv
    out = torch.zeros_like(query)
    lens = seq_lens.tolist()
    for i in range(s):
        n = int(lens[i])
        if n == 0:
            continue
        kv = fp8_dequantize_blocks(kv_cache_layer, block_tables[i, : (n + bs - 1) // bs])
        k = kv[0].reshape(-1, hkv, d)[:n].repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = kv[1].reshape(-1, hkv, d)[:n].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[i].float(), k) * scale
        probs = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", probs, v).to(query.dtype)
    return out


# -- fp8 record payloads straight from a paged cache (fp8_blocks.cu) ---------------------------
#
# The tiers' fp8 codec payload (layout in ``fp8.py``) of a block of a bf16/f16/f32 cache, so that
# what crosses PCIe is the payload (~0.53x the block) rather than the block. Defined as what the
# codec does to the gathered block: gather_blocks, then ``fp8.encode_payload``; the inverse is
# ``fp8.decode_payload``, then scatter_blocks.


def gather_fp8_payloads(
    kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor
) -> None:
    """``out[i, :P]`` = the fp8 payload of block ``block_ids[i]`` (P = ``fp8.payload_bytes``);
    ``out`` is uint8 ``[n, >= P]``. Bytes past P are left alone."""
    first = kv_caches[0]
    dev = first.device
    shape = (len(kv_caches), 2, first.shape[2], first.shape[3], first.shape[4])
    size = fp8.payload_bytes(shape)
    block = torch.empty((1, *shape), dtype=first.dtype, device=dev)
    payload = torch.empty(size, dtype=torch.uint8)
    for i, b in enumerate(block_ids.tolist()):
        gather_blocks(kv_caches, torch.tensor([b], device=dev), block)
        on_cpu = out.device.type == "cpu"
        fp8.encode_payload(block[0].cpu(), out[i, :size] if on_cpu else payload)
        if not on_cpu:
            out[i, :size].copy_(payload)


def scatter_fp8_payloads(
    payloads: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor
) -> None:
    """``kv_caches[l][:, block_ids[i]]`` = layer l of the block that payload ``payloads[i]``
    decodes to: the inverse of gather_fp8_payloads (whose headers the caller checked).
    Precondition: block_ids are distinct."""
    first = kv_caches[0]
    shape = (len(kv_caches), 2, first.shape[2], first.shape[3], first.shape[4])
    size = fp8.payload_bytes(shape)
    block = torch.empty((1, *shape), dtype=first.dtype)
    for i, b in enumerate(block_ids.tolist()):
        fp8.decode_payload(payloads[i, :size].cpu(), block[0])
        scatter_blocks(block.to(first.device), kv_caches, torch.tensor([b], device=first.device))


# -- device checksum (block_checksum.cu) -------------------------------------------------------
#
# A block is m little-endian uint64 words w_i; its checksum is
#     mix64((sum_i mix64(w_i ^ i * WORD_KEY)) ^ nbytes * LEN_KEY)      (all mod 2^64)
# with mix64 the splitmix64 finalizer. The sum is order-free, so a GPU reduces it in any order.

MASK64 = (1 << 64) - 1
CHECKSUM_WORD_KEY = 0x9E3779B97F4A7C15
CHECKSUM_LEN_KEY = 0xD6E8FEB86659FD93
MIX64_MUL1 = 0xBF58476D1CE4E5B9
MIX64_MUL2 = 0x94D049BB133111EB
# Words per numpy pass over a batch of rows: bounds the temporaries (a few of 8 MiB each).
_BATCH_WORDS = 1 << 20
_LE_U64 = np.dtype("<u8")


def mix64(x: int) -> int:
    """splitmix64 finalizer on a Python int in [0, 2^64)."""
    x ^= x >> 30
    x = (x * MIX64_MUL1) & MASK64
    x ^= x >> 27
    x = (x * MIX64_MUL2) & MASK64
    return x ^ (x >> 31)


def checksum_finish(word_sum: int, nbytes: int) -> int:
    """The checksum from a block's word sum: the last step, shared with the CUDA launcher."""
    return mix64((word_sum ^ (nbytes * CHECKSUM_LEN_KEY)) & MASK64)


@functools.lru_cache(maxsize=4)
def _word_keys(m: int) -> np.ndarray:
    # The same block size comes back on every call (one pool, one block shape): keep its keys.
    keys = np.arange(m, dtype=np.uint64) * np.uint64(CHECKSUM_WORD_KEY)
    keys.flags.writeable = False
    return keys


def _word_sums(words: np.ndarray) -> np.ndarray:
    """Per-row ``sum_i mix64(w_i ^ i * WORD_KEY)`` of a ``[k, m]`` uint64 array, mod 2^64.

    Array arithmetic on uint64 wraps silently (numpy warns only for scalars)."""
    x = np.bitwise_xor(words, _word_keys(words.shape[1]), dtype=np.uint64)
    x ^= x >> np.uint64(30)
    x *= np.uint64(MIX64_MUL1)
    x ^= x >> np.uint64(27)
    x *= np.uint64(MIX64_MUL2)
    x ^= x >> np.uint64(31)
    return x.sum(axis=1, dtype=np.uint64)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's bytes as a 1-D numpy uint8 array; no copy for CPU tensors."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.reshape(-1).view(torch.uint8).numpy()


def device_checksums(blocks: torch.Tensor | Sequence[torch.Tensor]) -> list[int]:
    """The checksum of each block's bytes (see block_checksum.cu). Precondition: every block is
    contiguous and holds the same positive multiple of 8 bytes."""
    if isinstance(blocks, torch.Tensor) and blocks.is_contiguous() and blocks.numel() > 0:
        n = blocks.shape[0]
        words = _as_bytes(blocks).view(_LE_U64).reshape(n, -1)
        rows = max(1, _BATCH_WORDS // words.shape[1])
        sums = [_word_sums(words[i : i + rows]) for i in range(0, n, rows)]
        nbytes = words.shape[1] * 8
    else:
        # Separate buffers, or rows of a tensor with gaps between them: one row at a time.
        parts = [_as_bytes(b) for b in blocks]
        if not parts:
            return []
        sums = [_word_sums(p.view(_LE_U64)[None, :]) for p in parts]
        nbytes = parts[0].size
    return [checksum_finish(int(s), nbytes) for part in sums for s in part]
