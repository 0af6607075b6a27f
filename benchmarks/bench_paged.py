"""Paged KV cache: memory saved by paging and by block sharing, and kernel throughput against the
machine's own copy speed.

    python benchmarks/bench_paged.py          # CPU: memory waste, sharing, gather/scatter vs memcpy
    python benchmarks/bench_paged.py --cuda   # also: kernels vs device copies, paged attention
    python benchmarks/bench_paged.py --smoke  # every part at tiny sizes, (d) on CUDA if present

(a) Waste of contiguous max-length allocation vs paging, on lognormal prompt and output lengths
    capped at the model's 4096 tokens, measured by running the requests through PagedKVCache.
(b) Blocks saved by fork() for parallel sampling (n=4: one prompt, four divergent outputs).
(c) CPU gather/scatter/copy_blocks against a plain torch copy_ of the same bytes between
    preallocated buffers. Sources and destinations rotate over a working set far larger than the
    last-level cache, so neither side is cache-hot. Medians of several runs.
(d) --cuda: kernels against a device-to-device copy; gather into pinned host memory (zero-copy)
    against a pinned cudaMemcpy; paged attention against dense SDPA on the same K/V.

Every run also checks what the kernels wrote (untimed, on random blocks): gather, scatter and
copy_blocks against indexing, and paged attention against SDPA within bf16/fp16 rounding. The
result goes to ``--json`` / ``--json-out`` as well as the tables.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import add_run_args, emit, expect, finish_args, fmt_size, print_header, run_main

from kvstore import kernels
from kvstore.layout import KVLayout
from kvstore.paged import PagedKVCache

MAX_MODEL_LEN = 4096
MIB = 1 << 20
ATTENTION_TOLERANCE = 0.05  # max |paged - dense| in bf16/fp16 outputs of unit-scale inputs
QUIET = False  # --json: the tables are not printed


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    if QUIET:
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def request_lengths(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths, lognormal (medians 600 and 200 tokens), capped so that
    prompt + output <= MAX_MODEL_LEN."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(np.log(600), 1.0, n).astype(int), 1, MAX_MODEL_LEN - 1)
    output = np.clip(rng.lognormal(np.log(200), 0.9, n).astype(int), 1, None)
    output = np.minimum(output, MAX_MODEL_LEN - prompt)
    return prompt, output


def tiny_cache(num_blocks: int, block_size: int = 16) -> PagedKVCache:
    # Block accounting does not depend on the tensor sizes: keep the tensors tiny.
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=block_size)
    return PagedKVCache(layout, num_blocks)


def bench_memory_waste(num_requests: int, batch: int, max_tokens: int) -> list[list[str]]:
    prompt, output = request_lengths(num_requests, seed=0)
    used = int((prompt + output).sum())
    rows = []
    contiguous = num_requests * MAX_MODEL_LEN
    rows.append(["contiguous, max model length", f"{contiguous}", f"{1 - used / contiguous:.1%}"])
    reserved = int(np.minimum(prompt + max_tokens, MAX_MODEL_LEN).sum())
    rows.append([f"contiguous, prompt + max_tokens={max_tokens}", f"{reserved}", ""])
    rows[-1][2] = f"{1 - used / reserved:.1%}"
    for block_size in (16, 32):
        cache = tiny_cache(batch * (MAX_MODEL_LEN // block_size), block_size)
        allocated = 0
        for start in range(0, num_requests, batch):
            ids = range(start, min(start + batch, num_requests))
            for i in ids:
                cache.add_sequence(i, [0] * int(prompt[i]))
                cache.append_tokens(i, int(output[i]))  # decode, as a count of tokens
            allocated += cache.stats().num_in_use * block_size
            for i in ids:
                cache.free(i)
        rows.append(
            [f"paged, block_size={block_size}", f"{allocated}", f"{1 - used / allocated:.1%}"]
        )
    table(
        f"(a) KV memory waste, {num_requests} requests, {used / num_requests:.0f} tokens each on "
        f"average (lognormal, capped at {MAX_MODEL_LEN})",
        ["allocation", "token slots", "waste"],
        rows,
    )
    return rows


def bench_parallel_sampling(num_requests: int, n: int, batch: int) -> dict[str, int]:
    prompt, _ = request_lengths(num_requests, seed=1)
    rng = np.random.default_rng(2)
    bs = 16
    separate = shared = 0
    cache = tiny_cache(batch * n * (MAX_MODEL_LEN // bs + 1))
    for start in range(0, num_requests, batch):
        seqs = []
        for r in range(start, min(start + batch, num_requests)):
            p = int(prompt[r])
            outs = np.minimum(rng.lognormal(np.log(200), 0.9, n).astype(int) + 1, MAX_MODEL_LEN - p)
            separate += sum(-(-(p + int(o)) // bs) for o in outs)
            cache.add_sequence((r, 0), [0] * p)
            for j in range(1, n):
                cache.fork((r, 0), (r, j))
            for j in range(n):
                cache.append_tokens((r, j), int(outs[j]))
                seqs.append((r, j))
        shared += cache.stats().num_in_use
        for s in seqs:
            cache.free(s)
    table(
        f"(b) parallel sampling n={n}, {num_requests} prompts, block_size={bs}",
        ["allocation", "blocks", "saved"],
        [
            ["n separate sequences", f"{separate}", ""],
            [
                "fork(): shared prompt blocks + copy-on-write tail",
                f"{shared}",
                f"{1 - shared / separate:.1%}",
            ],
        ],
    )
    return {"separate_blocks": separate, "shared_blocks": shared}


def interleaved_medians(fns: list[Callable[[int], None]], runs: int) -> list[float]:
    """Median time of each callable. Each run times every callable once, in turn, so a change
    in machine load (shared cores) shifts all of them alike and the ratios hold."""
    for fn in fns:
        fn(0)  # warm up: page faults, allocator
    times: list[list[float]] = [[] for _ in fns]
    for i in range(runs):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn(i + 1)
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def check_kernels(device: torch.device, num_blocks: int, n: int) -> None:
    """gather_blocks, scatter_blocks and copy_blocks write what indexing says they should, on
    random blocks of a small paged cache on ``device`` (untimed)."""
    layers = 3
    layout = KVLayout(num_layers=layers, num_kv_heads=2, head_dim=16, block_size=16)
    g = torch.Generator().manual_seed(5)
    shape = (2, num_blocks, 16, 2, 16)
    caches = [torch.randn(shape, generator=g).to(layout.dtype).to(device) for _ in range(layers)]
    perm = torch.randperm(num_blocks, generator=g)
    ids, others = perm[:n].to(device), perm[n : 2 * n].to(device)

    def block(cs: list[torch.Tensor], b: int) -> torch.Tensor:
        return torch.stack([c[:, b] for c in cs])

    out = torch.empty((n, *layout.block_shape), dtype=layout.dtype, device=device)
    kernels.gather_blocks(caches, ids, out)
    for j in range(n):
        expect(torch.equal(out[j], block(caches, int(ids[j]))), f"gather_blocks: block {j}")
    dst = [torch.zeros_like(c) for c in caches]
    kernels.scatter_blocks(out, dst, others)
    for j in range(n):
        expect(torch.equal(block(dst, int(others[j])), out[j]), f"scatter_blocks: block {j}")
    before = [c.clone() for c in caches]
    kernels.copy_blocks(caches, ids, others)
    for j in range(n):
        same = torch.equal(block(caches, int(others[j])), block(before, int(ids[j])))
        expect(same, f"copy_blocks: block {j}")


def bench_cpu_copies(layers: int, num_blocks: int, n: int, runs: int) -> list[list[str]]:
    layout = KVLayout(num_layers=layers, num_kv_heads=8, head_dim=128, block_size=16)
    dtype, bshape = layout.dtype, layout.block_shape
    caches = [torch.empty(2, num_blocks, 16, 8, 128, dtype=dtype) for _ in range(layers)]
    for i, c in enumerate(caches):
        c.fill_(i + 1)  # touch every page: untouched memory reads as one shared zero page
    nbytes = n * layout.block_bytes
    slots = 4
    outs = [torch.full((n, *bshape), 1.0, dtype=dtype) for _ in range(slots)]
    arena = torch.full((slots * n, *bshape), 1.0, dtype=dtype)
    out_lists = [[arena[s * n + i] for i in range(n)] for s in range(slots)]
    cache_bytes = layers * caches[0].numel() * caches[0].element_size()
    srcs = [torch.full((nbytes,), 1, dtype=torch.uint8) for _ in range(cache_bytes // nbytes)]
    dsts = [torch.empty(nbytes, dtype=torch.uint8).fill_(2) for _ in range(slots)]
    rng = np.random.default_rng(3)
    picks = [rng.permutation(num_blocks)[: 2 * n] for _ in range(runs + 1)]
    ids = [torch.from_numpy(p[:n]).long() for p in picks]
    others = [torch.from_numpy(p[n:]).long() for p in picks]

    def memcpy(i: int) -> None:
        dsts[i % slots].copy_(srcs[i % len(srcs)])

    cases: list[tuple[str, Callable[[int], None]]] = [
        ("memcpy (torch copy_, same bytes)", memcpy),
        ("gather -> one tensor", lambda i: kernels.gather_blocks(caches, ids[i], outs[i % slots])),
        (
            "gather -> list of block tensors",
            lambda i: kernels.gather_blocks(caches, ids[i], out_lists[i % slots]),
        ),
        (
            "scatter <- one tensor",
            lambda i: kernels.scatter_blocks(outs[i % slots], caches, ids[i]),
        ),
        (
            "scatter <- list of block tensors",
            lambda i: kernels.scatter_blocks(out_lists[i % slots], caches, ids[i]),
        ),
        ("copy_blocks (copy-on-write)", lambda i: kernels.copy_blocks(caches, ids[i], others[i])),
    ]
    medians = interleaved_medians([fn for _, fn in cases], runs)
    base = nbytes / medians[0] / 1e9
    rows = []
    for (name, _), t in zip(cases, medians, strict=True):
        gbps = nbytes / t / 1e9
        rows.append([name, f"{t * 1e3:.2f}", f"{gbps:.2f}", f"{gbps / base:.2f}"])
    table(
        f"(c) CPU, {n} blocks of {fmt_size(layout.block_bytes)} ({layers} layers x 8 heads x 128 "
        f"x 16 tokens, bf16) per call, cache {cache_bytes // MIB} MiB, "
        f"{torch.get_num_threads()} thread(s), median of {runs} interleaved runs",
        ["operation", "ms", "GB/s", "vs memcpy"],
        rows,
    )
    return rows


class DeviceTimer:
    """Median wall time of a callable on a device: CUDA events there, perf_counter elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[int], object], runs: int) -> float:
        fn(0)
        times = []
        for i in range(runs):
            if self.cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn(i + 1)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn(i + 1)
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def bench_device_copies(
    device: torch.device, scale: int, runs: int, pin: bool
) -> tuple[float, list[list[str]]]:
    """Kernels against the device's own copies; returns the D2D copy bandwidth (GB/s).
    ``scale`` shrinks sizes for a CPU smoke run, which also cannot pin memory. Kernel calls
    skip the id checks (check=False): on device ids they sync the host, and the idle gap would
    count in the event timing."""
    timer = DeviceTimer(device)
    layers, num_blocks, n = 32, 2048 // scale, 256 // scale
    layout = KVLayout(num_layers=layers, num_kv_heads=8, head_dim=128, block_size=16)
    dtype, bshape = layout.dtype, layout.block_shape
    caches = [
        torch.randn(2, num_blocks, 16, 8, 128, device=device).to(dtype) for _ in range(layers)
    ]
    cache_mib = layers * caches[0].numel() * caches[0].element_size() // MIB
    nbytes = n * layout.block_bytes
    rng = np.random.default_rng(4)
    picks = [rng.permutation(num_blocks)[: 2 * n] for _ in range(runs + 1)]
    ids = [torch.from_numpy(p[:n]).to(device) for p in picks]
    others = [torch.from_numpy(p[n:]).to(device) for p in picks]
    slots = 4
    # Every buffer is written once up front, so no timed call pays for first-touch page faults.
    dev_out = [torch.ones(n, *bshape, dtype=dtype, device=device) for _ in range(slots)]
    dev_src = [torch.ones(nbytes, dtype=torch.uint8, device=device) for _ in range(slots)]
    dev_dst = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(slots)]

    def host(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dt)
        return t.pin_memory().fill_(1) if pin else t.fill_(1)

    host_out = [host((n, *bshape), dtype) for _ in range(2)]
    host_bytes = [host((nbytes,), torch.uint8) for _ in range(2)]

    cases: list[tuple[str, Callable[[int], object], bool]] = [
        ("device copy_ (D2D memcpy)", lambda i: dev_dst[i % slots].copy_(dev_src[i % slots]), True),
        (
            "gather_blocks -> device",
            lambda i: kernels.gather_blocks(caches, ids[i], dev_out[i % slots], check=False),
            False,
        ),
        (
            "scatter_blocks <- device",
            lambda i: kernels.scatter_blocks(dev_out[i % slots], caches, others[i], check=False),
            False,
        ),
        (
            "copy_blocks",
            lambda i: kernels.copy_blocks(caches, ids[i], others[i], check=False),
            False,
        ),
        (
            "pinned D2H memcpy (copy_)",
            lambda i: host_bytes[i % 2].copy_(dev_src[i % slots], non_blocking=True),
            True,
        ),
        (
            "gather_blocks -> pinned host",
            lambda i: kernels.gather_blocks(caches, ids[i], host_out[i % 2], check=False),
            False,
        ),
        (
            "pinned H2D memcpy (copy_)",
            lambda i: dev_dst[i % slots].copy_(host_bytes[i % 2], non_blocking=True),
            True,
        ),
        (
            "scatter_blocks <- pinned host",
            lambda i: kernels.scatter_blocks(host_out[i % 2], caches, others[i], check=False),
            False,
        ),
    ]
    rows = []
    base = d2d = 0.0
    for name, fn, is_baseline in cases:
        t = timer(fn, runs)
        gbps = nbytes / t / 1e9
        base = gbps if is_baseline else base
        d2d = d2d or gbps
        rows.append([name, f"{t * 1e3:.3f}", f"{gbps:.1f}", f"{gbps / base:.2f}"])
    table(
        f"(d) {device}: {n} blocks of {layout.block_bytes // MIB} MiB per call, cache {cache_mib} "
        f"MiB, median of {runs}; each ratio is against the memcpy above it",
        ["operation", "ms", "GB/s", "vs memcpy"],
        rows,
    )
    return d2d, rows


