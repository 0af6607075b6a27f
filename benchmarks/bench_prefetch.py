"""Reading a prefix back through a real daemon with an NVMe tier: cold, prefetched, resident.

A real ``kvstore serve`` with a CPU tier and an NVMe tier (write-back) holds prefixes of 128
Llama-3-8B blocks (``KVLayout(32, 8, 128, 16)`` bf16: 2 MiB a block, 256 MiB a prefix). Timed:
``get(keys, out=preallocated)`` of a whole prefix that is

* (a) cold: on disk only. It is put, then pushed out of the CPU tier by putting filler blocks
  (eviction writes it down), then the fillers are deleted so the promotion finds free slots
  and the get pays for reads only, not for writing victims down;
* (b) prefetched: cold as in (a), ``kv.prefetch(keys)``, sleep 50 ms, then the timed get;
* (c) resident in the CPU tier.

Each round uses three new prefixes, one per case, so no prefix is timed twice and every case
gets one sample a round (``--rounds``, default 5; 3 with ``--quick``). Before every timed get
the prefix's state is checked (a ``lookup`` and the CPU tier's hit counter tell how many of its
blocks are in the CPU tier) and the daemon's background writer is let go idle; after it, the
bytes are compared with what was put. The machine's limits, measured in the same run: ``dd``
O_DIRECT write and read of 256 MiB in 2 MiB blocks on the same filesystem once a round, next to
the cold reads (ratios to dd are medians of per-round ratios), and a single-thread
``np.copyto`` of 256 MiB (the memcpy floor of case c).

``--restart`` (on by default, off with ``--quick``): restart time at 100,000 blocks. A daemon
with 16 KiB blocks (``KVLayout(2, 2, 64, 16)``), a 256 MiB CPU tier and ``--write-through``
takes 100,000 puts; once the NVMe tier holds all of them it is stopped with SIGTERM and
started again (``--restarts`` times): timed from process start to the health check saying
SERVING, and to the first ``lookup`` of all 100,000 keys that finds them all. The start of the
same daemon on an empty NVMe directory is timed the same way, for reference.

The NVMe directory is under the repo's ``var/`` (gitignored; same filesystem as the daemon would
use), never /dev/shm, and is removed at the end, on Ctrl-C and on SIGTERM. Default run: about
1-1.5 minutes and at most ~2.7 GB of disk at a time.

    .venv/bin/python benchmarks/bench_prefetch.py [--quick] [--json] [--rounds 5]
        [--dir DIR] [--restart | --no-restart] [--restart-blocks 100000] [--restarts 3]

``--smoke``: 8-block prefixes (16 MiB) in tiers sized to match, one round, and the restart part
at 2,000 blocks, one restart. After every restart the first blocks are read back and compared
with what was put.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from _harness import (
    KVStoreDaemon,
    Reporter,
    dd,
    emit,
    expect,
    fmt_size,
    parse_args,
    percentile,
    print_header,
    run_main,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import KVLayout, KVStoreClient

MiB = 1 << 20
LAYOUT = KVLayout(32, 8, 128, 16)  # Llama-3-8B: 2 MiB blocks
PREFIX_BLOCKS = 128  # 2048 tokens
PREFIX_BYTES = PREFIX_BLOCKS * LAYOUT.block_bytes  # 256 MiB
PREFETCH_LEAD_S = 0.05
PUT_BATCH = 32
# CPU tier: the three prefixes of a round plus one slab (the fillers fill it all); NVMe tier:
# the two cold prefixes with room to spare. Its file is preallocated to the capacity.
CPU_CAPACITY = 3 * PREFIX_BYTES + 64 * MiB
NVME_CAPACITY = 1536 * MiB
MODEL = "bench-prefetch/llama-3-8b"
IO_THREADS = 4  # the NVMe tier's read threads (nvme.io_threads, default 4)

SMALL_LAYOUT = KVLayout(2, 2, 64, 16)  # 2 x 2 x 16 x 2 x 64 x 2 bytes = 16 KiB blocks
SMALL_CPU = 256 * MiB
SMALL_NVME = 2560 * MiB
SMALL_BATCH = 1024
SMALL_MODEL = "bench-prefetch/restart"


def use_smoke_sizes() -> None:
    """Shrink the sizes above for ``--smoke``: the same runs, seconds long."""
    global PREFIX_BLOCKS, PREFIX_BYTES, PUT_BATCH, CPU_CAPACITY, NVME_CAPACITY
    global SMALL_CPU, SMALL_NVME
    PREFIX_BLOCKS = PUT_BATCH = 8
    PREFIX_BYTES = PREFIX_BLOCKS * LAYOUT.block_bytes
    CPU_CAPACITY = 3 * PREFIX_BYTES + 64 * MiB
    NVME_CAPACITY = 256 * MiB
    SMALL_CPU = 64 * MiB
    SMALL_NVME = 128 * MiB


def add_args(p: argparse.ArgumentParser) -> None:
    repo = Path(__file__).resolve().parents[1]
    p.add_argument("--dir", default=str(repo / "var"), help="parent of the NVMe dirs (on disk)")
    p.add_argument("--rounds", type=int, default=None, help="samples per case (default 7)")
    p.add_argument(
        "--restart",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time a restart at --restart-blocks blocks (default: on, off with --quick)",
    )
    p.add_argument("--restart-blocks", type=int, default=100_000)
    p.add_argument("--restarts", type=int, default=3, help="restarts timed (default 3)")


# ------------------------------------------------------------------------------ helpers


def parallel_read(path: Path, threads: int, block: int = 2 * MiB) -> float:
    """GB/s of reading all of ``path`` in ``block`` pieces with O_DIRECT ``os.preadv`` from
    ``threads`` threads (piece i by thread i % threads), as the NVMe tier's IO threads read."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        size = os.fstat(fd).st_size
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        bufs = [mmap.mmap(-1, block, flags=flags) for _ in range(threads)]  # page-aligned

        def worker(i: int) -> int:
            done = 0
            for off in range(i * block, size, threads * block):
                done += os.preadv(fd, [bufs[i]], off)
            return done

        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            total = sum(pool.map(worker, range(threads)))
            dt = time.perf_counter() - t0
        if total != size:
            raise RuntimeError(f"parallel read got {total} of {size} bytes")
        for b in bufs:
            b.close()
    finally:
        os.close(fd)
    return size / dt / 1e9


