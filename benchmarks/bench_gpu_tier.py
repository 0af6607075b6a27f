"""The GPU tier and the worker's transfers on a CUDA host, against the device's own copy speeds.

    python benchmarks/bench_gpu_tier.py            # needs CUDA and CuPy
    python benchmarks/bench_gpu_tier.py --blocks 128 --runs 3
    python benchmarks/bench_gpu_tier.py --smoke    # 8 blocks, one timed run; exits 77 without CUDA

A worker holds a paged cache shaped like Llama-3-8B's (32 layers, 8 KV heads, head dim 128,
bf16, 16-token blocks: 2 MiB per block) on the GPU, and moves ``--blocks`` blocks per transfer
through real daemons:

1. offload into the daemon's GPU pool (gather, device to device, across CUDA IPC, + device
   checksums + two RPCs) against one device-to-device ``copy_`` of the same bytes;
2. load from the GPU pool (scatter + checksums + two RPCs) against the same copy;
3. offload into the shared-memory CPU tier (a daemon with the GPU tier off: the gather kernel
   writes the pinned arena across PCIe, then the xxh3 of each slot on the CPU) against a pinned
   ``cudaMemcpy`` device-to-host of the same bytes (the target is >= 80%); and the same without
   the checksums (the copy alone, through the zero-copy reservation views);
4. load from the CPU tier against a pinned host-to-device copy;
5. promotion by ``prefetch``: the daemon copying CPU blocks up into the pool, time until the last
   one is in, against the pinned host-to-device copy.

Every figure is the median of ``--runs`` runs; keys are deleted between runs so every offload
stores new blocks. Prints GB/s (1e9 bytes) and each transfer's ratio to its limit. Every
load is compared with the blocks offloaded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import (
    KVStoreDaemon,
    add_run_args,
    emit,
    expect,
    finish_args,
    print_header,
    run_main,
    skip,
)

from kvstore import KVLayout, KVStoreClient
from kvstore.client import paged_io

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)  # 2 MiB blocks


def timed(fn: Callable[[], object], device: torch.device) -> float:
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def median(
    fn: Callable[[], object],
    runs: int,
    device: torch.device,
    before: Callable[[], object] | None = None,
) -> float:
    times = []
    for _ in range(runs + 1):  # the first run warms up (kernel compile, mappings)
        if before is not None:
            before()
        times.append(timed(fn, device))
    return statistics.median(times[1:])


def device_limits(nbytes: int, runs: int, device: torch.device) -> tuple[float, float, float]:
    """Seconds for one device-to-device, pinned device-to-host and host-to-device copy."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return (
        median(lambda: b.copy_(a), runs, device),
        median(lambda: pinned.copy_(a, non_blocking=True), runs, device),
        median(lambda: a.copy_(pinned, non_blocking=True), runs, device),
    )


Row = tuple[str, float, str, float]


def bench_gpu_pool(
    src: list[torch.Tensor], dst: list[torch.Tensor], daemon_args: list[str], runs: int
) -> tuple[float, float]:
    """Offload into and load from the daemon's GPU pool: seconds per transfer."""
    n, device = src[0].shape[1], src[0].device
    ids = list(range(n))
    with (
        KVStoreDaemon(n * LAYOUT.block_bytes + (256 << 20), extra_args=daemon_args) as daemon,
        KVStoreClient(daemon.address, layout=LAYOUT, model="bench") as kv,
    ):
        keys = kv.hash_tokens(list(range(LAYOUT.block_size * n)))
        mapped = kv._pool_link.device_for(src) is not None
        expect(mapped, "bench_gpu_tier: the client could not map the daemon's GPU pool")
        offload = median(lambda: kv.offload(src, ids, keys), runs, device, lambda: kv.delete(keys))
        load = median(lambda: kv.load(dst, ids, keys), runs, device)
        same = all(torch.equal(x, y) for x, y in zip(src, dst, strict=True))
        expect(same, "bench_gpu_tier: blocks loaded from the GPU pool differ")
    return offload, load


def bench_cpu_tier(
    src: list[torch.Tensor], dst: list[torch.Tensor], runs: int
) -> tuple[float, float, float]:
    """Offload into the CPU tier (and the gather alone), and load from it: seconds."""
    n, device = src[0].shape[1], src[0].device
    ids = list(range(n))
    chunk = paged_io.CHUNK_BLOCKS
    with (
        KVStoreDaemon(n * LAYOUT.block_bytes + (256 << 20), extra_args=["--gpu", "off"]) as daemon,
        KVStoreClient(daemon.address, layout=LAYOUT, model="bench") as kv,
    ):
        keys = kv.hash_tokens(list(range(LAYOUT.block_size * n)))
        offload = median(lambda: kv.offload(src, ids, keys), runs, device, lambda: kv.delete(keys))

        def gather_only() -> None:
            for start in range(0, n, chunk):
                r = kv.reserve(keys[start : start + chunk])
                cids = ids[start : start + chunk]
                paged_io.gather_into_views(src, [cids[i] for i in r.indices], r.views)
                r.abort()

        gather = median(gather_only, runs, device, lambda: kv.delete(keys))
        kv.offload(src, ids, keys)
        for layer in dst:
            layer.zero_()
        load = median(lambda: kv.load(dst, ids, keys), runs, device)
        same = all(torch.equal(x, y) for x, y in zip(src, dst, strict=True))
        expect(same, "bench_gpu_tier: blocks loaded from the CPU tier differ")
    return offload, gather, load


