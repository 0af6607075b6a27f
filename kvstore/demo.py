"""``kvstore demo``: the daemon plus a realistic synthetic workload through the client.

Starts ``kvstore serve`` on the embedded default config (a private socket in a temporary
directory), replays a multi-tenant chat workload shaped like Llama-3-8B KV traffic (every
tenant has a long system prompt; conversations grow turn by turn, so each request shares a
prefix with earlier ones), prints a report and stops the daemon with SIGTERM.

Each request does what a serving engine does: hash the prompt into block keys, ``lookup`` the
cached prefix, ``get`` it into a preallocated staging tensor, "compute" the rest (here: take
blocks from a pool of random KV blocks) and ``put`` the new full blocks. Every block read back is
compared byte for byte with what was stored under its key.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from kvstore.client import KVStoreClient
from kvstore.client._common import wait_for_daemon
from kvstore.layout import KVLayout
from kvstore.stats_table import render_stats, stats_to_dict
from kvstore.units import format_size

LLAMA3_8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)


@dataclass
class Conversation:
    tenant: int
    tokens: list[int]


@dataclass
class Report:
    requests: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    stored_blocks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    get_s: float = 0.0
    put_s: float = 0.0
    lookup_s: list[float] = field(default_factory=list)
    mismatches: int = 0


def _progress(done: int, total: int, report: Report, started: float) -> None:
    if not sys.stderr.isatty() and done % max(1, total // 10) and done != total:
        return  # a log file gets ten lines, a terminal a live bar
    width = 30
    full = int(width * done / total)
    rate = report.hit_blocks / report.prompt_blocks if report.prompt_blocks else 0.0
    sys.stderr.write(
        ("\r" if sys.stderr.isatty() else "\n")
        + f"  [{'█' * full}{'░' * (width - full)}] {done}/{total} requests  "
        f"hit rate {100 * rate:5.1f}%  {time.monotonic() - started:5.1f}s"
    )
    sys.stderr.flush()


def run_workload(
    address: str,
    tenants: int,
    conversations: int,
    turns: int,
    system_tokens: int,
    turn_tokens: int,
    seed: int = 0,
    progress: bool = True,
) -> Report:
    rng = random.Random(seed)
    layout = LLAMA3_8B
    pool = torch.randn((64, *layout.block_shape), dtype=torch.float32).to(layout.dtype)
    system_prompts = [
        [rng.randrange(128_000) for _ in range(system_tokens)] for _ in range(tenants)
    ]
    convs = [
        Conversation(t % tenants, list(system_prompts[t % tenants])) for t in range(conversations)
    ]
    schedule = [c for c in range(conversations) for _ in range(turns)]
    rng.shuffle(schedule)
    max_blocks = (system_tokens + turns * turn_tokens * 2) // layout.block_size + 1
    staging = torch.empty((max_blocks, *layout.block_shape), dtype=layout.dtype)
    report = Report()
    started = time.monotonic()
    with KVStoreClient(address, layout=layout, model="meta-llama/Llama-3-8B") as kv:
        for n, c in enumerate(schedule):
            conv = convs[c]
            conv.tokens += [rng.randrange(128_000) for _ in range(turn_tokens)]  # the user turn
            keys = kv.hash_tokens(conv.tokens)
            t0 = time.perf_counter()
            cached = kv.lookup(keys)
            report.lookup_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = kv.get(keys[:cached], out=staging)
            report.get_s += time.perf_counter() - t0
            # A block's content is a function of its key, so any byte that comes back can be
            # checked against what was stored.
            for i in range(got.shape[0]):
                expected = pool[keys[i][0] % len(pool)]
                if not torch.equal(got[i].view(torch.uint8), expected.view(torch.uint8)):
                    report.mismatches += 1
            new = keys[got.shape[0] :]
            blocks = pool[torch.tensor([k[0] % len(pool) for k in new], dtype=torch.long)]
            t0 = time.perf_counter()
            stored = kv.put(new, blocks)
            report.put_s += time.perf_counter() - t0
            conv.tokens += [rng.randrange(128_000) for _ in range(turn_tokens)]  # the reply
            report.requests += 1
            report.prompt_blocks += len(keys)
            report.hit_blocks += got.shape[0]
            report.stored_blocks += stored
            report.bytes_read += got.shape[0] * layout.block_bytes
            report.bytes_written += stored * layout.block_bytes
            if progress:
                _progress(n + 1, len(schedule), report, started)
        if progress:
            sys.stderr.write("\n")
        stats = kv.stats()
    print_report(report, stats, time.monotonic() - started)
    return report


def print_report(report: Report, stats: object, elapsed_s: float) -> None:
    lookups = sorted(report.lookup_s)
    p50 = lookups[len(lookups) // 2] * 1e3 if lookups else 0.0
    hit = report.hit_blocks / report.prompt_blocks if report.prompt_blocks else 0.0
    print()
    print(
        f"workload: {report.requests} requests in {elapsed_s:.1f}s, Llama-3-8B layout "
        f"({format_size(LLAMA3_8B.block_bytes)} per 16-token block)"
    )
    print(f"  prompt blocks        {report.prompt_blocks:>10}")
    print(f"  served from store    {report.hit_blocks:>10}   prefix hit rate {100 * hit:.1f}%")
    print(f"  newly stored         {report.stored_blocks:>10}")
    gb_read = report.bytes_read / report.get_s / 1e9 if report.get_s else 0.0
    gb_written = report.bytes_written / report.put_s / 1e9 if report.put_s else 0.0
    print(f"  get throughput       {gb_read:>10.2f} GB/s  ({format_size(report.bytes_read)})")
    print(f"  put throughput       {gb_written:>10.2f} GB/s  ({format_size(report.bytes_written)})")
    print(f"  lookup latency p50   {p50:>10.2f} ms")
    print(f"  byte mismatches      {report.mismatches:>10}")
    print()
    print(render_stats(stats_to_dict(stats)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--turn-tokens", type=int, default=160)
    p.add_argument("--cpu-capacity", default=None, help="override the default config's CPU tier")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        address = f"unix:{os.path.join(tmp, 'kv.sock')}"
        cmd = [sys.executable, "-m", "kvstore", "serve", "--address", address]
        if args.cpu_capacity:
            cmd += ["--cpu-capacity", args.cpu_capacity]
        print(f"starting daemon: {' '.join(cmd[1:])}", file=sys.stderr)
        daemon = subprocess.Popen(cmd)
        try:
            wait_for_daemon(address, timeout_s=60, proc=daemon)
            report = run_workload(
                address,
                args.tenants,
                args.conversations,
                args.turns,
                args.system_tokens,
                args.turn_tokens,
                progress=not args.no_progress,
            )
        finally:
            daemon.send_signal(signal.SIGTERM)
            code = daemon.wait(30)
        print(f"\ndaemon stopped (exit {code})")
    return 0 if report.mismatches == 0 and code == 0 else 1
