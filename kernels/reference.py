"""Torch reference of every kernel. Runs on any device torch runs on; the CPU path of the public
API and the oracle the CUDA kernels are tested against.

Inputs are assumed validated by the public entry points in ``__init__``. Copies move bytes: each
tensor is viewed as the integer type of its element size, so every dtype (float8 included, NaN
payloads included) round-trips bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer type of its element size (same storage, no copy)."""
    return t.view(_RAW[t.element_size()])


def gather_blocks(
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    out: torch.Tensor | Sequence[torch.Tensor],
) -> None:
    """``out[i][l] = kv_caches[l][:, block_ids[i]]`` for every block i and layer l."""
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
