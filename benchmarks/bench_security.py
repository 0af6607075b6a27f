"""What authentication and per-tenant memory cost, and what a shared namespace gains.

1. **Client open time against the tier's size.** A client used to map the whole arena with
   ``MAP_POPULATE`` (its open time and RSS grew with the tier); now it maps nothing until a
   reply names a slab, and then only that slab. Daemons with 1, 8 and 64 GiB CPU tiers (not
   prefaulted, so they fit this machine); per size: the median time to open a client, to
   store and read one block (which maps one slab), and the client's RSS growth.
2. **The hot path.** Lookup of 128 keys (p50, us) and shared-memory put/get of 32 x 2 MiB
   blocks (GB/s), against memcpy in the same run. Run this script once on this tree and once
   on the tree before authentication (``PYTHONPATH=<old tree>``), alternately, and compare the
   ``hot path`` rows: each prints its ratios against the same run's memcpy.
3. **A shared system prompt.** Four tenants send requests made of one 1,024-token system prompt
   and a 256-token question of their own, round robin, against a 64 MiB CPU tier (SmolLM2's
   layout: 360 KiB blocks). Without sharing, each tenant stores its own copy of the prompt's
   KV (four copies compete for the tier); with a shared namespace (the prompt under one tenant
   that the others read) there is one. Per mode: the share of prompt tokens served from the
   store, the store's time per request, and the time to first token that results, with the
   missed tokens' prefill priced at SmolLM2's prefill rate measured in this run (bf16, this
   machine). Every block read back is checked against the one stored.

Usage: ``python benchmarks/bench_security.py [--quick | --smoke] [--json] [--part PART]``
(``open``, ``hot`` or ``shared``; default all three).
``--smoke``: one 1 GiB tier, 4 blocks on the hot path, one round of the workload, its prefill
rate from the tiny random model (``_harness.SMOKE_LLAMA``).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (
    KVStoreDaemon,
    emit,
    expect,
    fmt_size,
    load_model,
    parse_args,
    print_header,
    print_table,
    rss_bytes,
    run_main,
    skip_without_model,
)

from kvstore import KVLayout, KVStoreClient

GiB, MiB = 1 << 30, 1 << 20
BIG = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
SMOL = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16)


def _config(prefault: bool) -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="kvbench-sec-"), "daemon.toml")
    with open(path, "w") as f:
        f.write(f"[cpu]\nprefault = {'true' if prefault else 'false'}\n")
    return path


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ----------------------------------------------------------------- 1. open time
def open_time(sizes: list[int], runs: int) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        with KVStoreDaemon(size, extra_args=["--config", _config(prefault=False)]) as d:
            opens, firsts, rss = [], [], []
            block = torch.zeros(1, *BIG.block_shape, dtype=BIG.dtype)
            for i in range(runs):
                before = rss_bytes()
                t0 = time.perf_counter()
                kv = KVStoreClient(d.address, layout=BIG, model=f"open-{i}")
                t1 = time.perf_counter()
                keys = kv.hash_tokens(list(range(i * 16, i * 16 + 16)))
                kv.put(keys, block)
                kv.get(keys)
                t2 = time.perf_counter()
                rss.append(rss_bytes() - before)
                kv.close()
                opens.append(t1 - t0)
                firsts.append(t2 - t1)
            rows.append(
                {
                    "tier": fmt_size(size),
                    "open_ms": median(opens) * 1e3,
                    "first_put_get_ms": median(firsts) * 1e3,
                    "client_rss_mib": median(rss) / MiB,
                }
            )
    return rows


# ----------------------------------------------------------------- 2. hot path
def hot_path(runs: int, n: int) -> dict[str, float]:
    with KVStoreDaemon(n * 2 * BIG.block_bytes + 64 * MiB) as d:
        kv = KVStoreClient(d.address, layout=BIG, model="hot")
        keys = kv.hash_tokens(list(range(n * 16)))
        blocks = torch.randn(n, *BIG.block_shape).to(BIG.dtype)
        out = torch.empty_like(blocks)
        src = blocks.view(torch.uint8).numpy().reshape(-1)
        dst = np.empty_like(src)
        lookups, puts, gets, copies = [], [], [], []
        lk = kv.hash_tokens(list(range(128 * 16)))
        for r in range(runs):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            copies.append(time.perf_counter() - t0)
            for _ in range(20):
                t0 = time.perf_counter()
                kv.lookup(lk)
                lookups.append(time.perf_counter() - t0)
            kv.delete(keys)
            t0 = time.perf_counter()
            kv.put(keys, blocks)
            puts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            kv.get(keys, out=out)
            gets.append(time.perf_counter() - t0)
            expect(torch.equal(out.view(torch.uint8), blocks.view(torch.uint8)), f"round {r}")
        kv.close()
    nbytes = n * BIG.block_bytes
    memcpy = nbytes / median(copies) / 1e9
    put, get = nbytes / median(puts) / 1e9, nbytes / median(gets) / 1e9
    return {
        "lookup_128_p50_us": median(lookups) * 1e6,
        "memcpy_gbps": memcpy,
        "put_gbps": put,
        "get_gbps": get,
        "put_over_memcpy": put / memcpy,
        "get_over_memcpy": get / memcpy,
    }


# ----------------------------------------------------------------- 3. shared prompt
def prefill_rate(args: Any) -> float:
    """SmolLM2 bf16 prefill, tokens per second, for a 1,024-token prompt on this machine."""
    model, _, _ = load_model(args, torch.bfloat16)
    ids = torch.arange(1024).remainder(model.config.vocab_size).unsqueeze(0)
    with torch.no_grad():
        model(ids[:, :64])  # warm-up
        t0 = time.perf_counter()
        model(ids)
        seconds = time.perf_counter() - t0
    return 1024 / seconds


def shared_workload(shared: bool, rounds: int, rate: float) -> dict[str, Any]:
    tenants = [f"app{i}" for i in range(4)]
    prompt = list(range(1024))
    with KVStoreDaemon(64 * MiB, extra_args=["--config", _config(prefault=True)]) as d:
        clients = {
            t: KVStoreClient(d.address, layout=SMOL, model="smollm2", tenant=t) for t in tenants
        }
        prompt_client = (
            KVStoreClient(d.address, layout=SMOL, model="smollm2", tenant="shared-prompts")
            if shared
            else None
        )
        g = torch.Generator().manual_seed(0)
        stored: dict[tuple[int, bytes], torch.Tensor] = {}  # (client, key) -> block put
        hit_tokens = total_tokens = 0
        store_s: list[float] = []
        ttft: list[float] = []
        for r in range(rounds):
            for i, t in enumerate(tenants):
                kv = clients[t]
                pkv = prompt_client if prompt_client is not None else kv
                question = [50_000 + r * 1000 + i * 300 + j for j in range(256)]
                t0 = time.perf_counter()
                pkeys = pkv.hash_tokens(prompt)
                found = pkv.lookup(pkeys)
                got = pkv.get(pkeys[:found]) if found else None
                missing = pkeys[found:]
                fresh = torch.randn(len(missing), *SMOL.block_shape, generator=g).to(SMOL.dtype)
                if missing:  # computed by the engine, then stored for the next request
                    pkv.put(missing, fresh)
                qkeys = kv.hash_tokens(prompt + question)[len(pkeys) :]
                asked = torch.randn(len(qkeys), *SMOL.block_shape, generator=g).to(SMOL.dtype)
                kv.put(qkeys, asked)
                elapsed = time.perf_counter() - t0
                # Untimed: what was read is what was stored under those keys.
                for j in range(len(got) if got is not None else 0):
                    want = stored[(id(pkv), pkeys[j])]
                    expect(torch.equal(got[j].view(torch.uint8), want.view(torch.uint8)),
                           f"prompt block {j} read back differs")  # fmt: skip
                for key, block in zip(missing, fresh, strict=True):
                    stored[(id(pkv), key)] = block
                store_s.append(elapsed)
                hit_tokens += found * 16
                total_tokens += len(prompt)
                computed = len(prompt) + len(question) - found * 16
                ttft.append(elapsed + computed / rate)
        for kv in clients.values():
            kv.close()
        if prompt_client is not None:
            prompt_client.close()
    return {
        "mode": "shared namespace" if shared else "a copy per tenant",
        "prompt_hit_rate": hit_tokens / total_tokens,
        "store_ms_per_request": median(store_s) * 1e3,
        "ttft_ms_p50": median(ttft) * 1e3,
    }


def main() -> int:
    args = parse_args(
        __doc__.split("\n\n")[0],
        lambda p: (
            p.add_argument("--part", choices=("all", "open", "hot", "shared"), default="all"),
            p.add_argument("--sizes", help="tier sizes for the open-time part, e.g. 1GiB,8GiB"),
        ),
    )
    print_header("bench_security", args)
    result: dict[str, Any] = {}
    if args.part in ("all", "shared"):
        skipped = skip_without_model(args)
        if skipped is not None:
            return skipped
    if args.part in ("all", "open"):
        sizes = (
            [1 * GiB]
            if args.smoke
            else [1 * GiB, 8 * GiB]
            if args.quick
            else [1 * GiB, 8 * GiB, 64 * GiB]
        )
        if args.sizes:
            from kvstore.units import parse_size

            sizes = [parse_size(x) for x in args.sizes.split(",")]
        rows = open_time(sizes, 1 if args.smoke else 3 if args.quick else 7)
        result["open"] = rows
        print_table(
            "client open time against the CPU tier's size (medians)",
            ["tier", "open ms", "first put+get ms", "client RSS growth MiB"],
            [[r["tier"], r["open_ms"], r["first_put_get_ms"], r["client_rss_mib"]] for r in rows],
        )
    if args.part in ("all", "hot"):
        hot = hot_path(1 if args.smoke else 3 if args.quick else 9, 4 if args.smoke else 32)
        result["hot"] = hot
        print_table(
            "hot path (medians; compare with the same script on the tree before)",
            ["lookup 128 keys p50 us", "memcpy GB/s", "put GB/s", "get GB/s", "put/memcpy",
             "get/memcpy"],
            [[hot["lookup_128_p50_us"], hot["memcpy_gbps"], hot["put_gbps"], hot["get_gbps"],
              hot["put_over_memcpy"], hot["get_over_memcpy"]]],
        )  # fmt: skip
    if args.part in ("all", "shared"):
        rate = prefill_rate(args)
        rounds = 1 if args.smoke else 3 if args.quick else 8
        rows = [shared_workload(False, rounds, rate), shared_workload(True, rounds, rate)]
        result["shared"] = {"prefill_tokens_per_s": rate, "modes": rows}
        print_table(
            f"4 tenants, one 1,024-token system prompt, 64 MiB CPU tier "
            f"(SmolLM2 prefill measured at {rate:.0f} tokens/s)",
            ["mode", "prompt tokens from store", "store ms/request", "TTFT p50 ms"],
            [[r["mode"], f"{r['prompt_hit_rate']:.0%}", r["store_ms_per_request"],
              r["ttft_ms_p50"]] for r in rows],
        )  # fmt: skip
        print(f"TTFT with sharing / without: {rows[1]['ttft_ms_p50'] / rows[0]['ttft_ms_p50']:.2f}")
    emit(result, args)
    return 0


if __name__ == "__main__":
    run_main(main)
