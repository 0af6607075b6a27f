"""Block codecs of the tiers below the CPU tier: ``none``, ``lz4``, ``fp8``, ``fp8+lz4``.

A codec turns one block's bytes into the payload a record stores and back. Every record says
which codec wrote it (its id, below), so a reader decodes whatever a tier holds, whichever codec
the namespace is configured with now. Ids are on-disk and on-the-wire values: never renumber.

* ``none`` (0): the bytes as they are.
* ``lz4`` (1): an lz4 block of the bytes (``LZ4_compress_default``). Lossless. A writer stores a
  block raw (``none``) when compressing does not make it smaller, so the id says what was done.
* ``fp8`` (2): lossy. The block, of shape ``(layers, 2, block_size, kv_heads, head_dim)`` in
  bfloat16, float16 or float32, as float8 e4m3 (``torch.float8_e4m3fn``) with one float32 scale
  per (layer, K/V, kv head), in the FP8 format of ``kvstore.kernels.fp8`` (its one definition,
  shared with the FP8 paged cache): ``scale = amax / 448``; a group of zeros gets scale 1 here.
  Payload: a 24-byte frame header (magic ``KVF8``, version, source dtype, the shape), the
  scales, then the e4m3 bytes. The frame names the shape and dtype, so decoding needs nothing
  but the payload and the raw length. NaN stays NaN; an infinity saturates to the largest
  finite value of its group (its group's scale is taken over the finite values).
* ``fp8+lz4`` (3): an lz4 block of the ``fp8`` payload; a writer falls back to ``fp8`` when lz4
  does not shrink it.

Decoding is deterministic: every step (e4m3 to float32, one float32 multiply, one rounding to the
source dtype) is an exactly rounded IEEE operation, so a payload decodes to the same bytes on any
machine, every time. That is what lets a lossy record carry the checksum of its *decoded* form,
taken when it was encoded, and every read verify against it.

The fp8 codec applies only to blocks whose format (``BlockFormat``) is known and of a float dtype
it can encode; ``plan`` turns any other request into the lossless codec it contains (``fp8`` ->
``none``, ``fp8+lz4`` -> ``lz4``). Pure functions between caller buffers, no IO; they block the
calling thread (vectorised, in per-thread buffers; torch and the lz4 library release the GIL, so
two threads code two blocks at once), so tiers call them off the event loop.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.checksum import block_checksum
from kvstore.kernels import fp8

CODEC_NONE, CODEC_LZ4, CODEC_FP8, CODEC_FP8_LZ4 = 0, 1, 2, 3
NAMES: dict[str, int] = {"none": 0, "lz4": 1, "fp8": 2, "fp8+lz4": 3}
NAME_OF: dict[int, str] = {v: k for k, v in NAMES.items()}
LOSSY = frozenset({CODEC_FP8, CODEC_FP8_LZ4})
LOSSLESS_PART = {CODEC_NONE: 0, CODEC_LZ4: 1, CODEC_FP8: 0, CODEC_FP8_LZ4: 1}

FP8_MAX = fp8.MAX
FP8_DTYPES: dict[str, tuple[int, torch.dtype]] = {
    name: (fp8.PAYLOAD_DTYPES[dt], dt)
    for name, dt in (
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("float32", torch.float32),
    )
}


def codec_id(name: str) -> int:
    """The id of a codec named in a configuration; ValueError naming the choices otherwise."""
    try:
        return NAMES[name]
    except KeyError:
        raise ValueError(f"codec {name!r} unknown; choose one of {sorted(NAMES)}") from None


@dataclass(frozen=True)
class BlockFormat:
    """What the fp8 codec needs to know of a block beyond its bytes: its element dtype's name
    (``kvstore.layout`` names) and its shape ``(layers, 2, block_size, kv_heads, head_dim)``."""

    dtype: str
    shape: tuple[int, int, int, int, int]

    @property
    def groups(self) -> int:
        """Scale groups: one per (layer, K/V, kv head)."""
        layers, kv, _, heads, _ = self.shape
        return layers * kv * heads

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


def fp8_payload_bytes(fmt: BlockFormat) -> int:
    """Bytes of an ``fp8`` payload of a block of ``fmt``: header, scales, one byte per element."""
    return fp8.payload_bytes(fmt.shape)


def plan(name_or_id: str | int, fmt: BlockFormat | None, raw_bytes: int) -> tuple[int, int]:
    """(codec id to encode with, bound on its payload's bytes) for a block of ``raw_bytes``.

    A lossy codec asked for a block it cannot encode (format unknown, a dtype other than
    bfloat16/float16/float32, a format that does not describe ``raw_bytes``, or a block so small
    fp8 would not shrink it) becomes its lossless part. The bound is what a tier sizes the
    record's room by: ``raw_bytes`` for the lossless codecs (lz4 may not shrink a block), the
    fp8 payload's size for the fp8 codecs."""
    codec = codec_id(name_or_id) if isinstance(name_or_id, str) else name_or_id
    if codec not in NAME_OF:
        raise ValueError(f"codec id {codec} unknown")
    if codec in LOSSY:
        itemsize = FP8_DTYPES[fmt.dtype][1].itemsize if fmt and fmt.dtype in FP8_DTYPES else 0
        if (
            fmt is None
            or not itemsize
            or fmt.elements * itemsize != raw_bytes
            or fp8_payload_bytes(fmt) >= raw_bytes
        ):
            return LOSSLESS_PART[codec], raw_bytes
        return codec, fp8_payload_bytes(fmt)
    return codec, raw_bytes


def scratch_bytes(raw_bytes: int) -> int:
    """Scratch ``encode`` and ``decode`` need for a block of ``raw_bytes``, at most."""
    return 2 * lz4_bound(raw_bytes) + 64


# --------------------------------------------------------------------------------- lz4
def _address(view: memoryview) -> int:
    """Address of a buffer's first byte (read-only buffers too, unlike ctypes.from_buffer)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def _load_lz4() -> tuple[Callable[..., int], Callable[..., int]] | None:
    """LZ4_compress_default and LZ4_decompress_safe from the lz4 package's own extension: they
    work between caller buffers (no per-call allocation of a block-sized result, whose page
    faults cost more than the codec here) and ctypes releases the GIL around them."""
    try:
        import lz4.block._block as ext

        lib = ctypes.CDLL(ext.__file__)
        fns = (lib.LZ4_compress_default, lib.LZ4_decompress_safe)
    except (ImportError, OSError, AttributeError):
        return None
    for fn in fns:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fns


_LZ4 = _load_lz4()


def lz4_bound(n: int) -> int:
    """LZ4_COMPRESSBOUND: the largest an lz4 block of ``n`` bytes can be."""
    return n + n // 255 + 16


def lz4_compress(src: memoryview, dst: memoryview) -> int:
    """Compress into ``dst`` (lz4 block format); 0 when the result does not fit."""
    if _LZ4 is not None:
        return max(0, _LZ4[0](_address(src), _address(dst), src.nbytes, dst.nbytes))
    import lz4.block

    out = lz4.block.compress(src, store_size=False)
    if len(out) > dst.nbytes:
        return 0
    dst[: len(out)] = out
    return len(out)


def lz4_decompress_into(src: memoryview, dst: memoryview) -> int:
    """Decompress into ``dst``; the bytes produced, or -1 for corrupt input or too small a
    ``dst``."""
    if _LZ4 is not None:
        n = _LZ4[1](_address(src), _address(dst), src.nbytes, dst.nbytes)
        return n if n >= 0 else -1
    import lz4.block

    try:
        out = lz4.block.decompress(src, uncompressed_size=dst.nbytes)
    except Exception:  # lz4.block.LZ4BlockError and friends: corrupt input
        return -1
    dst[: len(out)] = out
    return len(out)


def lz4_decompress(src: memoryview, dst: memoryview) -> bool:
    """Fill all of ``dst`` from ``src``; False for corrupt input or a wrong length."""
    return lz4_decompress_into(src, dst) == dst.nbytes


# --------------------------------------------------------------------------------- fp8
def _tensor(buf: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``buf``'s memory (no copy; a read-only buffer, which torch cannot wrap,
    is copied: the tiers pass writable slots and scratch, tests pass ``bytes``)."""
    if buf.readonly:
        buf = memoryview(bytearray(buf))
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)


