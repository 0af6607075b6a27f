"""The FP8 format, defined once: its constants, its math, and the fast CPU paths of that math.

Both users of the format import it from here: the FP8 paged cache's kernels and their torch
reference (``reference.py``, ``write_kv_fp8.cu``, ``paged_attention.cu``, ``fp8_blocks.cu``) and
the tiers' ``fp8`` codec (``kvstore.tiers.codecs``). It lives in ``kernels`` because that
package imports nothing of ours and everything may import it (``kvstore.layout``, a core type,
already does), so neither user reaches up a layer; the codec's payload framing (header,
scale placement, zero-group convention) stays with the codec, the cache's (scale row) with the
cache.

The math, for a group of values x that shares one scale s (float32 throughout):

    scale:      s = amax / 448            amax = the largest finite |x| of the group
    quantize:   q = e4m3(clamp(x / s, -448, 448))   one IEEE division, then round to nearest
                                                    even to float8 e4m3fn (3 mantissa bits)
    dequantize: x' = float32(q) * s       one IEEE multiply, then (if the destination is
                                          narrower) one round-to-nearest-even to its dtype

Every step is exactly rounded, so a quantized group dequantizes to the same bytes on any
machine and in any implementation (CUDA kernels included). An e4m3fn NaN code (S.1111.111)
dequantizes to NaN. A group's scale is never above 3.4e38 / 448 (the largest float32 over 448),
which the fast paths below rely on (``s * 256`` cannot overflow).

Error bound, element x of a group with scale s (3 mantissa bits, subnormal step 2^-9):
    |x - x'| <= max(|x| * 2^-4, s * 2^-10)      (so at most amax / 16 in the group)

Fast CPU paths (``quantize_groups``, ``dequantize_groups``): the same results, bit for bit, as
the one-line definitions (``quantize``, ``dequantize``). They work in place in per-thread
buffers reused across calls (a fresh temporary costs page faults that cost more than the
arithmetic on this kind of machine), on whole groups at once in chunks that stay in L2, with the
per-group scale arithmetic in numpy (a torch call on a few hundred values costs more than a pass
over the block). e4m3 -> float is done by moving bits (e4m3 is float16 with the exponent bias 7
instead of 15, so ``q`` read as float16 is exactly ``float(q) * 2^-8``; the 2^8 goes into the
scale, exactly), because torch's own float8 -> float32 cast runs ~20x slower on CPU. float ->
e4m3 is torch's cast (round to nearest even; a scalar loop, the largest cost of encoding), of
values within the finite range. What is left is ~10 passes of torch's vectorised kernels per
block: 1.5-3.7x faster than the first implementation, still 5-10x slower than a copy
(``benchmarks/bench_tier_codecs.py``); near-copy speed would need a compiled one-pass kernel.
"""

from __future__ import annotations

import math
import struct
import threading

import numpy as np
import torch

DTYPE = torch.float8_e4m3fn
MAX = 448.0
"""Largest finite float8 e4m3fn value."""
REL_BOUND = 2.0**-4
"""Half an ulp of a 3-bit mantissa, relative."""
SUBNORMAL_BOUND = 2.0**-10
"""Half the subnormal step (2^-9), in units of the scale."""
NAN_CODE = 0x7F
"""e4m3fn's NaN, less the sign bit; e4m3fn has no infinity."""

# Elements per chunk of the fast paths: float32 + 2 int16 work buffers of this size (2 MiB) stay
# in a core's L2.
_CHUNK = 1 << 18
# Integer view of each float dtype, the mask of its magnitude bits and the bits of +infinity:
# on magnitude bits, integer order is float order, and every NaN is above infinity.
_BITS = {
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
}
FLOAT_DTYPES = tuple(_BITS)


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The scale of groups whose largest finite magnitudes are ``amax`` (float32)."""
    return amax.float() / MAX


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` (any float dtype) in e4m3fn units of ``scale`` (broadcast against ``x``); a group
    of scale 0 quantizes to 0."""
    s = scale.float()
    y = torch.where(s > 0, x.float() / torch.where(s > 0, s, 1.0), 0.0)
    # Clamp first: torch versions differ on what they make of magnitudes above 448.
    return y.clamp(-MAX, MAX).to(DTYPE)


def _half_bits(q: torch.Tensor) -> torch.Tensor:
    """e4m3fn codes (uint8) as float16 values ``float(q) * 2^-8`` (NaN codes aside)."""
    b = q.view(torch.uint8).to(torch.int16)
    return ((b & 0x7F) << 7).bitwise_or_((b & 0x80) << 8).view(torch.float16)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of e4m3fn ``q`` in units of ``scale``: ``float(q) * scale``, NaN codes
    NaN."""
    x = _half_bits(q) * (scale.float() * 256.0)
    nan = q.view(torch.uint8) & 0x7F == NAN_CODE
    return x.masked_fill_(nan, float("nan")) if bool(nan.any()) else x


def error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The largest ``|x - dequantize(quantize(x, s), s)|`` the format allows, per element."""
    return torch.maximum(x.float().abs() * REL_BOUND, scale.float() * SUBNORMAL_BOUND)


