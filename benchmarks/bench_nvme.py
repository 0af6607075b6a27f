"""The NVMe tier against this machine's own disk limits, measured in one run on one filesystem.

Prints one table: ``dd`` O_DIRECT write and read of 2 MiB blocks (the ceiling), the tier's write
and read throughput for 2 MiB blocks with many in flight (as the daemon issues them) and their
ratio to dd (target >= 0.70), small-block write rate, restart (``open``) time of a tier holding
100,000 blocks, the tier's memory per block, and lz4 ratios on bf16 tensors (random normal, and
synthetic ones with the structure of KV caches). Figures are medians of ``--runs`` runs; each
ratio to dd is the median of per-run ratios, dd and the tier measured back to back, because
this disk's speed drifts by up to 1.8x between runs.

Every IO bypasses the page cache (O_DIRECT); the files live under ``--dir`` (default
``var/bench-nvme`` in the repo, the same filesystem the daemon would use) and are removed at the
end. Default run: about 70 seconds and at most ~2.2 GB of disk at a time.

    .venv/bin/python benchmarks/bench_nvme.py [--dir DIR] [--runs 3] [--quick | --smoke] [--json]

Every read is verified by the tier (header and xxh3 of the payload); ``--smoke`` (a few
blocks of each kind) also compares each block read with the one written, byte for byte.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import mmap
import os
import shutil
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import torch
from _harness import add_run_args, dd, emit, expect, finish_args, print_header

from kvstore.checksum import block_checksum
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.nvme.diskio import lz4_compress
from kvstore.tiers.nvme.ondisk import round_up

MiB = 1 << 20
NS = bytes(16)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def arena(count: int, nbytes: int, fill: Callable[[int], bytes]) -> list[memoryview]:
    """``count`` page-aligned, pre-faulted buffers (what CPU-tier slots look like)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    mm = mmap.mmap(-1, count * nbytes, flags=flags)
    view = memoryview(mm)
    bufs = [view[i * nbytes : (i + 1) * nbytes] for i in range(count)]
    for i, b in enumerate(bufs):
        b[:] = fill(i)
    return bufs


# ------------------------------------------------------------------------------- dd


def dd_run(directory: Path, blocks: int) -> tuple[float, float]:
    path = directory / "dd.bin"
    w = dd(["if=/dev/zero", f"of={path}", "bs=2M", f"count={blocks}", "oflag=direct"])
    r = dd([f"if={path}", "of=/dev/null", "bs=2M", "iflag=direct"])
    path.unlink()
    return w, r


# ------------------------------------------------------------------------------- tier
async def pump(n: int, in_flight: int, op: Callable[[int, int], object]) -> float:
    """Run op(i, worker) for i in range(n) with ``in_flight`` workers; seconds taken."""
    it = iter(range(n))

    async def worker(w: int) -> None:
        for i in it:
            await op(i, w)  # type: ignore[misc]

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(in_flight)))
    return time.perf_counter() - t0


async def tier_run(
    directory: Path,
    blocks: int,
    block_bytes: int,
    src: list[memoryview],
    in_flight: int,
    io_threads: int,
    codec: str | None = None,
    compare: bool = False,
) -> tuple[float, float]:
    """Write then read ``blocks`` blocks through a fresh tier: (write GB/s, read GB/s) of raw
    block bytes. ``compare``: each block read is also compared with its source (in the timed
    loop: smoke runs only)."""
    sums = [block_checksum(src[i % len(src)], NS, key(i)) for i in range(blocks)]
    capacity = blocks * NvmeTier.slot_bytes_for(block_bytes) + 64 * MiB
    tdir = directory / "tier"
    tier = NvmeTier(tdir, capacity, codec=codec, io_threads=io_threads, slab_bytes=64 * MiB)
    await tier.open()
    assert tier.direct_io, "O_DIRECT unavailable: the figures would measure the page cache"
    slots = [tier.allocate(block_bytes) for _ in range(blocks)]
    assert all(s is not None for s in slots)

    async def write(i: int, _w: int) -> None:
        await tier.write(slots[i], key(i), NS, src[i % len(src)], sums[i])  # type: ignore[arg-type]

    outs = arena(in_flight, block_bytes, lambda i: bytes(block_bytes))  # pre-faulted

    async def read(i: int, w: int) -> None:
        ok = await tier.read_into(slots[i], key(i), NS, sums[i], outs[w])  # type: ignore[arg-type]
        expect(ok, f"read of block {i} missed")
        if compare:
            expect(outs[w] == src[i % len(src)], f"block {i} read differs from the one written")

    wt = await pump(blocks, in_flight, write)
    rt = await pump(blocks, in_flight, read)
    expect(tier.stats()["misses"] == 0, f"{tier.stats()['misses']} misses")
    await tier.close()
    shutil.rmtree(tdir)
    total = blocks * block_bytes / 1e9
    return total / wt, total / rt


