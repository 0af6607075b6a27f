"""Replay of the Mooncake FAST'25 synthetic trace at storage level: hit rate and request rate.

The trace (``../shared/data/synthetic_trace.jsonl.gz``, beside this repository; ``--trace``
names another) lists 3,993 requests by the 512-token prefix blocks of their prompts. Each block
is one store block (16 KiB by default) under a chained key: a block's key depends on its whole
prefix of ids (``_trace_sim``). Per request the replay reads the leading run of stored blocks
and puts the rest, every block's bytes derived from its key and every hit's bytes checked:

* kvstore, one real daemon per eviction policy it offers (``lru``, ``prefix``, ``priority``),
  CPU tier only, capacity ``--capacity-frac`` (10%) of the trace's distinct blocks in bytes,
  started empty. A request is ``get(keys, out)`` (the acquire path: lookup and read in one
  call, or none when the client's presence table already knows every block's place), then
  ``put`` of the blocks after the leading run (one call into spare slots, or reserve +
  commit): at most three round trips. The put does not wait for its commit
  (``put(..., wait=False)``, as an engine offloads while it computes): its reply is read at
  the next put, or at the final ``flush()``, whose time counts, so the replay waits only for
  a reserve. The ``lru`` replay runs again with puts that wait (``, puts wait``;
  ``--skip-waiting-puts`` leaves it out).
* kvstore CPU+NVMe: the ``lru`` daemon with an NVMe tier too, ``--nvme-frac`` of the distinct
  blocks (default 3x the CPU tier) in a fresh directory under the temp dir (``--nvme-dir``); a
  hit is a block of the leading run found in either tier. Its reference is the exact LRU
  simulation at the two tiers' bytes together.
* Redis (redis-py, pipelined) on a ``redis-server`` with ``maxmemory`` = the same bytes and
  ``allkeys-lru``, started empty: a pipeline of EXISTS (which does not touch a key's LRU
  clock) finds the leading run, then one pipeline GETs it and SETs the rest. Two round trips.
* Mooncake Store (``mooncake-transfer-engine-non-cuda``, in ``.venv-mooncake``, which
  ``scripts/mooncake_env.sh`` builds; without it the Mooncake rows are skipped and the run says
  so): a fresh ``mooncake_master`` and a segment of the same bytes (at least Mooncake's 16 MiB),
  all on 127.0.0.1, replayed by ``_mooncake_peer`` in that environment (``batch_is_exist``,
  ``batch_get_into``, ``batch_put_from``: three round trips) in each of ``--mooncake-modes``:
  ``tcp`` (the store client mounts the segment, every block through the TCP transport over
  loopback), ``embedded`` (the same with Mooncake's TCP-only default: a local memcpy into the
  client's own segment) and ``shm`` (its same-host mode: a standalone ``mooncake_client``
  holds the segment, the replay is a dummy client handing it shared-memory buffers).
* an exact simulation of a block LRU of the same byte capacity over the same request order
  (and of kvstore's prefix-aware order), with the same semantics: the leading run is read (a
  touch, in prefix order), then the new blocks after it are put; blocks already stored
  further on are left alone (kvstore's put deduplicates them without a touch). And the
  unbounded cache: the hit rate no capacity can beat.
* exact simulations of the frequency-aware orders LMCache and vLLM offer or build on (2Q,
  ARC, S3-FIFO) and of a plain LFU (``_policy_sims``), with kvstore's put semantics, each
  against LRU with the same semantics over the whole trace and each half: one that beats LRU
  by ``CLEAR_MARGIN`` on both halves would be worth offering as a policy.

Reported: prefix block-hit rate (blocks found in their request's leading run / blocks asked
for) of each against the simulation and the bound; requests/s (requests / the time spent in
store calls: building blocks and checking them is left out) and p50/p99 request latency; a
request's time against a single-thread memcpy of its bytes measured in the same run; the blocks
each store held at the end, and how much of Redis's memory is per-key overhead
(``used_memory / (keys x block bytes)``). Figures are medians over ``--runs`` rounds; a round
replays every store once, in a fixed order.

Redis's eviction at replay speed: ``allkeys-lru`` is an approximation. Each eviction samples
``maxmemory-samples`` (5) keys into a pool of 16 candidates and evicts the one idle longest,
and idleness is read off a 24-bit LRU clock that ticks once every 1,000 ms
(``LRU_CLOCK_RESOLUTION``). A replay at full speed touches the whole cache within a few
seconds, so most keys share one or two clock values and the choice among them is close to
random: hot prefixes go as readily as cold tails. Redis also stores a 16 KiB value in a
20 KiB jemalloc size class (16 KiB plus the sds header, rounded up), so the same bytes hold
about 20% fewer blocks.

Mooncake's eviction at replay speed: the master evicts in a background thread (every 10 ms)
once more than 90% of the segment is allocated (``eviction_high_watermark_ratio``) or a put
found no space, about 5% of the objects at a time (``eviction_ratio``), oldest lease first; an
object read in the last 10 s (``default_kv_lease_ttl``, granted by every get) cannot be evicted.
A put that finds no room is refused (``-200``, counted) rather than waiting for eviction.

``--sweep``: hit rate against capacity (5-40% of the distinct blocks) for each kvstore policy,
the LRU simulation and the unbounded bound, one run each, plotted to ``--plot`` (a PNG, with
matplotlib; without it the plot is skipped and the table stays).

``--smoke``: the first 200 requests, a tiny capacity, one run: checks the script runs, every
hit still verified; its figures mean nothing.

    .venv/bin/python benchmarks/bench_trace.py [--runs 3] [--capacity-frac 0.1] [--sweep]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _harness import (
    SKIP_EXIT,
    KVStoreDaemon,
    RedisServer,
    Reporter,
    benchmark_name,
    daemon_rpc_seconds,
    emit,
    expect,
    fmt_size,
    free_tcp_port,
    parse_args,
    percentile,
    print_header,
    redis_server_path,
    rpc_seconds_between,
    run_main,
)
from _policy_sims import POLICIES as FREQUENCY_POLICIES
from _policy_sims import simulate_policy
from _trace_sim import (
    BlockContent,
    Chain,
    SimResult,
    default_trace_path,
    distinct_blocks,
    half_hit_rates,
    load_trace,
    simulate,
)

from kvstore import KVLayout, KVStoreClient
from kvstore.config.tiers import POLICIES
from kvstore.errors import CapacityError

SWEEP_FRACS = (0.05, 0.10, 0.20, 0.30, 0.40)
SWEEP_ORDERS = ("arc", "s3fifo", "2q")  # simulated at each capacity of the sweep
SMOKE_REQUESTS = 200
MODEL = "bench-trace"
LRU_TARGET = 0.99  # issue #32: kvstore's LRU >= 0.99x the exact simulation
REPO = Path(__file__).resolve().parent.parent
MOONCAKE_VENV = ".venv-mooncake"  # scripts/mooncake_env.sh builds it
MOONCAKE_DRIVER = Path(__file__).resolve().parent / "_mooncake_peer.py"
MOONCAKE_MODES = ("tcp", "embedded", "shm")
MOONCAKE_SMOKE_MODES = ("tcp", "shm")
MOONCAKE_TIMEOUT_S = 900.0
NVME_MULTIPLE = 3  # default NVMe tier: this many times the CPU tier


def layout_for(block_bytes: int) -> KVLayout:
    """A bf16 layout of ``block_bytes`` per block: 4 KiB per layer (16 tokens x 64 dims x K,V)."""
    if block_bytes % 4096 or block_bytes <= 0:
        raise ValueError(f"block size must be a positive multiple of 4 KiB, got {block_bytes}")
    layout = KVLayout(num_layers=block_bytes // 4096, num_kv_heads=1, head_dim=64, block_size=16)
    assert layout.block_bytes == block_bytes
    return layout


@dataclass
class Replay:
    """One store's pass over the requests."""

    store: str
    hits: list[int] = field(default_factory=list)  # per request: blocks of its leading run
    latency_s: list[float] = field(default_factory=list)  # per request: time in store calls
    held_at_end: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def hit_rate(self, blocks: int) -> float:
        return sum(self.hits) / blocks if blocks else 0.0

    @property
    def requests_per_s(self) -> float:
        total = sum(self.latency_s)
        return len(self.latency_s) / total if total > 0 else float("inf")


