"""Soak with faults (``benchmarks/soak.py --faults``): two tenants' clients run against one real
daemon whose tiers never stop evicting, while the daemon is ``kill -9``-ed and restarted, Redis
is restarted and the NVMe filesystem fills up; every byte read is checked, every acknowledged
durable block is looked for after each restart, and the daemon's memory and descriptors are
watched. Not a pytest test (``tests/test_soak_faults.py`` runs a two-minute one).

What runs, all in private temp dirs, all stopped on exit, exception, Ctrl-C and SIGTERM:

* ``redis-server`` on a unix socket, ``--maxmemory`` small (``allkeys-lru``): Redis evicts too;
* ``kvstore serve`` on a unix socket with a tenant policy: uid ``ALPHA_UID`` is tenant
  ``alpha``, uid ``BETA_UID`` tenant ``beta``, root (this script) tenant ``ledger`` and
  operator. A small CPU tier (64 MiB), the Redis tier with a MAC secret file
  (``redis.mac_key_file``), and the NVMe tier with ``nvme.durable_puts`` on (every put, of every
  client, is acknowledged only once on disk). The daemon cuts its NVMe file into 256 MiB slabs,
  one block size per slab, so a tier of six sizes needs seven or more slabs (a smaller one is a
  single slab that holds one size at a time and is emptied whenever another size is written):
  it is a 2 GiB file on a 512 MiB tmpfs of our own (``mount_tmpfs``), sparse (it cannot be
  preallocated: its slots take space when first written, and a full filesystem fails those
  writes), and what it holds stays small because alpha and beta each have a ``quota_nvme`` of
  32 MiB: past it each evicts its own disk blocks, all the time;
* four client processes, two per tenant, each under its tenant's uid (``setpriv --reuid
  --regid --clear-groups``), one on the shared-memory transport and one on gRPC. Each tenant
  has three namespaces with blocks of 16 KiB to 2 MiB over a keyspace far larger than the
  tiers, and mixes put / get / lookup / prefetch / delete over it with a skewed choice of
  prompt (hits, promotions, and eviction in every tier all the time);
* the durable ledger (a thread of this script): tenant ``ledger`` puts blocks under keys never
  used before, keeps ``LEDGER_LIVE`` of them (deleting the oldest), and after every restart
  reads back every block whose put was acknowledged.

Faults, on a fixed schedule over ``--seconds`` (``fault_schedule``): the daemon is SIGKILLed and
restarted (same socket, config and NVMe file) ``n`` times at equal intervals (600 s: every
120 s; 120 s: every 40 s); Redis is SIGKILLed and restarted once, halfway (same socket and data
dir; it comes back empty); the NVMe filesystem is filled to ENOSPC by a filler file from before
the last daemon kill to after it (so that restart opens its tier on a full disk), then the filler
is removed.

Checks (the exit status is 1 if one fails):

* every block read is compared with the only bytes that may be under its key (a numpy stream
  seeded by sha256(namespace identity + key), ``soak.expected_block``): wrong bytes must be 0.
  Misses are legal (eviction, deletes, restarts);
* errors are counted by kind and by when they happened: during a daemon outage (from the kill
  to ``SETTLE_S`` after the restarted daemon answers health checks), a Redis restart, the full
  disk, or none of them. Legal kinds are listed in ``LEGAL`` per period; any other is a failure;
* the durable contract (docs/operations.md "Durability modes", ``nvme.durable_puts``): a put
  acknowledged by the daemon has its blocks on disk, fdatasync'd, so they survive ``kill -9``. It
  says nothing of a block evicted or deleted later, so the ledger is kept from eviction: the tier as
  a whole never fills (the others' quotas; the report shows how full it got), its tenant has a
  ``guaranteed_nvme`` twice its live bytes besides, and only the ledger deletes its keys. After each
  restart (and at the end) every block acknowledged and not deleted since must be readable,
  byte-exact (a get may be refused under pressure: a block is lost only if a lookup
  does not find it either). Lost blocks must be 0, a check must follow every kill, and every
  daemon life must acknowledge durable puts (a ledger refused throughout is a failure too);
* the daemon's RSS and open descriptors (``/proc``) every ``--sample-every`` seconds: for each
  daemon life, the plateau after ``warm-up`` (its first 40 %, at most 30 s) must not grow by more
  than ``RSS_GROWTH`` (or 10 % of the plateau) / ``FD_GROWTH`` descriptors from the first to the
  last third of the warm part;
* at the end the daemon must stop with exit 0 on SIGTERM.

The report prints operations by kind, wrong bytes, errors by kind and period, the ledger's
checks, recovery times, RSS/fds per daemon life, throughput over time; ``--plot`` writes a PNG
(throughput with the faults marked, RSS and descriptors below); ``--summary-json`` the figures
the test asserts on.

    PYTHONPATH=. .venv/bin/python benchmarks/soak.py --faults [--seconds 600] [--plot PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from _harness import (
    KVStoreDaemon,
    RedisServer,
    _tail,
    fmt_size,
    mount_tmpfs,
    print_table,
    redis_server_path,
)
from soak import (
    SHARED_KEY_SEED,
    TOKENS_PER_BLOCK,
    NsSpec,
    daemon_log_findings,
    daemon_stats,
    error_kind,
    expected_block,
    make_blocks,
    prompt_tokens,
    redis_info,
)

from kvstore import KVStoreClient, block_hashes

MiB = 1 << 20
ALPHA_UID, BETA_UID = 2111, 2112
TENANT_UIDS = {"alpha": ALPHA_UID, "beta": BETA_UID}
# Per tenant three block sizes (16 KiB .. 2 MiB); every size shares every tier with the others.
TENANT_NS = {
    "alpha": (
        NsSpec("a16", "faults-a16", "alpha", 1, 32, shared_keys=True, heads=2),
        NsSpec("a256", "faults-a256", "alpha", 4, 8, shared_keys=True),
        NsSpec("a2m", "faults-a2m", "alpha", 32, 2, shared_keys=True),
    ),
    "beta": (
        NsSpec("b64", "faults-b64", "beta", 1, 16, shared_keys=True),
        NsSpec("b512", "faults-b512", "beta", 8, 4, shared_keys=True),
        NsSpec("b2m", "faults-b2m", "beta", 32, 2, shared_keys=True),
    ),
}
LEDGER = NsSpec("ledger", "faults-ledger", "ledger", 2, 4, shared_keys=True)  # 128 KiB blocks
LEDGER_LIVE = 96  # acknowledged ledger blocks kept (12 MiB); older ones are deleted
OPS = ("put", "get", "lookup", "prefetch", "delete")
SETTLE_S = 3.0  # after a restarted process answers: calls begun during the outage end by then
RSS_GROWTH = 48 * MiB
FD_GROWTH = 16
# Error kinds that may happen, by period; anything else is a failure.
UNDER_PRESSURE = {"CapacityError", "LeaseExpiredError"}
# A durable put whose block is gone before its write reached the disk is refused (the daemon
# cannot tell a client's delete from an eviction): the two clients of a tenant share keys, so
# one's put racing the other's delete may be refused at any time. A write into a slot never
# written before needs filesystem space: on the full disk such puts are refused too.
NOT_DURABLE = "UnavailableError(not durable)"
# A same-host client's session socket (slab descriptors, local calls) breaks when the daemon
# dies under a call: the kill's error on that path, as UNAVAILABLE is on gRPC.
SESSION_LOST = "UnavailableError(session)"
LEGAL = {
    "daemon down": UNDER_PRESSURE
    | {
        "UnavailableError(UNAVAILABLE)",
        "UnavailableError(DEADLINE_EXCEEDED)",
        SESSION_LOST,
        NOT_DURABLE,
    },
    "redis restart": UNDER_PRESSURE | {NOT_DURABLE},
    "disk full": UNDER_PRESSURE | {NOT_DURABLE},
    "steady": UNDER_PRESSURE | {NOT_DURABLE},
}
PERIODS = tuple(LEGAL)
# The ledger deletes only keys it no longer puts: a refused durable put of its own is legal
# only where the disk is full or the daemon was killed under it.
LEDGER_NOT_DURABLE = ("daemon down", "disk full")


def fault_kind(exc: BaseException) -> str:
    """``soak.error_kind``, with a same-host session broken by a kill told apart, and a durable
    put refused (its blocks stay in memory, the put may be retried: docs/operations.md
    "Durability modes") told apart from a daemon that does not answer."""
    if "could not be made durable" in str(exc):
        return f"{type(exc).__name__}(not durable)"
    kind = error_kind(exc)
    if kind == "UnavailableError" and "session" in str(exc):
        return SESSION_LOST
    return kind


# --------------------------------------------------------------------------- the client processes
@dataclass(frozen=True)
class WorkerPlan:
    address: str
    tenant: str
    index: int
    transport: str
    seed: int
    keyspace_mib: int
    rpc_timeout_s: float


def keys_of(plan: WorkerPlan, prompt: int, n_blocks: int, cache: dict) -> list[bytes]:
    cached = cache.get((prompt, n_blocks))
    if cached is None:
        tokens = prompt_tokens(plan.seed, prompt, n_blocks)
        cached = [bytes(k) for k in block_hashes(SHARED_KEY_SEED, tokens, TOKENS_PER_BLOCK)]
        if len(cache) > 4096:
            cache.clear()
        cache[(prompt, n_blocks)] = cached
    return cached


def check_blocks(ns: NsSpec, keys: list[bytes], got: torch.Tensor) -> tuple[int, int, int]:
    """(blocks read, wrong blocks, wrong bytes) of ``got``, the answer to a get of ``keys``."""
    m = int(got.shape[0])
    if m > len(keys):  # more blocks than keys: every one beyond is wrong
        return m, m - len(keys), (m - len(keys)) * ns.block_bytes
    rows = got.contiguous().view(torch.uint8).reshape(m, ns.block_bytes).numpy()
    wrong = wrong_bytes = 0
    for i in range(m):
        bad = int(np.count_nonzero(rows[i] != expected_block(ns, keys[i])))
        wrong += bad > 0
        wrong_bytes += bad
    return m, wrong, wrong_bytes


def worker_main(plan: WorkerPlan) -> None:
    """One client process (run as its tenant's uid): operations until stdin closes; JSON lines
    on stdout: ``ready``, ``counts`` (cumulative, every second), ``error``, ``wrong``, ``done``."""
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    stop = threading.Event()

    def watch_stdin() -> None:  # the parent closes our stdin (or dies): stop
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    lock = threading.Lock()

    def emit(**obj: Any) -> None:
        with lock:
            sys.stdout.write(json.dumps({"t": time.time(), **obj}) + "\n")
            sys.stdout.flush()

    rng = random.Random(plan.seed * 1000 + plan.index)
    spaces = TENANT_NS[plan.tenant]
    prompts = {ns.name: max(1, plan.keyspace_mib * MiB // (ns.blocks_per_prompt * ns.block_bytes))
               for ns in spaces}  # fmt: skip
    counts: Counter = Counter()
    cache: dict[str, dict] = {ns.name: {} for ns in spaces}
    clients: dict[str, KVStoreClient] = {}
    while not clients and not stop.is_set():
        try:
            for ns in spaces:
                clients[ns.name] = KVStoreClient(
                    plan.address,
                    layout=ns.layout,
                    model=ns.model,
                    tenant=ns.tenant,
                    transport=plan.transport,
                    timeout_s=plan.rpc_timeout_s,
                )
        except Exception as exc:
            emit(ev="error", op="open", kind=fault_kind(exc), msg=str(exc)[:300])
            for kv in clients.values():
                with contextlib.suppress(Exception):
                    kv.close()
            clients = {}
            time.sleep(0.5)
    emit(ev="ready")

    def one() -> str:
        ns = rng.choice(spaces)
        kv = clients[ns.name]
        prompt = int(prompts[ns.name] * rng.random() ** 3)  # skewed: a hot head, a long tail
        keys = keys_of(plan, prompt, ns.blocks_per_prompt, cache[ns.name])
        r = rng.random()
        op = "put" if r < 0.40 else "get" if r < 0.80 else "lookup" if r < 0.88 else (
            "prefetch" if r < 0.95 else "delete")  # fmt: skip
        in_flight[0] = op
        if op == "put":
            k = rng.randint(1, len(keys))
            kv.put(keys[:k], make_blocks(ns, keys[:k]))
            counts["blocks_put"] += k
        elif op == "get":
            k = rng.randint(1, len(keys))
            if rng.random() < 0.5:
                k = kv.lookup(keys[:k])
                counts["lookup"] += 1
            if k:
                m, wrong, wrong_bytes = check_blocks(ns, keys[:k], kv.get(keys[:k]))
                counts["blocks_read"] += m
                counts["bytes_read"] += m * ns.block_bytes
                counts["wrong_blocks"] += wrong
                counts["wrong_bytes"] += wrong_bytes
                if wrong:
                    emit(ev="wrong", ns=ns.name, prompt=prompt, blocks=wrong, bytes=wrong_bytes)
        elif op == "lookup":
            kv.lookup(keys)
        elif op == "prefetch":
            kv.prefetch(keys)
        else:
            i = rng.randrange(len(keys))
            kv.delete(keys[i : i + rng.randint(1, 4)])
        return op

    in_flight = ["?"]  # the operation one() is in, for the error's record
    next_report = time.monotonic() + 1.0
    while not stop.is_set():
        in_flight[0] = "?"
        began = time.time()
        try:
            counts[one()] += 1
        except Exception as exc:  # counted by kind; the soak goes on
            counts["errors"] += 1
            emit(ev="error", t0=began, op=in_flight[0], kind=fault_kind(exc), msg=str(exc)[:300])
            time.sleep(0.05)
        if time.monotonic() >= next_report:
            next_report += 1.0
            emit(ev="counts", c=dict(counts))
    emit(ev="counts", c=dict(counts))
    for kv in clients.values():
        with contextlib.suppress(Exception):
            kv.close()
    emit(ev="done")


class WorkerProc:
    """A client process under its tenant's uid, and the thread that reads its JSON lines."""

    def __init__(self, plan: WorkerPlan, uid: int, log_dir: str) -> None:
        self.plan = plan
        self.name = f"{plan.tenant}{plan.index}/{plan.transport}"
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": root, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
        self.stderr_path = os.path.join(log_dir, f"worker-{plan.tenant}{plan.index}.err")
        cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable,
               os.path.abspath(__file__), "--worker", json.dumps(asdict(plan))]  # fmt: skip
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                cwd="/tmp", start_new_session=True,
            )  # fmt: skip
        self.counts: Counter = Counter()
        self.events: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self.done = False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            ev = msg.get("ev")
            if ev == "counts":
                self.counts = Counter(msg["c"])
            elif ev == "ready":
                self.ready.set()
            elif ev == "done":
                self.done = True
            else:
                self.events.append({**msg, "worker": self.name})

    def stop(self) -> None:
        """Close its stdin: it ends its operation in flight and exits."""
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        self.proc.wait()