def disk_limits(directory: Path, blocks: int, threads: int) -> tuple[float, float, float]:
    """(dd write, dd read, parallel read) GB/s of one file of ``blocks`` 2 MiB blocks written
    and read with O_DIRECT; the file is removed."""
    path = directory / "dd.bin"
    try:
        w = dd(["if=/dev/zero", f"of={path}", "bs=2M", f"count={blocks}", "oflag=direct"])
        r = dd([f"if={path}", "of=/dev/null", "bs=2M", "iflag=direct"])
        pr = parallel_read(path, threads)
    finally:
        path.unlink(missing_ok=True)
    return w, r, pr


def memcpy_floor(dst: np.ndarray, src: np.ndarray, k: int) -> list[float]:
    """Seconds of ``k`` single-thread np.copyto of all of ``src`` (far larger than the L3)."""
    np.copyto(dst, src)  # warm-up
    out = []
    for _ in range(k):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(time.perf_counter() - t0)
    return out


def tier(kv: KVStoreClient, name: str) -> Any:
    for t in kv.stats().tiers:
        if t.name == name:
            return t
    raise RuntimeError(f"the daemon reports no {name} tier")


def calling_client(address: str) -> KVStoreClient:
    """A client that asks the daemon every lookup (``KVSTORE_PRESENCE_TABLES=0``): one that
    answers from its presence table tells the daemon's hit counters only now and then."""
    saved = os.environ.get("KVSTORE_PRESENCE_TABLES")
    os.environ["KVSTORE_PRESENCE_TABLES"] = "0"
    try:
        return KVStoreClient(address, layout=LAYOUT, model=MODEL)
    finally:
        if saved is None:
            del os.environ["KVSTORE_PRESENCE_TABLES"]
        else:
            os.environ["KVSTORE_PRESENCE_TABLES"] = saved