def progress(rep: Reporter, label: str, i: int, chains: list[Chain], r: Replay) -> None:
    if (i + 1) % 1000 == 0 and i + 1 < len(chains):
        asked = sum(len(c.keys) for c in chains[: i + 1])
        rep.line(
            f"    {label}: {i + 1}/{len(chains)} requests, hit rate {sum(r.hits) / asked:.3f}, "
            f"{r.requests_per_s:.0f} req/s"
        )


# --------------------------------------------------------------------------- kvstore
def replay_kvstore(
    chains: list[Chain],
    content: BlockContent,
    capacity_bytes: int,
    policy: str,
    rep: Reporter,
    label: str,
    no_spare: bool = False,
    nvme_bytes: int = 0,
    nvme_parent: str | None = None,
    put_wait: bool = False,
) -> Replay:
    """One pass through a fresh daemon (CPU tier only, ``policy``; ``no_spare``: with
    ``limits.max_spare = 0``, so no slots are held ahead for puts; ``nvme_bytes``: with an
    NVMe tier of that size in a fresh directory under ``nvme_parent``, the system's temp
    directory by default). A put the daemon refuses (CapacityError) is counted in
    ``extra["puts_refused"]`` and the replay goes on. With NVMe, a hit is a block of the
    leading run found in either tier (``get`` reads it from whichever holds it). ``put_wait``:
    each put waits for its commit (else the last request's time includes the final flush)."""
    layout = layout_for(content.block_bytes)
    bb = content.block_bytes
    longest = max(len(c.keys) for c in chains)
    src = np.empty((longest, bb), dtype=np.uint8)
    out = np.zeros((longest, bb), dtype=np.uint8)
    src_t = torch.from_numpy(src).view(layout.dtype).view(longest, *layout.block_shape)
    out_t = torch.from_numpy(out).view(layout.dtype).view(longest, *layout.block_shape)
    name = f"kvstore {policy}" + (", max_spare 0" if no_spare else "")
    name += ", puts wait" if put_wait else ""
    result = Replay(name + (" + NVMe" if nvme_bytes else ""))
    stored = refused = 0
    refused_first: int | None = None
    metrics = f"127.0.0.1:{free_tcp_port()}"  # where the daemon's own call times are read
    daemon_args = ["--gpu", "off", "--metrics-address", metrics]
    with contextlib.ExitStack() as stack:
        if no_spare:
            cfg = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvbench-trace-"))
            path = os.path.join(cfg, "daemon.toml")
            with open(path, "w") as f:
                f.write('[limits]\nmax_spare = "0"\n')
            daemon_args += ["--config", path]
        if nvme_bytes:
            nvme_dir = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="kvbench-trace-nvme-", dir=nvme_parent)
            )
            daemon_args += ["--nvme-path", nvme_dir, "--nvme-capacity", str(nvme_bytes)]
        daemon = stack.enter_context(
            KVStoreDaemon(capacity_bytes, policy=policy, extra_args=daemon_args)
        )
        kv = stack.enter_context(
            KVStoreClient(daemon.address, layout=layout, model=MODEL, transport="shm")
        )
        served_before = daemon_rpc_seconds(f"http://{metrics}/metrics")
        for i, chain in enumerate(chains):
            keys = list(chain.keys)
            n = len(keys)
            content.fill(keys, src)
            t0 = time.perf_counter()
            m = kv.get(keys, out=out_t[:n]).shape[0]
            if m < n:
                try:
                    stored += kv.put(keys[m:], src_t[m:n], wait=put_wait)
                except CapacityError:
                    refused += 1
                    refused_first = i if refused_first is None else refused_first
            if i == len(chains) - 1:  # the puts that did not wait are served: timed
                try:
                    stored += kv.flush()
                except CapacityError:
                    refused += 1
            result.latency_s.append(time.perf_counter() - t0)
            result.hits.append(m)
            # Untimed: every hit holds the bytes derived from its key.
            expect(
                np.array_equal(out[:m], src[:m]),
                f"{label}: request {i}: a block read back differs from the one put",
            )
            progress(rep, label, i, chains, result)
        served = rpc_seconds_between(served_before, daemon_rpc_seconds(f"http://{metrics}/metrics"))
        expect(bool(served), f"{label}: the daemon's /metrics counted none of the replay's calls")
        tiers = {t.name: t for t in kv.stats().tiers}
        cpu = tiers["cpu"]
        nvme = tiers.get("nvme")
        result.held_at_end = int(cpu.blocks) + (int(nvme.blocks) if nvme is not None else 0)
        result.extra = {
            "blocks_stored": stored,
            "evictions": int(cpu.evictions),
            "tier_capacity_bytes": int(cpu.capacity_bytes),
            "tier_used_bytes": int(cpu.used_bytes),
            "spare_binds": int(getattr(getattr(kv, "_spare", None), "binds", 0)),
            "puts_refused": refused,
            "first_refused_request": refused_first,
            # Per method: (seconds the daemon spent serving it, calls) during the replay.
            "daemon_calls": served,
        }
        if nvme is not None:
            result.extra.update(
                {
                    "cpu_blocks_at_end": int(cpu.blocks),
                    "nvme_blocks_at_end": int(nvme.blocks),
                    "nvme_capacity_bytes": int(nvme.capacity_bytes),
                    "nvme_evictions": int(nvme.evictions),
                    "nvme_demotions": int(nvme.demotions),  # written down into NVMe
                    "nvme_promotions": int(nvme.promotions),  # read back up from NVMe
                }
            )
    return result