# --------------------------------------------------------------------------- the durable ledger
@dataclass
class LedgerCheck:
    at_s: float
    after: str
    acked: int
    readable: int
    lost: int
    wrong: int
    refused_then_found: int
    nvme_counters: str = ""  # the NVMe tier's checksum failures and IO errors (this life)


class Ledger:
    """Durable puts of tenant ``ledger`` under keys never used before, and the checks that
    every acknowledged one is still there; runs in a thread of its own. Only acknowledged puts
    join ``acked``; a key whose delete was not acknowledged leaves it (it may or may not be
    there), one whose delete was acknowledged too."""

    def __init__(self, address: str, seed: int, rpc_timeout_s: float, t0: float) -> None:
        self.address = address
        self.seed = seed
        self.rpc_timeout_s = rpc_timeout_s
        self.t0 = t0
        self.acked: dict[int, bytes] = {}  # sequence number -> key, oldest first
        self.next_seq = 0
        self.puts = self.deletes = self.errors = 0
        self.error_kinds: Counter = Counter()
        self.last_error = ""
        self.nvme_peak = 0.0  # the highest used / capacity of the NVMe tier seen
        self.ack_times: list[float] = []  # when each durable put was acknowledged (run s)
        self.ack_at: dict[int, float] = {}  # the same per sequence number
        self.events: list[dict[str, Any]] = []  # its errors, as the clients report theirs
        self.checks: list[LedgerCheck] = []
        self.lost_keys: list[str] = []
        self._want_check: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._kv: KVStoreClient | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def key(self, seq: int) -> bytes:
        tokens = prompt_tokens(self.seed + 7919, seq, 1)
        return bytes(block_hashes(SHARED_KEY_SEED, tokens, TOKENS_PER_BLOCK)[0])

    def request_check(self, after: str) -> None:
        with self._lock:
            self._want_check.append(after)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(self.rpc_timeout_s * 4 + 30)

    def pending_checks(self) -> list[str]:
        """The checks asked for and not done (call once the thread has stopped)."""
        with self._lock:
            pending, self._want_check = self._want_check, []
        return pending

    def client(self) -> KVStoreClient:
        if self._kv is None:
            self._kv = KVStoreClient(
                self.address,
                layout=LEDGER.layout,
                model=LEDGER.model,
                tenant=LEDGER.tenant,
                timeout_s=self.rpc_timeout_s,
            )
        return self._kv

    def _run(self) -> None:
        next_stats = 0.0
        while not self._stop.is_set():
            with self._lock:
                after = self._want_check[0] if self._want_check else None
            began = time.time()
            try:
                if after is not None:  # until it completes: the daemon may not answer yet
                    self.check(after)
                    with self._lock:
                        self._want_check.pop(0)
                if time.monotonic() >= next_stats:
                    next_stats = time.monotonic() + 2.0
                    self.watch_nvme()
                self.step()
            except Exception as exc:  # judged with the clients' errors, by period
                self.errors += 1
                self.error_kinds[fault_kind(exc)] += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                self.events.append(
                    {"ev": "error", "t": time.time(), "t0": began,
                     "op": "ledger " + ("check" if after else "put/delete"),
                     "kind": fault_kind(exc), "msg": str(exc)[:300], "worker": "ledger"}
                )  # fmt: skip
                time.sleep(0.2)
            self._stop.wait(0.1)
        self.close()

    def close(self) -> None:
        """Close the client (a closed client's memory is unmapped: never use it again)."""
        if self._kv is not None:
            with contextlib.suppress(Exception):
                self._kv.close()
            self._kv = None

    def watch_nvme(self) -> None:
        """The fullest the NVMe tier has been, and the ledger tenant's bytes there: the
        ledger's blocks are never evicted only while the tier as a whole has room."""
        stats = self.client().stats()
        nvme = next((t for t in stats.tiers if t.name == "nvme"), None)
        if nvme is not None and nvme.capacity_bytes:
            self.nvme_peak = max(self.nvme_peak, nvme.used_bytes / nvme.capacity_bytes)

    def step(self) -> None:
        kv = self.client()
        if len(self.acked) >= LEDGER_LIVE:
            doomed = list(self.acked.items())[:4]
            for seq, _ in doomed:  # unknown if the delete fails: never checked again
                del self.acked[seq]
            kv.delete([k for _, k in doomed])
            self.deletes += len(doomed)
        seqs = range(self.next_seq, self.next_seq + 4)
        self.next_seq += 4  # a key is put once: a failed put's keys are never asked for
        keys = [self.key(s) for s in seqs]
        kv.put(keys, make_blocks(LEDGER, keys))  # returns only once durable
        self.acked.update(zip(seqs, keys, strict=True))
        self.puts += 4
        now = time.monotonic() - self.t0
        self.ack_times.append(now)
        self.ack_at.update((seq, now) for seq in seqs)

    def check(self, after: str, retries: int = 5) -> LedgerCheck:
        """Read every acknowledged block; retry what a get did not return (refused under
        pressure, or a promotion that lost a race); lost = not found by a lookup either."""
        kv = self.client()
        seq_of = {k: seq for seq, k in self.acked.items()}
        acked = list(self.acked.values())
        missing: list[bytes] = []
        wrong = readable = 0
        for key in acked:  # one by one: a missing block must not hide the ones after it
            m, bad, _ = check_blocks(LEDGER, [key], kv.get([key]))
            wrong += bad
            readable += m
            if not m:
                missing.append(key)
        found_late = 0
        for _ in range(retries):
            if not missing:
                break
            time.sleep(0.5)
            still = []
            for key in missing:
                m, bad, _ = check_blocks(LEDGER, [key], kv.get([key]))
                wrong += bad
                found_late += m
                if not m:
                    still.append(key)
            missing = still
        lost = [k for k in missing if kv.lookup([k]) == 0]
        self.lost_keys += [
            f"{k.hex()[:16]} (put {seq_of[k]}, acknowledged at {self.ack_at[seq_of[k]]:.1f}s)"
            for k in lost
        ]
        nvme = next((t for t in kv.stats().tiers if t.name == "nvme"), None)
        counters = (
            f"cksum {nvme.checksum_failures}, io errors {int(nvme.extra.get('io_errors', 0))}"
            if nvme is not None
            else ""
        )
        result = LedgerCheck(
            round(time.monotonic() - self.t0, 1),
            after,
            len(acked),
            readable + found_late,
            len(lost),
            wrong,
            found_late + len(missing) - len(lost),
            counters,
        )
        self.checks.append(result)
        print(
            f"  ledger check after {after}: {result.acked} acknowledged, {result.readable} read, "
            f"{result.lost} lost, {result.wrong} wrong",
            flush=True,
        )
        return result


