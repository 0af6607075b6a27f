"""Moving blocks between an engine's paged KV cache and the store, through the kernels.

``offload`` gathers physical blocks straight into reserved shared-memory slots and commits them;
``load`` scatters leased slots straight into physical blocks. Neither builds a tensor the size
of the whole transfer: work goes in chunks of ``chunk_blocks`` and, on the shared-memory path,
through no intermediate tensor at all. On CUDA the arena is registered as pinned memory once, so
the kernels read and write it across PCIe directly. The bytes path (no arena) uses one
chunk-sized staging tensor.

Used by ``KVStoreClient.offload/load`` and ``AsyncKVStoreClient.offload/load``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import xxhash

from kvstore import kernels
from kvstore.client._common import MappedArena, copy_hashing_copy
from kvstore.client._parallel import each_block
from kvstore.kernels import _validate
from kvstore.layout import KVLayout

CHUNK_BLOCKS = 32
"""Blocks per chunk on the bytes path (the size of its one staging tensor)."""
ARENA_CHUNK_BLOCKS = 1024
"""Blocks per reservation or lease on the shared-memory path, which stages nothing: one call
for a whole prompt's prefix (120 blocks: one acquire, not four), and requests small enough for
a local call (32 KiB of keys)."""
R = TypeVar("R")


def check_paged(
    layout: KVLayout,
    kv_caches: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    keys: Sequence[bytes],
) -> list[int]:
    """Validate an offload/load against the layout; returns the block ids as ints."""
    if len(kv_caches) != layout.num_layers:
        raise ValueError(f"kv_caches has {len(kv_caches)} layers, layout has {layout.num_layers}")
    expected = (2, layout.block_rows, layout.num_kv_heads, layout.head_dim)
    for i, cache in enumerate(kv_caches):
        if not isinstance(cache, torch.Tensor):
            raise ValueError(f"kv_caches[{i}] must be a torch.Tensor")
        if cache.dtype != layout.dtype:
            raise ValueError(
                f"kv_caches[{i}] has dtype {cache.dtype}, layout expects {layout.dtype}"
            )
        shape = tuple(cache.shape)
        if len(shape) != 5 or (shape[0], *shape[2:]) != expected:
            raise ValueError(
                f"kv_caches[{i}] has shape {shape}, expected [2, num_blocks, "
                f"{layout.block_rows}, {layout.num_kv_heads}, {layout.head_dim}]"
            )
    ids = [
        int(b) for b in (block_ids.tolist() if isinstance(block_ids, torch.Tensor) else block_ids)
    ]
    if len(ids) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(ids)} block ids")
    return ids


def ensure_pinned(arena: MappedArena, kv_caches: Sequence[torch.Tensor]) -> None:
    """Register the arena's slabs as pinned host memory the first time CUDA caches use it
    (slabs mapped later are registered as they are mapped), so the kernels copy across PCIe at
    full speed and without a staging buffer."""
    if not kv_caches or kv_caches[0].device.type != "cuda" or arena.pinned:
        return
    arena.pin()


def chunked(
    keys: Sequence[bytes], ids: list[int], size: int = CHUNK_BLOCKS
) -> Iterator[tuple[Sequence[bytes], list[int]]]:
    for start in range(0, len(ids), size):
        yield keys[start : start + size], ids[start : start + size]


def gather_into_views(
    kv_caches: Sequence[torch.Tensor],
    block_ids: list[int],
    views: torch.Tensor | Sequence[torch.Tensor],
) -> None:
    """Gather into ``views`` (per-block tensors or one ``[n, ...]`` tensor), then wait for it."""
    if len(views):
        kernels.gather_blocks(kv_caches, block_ids, views)
        if kv_caches[0].device.type == "cuda":
            torch.cuda.current_stream(kv_caches[0].device).synchronize()


def gather_with_checksums(
    kv_caches: Sequence[torch.Tensor],
    block_ids: list[int],
    views: Sequence[torch.Tensor],
    seeds: Sequence[int],
) -> list[int] | None:
    """Gather CPU caches into ``views`` (shared-memory slots) and checksum each block from its
    source as it is copied: a streaming xxh3 over the source pieces, in the slot's byte order,
    each hashed right after its copy (while in cache). The checksum vouches for what this client
    copied, whatever writes into the slot afterwards. None for CUDA caches: their checksums are
    taken from the slots on the device after the gather kernel (``WriteReservation.checksums``).
    """
    if not views:
        return []
    if kv_caches[0].device.type != "cpu":
        return None
    # The checks gather_blocks makes (the kernels' own validation), before any byte moves.
    geom = _validate.check_caches(kv_caches)
    ids = _validate.as_ids(block_ids, "block_ids")
    _validate.check_blocks(views, geom, ids.numel(), "out")
    _validate.check_id_range(ids, geom.num_blocks, "block_ids")
    caches = [kernels.reference.raw(c.detach()).numpy() for c in kv_caches]
    sums = []
    for block, view, seed in zip(block_ids, views, seeds, strict=True):
        dst = kernels.reference.raw(view).numpy()  # [layers, 2, block_size, H, D]
        h = xxhash.xxh3_64(seed=seed)
        for layer, cache in enumerate(caches):
            for kv in (0, 1):
                src = cache[kv, block]
                np.copyto(dst[layer, kv], src)
                h.update(np.ascontiguousarray(src).data)  # no copy when contiguous
        sums.append(h.intdigest())
    return sums


def scatter_with_checksums(
    views: Sequence[torch.Tensor],
    kv_caches: Sequence[torch.Tensor],
    block_ids: list[int],
    checksums: Sequence[int],
    seeds: Sequence[int],
) -> int | None:
    """Scatter arena slots (``views``: a lease's, or places a presence table gave) into CPU
    caches, each block checked where it is copied: a run of slots is first copied into a
    private staging buffer (``_take_staging``), each block hashed from its copy while in cache
    (``copy_hashing_copy``) against the checksum for the key asked (``seeds``), and only the
    blocks that verified are scattered, from that private copy. So a slot rewritten during the
    copy (a block read with no lease, whose slot is reused) fails the check, and what lands in
    the caches is what was checked. Returns how many leading blocks arrived intact (the caller
    recomputes from there; blocks past the first bad one may have been copied too, by the other
    thread of a large load). None for CUDA caches: they are verified on the slots after the
    kernel (``ReadLease.intact``)."""
    if not views:
        return 0
    if kv_caches[0].device.type != "cpu":
        return None
    geom = _validate.check_caches(kv_caches)
    ids = _validate.as_ids(block_ids, "block_ids")
    _validate.check_blocks(views, geom, ids.numel(), "blocks")
    _validate.check_id_range(ids, geom.num_blocks, "block_ids")
    caches = [kernels.reference.raw(c.detach()).numpy() for c in kv_caches]
    slots = [kernels.reference.raw(v).numpy() for v in views]  # [layers, 2, bs, H, D] each
    runs = []  # (first block, [k, *block] view over slots that lie back to back)
    i = 0
    while i < len(slots):
        run = _slot_run(slots, block_ids, i)
        runs.append((i, run))
        i += len(run)
    first_bad = [len(views)] * len(runs)

    def scatter_run(r: int) -> None:
        i, run = runs[r]
        k, size = len(run), run[0].nbytes
        buf = _take_staging(k * size)
        try:
            scatter_staged(i, run, buf[: k * size].reshape(k, size), r)
        finally:
            _give_staging(buf)

    def scatter_staged(i: int, run: np.ndarray, staged: np.ndarray, r: int) -> None:
        """Copy ``run`` into ``staged`` checking each block, then scatter those that verified."""
        k = len(run)
        for j in range(k):
            source = run[j].reshape(-1).view(np.uint8)
            if copy_hashing_copy(staged[j], source, seeds[i + j]) != checksums[i + j]:
                first_bad[r] = i + j
                k = j
                break
        if not k:
            return
        blocks = staged[:k].view(run.dtype).reshape(k, *run.shape[1:])
        # Blocks of a run are copied a layer at a time, one numpy call for the whole run
        # instead of one per block and layer.
        ids_run = block_ids[i : i + k]
        first = ids_run[0]
        # A slice only where the ids really are consecutive, ascending: distinct ids out of
        # order ([0, 2, 1, 3]) span the same range and must go where each one says.
        dst_ids: slice | np.ndarray = (
            slice(first, first + k)
            if ids_run == list(range(first, first + k))
            else np.asarray(ids_run)
        )
        for layer, cache in enumerate(caches):
            part = blocks[:, layer].swapaxes(0, 1)  # [2, k, bs, H, D]
            if isinstance(dst_ids, slice):
                np.copyto(cache[:, dst_ids], part)
            else:
                cache[:, dst_ids] = part

    # Runs go to two threads for a large load (``each_block``): their blocks are distinct.
    each_block(len(runs), len(slots) * (slots[0].nbytes if slots else 0), scatter_run)
    return min(first_bad)


RUN_BLOCKS = 16
"""Most blocks one scatter step copies (then hashes) at once: a few MiB, which stay in cache."""
RUN_BYTES = 8 << 20
"""And at most this many bytes (a staging buffer's size)."""

_spare: list[np.ndarray] = []  # staging buffers not in use, kept for the next load
_spare_lock = threading.Lock()
SPARE_BUFFERS = 4
"""Staging buffers kept between loads (a load uses at most two at once, one per thread)."""


def _take_staging(nbytes: int) -> np.ndarray:
    """A staging buffer of at least ``nbytes``, this caller's alone until ``_give_staging``
    (kept ones are reused: a new one would fault its pages in on every load)."""
    with _spare_lock:
        for j, buf in enumerate(_spare):
            if buf.nbytes >= nbytes:
                return _spare.pop(j)
    return np.empty(nbytes, dtype=np.uint8)


def _give_staging(buf: np.ndarray) -> None:
    with _spare_lock:
        if len(_spare) < SPARE_BUFFERS:
            _spare.append(buf)


def _slot_run(slots: Sequence[np.ndarray], block_ids: Sequence[int], i: int) -> np.ndarray:
    """``[k, *block]`` over the slots i, i+1, ... that lie back to back in memory (k >= 1,
    at most RUN_BLOCKS, destination ids distinct as the caller checked)."""
    first = slots[i]
    size = first.nbytes
    base = first.__array_interface__["data"][0]
    k = 1
    while (
        k < RUN_BLOCKS
        and (k + 1) * size <= RUN_BYTES
        and i + k < len(slots)
        and slots[i + k].__array_interface__["data"][0] == base + k * size
    ):
        k += 1
    # The slots are views of one mapping, back to back: one view over all of them.
    return np.lib.stride_tricks.as_strided(
        first, shape=(k, *first.shape), strides=(size, *first.strides), writeable=False
    )


def scatter_from_views(
    views: torch.Tensor | Sequence[torch.Tensor],
    kv_caches: Sequence[torch.Tensor],
    block_ids: list[int],
) -> None:
    """Scatter from ``views`` (per-block tensors or one ``[n, ...]`` tensor), then wait for it."""
    if len(views):
        kernels.scatter_blocks(views, kv_caches, block_ids)
        if kv_caches[0].device.type == "cuda":
            torch.cuda.current_stream(kv_caches[0].device).synchronize()


def staging(layout: KVLayout, total: int, kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """One chunk-sized host tensor for a bytes-path transfer of ``total`` blocks, reused for
    every chunk; pinned for CUDA caches, since the kernels reach host memory only when it is
    pinned (pageable memory is refused)."""
    pin = bool(kv_caches) and kv_caches[0].device.type == "cuda"
    n = min(total, CHUNK_BLOCKS)
    return torch.empty((n, *layout.block_shape), dtype=layout.dtype, pin_memory=pin)


def caller_stream(kv_caches: Sequence[torch.Tensor]) -> torch.cuda.Stream | None:
    """The stream the caller's engine works on, for CUDA caches. Work handed to a worker thread
    must run on it: a new thread's current stream is the default one, which is not ordered with
    the engine's own streams, so a gather there could read blocks still being written."""
    if kv_caches and kv_caches[0].device.type == "cuda":
        return torch.cuda.current_stream(kv_caches[0].device)
    return None


def on_stream(stream: torch.cuda.Stream | None, fn: Callable[..., R], *args: Any) -> R:
    """``fn(*args)`` with ``stream`` current (in whatever thread this runs)."""
    if stream is None:
        return fn(*args)
    with torch.cuda.stream(stream):
        return fn(*args)