# --------------------------------------------------------------------------- Redis
def redis_info(r: Any) -> dict[str, int]:
    mem, stats = r.info("memory"), r.info("stats")
    return {
        "used_memory": int(mem["used_memory"]),
        "keys": int(r.dbsize()),
        "evicted_keys": int(stats["evicted_keys"]),
    }


def replay_redis(
    chains: list[Chain], content: BlockContent, capacity_bytes: int, rep: Reporter, label: str
) -> Replay:
    """One pass through a fresh redis-server (``maxmemory`` = ``capacity_bytes``,
    ``allkeys-lru``) driven by redis-py: EXISTS pipeline, then GET + SET pipeline."""
    import redis

    bb = content.block_bytes
    longest = max(len(c.keys) for c in chains)
    src = np.empty((longest, bb), dtype=np.uint8)
    result = Replay("redis allkeys-lru")
    args = ["--maxmemory", str(capacity_bytes), "--maxmemory-policy", "allkeys-lru"]
    with RedisServer(extra_args=args) as server:
        r = redis.Redis(unix_socket_path=server.socket_path, socket_read_size=1 << 20)
        try:
            empty = redis_info(r)
            for i, chain in enumerate(chains):
                keys = chain.keys
                n = len(keys)
                content.fill(keys, src)
                t0 = time.perf_counter()
                pipe = r.pipeline(transaction=False)
                for k in keys:
                    pipe.exists(k)
                found = pipe.execute()
                m = 0
                while m < n and found[m]:
                    m += 1
                pipe = r.pipeline(transaction=False)
                for k in keys[:m]:
                    pipe.get(k)
                for j in range(m, n):
                    pipe.set(keys[j], memoryview(src[j]))
                replies = pipe.execute()
                result.latency_s.append(time.perf_counter() - t0)
                got = 0
                while got < m and replies[got] is not None:
                    got += 1
                result.hits.append(got)
                for j in range(got):  # untimed
                    expect(
                        replies[j] == src[j].tobytes(),
                        f"{label}: request {i}: a value read back differs from the one set",
                    )
                progress(rep, label, i, chains, result)
            end = redis_info(r)
            cfg = r.config_get("maxmemory-samples")
        finally:
            r.close()
    result.held_at_end = end["keys"]
    result.extra = {
        "used_memory": end["used_memory"],
        "used_memory_empty": empty["used_memory"],
        "evicted_keys": end["evicted_keys"],
        "memory_per_block_bytes": (end["used_memory"] / end["keys"]) if end["keys"] else None,
        "used_over_payload": (end["used_memory"] / (end["keys"] * bb)) if end["keys"] else None,
        "over_payload_less_empty": (
            (end["used_memory"] - empty["used_memory"]) / (end["keys"] * bb)
            if end["keys"]
            else None
        ),
        "maxmemory_samples": int(cfg.get("maxmemory-samples", 0)),
    }
    return result


# --------------------------------------------------------------------------- Mooncake
def mooncake_python() -> Path:
    return REPO / MOONCAKE_VENV / "bin" / "python"


def mooncake_missing() -> str | None:
    """Why Mooncake cannot be replayed here (None: it can): its environment is not built."""
    py = mooncake_python()
    if not py.exists():
        return f"{MOONCAKE_VENV} is not built here (bash scripts/mooncake_env.sh builds it)"
    if not (py.parent / "mooncake_master").exists():
        return f"{MOONCAKE_VENV} has no mooncake_master (rerun bash scripts/mooncake_env.sh)"
    return None


