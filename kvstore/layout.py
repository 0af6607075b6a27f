"""KVLayout: how one block of KV cache is shaped and how many bytes it takes.

A block holds K and V of every layer for ``block_size`` consecutive tokens, shaped
``(num_layers, 2, block_rows, num_kv_heads, head_dim)``. One contiguous block is the unit of
storage, IO and transfer in every tier.

``scale_format`` says how values are scaled. ``"none"``: the values are the K/V themselves
(``block_rows == block_size``). ``"block_head_f32"`` (FP8 KV, dtype float8_e4m3fn only): one
float32 scale per (block, layer, K|V, KV head), ``amax / 448``, kept in one extra row after each
(layer, K|V) chunk's tokens (``block_rows == block_size + 1``; format and math in
``kvstore.kernels.reference``). The scales are bytes of the block, so every path that moves a
block (copy-on-write, offload, load, every tier) moves them with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstore.kernels.reference import FP8_DTYPE, FP8_SCALE_ROWS

# dtype name <-> torch dtype. Names are what travels on the wire and in fingerprints.
_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}
_NAMES = {v: k for k, v in _DTYPES.items()}

SCALE_NONE = "none"
SCALE_BLOCK_HEAD = "block_head_f32"
SCALE_FORMATS = (SCALE_NONE, SCALE_BLOCK_HEAD)


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; supported: {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; supported: {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class KVLayout:
    """Shape of one KV block. Immutable; part of every namespace's fingerprint."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = field(default=torch.bfloat16)
    scale_format: str = SCALE_NONE

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        dtype_name(self.dtype)  # validates
        if self.scale_format not in SCALE_FORMATS:
            raise ValueError(
                f"unsupported scale_format {self.scale_format!r}; supported: {SCALE_FORMATS}"
            )
        if self.scaled:
            if self.dtype != FP8_DTYPE:
                raise ValueError(
                    f"scale_format {self.scale_format!r} needs dtype float8_e4m3fn, "
                    f"got {dtype_name(self.dtype)}"
                )
            if self.head_dim % 4:
                raise ValueError(
                    f"scale_format {self.scale_format!r} needs head_dim a multiple of 4 "
                    f"(4-byte aligned scales), got {self.head_dim}"
                )

    @classmethod
    def fp8(cls, layout: KVLayout) -> KVLayout:
        """The scaled FP8 layout of ``layout``'s shape: what an FP8 paged cache of it holds."""
        return cls(
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
            layout.block_size,
            FP8_DTYPE,
            SCALE_BLOCK_HEAD,
        )

    @property
    def scaled(self) -> bool:
        """Values are FP8 in units of per-block scales (``scale_format != "none"``)."""
        return self.scale_format != SCALE_NONE

    @property
    def block_rows(self) -> int:
        """Rows per (layer, K|V) chunk of a block: its tokens, plus the scale row if scaled."""
        return self.block_size + (FP8_SCALE_ROWS if self.scaled else 0)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_rows, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_bytes(self) -> int:
        return (
            self.num_layers
            * 2
            * self.block_rows
            * self.num_kv_heads
            * self.head_dim
            * self.itemsize
        )

    @property
    def bytes_per_token(self) -> int:
        """Bytes of cache per token, scale rows included (rounded down)."""
        return self.block_bytes // self.block_size

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def check_blocks(
        self, blocks: torch.Tensor, n: int | None = None, what: str = "blocks"
    ) -> None:
        """Raise ValueError naming the problem unless ``blocks`` is ``[n, *block_shape]``."""
        if not isinstance(blocks, torch.Tensor):
            raise ValueError(f"{what} must be a torch.Tensor, got {type(blocks).__name__}")
        if blocks.dtype != self.dtype:
            raise ValueError(f"{what} has dtype {blocks.dtype}, layout expects {self.dtype}")
        if tuple(blocks.shape[1:]) != self.block_shape or blocks.dim() != 6:
            raise ValueError(
                f"{what} has shape {tuple(blocks.shape)}, layout expects [n, *{self.block_shape}]"
            )
        if n is not None and blocks.shape[0] < n:
            raise ValueError(f"{what} holds {blocks.shape[0]} blocks, {n} needed")
