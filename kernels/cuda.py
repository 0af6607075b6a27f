"""CuPy launchers for ``paged_copy.cu``, ``paged_attention.cu`` (with the FP8 cache's and the fp8
payloads' kernels) and ``block_checksum.cu``.

Imported by the package only when a CUDA tensor is given. Importing it without CuPy works;
calling a launcher then raises RuntimeError pointing at the ``kvstore[cuda]`` extra.

Owns: one ``cupy.RawModule`` per source file, compiled with NVRTC on first use and cached for the
life of the process (and by CuPy on disk across processes); a small cache of per-layer base
pointer arrays, since an engine passes the same ``kv_caches`` on every call. Kernels run on
torch's current stream of the caches' device, so they are ordered with the engine's own work and
temporaries freed here are safe under torch's caching allocator. Thread-safe.

Inputs arrive validated (shapes, dtypes, ids) by the package's public functions; what is checked
here is what only CUDA knows: whether host memory is pinned, so the device can reach it.
"""

from __future__ import annotations

import functools
import pathlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from . import fp8, reference
from ._validate import AttentionShape, BlocksLike, CacheGeometry, ChecksumBlocks

try:
    import cupy
except ImportError:  # the optional kvstore[cuda] extra
    cupy = None

_SOURCES = pathlib.Path(__file__).resolve().parent
_COPY_SOURCE = "paged_copy.cu"
_ATTENTION_SOURCE = "paged_attention.cu"
_CHECKSUM_SOURCE = "block_checksum.cu"
_CHECKSUM_KERNEL = "block_checksum_partial"
_CHECKSUM_THREADS = 256  # a multiple of 32: the kernel reduces whole warps
# CTAs per block: a 2 MiB block (256 Ki words) gets 64 CTAs of 256 threads, 16 words a thread,
# so a handful of blocks fill a large GPU; small blocks get fewer CTAs, each thread at least
# _CHECKSUM_MIN_WORDS words, so the atomics and reductions stay small next to the loads.
_CHECKSUM_MAX_CHUNKS = 64
_CHECKSUM_MIN_WORDS = 8
_MAX_GRID_Y = 65535  # the checksum kernel grid-strides over blocks past this
_COPY_THREADS = 256
_MAX_GRID = 1 << 16  # the copy kernels grid-stride past this
_ATTENTION_THREADS = 8 * 32  # KVSTORE_ATTENTION_WARPS * 32 in paged_attention.cu
_ATTENTION_MAX_HEAD_DIM = 256  # 32 * KVSTORE_ATTENTION_MAX_PER_LANE
_ATTENTION_KERNELS = {
    torch.float32: "paged_attention_f32",
    torch.float16: "paged_attention_f16",
    torch.bfloat16: "paged_attention_bf16",
}
_ATTENTION_FP8_KERNELS = {
    torch.float32: "paged_attention_fp8_f32",
    torch.float16: "paged_attention_fp8_f16",
    torch.bfloat16: "paged_attention_fp8_bf16",
}
_WRITE_FP8_KERNELS = {
    torch.float32: "write_kv_fp8_f32",
    torch.float16: "write_kv_fp8_f16",
    torch.bfloat16: "write_kv_fp8_bf16",
}
_WRITE_FP8_THREADS = 128  # KVSTORE_WRITE_THREADS in paged_attention.cu
_PAYLOAD_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_PAYLOAD_THREADS = 128  # KVSTORE_PAYLOAD_THREADS in paged_attention.cu
_COPY_WIDTHS = (16, 8, 4, 2, 1)  # bytes per access; suffixes v16 .. v1 in paged_copy.cu
# Every entry point the launchers may ask for, by source file (scripts/compile_kernels.sh checks
# the compiled PTX holds each one).
KERNELS: dict[str, tuple[str, ...]] = {
    _COPY_SOURCE: tuple(
        f"{op}_v{w}"
        for op in ("gather_blocks", "scatter_blocks", "copy_blocks")
        for w in _COPY_WIDTHS
    ),
    _ATTENTION_SOURCE: (
        *_ATTENTION_KERNELS.values(),
        *_ATTENTION_FP8_KERNELS.values(),
        *_WRITE_FP8_KERNELS.values(),
        *(
            f"{op}_fp8_payloads_{sfx}"
            for op in ("gather", "scatter")
            for sfx in _PAYLOAD_SUFFIX.values()
        ),
    ),
    _CHECKSUM_SOURCE: (_CHECKSUM_KERNEL,),
}
# cudaMemoryType values returned by cudaPointerGetAttributes.
_MEMORY_UNREGISTERED, _MEMORY_HOST, _MEMORY_DEVICE, _MEMORY_MANAGED = 0, 1, 2, 3