def fp8_encode(data: memoryview, fmt: BlockFormat, out: memoryview) -> int:
    """Encode a block of ``fmt`` into ``out`` (at least ``fp8_payload_bytes(fmt)``); returns
    the payload's length."""
    src_dtype = FP8_DTYPES[fmt.dtype][1]
    src = _tensor(data[: fmt.elements * src_dtype.itemsize], src_dtype).view(fmt.shape)
    n = fp8_payload_bytes(fmt)
    fp8.encode_payload(src, _tensor(out[:n], torch.uint8))
    return n


def fp8_decode(payload: memoryview, out: memoryview) -> bool:
    """Decode an fp8 payload into all of ``out``; False when the payload is not a whole fp8
    payload of a block of ``out``'s length (a corrupt record)."""
    stated = fp8.parse_header(payload)
    if stated is None:
        return False
    shape, dtype = stated
    if math.prod(shape) * dtype.itemsize != out.nbytes or payload.nbytes != fp8.payload_bytes(
        shape
    ):
        return False
    fp8.decode_payload(_tensor(payload, torch.uint8), _tensor(out, dtype).view(shape))
    return True


# --------------------------------------------------------------------------------- codecs
def encode(
    codec: int, data: memoryview, fmt: BlockFormat | None, scratch: memoryview
) -> tuple[int, memoryview]:
    """Encode ``data`` with ``codec`` (as ``plan`` returned it): (codec id that wrote the
    payload, the payload). The payload is ``data`` itself for ``none`` (and for ``lz4`` when
    compressing does not shrink it), else a view of ``scratch`` (``scratch_bytes`` long)."""
    if codec == CODEC_NONE:
        return CODEC_NONE, data
    if codec == CODEC_LZ4:
        n = lz4_compress(data, scratch[: data.nbytes - 1])
        return (CODEC_LZ4, scratch[:n]) if n else (CODEC_NONE, data)
    if codec not in LOSSY or fmt is None:
        raise ValueError(f"codec {codec} cannot encode this block (use plan())")
    size = fp8_payload_bytes(fmt)
    frame = scratch[:size]
    fp8_encode(data, fmt, frame)
    if codec == CODEC_FP8:
        return CODEC_FP8, frame
    packed = scratch[size : size + size - 1]
    n = lz4_compress(frame, packed)
    return (CODEC_FP8_LZ4, packed[:n]) if n else (CODEC_FP8, frame)