def attention_case(
    device: torch.device, dtype: torch.dtype, scale: int, runs: int, d2d_gbps: float
) -> list[str]:
    """Paged attention against dense SDPA over the same K/V laid out contiguously."""
    timer = DeviceTimer(device)
    seqs, seq_len, heads, heads_kv, head_dim, bs = 64 // scale, 2048 // scale, 32, 8, 128, 16
    per_seq = seq_len // bs
    k = torch.randn(seqs, heads_kv, seq_len, head_dim, device=device).to(dtype)
    v = torch.randn_like(k)
    q = torch.randn(seqs, heads, head_dim, device=device).to(dtype)
    perm = torch.randperm(seqs * per_seq, device=device)
    cache = torch.empty(2, seqs * per_seq, bs, heads_kv, head_dim, device=device, dtype=dtype)
    for i, dense_kv in enumerate((k, v)):
        blocks = dense_kv.reshape(seqs, heads_kv, per_seq, bs, head_dim).permute(0, 2, 3, 1, 4)
        cache[i, perm] = blocks.reshape(-1, bs, heads_kv, head_dim)
    tables = perm.reshape(seqs, per_seq).to(torch.int32)
    lens = torch.full((seqs,), seq_len, dtype=torch.int32, device=device)
    sm_scale = head_dim**-0.5

    def paged(_: int = 0) -> torch.Tensor:
        return kernels.paged_attention(q, cache, tables, lens, sm_scale, check=False)

    def dense(_: int = 0) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=sm_scale, enable_gqa=True)
        return out[:, :, 0]

    err = (paged().float() - dense().float()).abs().max().item()
    expect(err < ATTENTION_TOLERANCE, f"paged attention ({dtype}) differs from SDPA by {err}")
    t_paged, t_dense = timer(paged, runs), timer(dense, runs)
    kv_gbps = 2 * k.numel() * k.element_size() / t_paged / 1e9
    return [
        str(dtype).removeprefix("torch."),
        f"{seqs} x {seq_len}",
        f"{t_paged * 1e3:.3f}",
        f"{t_dense * 1e3:.3f}",
        f"{t_dense / t_paged:.2f}",
        f"{kv_gbps:.0f}",
        f"{kv_gbps / d2d_gbps:.2f}",
        f"{err:.1e}",
    ]