_lock = threading.Lock()
_kernels: dict[tuple[str, str, int], Any] = {}
_layer_ptr_arrays: OrderedDict[tuple[int, tuple[int, ...]], torch.Tensor] = OrderedDict()
_LAYER_PTR_CACHE_SIZE = 16


def _cupy() -> Any:
    if cupy is None:
        raise RuntimeError(
            "kvstore.kernels got CUDA tensors but CuPy is not installed: "
            "pip install 'kvstore[cuda]' (cupy-cuda12x)"
        )
    return cupy


@functools.cache
def _module(source: str) -> Any:
    # Plain NVRTC, no include paths: the sources define their own fp16/bf16 conversions.
    return _cupy().RawModule(code=(_SOURCES / source).read_text(), options=("--std=c++17",))


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _kernel(source: str, name: str, device_index: int) -> Any:
    key = (source, name, device_index)
    with _lock:
        kernel = _kernels.get(key)
    if kernel is None:
        with _cupy().cuda.Device(device_index):
            kernel = _module(source).get_function(name)
        with _lock:
            _kernels[key] = kernel
    return kernel


def _launch(
    device: torch.device,
    source: str,
    name: str,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: tuple[Any, ...],
) -> None:
    cp = _cupy()
    index = _device_index(device)
    kernel = _kernel(source, name, index)
    stream = torch.cuda.current_stream(index)
    with cp.cuda.Device(index), cp.cuda.ExternalStream(stream.cuda_stream, index):
        kernel(grid, block, args)


