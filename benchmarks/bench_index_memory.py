"""Daemon memory per indexed block, at one million blocks.

Three measurements of N committed blocks:

* ``index+lru``: ``kvstore.index.BlockIndex`` and ``make_policy("lru")`` holding N committed
  entries with realistic fields: 32-byte random keys (what SHA-256 chain keys look like), a
  namespace id, a tier, a slot offset, a priority and a random 64-bit checksum, every entry
  inserted in the policy.
* ``BlockStore``: the real daemon store (``kvstore.daemon.store.BlockStore``) filled through its
  own protocol, ``reserve`` of 128 packed-then-unpacked keys (as the servicer does) and
  ``commit`` with checksums. Its CPU arena is sized for N 4 KiB slots but not pre-faulted: the
  store never touches slot bytes on this path, so the sparse file costs no memory and only the
  store's own structures are counted (slab allocator included).
* ``daemon``: a real ``kvstore serve`` process filled by a real client (``KVStoreClient.put`` of
  128 blocks of 4 KiB a call, random keys), measured from outside: the growth of its resident
  memory (``/proc/PID/smaps``) but for the arena's slabs (block bytes, not index), split into
  private memory (the Python heap) and files, plus the presence tables (memfds same-host clients
  map; their pages do not show in the daemon's resident set, so they are counted whole, by their
  allocated pages; the client maps its namespace's table before and after the fill, as an
  engine's client keeps it). The first and last batches are then looked up and read back byte
  for byte, and the CPU tier must count every block.

The first two run each in a fresh child process (so one does not inherit the other's heap),
each twice: by ``tracemalloc`` (bytes Python allocated and still holds; its allocation sites
are the breakdown by code line) and by RSS delta (what the OS charges, allocator rounding and
slack included; no tracemalloc running). A structural breakdown (``sys.getsizeof`` of the
index's dicts, key objects, typed arrays, the policy's arrays) goes with the RSS one.

Not counted above, and reported separately: the page tables that map the shared-memory arena
(``VmPTE`` of the daemon with an N-block arena against one with a 64 MiB arena). The arena is
mapped with huge pages where the kernel's ``shmem_enabled`` allows, else with 4 KiB pages (8
bytes of page table per page per mapping process: 1/512 of the block size per block).

Target: < 256 bytes per indexed block (the ``daemon`` figure is the one that counts).
``--smoke`` runs every part at 2,000 blocks, the children in this process.
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
    expect,
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
SITES = 12  # allocation sites reported
SMOKE_BLOCKS = 2000


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


def block_state(store: Any) -> tuple[Any, Any]:
    """The store's block index and CPU eviction policy (kept by its ledger where it has one)."""
    owner = getattr(store, "ledger", store)
    return owner.index, owner.policy


def cpu_slots_of(store: Any) -> Any:
    """The store's CPU tier (``CpuSlots``: which entry holds which slot)."""
    return getattr(store, "ledger", store).cpu_slots


async def fill_store(store: Any, n: int) -> None:
    from kvstore.keys import Namespace, unpack_keys
    from kvstore.layout import KVLayout

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB
    handle = store.open_namespace(Namespace(model="bench-index-memory", layout=layout))
    rand = os.urandom
    done = 0
    keys: list[bytes] = []
    while done < n:
        k = min(BATCH, n - done)
        keys = unpack_keys(rand(32 * k))  # what the servicer hands the store
        reserved = await maybe_await(store.reserve(handle, keys))
        expect(
            bool(reserved.reservation_id) and min(reserved.offsets) >= 0,
            "reserve did not reserve every new key",
        )
        checksums = [int.from_bytes(rand(8), "little") for _ in range(k)]
        store.commit(handle, reserved.reservation_id, checksums)
        done += k
    index, _ = block_state(store)
    expect(len(index) == n, f"store holds {len(index)} entries, expected {n}")
    found = await maybe_await(store.lookup(handle, keys))
    expect(found == len(keys), f"lookup found {found} of the last {len(keys)} keys")


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