# --------------------------------------------------------------------------- faults
@dataclass
class Fault:
    kind: str  # "daemon kill", "redis restart", "disk fill", "disk free"
    at_s: float  # scheduled, seconds after the start
    done_s: float = -1.0  # when it was over (the process answered again; the filler written)
    wall: float = 0.0  # time.time() when it began
    wall_end: float = 0.0
    detail: str = ""


def fault_schedule(seconds: float) -> list[Fault]:
    """Daemon kills at equal intervals (4 in 600 s, 2 in 120 s); one Redis restart halfway; the
    disk full from 35 % of an interval before the last kill to 35 % after it."""
    kills = max(2, round(seconds / 120) - 1)
    gap = seconds / (kills + 1)
    plan = [Fault("daemon kill", gap * (i + 1)) for i in range(kills)]
    plan.append(Fault("redis restart", seconds / 2 + (gap / 2 if kills % 2 else 0.0)))
    plan.append(Fault("disk fill", gap * kills - 0.35 * gap))
    plan.append(Fault("disk free", gap * kills + 0.35 * gap))
    return sorted(plan, key=lambda f: f.at_s)


def fill_disk(directory: str) -> tuple[str, int]:
    """Write a filler file in ``directory`` until the filesystem is full (ENOSPC)."""
    path = os.path.join(directory, "filler")
    chunk = b"\0" * MiB
    written = 0
    with open(path, "wb") as f:
        try:
            while True:
                written += f.write(chunk)
                f.flush()
        except OSError:
            pass
    return path, written