def in_cpu(kv: KVStoreClient, keys: Sequence[bytes]) -> tuple[int, int]:
    """(blocks of ``keys``'s leading run found in any tier, of those in the CPU tier): a lookup
    counts a CPU-tier hit per block of the run the CPU tier holds, and promotes nothing. ``kv``
    must call for every lookup (``calling_client``)."""
    before = tier(kv, "cpu").hits
    found = kv.lookup(keys)
    return found, tier(kv, "cpu").hits - before


def settle(kv: KVStoreClient, quiet_s: float = 0.2, timeout_s: float = 60.0) -> None:
    """Wait until the daemon's background writer is idle: no demotion for ``quiet_s``."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        t = tier(kv, "nvme")
        now = (t.demotions, t.blocks, t.used_bytes)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.05)
    raise RuntimeError("the NVMe tier kept writing for a minute")


def put_all(kv: KVStoreClient, keys: Sequence[bytes], src: torch.Tensor, batch: int) -> None:
    n = len(src)
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        j = i % n
        if j + len(chunk) > n:
            j = 0
        kv.put(chunk, src[j : j + len(chunk)])


class Prefixes:
    """Unique 2048-token prompts: prefix i's keys chain over its own token ids."""

    def __init__(self, kv: KVStoreClient) -> None:
        self.kv = kv
        self.next = 0

    def new(self, blocks: int | None = None) -> list[bytes]:
        blocks = PREFIX_BLOCKS if blocks is None else blocks
        base = self.next * 10_000_000
        self.next += 1
        tokens = torch.arange(base, base + blocks * LAYOUT.block_size, dtype=torch.int64)
        return self.kv.hash_tokens(tokens)


