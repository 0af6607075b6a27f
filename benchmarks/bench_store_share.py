"""The store's share of a cached prompt's time to first token: ``lookup`` + ``load`` of 120 blocks.

``bench_ttft`` serves 2048-token prompts whose first 1920 tokens (120 blocks of 16) are cached;
the worker then asks the store ``lookup(keys)`` and ``load(kv_caches, ids, keys)`` of those 120
blocks before its prefill of the suffix (``kvstore.worker.engine``). This times exactly those two
calls, without the models, for the two KV layouts ``bench_ttft`` uses: SmolLM2-135M (30 layers x
3 KV heads x 64, 360 KiB blocks) and Llama-3.2-1B (16 x 8 x 64, 512 KiB blocks), bf16, into a
CPU ``PagedKVCache``, with a real daemon. Loads rotate over 4 caches (240 MiB for Llama) so no
copy is cache-hot; ``memcpy`` is one ``np.copyto`` of the same bytes between pre-faulted
buffers, for the ratio. Medians of ``--reps`` of each, interleaved.

Only public API: the same script times any revision of the client (``bench_client_ab.py``).

``--smoke``: a 16-block prefix, 2 repetitions; every load still checked, the figures mean
nothing (the test suite runs it so).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from _harness import KVStoreDaemon, Reporter, emit, parse_args, print_header, run_main

from kvstore import KVLayout, KVStoreClient, PagedKVCache

PREFIX_BLOCKS = 120
LAYOUTS = {
    "smollm2-135m": KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16),
    "llama-3.2-1b": KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, block_size=16),
}
ROTATE = 4


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reps", type=int, default=None, help="timed lookup+load pairs per layout")


def same_blocks(dst: PagedKVCache, src: PagedKVCache, n: int) -> bool:
    pairs = zip(dst.kv_caches, src.kv_caches, strict=True)
    return all(torch.equal(a[:, :n], b[:, :n]) for a, b in pairs)


def measure(name: str, layout: KVLayout, reps: int, n: int, check_all: bool) -> dict[str, float]:
    """Timings of ``reps`` lookup + load pairs of an ``n``-block prefix. The last load is
    checked against the blocks offloaded; with ``check_all`` every load is (untimed)."""
    nbytes = n * layout.block_bytes
    with (
        KVStoreDaemon(max((64 if check_all else 256) << 20, 2 * nbytes)) as daemon,
        KVStoreClient(daemon.address, layout=layout, model=name) as kv,
    ):
        keys = kv.hash_tokens(torch.arange((n + 8) * layout.block_size))  # 8 more: not stored
        src = PagedKVCache(layout, n + 1)
        for cache in src.kv_caches:
            cache.copy_(torch.randn(cache.shape).to(layout.dtype))
        ids = list(range(n))
        if kv.offload(src.kv_caches, ids, keys[:n]) != n:
            raise RuntimeError("could not store the prefix")
        caches = [PagedKVCache(layout, n + 1) for _ in range(ROTATE)]
        for c in caches:
            for t in c.kv_caches:
                t.fill_(1)  # faulted in
        mem_src = np.full(nbytes, 3, dtype=np.uint8)
        mem_dst = [np.zeros(nbytes, dtype=np.uint8) for _ in range(ROTATE)]
        out: dict[str, list[float]] = {"lookup": [], "load": [], "store": [], "memcpy": []}
        for rep in range(reps + 2):  # the first two warm up
            c = caches[rep % ROTATE]
            t0 = time.perf_counter()
            found = kv.lookup(keys)
            t1 = time.perf_counter()
            loaded = kv.load(c.kv_caches, ids, keys[:found])
            t2 = time.perf_counter()
            np.copyto(mem_dst[rep % ROTATE], mem_src)
            t3 = time.perf_counter()
            if found != n or loaded != n:
                raise RuntimeError(f"lookup found {found}, load loaded {loaded} of {n}")
            if check_all and not same_blocks(c, src, n):
                raise RuntimeError("load did not restore the blocks")
            if rep >= 2:
                out["lookup"].append(t1 - t0)
                out["load"].append(t2 - t1)
                out["store"].append(t2 - t0)
                out["memcpy"].append(t3 - t2)
        if not same_blocks(c, src, n):
            raise RuntimeError("load did not restore the blocks")
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0], add_args)
    reps = args.reps or (2 if args.smoke else 20 if args.quick else 60)
    blocks = 16 if args.smoke else PREFIX_BLOCKS
    rep = Reporter(args.json)
    if not args.json:
        print_header("bench_store_share", args)
    results = {
        name: measure(name, layout, reps, blocks, args.smoke) for name, layout in LAYOUTS.items()
    }
    rep.table(
        f"lookup + load of {blocks} blocks (ms, median of {reps})",
        ["layout", "lookup", "load", "store share", "memcpy", "store / memcpy"],
        [
            [name, r["lookup"] * 1e3, r["load"] * 1e3, r["store"] * 1e3, r["memcpy"] * 1e3,
             r["store"] / r["memcpy"]]
            for name, r in results.items()
        ],
    )  # fmt: skip
    emit({"blocks": blocks, "reps": reps, "s": results}, args)
    return 0


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    run_main(main)