# -- fast CPU paths over groups laid out [C, T, H, D] with one scale per (c, h) -----------------


class _Work(threading.local):
    """Per-thread work buffers, grown to the largest chunk asked for and then reused, and their
    shaped views (a view costs more here than some of the passes over it)."""

    def __init__(self) -> None:
        self.bufs: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self.views: dict[tuple[torch.dtype, int, tuple[int, ...]], torch.Tensor] = {}

    def get(self, dtype: torch.dtype, shape: tuple[int, ...], slot: int = 0) -> torch.Tensor:
        view = self.views.get((dtype, slot, shape))
        if view is None:
            n = math.prod(shape)
            buf = self.bufs.get((dtype, slot))
            if buf is None or buf.numel() < n:
                buf = self.bufs[(dtype, slot)] = torch.empty(n, dtype=dtype)
                self.views = {k: v for k, v in self.views.items() if k[:2] != (dtype, slot)}
            view = self.views[(dtype, slot, shape)] = buf[:n].view(shape)
        return view


_WORK = _Work()


def _chunks(c: int, per_c: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK // max(1, per_c))
    return [(i, min(c, i + step)) for i in range(0, c, step)]


def _as_float32(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float32 values of magnitude bits of ``dtype`` (exact: every such value is a float32)."""
    if dtype == torch.bfloat16:
        return (bits.astype(np.int32) << 16).view(np.float32)
    if dtype == torch.float16:
        return bits.view(np.float16).astype(np.float32)
    return bits.view(np.float32)


def quantize_groups(
    x: torch.Tensor, scales_out: torch.Tensor, q_out: torch.Tensor, empty_scale: float
) -> None:
    """Quantize ``x`` ``[C, T, H, D]`` (bfloat16, float16 or float32, contiguous, on the CPU)
    into ``q_out`` (same shape, uint8 or e4m3fn), one group per (c, h): ``scales_out[c, h]``
    (float32 ``[C, H]``) is ``scale_of`` the group's largest finite magnitude, or
    ``empty_scale`` when that is 0. ``quantize(x, scale)``, bit for bit: NaN stays NaN and an
    infinity saturates to +-448."""
    c_all, t, h, d = x.shape
    ints, mask, inf_bits = _BITS[x.dtype]
    bits = x.view(ints)
    q8 = q_out.view(DTYPE)
    for c0, c1 in _chunks(c_all, t * h * d):
        shape = (c1 - c0, t, h, d)
        mag = _WORK.get(ints, shape)
        torch.bitwise_and(bits[c0:c1], mask, out=mag)
        amax_bits = mag.amax(dim=3).amax(dim=1)  # [c, H]; over D first (contiguous)
        finite = int(amax_bits.max()) < inf_bits
        if not finite:  # an infinity or NaN: the scale is taken over the finite values
            mag.masked_fill_(mag >= inf_bits, 0)
            amax_bits = mag.amax(dim=3).amax(dim=1)
        # scale_of(amax), on c x H values: numpy's small-array calls cost less than torch's.
        amax = _as_float32(amax_bits.numpy(), x.dtype)
        scale = scales_out[c0:c1]
        scale_np = scale.numpy()
        np.divide(amax, np.float32(MAX), out=scale_np)
        scale_np[amax == 0] = empty_scale
        y = _WORK.get(torch.float32, shape)
        # Convert, then divide in place: torch's mixed-dtype division runs ~10x slower here.
        y.copy_(x[c0:c1]).div_(scale[:, None, :, None])
        if not finite:
            y.clamp_(-MAX, MAX)
        # With every |x| <= amax, |y| <= 448 * (1 + 2^-23)^2, which rounds to 448 whatever
        # torch does above 448: the clamp only matters for infinities (NaN stays NaN).
        q8[c0:c1].copy_(y)


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """``out = dequantize(q, scales[c, h])`` rounded to ``out``'s dtype (bfloat16, float16 or
    float32), bit for bit, for ``q`` ``[C, T, H, D]`` (uint8 or e4m3fn) and ``out`` of that
    shape, contiguous, on the CPU. NaN codes become the NaN torch rounds a float32 NaN to."""
    c_all, t, h, d = q.shape
    codes = q.view(torch.uint8)
    s256 = scales.float() * 256.0
    direct = out.dtype == torch.float32
    for c0, c1 in _chunks(c_all, t * h * d):
        shape = (c1 - c0, t, h, d)
        b = _WORK.get(torch.int16, shape)
        sign = _WORK.get(torch.int16, shape, slot=1)
        b.copy_(codes[c0:c1])
        # float16 bits of code b: ((b & 0x7f) << 7) | ((b & 0x80) << 8), in three passes:
        # adding the sign bit to itself carries it to bit 8, so one shift places all of it.
        torch.bitwise_and(b, 0x80, out=sign)
        b.add_(sign).bitwise_left_shift_(7)
        y = out[c0:c1] if direct else _WORK.get(torch.float32, shape)
        # Convert, then multiply in place: torch's mixed-dtype multiply runs ~10x slower here.
        y.copy_(b.view(torch.float16)).mul_(s256[c0:c1, None, :, None])
        flag = _WORK.get(torch.uint8, shape)
        torch.bitwise_or(codes[c0:c1], 0x80, out=flag)  # 0xff: the code is S.1111.111, a NaN
        if int(flag.max()) == 0xFF:
            y.masked_fill_(flag == 0xFF, float("nan"))
        if not direct:
            out[c0:c1].copy_(y)


# -- the fp8 record payload of one contiguous block -------------------------------------------
#
# What the tiers' ``fp8`` codec stores for a block of shape ``(layers, 2, block_size, H, D)`` in
# bfloat16, float16 or float32, and what the fp8 gather kernel writes straight from a paged
# cache (so the bytes that leave the device are already the payload): a 24-byte header (magic
# ``KVF8``, version 1, source dtype code, 2 zero bytes, layers, block_size, H, D as little-endian
# uint32), the float32 scales ``[layers, 2, H]``, then the e4m3 codes ``[layers, 2, block_size,
# H, D]``. A group here is (layer, K|V, head); a group of zeros gets scale 1.

PAYLOAD_MAGIC = b"KVF8"
PAYLOAD_VERSION = 1
PAYLOAD_DTYPES: dict[torch.dtype, int] = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_DTYPE_OF_CODE = {code: dt for dt, code in PAYLOAD_DTYPES.items()}
HEADER = struct.Struct("<4sBBxxIIII")
assert HEADER.size == 24
EMPTY_GROUP_SCALE = 1.0


def payload_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of the payload of a block of ``shape`` ``(layers, 2, block_size, H, D)``."""
    layers, kv, bs, heads, dim = shape
    return HEADER.size + 4 * layers * kv * heads + layers * kv * bs * heads * dim


def header(shape: tuple[int, ...], dtype: torch.dtype) -> bytes:
    """The payload header of a block of ``shape`` and ``dtype``."""
    layers, _, bs, heads, dim = shape
    code = PAYLOAD_DTYPES[dtype]
    return HEADER.pack(PAYLOAD_MAGIC, PAYLOAD_VERSION, code, layers, bs, heads, dim)


def parse_header(payload: memoryview | bytes) -> tuple[tuple[int, ...], torch.dtype] | None:
    """(block shape, source dtype) a payload's header states, or None if it is not a header
    of this format (short, another magic or version, an unknown dtype)."""
    if len(payload) < HEADER.size:
        return None
    magic, version, code, layers, bs, heads, dim = HEADER.unpack_from(payload)
    dtype = _DTYPE_OF_CODE.get(code)
    if magic != PAYLOAD_MAGIC or version != PAYLOAD_VERSION or dtype is None:
        return None
    return (layers, 2, bs, heads, dim), dtype


def _payload_parts(payload: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """(header bytes, scales [layers * 2, H] float32, codes [layers * 2, bs, H, D] uint8)
    views of a uint8 payload tensor."""
    layers, kv, bs, heads, dim = shape
    groups = layers * kv * heads
    scales = payload[HEADER.size : HEADER.size + 4 * groups].view(torch.float32)
    codes = payload[HEADER.size + 4 * groups : payload_bytes(shape)]
    return (
        payload[: HEADER.size],
        scales.view(layers * kv, heads),
        codes.view(layers * kv, bs, heads, dim),
    )


def encode_payload(block: torch.Tensor, payload: torch.Tensor) -> None:
    """Write the payload of ``block`` ``(layers, 2, bs, H, D)`` (contiguous, CPU) into
    ``payload`` (uint8, at least ``payload_bytes(block.shape)``)."""
    shape = tuple(block.shape)
    head, scales, codes = _payload_parts(payload, shape)
    head.copy_(torch.frombuffer(bytearray(header(shape, block.dtype)), dtype=torch.uint8))
    layers, kv, bs, heads, dim = shape
    quantize_groups(block.view(layers * kv, bs, heads, dim), scales, codes, EMPTY_GROUP_SCALE)


def decode_payload(payload: torch.Tensor, out: torch.Tensor) -> None:
    """Decode a payload (uint8 CPU tensor, header already checked against ``out``) into
    ``out`` ``(layers, 2, bs, H, D)`` (contiguous, of the payload's dtype)."""
    shape = tuple(out.shape)
    _, scales, codes = _payload_parts(payload, shape)
    layers, kv, bs, heads, dim = shape
    dequantize_groups(codes, scales, out.view(layers * kv, bs, heads, dim))