def _key_maps(value: dict[Any, Any]) -> list[dict[Any, Any]]:
    """The key -> entry id dicts of an index attribute: itself, or its per-namespace dicts."""
    if value and all(isinstance(v, dict) for v in value.values()):
        return list(value.values())
    return [value]


def breakdown(index: Any, policy: Any, cpu_slots: Any = None) -> dict[str, Any]:
    """``sys.getsizeof`` of each structure (requested sizes, no allocator rounding). A key's
    bytes object is shared by its dict slot and the index's key list: counted once. With
    ``cpu_slots``, the CPU tier's slot owner arrays too."""
    parts: dict[str, Any] = {}
    for name, value in vars(index).items():
        if isinstance(value, dict):
            maps = _key_maps(value)
            nested = maps[0] is not value
            parts[f"index.{name} dicts"] = sys.getsizeof(value) + (
                sum(sys.getsizeof(m) for m in maps) if nested else 0
            )
            parts["key bytes objects"] = sum(sys.getsizeof(k) for m in maps for k in m)
            # ints above 256 are objects of their own (CPython caches -5..256)
            parts["entry id int objects"] = sum(
                sys.getsizeof(v) for m in maps for v in m.values() if isinstance(v, int) and v > 256
            )
        elif isinstance(value, list):
            parts[f"index.{name} list"] = sys.getsizeof(value)
    arrays, array_names = _arrays_of(index)
    parts["index field arrays"] = arrays
    queue, queue_names = _arrays_of(policy)
    parts["lru policy arrays"] = queue
    if cpu_slots is not None:
        parts["cpu tier slot owner arrays"] = cpu_slots.owner_bytes()
    parts["_names"] = {"index field arrays": array_names, "lru policy arrays": queue_names}
    return parts


def _site(stat: Any) -> str:
    frame = stat.traceback[0]
    parts = frame.filename.split(os.sep)
    for root in ("kvstore", "tiers", "benchmarks"):
        if root in parts:
            parts = parts[len(parts) - 1 - parts[::-1].index(root) :]
            break
    else:
        parts = parts[-2:]
    return f"{'/'.join(parts)}:{frame.lineno}"


async def child_async(mode: str, method: str, n: int) -> dict[str, Any]:
    async with contextlib.AsyncExitStack() as stack:
        store = None
        if mode == "BlockStore":
            store = await stack.enter_async_context(in_process_store(store_config(n)))
        gc.collect()
        if method == "tracemalloc":
            tracemalloc.start()
            before = tracemalloc.take_snapshot()
            base = tracemalloc.get_traced_memory()[0]
        else:
            base = rss_bytes()
        t0 = time.perf_counter()
        slots = None
        if store is not None:
            await fill_store(store, n)
            index, policy = block_state(store)
            slots = cpu_slots_of(store)
        else:
            index, policy = fill_index(n)
        fill_s = time.perf_counter() - t0
        gc.collect()
        result: dict[str, Any] = {"mode": mode, "method": method, "n": n, "fill_s": fill_s}
        if method == "tracemalloc":
            result["bytes"] = tracemalloc.get_traced_memory()[0] - base
            diff = tracemalloc.take_snapshot().compare_to(before, "lineno")
            tracemalloc.stop()
            result["sites"] = [[_site(s), s.size_diff] for s in diff[:SITES] if s.size_diff > 0]
        else:
            result["bytes"] = rss_bytes() - base
            result["breakdown"] = breakdown(index, policy, slots)
        return result


def child(mode: str, method: str, n: int) -> dict[str, Any]:
    # Import everything first: module objects are not per-block memory.
    import kvstore.daemon.store
    import kvstore.keys
    import kvstore.policy

    del kvstore
    return asyncio.run(child_async(mode, method, n))


