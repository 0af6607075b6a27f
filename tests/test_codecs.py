"""The tiers' block codecs (``kvstore.tiers.codecs``) and the NVMe tier holding records of every
codec: exact round trips for none and lz4, fp8 within e4m3's bound per element and per scale
group, deterministic decoding, corrupt payloads refused, mixed codecs in one tier across a
restart, a corrupt encoded record a miss, records of the previous record version still read."""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvstore.checksum import block_checksum
from kvstore.layout import KVLayout
from kvstore.tiers import codecs
from kvstore.tiers.codecs import (
    CODEC_FP8,
    CODEC_FP8_LZ4,
    CODEC_LZ4,
    CODEC_NONE,
    BlockFormat,
    block_format_of,
)
from kvstore.tiers.nvme import FILE_NAME, PAGE, NvmeTier, ondisk

NS = bytes(range(16))
SHAPE = (4, 2, 16, 3, 64)  # layers, K/V, block_size, kv heads, head_dim
FMT = BlockFormat("bfloat16", SHAPE)
# Per element: e4m3 keeps 3 mantissa bits (half an ulp is 2^-4 of the value) down to 2^-6,
# below which its subnormals are 2^-9 apart; the decoded value is then rounded to the source
# dtype (half an ulp: bf16 2^-8, fp16 2^-11, fp32 2^-24).
E4M3_REL, E4M3_SUBNORMAL_ABS = 2.0**-4, 2.0**-10
SOURCE_REL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def kv_block(seed: int, dtype: torch.dtype = torch.bfloat16, shape=SHAPE) -> torch.Tensor:
    """A KV-like block: every (layer, K/V, head) group on its own scale (over three orders of
    magnitude, one outlier head), with a few exact zeros."""
    g = torch.Generator().manual_seed(seed)
    layers, kv, _, heads, _ = shape
    scale = torch.logspace(-2, 1.5, layers * kv * heads).view(layers, kv, 1, heads, 1)
    x = torch.randn(shape, generator=g) * scale
    x[0, 1, :, 0, :5] = 0.0
    return x.to(dtype)


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy().reshape(-1))


def from_bytes(b: bytes, dtype: torch.dtype, shape=SHAPE) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=dtype).view(shape)


