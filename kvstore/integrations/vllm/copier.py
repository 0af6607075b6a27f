"""Copies of one block between vLLM's per-layer paged caches and a kvstore slot."""

from __future__ import annotations

import numpy as np
import torch

from kvstore.integrations.vllm.identity import StoreIdentity


class _LayerCopier:
    """Copies one block between vLLM's per-layer caches and a ``[layers, 2, bs, H, D]``-sized
    slot. Each layer's cache is seen as ``parts`` tensors ``[num_blocks, elems]`` whose rows,
    concatenated, are the block's bytes in the stored format."""

    def __init__(self, ident: StoreIdentity, kv_caches: dict[str, torch.Tensor]) -> None:
        lay = ident.layout
        missing = [n for n in ident.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"vLLM handed over no KV cache for layers {missing[:3]}")
        self.layout = lay
        self.device = kv_caches[ident.layer_names[0]].device
        self.parts: list[list[torch.Tensor]] = []
        h, d, bs = lay.num_kv_heads, lay.head_dim, lay.block_size
        for name in ident.layer_names:
            t = kv_caches[name]
            if t.dtype != lay.dtype:
                raise ValueError(f"layer {name}: cache dtype {t.dtype}, expected {lay.dtype}")
            shape = tuple(t.shape)
            if ident.kv_format.startswith("vllm-cpu"):
                ok = len(shape) == 4 and shape[1:] == (h, bs, 2 * d) and t[0].is_contiguous()
                parts = [t.reshape(shape[0], -1)] if ok else []
            elif len(shape) == 5 and shape[0] == 2 and shape[2:] == (bs, h, d):
                ok = t[0, 0].is_contiguous()
                parts = [t[0].reshape(shape[1], -1), t[1].reshape(shape[1], -1)] if ok else []
            elif len(shape) == 5 and shape[1] == 2 and shape[2:] == (bs, h, d):
                ok = t[0].is_contiguous()
                parts = [t.reshape(shape[0], -1)] if ok else []
            else:
                ok, parts = False, []
            if not ok:
                raise ValueError(
                    f"layer {name}: unsupported KV cache layout {shape} strides {t.stride()} "
                    f"for format {ident.kv_format} (block_size {bs}, {h} KV heads, "
                    f"head_dim {d}); supported: CPU [nb, H, bs, 2D], "
                    "[2, nb, bs, H, D] and [nb, 2, bs, H, D] with each block contiguous"
                )
            self.parts.append(parts)
        self.num_parts = len(self.parts[0])
        self.num_blocks = self.parts[0][0].shape[0]
        self.host = self.device.type == "cpu"
        if self.host:
            # numpy copies run in this thread at memcpy speed without torch's thread pool.
            self.np_parts = [[_raw(p).numpy() for p in parts] for parts in self.parts]

    def _slot(self, view: torch.Tensor) -> torch.Tensor:
        return view.view(self.layout.num_layers, self.num_parts, -1)

    def gather(self, block_id: int, view: torch.Tensor) -> None:
        slot = self._slot(view)
        if self.host:
            dst = _raw(slot).numpy()
            for layer, np_parts in enumerate(self.np_parts):
                for p, np_part in enumerate(np_parts):
                    np.copyto(dst[layer, p], np_part[block_id])
            return
        for layer, parts in enumerate(self.parts):
            for p, part in enumerate(parts):
                slot[layer, p].copy_(part[block_id])

    def scatter(self, view: torch.Tensor, block_id: int) -> None:
        for layer in range(self.layout.num_layers):
            self.scatter_layer(view, block_id, layer)

    def scatter_layer(self, view: torch.Tensor, block_id: int, layer: int) -> None:
        """Copy one layer of the slot ``view`` into block ``block_id`` of that layer's cache."""
        slot = self._slot(view)
        if self.host:
            src = _raw(slot).numpy()
            for p, np_part in enumerate(self.np_parts[layer]):
                np.copyto(np_part[block_id], src[layer, p])
            return
        for p, part in enumerate(self.parts[layer]):
            part[block_id].copy_(slot[layer, p])


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(_RAW[t.element_size()])