# --------------------------------------------------------------------------- parent side
def run_child(mode: str, method: str, n: int, in_process: bool) -> dict[str, Any]:
    """One measurement in a fresh process (in this one with ``in_process``: smoke runs)."""
    if in_process:
        return child(mode, method, n)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, method, str(n)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"child {mode}/{method} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _status(pid: int) -> dict[str, int]:
    """The ``/proc/PID/status`` fields in kB, as bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            fields = rest.split()
            if len(fields) == 2 and fields[1] == "kB":
                out[name] = int(fields[0]) * 1024
    return out


RSS_KINDS = ("private", "presence", "arena", "files")


def rss_by_kind(pid: int) -> dict[str, int]:
    """Memory of a process by kind (``/proc/PID/smaps``): ``arena`` (resident pages of the CPU
    tier's slabs: block bytes, not index), ``presence`` (the presence tables' memfds, whole:
    ``presence_bytes``), ``private`` (heap and anonymous memory), ``files`` (code and other
    files)."""
    out = dict.fromkeys(RSS_KINDS, 0)
    kind = "private"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 5 and "-" in fields[0] and ":" in fields[3]:  # a mapping's header
                name = " ".join(fields[5:])
                if "kvstore-slab" in name:
                    kind = "arena"
                elif "kvstore-presence" in name:
                    kind = "presence"
                elif not name or name.startswith("["):
                    kind = "private"
                else:
                    kind = "files"
            elif fields and fields[0] == "Rss:" and kind != "presence":
                out[kind] += int(fields[1]) * 1024
    out["presence"] = presence_bytes(pid)
    return out


def presence_bytes(pid: int) -> int:
    """Bytes of shared memory held by the presence tables (memfds) a process maps or holds
    open, by their allocated pages: they do not show in the daemon's resident set, yet they
    are memory all the same (mapped by every same-host client)."""
    seen: dict[tuple[int, int], int] = {}
    for folder in (f"/proc/{pid}/map_files", f"/proc/{pid}/fd"):
        try:
            names = os.listdir(folder)
        except OSError:  # map_files needs CAP_SYS_ADMIN
            continue
        for name in names:
            path = os.path.join(folder, name)
            try:
                if "kvstore-presence" not in os.readlink(path):
                    continue
                st = os.stat(path)
            except OSError:
                continue
            seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return sum(seen.values())


def map_presence(kv: Any, keys: list[bytes]) -> None:
    """Look ``keys`` up twice in a row: the first lookup after a pause is a call, the next one
    maps the namespace's presence table (the daemon builds it then, if it has none), as the
    client of an engine serving requests keeps it mapped."""
    for _ in range(2):
        expect(kv.lookup(keys) == len(keys), "a batch just put is not found")


def daemon_fill(n: int) -> dict[str, Any]:
    """Fill a real daemon with ``n`` 4 KiB blocks through a real client: how its resident
    memory grew from the first batch to the last, by kind of mapping."""
    import torch

    from kvstore import KVLayout, KVStoreClient
    from kvstore.keys import unpack_keys

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB
    capacity = n * layout.block_bytes + (64 << 20)
    g = torch.Generator().manual_seed(1)
    blocks = torch.randn((BATCH, *layout.block_shape), generator=g).to(layout.dtype)
    with (
        KVStoreDaemon(capacity) as daemon,
        KVStoreClient(daemon.address, layout=layout, model="bench-index-memory") as kv,
    ):
        first = unpack_keys(os.urandom(32 * BATCH))
        expect(kv.put(first, blocks) == BATCH, "the first put did not store every block")
        map_presence(kv, first)
        time.sleep(0.5)
        before = rss_by_kind(daemon.pid)
        t0 = time.perf_counter()
        done, keys = BATCH, first
        while done < n:
            k = min(BATCH, n - done)
            keys = unpack_keys(os.urandom(32 * k))
            stored = kv.put(keys, blocks[:k])
            expect(stored == k, f"a put stored {stored} of {k} new blocks")
            done += k
        fill_s = time.perf_counter() - t0
        map_presence(kv, keys)  # as a serving engine's client keeps it
        time.sleep(0.5)
        after = rss_by_kind(daemon.pid)
        for sample in (first, keys):  # every block still indexed; two batches read back
            expect(kv.lookup(sample) == len(sample), "a block is missing after the fill")
            got = kv.get(sample)
            expect(
                torch.equal(got.view(torch.uint8), blocks[: len(sample)].view(torch.uint8)),
                "a block read back differs from the one put",
            )
        cpu = next(t for t in kv.stats().tiers if t.name == "cpu")
        expect(cpu.blocks == done, f"the CPU tier holds {cpu.blocks} blocks, expected {done}")
    grown = {k: after[k] - before[k] for k in RSS_KINDS}
    return {
        "n": n - BATCH,
        "fill_s": fill_s,
        "grown": grown,
        "bytes": sum(v for k, v in grown.items() if k != "arena"),
    }


def arena_page_tables(capacity: int) -> dict[str, int]:
    """Page tables of a real daemon's arena mapping: the ``VmPTE`` of a daemon with a
    ``capacity`` arena minus that of one with a 64 MiB arena, for ``capacity - 64 MiB``."""
    base = 64 << 20
    pte = {}
    for cap in (base, capacity):
        with KVStoreDaemon(cap) as d:
            pte[cap] = _status(d.pid)["VmPTE"]
    return {"arena_bytes": capacity - base, "pte_bytes": pte[capacity] - pte[base]}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=None, help="indexed blocks (default 1000000)")
    p.add_argument("--child", nargs=3, metavar=("MODE", "METHOD", "N"), help=argparse.SUPPRESS)


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0], add_args)
    if args.child:
        mode, method, n = args.child
        print(json.dumps(child(mode, method, int(n))))
        return 0
    n = args.blocks or (SMOKE_BLOCKS if args.smoke else 100_000 if args.quick else 1_000_000)
    rep = Reporter(args.json)
    if not args.json:
        print_header("bench_index_memory", args)
        where = "in this process" if args.smoke else "each in a fresh process"
        rep.line(f"  {n} blocks; the in-process measurements {where}")
    results: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        for method in METHODS:
            results[f"{mode}/{method}"] = run_child(mode, method, n, in_process=args.smoke)
    outside = daemon_fill(n)

    rows = []
    for mode in MODES:
        rss = results[f"{mode}/rss"]
        tm = results[f"{mode}/tracemalloc"]
        rows.append([mode, rss["bytes"] / n, tm["bytes"] / n, rss["bytes"] / 2**20, rss["fill_s"]])
    m = outside["n"]
    rows.append(["daemon (outside)", outside["bytes"] / m, None, outside["bytes"] / 2**20,
                 outside["fill_s"]])  # fmt: skip
    rep.table(
        f"Memory per indexed block at {n} blocks",
        ["structures", "RSS B/block", "tracemalloc B/block", "RSS MiB", "fill s"],
        rows,
    )
    grown = outside["grown"]
    rep.table(
        "The daemon's growth by kind of memory (smaps, presence memfds; arena not counted)",
        ["mapping", "B/block", "MiB"],
        [[kind, grown[kind] / m, grown[kind] / 2**20] for kind in RSS_KINDS],
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
    sites = results["BlockStore/tracemalloc"]["sites"]
    rep.table(
        "Where it goes (BlockStore, tracemalloc: allocation sites still holding memory)",
        ["allocated at", "B/block"],
        [[site, size / n] for site, size in sites],
    )

    cap = (128 if args.smoke else 256 if args.quick else 1024) << 20
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

    value = outside["bytes"] / m
    status = verdict(value < TARGET_BYTES)
    rep.table(
        "Target",
        ["target", "value", "needed", "status"],
        [["daemon memory per indexed block", value, f"< {TARGET_BYTES}", status]],
    )
    emit(
        {
            "blocks": n,
            "bytes_per_block": {
                **{k: v["bytes"] / n for k, v in results.items()},
                "daemon": value,
            },
            "daemon_growth_bytes_per_block": {k: v / m for k, v in grown.items()},
            "breakdown_bytes_per_block": {k: v / n for k, v in parts.items()},
            "allocation_sites_bytes_per_block": {site: size / n for site, size in sites},
            "arena_page_tables": {**pte, "bytes_per_mib": per_mib},
            "target": {"max_bytes": TARGET_BYTES, "value": value, "status": status},
        },
        args,
    )
    return 0


if __name__ == "__main__":
    run_main(main)