# ------------------------------------------------------------------------------ prefetch
def prefetch_rounds(
    kv: KVStoreClient, probe: KVStoreClient, directory: Path, rounds: int, rep: Reporter
) -> dict:
    """``kv`` puts and gets; ``probe`` (a ``calling_client``) checks where blocks are."""
    # Random bf16 bit patterns: nothing for a codec to find, every block different.
    src = torch.empty((PREFIX_BLOCKS, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
    src.view(torch.int16).random_(-(1 << 15), 1 << 15)
    out = torch.zeros_like(src)  # faulted in once; every get writes into it
    src_bits, out_bits = src.view(torch.int16), out.view(torch.int16)
    src_np, out_np = src_bits.numpy(), out_bits.numpy()
    prefixes = Prefixes(kv)
    fill_blocks = CPU_CAPACITY // LAYOUT.block_bytes

    samples: dict[str, list[float]] = {"cold": [], "prefetched": [], "resident": []}
    prefetch_done: list[int] = []  # blocks the prefetch had promoted for each (b) get
    dd_w: list[float] = []
    dd_r: list[float] = []
    par_r: list[float] = []
    memcpy: list[float] = []
    ratio_cold_dd: list[float] = []
    ratio_pref_dd: list[float] = []
    ratio_cold_par: list[float] = []

    def timed_get(keys: list[bytes], case: str, lead: Callable[[], None] | None = None) -> None:
        found, cpu = in_cpu(probe, keys)
        want_cpu = PREFIX_BLOCKS if case == "resident" else 0
        if found != PREFIX_BLOCKS or cpu != want_cpu:
            raise RuntimeError(
                f"case {case}: {found} blocks found, {cpu} in the CPU tier; "
                f"expected {PREFIX_BLOCKS} and {want_cpu}"
            )
        out_bits.zero_()
        hits0 = tier(kv, "nvme").extra.get("prefetch_hits", 0.0)
        if lead is not None:
            lead()
        t0 = time.perf_counter()
        got = kv.get(keys, out=out)
        dt = time.perf_counter() - t0
        if got.shape[0] != PREFIX_BLOCKS or not torch.equal(out_bits, src_bits):
            raise RuntimeError(f"case {case}: get returned {got.shape[0]} blocks or wrong bytes")
        samples[case].append(dt)
        if case == "prefetched":
            prefetch_done.append(int(tier(kv, "nvme").extra.get("prefetch_hits", 0.0) - hits0))

    def prefetch_lead(keys: list[bytes]) -> Callable[[], None]:
        def lead() -> None:
            kv.prefetch(keys)
            time.sleep(PREFETCH_LEAD_S)

        return lead

    for r in range(rounds):
        cold, pref, resident = prefixes.new(), prefixes.new(), prefixes.new()
        put_all(kv, cold, src, PUT_BATCH)
        put_all(kv, pref, src, PUT_BATCH)
        # Fillers push both out of the CPU tier (the LRU victims are written down first; a
        # block the background writer holds at that moment is skipped, hence the loop) ...
        fillers = prefixes.new(fill_blocks)
        put_all(kv, fillers, src, PUT_BATCH)
        settle(kv)
        for _ in range(32):
            if in_cpu(probe, cold)[1] == 0 and in_cpu(probe, pref)[1] == 0:
                break
            more = prefixes.new(PUT_BATCH)
            put_all(kv, more, src, PUT_BATCH)
            fillers += more
            settle(kv)
        # ... and are deleted, so promotions find free slots and write nothing down.
        kv.delete(fillers)
        put_all(kv, resident, src, PUT_BATCH)
        settle(kv)

        w, rd, prd = disk_limits(directory, PREFIX_BLOCKS, IO_THREADS)
        dd_w.append(w)
        dd_r.append(rd)
        par_r.append(prd)
        memcpy += memcpy_floor(out_np, src_np, 2)
        timed_get(resident, "resident")
        # Cold and prefetched alternate who goes first, so drift hits both alike.
        order = ["cold", "prefetched"] if r % 2 == 0 else ["prefetched", "cold"]
        for case in order:
            if case == "cold":
                timed_get(cold, "cold")
            else:
                timed_get(pref, "prefetched", prefetch_lead(pref))
        ratio_cold_dd.append(PREFIX_BYTES / samples["cold"][-1] / 1e9 / rd)
        ratio_pref_dd.append(PREFIX_BYTES / samples["prefetched"][-1] / 1e9 / rd)
        ratio_cold_par.append(PREFIX_BYTES / samples["cold"][-1] / 1e9 / prd)
        kv.delete(cold + pref + resident)
        settle(kv)
        rep.line(
            f"  round {r + 1}/{rounds}: cold {samples['cold'][-1] * 1e3:.0f} ms, "
            f"prefetched {samples['prefetched'][-1] * 1e3:.0f} ms "
            f"({prefetch_done[-1]} blocks by the prefetch), "
            f"resident {samples['resident'][-1] * 1e3:.0f} ms; dd read {rd:.2f} GB/s, "
            f"{IO_THREADS}-thread read {prd:.2f} GB/s"
        )
    return {
        "samples_s": samples,
        "prefetch_promoted_blocks": prefetch_done,
        "dd_write_gbps": dd_w,
        "dd_read_gbps": dd_r,
        "parallel_read_gbps": par_r,
        "memcpy_s": memcpy,
        "ratio_cold_to_dd": ratio_cold_dd,
        "ratio_prefetched_to_dd": ratio_pref_dd,
        "ratio_cold_to_parallel_read": ratio_cold_par,
    }


def report_prefetch(res: dict, rep: Reporter) -> dict:
    med = statistics.median
    s = res["samples_s"]
    cold, pref, resident = (med(s[k]) for k in ("cold", "prefetched", "resident"))
    memcpy = med(res["memcpy_s"])
    dd_r, dd_w = med(res["dd_read_gbps"]), med(res["dd_write_gbps"])
    par_r = med(res["parallel_read_gbps"])
    gb = PREFIX_BYTES / 1e9

    def row(label: str, xs: list[float], ratio: float | None, note: str) -> list[Any]:
        m = med(xs)
        return [label, len(xs), m * 1e3, percentile(xs, 0.9) * 1e3, gb / m, ratio, note]

    def disk_row(label: str, rates: list[float], ratio: float | None, note: str) -> list[Any]:
        # Rates as times for 256 MiB; the slowest run is the p90 of so few.
        m = med(rates)
        return [label, len(rates), gb / m * 1e3, gb / min(rates) * 1e3, m, ratio, note]

    rc_dd, rp_dd = med(res["ratio_cold_to_dd"]), med(res["ratio_prefetched_to_dd"])
    rc_par = med(res["ratio_cold_to_parallel_read"])
    promoted = med(res["prefetch_promoted_blocks"])
    hidden = cold - pref
    disk_part = cold - resident
    rows = [
        row(
            "(a) cold on NVMe",
            s["cold"],
            rc_dd,
            f"vs dd read (per-round ratios); {rc_par:.2f} of the {IO_THREADS}-thread read",
        ),
        row(
            f"(b) prefetched {PREFETCH_LEAD_S * 1e3:.0f} ms before",
            s["prefetched"],
            rp_dd,
            f"vs dd read; the prefetch promoted {promoted:.0f} of {PREFIX_BLOCKS} blocks",
        ),
        row("(c) resident in CPU tier", s["resident"], memcpy / resident, "vs memcpy"),
        disk_row(
            "dd read O_DIRECT, 2 MiB",
            res["dd_read_gbps"],
            1.0,
            f"{fmt_size(PREFIX_BYTES)} file, each round",
        ),
        disk_row(
            f"O_DIRECT preadv 2 MiB, {IO_THREADS} threads",
            res["parallel_read_gbps"],
            par_r / dd_r,
            "same file, after dd read; the tier reads with as many threads",
        ),
        disk_row("dd write O_DIRECT, 2 MiB", res["dd_write_gbps"], None, ""),
        row(
            "memcpy np.copyto, 1 thread",
            res["memcpy_s"],
            1.0,
            f"{fmt_size(PREFIX_BYTES)}, pre-faulted",
        ),
    ]
    rep.table(
        f"get(out=...) of a {PREFIX_BLOCKS}-block prefix ({fmt_size(PREFIX_BYTES)}, "
        f"{fmt_size(LAYOUT.block_bytes)} blocks)",
        ["case", "n", "median ms", "p90 ms", "GB/s", "ratio", "notes"],
        rows,
    )
    lead_ms = PREFETCH_LEAD_S * 1e3
    rep.line(
        f"\nprefetch {lead_ms:.0f} ms ahead hid {hidden * 1e3:.0f} ms of the cold get: "
        f"{100 * hidden / cold:.0f}% of its latency, {100 * hidden / PREFETCH_LEAD_S:.0f}% "
        f"of the {lead_ms:.0f} ms head start, {100 * hidden / disk_part:.0f}% of the "
        f"{disk_part * 1e3:.0f} ms a cold get takes over a resident one."
    )
    rep.line(
        "p90: nearest rank (with under 10 samples, the slowest). Cold and prefetched gets find "
        "free CPU slots\n(no victim to write down). Disk rows: time and GB/s for "
        f"{fmt_size(PREFIX_BYTES)}."
    )
    return {
        "median_ms": {"cold": cold * 1e3, "prefetched": pref * 1e3, "resident": resident * 1e3},
        "dd_read_gbps": dd_r,
        "dd_write_gbps": dd_w,
        "parallel_read_gbps": par_r,
        "memcpy_gbps": gb / memcpy,
        "cold_vs_dd_read": rc_dd,
        "cold_vs_parallel_read": rc_par,
        "prefetched_vs_dd_read": rp_dd,
        "resident_vs_memcpy": memcpy / resident,
        "prefetch_hidden_ms": hidden * 1e3,
        "prefetch_hidden_of_lead": hidden / PREFETCH_LEAD_S,
        "raw": res,
    }


# ------------------------------------------------------------------------------ restart
class TimedDaemon(KVStoreDaemon):
    """The harness daemon with a tighter readiness poll: the socket file is polled every 2 ms
    and a fresh channel asks the health check once it exists. (A channel that failed to
    connect before the socket existed would wait out gRPC's reconnect backoff, ~1 s.)"""

    def _wait_ready(self) -> None:
        assert self.proc is not None
        path = self.address.removeprefix("unix:")
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode} before serving")
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon not serving after {self.ready_timeout_s}s")
            if not os.path.exists(path):
                time.sleep(0.002)
                continue
            with grpc.insecure_channel(self.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                try:
                    reply = stub.Check(
                        health_pb2.HealthCheckRequest(), timeout=5.0, wait_for_ready=True
                    )
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
            time.sleep(0.002)

    def sigterm(self) -> tuple[float, int | None]:
        """SIGTERM; (seconds until the process exited, its exit status)."""
        assert self.proc is not None
        t0 = time.perf_counter()
        self.proc.terminate()
        try:
            code = self.proc.wait(120)
        except subprocess.TimeoutExpired:
            return time.perf_counter() - t0, None  # stop() kills it
        return time.perf_counter() - t0, code


def small_keys(n: int) -> list[bytes]:
    return [hashlib.sha256(b"bench-prefetch restart %d" % i).digest() for i in range(n)]


def check_read_back(daemon: KVStoreDaemon, keys: list[bytes], src: torch.Tensor) -> None:
    """The first blocks put (``put_all``: key i holds ``src[i]``) read back unchanged."""
    n = min(64, len(keys), len(src))
    with KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model=SMALL_MODEL) as kv:
        got = kv.get(keys[:n])
    expect(got.shape[0] == n, f"after a restart get returned {got.shape[0]} of {n} blocks")
    same = torch.equal(got.view(torch.int16), src[:n].view(torch.int16))
    expect(same, "a block read back after a restart differs from the one put")


def timed_start(args: list[str], keys: list[bytes]) -> tuple[TimedDaemon, dict[str, Any]]:
    """Start a daemon; seconds from process start to SERVING and to a full lookup."""
    daemon = TimedDaemon(SMALL_CPU, extra_args=args, ready_timeout_s=300.0)
    t0 = time.perf_counter()
    try:
        daemon.start()
        serving = time.perf_counter() - t0
        attempts = 0
        with KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model=SMALL_MODEL) as kv:
            while True:
                attempts += 1
                found = kv.lookup(keys) if keys else 0
                if found == len(keys) or time.perf_counter() - t0 > 60:
                    break
                time.sleep(0.01)
        lookup = time.perf_counter() - t0
    except BaseException:
        daemon.stop()
        raise
    return daemon, {"serving_s": serving, "lookup_s": lookup, "found": found, "tries": attempts}


