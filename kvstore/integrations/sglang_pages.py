"""SGLang host-pool pages as kvstore blocks: which pieces of host memory a page is, and the
copies between them and the daemon's shared memory (``kvstore.integrations.sglang``).

A page is stored as SGLang's own flat page holds it (``host_pool.get_data_page(index,
flat=True)``): the elements of ``get_data_page(index, flat=False)`` in C order. That view's
contiguous runs are the pieces a copy goes in; for every host layout they are the runs SGLang's
``get_page_buffer_meta`` names (one or two per page for ``page_first``, ``page_first_direct``
and ``page_head``; one per layer and K/V for ``layer_first``), in flat-page order. Nothing here
imports SGLang.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from kvstore.errors import KVStoreError
from kvstore.keys import KEY_BYTES
from kvstore.layout import KVLayout

PIECE_HASH_BYTES = 256 << 10
"""Copies are hashed in pieces of at most this size, each right before (write) or after (read)
its copy, while it is in cache: one pass over memory, not two."""


def page_key(key: object) -> bytes | None:
    """The 32-byte kvstore key of an SGLang page key (64 hex digits), or None for any other
    key (a miss on reads, False on writes)."""
    if not isinstance(key, str) or len(key) != 2 * KEY_BYTES:
        return None
    try:
        return bytes.fromhex(key)
    except ValueError:
        return None


def _storage_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of the whole storage under ``t`` (bounds every piece taken of it)."""
    storage = t.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8)
    whole.set_(storage, 0, (storage.nbytes(),), (1,))
    return whole.numpy()


def _runs(view: torch.Tensor) -> tuple[int, list[int]]:
    """Contiguous runs of a strided ``view``, in C order: (elements per run, each run's
    element offset from the view's storage offset)."""
    shape, strides = list(view.shape), list(view.stride())
    run, k = 1, len(shape)
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == run):
        run *= shape[k - 1]
        k -= 1
    starts = [0]
    for size, stride in zip(shape[:k], strides[:k], strict=True):
        starts = [s + i * stride for s in starts for i in range(size)]
    return run, starts


@dataclass(frozen=True)
class PageFormat:
    """How one SGLang page lies in the host pool, and what it is in kvstore."""

    page_size: int  # tokens a page (the stride of host indices between pages)
    page_bytes: int
    shape: tuple[int, ...]  # of ``get_data_page(index, flat=False)``
    strides: tuple[int, ...]
    itemsize: int
    run_bytes: int  # bytes of each contiguous piece of a page
    run_offsets: tuple[int, ...]  # byte offset of each piece from the page's first element
    zero_copy: bool  # ``get_data_page`` is a view of the pool: pieces are copied in place
    description: str  # the page format, written into the namespace's revision

    @property
    def layout(self) -> KVLayout:
        """The raw-bytes kvstore layout of one page: ``page_bytes`` of uint8."""
        return KVLayout(1, 1, self.page_bytes // 2, 1, torch.uint8)


def describe_pool(pool: Any) -> PageFormat:
    """The page format of an SGLang host pool; ValueError when its pages cannot be stored."""
    page_size = int(getattr(pool, "logical_page_size", None) or pool.page_size)
    view = pool.get_data_page(0, flat=False)
    if not isinstance(view, torch.Tensor) or view.device.type != "cpu":
        raise ValueError(f"{type(pool).__name__}: pages are not CPU tensors")
    itemsize = view.element_size()
    page_bytes = view.numel() * itemsize
    if page_bytes == 0 or page_bytes % 2:
        raise ValueError(f"{type(pool).__name__}: a page of {page_bytes} bytes")
    buffer = getattr(pool, "kv_buffer", None)
    zero_copy = (
        isinstance(buffer, torch.Tensor)
        and view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    )
    run, starts = _runs(view)
    parts = [
        type(pool).__name__,
        str(getattr(pool, "layout", "")),
        str(view.dtype).removeprefix("torch."),
        "x".join(str(d) for d in view.shape),
        f"p{page_size}",
    ]
    tag = getattr(pool, "storage_format_tag", None)
    if tag:
        parts.append(str(tag))
    return PageFormat(
        page_size=page_size,
        page_bytes=page_bytes,
        shape=tuple(view.shape),
        strides=tuple(view.stride()),
        itemsize=itemsize,
        run_bytes=run * itemsize,
        run_offsets=tuple(s * itemsize for s in starts),
        zero_copy=zero_copy,
        description=":".join(parts),
    )


class HostPages:
    """The pages of one SGLang host pool as numpy pieces over its memory (``zero_copy``), or
    through its flat-page copies (otherwise). Owns nothing; reads the pool's buffers only
    through views bounded by their storage."""

    def __init__(self, pool: Any, fmt: PageFormat) -> None:
        self.pool = pool
        self.fmt = fmt
        self._memory = _storage_bytes(pool.kv_buffer) if fmt.zero_copy else None

    def pieces(self, index: int) -> list[np.ndarray]:
        """The pieces of the page starting at host index ``index``, in the order of its flat
        page. ValueError if the pool gives a page of another shape."""
        fmt, memory = self.fmt, self._memory
        assert memory is not None
        view = self.pool.get_data_page(index, flat=False)
        if tuple(view.shape) != fmt.shape or tuple(view.stride()) != fmt.strides:
            raise ValueError(f"host page {index} is {tuple(view.shape)}, expected {fmt.shape}")
        base = view.storage_offset() * fmt.itemsize
        n = fmt.run_bytes
        return [memory[base + o : base + o + n] for o in fmt.run_offsets]


def copy_in_hashing(dst: np.ndarray, pieces: Sequence[np.ndarray], seed: int) -> int:
    """Copy the pieces of a page one after the other into ``dst`` (one slot); the seeded xxh3
    of the source, each part hashed right before its copy (the checksum vouches for what was
    meant to be stored, whatever writes into the slot meanwhile)."""
    h = xxhash.xxh3_64(seed=seed)
    at = 0
    for piece in pieces:
        n = len(piece)
        for start in range(0, n, PIECE_HASH_BYTES):
            part = piece[start : start + PIECE_HASH_BYTES]
            h.update(part.data)
            np.copyto(dst[at + start : at + start + len(part)], part)
        at += n
    return h.intdigest()


def copy_out_hashing(src: np.ndarray, pieces: Sequence[np.ndarray], seed: int) -> int:
    """Copy one slot into the pieces of a page; the seeded xxh3 of the copy, each part hashed
    right after its copy (a slot that changes under the copy fails the check)."""
    h = xxhash.xxh3_64(seed=seed)
    at = 0
    for piece in pieces:
        n = len(piece)
        for start in range(0, n, PIECE_HASH_BYTES):
            part = piece[start : start + PIECE_HASH_BYTES]
            np.copyto(part, src[at + start : at + start + len(part)])
            h.update(part.data)
        at += n
    return h.intdigest()


def slot_array(arena: Any, address: int, nbytes: int, write: bool) -> np.ndarray:
    """A numpy view of one arena slot, checked against its slab (and, to write, refused
    unless the slab is mapped writable)."""
    slab, offset = arena._where(address, nbytes)
    if write and not slab.writable:
        raise KVStoreError("the daemon reserved a slot in memory this client may only read")
    array: np.ndarray = slab.np[offset : offset + nbytes]
    return array