def decode(codec: int, payload: memoryview, out: memoryview, scratch: memoryview) -> bool:
    """Decode a payload written by ``codec`` into all of ``out``; False when it is not a valid
    payload of a block of ``out``'s length (a corrupt record: a miss). ``scratch`` (only for
    ``fp8+lz4``) must hold ``scratch_bytes(out.nbytes)``."""
    if codec == CODEC_NONE:
        if payload.nbytes != out.nbytes:
            return False
        out[:] = payload
        return True
    if codec == CODEC_LZ4:
        return lz4_decompress(payload, out)
    if codec == CODEC_FP8:
        return fp8_decode(payload, out)
    if codec == CODEC_FP8_LZ4:
        frame = scratch[: out.nbytes]  # an fp8 frame is smaller than its block (see plan)
        n = lz4_decompress_into(payload, frame)
        return n > 0 and fp8_decode(frame[:n], out)
    return False


def encode_payload(
    block: Any, fmt: BlockFormat, out: memoryview, namespace: bytes, key: bytes
) -> tuple[int, int]:
    """Encode a block as its fp8 payload into ``out`` (exactly ``fp8_payload_bytes(fmt)``), for
    a CPU tier of payloads (``cpu = "fp8"``): (checksum of its decoded form, checksum of the
    payload), both bound to ``namespace`` and ``key`` (``kvstore.checksum.block_checksum``).
    The decoded form is what every reader gets; it is decoded here once to take its checksum."""
    data = memoryview(block).cast("B")
    fp8_encode(data, fmt, out)
    decoded = memoryview(bytearray(data.nbytes))
    if not fp8_decode(out, decoded):
        raise AssertionError("a fresh fp8 payload failed to decode")
    return block_checksum(decoded, namespace, key), block_checksum(out, namespace, key)


def round_trip(codec: int, data: memoryview, fmt: BlockFormat | None) -> bytes:
    """The bytes a reader gets back for ``data`` stored with ``codec`` (tests, benchmarks)."""
    scratch = memoryview(bytearray(scratch_bytes(data.nbytes)))
    used, payload = encode(codec, data, fmt, scratch)
    out = memoryview(bytearray(data.nbytes))
    if not decode(used, memoryview(bytes(payload)), out, scratch):
        raise AssertionError("a fresh payload failed to decode")
    return bytes(out)


def block_format_of(layout: Any) -> BlockFormat | None:
    """The ``BlockFormat`` of a ``kvstore.layout.KVLayout`` (None for dtypes fp8 cannot
    encode, so the lossless part of a codec applies)."""
    name = getattr(layout, "dtype_name", None)
    if name not in FP8_DTYPES:
        return None
    return BlockFormat(name, tuple(layout.block_shape))