def replay_mooncake(
    mode: str,
    trace: Path,
    requests: int | None,
    capacity_bytes: int,
    block_bytes: int,
    rep: Reporter,
    label: str,
) -> Replay:
    """One pass through a fresh Mooncake Store (master, segment of ``capacity_bytes``, and in
    ``shm`` mode a standalone real client), driven by ``_mooncake_peer`` in Mooncake's own
    environment: the same requests, keys and bytes, every hit checked there."""
    with tempfile.TemporaryDirectory(prefix="kvbench-trace-mc-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [
            str(mooncake_python()),
            str(MOONCAKE_DRIVER),
            "--mode",
            mode,
            "--capacity-bytes",
            str(capacity_bytes),
            "--block-bytes",
            str(block_bytes),
            "--trace",
            str(trace),
            "--json-out",
            out,
        ]
        if requests is not None:
            cmd += ["--requests", str(requests)]
        log = os.path.join(tmp, "driver.log")
        with open(log, "wb") as f:
            rc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, timeout=MOONCAKE_TIMEOUT_S
            ).returncode
        if rc != 0:
            with open(log, errors="replace") as f:
                lines = [ln for ln in f.read().splitlines() if not ln.startswith(("I", "W"))]
            raise RuntimeError(
                f"{label}: the Mooncake driver exited {rc}:\n" + "\n".join(lines[-30:])
            )
        with open(out) as f:
            doc = json.load(f)
    result = Replay(f"mooncake {mode}")
    result.hits = list(doc.pop("hits"))
    result.latency_s = list(doc.pop("latency_s"))
    result.held_at_end = int(doc["held_at_end"])
    result.extra = doc
    return result


