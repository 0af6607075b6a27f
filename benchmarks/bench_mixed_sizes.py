"""Utilisation of the CPU tier under mixed-block-size churn, against the same churn with one
block size.

A real ``kvstore.daemon.store.BlockStore`` in process (no daemon, no RPCs), driven through its
own protocol on its event loop: ``reserve``, a copy of each block into the arena slot,
``commit`` with bound checksums (``kvstore.checksum.block_checksum``), ``acquire`` / verify /
``release`` for gets. A CPU tier of 256 MiB with the default 64 MiB slab setting (the allocator
makes slabs of capacity/16 = 16 MiB), no NVMe, no Redis, so eviction drops blocks.

Workload (seeded, generated once): namespaces whose layouts give blocks of 64 KiB (1 layer),
256 KiB (4 layers, two tenants), 512 KiB (8 layers, TP ranks 0 and 1) and 2 MiB (32 layers), all
bf16 x 16 tokens x 8 KV heads x 128 dims per layer. A fixed number of operations in phases; each
phase gives every block size a share of the bytes put (one size dominates, then another, then
an even mix). An operation is a put (batch of 1-32 blocks, keys never seen before, so every put
stores new blocks and, once the tier is full, evicts) or, with probability ``--get-share``, a
get of one of the 64 most recent puts (keeps the LRU order meaningful; blocks read are checked
byte for byte). The single-size baseline replays the very same stream with every namespace's
blocks of one size (``--single-kib``, default 256): each put stores the same bytes (rounded to
whole blocks, the remainder carried to the next put of that namespace), each get reads the
baseline's blocks of the same put.

Measured from ``--warmup-ops`` operations after the first eviction (the tier is full), sampled
every ``--sample-every`` operations:

* utilisation: bytes of committed blocks / tier capacity, from the store's per-namespace
  counters (``NamespaceRecord.blocks`` x ``block_bytes``; cross-checked against the CPU tier's
  ``used_bytes`` from ``store.tier_snapshots()``, equal whenever nothing is reserved);
* where the rest is (from ``allocator.slab_info``): free slots in slabs of the class that
  just put (``own``), free slots stranded in slabs of other classes (``stranded``), unassigned
  slabs (``pool``);
* per put: evictions (``store.cpu.evictions``), blocks moved by slab drains (a ``BlockStore``
  subclass counts successful ``relocate_cpu`` calls), slabs drained (calls of
  ``allocator.begin_drain``), evicted bytes per byte put;
* CapacityErrors (must be 0: nothing is leased between operations; any is exit status 1);
* put throughput (puts/s and GB/s over the time spent in puts: reserve, copy, checksum,
  commit) and gets' hit rate.

``store.check()`` (every invariant of the store and of the slab allocator) runs every
``--check-every`` operations and at the end; a broken invariant stops the run and is printed
with its traceback (exit status 1).

    .venv/bin/python benchmarks/bench_mixed_sizes.py [--quick] [--json]    # ~1-2 min
    .venv/bin/python benchmarks/bench_mixed_sizes.py --smoke   # a 160 MiB tier, 100 ops a phase
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import signal
import statistics
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from _harness import (
    Reporter,
    emit,
    fmt_size,
    parse_args,
    percentile,
    print_header,
    run_main,
)

KIB = 1 << 10
MIB = 1 << 20
CAPACITY = 256 * MIB
SLAB_SETTING = 64 * MIB  # the default; the allocator caps it at capacity / 16
OP_TIMEOUT_S = 30.0  # any one store call
RECENT_PUTS = 64  # gets pick one of the last RECENT_PUTS puts

# (name, model, tenant, layers, tp_rank, tp_size): layers x 64 KiB per block.
NAMESPACES: tuple[tuple[str, str, str, int, int, int], ...] = (
    ("draft-64k", "draft-1l", "", 1, 0, 1),
    ("chat-256k-a", "chat-4l", "alpha", 4, 0, 1),
    ("chat-256k-b", "chat-4l", "beta", 4, 0, 1),
    ("mid-512k-tp0", "mid-8l", "", 8, 0, 2),
    ("mid-512k-tp1", "mid-8l", "", 8, 1, 2),
    ("target-2m", "target-32l", "", 32, 0, 1),
)
SIZE_KIB = (64, 256, 512, 2048)
# Per phase: share of the bytes put by each block size (64K, 256K, 512K, 2M).
PHASES: tuple[tuple[str, tuple[float, ...]], ...] = (
    ("64K-heavy", (0.70, 0.10, 0.10, 0.10)),
    ("2M-heavy", (0.10, 0.10, 0.10, 0.70)),
    ("256K-heavy", (0.10, 0.70, 0.10, 0.10)),
    ("512K-heavy", (0.10, 0.10, 0.70, 0.10)),
    ("even", (0.25, 0.25, 0.25, 0.25)),
    ("64K+2M", (0.45, 0.05, 0.05, 0.45)),
)


class Broken(Exception):
    """store.check() raised: an invariant is broken."""


# --------------------------------------------------------------------------- the stream
@dataclass(frozen=True)
class Op:
    phase: int
    kind: str  # "put" | "get"
    ns: int  # index into NAMESPACES
    blocks: int = 0  # put: blocks of the namespace's own size
    target: int = -1  # get: index (into the stream) of the put it reads


def make_stream(seed: int, phase_ops: int, get_share: float) -> list[Op]:
    rng = random.Random(seed)
    by_size: dict[int, list[int]] = {}
    for i, spec in enumerate(NAMESPACES):
        by_size.setdefault(spec[3] * 64, []).append(i)
    ops: list[Op] = []
    recent: list[int] = []
    for p, (_, shares) in enumerate(PHASES):
        # A share of *bytes*: a size is chosen per put with probability share / size.
        weights = [s / k for s, k in zip(shares, SIZE_KIB, strict=True)]
        for _ in range(phase_ops):
            if recent and rng.random() < get_share:
                # Skewed to the newest: the square of a uniform picks young puts more often.
                target = recent[-1 - int(rng.random() ** 2 * len(recent))]
                ops.append(Op(p, "get", ops[target].ns, target=target))
                continue
            size = rng.choices(SIZE_KIB, weights)[0]
            ns = rng.choice(by_size[size])
            ops.append(Op(p, "put", ns, blocks=rng.randint(1, 32)))
            recent.append(len(ops) - 1)
            del recent[:-RECENT_PUTS]
    return ops


def layout_for(layers: int) -> Any:
    from kvstore import KVLayout

    return KVLayout(num_layers=layers, num_kv_heads=8, head_dim=128, block_size=16)


def namespaces_for(single_layers: int | None) -> list[Any]:
    from kvstore import Namespace

    out = []
    for _, model, tenant, layers, rank, size in NAMESPACES:
        lay = layout_for(single_layers or layers)
        model_name = f"{model}-single" if single_layers else model
        out.append(
            Namespace(model=model_name, layout=lay, tenant=tenant, tp_rank=rank, tp_size=size)
        )
    return out


# --------------------------------------------------------------------------- one run
@dataclass
class RunResult:
    label: str
    samples: list[dict[str, float]] = field(default_factory=list)
    capacity_errors: int = 0
    capacity_messages: list[str] = field(default_factory=list)
    puts: int = 0  # measured puts (after warm-up) that stored something
    put_bytes: int = 0
    put_bytes_by_kib: dict[int, int] = field(default_factory=lambda: dict.fromkeys(SIZE_KIB, 0))
    put_seconds: float = 0.0
    evictions: int = 0
    evicted_bytes: int = 0
    moved: int = 0
    moved_bytes: int = 0
    drains: int = 0
    get_blocks_asked: int = 0
    get_blocks_hit: int = 0
    wrong_blocks: int = 0
    checks: int = 0
    broken: str = ""  # traceback of a broken invariant
    wall_s: float = 0.0
    ops_done: int = 0
    truncated: bool = False
    checksum_failures: int = 0
    first_full_op: int = -1  # the first put that evicted
    start_op: int = -1  # the first measured operation


def counting_store_class() -> type:
    from kvstore.daemon.store import BlockStore

    class CountingStore(BlockStore):
        """The real store; counts the blocks a slab drain moves instead of evicting."""

        moved = 0
        moved_bytes = 0

        def relocate_cpu(self, eid: int, avoid_slab: int) -> bool:
            bb = self.block_bytes_of(eid)
            ok = super().relocate_cpu(eid, avoid_slab)
            if ok:
                self.moved += 1
                self.moved_bytes += bb
            return ok

    return CountingStore


def store_config(capacity: int) -> Any:
    from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig

    cpu = CpuTierConfig(capacity_bytes=capacity, slab_bytes=SLAB_SETTING, prefault=False)
    return DaemonConfig(gpu=GpuTierConfig(enabled="off"), cpu=cpu)


def key_of(label: str, op: int, i: int) -> bytes:
    return hashlib.blake2b(f"{label}:{op}:{i}".encode(), digest_size=32).digest()


class Source:
    """Block contents: a slice of one random buffer chosen by the key (cheap, and a block read
    back can be compared with exactly what was written)."""

    def __init__(self, seed: int) -> None:
        self.span = 64 * MIB
        rng = np.random.default_rng(seed)
        self.buf = rng.integers(0, 256, self.span + 2 * MIB, dtype=np.uint8)
        self.view = memoryview(self.buf)

    def block(self, key: bytes, size: int) -> memoryview:
        off = (int.from_bytes(key[:8], "little") % (self.span // 4096)) * 4096
        return self.view[off : off + size]


def slab_breakdown(store: Any, asking_slot: int) -> dict[str, int]:
    alloc = store.allocator
    own = stranded = pool = used = tail = 0
    for i in range(alloc.num_slabs):
        info = alloc.slab_info(i)
        if not info.slot_bytes:
            pool += info.size_bytes
            continue
        free = (info.slots - info.used) * info.slot_bytes
        used += info.used * info.slot_bytes
        tail += info.size_bytes - info.slots * info.slot_bytes
        if info.slot_bytes == asking_slot:
            own += free
        else:
            stranded += free
    return {"own": own, "stranded": stranded, "pool": pool, "slab_used": used, "tail": tail}


async def run_stream(
    label: str,
    stream: list[Op],
    single_layers: int | None,
    args: argparse.Namespace,
    source: Source,
    deadline: float,
) -> RunResult:
    from kvstore.checksum import block_checksum
    from kvstore.errors import CapacityError

    res = RunResult(label)
    namespaces = namespaces_for(single_layers)
    sizes = [ns.layout.block_bytes for ns in namespaces]
    fps = [ns.fingerprint for ns in namespaces]
    cls = counting_store_class()
    config = store_config(args.capacity)

    # Per-namespace carry of bytes the single-size replay still owes (whole blocks only).
    carry = [0] * len(namespaces)
    stream_sizes = [spec[3] * 64 * KIB for spec in NAMESPACES]
    put_keys: dict[int, list[bytes]] = {}

    store = cls(config)  # started and stopped as the daemon does (arena unlinked at the end)
    drains = 0
    begin_drain = store.allocator.begin_drain

    def counting_drain(slab: int) -> None:
        nonlocal drains
        drains += 1
        begin_drain(slab)

    store.allocator.begin_drain = counting_drain  # type: ignore[method-assign]
    try:
        await store.start()
        handles = [store.open_namespace(ns) for ns in namespaces]
        view = store.arena.view
        capacity = store.allocator.capacity_bytes
        asking_slot = 0
        base: dict[str, int] = {}
        t_start = time.perf_counter()

        def committed_bytes() -> int:
            return sum(r.blocks * r.block_bytes for r in store.namespaces())

        def check(where: str) -> None:
            res.checks += 1
            try:
                store.check()
            except AssertionError:
                res.broken = f"store.check() at {where}:\n{traceback.format_exc()}"
                raise Broken from None

        start_op = -1  # measuring starts --warmup-ops operations after the first eviction
        for i, op in enumerate(stream):
            if start_op < 0 and res.first_full_op >= 0:
                start_op = res.first_full_op + args.warmup_ops
            if i == start_op:
                res.start_op = i
                base = {
                    "evictions": store.cpu.evictions,
                    "moved": store.moved,
                    "moved_bytes": store.moved_bytes,
                    "drains": drains,
                }
            measuring = 0 <= start_op <= i
            if time.perf_counter() > deadline:
                res.truncated = True
                break
            h = handles[op.ns]
            bb = sizes[op.ns]
            if op.kind == "put":
                if single_layers:
                    carry[op.ns] += op.blocks * stream_sizes[op.ns]
                    n = carry[op.ns] // bb
                    carry[op.ns] -= n * bb
                else:
                    n = op.blocks
                keys = [key_of(label, i, j) for j in range(n)]
                put_keys[i] = keys
                if not n:
                    continue
                asking_slot = store.allocator.slot_bytes_for(bb)
                before = committed_bytes()
                t0 = time.perf_counter()
                try:
                    r = await asyncio.wait_for(store.reserve(h, keys), OP_TIMEOUT_S)
                except CapacityError as exc:
                    res.capacity_errors += 1
                    if len(res.capacity_messages) < 3:
                        res.capacity_messages.append(f"op {i}: {exc}")
                    continue
                sums = []
                for key, off in zip(keys, r.offsets, strict=True):
                    src = source.block(key, bb)
                    view[off : off + bb] = src
                    sums.append(block_checksum(src, fps[op.ns], key))
                store.commit(h, r.reservation_id, sums)
                dt = time.perf_counter() - t0
                after = committed_bytes()
                if res.first_full_op < 0 and store.cpu.evictions:
                    res.first_full_op = i
                if measuring:
                    res.puts += 1
                    res.put_bytes += n * bb
                    res.put_bytes_by_kib[bb // KIB] += n * bb
                    res.put_seconds += dt
                    res.evicted_bytes += before + n * bb - after
            else:
                keys = put_keys.get(op.target, [])
                if not keys:
                    continue
                lease = await asyncio.wait_for(store.acquire(h, keys), OP_TIMEOUT_S)
                try:
                    for key, off, csum in zip(keys, lease.offsets, lease.checksums, strict=False):
                        got = view[off : off + bb]
                        same = np.array_equal(
                            np.frombuffer(got, np.uint8),
                            np.frombuffer(source.block(key, bb), np.uint8),
                        )
                        if not same or block_checksum(got, fps[op.ns], key) != csum:
                            res.wrong_blocks += 1
                finally:
                    if lease.lease_id:
                        store.release(h, lease.lease_id)
                if measuring:
                    res.get_blocks_asked += len(keys)
                    res.get_blocks_hit += len(lease.offsets)
            res.ops_done = i + 1
            if measuring and (i - start_op) % args.sample_every == 0:
                snap = next(s for s in store.tier_snapshots() if s.name == "cpu")
                committed = committed_bytes()
                if committed != snap.used_bytes:
                    raise AssertionError(
                        f"op {i}: committed {committed} != cpu used_bytes {snap.used_bytes} "
                        "with nothing reserved"
                    )
                parts = slab_breakdown(store, asking_slot)
                res.samples.append(
                    {
                        "op": i,
                        "phase": op.phase,
                        "util": committed / capacity,
                        "own": parts["own"] / capacity,
                        "stranded": parts["stranded"] / capacity,
                        "pool": parts["pool"] / capacity,
                        "tail": parts["tail"] / capacity,
                    }
                )
            if args.check_every and i % args.check_every == 0:
                check(f"op {i}")
        check("the end")
        res.wall_s = time.perf_counter() - t_start
        if base:
            res.evictions = store.cpu.evictions - base["evictions"]
            res.moved = store.moved - base["moved"]
            res.moved_bytes = store.moved_bytes - base["moved_bytes"]
            res.drains = drains - base["drains"]
        res.checksum_failures = store.cpu.checksum_failures
    except Broken:
        pass
    finally:
        await asyncio.wait_for(store.stop(), OP_TIMEOUT_S)
    return res


# --------------------------------------------------------------------------- report
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def p10(xs: list[float]) -> float:
    return percentile(xs, 0.10) if xs else float("nan")


def summary(r: RunResult) -> dict[str, Any]:
    util = [s["util"] for s in r.samples]
    puts = max(r.puts, 1)
    return {
        "label": r.label,
        "samples": len(util),
        "util_median": med(util),
        "util_p10": p10(util),
        "util_min": min(util) if util else float("nan"),
        "own_free_median": med([s["own"] for s in r.samples]),
        "stranded_median": med([s["stranded"] for s in r.samples]),
        "stranded_p90": percentile([s["stranded"] for s in r.samples], 0.9) if util else 0.0,
        "pool_median": med([s["pool"] for s in r.samples]),
        "capacity_errors": r.capacity_errors,
        "capacity_messages": r.capacity_messages,
        "puts": r.puts,
        "put_bytes_by_kib": r.put_bytes_by_kib,
        "evictions_per_put": r.evictions / puts,
        "evicted_bytes_per_put_byte": r.evicted_bytes / max(r.put_bytes, 1),
        "moved_per_put": r.moved / puts,
        "moved_bytes_per_put_byte": r.moved_bytes / max(r.put_bytes, 1),
        "drains_per_put": r.drains / puts,
        "puts_per_s": r.puts / r.put_seconds if r.put_seconds else float("nan"),
        "put_gb_per_s": r.put_bytes / r.put_seconds / 1e9 if r.put_seconds else float("nan"),
        "ops_per_s": r.ops_done / r.wall_s if r.wall_s else float("nan"),
        "get_hit_rate": r.get_blocks_hit / r.get_blocks_asked if r.get_blocks_asked else 0.0,
        "wrong_blocks": r.wrong_blocks,
        "checksum_failures": r.checksum_failures,
        "checks": r.checks,
        "broken": r.broken,
        "truncated": r.truncated,
        "ops_done": r.ops_done,
        "first_full_op": r.first_full_op,
        "start_op": r.start_op,
        "wall_s": r.wall_s,
        "per_phase_util_median": [
            med([s["util"] for s in r.samples if s["phase"] == p]) for p in range(len(PHASES))
        ],
        "per_phase_util_p10": [
            p10([s["util"] for s in r.samples if s["phase"] == p]) for p in range(len(PHASES))
        ],
    }


def pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.1f}%"


def report(out: Reporter, runs: list[dict[str, Any]], args: Any) -> None:
    spec: list[tuple[str, str, Any]] = [
        ("utilisation, median", "util_median", pct),
        ("utilisation, p10", "util_p10", pct),
        ("utilisation, min", "util_min", pct),
        ("free in the putting class's slabs, median", "own_free_median", pct),
        ("free stranded in other classes' slabs, median", "stranded_median", pct),
        ("free stranded in other classes' slabs, p90", "stranded_p90", pct),
        ("unassigned slabs, median", "pool_median", pct),
        ("CapacityErrors", "capacity_errors", str),
        ("evictions per put (blocks)", "evictions_per_put", lambda v: f"{v:.2f}"),
        ("evicted bytes per byte put", "evicted_bytes_per_put_byte", lambda v: f"{v:.3f}"),
        ("blocks moved by drains per put", "moved_per_put", lambda v: f"{v:.2f}"),
        ("moved bytes per byte put", "moved_bytes_per_put_byte", lambda v: f"{v:.3f}"),
        ("slabs drained per put", "drains_per_put", lambda v: f"{v:.3f}"),
        ("puts / s (time in puts)", "puts_per_s", lambda v: f"{v:.0f}"),
        ("put GB/s (reserve+copy+checksum+commit)", "put_gb_per_s", lambda v: f"{v:.2f}"),
        ("operations / s (wall)", "ops_per_s", lambda v: f"{v:.0f}"),
        ("gets: blocks found", "get_hit_rate", pct),
        ("wrong blocks read", "wrong_blocks", str),
        ("store.check() calls (all passed)", "checks", str),
    ]
    rows = [(name, *(f(r[k]) for r in runs)) for name, k, f in spec]
    out.table(
        f"CPU tier {fmt_size(args.capacity)}, slabs {fmt_size(args.slab_bytes)}; samples every "
        f"{args.sample_every} ops from {args.warmup_ops} ops after the first eviction "
        f"({runs[0]['samples']} for mixed)",
        ["", *(r["label"] for r in runs)],
        rows,
    )
    prow = []
    for p, (name, shares) in enumerate(PHASES):
        share = "/".join(f"{int(100 * s)}" for s in shares)
        cells = []
        for r in runs:
            cells.append(
                f"{pct(r['per_phase_util_median'][p])} / {pct(r['per_phase_util_p10'][p])}"
            )
        prow.append((f"{p} {name} ({share})", *cells))
    out.table(
        "Utilisation per phase, median / p10 (phase: byte shares 64K/256K/512K/2M %)",
        ["phase", *(r["label"] for r in runs)],
        prow,
    )


def explain(out: Reporter, runs: list[dict[str, Any]]) -> None:
    mixed, singles = runs[0], runs[1:]
    line = lambda text: out.line(textwrap.fill(text, 100))  # noqa: E731
    by_kib = {r["kib"]: r for r in singles}
    base = by_kib.get(256) or singles[0]
    out.line()
    line(
        f"Mixed sizes keep {pct(mixed['util_median'])} of the tier in committed blocks "
        f"(median; p10 {pct(mixed['util_p10'])}) against {pct(base['util_median'])} "
        f"(p10 {pct(base['util_p10'])}) with one size. The rest is free slots: "
        f"{pct(mixed['stranded_median'])} stranded in slabs of classes that were not putting "
        f"and {pct(mixed['own_free_median'])} in the putting class's own slabs (the tail of a "
        "slab it took by draining another class's), and "
        f"{pct(mixed['pool_median'])} in unassigned slabs, medians."
    )
    line(
        f"Every put found room: {mixed['capacity_errors']} CapacityErrors mixed, "
        f"{sum(r['capacity_errors'] for r in singles)} single. The price of cross-size room: "
        f"{mixed['drains_per_put']:.3f} slab drains per put, {mixed['moved_per_put']:.2f} "
        f"blocks moved per put ({mixed['moved_bytes_per_put_byte']:.3f} bytes copied and "
        "checksummed per byte put); evicted bytes per byte put are "
        f"{mixed['evicted_bytes_per_put_byte']:.3f} (steady state: what goes in comes out)."
    )
    if all(k in by_kib for k in SIZE_KIB):
        # The put rate the mixed byte shares would have if mixing cost nothing: a harmonic
        # mean of each size's own single-size rate, weighted by the mixed run's bytes.
        nbytes = mixed["put_bytes_by_kib"]
        expect = sum(nbytes.values()) / sum(
            nbytes[k] / (by_kib[k]["put_gb_per_s"] * 1e9) for k in SIZE_KIB
        )
        mixed["put_gb_per_s_expected"] = expect / 1e9
        line(
            f"Put throughput: mixed {mixed['put_gb_per_s']:.2f} GB/s against "
            f"{expect / 1e9:.2f} GB/s expected from the single-size runs for the same byte "
            f"shares ({mixed['put_gb_per_s'] / expect * 1e9:.2f}x): small blocks cost more per "
            "byte whatever the mix; the ratio is what mixing itself costs (drains: copying, "
            "checksumming and re-indexing the moved blocks)."
        )


async def amain(args: argparse.Namespace) -> list[dict[str, Any]]:
    stream = make_stream(args.seed, args.phase_ops, args.get_share)
    source = Source(args.seed)
    plan: list[tuple[str, int | None]] = [("mixed", None)]
    plan += [(f"single {k}K", k // 64) for k in args.singles]
    out: list[dict[str, Any]] = []
    for label, layers in plan:
        deadline = time.perf_counter() + args.max_seconds / len(plan)
        res = await run_stream(label, stream, layers, args, source, deadline)
        summ = summary(res)
        summ["kib"] = layers * 64 if layers else 0
        out.append(summ)
    return out


def describe_stream(out: Reporter, args: argparse.Namespace) -> None:
    stream = make_stream(args.seed, args.phase_ops, args.get_share)
    rows = []
    for p, (name, _) in enumerate(PHASES):
        ops = [o for o in stream if o.phase == p]
        puts = [o for o in ops if o.kind == "put"]
        by_size = {k: 0 for k in SIZE_KIB}
        nbytes = {k: 0 for k in SIZE_KIB}
        for o in puts:
            k = NAMESPACES[o.ns][3] * 64
            by_size[k] += 1
            nbytes[k] += o.blocks * k * KIB
        total = sum(nbytes.values())
        rows.append(
            (
                f"{p} {name}",
                len(ops),
                len(puts),
                "/".join(str(by_size[k]) for k in SIZE_KIB),
                "/".join(f"{100 * nbytes[k] / total:.0f}" for k in SIZE_KIB),
                f"{total / args.capacity:.1f}x",
            )
        )
    out.table(
        f"Stream (seed {args.seed}, {len(stream)} ops, gets {100 * args.get_share:.0f}%)",
        ["phase", "ops", "puts", "puts 64K/256K/512K/2M", "bytes %", "bytes / tier"],
        rows,
    )


def extra_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--phase-ops", type=int, default=0, help="operations per phase")
    p.add_argument("--warmup-ops", type=int, default=0, help="operations after the first eviction")
    p.add_argument("--sample-every", type=int, default=10)
    p.add_argument("--check-every", type=int, default=250, help="store.check() period (ops)")
    p.add_argument("--get-share", type=float, default=0.25)
    p.add_argument(
        "--singles",
        default="",
        help="single-size baselines, KiB, comma-separated (default 64,256,512,2048; quick 256)",
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--max-seconds", type=float, default=150.0, help="soft budget, all runs")


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0], extra_args)
    args.phase_ops = args.phase_ops or (100 if args.smoke else 300 if args.quick else 2500)
    args.warmup_ops = args.warmup_ops or (10 if args.smoke else 50 if args.quick else 200)
    # Room for a put of 32 x 2 MiB within a handle's pinned bound (half the tier).
    args.capacity = 160 * MIB if args.smoke else CAPACITY
    args.singles = [
        int(k) for k in (args.singles or ("256" if args.quick else "64,256,512,2048")).split(",")
    ]
    if any(k not in SIZE_KIB for k in args.singles):
        raise SystemExit(f"--singles: sizes in KiB among {SIZE_KIB}")
    args.slab_bytes = min(SLAB_SETTING, args.capacity // 16)
    out = Reporter(args.json)
    if not args.json:
        print_header("bench_mixed_sizes", args)
    # A hard stop past the soft budget: nothing in process can hang the script.
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(args.max_seconds + 60))
    describe_stream(out, args)
    runs = asyncio.run(amain(args))
    signal.alarm(0)
    report(out, runs, args)
    explain(out, runs)
    status = 0
    for r in runs:
        if r["truncated"]:
            out.line(f"{r['label']}: budget reached after {r['ops_done']} ops (truncated)")
        out.line(
            f"{r['label']}: first eviction at op {r['first_full_op']}, measured from op "
            f"{r['start_op']} to {r['ops_done']} ({r['wall_s']:.1f} s)"
        )
        if r["start_op"] < 0:
            out.line(f"{r['label']}: the tier never filled: nothing measured")
            status = 1
        for m in r["capacity_messages"]:
            out.line(f"{r['label']}: CapacityError {m}")
        if r["capacity_errors"]:
            status = 1
        if r["broken"]:
            out.line(f"{r['label']}: BROKEN INVARIANT\n{r['broken']}")
            status = 1
        if r["wrong_blocks"] or r["checksum_failures"]:
            out.line(f"{r['label']}: {r['wrong_blocks']} wrong blocks read")
            status = 1
    emit({"args": vars(args), "runs": runs}, args)
    return status


def _alarm(signum: int, frame: object) -> None:
    raise TimeoutError("bench_mixed_sizes: hard time limit reached")


if __name__ == "__main__":
    run_main(main)