def restart_run(root: Path, blocks: int, restarts: int, rep: Reporter) -> dict[str, Any]:
    nvme_dir = root / "restart"
    args = [
        "--nvme-path",
        str(nvme_dir),
        "--nvme-capacity",
        str(SMALL_NVME),
        "--write-through",
    ]
    keys = small_keys(blocks)
    src = torch.empty((SMALL_BATCH, *SMALL_LAYOUT.block_shape), dtype=SMALL_LAYOUT.dtype)
    src.view(torch.int16).random_(-(1 << 15), 1 << 15)

    daemon, empty = timed_start(args, [])
    try:
        with KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model=SMALL_MODEL) as kv:
            t0 = time.perf_counter()
            put_all(kv, keys, src, SMALL_BATCH)
            put_s = time.perf_counter() - t0
            deadline = time.monotonic() + 300
            while tier(kv, "nvme").blocks < blocks:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {tier(kv, 'nvme').blocks} of {blocks} on disk")
                time.sleep(0.02)
            fill_s = time.perf_counter() - t0
            if kv.lookup(keys) != blocks:
                raise RuntimeError("blocks went missing while filling")
        rep.line(
            f"  restart: {blocks:,} blocks put in {put_s:.1f} s, all on disk after {fill_s:.1f} s"
        )
        stops, starts = [], []
        for i in range(restarts):
            stop_s, code = daemon.sigterm()
            daemon.stop()
            stops.append(stop_s)
            if code != 0:
                raise RuntimeError(f"daemon exited with {code} after SIGTERM")
            daemon, timing = timed_start(args, keys)
            starts.append(timing)
            rep.line(
                f"  restart {i + 1}/{restarts}: SERVING after {timing['serving_s']:.2f} s, "
                f"lookup found {timing['found']:,} after {timing['lookup_s']:.2f} s"
            )
            if timing["found"] != blocks:
                raise RuntimeError(f"after restart lookup found {timing['found']} of {blocks}")
            check_read_back(daemon, keys, src)
    finally:
        daemon.stop()
    return {
        "blocks": blocks,
        "block_bytes": SMALL_LAYOUT.block_bytes,
        "empty_start": empty,
        "put_s": put_s,
        "fill_s": fill_s,
        "stop_s": stops,
        "restarts": starts,
    }