# --------------------------------------------------------------------------- the parent
def config_toml(args: argparse.Namespace, redis_socket: str, mac_file: str, nvme_dir: str) -> str:
    access = "".join(
        f'[[access]]\nname = "{t}-app"\nuids = [{uid}]\ntenants = ["{t}"]\n\n'
        for t, uid in TENANT_UIDS.items()
    )
    return f"""
[daemon]
lease_ttl_s = 5.0
reservation_ttl_s = 5.0
reaper_interval_s = 0.5
drain_timeout_s = 20.0

[cpu]
slab = "{args.cpu_slab_mib}MiB"

[nvme]
path = "{nvme_dir}"
capacity = "{args.nvme_capacity_mib}MiB"
durable_puts = true

[redis]
url = "unix://{redis_socket}"
timeout_s = 1.0
mac_key_file = "{mac_file}"

{access}[[access]]
name = "soak-driver"
uids = [0]
tenants = ["ledger"]
role = "operator"

[tenants.alpha]
quota_nvme = "{args.tenant_nvme_mib}MiB"

[tenants.beta]
quota_nvme = "{args.tenant_nvme_mib}MiB"

[tenants.ledger]
guaranteed_nvme = "{2 * LEDGER_LIVE * LEDGER.block_bytes // MiB}MiB"
"""


def proc_sample(pid: int) -> tuple[int, int]:
    """(RSS bytes, open descriptors) of ``pid``; (0, 0) if it is gone."""
    rss = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0, 0


@dataclass
class Run:
    """What the parent records while the soak runs."""

    t0: float = 0.0
    wall0: float = 0.0
    faults: list[Fault] = field(default_factory=list)
    lives: list[tuple[float, float]] = field(default_factory=list)  # each daemon life (s)
    samples: list[dict[str, float]] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0