async def restart_run(
    directory: Path, blocks: int, block_bytes: int, in_flight: int, io_threads: int, runs: int
) -> dict[str, float]:
    """Fill a tier with ``blocks`` small blocks, then time open() after a clean close."""
    src = arena(64, block_bytes, lambda i: os.urandom(block_bytes))
    sums = [block_checksum(src[i % 64], NS, key(i)) for i in range(blocks)]
    slab = 256 * MiB
    per_slab = slab // NvmeTier.slot_bytes_for(block_bytes)
    capacity = -(-blocks // per_slab) * slab + 16 * MiB
    tdir = directory / "restart"
    tier = NvmeTier(tdir, capacity, io_threads=io_threads, slab_bytes=slab)
    await tier.open()
    slots = [tier.allocate(block_bytes) for _ in range(blocks)]

    async def write(i: int, _w: int) -> None:
        await tier.write(slots[i], key(i), NS, src[i % 64], sums[i])  # type: ignore[arg-type]

    fill_s = await pump(blocks, in_flight, write)
    await tier.close()
    open_s = []
    for _ in range(runs):
        tier = NvmeTier(tdir, capacity, io_threads=io_threads, slab_bytes=slab)
        t0 = time.perf_counter()
        records = await tier.open()
        open_s.append(time.perf_counter() - t0)
        expect(len(records) == blocks, f"recovered {len(records)} of {blocks}")
        del records
        await tier.close()
    # Memory the tier keeps per block (its slot map and record identities), measured apart.
    gc.collect()
    tracemalloc.start()
    tier = NvmeTier(tdir, capacity, io_threads=io_threads, slab_bytes=slab)
    records = await tier.open()
    del records
    gc.collect()
    mem = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    await tier.close()
    file_bytes = os.stat(tier.path).st_size
    shutil.rmtree(tdir)
    return {
        "fill_blocks_per_s": blocks / fill_s,
        "open_s": statistics.median(open_s),
        "open_s_max": max(open_s),
        "bytes_per_block": mem / blocks,
        "file_gb": file_bytes / 1e9,
    }


# ------------------------------------------------------------------------------- lz4
def kv_like(seed: int, layers: int = 32, heads: int = 8, dim: int = 128, tokens: int = 16):
    """A bf16 block with the structure of a real KV cache (no model is installed here): keys
    with per-channel means and log-normal scales, ~3% outlier channels at 10x, and RoPE
    rotation along the tokens; values with milder per-channel scales. Shape
    (layers, 2, tokens, heads, dim), as kvstore.layout lays a block out."""
    g = torch.Generator().manual_seed(seed)
    k_scale = torch.exp(0.5 * torch.randn(layers, heads, dim, generator=g))
    k_scale = torch.where(torch.rand(layers, heads, dim, generator=g) < 0.03, 10 * k_scale, k_scale)
    k_mean = torch.randn(layers, heads, dim, generator=g) * k_scale
    k = k_mean + 0.3 * k_scale * torch.randn(tokens, layers, heads, dim, generator=g)
    pos = torch.arange(tokens, dtype=torch.float32) + 977 * seed
    freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angle = pos[:, None] * freq[None, :]  # (tokens, dim/2)
    cos, sin = angle.cos()[:, None, None, :], angle.sin()[:, None, None, :]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    k = torch.stack([k1 * cos - k2 * sin, k1 * sin + k2 * cos], dim=-1).flatten(-2)
    v = torch.exp(0.3 * torch.randn(layers, heads, dim, generator=g)) * torch.randn(
        tokens, layers, heads, dim, generator=g
    )
    kv = torch.stack([k, v], dim=0).permute(2, 0, 1, 3, 4)  # (layers, 2, tokens, heads, dim)
    return kv.contiguous().to(torch.bfloat16)


def lz4_rows(blocks: int) -> list[tuple[str, float, float]]:
    """(name, codec ratio raw/compressed, compress GB/s) over ``blocks`` blocks."""
    shape = (32, 2, 16, 8, 128)
    g = torch.Generator().manual_seed(0)
    kinds: dict[str, Callable[[int], torch.Tensor]] = {
        "bf16 random normal": lambda s: torch.randn(shape, generator=g).to(torch.bfloat16),
        "bf16 KV-structured": kv_like,
        "fp8 e4m3 KV-structured": lambda s: (
            kv_like(s).float().clamp(-448, 448).to(torch.float8_e4m3fn)
        ),
        "bf16 KV-structured, byte planes split": lambda s: (
            kv_like(s).view(torch.uint8).reshape(-1, 2).t().contiguous()
        ),
        "bf16 KV, 50% zero tokens (padding)": lambda s: kv_like(s).index_fill_(
            2, torch.arange(8, 16), 0
        ),
    }
    populate = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    dst = memoryview(mmap.mmap(-1, 8 * MiB, flags=populate))  # faulted in: not timed below
    rows = []
    for name, make in kinds.items():
        raw = comp = 0
        secs = 0.0
        for s in range(blocks):
            data = make(s).contiguous().view(torch.uint8).numpy().data.cast("B")
            t0 = time.perf_counter()
            n = lz4_compress(data, dst[: round_up(data.nbytes) + 64 * 1024])
            secs += time.perf_counter() - t0
            raw, comp = raw + data.nbytes, comp + (n or data.nbytes)
        rows.append((name, raw / comp, raw / secs / 1e9))
    return rows


# ------------------------------------------------------------------------------- main
async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=str(Path(__file__).resolve().parents[1] / "var/bench-nvme"))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--blocks", type=int, default=1024, help="2 MiB blocks per throughput run")
    p.add_argument("--in-flight", type=int, default=16)
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--restart-blocks", type=int, default=100_000)
    p.add_argument("--restart-block-bytes", type=int, default=16 * 1024)
    add_run_args(p)
    a = finish_args(p.parse_args())
    small_blocks = 4096
    if a.smoke:
        a.runs, a.blocks, a.restart_blocks, small_blocks = 1, 8, 500, 256
    elif a.quick:
        a.runs, a.blocks, a.restart_blocks = 1, 64, 5000
    if not a.json:
        print_header("bench_nvme", a)
    directory = Path(a.dir)
    directory.mkdir(parents=True, exist_ok=True)
    if directory.resolve().is_relative_to("/dev/shm"):
        sys.exit("--dir must be on the disk, not /dev/shm")
    block = 2 * MiB
    t_start = time.perf_counter()
    try:
        src = arena(32, block, lambda i: os.urandom(block))
        kv_src = arena(32, block, lambda i: bytes(kv_like(i).view(torch.uint8).numpy()))
        dd_w, dd_r, t_w, t_r = [], [], [], []
        for run in range(a.runs):
            # Alternate who goes first: the first writes after a delete (discard) run slower.
            order = ("dd", "tier") if run % 2 == 0 else ("tier", "dd")
            for who in order:
                if who == "dd":
                    w, r = dd_run(directory, a.blocks)
                    dd_w.append(w)
                    dd_r.append(r)
                else:
                    w, r = await tier_run(
                        directory, a.blocks, block, src, a.in_flight, a.io_threads, None, a.smoke
                    )
                    t_w.append(w)
                    t_r.append(r)
        lz_w, lz_r = await tier_run(
            directory, a.blocks // 2, block, kv_src, a.in_flight, a.io_threads, "lz4", a.smoke
        )
        small_src = arena(64, 16384, lambda i: os.urandom(16384))
        small = await tier_run(
            directory, small_blocks, 16384, small_src, a.in_flight * 4, a.io_threads, None, a.smoke
        )
        rs = await restart_run(
            directory,
            a.restart_blocks,
            a.restart_block_bytes,
            a.in_flight * 4,
            a.io_threads,
            a.runs,
        )
        lz = lz4_rows(2 if a.smoke else 8 if a.quick else 32)
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    med = statistics.median
    dw, dr = med(dd_w), med(dd_r)
    ratio_w = med(t / d for t, d in zip(t_w, dd_w, strict=True))
    ratio_r = med(t / d for t, d in zip(t_r, dd_r, strict=True))
    rows = [
        ("dd write 2 MiB O_DIRECT", f"{dw:.2f} GB/s", "1.00", f"runs {_fmt(dd_w)}"),
        ("dd read 2 MiB O_DIRECT", f"{dr:.2f} GB/s", "1.00", f"runs {_fmt(dd_r)}"),
        (
            f"tier write 2 MiB, {a.in_flight} in flight",
            f"{med(t_w):.2f} GB/s",
            f"{ratio_w:.2f}",
            f"runs {_fmt(t_w)}; durable: 2 fdatasync barriers a write, group-committed",
        ),
        (
            f"tier read 2 MiB, {a.in_flight} in flight",
            f"{med(t_r):.2f} GB/s",
            f"{ratio_r:.2f}",
            f"runs {_fmt(t_r)}; header and xxh3 of the payload checked",
        ),
        (
            "tier write, lz4 on, KV-structured",
            f"{lz_w:.2f} GB/s",
            f"{lz_w / dw:.2f}",
            "raw bytes/s, 1 run",
        ),
        ("tier read, lz4 on, KV-structured", f"{lz_r:.2f} GB/s", f"{lz_r / dr:.2f}", "1 run"),
        (
            f"tier write 16 KiB, {a.in_flight * 4} in flight",
            f"{small[0] * 1e9 / 16384:,.0f} blk/s",
            "",
            f"{small[0]:.2f} GB/s; read {small[1] * 1e9 / 16384:,.0f} blk/s",
        ),
        (
            f"restart: open() at {a.restart_blocks:,} blocks",
            f"{rs['open_s']:.2f} s",
            "",
            f"max {rs['open_s_max']:.2f} s; {a.restart_block_bytes // 1024} KiB blocks, "
            f"{rs['file_gb']:.2f} GB file, header scan",
        ),
        (
            "  fill rate for that tier",
            f"{rs['fill_blocks_per_s']:,.0f} blk/s",
            "",
            f"{a.in_flight * 4} in flight",
        ),
        ("  tier memory per block", f"{rs['bytes_per_block']:.0f} B", "", "tracemalloc after open"),
    ]
    rows += [
        (f"lz4 ratio: {name}", f"{ratio:.3f}", "", f"compress {gbs:.2f} GB/s, 1 thread")
        for name, ratio, gbs in lz
    ]
    if not a.json:
        w0 = max(len(r[0]) for r in rows)
        print(f"\n{'measure':<{w0}}  {'value':>14}  {'vs dd':>6}  notes")
        print("-" * (w0 + 40))
        for name, value, ratio, note in rows:
            print(f"{name:<{w0}}  {value:>14}  {ratio:>6}  {note}")
        print(
            f"\n{a.runs} runs, medians; dir {directory}; {time.perf_counter() - t_start:.0f} s "
            "total.\nlz4 ratios are on synthetic tensors with the structure of KV caches."
        )
    emit(
        {
            "runs": a.runs,
            "blocks": a.blocks,
            "dd_gbps": {"write": dd_w, "read": dd_r},
            "tier_gbps": {"write": t_w, "read": t_r},
            "tier_over_dd": {"write": ratio_w, "read": ratio_r},
            "lz4_tier_gbps": {"write": lz_w, "read": lz_r},
            "small_16k_gbps": {"write": small[0], "read": small[1]},
            "restart": rs,
            "lz4_ratios": {name: {"ratio": r, "compress_gbps": g} for name, r, g in lz},
        },
        a,
    )
    return 0


def _fmt(xs: list[float]) -> str:
    return "/".join(f"{x:.2f}" for x in xs)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _harness import run_main  # SIGTERM unwinds too, so the ~2 GB of files are removed

    run_main(lambda: asyncio.run(main()))