def report_restart(res: dict[str, Any], rep: Reporter) -> None:
    med = statistics.median
    starts = res["restarts"]
    serving = med(s["serving_s"] for s in starts)
    lookup = med(s["lookup_s"] for s in starts)
    empty = res["empty_start"]
    n = res["blocks"]

    def each(k: str) -> str:
        return "/".join(f"{s[k]:.2f}" for s in starts)

    rep.table(
        f"Restart at {n:,} blocks of {fmt_size(res['block_bytes'])} (write-through, "
        f"{len(starts)} restarts, seconds)",
        ["measure", "median s", "notes"],
        [
            ["start -> SERVING, NVMe tier empty", empty["serving_s"], "same flags, empty dir"],
            ["restart -> SERVING", serving, f"runs {each('serving_s')}"],
            [
                f"restart -> lookup finds all {n:,}",
                lookup,
                f"runs {each('lookup_s')}; first lookup found all: "
                f"{all(s['tries'] == 1 for s in starts)}",
            ],
            ["  recovery cost (restart - empty start)", serving - empty["serving_s"], ""],
            ["SIGTERM -> exit", med(res["stop_s"]), "nothing dirty to drain"],
            [
                f"fill: {n:,} puts until all on disk",
                res["fill_s"],
                f"{n / res['fill_s']:,.0f} blocks/s; puts returned after {res['put_s']:.1f} s",
            ],
        ],
    )