def bench_promotion(src: list[torch.Tensor], daemon_args: list[str], runs: int) -> float:
    """Seconds from a prefetch to the last block of it in the GPU pool."""
    n, device = src[0].shape[1], src[0].device
    ids = list(range(n))
    cpu_src = [t.cpu() for t in src]
    with (
        KVStoreDaemon(n * LAYOUT.block_bytes + (256 << 20), extra_args=daemon_args) as daemon,
        KVStoreClient(daemon.address, layout=LAYOUT, model="bench") as kv,
    ):
        keys = kv.hash_tokens(list(range(LAYOUT.block_size * n)))
        kv._pool_link.device_for(src)  # maps the pool: prefetches then go up into it

        def promoted() -> int:
            return next(t.promotions for t in kv.stats().tiers if t.name == "gpu")

        def prefetch_all() -> None:
            want = promoted() + n
            kv.prefetch(keys)
            deadline = time.monotonic() + 30
            while promoted() < want:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"promoted {promoted()} of {want} blocks in 30 s")
                time.sleep(0.0005)

        def back_to_cpu() -> None:
            kv.delete(keys)
            kv.offload(cpu_src, ids, keys)  # CPU caches: the blocks land in the CPU tier

        return median(prefetch_all, runs, device, back_to_cpu)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    add_run_args(parser)
    parser.add_argument("--blocks", type=int, default=None, help="blocks per transfer (2 MiB)")
    parser.add_argument("--runs", type=int, default=None)
    args = finish_args(parser.parse_args())
    if not torch.cuda.is_available():
        return skip(args, "cuda", "the GPU tier needs a CUDA device")
    import importlib.util

    if importlib.util.find_spec("cupy") is None:
        return skip(args, "module:cupy", "the kernels need CuPy (pip install -e '.[cuda]')")
    device = torch.device("cuda", 0)
    n = args.blocks or (8 if args.smoke else 64 if args.quick else 256)
    runs = args.runs or (1 if args.smoke else 3 if args.quick else 5)
    nbytes = n * LAYOUT.block_bytes
    name = torch.cuda.get_device_name(device)
    if not args.json:
        print_header("bench_gpu_tier", args)
        mib = LAYOUT.block_bytes >> 20
        print(f"{name}; {n} blocks of {mib} MiB = {nbytes >> 20} MiB a transfer")

    shape = (2, n, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    src = [torch.randn(shape, device=device).to(LAYOUT.dtype) for _ in range(LAYOUT.num_layers)]
    dst = [torch.empty_like(t) for t in src]
    d2d, d2h, h2d = device_limits(nbytes, runs, device)
    gpu_args = ["--gpu", "on", "--gpu-capacity", str(nbytes + (256 << 20))]

    offload_gpu, load_gpu = bench_gpu_pool(src, dst, gpu_args, runs)
    offload_cpu, gather_cpu, load_cpu = bench_cpu_tier(src, dst, runs)
    promote = bench_promotion(src, gpu_args, runs)
    rows: list[Row] = [
        ("offload -> GPU pool", offload_gpu, "d2d copy", d2d),
        ("load <- GPU pool", load_gpu, "d2d copy", d2d),
        ("offload -> CPU tier", offload_cpu, "pinned d2h", d2h),
        ("  its gather into the arena alone", gather_cpu, "pinned d2h", d2h),
        ("load <- CPU tier", load_cpu, "pinned h2d", h2d),
        ("prefetch CPU -> GPU pool (daemon)", promote, "pinned h2d", h2d),
    ]
    if not args.json:
        print(f"\n{'transfer':<36} {'GB/s':>8}  {'limit':<11} {'GB/s':>8}  {'ratio':>6}")
        for what, t, limit_name, limit in rows:
            print(
                f"{what:<36} {nbytes / t / 1e9:>8.1f}  {limit_name:<11} "
                f"{nbytes / limit / 1e9:>8.1f}  {limit / t:>5.2f}x"
            )
    emit(
        {
            "device": name,
            "blocks": n,
            "runs": runs,
            "transfers": {
                what: {"gbps": nbytes / t / 1e9, "limit": lname, "ratio": limit / t}
                for what, t, lname, limit in rows
            },
        },
        args,
    )
    return 0


if __name__ == "__main__":
    run_main(main)