def bench_device(device: torch.device, scale: int, runs: int, pin: bool) -> dict[str, Any]:
    check_kernels(device, 64, 8)
    d2d, copies = bench_device_copies(device, scale, runs, pin)
    rows = [attention_case(device, dt, scale, runs, d2d) for dt in (torch.bfloat16, torch.float16)]
    table(
        "(d) paged attention (32 q heads, 8 kv heads, head_dim 128, block_size 16) vs dense SDPA "
        "on contiguous K/V; K/V GB/s against the D2D copy",
        [
            "dtype",
            "seqs x tokens",
            "paged ms",
            "dense ms",
            "dense/paged",
            "K/V GB/s",
            "vs D2D",
            "max |diff|",
        ],
        rows,
    )
    return {"device": str(device), "scale": scale, "copies": copies, "attention": rows}


def main() -> int:
    global QUIET
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(parser)
    parser.add_argument("--cuda", action="store_true", help="also run the GPU measurements")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per case (median)")
    parser.add_argument("--layers", type=int, default=16, help="layers of the CPU copy benchmark")
    parser.add_argument("--cache-mib", type=int, default=None, help="CPU cache size, >> L3")
    parser.add_argument("--blocks-per-call", type=int, default=32)
    parser.add_argument(
        "--device-smoke",
        action="store_true",
        help="run the --cuda measurements on CPU at 1/16 size, to check the script itself",
    )
    args = finish_args(parser.parse_args())
    QUIET = args.json
    runs = args.runs or (2 if args.smoke else 3 if args.quick else 9)
    cache_mib = args.cache_mib or (16 if args.smoke else 128 if args.quick else 512)
    layers, per_call = (2, 8) if args.smoke else (args.layers, args.blocks_per_call)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if not args.json:
        print_header("bench_paged", args)
    t0 = time.perf_counter()
    result: dict[str, Any] = {}
    requests = 500 if args.smoke else 20000
    result["memory_waste"] = bench_memory_waste(requests, batch=64 if args.smoke else 256,
                                                max_tokens=2048)  # fmt: skip
    result["parallel_sampling"] = bench_parallel_sampling(
        num_requests=100 if args.smoke else 2000, n=4, batch=32 if args.smoke else 128
    )
    check_kernels(torch.device("cpu"), 64, 8)
    block_mib = layers * 2 * 16 * 8 * 128 * 2 / MIB
    cache_blocks = int(cache_mib / block_mib)
    if cache_blocks < 2 * per_call:  # copy_blocks pairs per_call sources with as many targets
        sys.exit(f"--cache-mib {cache_mib} holds {cache_blocks} blocks; (c) needs {2 * per_call}")
    result["cpu_copies"] = bench_cpu_copies(layers, cache_blocks, per_call, runs)
    cuda = torch.cuda.is_available()
    if args.cuda and not cuda:
        sys.exit("--cuda: no CUDA device")
    devices = []
    if args.cuda:
        devices.append(bench_device(torch.device("cuda"), scale=1, runs=runs, pin=True))
    elif args.smoke and cuda:  # the device part at a tiny size, where there is a device
        devices.append(bench_device(torch.device("cuda"), scale=64, runs=runs, pin=True))
    if args.device_smoke or (args.smoke and not cuda):
        scale = 64 if args.smoke else 16
        devices.append(bench_device(torch.device("cpu"), scale=scale, runs=runs, pin=False))
    result["device"] = devices
    if not args.json:
        print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    emit(result, args)
    return 0


if __name__ == "__main__":
    run_main(main)