# ------------------------------------------------------------------------------ main
def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0], add_args)
    if args.smoke:
        use_smoke_sizes()
        args.restart_blocks, args.restarts = 2000, 1
    rounds = args.rounds or (1 if args.smoke else 3 if args.quick else 7)
    on = args.smoke or not args.quick
    restart = on if args.restart is None else args.restart
    rep = Reporter(args.json)
    if not args.json:
        print_header("bench_prefetch", args)
    parent = Path(args.dir)
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-prefetch-", dir=parent))
    if root.resolve().is_relative_to("/dev/shm"):
        shutil.rmtree(root)
        sys.exit("--dir must be on the disk, not /dev/shm")
    t_start = time.perf_counter()
    result: dict[str, Any] = {"rounds": rounds}
    try:
        nvme_dir = root / "nvme"
        extra = ["--nvme-path", str(nvme_dir), "--nvme-capacity", str(NVME_CAPACITY)]
        rep.line(
            f"daemon: cpu tier {fmt_size(CPU_CAPACITY)}, nvme tier {fmt_size(NVME_CAPACITY)} "
            f"(write-back) in {nvme_dir}"
        )
        with (
            KVStoreDaemon(CPU_CAPACITY, extra_args=extra) as daemon,
            KVStoreClient(daemon.address, layout=LAYOUT, model=MODEL) as kv,
            calling_client(daemon.address) as probe,
        ):
            if not kv.uses_shared_memory:
                raise RuntimeError("the client could not map the daemon's arena")
            res = prefetch_rounds(kv, probe, root, rounds, rep)
        result["prefetch"] = report_prefetch(res, rep)
        shutil.rmtree(nvme_dir, ignore_errors=True)
        if restart:
            rs = restart_run(root, args.restart_blocks, args.restarts, rep)
            report_restart(rs, rep)
            result["restart"] = rs
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rep.line(f"\n{time.perf_counter() - t_start:.0f} s total; dir {root} removed.")
    emit(result, args)
    return 0


if __name__ == "__main__":
    run_main(main)