# --------------------------------------------------------------------------- memcpy
def memcpy_block_s(block_bytes: int, working_set: int) -> float:
    """Median time of a single-thread ``np.copyto`` of one block, over a working set beyond
    the caches (median over batches of 32 copies, divided by 32)."""
    n = max(working_set // block_bytes // 32, 1) * 32
    src = np.random.default_rng(1).integers(0, 256, (n, block_bytes), dtype=np.uint8)
    dst = np.zeros_like(src)
    samples = []
    for _ in range(2):
        for lo in range(0, n, 32):
            t0 = time.perf_counter()
            for i in range(lo, lo + 32):
                np.copyto(dst[i], src[i])
            samples.append((time.perf_counter() - t0) / 32)
    expect(np.array_equal(dst, src), "memcpy copied other bytes")
    return statistics.median(samples)


# --------------------------------------------------------------------------- summaries
def capacity_for(frac: float, distinct: int, longest: int) -> int:
    """Blocks a cache of ``frac`` of the distinct blocks holds: at least the longest request
    (a put must fit)."""
    return max(int(frac * distinct), longest)


def summarize_runs(
    runs: list[Replay], chains: list[Chain], memcpy_s: float, block_bytes: int
) -> dict[str, Any]:
    """Medians over the runs of one store."""
    blocks = sum(len(c.keys) for c in chains)
    rates = [r.hit_rate(blocks) for r in runs]
    best = runs[0]
    # A request moves its hits out and the rest in: that many blocks of memcpy.
    memcpy_req = [len(c.keys) * memcpy_s for c in chains]
    out: dict[str, Any] = {
        "hit_rate": statistics.median(rates),
        "hit_rates": rates,
        "hit_rate_halves": half_hit_rates(best.hits, chains),
        "requests_per_s": statistics.median(r.requests_per_s for r in runs),
        "p50_ms": statistics.median(percentile(r.latency_s, 0.5) * 1e3 for r in runs),
        "p99_ms": statistics.median(percentile(r.latency_s, 0.99) * 1e3 for r in runs),
        "time_over_memcpy": statistics.median(sum(r.latency_s) / sum(memcpy_req) for r in runs),
        "held_at_end": statistics.median(r.held_at_end for r in runs),
        "held_bytes_at_end": statistics.median(r.held_at_end for r in runs) * block_bytes,
        "extra": runs[-1].extra,
    }
    calls = runs[-1].extra.get("daemon_calls")
    if calls is not None:
        n = len(chains)
        out["time_per_request_ms"] = {
            "wall": sum(runs[-1].latency_s) / n * 1e3,
            "daemon": sum(t for t, _ in calls.values()) / n * 1e3,
            "memcpy": sum(memcpy_req) / n * 1e3,
            "calls": {
                m: {"per_request": c / n, "us_per_call": t / c * 1e6} for m, (t, c) in calls.items()
            },
        }
    return out


def rate(x: float) -> str:
    """A hit rate as the tables print it (four decimals: the differences are small)."""
    return f"{x:.4f}"


def sim_dict(s: SimResult) -> dict[str, Any]:
    return {
        "hit_rate": s.hit_rate,
        "hit_rate_halves": s.half_hit_rates(),
        "capacity_blocks": s.capacity_blocks,
        "held_at_end": s.held_at_end,
    }


TABLE_HEADERS = (
    "store",
    "hit rate",
    "blocks at end",
    "x LRU sim",
    "req/s",
    "p50 ms",
    "p99 ms",
    "x memcpy",
)
SIM_ROWS = (
    ("unbounded", "unbounded cache (bound)"),
    ("lru", "exact LRU simulation"),
    ("lru_dedup", "  the same, put leaves stored blocks alone"),
    ("prefix", "exact prefix-aware simulation"),
    ("2q", "exact 2Q simulation"),
    ("arc", "exact ARC simulation"),
    ("s3fifo", "exact S3-FIFO simulation"),
    ("lfu", "exact LFU simulation (naive frequency)"),
    ("lru_cpu_nvme", "exact LRU simulation at CPU+NVMe bytes"),
    ("lru_cpu_nvme_slots", "  the same at the blocks the NVMe tier holds"),
)

NVME_PAGE = 4096
"""An NVMe record is a header page plus its payload in whole pages (docs/configuration.md)."""


def nvme_blocks(nvme_bytes: int, block_bytes: int) -> int:
    """How many blocks an NVMe tier of ``nvme_bytes`` holds."""
    return nvme_bytes // (NVME_PAGE + -(-block_bytes // NVME_PAGE) * NVME_PAGE)


def simulations(
    chains: list[Chain], cap: int, nvme_cap: int = 0, nvme_slots: int = 0
) -> dict[str, SimResult]:
    """The references: textbook LRU (a put of a stored block is a use of it), LRU with
    kvstore's put semantics (stored blocks deduplicated, untouched), kvstore's prefix-aware
    order (with its put semantics), and the unbounded cache; with ``nvme_cap``, also textbook
    LRU at the CPU and NVMe tiers' bytes together (one cache of ``cap + nvme_cap`` blocks: the
    most two tiers can hold, as an NVMe tier below the CPU one holds what the CPU tier evicted),
    and at the blocks the NVMe tier really holds (``nvme_slots``: each takes a header page);
    and the frequency-aware policies of ``_policy_sims`` (with kvstore's put semantics)."""
    sims = {
        "unbounded": simulate(chains, None),
        "lru": simulate(chains, cap, "lru"),
        "lru_dedup": simulate(chains, cap, "lru", put_touches=False),
        "prefix": simulate(chains, cap, "prefix", put_touches=False),
    }
    sims.update({p: simulate_policy(chains, cap, p) for p in FREQUENCY_POLICIES})
    if nvme_cap:
        sims["lru_cpu_nvme"] = simulate(chains, cap + nvme_cap, "lru")
    if nvme_slots:
        sims["lru_cpu_nvme_slots"] = simulate(chains, cap + nvme_slots, "lru")
    return sims


CLEAR_MARGIN = 0.02
"""An eviction order replaces LRU only if it beats it by this much on both halves."""


def eviction_orders(sims: dict[str, SimResult]) -> list[dict[str, Any]]:
    """Each other order's hit rate against LRU with kvstore's put semantics (``lru_dedup``),
    over the whole trace and each half, and whether it wins clearly on both."""
    base = sims["lru_dedup"]
    b1, b2 = base.half_hit_rates()
    out = []
    for key in ("prefix", *FREQUENCY_POLICIES):
        if key not in sims:
            continue
        h1, h2 = sims[key].half_hit_rates()
        if not (b1 and b2 and base.hit_rate):
            continue  # a replay too short to have hits in both halves (a smoke run)
        halves = (h1 / b1, h2 / b2)
        overall = sims[key].hit_rate / base.hit_rate
        if min(halves) >= 1 + CLEAR_MARGIN:
            verdict_ = "wins on both halves"
        elif overall < 1:
            verdict_ = "loses"
        else:
            verdict_ = "no clear win"
        out.append({"order": key, "overall": overall, "halves": halves, "verdict": verdict_})
    return out


def report(
    rep: Reporter,
    chains: list[Chain],
    cap: int,
    bb: int,
    runs: int,
    sims: dict[str, SimResult],
    stores: dict[str, dict[str, Any]],
) -> dict[str, Any] | None:
    """Print the replay's tables; returns the LRU-against-simulation verdict (None without
    an LRU replay)."""
    sim_lru = sims["lru"].hit_rate
    sim_dedup = sims["lru_dedup"].hit_rate
    rows: list[list[Any]] = []
    for key, label in SIM_ROWS:
        if key not in sims:
            continue
        s = sims[key]
        rows.append([label, rate(s.hit_rate), s.held_at_end, s.hit_rate / sim_lru] + [None] * 4)
    for name, st in stores.items():
        rows.append(
            [
                name,
                rate(st["hit_rate"]),
                st["held_at_end"],
                st["hit_rate"] / sim_lru,
                st["requests_per_s"],
                st["p50_ms"],
                st["p99_ms"],
                st["time_over_memcpy"],
            ]
        )
    rep.table(
        f"Replay of {len(chains)} requests, capacity {cap} blocks of {fmt_size(bb)}; medians "
        f"of {runs} run(s)",
        TABLE_HEADERS,
        rows,
    )
    redis_rps = stores.get("redis allkeys-lru", {}).get("requests_per_s")
    ratio_rows: list[list[Any]] = []
    if redis_rps:
        for name, st in stores.items():
            if name.startswith("kvstore"):
                ratio_rows.append(
                    [f"{name}: req/s / redis req/s", st["requests_per_s"] / redis_rps]
                )
    shm = stores.get("mooncake shm", {}).get("requests_per_s")
    if shm:
        for name, st in stores.items():
            if name.startswith("kvstore"):
                ratio_rows.append(
                    [f"{name}: req/s / mooncake shm req/s", st["requests_per_s"] / shm]
                )
    if "lru_cpu_nvme" in sims:
        for name, st in stores.items():
            if name.endswith("+ NVMe"):
                ratio_rows.append(
                    [
                        f"{name} hit rate / LRU sim at CPU+NVMe bytes",
                        st["hit_rate"] / sims["lru_cpu_nvme"].hit_rate,
                    ]
                )
                if "lru_cpu_nvme_slots" in sims:
                    ratio_rows.append(
                        [
                            f"{name} hit rate / LRU sim at the blocks the tiers hold",
                            st["hit_rate"] / sims["lru_cpu_nvme_slots"].hit_rate,
                        ]
                    )
    for name, st in stores.items():
        if name.startswith("mooncake"):
            ratio_rows.append([f"{name} hit rate / LRU sim", st["hit_rate"] / sim_lru])
    lru = stores.get("kvstore lru")
    verdict_: dict[str, Any] | None = None
    if lru is not None:
        value = lru["hit_rate"] / sim_lru
        status = "PASS" if value >= LRU_TARGET else "MISS"
        dedup = lru["hit_rate"] / sim_dedup
        verdict_ = {"value": value, "over_dedup_sim": dedup, "target": LRU_TARGET, "status": status}
        ratio_rows.append([f"kvstore lru hit rate / LRU sim (>= {LRU_TARGET}: {status})", value])
        ratio_rows.append(["kvstore lru hit rate / LRU sim, put leaves stored alone", dedup])
    if ratio_rows:
        rep.table("Ratios", ["ratio", "x"], [[k, f"{v:.3f}"] for k, v in ratio_rows])
    halves = [[name, *map(rate, st["hit_rate_halves"])] for name, st in stores.items()]
    halves += [
        [label.strip(), *map(rate, sims[k].half_hit_rates())] for k, label in SIM_ROWS if k in sims
    ]
    rep.table("Hit rate by half of the trace", ["store", "first half", "second half"], halves)
    order_rows = []
    for row in eviction_orders(sims):
        order_rows.append([row["order"], row["overall"], *row["halves"], row["verdict"]])
    rep.table(
        "Eviction orders against LRU with the same put semantics (x LRU; a clear win is >= "
        f"{1 + CLEAR_MARGIN:g}x on both halves)",
        ["order", "whole trace", "first half", "second half", "verdict"],
        order_rows,
    )
    report_time_split(rep, stores)
    red = stores.get("redis allkeys-lru")
    if red is not None:
        ex = red["extra"]
        rep.line(
            f"  redis: {red['held_at_end']:.0f} keys held at the end ({cap} fit the bytes), "
            f"used_memory {ex['used_memory'] / (1 << 20):.1f} MiB = "
            f"{ex['used_over_payload']:.3f} x keys x block bytes "
            f"({ex['memory_per_block_bytes']:.0f} B per block; "
            f"{ex['over_payload_less_empty']:.3f} x without the empty server's "
            f"{ex['used_memory_empty'] / (1 << 20):.1f} MiB); allkeys-lru samples "
            f"{ex['maxmemory_samples']} keys per eviction on a 1 s LRU clock"
        )
    for name, st in stores.items():
        ex = st["extra"]
        if "nvme_blocks_at_end" in ex:
            rep.line(
                f"  {name}: {ex['cpu_blocks_at_end']} blocks in CPU + {ex['nvme_blocks_at_end']} "
                f"on NVMe at the end ({fmt_size(ex['nvme_capacity_bytes'])} NVMe tier); "
                f"{ex['nvme_demotions']} blocks written down to NVMe, {ex['nvme_promotions']} "
                f"read back up (hits served from NVMe), {ex['nvme_evictions']} dropped from NVMe"
            )
        if name.startswith("mooncake"):
            raised = " (raised to Mooncake's 16 MiB minimum)" if ex["segment_raised"] else ""
            rep.line(
                f"  {name}: {st['held_at_end']:.0f} blocks held at the end ({cap} fit the "
                f"bytes), {ex['allocated_over_capacity']:.1%} of its "
                f"{fmt_size(ex['segment_bytes'])} segment{raised} allocated; "
                f"{ex['evicted_keys']} keys evicted in "
                f"{ex['eviction_rounds']} rounds; puts refused for space (-200) "
                f"{ex['puts_refused_no_space']}, already stored (-705) "
                f"{ex['puts_already_stored']}; gone between exist and get "
                f"{ex['get_lost_after_exist']}"
            )
    for name, st in stores.items():
        refused = st["extra"].get("puts_refused")
        if refused:
            rep.line(
                f"  {name}: {refused} puts refused (CapacityError), the first at request "
                f"{st['extra']['first_refused_request']}"
            )
    return verdict_


SPLIT_METHODS = ("Acquire", "Reserve", "Commit", "Bind")


def report_time_split(rep: Reporter, stores: dict[str, dict[str, Any]]) -> None:
    """Where a kvstore request's time goes (the last run of each): its wall time in store
    calls, the daemon's own time serving its calls (from the daemon's metrics; a put that
    does not wait is served while the client goes on, so the two overlap), by method, and the
    memcpy of its blocks."""
    rows = []
    for name, st in stores.items():
        split = st.get("time_per_request_ms")
        if split is None:
            continue
        calls = split["calls"]
        cells = []
        for method in SPLIT_METHODS:
            c = calls.get(method)
            cells.append(f"{c['per_request']:.2f} x {c['us_per_call']:.0f}" if c else "-")
        others = sum(
            c["per_request"] * c["us_per_call"] for m, c in calls.items() if m not in SPLIT_METHODS
        )
        rows.append(
            [
                name,
                split["wall"],
                split["daemon"],
                f"{split['daemon'] / split['wall']:.0%}",
                *cells,
                f"{others / 1e3:.3f}",
                split["memcpy"],
            ]
        )
    if rows:
        rep.table(
            "Where a kvstore request's time goes (per request; by method: calls per request x "
            "us the daemon spent on each, from its /metrics)",
            [
                "store",
                "wall ms",
                "daemon ms",
                "daemon/wall",
                *SPLIT_METHODS,
                "other ms",
                "memcpy ms",
            ],
            rows,
        )


# --------------------------------------------------------------------------- sweep
def run_sweep(
    chains: list[Chain],
    content: BlockContent,
    distinct: int,
    policies: list[str],
    no_spare: bool,
    rep: Reporter,
    plot_path: str,
) -> dict[str, Any]:
    """Hit rate at each capacity of ``SWEEP_FRACS``: the simulations and one replay per kvstore
    policy (and, with ``no_spare``, LRU with ``limits.max_spare = 0``)."""
    longest = max(len(c.keys) for c in chains)
    blocks = sum(len(c.keys) for c in chains)
    runs = [(p, False) for p in policies] + ([("lru", True)] if no_spare else [])
    rows = []
    points: list[dict[str, Any]] = []
    for frac in SWEEP_FRACS:
        cap = capacity_for(frac, distinct, longest)
        sims = simulations(chains, cap)
        point: dict[str, Any] = {"capacity_frac": frac, "capacity_blocks": cap}
        point.update({f"sim_{k}": v.hit_rate for k, v in sims.items()})
        for policy, bare in runs:
            name = f"kvstore_{policy}" + ("_no_spare" if bare else "")
            label = f"sweep {frac:.0%} {name}"
            r = replay_kvstore(chains, content, cap * content.block_bytes, policy, rep, label, bare)
            point[name] = r.hit_rate(blocks)
            point[f"{name}_held"] = r.held_at_end
            point[f"{name}_puts_refused"] = r.extra["puts_refused"]
        if "kvstore_lru" in point:
            point["lru_over_sim"] = point["kvstore_lru"] / point["sim_lru"]
        points.append(point)
        rep.line(f"  sweep {frac:.0%} ({cap} blocks) done")
        row = [f"{frac:.0%} ({cap})", rate(point["sim_lru"]), rate(point["sim_prefix"])]
        row += [rate(point[f"sim_{p}"]) for p in SWEEP_ORDERS]
        row += [rate(point[f"kvstore_{p}" + ("_no_spare" if b else "")]) for p, b in runs]
        over = point.get("lru_over_sim")
        row += [f"{over:.3f}" if over is not None else None, rate(point["sim_unbounded"])]
        rows.append(row)
    heads = ["capacity (blocks)", "LRU sim", "prefix sim"]
    heads += [f"{p} sim" for p in SWEEP_ORDERS]
    heads += [f"kvstore {p}" + (", max_spare 0" if b else "") for p, b in runs]
    heads += ["kv lru / sim", "unbounded"]
    rep.table(
        "Sweep: hit rate against capacity (share of distinct blocks), one run each", heads, rows
    )
    plotted = plot_sweep(points, runs, plot_path, rep) if plot_path else None
    return {"points": points, "plot": plotted}


def plot_sweep(
    points: list[dict[str, Any]], runs: list[tuple[str, bool]], path: str, rep: Reporter
) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        rep.line("  plot skipped: matplotlib is not installed here (the table above has it)")
        return None
    xs = [100 * p["capacity_frac"] for p in points]
    fig, (ax, ax2) = plt.subplots(
        2, 1, figsize=(7, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    ax.plot(xs, [p["sim_unbounded"] for p in points], "k--", label="unbounded cache")
    ax.plot(xs, [p["sim_lru"] for p in points], "k-o", label="exact LRU simulation")
    ax2.axhline(1.0, color="k", lw=1)
    for order in SWEEP_ORDERS:  # the frequency-aware orders, against LRU with the same puts
        ax2.plot(
            xs,
            [p[f"sim_{order}"] / p["sim_lru_dedup"] for p in points],
            ls="--",
            lw=1,
            label=f"{order} simulation / LRU",
        )
    ax2.axhline(LRU_TARGET, color="k", ls=":", lw=1, label=f"{LRU_TARGET} x simulation")
    for policy, bare in runs:
        name = f"kvstore_{policy}" + ("_no_spare" if bare else "")
        label = f"kvstore {policy}" + (", max_spare 0" if bare else "")
        ax.plot(xs, [p[name] for p in points], marker="x", label=label)
        ax2.plot(xs, [p[name] / p["sim_lru"] for p in points], marker="x", label=label)
    ax.set_ylabel("prefix block-hit rate")
    ax.set_title("FAST'25 synthetic trace replayed at storage level")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax2.set_xlabel("CPU tier capacity, % of the trace's distinct blocks")
    ax2.set_ylabel("hit rate / LRU simulation")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    rep.line(f"  plot written to {path}")
    return path


# --------------------------------------------------------------------------- main
def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, help="trace file (default: the synthetic trace)")
    p.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--capacity-frac", type=float, default=None, help="CPU tier / distinct blocks")
    p.add_argument("--block-kib", type=int, default=16, help="block size (multiple of 4)")
    p.add_argument("--runs", type=int, default=None, help="rounds (medians over them)")
    p.add_argument("--policies", default=",".join(POLICIES), help="kvstore policies to replay")
    p.add_argument("--no-redis", action="store_true", help="leave the Redis peer out")
    p.add_argument(
        "--skip-no-spare",
        action="store_true",
        help="leave out the LRU replay with limits.max_spare = 0 (no slots held ahead for puts)",
    )
    p.add_argument(
        "--skip-waiting-puts",
        action="store_true",
        help="leave out the LRU replay whose puts wait for their commit",
    )
    p.add_argument(
        "--nvme-frac",
        type=float,
        default=None,
        help=f"NVMe tier / distinct blocks for the CPU+NVMe replay (default {NVME_MULTIPLE}x "
        "the CPU tier's); 0 leaves that replay out",
    )
    p.add_argument(
        "--nvme-dir",
        default=None,
        help="folder under which the NVMe tier's fresh directory is made (default: the temp dir)",
    )
    p.add_argument(
        "--mooncake-modes",
        default=None,
        help=f"Mooncake Store replays, of {','.join(MOONCAKE_MODES)} (default all; with --smoke "
        f"{','.join(MOONCAKE_SMOKE_MODES)}); '' leaves Mooncake out",
    )
    p.add_argument("--sweep", action="store_true", help="hit rate against capacity, plotted")
    p.add_argument("--plot", default="var/trace-sweep.png", help="PNG of the sweep ('' for none)")


def skip_missing_trace(args: argparse.Namespace, path: Path) -> int:
    """The trace is not here: measure nothing and say so, with the harness's skip status."""
    reason = f"the trace {path} is not here (--trace names another)"
    print(f"SKIPPED ({benchmark_name()}): needs file:{path}: {reason}", file=sys.stderr)
    emit({"skipped": {"needs": f"file:{path}", "reason": reason}}, args)
    return SKIP_EXIT


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0], add_args)
    trace = Path(args.trace) if args.trace else default_trace_path()
    if not trace.exists():
        return skip_missing_trace(args, trace)
    limit = args.requests or (SMOKE_REQUESTS if args.smoke else None)
    frac = args.capacity_frac or (0.05 if args.smoke else 0.10)
    runs = args.runs or (1 if args.quick else 3)
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            raise SystemExit(f"unknown policy {p!r}; kvstore offers {', '.join(POLICIES)}")
    nvme_frac = NVME_MULTIPLE * frac if args.nvme_frac is None else args.nvme_frac
    if args.mooncake_modes is None:
        mc_modes = list(MOONCAKE_SMOKE_MODES if args.smoke else MOONCAKE_MODES)
    else:
        mc_modes = [m for m in args.mooncake_modes.split(",") if m]
    for m in mc_modes:
        if m not in MOONCAKE_MODES:
            raise SystemExit(f"unknown Mooncake mode {m!r}; one of {', '.join(MOONCAKE_MODES)}")
    mc_skipped = mooncake_missing() if mc_modes else None
    use_redis = not args.no_redis
    if use_redis and redis_server_path() is None:
        raise RuntimeError("redis-server not found: the Redis peer is part of the run (--no-redis)")
    rep = Reporter(args.json)
    if not args.json:
        print_header("bench_trace", args)
    started = time.monotonic()

    chains = load_trace(trace, limit)
    distinct = distinct_blocks(chains)
    longest = max(len(c.keys) for c in chains)
    blocks = sum(len(c.keys) for c in chains)
    bb = args.block_kib << 10
    content = BlockContent(bb)
    cap = capacity_for(frac, distinct, longest)
    capacity_bytes = cap * bb
    nvme_cap = int(nvme_frac * distinct) if "lru" in policies else 0
    rep.line(
        f"  trace {trace.name}: {len(chains)} requests, {blocks} blocks asked, {distinct} "
        f"distinct, longest request {longest}; {fmt_size(bb)} blocks"
    )
    rep.line(
        f"  capacity {cap} blocks = {capacity_bytes / (1 << 20):.1f} MiB "
        f"({cap / distinct:.1%} of the distinct blocks"
        + (f"; raised from {frac:.0%} to fit the longest request" if cap > frac * distinct else "")
        + f"), {runs} run(s), policies {', '.join(policies)}"
    )
    if nvme_cap:
        rep.line(
            f"  CPU+NVMe replay (lru): NVMe tier {nvme_cap} blocks = "
            f"{nvme_cap * bb / (1 << 20):.1f} MiB ({nvme_cap / distinct:.1%} of the distinct "
            f"blocks, {nvme_cap / cap:.1f}x the CPU tier), a fresh directory each run; it "
            f"holds {nvme_blocks(nvme_cap * bb, bb)} blocks (a header page each)"
        )
    if mc_skipped:
        rep.line(f"  Mooncake Store SKIPPED: {mc_skipped}")
    elif mc_modes:
        rep.line(f"  Mooncake Store modes: {', '.join(mc_modes)}, each run starting empty")

    sims = simulations(chains, cap, nvme_cap, nvme_blocks(nvme_cap * bb, bb) if nvme_cap else 0)
    memcpy_s = memcpy_block_s(bb, (4 if args.smoke else 64) << 20)
    rep.line(f"  memcpy of one block (np.copyto, 1 thread): {memcpy_s * 1e6:.2f} us")

    per_store: dict[str, list[Replay]] = {}

    def note(r: Replay, label: str) -> None:
        per_store.setdefault(r.store, []).append(r)
        refused = r.extra.get("puts_refused")
        rep.line(
            f"  {label}: hit rate {r.hit_rate(blocks):.4f}, {r.requests_per_s:.0f} req/s, "
            f"{r.held_at_end} blocks held" + (f", {refused} puts refused" if refused else "")
        )

    for run in range(runs):
        for policy in policies:
            label = f"kvstore {policy} run {run + 1}"
            note(replay_kvstore(chains, content, capacity_bytes, policy, rep, label), label)
        if not args.skip_waiting_puts and "lru" in policies:
            label = f"kvstore lru, puts wait, run {run + 1}"
            r = replay_kvstore(chains, content, capacity_bytes, "lru", rep, label, put_wait=True)
            note(r, label)
        if not args.skip_no_spare and "lru" in policies:
            label = f"kvstore lru, max_spare 0, run {run + 1}"
            r = replay_kvstore(chains, content, capacity_bytes, "lru", rep, label, no_spare=True)
            note(r, label)
        if nvme_cap:
            label = f"kvstore lru + NVMe run {run + 1}"
            r = replay_kvstore(
                chains,
                content,
                capacity_bytes,
                "lru",
                rep,
                label,
                nvme_bytes=nvme_cap * bb,
                nvme_parent=args.nvme_dir,
            )
            note(r, label)
        if use_redis:
            label = f"redis run {run + 1}"
            note(replay_redis(chains, content, capacity_bytes, rep, label), label)
        for mode in [] if mc_skipped else mc_modes:
            label = f"mooncake {mode} run {run + 1}"
            r = replay_mooncake(mode, trace, limit, capacity_bytes, bb, rep, label)
            note(r, label)
    stores = {name: summarize_runs(rs, chains, memcpy_s, bb) for name, rs in per_store.items()}
    status = report(rep, chains, cap, bb, runs, sims, stores)

    sweep = None
    if args.sweep:
        no_spare = not args.skip_no_spare and "lru" in policies
        sweep = run_sweep(chains, content, distinct, policies, no_spare, rep, args.plot)
    elapsed = time.monotonic() - started
    rep.line(f"elapsed {elapsed:.0f}s; load {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    emit(
        {
            "trace": trace.name,
            "requests": len(chains),
            "blocks": blocks,
            "distinct_blocks": distinct,
            "block_bytes": bb,
            "capacity_frac": frac,
            "capacity_blocks": cap,
            "capacity_bytes": capacity_bytes,
            "nvme_capacity_blocks": nvme_cap,
            "nvme_capacity_bytes": nvme_cap * bb,
            "mooncake_modes": mc_modes,
            "mooncake_skipped": mc_skipped,
            "runs": runs,
            "memcpy_block_us": memcpy_s * 1e6,
            "simulation": {k: sim_dict(v) for k, v in sims.items()},
            "eviction_orders": eviction_orders(sims),
            "stores": stores,
            "lru_over_sim": status,
            "sweep": sweep,
            "elapsed_s": elapsed,
        },
        args,
    )
    return 0


if __name__ == "__main__":
    with contextlib.suppress(AttributeError):
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    run_main(main)
