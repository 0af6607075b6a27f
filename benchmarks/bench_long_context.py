"""A 128K-token prefix of a Llama-3-8B-shaped layout through the CPU and NVMe tiers, bf16 and fp8.

Layout: 32 layers, 8 KV heads, head_dim 128, 16-token blocks in bf16: 2 MiB a block, 8,192
blocks (16 GiB) for 131,072 tokens. For each NVMe codec (``none``, then ``fp8``) a real daemon
(``kvstore serve``, CPU tier ``--cpu-gib``, an NVMe tier sized to hold the whole prefix in that
codec) takes the prefix from one client in batches of ``--batch`` blocks (the CPU tier holds a
quarter of it, so most blocks go to disk through write-back), is stopped gracefully (dirty
blocks drained to disk) and restarted, so everything is read back from the NVMe tier:

* lookup time of the 8,192 keys (one RPC; median of 5), after the restart;
* read throughput: the client ``get``s the prefix in order (``out=`` a staging tensor), asking
  the daemon to ``prefetch`` the next batch while it reads one, against ``dd`` reading the same
  slab file with O_DIRECT in the same run (2 MiB reads);
* the daemon's memory (VmRSS, of which RssShmem is the CPU tier's shared arena, prefaulted at
  start, and RssAnon the daemon's own) after the restart and after the read;
* what fp8 changes: bytes on disk, write and read time, and (checked) that every block read
  back is the fp8 codec's decoding of what was written.

The blocks' values are synthetic (``torch.randn`` in bf16, 64 distinct blocks cycled under
8,192 distinct keys): the figures here are of sizes and speeds, which do not depend on the
values for these codecs; codec ratios and quality on real KV are in ``bench_tier_codecs.py``.

    .venv/bin/python benchmarks/bench_long_context.py [--tokens 131072] [--quick] [--json]

A block read back that is not what was written, a key the lookup does not find or a checksum
failure is exit status 1. ``--smoke``: a 1,024-token prefix (64 blocks) through a 64 MiB CPU
tier, every block read back checked.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _harness import (
    KVStoreDaemon,
    Reporter,
    dd,
    emit,
    expect,
    parse_args,
    print_header,
    run_main,
)

from kvstore import KVLayout, KVStoreClient
from kvstore.tiers import codecs
from kvstore.tiers.codecs import block_format_of
from kvstore.tiers.nvme import FILE_NAME, NvmeTier

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30
LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
DISTINCT = 64


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=None, help="prefix length (default 131072)")
    p.add_argument("--cpu-gib", type=float, default=None, help="CPU tier size (default 4)")
    p.add_argument("--batch", type=int, default=None, help="blocks per put / get (default 64)")
    p.add_argument("--dir", default=str(REPO / "var"), help="parent of the NVMe tier's dir")
    p.add_argument("--codecs", default="none,fp8", help="NVMe codecs to run, in order")


def memory(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                out[key] = int(line.split()[1]) * 1024
    return out


def run_codec(
    codec: str, directory: Path, keys_tokens: list[int], blocks: torch.Tensor, args: Any
) -> dict[str, Any]:
    n = len(keys_tokens) // LAYOUT.block_size
    fmt = block_format_of(LAYOUT)
    payload = NvmeTier(directory, 1 << 30).payload_bytes_for(LAYOUT.block_bytes, codec, fmt)
    slot = NvmeTier.slot_bytes_for(payload)
    # Whole 256 MiB slabs for every block, one spare, and the metadata pages.
    per_slab = (256 << 20) // slot
    capacity = (-(-n // per_slab) + 2) * (256 << 20)
    config = directory.parent / f"{codec}.toml"
    config.write_text(
        f'[daemon]\ndrain_timeout_s = 600\n[nvme]\npath = "{directory}"\n'
        f'capacity = {capacity}\ncodec = "{codec}"\n'
        "[limits]\nwrite_wait_s = 60\n"
    )
    cpu = int(args.cpu_gib * GiB)
    daemon_args = ["--config", str(config)]
    res: dict[str, Any] = {"codec": codec, "blocks": n, "nvme_capacity": capacity}
    batch = args.batch
    with KVStoreDaemon(cpu, extra_args=daemon_args, ready_timeout_s=300, grace_s=900) as d:
        with KVStoreClient(
            d.address, layout=LAYOUT, model="llama-3-8b-shaped", timeout_s=600
        ) as kv:
            keys = kv.hash_tokens(keys_tokens)
            t0 = time.perf_counter()
            for i in range(0, n, batch):
                idx = [j % DISTINCT for j in range(i, min(n, i + batch))]
                kv.put(keys[i : i + batch], blocks[idx])
            res["write_s"] = time.perf_counter() - t0
            res["mem_after_write"] = memory(d.pid)
        t0 = time.perf_counter()
        d.stop()  # graceful: dirty blocks are drained to disk
        res["stop_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        d.start()
        res["restart_s"] = time.perf_counter() - t0
        res["mem_after_restart"] = memory(d.pid)
        staging = torch.empty((batch, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
        with KVStoreClient(
            d.address, layout=LAYOUT, model="llama-3-8b-shaped", timeout_s=600
        ) as kv:
            lookups = []
            for _ in range(5):
                t0 = time.perf_counter()
                found = kv.lookup(keys)
                lookups.append(time.perf_counter() - t0)
            res["lookup_found"] = found
            res["lookup_s"] = statistics.median(lookups)
            expected = {}
            for j in range(DISTINCT):
                raw = blocks[j].contiguous().view(torch.uint8).numpy().reshape(-1)
                if codec == "none":
                    expected[j] = bytes(raw)
                else:
                    expected[j] = codecs.round_trip(codecs.codec_id(codec), memoryview(raw), fmt)
            mismatches = 0
            t0 = time.perf_counter()
            kv.prefetch(keys[:batch])
            for i in range(0, n, batch):
                if i + batch < n:
                    kv.prefetch(keys[i + batch : i + 2 * batch])
                got = kv.get(keys[i : i + batch], out=staging)
                if got.shape[0] != min(batch, n - i):
                    raise RuntimeError(f"{codec}: only {got.shape[0]} blocks at {i}")
                # One block of each batch, a different one each time (every one with --smoke).
                checked = range(got.shape[0]) if args.smoke else [(i // batch) % got.shape[0]]
                for k in checked:
                    back = bytes(got[k].view(torch.uint8).numpy().reshape(-1))
                    if back != expected[(i + k) % DISTINCT]:
                        mismatches += 1
            res["read_s"] = time.perf_counter() - t0
            res["mismatches"] = mismatches
            res["mem_after_read"] = memory(d.pid)
            nvme = next(t for t in kv.stats().tiers if t.name == "nvme")
            res["nvme_used"] = nvme.used_bytes
            res["nvme_logical"] = nvme.logical_bytes
            res["promotions"] = nvme.promotions
            res["checksum_failures"] = nvme.checksum_failures
    path = directory / FILE_NAME
    count = min(2048, max(1, res["nvme_used"] // (2 << 20)))
    res["dd_gbs"] = dd([f"if={path}", "of=/dev/null", "bs=2M", f"count={count}", "iflag=direct"])
    return res


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0], add_args)
    tokens = args.tokens or (1024 if args.smoke else 8192 if args.quick else 131072)
    if args.cpu_gib is None:
        args.cpu_gib = 1 / 16 if args.smoke else 4.0
    if args.batch is None:
        args.batch = 8 if args.smoke else 64
    rep = Reporter(args.json)
    if not args.json:
        print_header("bench_long_context", args)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    blocks = torch.randn((DISTINCT, *LAYOUT.block_shape), generator=g).to(LAYOUT.dtype)
    token_ids = list(range(tokens))
    parent = Path(args.dir)
    parent.mkdir(parents=True, exist_ok=True)
    results = []
    for codec in args.codecs.split(","):
        tmp = Path(tempfile.mkdtemp(prefix="bench-long-", dir=parent))
        try:
            results.append(run_codec(codec, tmp / "nvme", token_ids, blocks, args))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    n = tokens // LAYOUT.block_size
    logical = n * LAYOUT.block_bytes
    rows = []
    for r in results:
        rows.append(
            [
                r["codec"],
                r["nvme_used"] / GiB,
                r["write_s"],
                logical / r["write_s"] / 1e9,
                r["stop_s"],
                r["restart_s"],
                r["lookup_s"] * 1e3,
                r["read_s"],
                logical / r["read_s"] / 1e9,
                r["dd_gbs"],
                r["mismatches"],
            ]
        )
    rep.table(
        f"{tokens:,}-token prefix, Llama-3-8B layout: {n:,} blocks, {logical / GiB:.0f} GiB bf16; "
        f"CPU tier {args.cpu_gib:g} GiB",
        [
            "nvme codec",
            "on disk GiB",
            "write s",
            "write GB/s",
            "drain+stop s",
            "restart s",
            f"lookup {n} keys ms",
            "read s",
            "read GB/s (logical)",
            "dd O_DIRECT GB/s",
            "bad blocks",
        ],
        rows,
    )
    mem_rows = []
    for r in results:
        for when in ("mem_after_write", "mem_after_restart", "mem_after_read"):
            m = r[when]
            mem_rows.append(
                [
                    r["codec"],
                    when[4:].replace("_", " "),
                    m.get("VmRSS", 0) / GiB,
                    m.get("RssShmem", 0) / GiB,
                    m.get("RssAnon", 0) / (1 << 20),
                    m.get("VmHWM", 0) / GiB,
                ]
            )
    rep.table(
        "daemon memory",
        ["nvme codec", "when", "VmRSS GiB", "RssShmem GiB (arena)", "RssAnon MiB", "VmHWM GiB"],
        mem_rows,
    )
    emit({"tokens": tokens, "blocks": n, "results": results}, args)
    for r in results:
        expect(r["mismatches"] == 0, f"{r['codec']}: {r['mismatches']} blocks read back differ")
        expect(r["lookup_found"] == n, f"{r['codec']}: lookup found {r['lookup_found']} of {n}")
        expect(r["checksum_failures"] == 0, f"{r['codec']}: {r['checksum_failures']} failures")
    return 0


if __name__ == "__main__":
    run_main(main)