class FaultSoak:
    def __init__(self, args: argparse.Namespace, daemon: KVStoreDaemon, redis: RedisServer,
                 nvme_dir: str, work: str) -> None:  # fmt: skip
        self.args = args
        self.daemon = daemon
        self.redis = redis
        self.nvme_dir = nvme_dir
        self.work = work
        self.run = Run()
        self.workers: list[WorkerProc] = []
        self.filler: str | None = None
        self.ledger: Ledger | None = None
        self.restarting = False

    def totals(self) -> Counter:
        total: Counter = Counter()
        for w in self.workers:
            total.update(w.counts)
        return total

    def sample(self) -> None:
        proc = self.daemon.proc
        # Nothing while it is being restarted: a starting daemon is no life's plateau.
        restarting = self.restarting or proc is None
        rss, fds = proc_sample(proc.pid) if not restarting and proc is not None else (0, 0)
        t = self.totals()
        self.run.samples.append(
            {
                "t": self.run.now(),
                "ops": sum(t[op] for op in OPS),
                "bytes_read": t["bytes_read"],
                "rss": rss,
                "fds": fds,
                "life": len(self.run.lives) - 1,
                "disk_used": shutil.disk_usage(self.nvme_dir).used,  # the filler's too
            }
        )

    def progress(self) -> None:
        s = self.run.samples
        if not s:
            return
        last = s[-1]
        back = next((x for x in reversed(s) if last["t"] - x["t"] >= 9.5), s[0])
        rate = (last["ops"] - back["ops"]) / max(1e-9, last["t"] - back["t"])
        t = self.totals()
        ledger = self.ledger
        print(
            f"[{last['t']:5.0f}s] ops {int(last['ops']):>7} ({rate:.0f}/s)  errors "
            f"{t['errors']}  wrong bytes {t['wrong_bytes']}  ledger acked "
            f"{len(ledger.acked) if ledger else 0} lost "
            f"{sum(c.lost for c in ledger.checks) if ledger else 0} errors "
            f"{ledger.errors if ledger else 0}  faults done "
            f"{sum(f.done_s >= 0 for f in self.run.faults)}/{len(self.run.faults)}  daemon RSS "
            f"{last['rss'] / MiB:.0f} MiB fds {int(last['fds'])}  NVMe fs used "
            f"{last['disk_used'] / MiB:.0f} MiB",
            flush=True,
        )

    def inject(self, fault: Fault) -> None:
        fault.wall = time.time()
        t = self.run.now()
        if fault.kind == "daemon kill":
            self.restarting = True
            self.daemon.kill()
            self.run.lives[-1] = (self.run.lives[-1][0], t)
            self.daemon.start()
            self.run.lives.append((self.run.now(), -1.0))
            self.restarting = False
            fault.detail = f"restarted in {self.run.now() - t:.1f}s"
        elif fault.kind == "redis restart":
            self.redis.kill()
            self.redis.start()
            fault.detail = f"restarted in {self.run.now() - t:.1f}s"
        elif fault.kind == "disk fill":
            self.filler, written = fill_disk(self.nvme_dir)
            free = shutil.disk_usage(self.nvme_dir).free
            fault.detail = f"filler {fmt_size(written)} written, {free} B left"
        elif fault.kind == "disk free":
            if self.filler:
                os.unlink(self.filler)
                self.filler = None
            fault.detail = "filler removed"
        fault.done_s = self.run.now()
        fault.wall_end = time.time()
        print(f"[{t:5.0f}s] fault: {fault.kind} ({fault.detail})", flush=True)
        if fault.kind in ("daemon kill", "redis restart") and self.ledger is not None:
            self.ledger.request_check(f"{fault.kind} at {fault.at_s:.0f}s")

    def go(self) -> int:
        args = self.args
        self.run.faults = fault_schedule(args.seconds)
        print(
            f"soak --faults: {args.seconds:.0f}s; 4 clients of tenants alpha (uid {ALPHA_UID}) "
            f"and beta (uid {BETA_UID}); CPU {args.cpu_capacity_mib} MiB (slabs "
            f"{args.cpu_slab_mib} MiB), NVMe {args.nvme_capacity_mib} MiB on a "
            f"{args.nvme_fs_mib} MiB tmpfs, durable puts; Redis maxmemory "
            f"{args.redis_maxmemory_mib} MiB with a MAC secret; namespaces "
            + ", ".join(
                f"{ns.name} ({fmt_size(ns.block_bytes)})"
                for spaces in TENANT_NS.values()
                for ns in spaces
            )
            + f", ledger ({fmt_size(LEDGER.block_bytes)}); faults: "
            + ", ".join(f"{f.kind} at {f.at_s:.0f}s" for f in self.run.faults),
            flush=True,
        )
        for tenant, uid in TENANT_UIDS.items():
            for index, transport in enumerate(("shm", "grpc")):
                plan = WorkerPlan(self.daemon.address, tenant, index, transport, args.seed,
                                  args.keyspace_mib, args.rpc_timeout)  # fmt: skip
                self.workers.append(WorkerProc(plan, uid, self.work))
        t_spawn = time.monotonic()
        for w in self.workers:
            if not w.ready.wait(max(1.0, args.startup_timeout - (time.monotonic() - t_spawn))):
                print(f"worker {w.name} not ready: {_tail(w.stderr_path, 3000)}", flush=True)
                return 1
        print(f"4 workers ready after {time.monotonic() - t_spawn:.0f}s", flush=True)
        self.run.t0, self.run.wall0 = time.monotonic(), time.time()
        self.run.lives.append((0.0, -1.0))
        self.ledger = Ledger(self.daemon.address, args.seed, args.rpc_timeout, self.run.t0)
        self.ledger.thread.start()
        pending = list(self.run.faults)
        injecting: threading.Thread | None = None  # a fault in its own thread: sampling goes on
        next_sample = next_progress = 0.0
        while self.run.now() < args.seconds:
            now = self.run.now()
            idle = injecting is None or not injecting.is_alive()
            if pending and now >= pending[0].at_s and idle:
                injecting = threading.Thread(target=self.inject, args=(pending.pop(0),))
                injecting.start()
            if now >= next_sample:
                self.sample()
                next_sample = now + args.sample_every
            if now >= next_progress:
                self.progress()
                next_progress = now + args.progress_every
            for w in self.workers:
                if w.proc.poll() is not None:
                    print(f"worker {w.name} exited {w.proc.returncode}:\n"
                          f"{_tail(w.stderr_path, 3000)}", flush=True)  # fmt: skip
                    return self.finish(aborted=f"worker {w.name} exited early")
            time.sleep(0.2)
        if injecting is not None:
            injecting.join()
        return self.finish()

    def finish(self, aborted: str = "") -> int:
        args = self.args
        for f in self.run.faults:  # a run cut short: what never happened is not shown
            if f.done_s < 0:
                f.detail = "not reached"
        if self.filler:
            os.unlink(self.filler)
        for w in self.workers:
            w.stop()
        end = time.monotonic() + args.rpc_timeout + 30
        for w in self.workers:
            try:
                w.proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.kill()
            w.reader.join(5)
        self.run.lives[-1] = (self.run.lives[-1][0], self.run.now())
        self.sample()
        self.run.samples[-1]["life"] = -1  # the clients are gone: no life's plateau
        assert self.ledger is not None
        self.ledger.stop()
        final: LedgerCheck | None = None
        try:
            for after in self.ledger.pending_checks():  # a slow machine: none is skipped
                self.ledger.check(after)
            final = self.ledger.check("the run")
        except Exception as exc:
            print(f"final ledger check failed: {type(exc).__name__}: {exc}", flush=True)
        finally:
            self.ledger.close()
        stats = daemon_stats(self.daemon.address)
        return report(self, stats, final, aborted)