# ---------------------------------------------------------------------------- codecs
@pytest.mark.parametrize("codec", [CODEC_NONE, CODEC_LZ4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
def test_lossless_codecs_round_trip_exactly(codec, dtype):
    if dtype == torch.uint8:
        data = memoryview(np.repeat(np.arange(64, dtype=np.uint8), 97).tobytes())
        fmt = None
    else:
        data, fmt = as_bytes(kv_block(1, dtype)), BlockFormat(str(dtype)[6:], SHAPE)
    assert codecs.round_trip(codec, data, fmt) == bytes(data)
    scratch = memoryview(bytearray(codecs.scratch_bytes(data.nbytes)))
    used, payload = codecs.encode(codec, data, fmt, scratch)
    assert used in (CODEC_NONE, codec)
    if dtype == torch.uint8 and codec == CODEC_LZ4:
        assert used == CODEC_LZ4 and payload.nbytes < data.nbytes / 4  # runs compress


@pytest.mark.parametrize("codec", [CODEC_FP8, CODEC_FP8_LZ4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_error_is_within_e4m3s_bound_per_element_and_per_group(codec, dtype):
    x = kv_block(2, dtype)
    fmt = BlockFormat(str(dtype)[6:], SHAPE)
    planned, bound = codecs.plan(codec, fmt, x.numel() * x.element_size())
    assert planned == codec and bound == codecs.fp8_payload_bytes(fmt)
    y = from_bytes(codecs.round_trip(codec, as_bytes(x), fmt), dtype).double()
    xd = x.double()
    amax = xd.abs().amax(dim=(2, 4), keepdim=True)
    scale = torch.where(amax > 0, amax / codecs.FP8_MAX, torch.ones_like(amax))
    v = (xd / scale).abs()
    allowed = scale * torch.maximum(v * E4M3_REL, torch.full_like(v, E4M3_SUBNORMAL_ABS))
    allowed = allowed * (1 + 1e-6) + y.abs() * SOURCE_REL[dtype]
    assert bool(((y - xd).abs() <= allowed).all())
    # Per scale group: its largest value maps to e4m3's largest and comes back but for the
    # source rounding; the group's error relative to its norm stays under 2^-4.
    err = (y - xd).pow(2).sum(dim=(2, 4)).sqrt()
    norm = xd.pow(2).sum(dim=(2, 4)).sqrt()
    assert bool((err <= norm * E4M3_REL + 1e-30).all())
    ymax = y.abs().amax(dim=(2, 4), keepdim=True)
    assert bool(((ymax - amax).abs() <= amax * SOURCE_REL[dtype] * 2).all())
    # One outlier head does not cost the others their precision: the smallest group (scale
    # 1e-2) keeps a relative error far below what one block-wide scale would give it.
    assert float(err[0, 0, 0] / norm[0, 0, 0]) < 0.05


def test_fp8_zeros_nan_and_infinity():
    x = kv_block(3)
    x[1, 0, :, 2, :] = 0.0  # a whole group of zeros: scale 1, exact zeros back
    x[2, 1, 3, 1, 7] = float("nan")
    x[3, 0, 5, 0, 9] = float("inf")
    y = from_bytes(codecs.round_trip(CODEC_FP8, as_bytes(x), FMT), torch.bfloat16)
    assert bool((y[1, 0, :, 2, :] == 0).all())
    assert torch.isnan(y[2, 1, 3, 1, 7])
    finite_max = x[3, 0, :, 0, :].float().nan_to_num(posinf=0).abs().max()
    assert torch.isfinite(y[3, 0, 5, 0, 9])
    assert abs(float(y[3, 0, 5, 0, 9]) - float(finite_max)) <= float(finite_max) * 2**-7
    other = torch.ones(SHAPE, dtype=torch.bool)
    other[2, 1, :, 1, :] = other[3, 0, :, 0, :] = other[1, 0, :, 2, :] = False
    assert bool(torch.isfinite(y[other]).all())


def test_fp8_decoding_is_deterministic():
    data = as_bytes(kv_block(4))
    a, b = (codecs.round_trip(CODEC_FP8_LZ4, data, FMT) for _ in range(2))
    assert a == b
    s1 = memoryview(bytearray(codecs.scratch_bytes(data.nbytes)))
    s2 = memoryview(bytearray(codecs.scratch_bytes(data.nbytes)))
    assert bytes(codecs.encode(CODEC_FP8, data, FMT, s1)[1]) == bytes(
        codecs.encode(CODEC_FP8, data, FMT, s2)[1]
    )


def test_plan_keeps_lossy_codecs_to_blocks_they_can_encode():
    n = FMT.elements * 2
    assert codecs.plan("fp8", FMT, n) == (CODEC_FP8, codecs.fp8_payload_bytes(FMT))
    assert codecs.plan("fp8", None, n) == (CODEC_NONE, n)  # format unknown
    assert codecs.plan("fp8+lz4", None, n) == (CODEC_LZ4, n)
    assert codecs.plan("fp8", FMT, n + 2) == (CODEC_NONE, n + 2)  # format does not describe it
    fp8_layout = KVLayout(4, 3, 64, 16, dtype=torch.float8_e4m3fn)
    assert block_format_of(fp8_layout) is None  # already fp8: stored losslessly
    assert block_format_of(KVLayout(4, 3, 64, 16)) == FMT
    tiny = BlockFormat("bfloat16", (1, 2, 1, 1, 4))  # frame and scales outweigh the block
    assert codecs.plan("fp8", tiny, 16) == (CODEC_NONE, 16)
    assert codecs.fp8_payload_bytes(FMT) < n // 2 + 1024  # about half of bf16
    with pytest.raises(ValueError, match="unknown"):
        codecs.plan("zstd", FMT, n)


# The fp8 payload as first defined (one torch expression per step, no buffers, no chunks): the
# spec the fast paths must meet bit for bit, so records written before them decode to the same
# bytes, and records written now are what a reader of then expects.
def first_fp8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales [layers, 2, heads], e4m3 codes as uint8) of a block."""
    f = x.float()
    finite = torch.nan_to_num(f, nan=0.0, posinf=0.0, neginf=0.0).abs()
    amax = finite.amax(dim=(2, 4))
    scales = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (f / scales[:, :, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return scales, q.view(torch.uint8)


def first_fp8_decode(scales: torch.Tensor, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    b = q.to(torch.int16)
    half = ((b & 0x7F) << 7).bitwise_or_((b & 0x80) << 8).view(torch.float16)
    x = half.float() * (scales * 256.0)[:, :, None, :, None]
    x.masked_fill_(b & 0x7F == 0x7F, float("nan"))
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [SHAPE, (32, 2, 16, 8, 128)])  # one chunk; several
def test_fp8_payloads_are_bit_exact_with_the_formats_first_definition(dtype, shape):
    x = kv_block(7, torch.float32, shape)
    x[1, 0, :, 1, :] = 0.0  # a group of zeros
    x[2, 1, 3, 1, 7] = float("nan")
    x[3, 0, 5, 0, 9] = float("-inf")
    x[3, 1, 0, 2, 0] = 3e5  # past float16's range: an infinity once in float16
    x = x.to(dtype)
    fmt = BlockFormat(str(dtype)[6:], shape)
    groups = fmt.groups
    payload = bytearray(codecs.fp8_payload_bytes(fmt))
    codecs.fp8_encode(as_bytes(x), fmt, memoryview(payload))
    scales, q = first_fp8_encode(x)
    got_scales = torch.frombuffer(payload, dtype=torch.float32, offset=24, count=groups)
    assert torch.equal(got_scales.view(scales.shape), scales)
    assert torch.equal(
        torch.frombuffer(payload, dtype=torch.uint8, offset=24 + 4 * groups), q.flatten()
    )
    # Decoding any payload, every code (NaN codes too) under scales from 1e-40 to 1e35.
    rng = np.random.default_rng(0)
    body = np.frombuffer(payload, dtype=np.uint8, offset=24 + 4 * groups)
    body[:] = rng.integers(0, 256, body.size, dtype=np.uint8)
    body[:256] = np.arange(256, dtype=np.uint8)
    raw_scales = np.frombuffer(payload, dtype=np.float32, offset=24, count=groups)
    raw_scales[:] = np.exp(rng.uniform(-92, 80, groups)).astype(np.float32)
    out = memoryview(bytearray(x.numel() * x.element_size()))
    assert codecs.fp8_decode(memoryview(payload), out)
    want = first_fp8_decode(
        torch.from_numpy(raw_scales.copy()).view(scales.shape),
        torch.from_numpy(body.copy()).view(shape),
        dtype,
    )
    assert bytes(out) == bytes(as_bytes(want))


def test_fp8_codec_threads_code_blocks_at_once_without_mixing_their_buffers():
    blocks = [as_bytes(kv_block(20 + i, torch.bfloat16, (32, 2, 16, 8, 128))) for i in range(6)]
    fmt = BlockFormat("bfloat16", (32, 2, 16, 8, 128))
    alone = [codecs.round_trip(CODEC_FP8, b, fmt) for b in blocks]
    with ThreadPoolExecutor(3) as pool:
        for _ in range(3):
            together = list(pool.map(lambda b: codecs.round_trip(CODEC_FP8, b, fmt), blocks))
            assert together == alone


def test_corrupt_payloads_are_refused():
    data = as_bytes(kv_block(5))
    n = data.nbytes
    scratch = memoryview(bytearray(codecs.scratch_bytes(n)))
    out = memoryview(bytearray(n))
    _, frame = codecs.encode(CODEC_FP8, data, FMT, scratch)
    frame = bytearray(frame)
    assert codecs.decode(CODEC_FP8, memoryview(frame), out, scratch)
    assert not codecs.decode(CODEC_FP8, memoryview(frame)[:-1], out, scratch)  # cut short
    assert not codecs.decode(CODEC_FP8, memoryview(frame), out[:-2], scratch)  # other length
    bad = bytearray(frame)
    bad[0] ^= 1
    assert not codecs.decode(CODEC_FP8, memoryview(bad), out, scratch)  # magic
    bad = bytearray(frame)
    bad[8] += 1
    assert not codecs.decode(CODEC_FP8, memoryview(bad), out, scratch)  # shape
    assert not codecs.decode(CODEC_LZ4, memoryview(bytes(64)), out, scratch)
    assert not codecs.decode(CODEC_FP8_LZ4, memoryview(bytes(64)), out, scratch)
    assert not codecs.decode(CODEC_NONE, data[:-1], out, scratch)
    assert not codecs.decode(99, data, out, scratch)


# ---------------------------------------------------------------------------- the NVMe tier
def aligned(n: int) -> memoryview:
    return memoryview(mmap.mmap(-1, n))[:n]


@pytest.fixture
async def opened(tmp_path):
    tiers: list[NvmeTier] = []

    async def make(**kw) -> tuple[NvmeTier, list]:
        tier = NvmeTier(tmp_path / "nvme", 16 << 20, slab_bytes=1 << 20, **kw)
        records = await tier.open()
        tiers.append(tier)
        return tier, records

    yield make
    for tier in tiers:
        await tier.close()


CODEC_NAMES = ("none", "lz4", "fp8", "fp8+lz4")


async def write_mixed(tier: NvmeTier) -> list[tuple[int, int, bytes, int]]:
    """Blocks 0-7, two of each codec (odd ones compressible): (slot, i, bytes, checksum)."""
    out = []
    for i in range(8):
        x = kv_block(10 + i)
        if i % 2:
            x[:, :, :, :, 32:] = 0  # half zeros: lz4 has something to find
        data = bytes(as_bytes(x))
        src = aligned(len(data))
        src[:] = data
        c = block_checksum(data, NS, key(i))
        codec = CODEC_NAMES[i // 2]
        slot = tier.allocate(tier.payload_bytes_for(len(data), codec, FMT))
        assert slot is not None
        await tier.write(slot, key(i), NS, src, c, codec=codec, block_format=FMT)
        out.append((slot, i, data, c))
    return out


async def test_one_tier_holds_every_codec_and_reads_each_after_a_restart(opened):
    tier, _ = await opened(codec="none")
    written = await write_mixed(tier)
    s = tier.stats()
    # lz4 that saves no page is stored raw, and so is fp8 that lz4 does not shrink: the
    # record names what was done.
    assert (s["records_none"], s["records_lz4"], s["records_fp8"], s["records_fp8_lz4"]) == (
        3,
        1,
        3,
        1,
    )
    raw = len(written[0][2])
    fp8_slot = tier.slot_size(written[4][0])
    assert fp8_slot == tier.slot_bytes_for(codecs.fp8_payload_bytes(FMT)) < raw // 2 + 3 * PAGE
    assert tier.slot_size(written[0][0]) == PAGE + raw  # lossless: room for the raw block
    first = {}
    for slot, i, data, c in written:
        out = aligned(len(data))
        got = await tier.read_into_checked(slot, key(i), NS, c, out)
        assert got is not None
        if i < 4:
            assert bytes(out) == data and got == c
        else:  # the decoded form, verified against the checksum taken when it was encoded
            assert bytes(out) == codecs.round_trip(CODEC_FP8, memoryview(data), FMT)
            assert got == block_checksum(out, NS, key(i)) != c
        first[i] = (bytes(out), got)
    await tier.close()
    # Restarted with another default codec: every record still says which codec wrote it.
    tier2, records = await opened(codec="fp8+lz4")
    assert sorted(r.key for r in records) == [key(i) for i in range(8)]
    by_key = {r.key: r for r in records}
    for slot, i, data, _ in written:
        rec = by_key[key(i)]
        assert rec.checksum == first[i][1]  # a lossy record comes back as its decoded form
        out = aligned(len(data))
        assert await tier2.read_into_checked(slot, key(i), NS, rec.checksum, out) == rec.checksum
        assert bytes(out) == first[i][0]
    assert tier2.check().ok


@pytest.mark.parametrize("codec", ["fp8", "fp8+lz4", "lz4"])
async def test_a_corrupt_encoded_record_is_a_miss(opened, tmp_path, codec):
    tier, _ = await opened()
    written = await write_mixed(tier)
    slot, i, data, _ = written[2 * CODEC_NAMES.index(codec) + 1]  # the compressible one
    assert tier.stats()[f"records_{codec.replace('+', '_')}"] >= 1
    await tier.close()
    with open(tmp_path / "nvme" / FILE_NAME, "r+b") as f:
        f.seek(slot + PAGE + 3000)  # inside the scales or the payload
        b = f.read(1)
        f.seek(slot + PAGE + 3000)
        f.write(bytes([b[0] ^ 0x10]))
    tier2, records = await opened()
    rec = next(r for r in records if r.key == key(i))
    out = aligned(len(data))
    assert await tier2.read_into_checked(slot, key(i), NS, rec.checksum, out) is None
    assert tier2.stats()["checksum_failures"] == 1
    report = tier2.check()
    assert [(p.kind, p.key) for p in report.problems] == [("corrupt", key(i))]
    for other_slot, j, _, _ in written:  # the others are intact
        if j != i:
            other = next(r for r in records if r.key == key(j))
            assert await tier2.read_into(other_slot, key(j), NS, other.checksum, out)


async def test_records_of_the_previous_record_version_are_still_read(opened, tmp_path):
    tier, _ = await opened()
    written = await write_mixed(tier)
    old = written[:4]  # none and lz4: all that record version 3 wrote
    headers = {}
    for slot, *_ in old:
        page = tier._io.read_header(slot)
        assert page is not None
        headers[slot] = ondisk.pack_header_v3(page)
    await tier.close()
    with open(tmp_path / "nvme" / FILE_NAME, "r+b") as f:
        for slot, page in headers.items():
            f.seek(slot)
            f.write(page)
    tier2, records = await opened()
    assert len(records) == 8
    for slot, i, data, c in old:
        out = aligned(len(data))
        assert await tier2.read_into(slot, key(i), NS, c, out) and bytes(out) == data
    assert tier2.check().ok


async def test_a_write_whose_payload_cannot_fit_its_slot_is_refused(opened):
    tier, _ = await opened()
    data = bytes(as_bytes(kv_block(6)))
    slot = tier.allocate(codecs.fp8_payload_bytes(FMT))
    c = block_checksum(data, NS, key(1))
    with pytest.raises(ValueError, match="does not fit"):
        await tier.write(slot, key(1), NS, data, c, codec="none")  # room for fp8 only
    with pytest.raises(ValueError, match="does not fit"):  # fp8 without a format is lossless
        await tier.write(slot, key(1), NS, data, c, codec="fp8")
