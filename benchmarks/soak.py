"""Soak test: many client processes hammer one real daemon with small tiers for a bounded time,
and every block read is checked byte for byte. Not a pytest test: a script that stops by itself.

What it starts, all in private temp dirs, all stopped on exit, exception, Ctrl-C and SIGTERM:

* a real ``redis-server`` on a unix socket, ``maxmemory`` small (``--redis-maxmemory``,
  ``allkeys-lru``), so Redis evicts too;
* a real ``kvstore serve`` on a unix socket with a small CPU tier (``--cpu-capacity``, slabs of
  ``--cpu-slab``), a small NVMe tier in a temp dir (``--nvme-capacity``), the Redis tier, short
  lease and reservation TTLs (``--ttl``) so reclamation happens within the run;
* ``--clients`` worker processes (spawned), each holding one client per namespace. Four
  namespaces with three block sizes: ``a64`` and ``b64`` (64 KiB blocks, same model and layout,
  tenants ``alpha`` and ``beta``), ``c256`` (256 KiB) and ``d128`` (128 KiB). ``b64``, ``c256``
  and ``d128`` use the very same 32-byte keys (one chain of token hashes from a fixed seed, given
  to ``put``/``get`` as raw keys), so a store that mixed up namespaces, tenants or block sizes
  would serve one namespace's bytes for another's key; ``a64`` uses ``hash_tokens``.

Workers: transport ``shm`` or ``grpc`` (every third), the sync client or ``AsyncKVStoreClient``
with two concurrent tasks (every fourth), and "slow readers" (every fourth, from the third) that
read one 48-block run of 256 KiB blocks (12 MiB) again and again while the machine is busy. The
others mix put / get (half with ``out=``; half after a ``lookup``) / lookup / prefetch (half
followed by a get) / delete over a keyspace larger than all tiers together, with a skewed choice
of prompt so that some blocks stay hot (hits, promotions) and the tail drives eviction and
demotion. Every ``--kill-every`` seconds a worker caught in the middle of a ``put`` is
SIGKILLed and a replacement started.

Checks. Every block is derived from its namespace and key (a numpy generator seeded with
sha256(namespace identity + key)), so every block read is compared with what must be under
that key: a difference is a wrong block (must be 0). Misses are legal (eviction, deletes,
Redis eviction). Errors are counted by class; ``CapacityError`` and ``LeaseExpiredError`` are
legal under pressure, anything else is unexplained. After the run, with every client gone: the
daemon's active leases and reservations (``kvstore stat --json``) must drop to 0 within
2 x TTL + a few reaper intervals; then every key of the keyspace is deleted and the CPU tier's
used bytes must equal the namespaces' blocks x block bytes (both 0 then), with no block left
in the NVMe tier; a fresh put/get per namespace and transport must still round-trip; the
daemon must exit 0 on SIGTERM. Exit status 1 on any wrong block, leak, unexplained error, hang
or bad daemon exit.

``--smoke``: a run of a few seconds (2 clients, small tiers) that checks all of the above.
``--faults``: the soak with faults instead (daemon ``kill -9``s, a Redis restart, a full disk,
clients of two tenants under their own uids, a durable ledger), ``benchmarks/soak_faults.py``.

    PYTHONPATH=. .venv/bin/python benchmarks/soak.py [--seconds 60] [--clients 8] [--seed 1]
    PYTHONPATH=. .venv/bin/python benchmarks/soak.py --faults [--seconds 600] [--plot PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import random
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from _harness import (
    KVStoreDaemon,
    RedisServer,
    _env_with_our_kvstore,
    _tail,
    fmt_size,
    maybe_await,
    print_table,
    redis_server_path,
    run_main,
)

from kvstore import AsyncKVStoreClient, KVLayout, KVStoreClient, block_hashes
from kvstore.errors import UnavailableError

# --------------------------------------------------------------------------- the workload
MiB = 1 << 20
TOKENS_PER_BLOCK = 16
SHARED_KEY_SEED = hashlib.sha256(b"kvstore soak: keys shared by namespaces").digest()
SLOW_RUN_BLOCKS = 48  # blocks of the run a slow reader reads again and again (c256: 12 MiB)
SLOW_RUNS = 4  # distinct slow runs (slow readers take slot % SLOW_RUNS)
LEGAL_ERRORS = {
    "CapacityError": "a tier full of leased/reserved blocks refuses a put",
    "LeaseExpiredError": "a reservation outlived its TTL on a busy machine",
}


@dataclass(frozen=True)
class NsSpec:
    """One namespace of the soak: who it claims to be, its layout, how its keys are made."""

    name: str
    model: str
    tenant: str
    layers: int  # 8 KV heads x 128 dims x 16 tokens x bf16: 64 KiB per layer
    blocks_per_prompt: int
    shared_keys: bool  # raw keys from SHARED_KEY_SEED (same bytes in every such namespace)
    heads: int = 8  # KV heads (2: 16 KiB per layer)

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.layers, self.heads, 128, TOKENS_PER_BLOCK, torch.bfloat16)

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def ident(self) -> bytes:
        return f"{self.model}|{self.tenant}|{self.layers}|".encode()


NAMESPACES = (
    NsSpec("a64", "soak-llama", "alpha", 1, 24, shared_keys=False),
    NsSpec("b64", "soak-llama", "beta", 1, 24, shared_keys=True),
    NsSpec("c256", "soak-big", "alpha", 4, 12, shared_keys=True),
    NsSpec("d128", "soak-mid", "", 2, 16, shared_keys=True),
)
SLOW_NS = NAMESPACES[2]


def prompts_of(ns: NsSpec, keyspace_bytes: int) -> int:
    """Prompts of ``ns`` in the keyspace; slow runs come after them (ids ``prompts..``)."""
    return max(1, keyspace_bytes // (ns.blocks_per_prompt * ns.block_bytes))


def prompt_tokens(seed: int, prompt: int, n_blocks: int) -> np.ndarray:
    rng = np.random.default_rng([seed, prompt])
    return rng.integers(0, 50_000, n_blocks * TOKENS_PER_BLOCK, dtype=np.int64)


def expected_block(ns: NsSpec, key: bytes) -> np.ndarray:
    """The only bytes that may ever be read under ``key`` in ``ns``."""
    digest = hashlib.sha256(ns.ident + bytes(key)).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    return np.frombuffer(rng.bytes(ns.block_bytes), dtype=np.uint8)


def make_blocks(ns: NsSpec, keys: list[bytes]) -> torch.Tensor:
    raw = np.empty((len(keys), ns.block_bytes), dtype=np.uint8)
    for i, key in enumerate(keys):
        raw[i] = expected_block(ns, key)
    return torch.from_numpy(raw).view(torch.bfloat16).view(len(keys), *ns.layout.block_shape)


# --------------------------------------------------------------------------- shared counters
OPS = ("put", "get", "lookup", "prefetch", "delete", "slow_get")
OP_CODE = {op: i + 1 for i, op in enumerate(OPS)}  # 0: between operations
FIELDS = (
    *OPS,
    "blocks_put",  # blocks sent in puts
    "blocks_new",  # of which newly stored
    "blocks_asked",  # blocks asked for in gets
    "blocks_read",  # blocks returned (and verified)
    "race_misses",  # lookup said present, the get right after did not return it
    "wrong",
    "errors",
)
F = {name: i for i, name in enumerate(FIELDS)}
# Per slot, doubles: the operation in flight, when it started, 1.0 once the clients are open.
ST_OP, ST_T0, ST_READY, ST_N = 0, 1, 2, 3


class Shared:
    """Counters every worker process adds to and the parent reads: one row per slot, one
    writer per row (a replacement continues its killed predecessor's row). Raw shared memory,
    so a SIGKILLed worker cannot leave a lock held."""

    def __init__(self, ctx: Any, slots: int) -> None:
        self.slots = slots
        self.counts = ctx.RawArray("q", slots * len(FIELDS))
        self.state = ctx.RawArray("d", slots * ST_N)
        self.op_time = ctx.RawArray("d", slots * len(OPS) * 2)  # per op: total s, max s
        # time.monotonic() (one clock for every process) after which no operation starts.
        self.deadline = ctx.RawValue("d", time.monotonic() + 24 * 3600)

    def add(self, slot: int, field: str, n: int = 1) -> None:
        self.counts[slot * len(FIELDS) + F[field]] += n

    def total(self, field: str) -> int:
        i = F[field]
        return sum(self.counts[s * len(FIELDS) + i] for s in range(self.slots))

    def totals(self) -> dict[str, int]:
        return {f: self.total(f) for f in FIELDS}

    def set_op(self, slot: int, op: str | None) -> None:
        self.state[slot * ST_N + ST_T0] = time.monotonic()
        self.state[slot * ST_N + ST_OP] = OP_CODE[op] if op else 0

    def op_in_flight(self, slot: int) -> tuple[str | None, float]:
        code = int(self.state[slot * ST_N + ST_OP])
        since = time.monotonic() - self.state[slot * ST_N + ST_T0]
        return (OPS[code - 1] if code else None), since

    def timed(self, slot: int, op: str, seconds: float) -> None:
        base = (slot * len(OPS) + OPS.index(op)) * 2
        self.op_time[base] += seconds
        self.op_time[base + 1] = max(self.op_time[base + 1], seconds)

    def op_seconds(self, op: str) -> tuple[float, float]:
        """(total, max) seconds spent in successful ``op`` calls, all slots."""
        k = OPS.index(op)
        rows = [(s * len(OPS) + k) * 2 for s in range(self.slots)]
        return sum(self.op_time[r] for r in rows), max(self.op_time[r + 1] for r in rows)


# --------------------------------------------------------------------------- worker process
@dataclass(frozen=True)
class WorkerPlan:
    address: str
    parent_pid: int
    seed: int
    keyspace_bytes: int
    rpc_timeout_s: float
    transport: str  # "shm" or "grpc"
    api: str  # "sync" or "async"
    role: str  # "mixed" or "slow"
    events_path: str


def error_kind(exc: BaseException) -> str:
    """The class name, with the gRPC status when the message carries one (``INTERNAL: ...``,
    ``unreachable (DEADLINE_EXCEEDED)``)."""
    name = type(exc).__name__
    m = re.match(r"([A-Z][A-Z_]+): ", str(exc)) or re.search(r"\(([A-Z][A-Z_]+)\)", str(exc))
    return f"{name}({m.group(1)})" if m and name not in LEGAL_ERRORS else name


class Worker:
    """The operations of one worker process: one client per namespace, run by one asyncio task
    (sync clients: calls block the loop, which is all there is) or two (async client)."""

    def __init__(self, slot: int, plan: WorkerPlan, shared: Shared, clients: dict) -> None:
        self.slot = slot
        self.plan = plan
        self.shared = shared
        self.clients = clients
        self.rng = random.Random(plan.seed * 1000 + slot + int(time.time() * 1e6))
        self.prompts = {ns.name: prompts_of(ns, plan.keyspace_bytes) for ns in NAMESPACES}
        self.keys: dict[tuple[str, int], list[bytes]] = {}
        self.events = open(plan.events_path, "a", buffering=1)  # noqa: SIM115 (process lifetime)
        # Caller tensors for ``get(out=...)``, one set per task: the async workers run two
        # tasks at once, and a tensor shared between them would be overwritten by one get while
        # the other still checks it (a race in this script, not in the store).
        self.task = contextvars.ContextVar("task", default=0)
        self._outs = [
            {
                ns.name: torch.empty(
                    (ns.blocks_per_prompt, *ns.layout.block_shape), dtype=torch.bfloat16
                )
                for ns in NAMESPACES
            }
            for _ in range(2)
        ]
        self._slow_outs = [
            torch.empty((SLOW_RUN_BLOCKS, *SLOW_NS.layout.block_shape), dtype=torch.bfloat16)
            for _ in range(2)
        ]

    @property
    def outs(self) -> dict[str, torch.Tensor]:
        return self._outs[self.task.get()]

    @property
    def slow_out(self) -> torch.Tensor:
        return self._slow_outs[self.task.get()]

    def log(self, **event: Any) -> None:
        self.events.write(json.dumps({"t": round(time.time(), 3), **event}) + "\n")

    async def keys_of(self, ns: NsSpec, prompt: int, n_blocks: int) -> list[bytes]:
        cached = self.keys.get((ns.name, prompt))
        if cached is None:
            tokens = prompt_tokens(self.plan.seed, prompt, n_blocks)
            if ns.shared_keys:
                cached = block_hashes(SHARED_KEY_SEED, tokens, TOKENS_PER_BLOCK)
            else:
                cached = await maybe_await(self.clients[ns.name].hash_tokens(tokens))
            cached = [bytes(k) for k in cached]
            if len(self.keys) > 4096:
                self.keys.clear()
            self.keys[(ns.name, prompt)] = cached
        return cached

    def verify(self, ns: NsSpec, keys: list[bytes], got: torch.Tensor, op: str) -> int:
        """Compare every block of ``got`` (the answer to a get of ``keys``) with what must be
        under its key; returns how many blocks came back."""
        m = int(got.shape[0])
        if m > len(keys):
            self.shared.add(self.slot, "wrong", m - len(keys))
            self.log(
                event="wrong",
                op=op,
                ns=ns.name,
                key="-",
                first_bad_byte=-1,
                bad_bytes=-1,
                holds=f"{m} blocks returned for {len(keys)} keys",
            )
            m = len(keys)
            got = got[:m]
        rows = got.contiguous().view(torch.uint8).reshape(m, ns.block_bytes).numpy()
        for i in range(m):
            want = expected_block(ns, keys[i])
            if not np.array_equal(rows[i], want):
                self.shared.add(self.slot, "wrong")
                self.log(event="wrong", op=op, ns=ns.name, **describe_wrong(ns, keys[i], rows[i]))
        self.shared.add(self.slot, "blocks_read", m)
        return m

    async def timed(self, op: str, fn: Any) -> Any:
        """Run one client call (``fn()`` is a coroutine for the async client, the result itself
        for the sync one), marked in flight for the parent and timed."""
        self.shared.set_op(self.slot, op)
        t0 = time.perf_counter()
        try:
            result = await maybe_await(fn())
        except Exception as exc:
            exc.soak_op = op  # type: ignore[attr-defined]
            raise
        finally:
            self.shared.set_op(self.slot, None)
        self.shared.timed(self.slot, op, time.perf_counter() - t0)
        self.shared.add(self.slot, op)
        return result

    def pick(self) -> tuple[NsSpec, int]:
        ns = self.rng.choice(NAMESPACES)
        # Skewed: the first prompts are hot, the long tail keeps the tiers under pressure.
        return ns, int(self.prompts[ns.name] * self.rng.random() ** 3)

    async def one_mixed(self) -> None:
        ns, prompt = self.pick()
        kv = self.clients[ns.name]
        keys = await self.keys_of(ns, prompt, ns.blocks_per_prompt)
        r = self.rng.random()
        if r < 0.35:  # put a prefix of the prompt
            k = self.rng.randint(1, len(keys))
            blocks = make_blocks(ns, keys[:k])
            new = await self.timed("put", lambda: kv.put(keys[:k], blocks))
            self.shared.add(self.slot, "blocks_put", k)
            self.shared.add(self.slot, "blocks_new", int(new))
        elif r < 0.70:  # get, half of them after a lookup, half into a caller's tensor
            k = self.rng.randint(1, len(keys))
            asked = k
            looked = self.rng.random() < 0.5
            if looked:
                asked = await self.timed("lookup", lambda: kv.lookup(keys[:k]))
                if asked == 0:
                    return
            out = self.outs[ns.name] if self.rng.random() < 0.5 else None
            got = await self.timed("get", lambda: kv.get(keys[:asked], out=out))
            m = self.verify(ns, keys[:asked], got, "get")
            self.shared.add(self.slot, "blocks_asked", asked)
            if looked:  # lookup had just found all ``asked``
                self.shared.add(self.slot, "race_misses", asked - m)
        elif r < 0.80:
            await self.timed("lookup", lambda: kv.lookup(keys))
        elif r < 0.92:  # prefetch the whole prompt; half the time read it right after
            await self.timed("prefetch", lambda: kv.prefetch(keys))
            if self.rng.random() < 0.5:
                got = await self.timed("get", lambda: kv.get(keys))
                self.verify(ns, keys, got, "get")
                self.shared.add(self.slot, "blocks_asked", len(keys))
        else:  # delete a few blocks of a prompt
            i = self.rng.randrange(len(keys))
            doomed = keys[i : i + self.rng.randint(1, 4)]
            await self.timed("delete", lambda: kv.delete(doomed))

    async def one_slow(self) -> None:
        ns = SLOW_NS
        kv = self.clients[ns.name]
        run = self.prompts[ns.name] + self.slot % SLOW_RUNS
        keys = await self.keys_of(ns, run, SLOW_RUN_BLOCKS)
        n = await self.timed("lookup", lambda: kv.lookup(keys))
        if n < len(keys):
            blocks = make_blocks(ns, keys)
            new = await self.timed("put", lambda: kv.put(keys, blocks))
            self.shared.add(self.slot, "blocks_put", len(keys))
            self.shared.add(self.slot, "blocks_new", int(new))
        got = await self.timed("slow_get", lambda: kv.get(keys, out=self.slow_out))
        self.verify(ns, keys, got, "slow_get")
        self.shared.add(self.slot, "blocks_asked", len(keys))
        await asyncio.sleep(self.rng.uniform(0.0, 0.2))

    async def loop(self, task: int) -> None:
        self.task.set(task)  # each task runs in its own context: its own caller tensors
        one = self.one_slow if self.plan.role == "slow" else self.one_mixed
        shared = self.shared
        while time.monotonic() < shared.deadline.value and os.getppid() == self.plan.parent_pid:
            try:
                await one()
            except Exception as exc:  # counted and logged; the soak goes on
                self.shared.add(self.slot, "errors")
                op = getattr(exc, "soak_op", "soak")  # "soak": this script's own code raised
                self.log(event="error", op=op, kind=error_kind(exc), msg=str(exc)[:400])
                await asyncio.sleep(0.01)

    async def run(self) -> None:
        tasks = 2 if self.plan.api == "async" else 1
        await asyncio.gather(*(self.loop(i) for i in range(tasks)))


def describe_wrong(ns: NsSpec, key: bytes, row: np.ndarray) -> dict[str, Any]:
    """What a wrong block holds instead: zeros, another namespace's block for the same key, or
    something else; where it first differs and how much of it differs."""
    want = expected_block(ns, key)
    diff = np.flatnonzero(row != want)
    what = "zeros" if not row.any() else "unknown bytes"
    for other in NAMESPACES:
        same_size = other is not ns and other.block_bytes == ns.block_bytes
        if same_size and np.array_equal(row, expected_block(other, key)):
            what = f"namespace {other.name}'s block for this key"
    return {
        "key": bytes(key).hex()[:16],
        "first_bad_byte": int(diff[0]) if diff.size else -1,
        "bad_bytes": int(diff.size),
        "holds": what,
    }


def worker_main(slot: int, plan: WorkerPlan, shared: Shared) -> None:
    """Entry point of a worker process (spawned)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills us
    torch.set_num_threads(1)
    try:
        asyncio.run(_worker(slot, plan, shared))
    except BaseException:
        with open(plan.events_path, "a") as f:
            f.write(json.dumps({"event": "crash", "msg": traceback.format_exc()[-2000:]}) + "\n")
        raise


async def _worker(slot: int, plan: WorkerPlan, shared: Shared) -> None:
    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        for ns in NAMESPACES:
            kw = dict(
                layout=ns.layout,
                model=ns.model,
                tenant=ns.tenant,
                transport=plan.transport,
                timeout_s=plan.rpc_timeout_s,
            )
            if plan.api == "async":
                kv: Any = await stack.enter_async_context(AsyncKVStoreClient(plan.address, **kw))
            else:
                kv = stack.enter_context(KVStoreClient(plan.address, **kw))
            clients[ns.name] = kv
        shared.state[slot * ST_N + ST_READY] = 1.0
        await Worker(slot, plan, shared, clients).run()


# --------------------------------------------------------------------------- the parent
class Pool:
    """The worker processes. Leaving the ``with`` block SIGKILLs whatever still runs."""

    def __init__(self, args: argparse.Namespace, address: str, events_dir: str) -> None:
        self.ctx = mp.get_context("spawn")
        self.args = args
        self.address = address
        self.events_dir = events_dir
        self.shared = Shared(self.ctx, args.clients)
        self.procs: dict[int, Any] = {}
        self.gen: dict[int, int] = {}
        self.kills: list[dict[str, Any]] = []
        self.crashes: list[str] = []
        self.hung: list[str] = []

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs.values():
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        for p in self.procs.values():
            p.join(5)

    @property
    def deadline(self) -> float:
        return self.shared.deadline.value

    @deadline.setter
    def deadline(self, t: float) -> None:
        self.shared.deadline.value = t

    def ready(self) -> int:
        return sum(self.shared.state[s * ST_N + ST_READY] == 1.0 for s in self.procs)

    def plan(self, slot: int) -> WorkerPlan:
        transport = "grpc" if slot % 3 == 1 else "shm"
        api = "async" if slot % 4 == 3 else "sync"
        role = "slow" if slot % 4 == 2 else "mixed"
        gen = self.gen.get(slot, 0)
        return WorkerPlan(
            address=self.address,
            parent_pid=os.getpid(),
            seed=self.args.seed,
            keyspace_bytes=self.args.keyspace_mib * MiB,
            rpc_timeout_s=self.args.rpc_timeout,
            transport=transport,
            api=api,
            role=role,
            events_path=os.path.join(self.events_dir, f"w{slot}-g{gen}.jsonl"),
        )

    def describe(self, slot: int) -> str:
        p = self.plan(slot)
        return f"{p.role}/{p.api}/{p.transport}"

    def start(self, slot: int) -> None:
        self.shared.state[slot * ST_N + ST_READY] = 0.0
        self.shared.set_op(slot, None)
        proc = self.ctx.Process(
            target=worker_main, args=(slot, self.plan(slot), self.shared), daemon=True
        )
        proc.start()
        self.procs[slot] = proc

    def check_exits(self, now: float) -> None:
        """A worker that died without being killed by us is a crash: note it, replace it."""
        for slot, p in list(self.procs.items()):
            if p.exitcode is not None and p.exitcode != 0:
                self.crashes.append(f"worker {slot} ({self.describe(slot)}) exit {p.exitcode}")
                self.gen[slot] = self.gen.get(slot, 0) + 1
                if now < self.deadline - 5:
                    self.start(slot)
                else:
                    del self.procs[slot]

    def kill_one_mid_put(self, rng: random.Random, wait_s: float = 3.0) -> None:
        """SIGKILL a worker caught inside ``put`` (or any worker after ``wait_s``); start a
        replacement in its slot."""
        ready = [
            s
            for s, p in self.procs.items()
            if p.is_alive() and self.shared.state[s * ST_N + ST_READY] == 1.0
        ]
        if not ready:
            return
        rng.shuffle(ready)
        victim, op = ready[0], None
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            hit = [s for s in ready if self.shared.op_in_flight(s)[0] == "put"]
            if hit:
                victim, op = hit[0], "put"
                break
            time.sleep(0.002)
        else:
            op = self.shared.op_in_flight(victim)[0]
        proc = self.procs[victim]
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        self.kills.append({"slot": victim, "op": op or "between ops", "t": time.monotonic()})
        self.gen[victim] = self.gen.get(victim, 0) + 1
        self.start(victim)

    def stuck(self, limit_s: float) -> list[str]:
        out = []
        for slot, p in self.procs.items():
            op, since = self.shared.op_in_flight(slot)
            if p.is_alive() and op and since > limit_s:
                out.append(f"worker {slot} in {op} for {since:.0f}s")
        return out

    def finish(self, grace_s: float) -> None:
        """Wait for every worker to stop by itself; SIGKILL (and report as hung) the rest."""
        end = time.monotonic() + grace_s
        for slot, p in self.procs.items():
            p.join(max(0.1, end - time.monotonic()))
            if p.is_alive():
                op, since = self.shared.op_in_flight(slot)
                self.hung.append(
                    f"worker {slot} ({self.describe(slot)}) still in {op or 'no op'} "
                    f"({since:.0f}s) {grace_s:.0f}s after the deadline"
                )
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
            elif p.exitcode not in (0, None):
                self.crashes.append(f"worker {slot} ({self.describe(slot)}) exit {p.exitcode}")


def redis_command(path: str, *args: str, timeout_s: float = 5.0) -> bytes:
    """One command over RESP on a unix socket; returns the reply (bulk strings unwrapped)."""
    msg = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        s.sendall(msg.encode())
        buf = b""
        while b"\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        head, _, rest = buf.partition(b"\r\n")
        if head.startswith(b"$") and int(head[1:]) >= 0:
            need = int(head[1:]) + 2
            while len(rest) < need:
                chunk = s.recv(65536)
                if not chunk:
                    break
                rest += chunk
            return rest[: need - 2]
        if head.startswith(b"-"):
            raise RuntimeError(f"redis {args[0]}: {head.decode()}")
        return head


def redis_info(path: str) -> dict[str, str]:
    text = redis_command(path, "INFO").decode(errors="replace")
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def daemon_stats(address: str, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """``kvstore stat --json``; None (with the reason printed) if it fails or takes too long."""
    cmd = [sys.executable, "-m", "kvstore", "stat", "--json", "--address", address]
    try:
        r = subprocess.run(
            [*cmd, "--timeout", str(timeout_s)],
            capture_output=True,
            text=True,
            timeout=timeout_s + 30,
            env=_env_with_our_kvstore(),
        )
    except subprocess.TimeoutExpired:
        print(f"  kvstore stat: no answer within {timeout_s + 30:.0f}s", flush=True)
        return None
    if r.returncode != 0:
        print(f"  kvstore stat failed ({r.returncode}): {r.stderr.strip()[-300:]}", flush=True)
        return None
    return json.loads(r.stdout)


def tier(stats: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in stats["tiers"] if t["name"] == name), None)


def accounting(stats: dict[str, Any]) -> dict[str, int]:
    cpu = tier(stats, "cpu") or {}
    nvme = tier(stats, "nvme") or {}
    return {
        "leases": int(stats["active_leases"]),
        "reservations": int(stats["active_reservations"]),
        "cpu_used": int(cpu.get("used_bytes", 0)),
        "cpu_blocks": int(cpu.get("blocks", 0)),
        "cpu_reserved_blocks": int(cpu.get("extra", {}).get("reserved_blocks", 0)),
        "ns_blocks": sum(int(n["blocks"]) for n in stats["namespaces"]),
        "ns_bytes": sum(int(n["blocks"]) * int(n["block_bytes"]) for n in stats["namespaces"]),
        "nvme_used": int(nvme.get("used_bytes", 0)),
        "nvme_blocks": int(nvme.get("blocks", 0)),
    }


def wait_for(address: str, ok: Any, limit_s: float, every_s: float) -> tuple[dict | None, float]:
    """Poll stats until ``ok(accounting)`` or ``limit_s``; returns the last stats and the time."""
    t0 = time.monotonic()
    last = None
    while True:
        stats = daemon_stats(address)
        if stats is not None:
            last = stats
            if ok(accounting(stats)):
                break
        if time.monotonic() - t0 > limit_s:
            break
        time.sleep(every_s)
    return last, time.monotonic() - t0


def all_keys(ns: NsSpec, kv: KVStoreClient, args: argparse.Namespace) -> list[bytes]:
    n = prompts_of(ns, args.keyspace_mib * MiB)
    runs = [(p, ns.blocks_per_prompt) for p in range(n)]
    if ns is SLOW_NS:
        runs += [(n + i, SLOW_RUN_BLOCKS) for i in range(SLOW_RUNS)]
    keys: list[bytes] = []
    for p, blocks in runs:
        tokens = prompt_tokens(args.seed, p, blocks)
        chain = (
            block_hashes(SHARED_KEY_SEED, tokens, TOKENS_PER_BLOCK)
            if ns.shared_keys
            else kv.hash_tokens(tokens)
        )
        keys += [bytes(k) for k in chain]
    return list(dict.fromkeys(keys))


def delete_everything(address: str, args: argparse.Namespace) -> int:
    deleted = 0
    for ns in NAMESPACES:
        with KVStoreClient(
            address, layout=ns.layout, model=ns.model, tenant=ns.tenant, timeout_s=args.rpc_timeout
        ) as kv:
            keys = all_keys(ns, kv, args)
            for i in range(0, len(keys), 512):
                deleted += kv.delete(keys[i : i + 512])
    return deleted


def round_trip(address: str, args: argparse.Namespace) -> list[str]:
    """A fresh put + get of 4 new blocks per namespace and transport; the failures."""
    failures = []
    pairs = [(ns, t) for ns in NAMESPACES for t in ("shm", "grpc")]
    for n, (ns, transport) in enumerate(pairs):
        kw = dict(layout=ns.layout, model=ns.model, tenant=ns.tenant, transport=transport)
        try:
            with KVStoreClient(address, timeout_s=args.rpc_timeout, **kw) as kv:
                tokens = prompt_tokens(args.seed, 10**6 + n, 4)  # keys outside the keyspace
                keys = [bytes(k) for k in block_hashes(SHARED_KEY_SEED, tokens, 16)]
                kv.put(keys, make_blocks(ns, keys))
                got = kv.get(keys)
                rows = got.contiguous().view(torch.uint8).reshape(-1, ns.block_bytes).numpy()
                good = len(rows) == 4 and all(
                    np.array_equal(rows[i], expected_block(ns, keys[i])) for i in range(4)
                )
                if not good:
                    failures.append(f"{ns.name}/{transport}: got {len(rows)} of 4 or wrong")
                kv.delete(keys)
        except Exception as exc:
            failures.append(f"{ns.name}/{transport}: {type(exc).__name__}: {exc}")
            if isinstance(exc, UnavailableError):
                break  # every further call would wait out its deadline too
    return failures


def read_events(events_dir: str) -> list[dict[str, Any]]:
    events = []
    for name in sorted(os.listdir(events_dir)):
        with open(os.path.join(events_dir, name)) as f:
            for line in f:
                with contextlib.suppress(json.JSONDecodeError):  # a SIGKILLed half line
                    events.append(json.loads(line))
    return events


def daemon_log_findings(path: str) -> tuple[int, Counter]:
    """Tracebacks in the daemon's log, and its problem lines by count: the exception line that
    ends each traceback, and unindented lines saying error/fail/exception/warning (digits as N)."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0, Counter()
    found: Counter = Counter()
    tracebacks = 0
    in_tb = False
    for ln in lines:
        if ln.startswith("Traceback (most recent call last)"):
            tracebacks += 1
            in_tb = True
        elif in_tb and ln and not ln[0].isspace():
            if re.match(r"[\w.]+(: |$)", ln) and not ln.startswith("During handling"):
                found["raised: " + re.sub(r"\d+", "N", ln)[:160]] += 1
                in_tb = False
        elif ln[:1].strip() and re.search(r"error|fail|exception|warning", ln, re.IGNORECASE):
            # "asctime logger message": drop the time
            found[re.sub(r"\d+", "N", ln.split(" ", 2)[-1])[:160]] += 1
    return tracebacks, found


def rss(pid: int) -> int:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def config_toml(args: argparse.Namespace, mac_key_file: str) -> str:
    return f"""
[daemon]
lease_ttl_s = {args.ttl}
reservation_ttl_s = {args.ttl}
reaper_interval_s = {args.reaper}
drain_timeout_s = 20.0

[cpu]
slab = "{args.cpu_slab_mib}MiB"

[redis]
timeout_s = 2.0
mac_key_file = "{mac_key_file}"
"""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="run time of the clients")
    p.add_argument("--clients", type=int, default=8, help="client processes (2-16)")
    p.add_argument("--kill-every", type=float, default=6.0, help="SIGKILL a worker every N s")
    p.add_argument("--cpu-capacity-mib", type=int, default=128)
    p.add_argument("--cpu-slab-mib", type=int, default=16)
    p.add_argument("--nvme-capacity-mib", type=int, default=256, help="0: no NVMe tier")
    p.add_argument("--redis-maxmemory-mib", type=int, default=64, help="0: no Redis tier")
    p.add_argument("--keyspace-mib", type=int, default=384, help="distinct bytes per namespace")
    p.add_argument("--ttl", type=float, default=5.0, help="lease and reservation TTL (s)")
    p.add_argument("--reaper", type=float, default=0.5, help="reaper interval (s)")
    p.add_argument("--rpc-timeout", type=float, default=20.0, help="client deadline per call")
    p.add_argument("--progress-every", type=float, default=5.0)
    p.add_argument("--startup-timeout", type=float, default=120.0, help="for the workers (s)")
    p.add_argument("--save-daemon-log", metavar="PATH", help="copy the daemon's log there")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny run of seconds (2 clients, small tiers and keyspace): does it all work?",
    )
    p.add_argument(
        "--faults",
        action="store_true",
        help="the soak with faults instead (daemon kill -9s, a Redis restart, a full disk): "
        "see benchmarks/soak_faults.py and its --help",
    )
    args = p.parse_args()
    if args.smoke:
        args.seconds, args.clients, args.kill_every = 6.0, 2, 2.0
        args.cpu_capacity_mib, args.cpu_slab_mib = 48, 4
        args.nvme_capacity_mib, args.redis_maxmemory_mib, args.keyspace_mib = 64, 16, 48
        args.ttl, args.rpc_timeout, args.progress_every = 3.0, 10.0, 2.0
    if not 2 <= args.clients <= 16:
        p.error("--clients must be in 2..16")
    return args


def main() -> int:
    if "--faults" in sys.argv[1:]:
        import soak_faults  # its own options (--seconds, --plot, --smoke, ...)

        return soak_faults.main([a for a in sys.argv[1:] if a != "--faults"])
    args = parse()
    # Ctrl-C unwinds (stopping everything) even where the shell started us with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvsoak-"))
        events_dir = os.path.join(work, "events")
        os.mkdir(events_dir)
        # The Redis tier's values carry a MAC under a secret of this run (a daemon with a Redis
        # tier and no secret refuses to start).
        mac_file = os.path.join(work, "redis-mac.key")
        with open(os.open(mac_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        cfg = os.path.join(work, "soak.toml")
        with open(cfg, "w") as f:
            f.write(config_toml(args, mac_file))
        extra = ["--config", cfg, "--gpu", "off"]
        if args.nvme_capacity_mib:
            nvme_dir = os.path.join(work, "nvme")
            os.mkdir(nvme_dir)
            extra += ["--nvme-path", nvme_dir, "--nvme-capacity", f"{args.nvme_capacity_mib}MiB"]
        redis = None
        if args.redis_maxmemory_mib:
            if redis_server_path() is None:
                print("redis-server not found: apt-get install -y redis-server", file=sys.stderr)
                return 2
            redis = stack.enter_context(RedisServer())
            redis_command(
                redis.socket_path, "CONFIG", "SET", "maxmemory", f"{args.redis_maxmemory_mib}mb"
            )
            redis_command(redis.socket_path, "CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
            extra += ["--redis-url", f"unix://{redis.socket_path}"]
        daemon = stack.enter_context(KVStoreDaemon(args.cpu_capacity_mib * MiB, extra_args=extra))
        return soak(args, daemon, redis, events_dir, stack)
    return 1


def soak(
    args: argparse.Namespace,
    daemon: KVStoreDaemon,
    redis: RedisServer | None,
    events_dir: str,
    stack: contextlib.ExitStack,
) -> int:
    print(
        f"soak: {args.clients} clients for {args.seconds:.0f}s; CPU {args.cpu_capacity_mib} MiB "
        f"(slabs {args.cpu_slab_mib} MiB), NVMe {args.nvme_capacity_mib or 'off'} MiB, Redis "
        f"maxmemory {args.redis_maxmemory_mib or 'off'} MiB; TTL {args.ttl}s; namespaces "
        + ", ".join(f"{ns.name} ({fmt_size(ns.block_bytes)} blocks)" for ns in NAMESPACES)
        + f"; keyspace {args.keyspace_mib} MiB each",
        flush=True,
    )
    rss_start = rss(daemon.pid)
    rss_peak = rss_start
    pool = stack.enter_context(Pool(args, daemon.address, events_dir))
    rng = random.Random(args.seed)
    for slot in range(args.clients):
        pool.start(slot)
    print(
        "workers: " + ", ".join(f"{s}:{pool.describe(s)}" for s in range(args.clients)),
        flush=True,
    )
    # The clock starts once every worker has its clients open (spawning 16 processes that
    # import torch takes a while on two cores); until then the ready ones already run.
    t0 = time.monotonic()
    while pool.ready() < args.clients and time.monotonic() - t0 < args.startup_timeout:
        time.sleep(0.2)
        pool.check_exits(time.monotonic())
    print(f"{pool.ready()}/{args.clients} workers ready after {time.monotonic() - t0:.0f}s")
    t_start = time.monotonic()
    pool.deadline = t_start + args.seconds
    samples: list[dict[str, int]] = []
    next_sample = t_start + 1.0
    next_print = t_start + args.progress_every
    next_kill = t_start + args.kill_every
    daemon_died = None
    while time.monotonic() < pool.deadline:
        time.sleep(max(0.0, min(next_sample, pool.deadline) - time.monotonic()))
        now = time.monotonic()
        if now >= next_sample:
            samples.append(pool.shared.totals())
            next_sample += 1.0
        if daemon.proc is not None and daemon.proc.poll() is not None:
            daemon_died = daemon.proc.returncode
            print(f"DAEMON EXITED with {daemon_died} at {now - t_start:.0f}s", flush=True)
            break
        rss_peak = max(rss_peak, rss(daemon.pid))
        pool.check_exits(now)
        if args.kill_every > 0 and now >= next_kill and now < pool.deadline - 3:
            pool.kill_one_mid_put(rng)
            next_kill = time.monotonic() + args.kill_every * rng.uniform(0.5, 1.5)
        if now >= next_print:
            next_print += args.progress_every
            progress(pool, samples, now - t_start, rss(daemon.pid))
    pool.deadline = min(pool.deadline, time.monotonic())
    pool.finish(args.rpc_timeout + 15.0)
    samples.append(pool.shared.totals())
    ran_s = time.monotonic() - t_start
    print(f"clients done after {ran_s:.0f}s", flush=True)
    return report(args, daemon, redis, pool, samples, events_dir, rss_start, rss_peak, daemon_died)


def progress(pool: Pool, samples: list[dict[str, int]], elapsed: float, rss_now: int) -> None:
    t = samples[-1] if samples else pool.shared.totals()
    prev = samples[-6] if len(samples) > 5 else {f: 0 for f in FIELDS}
    span = min(5, len(samples)) or 1
    rates = " ".join(f"{op} {(t[op] - prev[op]) / span:.0f}" for op in OPS)
    alive = sum(p.is_alive() for p in pool.procs.values())
    stuck = pool.stuck(pool.args.rpc_timeout + 5)
    print(
        f"[{elapsed:5.0f}s] ops {sum(t[op] for op in OPS):>7}  (/s: {rates})  "
        f"errors {t['errors']}  wrong {t['wrong']}  kills {len(pool.kills)}  "
        f"workers {alive}/{pool.args.clients}  daemon RSS {rss_now / MiB:.0f} MiB"
        + (f"  STUCK: {'; '.join(stuck)}" if stuck else ""),
        flush=True,
    )


def report(
    args: argparse.Namespace,
    daemon: KVStoreDaemon,
    redis: RedisServer | None,
    pool: Pool,
    samples: list[dict[str, int]],
    events_dir: str,
    rss_start: int,
    rss_peak: int,
    daemon_died: int | None,
) -> int:
    failures: list[str] = []
    totals = samples[-1]
    # Ops per second: per-second deltas from the first second with any operation on.
    per_sec = [{op: b[op] - a[op] for op in OPS} for a, b in itertools.pairwise(samples)]
    first = next((i for i, d in enumerate(per_sec) if sum(d.values())), len(per_sec))
    per_sec = per_sec[first:]
    rows = []
    for op in OPS:
        series = [d[op] for d in per_sec] or [0]
        total_s, max_s = pool.shared.op_seconds(op)
        mean_ms = 1e3 * total_s / totals[op] if totals[op] else None
        rows.append(
            [
                op,
                totals[op],
                statistics.median(series),
                min(series),
                max(series),
                mean_ms,
                1e3 * max_s,
            ]
        )
    print_table(
        f"Operations (successful calls; rates over {len(per_sec)} one-second samples)",
        ["op", "total", "median/s", "min/s", "max/s", "mean ms", "max ms"],
        rows,
    )
    print(
        f"blocks: put {totals['blocks_put']} (new {totals['blocks_new']}), asked in gets "
        f"{totals['blocks_asked']}, read and verified {totals['blocks_read']}, misses "
        f"{totals['blocks_asked'] - totals['blocks_read']} (legal), of which lookup-then-get "
        f"races {totals['race_misses']}"
    )

    events = read_events(events_dir)
    errors = [e for e in events if e.get("event") == "error"]
    kinds = Counter(e["kind"] for e in errors)
    sample_msg: dict[str, str] = {}
    ops_of: dict[str, Counter] = {}
    for e in errors:
        sample_msg.setdefault(e["kind"], e["msg"])
        ops_of.setdefault(e["kind"], Counter())[e.get("op") or "?"] += 1
    unexplained = {k: n for k, n in kinds.items() if k not in LEGAL_ERRORS}
    print_table(
        f"Errors by kind ({sum(kinds.values())}; counted {totals['errors']})",
        ["kind", "count", "legal?", "in ops", "first message"],
        [
            [
                k,
                n,
                "legal" if k in LEGAL_ERRORS else "UNEXPLAINED",
                ",".join(f"{o}:{c}" for o, c in ops_of[k].most_common()),
                sample_msg[k][:110],
            ]
            for k, n in kinds.most_common()
        ]
        or [["(none)", 0, "", "", ""]],
    )
    if unexplained:
        failures.append(f"unexplained errors: {dict(unexplained)}")

    wrong = [e for e in events if e.get("event") == "wrong"]
    print(f"\nwrong blocks: {totals['wrong']}")
    for e in wrong[:10]:
        print(
            f"  {e['op']} {e['ns']} key {e['key']}..: {e['bad_bytes']} bytes differ from "
            f"byte {e['first_bad_byte']}; holds {e['holds']}"
        )
    if totals["wrong"]:
        failures.append(f"{totals['wrong']} wrong blocks")

    crashes = [e["msg"].strip().splitlines()[-1] for e in events if e.get("event") == "crash"]
    mid_put = sum(k["op"] == "put" for k in pool.kills)
    print(
        f"kills: {len(pool.kills)} SIGKILLs ({mid_put} mid-put, others: "
        f"{', '.join(k['op'] for k in pool.kills if k['op'] != 'put') or 'none'}), each replaced"
    )
    for c in pool.crashes:
        print(f"  worker died on its own: {c}")
    for c in dict.fromkeys(crashes):
        print(f"  worker crash: {c}")
    if pool.crashes:
        failures.append(f"{len(pool.crashes)} worker crashes")
    for h in pool.hung:
        print(f"  HUNG: {h}")
    if pool.hung:
        failures.append(f"{len(pool.hung)} workers hung past their deadline")

    # --- leaks: every client is gone; leases and reservations must expire and free their slots.
    if daemon_died is None and daemon.proc is not None and daemon.proc.poll() is None:
        failures += leak_checks(args, daemon)
    elif daemon_died is not None:
        failures.append(f"daemon died during the run (exit {daemon_died})")

    rss_end = rss(daemon.pid) if daemon.proc is not None else 0
    print(
        f"\ndaemon RSS: start {rss_start / MiB:.0f} MiB, peak {rss_peak / MiB:.0f} MiB, "
        f"end {rss_end / MiB:.0f} MiB"
    )
    if redis is not None:
        with contextlib.suppress(Exception):
            info = redis_info(redis.socket_path)
            print(
                f"redis: used_memory {int(info['used_memory']) / MiB:.0f} MiB, keys evicted "
                f"{info.get('evicted_keys', '?')}, error replies "
                f"{info.get('total_error_replies', '?')}"
            )
    # --- graceful stop: SIGTERM, exit 0 expected.
    code: Any = daemon_died
    if daemon.proc is not None and daemon_died is None:
        daemon.proc.send_signal(signal.SIGTERM)
        try:
            code = daemon.proc.wait(60)
        except subprocess.TimeoutExpired:
            code = "no exit 60s after SIGTERM (killed)"
            daemon.proc.kill()
            daemon.proc.wait(10)
        print(f"daemon exit after SIGTERM: {code}")
        if code != 0:
            failures.append(f"daemon exit {code} after SIGTERM")
            print("the end of its log:")
            print("\n".join(_tail(daemon.log_path, 3000).splitlines()[-16:]))

    tracebacks, found = daemon_log_findings(daemon.log_path)
    print(f"daemon log: {tracebacks} tracebacks, {sum(found.values())} problem lines")
    for ln, n in found.most_common(10):
        print(f"  {n:>5} x {ln}")
    if args.save_daemon_log:
        shutil.copyfile(daemon.log_path, args.save_daemon_log)
        print(f"daemon log saved to {args.save_daemon_log}")
    print("\nRESULT: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))
    return 1 if failures else 0


def leak_checks(args: argparse.Namespace, daemon: KVStoreDaemon) -> list[str]:
    failures = []
    limit = 2 * args.ttl + 6 * args.reaper + 10
    stats, took = wait_for(
        daemon.address, lambda a: a["leases"] == 0 and a["reservations"] == 0, limit, args.reaper
    )
    if stats is None:
        return ["kvstore stat never answered after the run"]
    a = accounting(stats)
    print(
        f"\nafter the clients ({took:.1f}s of polling): active leases {a['leases']}, reservations "
        f"{a['reservations']}, CPU reserved blocks {a['cpu_reserved_blocks']}"
    )
    print_table(
        "Tiers after the run",
        [
            "tier",
            "used",
            "capacity",
            "blocks",
            "evictions",
            "promotions",
            "demotions",
            "cksum fail",
        ],
        [
            [
                t["name"],
                t["used_bytes"],
                t["capacity_bytes"],
                t["blocks"],
                t["evictions"],
                t["promotions"],
                t["demotions"],
                t["checksum_failures"],
            ]
            for t in stats["tiers"]
        ],
    )
    print(
        f"CPU used {a['cpu_used']} B in {a['cpu_blocks']} blocks; namespaces hold {a['ns_blocks']} "
        f"blocks = {a['ns_bytes']} B (blocks x block bytes, all tiers); NVMe {a['nvme_blocks']} "
        f"blocks, {a['nvme_used']} B"
    )
    if a["leases"] or a["reservations"] or a["cpu_reserved_blocks"]:
        failures.append(
            f"leak: {a['leases']} leases / {a['reservations']} reservations / "
            f"{a['cpu_reserved_blocks']} reserved blocks {took:.0f}s after every client exited"
        )
    # Namespaces count blocks in every tier: equality only holds when the CPU tier is the only
    # one that keeps blocks in the index (no NVMe tier).
    cpu_only = tier(stats, "nvme") is None
    over = a["cpu_used"] > a["ns_bytes"] or a["cpu_blocks"] > a["ns_blocks"]
    if over or (cpu_only and a["cpu_used"] != a["ns_bytes"]):
        failures.append(
            f"leak: CPU tier uses {a['cpu_used']} B / {a['cpu_blocks']} blocks, namespaces "
            f"hold {a['ns_bytes']} B / {a['ns_blocks']} blocks"
        )

    # Delete every key the soak could have written: every tier must then be empty.
    try:
        deleted = delete_everything(daemon.address, args)
    except Exception as exc:
        failures.append(f"delete of every key failed: {type(exc).__name__}: {exc}")
        return failures

    def empty(x: dict[str, int]) -> bool:
        return not (x["cpu_used"] or x["cpu_blocks"] or x["ns_blocks"] or x["nvme_blocks"])

    stats, took = wait_for(daemon.address, empty, 2 * args.ttl + 6 * args.reaper + 10, args.reaper)
    if stats is None:
        return [*failures, "kvstore stat never answered after the deletes"]
    a = accounting(stats)
    print(
        f"after deleting every key ({deleted} deleted; {took:.1f}s of polling): CPU used "
        f"{a['cpu_used']} B in {a['cpu_blocks']} blocks vs namespaces' blocks x block bytes "
        f"{a['ns_bytes']} B ({a['ns_blocks']} blocks); NVMe {a['nvme_blocks']} blocks, "
        f"{a['nvme_used']} B; leases {a['leases']}, reservations {a['reservations']}"
    )
    if a["cpu_used"] != a["ns_bytes"] or not empty(a):
        failures.append(
            f"leak: after deleting every key CPU used {a['cpu_used']} B ({a['cpu_blocks']} "
            f"blocks), namespaces {a['ns_bytes']} B, NVMe {a['nvme_blocks']} blocks"
        )
    bad = round_trip(daemon.address, args)
    print(f"fresh put/get per namespace and transport: {'ok' if not bad else '; '.join(bad)}")
    if bad:
        failures.append(f"round trip after the soak failed: {bad}")
    return failures


if __name__ == "__main__":
    run_main(main)
