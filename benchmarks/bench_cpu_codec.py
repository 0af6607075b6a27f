"""A ``cpu = "fp8"`` namespace against a lossless one, through one real daemon: the bytes that
cross the host boundary per block, and paged offload / load throughput.

    python benchmarks/bench_cpu_codec.py [--quick | --smoke] [--json] [--blocks N] [--rounds R]

Both namespaces use the same SmolLM2-135M-shaped layout (30 layers, 3 KV heads, head_dim 64,
16-token blocks: 360 KiB of bf16 per block) and a CPU paged cache. Each round offloads the
same N blocks under fresh keys into each namespace, then loads them into a fresh cache, the two
namespaces alternating so that a drifting load falls on both; medians over the rounds.

What a CPU run measures. "Bytes across the host boundary" is what a paged offload writes into
the shared-memory slots (and a load reads from them): on a CUDA cache the kernels move exactly
these bytes across PCIe (the fp8 gather quantizes on the device, the scatter dequantizes there),
so the payload / block ratio is the PCIe figure. It is a ratio of bytes, not a measured PCIe
transfer: no GPU here. The throughputs are of the CPU path, where the quantizer is the kernels'
torch reference on the host (and every offload also decodes each payload once for its
decoded-form checksum): on this CPU fp8 costs time; it is the GPU path whose copies it halves.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import KVStoreDaemon, Reporter, emit, expect, parse_args, print_header, run_main

from kvstore import KVLayout, KVStoreClient
from kvstore.tiers import codecs

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)
FP8_MODEL, RAW_MODEL = "bench-fp8-cpu", "bench-lossless"


def config_text() -> str:
    return f'[[codecs]]\nmodel = "{FP8_MODEL}"\ncpu = "fp8"\n'


def cache(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, n, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [torch.randn(shape, generator=g).to(LAYOUT.dtype) for _ in range(LAYOUT.num_layers)]


def block_bytes(caches: list[torch.Tensor], i: int) -> bytes:
    """Block ``i`` of a paged cache, laid out as the store keeps it."""
    block = torch.stack([c[:, i] for c in caches])  # (layers, 2, block_size, heads, dim)
    return block.contiguous().view(torch.uint8).numpy().tobytes()


def check_loaded(model: str, src: list[torch.Tensor], dst: list[torch.Tensor], n: int) -> None:
    """Every loaded block is the offloaded one: the same bytes for the lossless namespace, the
    bytes an fp8 round trip gives for the fp8 one."""
    fmt = codecs.block_format_of(LAYOUT)
    for i in range(n):
        want = block_bytes(src, i)
        if model == FP8_MODEL:
            want = codecs.round_trip(codecs.codec_id("fp8"), memoryview(want), fmt)
        expect(block_bytes(dst, i) == want, f"{model}: block {i} loaded differs from the stored")


def main() -> int:
    def extra(p):
        p.add_argument("--blocks", type=int, default=64)
        p.add_argument("--rounds", type=int, default=5)

    args = parse_args(__doc__.splitlines()[0], extra)
    n, rounds = (4, 1) if args.smoke else (16, 2) if args.quick else (args.blocks, args.rounds)
    out = Reporter(args.json)
    if not args.json:
        print_header("bench_cpu_codec", args)
    block = LAYOUT.block_bytes
    payload = codecs.fp8_payload_bytes(codecs.block_format_of(LAYOUT))
    fd, cfg = tempfile.mkstemp(suffix=".toml")
    with os.fdopen(fd, "w") as f:
        f.write(config_text())
    capacity = 4 * (rounds + 1) * n * block + (64 << 20)
    src = cache(n, 1)
    ids = list(range(n))
    times: dict[str, dict[str, list[float]]] = {
        m: {"offload": [], "load": []} for m in (FP8_MODEL, RAW_MODEL)
    }
    try:
        with KVStoreDaemon(capacity, extra_args=["--config", cfg]) as d:
            clients = {
                m: KVStoreClient(d.address, layout=LAYOUT, model=m) for m in (FP8_MODEL, RAW_MODEL)
            }
            try:
                for r in range(rounds):
                    for m, kv in clients.items():
                        keys = kv.hash_tokens(list(range(r * 10**6, r * 10**6 + n * 16)))
                        t0 = time.perf_counter()
                        assert kv.offload(src, ids, keys) == n
                        t1 = time.perf_counter()
                        dst = [torch.empty_like(c) for c in src]
                        t2 = time.perf_counter()
                        assert kv.load(dst, ids, keys) == n
                        t3 = time.perf_counter()
                        times[m]["offload"].append(t1 - t0)
                        times[m]["load"].append(t3 - t2)
                        if args.smoke or r == rounds - 1:  # untimed
                            check_loaded(m, src, dst, n)
                stats = clients[FP8_MODEL].stats()
                cpu = next(t for t in stats.tiers if t.name == "cpu")
            finally:
                for kv in clients.values():
                    kv.close()
    finally:
        os.unlink(cfg)
    load = os.getloadavg()
    out.line(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {n} blocks x {rounds}")
    out.table(
        "Bytes across the host boundary per block (the PCIe bytes of a CUDA cache)",
        ["namespace", "bytes per block", "of the block"],
        [
            [RAW_MODEL, block, "1.00x"],
            [FP8_MODEL + ' (cpu = "fp8")', payload, f"{payload / block:.3f}x"],
        ],
    )
    out.line(
        f"CPU tier (Stats) after the run: logical {cpu.logical_bytes} bytes, stored "
        f"{cpu.stored_bytes} bytes ({cpu.stored_bytes / cpu.logical_bytes:.3f}x)"
    )
    rows = []
    gbs: dict[str, dict[str, float]] = {}
    for m in (RAW_MODEL, FP8_MODEL):
        off = statistics.median(times[m]["offload"])
        ld = statistics.median(times[m]["load"])
        gbs[m] = {"offload": n * block / off / 1e9, "load": n * block / ld / 1e9}
        rows.append([m, f"{gbs[m]['offload']:.3f}", f"{gbs[m]['load']:.3f}"])
    ratio_off = statistics.median(times[RAW_MODEL]["offload"]) / statistics.median(
        times[FP8_MODEL]["offload"]
    )
    ratio_ld = statistics.median(times[RAW_MODEL]["load"]) / statistics.median(
        times[FP8_MODEL]["load"]
    )
    rows.append(["fp8 / lossless", f"{ratio_off:.3f}x", f"{ratio_ld:.3f}x"])
    out.table(
        "Paged offload / load of a CPU cache, logical GB/s (medians; CPU: torch reference "
        "quantizer)",
        ["namespace", "offload GB/s", "load GB/s"],
        rows,
    )
    emit(
        {
            "blocks": n,
            "rounds": rounds,
            "block_bytes": block,
            "fp8_payload_bytes": payload,
            "cpu_tier": {"logical_bytes": cpu.logical_bytes, "stored_bytes": cpu.stored_bytes},
            "gbps": gbs,
            "fp8_over_lossless": {"offload": ratio_off, "load": ratio_ld},
        },
        args,
    )
    return 0


if __name__ == "__main__":
    run_main(main)