# --------------------------------------------------------------------------- the report
def period_of(t: float, faults: list[Fault], t0: float | None = None) -> str:
    """When an error at wall time ``t``, of an operation begun at ``t0`` (default ``t``),
    happened: in which fault's window the operation overlapped, if any (an operation in flight
    when the daemon was killed fails of it, however late its last call ends)."""
    start = t if t0 is None else min(t0, t)
    for kind, period in (("daemon kill", "daemon down"), ("redis restart", "redis restart")):
        for f in faults:
            if f.kind == kind and f.wall and f.wall <= t and start <= f.wall_end + SETTLE_S:
                return period
    fill = next((f for f in faults if f.kind == "disk fill" and f.wall), None)
    free = next((f for f in faults if f.kind == "disk free" and f.wall), None)
    end = free.wall_end + SETTLE_S if free else float("inf")
    if fill and fill.wall <= t and start <= end:
        return "disk full"
    return "steady"


def growth(run: Run, life: int) -> dict[str, float] | None:
    """RSS and descriptors of one daemon life after its warm-up: the plateau (median), and the
    growth from the first third of the warm samples to the last (medians)."""
    start, end = run.lives[life]
    warm_from = start + min(30.0, 0.4 * (end - start))
    xs = [s for s in run.samples if s["life"] == life and s["t"] >= warm_from and s["rss"]]
    if len(xs) < 6:
        return None
    third = len(xs) // 3
    head, tail = xs[:third], xs[-third:]

    def med(rows: list[dict[str, float]], k: str) -> float:
        return statistics.median(r[k] for r in rows)

    return {
        "samples": len(xs),
        "rss_plateau": med(xs, "rss"),
        "rss_growth": med(tail, "rss") - med(head, "rss"),
        "fds_plateau": med(xs, "fds"),
        "fds_growth": med(tail, "fds") - med(head, "fds"),
        "rss_max": max(r["rss"] for r in xs),
        "fds_max": max(r["fds"] for r in xs),
    }