def _u64_array(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Addresses as a device int64 tensor (bit pattern of uint64; addresses fit either way)."""
    host = torch.from_numpy(np.array(values, dtype=np.uint64).view(np.int64))
    return host.to(device, non_blocking=True)


def _layer_ptrs(kv_caches: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Device array of the layers' base addresses, cached by (device, addresses)."""
    key = (_device_index(device), tuple(c.data_ptr() for c in kv_caches))
    with _lock:
        arr = _layer_ptr_arrays.get(key)
        if arr is not None:
            _layer_ptr_arrays.move_to_end(key)
            return arr
    arr = _u64_array(key[1], device)
    # A cached array may be read later from another stream: let the copy land before sharing it.
    torch.cuda.current_stream(key[0]).synchronize()
    with _lock:
        _layer_ptr_arrays[key] = arr
        while len(_layer_ptr_arrays) > _LAYER_PTR_CACHE_SIZE:
            _layer_ptr_arrays.popitem(last=False)
    return arr


class _AddressResolver:
    """Device-side addresses of tensors for one launch; one CUDA query per host allocation."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._host_offsets: dict[int, int] = {}

    def __call__(self, t: torch.Tensor, what: str) -> int:
        ptr = t.data_ptr()
        if t.device.type == "cuda":
            return ptr
        base = t.untyped_storage().data_ptr()
        offset = self._host_offsets.get(base)
        if offset is None:
            offset = self._host_offset(base, what)
            self._host_offsets[base] = offset
        return ptr + offset

    def _host_offset(self, base: int, what: str) -> int:
        cp = _cupy()
        with cp.cuda.Device(_device_index(self._device)):
            try:
                attrs = cp.cuda.runtime.pointerGetAttributes(base)
            except cp.cuda.runtime.CUDARuntimeError:
                attrs = None
        kind = getattr(attrs, "type", getattr(attrs, "memoryType", _MEMORY_UNREGISTERED))
        if attrs is None or kind == _MEMORY_UNREGISTERED or not attrs.devicePointer:
            raise ValueError(
                f"{what} is in pageable host memory, which the kernel cannot reach: pin it "
                "(tensor.pin_memory(), or cudaHostRegister for a shared-memory arena)"
            )
        if kind not in (_MEMORY_HOST, _MEMORY_MANAGED):
            raise ValueError(f"{what} is host memory of unexpected CUDA memory type {kind}")
        return int(attrs.devicePointer) - base


def _block_addresses(
    blocks: BlocksLike, device: torch.device, what: str
) -> tuple[torch.Tensor | None, int, int, list[int]]:
    """(per-block address array or None, base, byte stride, addresses to check alignment of)."""
    resolve = _AddressResolver(device)
    if isinstance(blocks, torch.Tensor):
        base = resolve(blocks, what)
        stride = blocks.stride(0) * blocks.element_size()
        return None, base, stride, [base, stride]
    addrs = [resolve(b, f"{what}[{i}]") for i, b in enumerate(blocks)]
    return _u64_array(addrs, device), 0, 0, addrs


def _vector_bytes(values: Iterable[int]) -> int:
    """Widest access (16, 8, 4, 2 or 1 bytes) that every address and stride is aligned to."""
    width = _COPY_WIDTHS[0]
    for v in values:
        while v % width:
            width //= 2
    return width


def _copy_launch_shape(geom: CacheGeometry, n: int, chunk_bytes: int, width: int) -> tuple:
    chunks = n * 2 * geom.num_layers
    vectors = chunk_bytes // width
    # Small chunks (few heads, short head_dim) leave threads idle; trim to whole warps.
    threads = min(_COPY_THREADS, max(32, (vectors + 31) // 32 * 32))
    return (min(chunks, _MAX_GRID),), (threads,)


def _move(
    kernel: str,
    geom: CacheGeometry,
    kv_caches: Sequence[torch.Tensor],
    ids: torch.Tensor,
    blocks: BlocksLike,
    what: str,
) -> None:
    device = geom.device
    item = geom.dtype.itemsize
    chunk_bytes = geom.chunk_elems * item
    kv_stride, block_stride = geom.kv_stride * item, geom.block_stride * item
    layer_ptrs = _layer_ptrs(kv_caches, device)
    ids_dev = ids.to(device, non_blocking=True)
    ptr_array, base, stride, addrs = _block_addresses(blocks, device, what)
    width = _vector_bytes(
        [*(c.data_ptr() for c in kv_caches), kv_stride, block_stride, chunk_bytes, *addrs]
    )
    n = ids.numel()
    grid, block = _copy_launch_shape(geom, n, chunk_bytes, width)
    args = (
        np.uint64(layer_ptrs.data_ptr()),
        np.uint64(ids_dev.data_ptr()),
        np.uint64(ptr_array.data_ptr() if ptr_array is not None else 0),
        np.uint64(base),
        np.int64(stride),
        np.int64(n),
        np.int32(geom.num_layers),
        np.int64(kv_stride),
        np.int64(block_stride),
        np.int64(chunk_bytes),
    )
    _launch(device, _COPY_SOURCE, f"{kernel}_v{width}", grid, block, args)


def gather_blocks(
    geom: CacheGeometry, kv_caches: Sequence[torch.Tensor], ids: torch.Tensor, out: BlocksLike
) -> None:
    _move("gather_blocks", geom, kv_caches, ids, out, "out")


def scatter_blocks(
    geom: CacheGeometry, blocks: BlocksLike, kv_caches: Sequence[torch.Tensor], ids: torch.Tensor
) -> None:
    _move("scatter_blocks", geom, kv_caches, ids, blocks, "blocks")


def copy_blocks(
    geom: CacheGeometry, kv_caches: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor
) -> None:
    device = geom.device
    item = geom.dtype.itemsize
    chunk_bytes = geom.chunk_elems * item
    kv_stride, block_stride = geom.kv_stride * item, geom.block_stride * item
    layer_ptrs = _layer_ptrs(kv_caches, device)
    src_dev = src.to(device, non_blocking=True)
    dst_dev = dst.to(device, non_blocking=True)
    width = _vector_bytes(
        [*(c.data_ptr() for c in kv_caches), kv_stride, block_stride, chunk_bytes]
    )
    n = src.numel()
    grid, block = _copy_launch_shape(geom, n, chunk_bytes, width)
    args = (
        np.uint64(layer_ptrs.data_ptr()),
        np.uint64(src_dev.data_ptr()),
        np.uint64(dst_dev.data_ptr()),
        np.int64(n),
        np.int32(geom.num_layers),
        np.int64(kv_stride),
        np.int64(block_stride),
        np.int64(chunk_bytes),
    )
    _launch(device, _COPY_SOURCE, f"copy_blocks_v{width}", grid, block, args)


def paged_attention(
    shape: AttentionShape,
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    fp8: bool = False,
) -> torch.Tensor:
    """Decode attention; with ``fp8`` over a scaled FP8 layer (``shape.block_size`` counts its
    token rows, the kernel finds the scale row after them)."""
    if shape.head_dim > _ATTENTION_MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim {shape.head_dim} > {_ATTENTION_MAX_HEAD_DIM}, the CUDA kernel's limit"
        )
    if shape.num_seqs > 65535:
        raise ValueError(f"{shape.num_seqs} sequences in one call; the CUDA kernel takes 65535")
    query = query.contiguous()
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty_like(query)
    if shape.num_seqs == 0 or shape.num_heads == 0 or shape.head_dim == 0:
        return out
    args = (
        np.uint64(out.data_ptr()),
        np.uint64(query.data_ptr()),
        np.uint64(kv_cache_layer.data_ptr()),
        np.uint64(block_tables.data_ptr()),
        np.uint64(seq_lens.data_ptr()),
        np.int32(shape.num_heads),
        np.int32(shape.num_kv_heads),
        np.int32(shape.head_dim),
        np.int32(shape.block_size),
        np.int32(shape.max_blocks),
        np.int64(kv_cache_layer.stride(0)),
        np.int64(kv_cache_layer.stride(1)),
        np.float32(scale),
    )
    grid = (shape.num_heads, shape.num_seqs)
    name = (_ATTENTION_FP8_KERNELS if fp8 else _ATTENTION_KERNELS)[query.dtype]
    _launch(query.device, _ATTENTION_SOURCE, name, grid, (_ATTENTION_THREADS,), args)
    return out


def write_kv_fp8(
    kv_cache_layer: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: torch.Tensor,
    row_start: torch.Tensor,
    row_end: torch.Tensor,
    valid_rows: torch.Tensor,
) -> None:
    """One launch, one CUDA block per (block, K|V, head) group."""
    device = kv_cache_layer.device
    ids, lo, hi, valid = (
        t.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
        for t in (block_ids, row_start, row_end, valid_rows)
    )
    first = torch.cumsum(hi - lo, 0) - (hi - lo)  # each block's first token in k / v
    k, v = k.contiguous(), v.contiguous()
    _, _, rows, hkv, d = kv_cache_layer.shape
    m = ids.numel()
    if 2 * hkv > _MAX_GRID_Y:
        raise ValueError(f"{hkv} KV heads; the CUDA kernel takes {_MAX_GRID_Y // 2}")
    args = (
        np.uint64(kv_cache_layer.data_ptr()),
        np.uint64(k.data_ptr()),
        np.uint64(v.data_ptr()),
        np.uint64(ids.data_ptr()),
        np.uint64(lo.data_ptr()),
        np.uint64(hi.data_ptr()),
        np.uint64(valid.data_ptr()),
        np.uint64(first.data_ptr()),
        np.int32(hkv),
        np.int32(d),
        np.int32(rows - reference.FP8_SCALE_ROWS),
        np.int64(kv_cache_layer.stride(0)),
        np.int64(kv_cache_layer.stride(1)),
    )
    grid = (m, 2 * hkv)
    name = _WRITE_FP8_KERNELS[k.dtype]
    _launch(device, _ATTENTION_SOURCE, name, grid, (_WRITE_FP8_THREADS,), args)


def _payloads(
    op: str,
    geom: CacheGeometry,
    kv_caches: Sequence[torch.Tensor],
    ids: torch.Tensor,
    payloads: torch.Tensor,
    what: str,
) -> None:
    """One launch, one CUDA block per (block, layer, K|V, head) group (grid-strided)."""
    device = geom.device
    item = geom.dtype.itemsize
    base = _AddressResolver(device)(payloads, what)
    stride = payloads.stride(0)
    if base % 4 or stride % 4:
        raise ValueError(f"{what}: payload rows must start at 4-byte aligned addresses")
    args: tuple[Any, ...] = (
        np.uint64(_layer_ptrs(kv_caches, device).data_ptr()),
        np.uint64(ids.to(device, non_blocking=True).data_ptr()),
        np.uint64(0),
        np.uint64(base),
        np.int64(stride),
        np.int64(ids.numel()),
        np.int32(geom.num_layers),
        np.int32(geom.num_kv_heads),
        np.int32(geom.head_dim),
        np.int32(geom.block_size),
        np.int64(geom.kv_stride * item),
        np.int64(geom.block_stride * item),
    )
    if op == "gather":
        words = np.frombuffer(fp8.header(geom.block_shape, geom.dtype), dtype="<u4")
        args += tuple(np.uint32(w) for w in words)
    groups = ids.numel() * 2 * geom.num_layers * geom.num_kv_heads
    name = f"{op}_fp8_payloads_{_PAYLOAD_SUFFIX[geom.dtype]}"
    _launch(device, _ATTENTION_SOURCE, name, (min(groups, _MAX_GRID),), (_PAYLOAD_THREADS,), args)


def gather_fp8_payloads(
    geom: CacheGeometry, kv_caches: Sequence[torch.Tensor], ids: torch.Tensor, out: torch.Tensor
) -> None:
    _payloads("gather", geom, kv_caches, ids, out, "out")


def scatter_fp8_payloads(
    geom: CacheGeometry,
    payloads: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    ids: torch.Tensor,
) -> None:
    _payloads("scatter", geom, kv_caches, ids, payloads, "payloads")


def device_checksums(blocks: BlocksLike, spec: ChecksumBlocks) -> list[int]:
    """One launch for all n blocks, one copy of their n word sums to the host; the last mixing
    step of each checksum runs here in Python (n integers, not worth a second kernel)."""
    assert spec.device is not None
    device = spec.device
    words = spec.nbytes // 8
    ptr_array: torch.Tensor | None = None
    if isinstance(blocks, torch.Tensor):
        base, stride = blocks.data_ptr(), blocks.stride(0) * blocks.element_size()
    else:
        ptr_array = _u64_array([b.data_ptr() for b in blocks], device)
        base, stride = 0, 0
    # Zeroed on the current stream, as the kernel will run: CTAs atomically add into it.
    partials = torch.zeros(spec.n, dtype=torch.int64, device=device)
    per_cta = _CHECKSUM_THREADS * _CHECKSUM_MIN_WORDS
    chunks = max(1, min(_CHECKSUM_MAX_CHUNKS, -(-words // per_cta)))
    grid = (chunks, min(spec.n, _MAX_GRID_Y))
    args = (
        np.uint64(ptr_array.data_ptr() if ptr_array is not None else 0),
        np.uint64(base),
        np.int64(stride),
        np.int64(spec.n),
        np.int64(words),
        np.uint64(partials.data_ptr()),
    )
    _launch(device, _CHECKSUM_SOURCE, _CHECKSUM_KERNEL, grid, (_CHECKSUM_THREADS,), args)
    # .cpu() copies on the same current stream and waits for it, so the sums are final (and the
    # pointer array is no longer read when it is freed).
    sums = partials.cpu().numpy().view(np.uint64)
    return [reference.checksum_finish(int(s), spec.nbytes) for s in sums]
