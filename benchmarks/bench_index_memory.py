"""Daemon memory per indexed block, at one million blocks.

Two measurements, each in a fresh child process (so one does not inherit the other's heap) and
each taken twice: by ``tracemalloc`` (bytes Python allocated and still holds) and by RSS delta
(what the OS charges, allocator rounding and slack included; no tracemalloc running):

* ``index+lru``: ``kvstore.index.BlockIndex`` and ``make_policy("lru")`` holding N committed
  entries with realistic fields: 32-byte random keys (what SHA-256 chain keys look like), a
  namespace id, a tier, a slot offset, a priority and a random 64-bit checksum, every entry
  inserted in the policy.
* ``BlockStore``: the real daemon store (``kvstore.daemon.store.BlockStore``) filled through its
  own protocol, ``reserve`` of 128 packed-then-unpacked keys (as the servicer does) and
  ``commit`` with checksums. Its CPU arena is sized for N 4 KiB slots but not pre-faulted: the
  store never touches slot bytes on this path, so the sparse file costs no memory and only the
  store's own structures are counted (slab allocator included). No store hook is needed.

Not counted above, and reported separately: the page tables that map the shared-memory arena.
The daemon maps (and pre-faults) the whole arena with 4 KiB pages, 8 bytes of page table per
page per process, so 2 KiB per MiB of arena, i.e. per block 1/512 of its size (4 KiB for a
2 MiB block). Measured from a real daemon's ``VmPTE``.

Target: < 256 bytes per indexed block (the RSS figure of ``BlockStore`` is the one that counts).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
import tracemalloc
from array import array
from typing import Any

from _harness import (
    KVStoreDaemon,
    Reporter,
    emit,
    in_process_store,
    maybe_await,
    parse_args,
    print_header,
    rss_bytes,
    run_main,
    verdict,
)

TARGET_BYTES = 256
MODES = ("index+lru", "BlockStore")
METHODS = ("rss", "tracemalloc")
BATCH = 128


# --------------------------------------------------------------------------- child side
def fill_index(n: int) -> tuple[Any, Any]:
    from kvstore.index import BlockIndex
    from kvstore.policy import make_policy

    index = BlockIndex()
    policy = make_policy("lru")
    rand = os.urandom
    for i in range(n):
        eid = index.add(rand(32), 1, 1, 4096 + i * 4096, 0)
        index.commit(eid, int.from_bytes(rand(8), "little"))
        policy.insert(eid, 0)
    return index, policy


def store_config(n: int) -> Any:
    from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig

    # n 4 KiB slots, plus a slab of slack; sparse (prefault off): no page is touched.
    cpu = CpuTierConfig(capacity_bytes=n * 4096 + (64 << 20), prefault=False)
    return DaemonConfig(gpu=GpuTierConfig(enabled="off"), cpu=cpu)


async def fill_store(store: Any, n: int) -> None:
    from kvstore.keys import Namespace, unpack_keys
    from kvstore.layout import KVLayout

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB
    ns = store.open_namespace(Namespace(model="bench-index-memory", layout=layout)).ns_id
    rand = os.urandom
    done = 0
    keys: list[bytes] = []
    while done < n:
        k = min(BATCH, n - done)
        keys = unpack_keys(rand(32 * k))  # what the servicer hands the store
        rid, offsets, _ = await maybe_await(store.reserve(ns, keys))
        if not rid or min(offsets) < 0:
            raise RuntimeError("reserve did not reserve every new key")
        store.commit(rid, [int.from_bytes(rand(8), "little") for _ in range(k)])
        done += k
    if len(store.index) != n or await maybe_await(store.lookup(ns, keys)) != len(keys):
        raise RuntimeError(f"store holds {len(store.index)} entries, expected {n}")


def _arrays_of(obj: Any) -> tuple[int, list[str]]:
    """Bytes and names of the typed arrays an object holds (one level of nesting)."""
    total, names = 0, []
    for name, value in vars(obj).items():
        if isinstance(value, array | bytearray):
            total += sys.getsizeof(value)
            names.append(name)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            sub, sub_names = _arrays_of(value)
            total += sub
            names += [f"{name}.{x}" for x in sub_names]
    return total, names


def breakdown(index: Any, policy: Any) -> dict[str, Any]:
    """``sys.getsizeof`` of each structure (requested sizes, no allocator rounding)."""
    parts: dict[str, Any] = {}
    for name, value in vars(index).items():
        if isinstance(value, dict):
            parts[f"index.{name} dict"] = sys.getsizeof(value)
            parts["key bytes objects"] = sum(sys.getsizeof(k) for k in value)
            parts["entry id int objects"] = sum(
                sys.getsizeof(v) for v in value.values() if isinstance(v, int) and v > 256
            )
        elif isinstance(value, list):
            parts[f"index.{name} list"] = sys.getsizeof(value)
    arrays, array_names = _arrays_of(index)
    parts["index field arrays"] = arrays
    queue, queue_names = _arrays_of(policy)
    parts["lru policy arrays"] = queue
    parts["_names"] = {"index field arrays": array_names, "lru policy arrays": queue_names}
    return parts


async def child_async(mode: str, method: str, n: int) -> dict[str, Any]:
    async with contextlib.AsyncExitStack() as stack:
        store = None
        if mode == "BlockStore":
            store = await stack.enter_async_context(in_process_store(store_config(n)))
        gc.collect()
        if method == "tracemalloc":
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
        else:
            base = rss_bytes()
        t0 = time.perf_counter()
        if store is not None:
            await fill_store(store, n)
            index, policy = store.index, store.policy
        else:
            index, policy = fill_index(n)
        fill_s = time.perf_counter() - t0
        gc.collect()
        if method == "tracemalloc":
            used = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
        else:
            used = rss_bytes() - base
        result: dict[str, Any] = {"mode": mode, "method": method, "n": n, "bytes": used}
        result["fill_s"] = fill_s
        if method == "rss":
            result["breakdown"] = breakdown(index, policy)
        return result


def child(mode: str, method: str, n: int) -> dict[str, Any]:
    # Import everything first: module objects are not per-block memory.
    import kvstore.daemon.store
    import kvstore.keys
    import kvstore.policy

    del kvstore
    return asyncio.run(child_async(mode, method, n))


# --------------------------------------------------------------------------- parent side
def run_child(mode: str, method: str, n: int) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, method, str(n)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"child {mode}/{method} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def arena_page_tables(capacity: int) -> dict[str, int]:
    """Page tables of a real daemon's arena mapping: the ``VmPTE`` of a daemon with a
    ``capacity`` arena minus that of one with a 64 MiB arena, for ``capacity - 64 MiB``."""
    base = 64 << 20
    pte = {}
    for cap in (base, capacity):
        with KVStoreDaemon(cap) as d:
            pte[cap] = _vm_field(d.pid, "VmPTE")
    return {"arena_bytes": capacity - base, "pte_bytes": pte[capacity] - pte[base]}


def _vm_field(pid: int, name: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {name} for pid {pid}")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=None, help="indexed blocks (default 1000000)")
    p.add_argument("--child", nargs=3, metavar=("MODE", "METHOD", "N"), help=argparse.SUPPRESS)


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0], add_args)
    if args.child:
        mode, method, n = args.child
        print(json.dumps(child(mode, method, int(n))))
        return 0
    n = args.blocks or (100_000 if args.quick else 1_000_000)
    rep = Reporter(args.json)
    if not args.json:
        print_header("bench_index_memory", args)
        rep.line(f"  {n} blocks; each measurement in a fresh process")
    results: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        for method in METHODS:
            results[f"{mode}/{method}"] = run_child(mode, method, n)

    rows = []
    for mode in MODES:
        rss = results[f"{mode}/rss"]
        tm = results[f"{mode}/tracemalloc"]
        rows.append([mode, rss["bytes"] / n, tm["bytes"] / n, rss["bytes"] / 2**20, rss["fill_s"]])
    rep.table(
        f"Memory per indexed block at {n} blocks",
        ["structures", "RSS B/block", "tracemalloc B/block", "RSS MiB", "fill s"],
        rows,
    )

    parts = dict(results["BlockStore/rss"]["breakdown"])
    names = parts.pop("_names")
    total = sum(parts.values())
    brows: list[list[Any]] = [[k, v / n, 100 * v / total] for k, v in parts.items()]
    brows.append(["sum", total / n, 100.0])
    rep.table(
        "Where it goes (BlockStore, sys.getsizeof: requested sizes, before allocator rounding)",
        ["structure", "B/block", "%"],
        brows,
    )
    for label, fields in names.items():
        rep.line(f"  {label}: {', '.join(fields)}")

    cap = (256 if args.quick else 1024) << 20
    pte = arena_page_tables(cap)
    per_mib = pte["pte_bytes"] / (pte["arena_bytes"] >> 20)
    rep.table(
        f"Not in the index: page tables of the daemon's arena mapping (VmPTE, {cap >> 20} MiB)",
        ["block size", "B/block", "note"],
        [
            ["64 KiB", per_mib / 16, "per mapping process (daemon and each client)"],
            ["512 KiB", per_mib / 2, ""],
            ["2 MiB", per_mib * 2, ""],
        ],
    )
    rep.line(f"  {per_mib:.0f} bytes of page table per MiB of arena")

    value = results["BlockStore/rss"]["bytes"] / n
    status = verdict(value < TARGET_BYTES)
    rep.table(
        "Target",
        ["target", "value", "needed", "status"],
        [["BlockStore RSS per indexed block", value, f"< {TARGET_BYTES}", status]],
    )
    emit(
        {
            "benchmark": "index_memory",
            "blocks": n,
            "bytes_per_block": {k: v["bytes"] / n for k, v in results.items()},
            "breakdown_bytes_per_block": {k: v / n for k, v in parts.items()},
            "arena_page_tables": {**pte, "bytes_per_mib": per_mib},
            "target": {"max_bytes": TARGET_BYTES, "value": value, "status": status},
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    run_main(main)