def report(soak: FaultSoak, stats: dict | None, final: LedgerCheck | None, aborted: str) -> int:
    args, run = soak.args, soak.run
    failures = [aborted] if aborted else []
    totals = soak.totals()
    seconds = max(1e-9, run.samples[-1]["t"]) if run.samples else 1.0
    print_table(
        "Operations (successful calls)",
        ["op", "total", "per s"],
        [[op, totals[op], totals[op] / seconds] for op in OPS]
        + [
            ["blocks put", totals["blocks_put"], totals["blocks_put"] / seconds],
            ["blocks read", totals["blocks_read"], totals["blocks_read"] / seconds],
        ],
    )
    print(
        f"\nbytes read and checked: {totals['bytes_read'] / MiB:.0f} MiB; wrong blocks "
        f"{totals['wrong_blocks']}, wrong bytes {totals['wrong_bytes']}"
    )
    ledger = soak.ledger
    assert ledger is not None
    events = [e for w in soak.workers for e in w.events] + ledger.events
    for e in [e for e in events if e["ev"] == "wrong"][:10]:
        print(f"  WRONG: {e['worker']} {e['ns']} prompt {e['prompt']}: {e['blocks']} blocks")
    if totals["wrong_bytes"] or totals["wrong_blocks"]:
        failures.append(f"{totals['wrong_bytes']} wrong bytes")

    errors = [e for e in events if e["ev"] == "error"]
    by: dict[str, Counter] = {}
    first: dict[str, str] = {}
    for e in errors:
        by.setdefault(e["kind"], Counter())[period_of(e["t"], run.faults, e.get("t0"))] += 1
        first.setdefault(e["kind"], f"{e['op']}: {e['msg']}")
    unexpected = {k: {p: n for p, n in c.items() if k not in LEGAL[p]} for k, c in by.items()}
    for e in errors:
        period = period_of(e["t"], run.faults, e.get("t0"))
        if (
            e["worker"] == "ledger"
            and e["kind"] == NOT_DURABLE
            and period not in LEDGER_NOT_DURABLE
        ):
            by_period = unexpected.setdefault("ledger " + NOT_DURABLE, {})
            by_period[period] = by_period.get(period, 0) + 1
    unexpected = {k: v for k, v in unexpected.items() if v}
    # What an operator needs to explain an unexpected error: when its operation began and
    # ended, relative to the start and to the faults.
    wall0 = run.wall0
    unexpected_samples = [
        {
            "began_s": round(e.get("t0", e["t"]) - wall0, 2),
            "ended_s": round(e["t"] - wall0, 2),
            "worker": e.get("worker", "?"),
            "op": e["op"],
            "kind": e["kind"],
            "msg": e["msg"][:200],
        }
        for e in errors
        if period_of(e["t"], run.faults, e.get("t0")) in unexpected.get(e["kind"], {})
    ][:12]
    print_table(
        f"Errors by kind and period ({len(errors)}; periods: a fault's window up to "
        f"{SETTLE_S:.0f}s after it is over)",
        ["kind", *PERIODS, "verdict", "first message"],
        [
            [
                k,
                *(c[p] for p in PERIODS),
                "UNEXPECTED" if k in unexpected else "legal",
                first[k][:90],
            ]
            for k, c in sorted(by.items(), key=lambda kc: -sum(kc[1].values()))
        ]
        or [["(none)", *(0 for _ in PERIODS), "", ""]],
    )
    if unexpected:
        failures.append(f"unexpected errors: {unexpected}")
        print_table(
            "Unexpected errors (first 12)",
            ["began s", "ended s", "worker", "op", "kind", "message"],
            [[u["began_s"], u["ended_s"], u["worker"], u["op"], u["kind"], u["msg"][:90]]
             for u in unexpected_samples],
        )  # fmt: skip

    print_table(
        f"Durable ledger ({LEDGER.name}, {fmt_size(LEDGER.block_bytes)} blocks; "
        f"{ledger.puts} blocks put durably, {ledger.deletes} deleted, {ledger.errors} failed "
        f"calls: {dict(ledger.error_kinds)}"
        + (f"; last: {ledger.last_error})" if ledger.errors else ")"),
        ["check after", "at s", "acknowledged", "read", "lost", "wrong", "found on retry",
         "NVMe tier"],
        [[c.after, c.at_s, c.acked, c.readable, c.lost, c.wrong, c.refused_then_found,
          c.nvme_counters] for c in ledger.checks],
    )  # fmt: skip
    lost = sum(c.lost for c in ledger.checks)
    lwrong = sum(c.wrong for c in ledger.checks)
    kill_checks = sum(c.after.startswith("daemon kill") for c in ledger.checks)
    kills = sum(f.kind == "daemon kill" and f.done_s >= 0 for f in run.faults)
    if lost or lwrong:
        failures.append(f"durable ledger: {lost} acknowledged blocks lost, {lwrong} wrong "
                        f"({ledger.lost_keys[:5]})")  # fmt: skip
    starved = [
        life
        for life, (start, end) in enumerate(run.lives)
        if not any(start <= t <= end for t in ledger.ack_times)
    ]
    print(
        f"ledger: NVMe tier at most {100 * ledger.nvme_peak:.0f} % full (its blocks are never "
        f"evicted while it has room); durable puts acknowledged in every daemon life: "
        f"{'no, none in lives ' + str(starved) if starved else 'yes'}"
    )
    if starved:
        failures.append(f"durable ledger: no durable put acknowledged in daemon lives {starved}")
    if kill_checks < kills or final is None:
        failures.append(f"durable ledger: {kill_checks} checks after {kills} daemon kills"
                        + ("" if final else ", no final check"))  # fmt: skip

    print_table(
        "Faults",
        ["fault", "scheduled s", "over at s", "detail"],
        [[f.kind, f.at_s, f.done_s if f.done_s >= 0 else None, f.detail] for f in run.faults],
    )
    if any(f.done_s < 0 for f in run.faults) and not aborted:
        failures.append("a fault was not injected")

    rows = []
    for life in range(len(run.lives)):
        g = growth(run, life)
        start, end = run.lives[life]
        if g is None:
            rows.append([life, start, end, "-", "-", "-", "-", "-"])
            continue
        rows.append([life, start, end, g["samples"], g["rss_plateau"] / MiB,
                     g["rss_growth"] / MiB, g["fds_plateau"], g["fds_growth"]])  # fmt: skip
        rss_limit = max(RSS_GROWTH, 0.1 * g["rss_plateau"])
        if g["rss_growth"] > rss_limit or g["fds_growth"] > FD_GROWTH:
            failures.append(
                f"daemon life {life}: RSS +{g['rss_growth'] / MiB:.0f} MiB (limit "
                f"{rss_limit / MiB:.0f}), fds +{g['fds_growth']:.0f} (limit {FD_GROWTH}) "
                "after warm-up"
            )
    print_table(
        f"Daemon RSS and descriptors per life (after warm-up: 40 % of the life, at most 30 s; "
        f"growth = last third - first third, limits {RSS_GROWTH // MiB} MiB or 10 %, "
        f"{FD_GROWTH} fds)",
        ["life", "from s", "to s", "samples", "RSS MiB", "RSS growth", "fds", "fds growth"],
        rows,
    )
    print_throughput(run)
    if stats is not None:
        print_table(
            "Tiers at the end",
            ["tier", "used", "capacity", "blocks", "evictions", "promotions", "demotions",
             "cksum fail"],
            [[t["name"], t["used_bytes"], t["capacity_bytes"], t["blocks"], t["evictions"],
              t["promotions"], t["demotions"], t["checksum_failures"]] for t in stats["tiers"]],
        )  # fmt: skip
        for t in stats["tiers"]:
            if t["name"] == "nvme":
                print(f"nvme tier: {json.dumps(t.get('extra', {}), sort_keys=True)}")
        print(f"tenants: {json.dumps(stats.get('tenants', []))}")
    with contextlib.suppress(Exception):
        info = redis_info(soak.redis.socket_path)
        print(f"redis: used_memory {int(info['used_memory']) / MiB:.0f} MiB, keys evicted "
              f"{info.get('evicted_keys', '?')} (since its restart)")  # fmt: skip

    # Graceful stop after all the kills: exit 0 expected.
    code: Any = None
    if soak.daemon.proc is not None:
        soak.daemon.proc.send_signal(signal.SIGTERM)
        try:
            code = soak.daemon.proc.wait(60)
        except subprocess.TimeoutExpired:
            code = "no exit 60s after SIGTERM"
        print(f"\ndaemon exit after SIGTERM: {code}")
        if code != 0:
            failures.append(f"daemon exit {code} after SIGTERM")
    tracebacks, found = daemon_log_findings(soak.daemon.log_path)
    print(f"daemon log ({len(run.lives)} lives): {tracebacks} tracebacks, "
          f"{sum(found.values())} problem lines")  # fmt: skip
    for ln, n in found.most_common(12):
        print(f"  {n:>5} x {ln}")
    if args.save_daemon_log:
        shutil.copyfile(soak.daemon.log_path, args.save_daemon_log)
    if args.plot:
        with contextlib.suppress(Exception):
            plot(run, args.plot)
            print(f"plot: {args.plot}")
    summary = {
        "seconds": args.seconds,
        "ops": {op: totals[op] for op in OPS},
        "blocks_read": totals["blocks_read"],
        "wrong_blocks": totals["wrong_blocks"],
        "wrong_bytes": totals["wrong_bytes"],
        "errors": {k: dict(c) for k, c in by.items()},
        "unexpected_errors": unexpected,
        "unexpected_samples": unexpected_samples,
        "ledger_checks": [asdict(c) for c in ledger.checks],
        "durable_lost": lost,
        "durable_wrong": lwrong,
        "daemon_kills": kills,
        "faults": [asdict(f) for f in run.faults],
        "lives": [growth(run, life) for life in range(len(run.lives))],
        "sigterm_exit": code,
        "failures": failures,
    }
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    print("\nRESULT: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))
    return 1 if failures else 0


def print_throughput(run: Run, every_s: float = 10.0) -> None:
    rows = []
    s = run.samples
    i = 0
    while i < len(s) - 1:
        j = next((k for k in range(i + 1, len(s)) if s[k]["t"] - s[i]["t"] >= every_s), len(s) - 1)
        dt = max(1e-9, s[j]["t"] - s[i]["t"])
        marks = [f.kind for f in run.faults if f.done_s >= 0 and s[i]["t"] <= f.at_s < s[j]["t"]]
        down = not s[j]["rss"]  # sampled while the daemon restarted
        rows.append([f"{s[i]['t']:.0f}-{s[j]['t']:.0f}", (s[j]["ops"] - s[i]["ops"]) / dt,
                     (s[j]["bytes_read"] - s[i]["bytes_read"]) / dt / MiB,
                     None if down else s[j]["rss"] / MiB, None if down else int(s[j]["fds"]),
                     s[j]["disk_used"] / MiB, ", ".join(marks)])  # fmt: skip
        i = j
    print_table(
        f"Throughput over time (every {every_s:.0f}s)",
        ["s", "ops/s", "MiB/s read", "RSS MiB", "fds", "NVMe fs MiB", "faults"],
        rows,
    )


def plot(run: Run, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = run.samples
    t = [x["t"] for x in s]
    rate = [0.0] + [
        (b["ops"] - a["ops"]) / max(1e-9, b["t"] - a["t"]) for a, b in itertools.pairwise(s)
    ]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    top.plot(t, rate, lw=1, color="tab:green", label="operations/s (all clients)")
    top.set_ylabel("operations/s")
    colors = {"daemon kill": "red", "redis restart": "blue", "disk fill": "orange",
              "disk free": "orange"}  # fmt: skip
    for f in run.faults:
        if f.done_s >= 0:
            for ax in (top, bottom):
                ax.axvline(f.at_s, color=colors[f.kind], ls="--" if "disk" in f.kind else "-",
                           lw=1)  # fmt: skip
            top.text(f.at_s, max(rate or [1]) * 0.98, f" {f.kind}", color=colors[f.kind],
                     rotation=90, va="top", fontsize=8)  # fmt: skip
    top.legend(loc="lower left")
    top.set_title("kvstore soak with faults")
    nan = float("nan")  # a gap while the daemon restarts
    rss = [x["rss"] / MiB if x["rss"] else nan for x in s]
    bottom.plot(t, rss, color="tab:purple", label="daemon RSS (MiB)")
    bottom.set_ylabel("RSS MiB")
    bottom.set_xlabel("seconds")
    fds = bottom.twinx()
    fds.plot(t, [x["fds"] if x["rss"] else nan for x in s], color="tab:gray",
             label="open descriptors")  # fmt: skip
    fds.set_ylabel("descriptors")
    bottom.legend(loc="upper left")
    fds.legend(loc="upper right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------- entry
def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="soak.py --faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600.0, help="run time of the clients")
    p.add_argument("--smoke", action="store_true", help="a 30 s run with every fault")
    p.add_argument("--plot", default="var/soak-faults.png", help="PNG path ('' for none)")
    p.add_argument("--summary-json", metavar="PATH", help="the report's figures as JSON")
    p.add_argument("--cpu-capacity-mib", type=int, default=64)
    p.add_argument("--cpu-slab-mib", type=int, default=4)
    p.add_argument(
        "--nvme-capacity-mib",
        type=int,
        default=2048,
        help="the NVMe file: 8 of the daemon's 256 MiB disk slabs, one per block size and spare "
        "(a smaller tier is one slab, which holds one block size at a time)",
    )
    p.add_argument(
        "--tenant-nvme-mib",
        type=int,
        default=32,
        help="quota_nvme of alpha and of beta: the tier as a whole never fills, so the ledger is "
        "never evicted, while each tenant evicts its own disk blocks all the time",
    )
    p.add_argument(
        "--nvme-fs-mib",
        type=int,
        default=512,
        help="the tmpfs the NVMe file is on: smaller than the file, which is then sparse (its "
        "slots take space as they are first written) and feels the filesystem fill up",
    )
    p.add_argument("--redis-maxmemory-mib", type=int, default=32)
    p.add_argument("--keyspace-mib", type=int, default=64, help="distinct bytes per namespace")
    p.add_argument("--rpc-timeout", type=float, default=10.0, help="client deadline per call")
    p.add_argument("--sample-every", type=float, default=2.0, help="RSS/fds/throughput (s)")
    p.add_argument("--progress-every", type=float, default=10.0)
    p.add_argument("--startup-timeout", type=float, default=120.0, help="for the workers (s)")
    p.add_argument("--save-daemon-log", metavar="PATH", help="copy the daemon's log there")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.smoke:
        args.seconds = 30.0
    if args.seconds < 20:
        p.error("--seconds must be at least 20 (two daemon kills, a Redis restart, a full disk)")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        print("soak --faults needs root and setpriv (clients under other uids, a tmpfs)",
              file=sys.stderr)  # fmt: skip
        return 2
    if redis_server_path() is None:
        print("redis-server not found: apt-get install -y redis-server", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.ExitStack() as stack:
        work = tempfile.mkdtemp(prefix="kvfaults-", dir="/tmp")
        stack.callback(shutil.rmtree, work, True)
        mac_file = os.path.join(work, "redis-mac.key")
        with open(os.open(mac_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        nvme_dir = stack.enter_context(
            mount_tmpfs(os.path.join(work, "nvme"), f"{args.nvme_fs_mib}m")
        )
        redis = stack.enter_context(
            RedisServer(
                extra_args=[
                    "--maxmemory",
                    f"{args.redis_maxmemory_mib}mb",
                    "--maxmemory-policy",
                    "allkeys-lru",
                ]
            )
        )
        cfg = os.path.join(work, "daemon.toml")
        with open(cfg, "w") as f:
            f.write(config_toml(args, redis.socket_path, mac_file, nvme_dir))
        daemon = stack.enter_context(
            KVStoreDaemon(args.cpu_capacity_mib * MiB, extra_args=["--config", cfg, "--gpu", "off"])
        )
        soak = FaultSoak(args, daemon, redis, nvme_dir, work)
        try:
            return soak.go()
        finally:
            for w in soak.workers:
                w.stop()
            for w in soak.workers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    w.proc.wait(5)
                w.kill()
    return 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        try:
            worker_main(WorkerPlan(**json.loads(sys.argv[2])))
        except BaseException:
            traceback.print_exc()
            raise
    else:
        from _harness import run_main

        run_main(lambda: main(sys.argv[1:]))
