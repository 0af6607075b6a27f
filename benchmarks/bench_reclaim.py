"""Time from a client's death to its slots being reusable.

A real daemon (``kvstore serve``, CPU tier of 192 MiB: 96 slots of 2 MiB) runs with lease and
reservation TTLs of 600 s, so nothing but the closed connection can explain a reclaim within the
run, and with ``limits.max_pinned_share = 1``, so that one client may pin most of the tier (by
default a handle may pin half of it while other handles are open). Setup: the parent's client
puts 16 blocks (2 MiB, Llama-3-8B-shaped) that the children will lease, and fills the other 80
slots once and deletes them, so that every slot is already mapped in the parent (a first touch
of shared-memory pages costs minor faults that would otherwise be charged to the reclaim).

Each run starts a child process (this script with ``--child``) that imports kvstore, opens a
``KVStoreClient`` (same namespace) and waits for "go". Then it reserves 64 new blocks with
``kv.reserve(keys)`` (128 MiB, never written or committed), acquires a lease on the 16 stored
blocks with ``kv.acquire(keys)`` (80 of the 96 slots now held), prints what it holds and
SIGKILLs itself. The parent takes the moment of death as the return of ``waitpid`` (it polls a
pidfd, with a timeout, then reaps), and then, in turn from run to run:

* ``stats``: polls ``Stats`` on a raw gRPC stub of its own channel (a call at most every 1 ms)
  until ``active_reservations`` and ``active_leases`` are back to their values before the child
  reserved (and ``open_handles`` too);
* ``warm``: the same, but the parent calls ``Stats`` back to back from the child's "held" line
  on, checking the pidfd after each reply (``warm_run``), so the channel is busy, not idle,
  when the child dies; the first reply to a call made after ``waitpid`` returned that shows
  the reclaim ends the measurement, and replies that showed it before are counted;
* ``put``: puts the child's 64 keys itself (``kv.put``, 128 MiB through shared memory) until
  all 64 are newly stored. A put that arrives while the dead child's reservation still exists
  waits for that writer (``limits.write_wait_s``), so the put succeeds as soon as the daemon
  has noticed the death; it is retried if it ever returns with keys still pending. The same
  put of 64 keys into free slots (the keys deleted first) is timed right after, for scale.

In the same run: an empty unary gRPC call (the health ``Check``) and one ``Stats`` call on the
same channel, for scale (the latter is the polling resolution), and the ``Stats`` call each run
makes right after the child opened its client, which follows the same idle wait (the child's
start-up, ~1.5 s) as the first poll after a death: if the first poll already finds everything
reclaimed, the reclaim took at most that call's time. The TTL-based reclaim the
previous design relied on is the default ``reservation_ttl_s`` / ``lease_ttl_s`` (30 s, plus
up to one reaper interval, 0.5 s); an expired reservation's slots were then quarantined one
more TTL before reuse.

Nothing can hang: every RPC has a deadline, every wait on a child has a timeout (a child that
misbehaves is killed), polling gives up after ``--give-up-s``, a SIGALRM past the time budget
unwinds the script, and the daemon is stopped on every exit.

    .venv/bin/python benchmarks/bench_reclaim.py [--quick] [--json] [--runs 20]   # ~1-2 min
    .venv/bin/python benchmarks/bench_reclaim.py --smoke   # one run of each mode
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

from _harness import (
    KVStoreDaemon,
    Reporter,
    emit,
    parse_args,
    percentile,
    print_header,
    run_main,
)

MIB = 1 << 20
LAYERS = 32  # x 8 KV heads x 128 dims x 16 tokens x 2 (K, V) x bf16 = 2 MiB per block
RESERVE_BLOCKS = 64
LEASE_BLOCKS = 16
CPU_CAPACITY = 192 * MIB  # 96 slots: the child holds 80
TTL_S = 600.0
OLD_TTL_S = 30.0  # the default reservation_ttl_s / lease_ttl_s
REAPER_S = 0.5  # the default reaper_interval_s
MODEL = "bench-reclaim"
MODES = ("stats", "put", "warm")
RPC_TIMEOUT_S = 10.0
CHILD_TIMEOUT_S = 60.0


def layout() -> Any:
    from kvstore import KVLayout

    return KVLayout(num_layers=LAYERS, num_kv_heads=8, head_dim=128, block_size=16)


def keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=32).digest() for i in range(n)]


def run_keys(run: int) -> list[bytes]:
    return keys(f"run{run}", RESERVE_BLOCKS)


LEASE_KEYS_TAG = "leased"


# --------------------------------------------------------------------------- the child
def child(address: str, run: int) -> int:
    """Open, say so, wait for "go", reserve and lease, say so, die by SIGKILL."""
    from kvstore import KVStoreClient

    kv = KVStoreClient(address, layout=layout(), model=MODEL, timeout_s=RPC_TIMEOUT_S)
    print("open", flush=True)
    ready, _, _ = select.select([sys.stdin], [], [], CHILD_TIMEOUT_S)
    if not ready or sys.stdin.readline().strip() != "go":
        return 1
    reservation = kv.reserve(run_keys(run))
    lease = kv.acquire(keys(LEASE_KEYS_TAG, LEASE_BLOCKS))
    print(f"held {len(reservation.indices)} {len(lease.offsets)}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    return 1  # not reached


# --------------------------------------------------------------------------- the parent
class Child:
    """One child process, killed on exit whatever happened."""

    def __init__(self, address: str, run: int) -> None:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", address, str(run)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,  # unbuffered: select() on the pipe sees every line
        )
        self.pidfd = os.pidfd_open(self.proc.pid)

    def readline(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"child {self.proc.pid}: no line within {timeout_s} s")
        return self.proc.stdout.readline().decode().strip()

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")

    def wait_death(self, timeout_s: float) -> float:
        """perf_counter() when waitpid returned. The pidfd becomes readable when the process
        has exited; waitpid then returns at once (Popen.wait with a timeout would sleep-poll)."""
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        if not poller.poll(timeout_s * 1000):
            raise TimeoutError(f"child {self.proc.pid} still alive after {timeout_s} s")
        self.proc.wait()
        t = time.perf_counter()
        if self.proc.returncode != -signal.SIGKILL:
            raise RuntimeError(f"child exited with {self.proc.returncode}, not SIGKILL")
        return t

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        os.close(self.pidfd)


def held(stats: Any) -> tuple[int, int, int]:
    return (stats.active_reservations, stats.active_leases, stats.open_handles)


def poll_until(stub: Any, pb: Any, want: tuple[int, int, int], give_up_s: float) -> int:
    """Call Stats (at most one call per ms) until (reservations, leases, handles) == ``want``;
    returns how many calls it took. TimeoutError after ``give_up_s``."""
    req = pb.StatsRequest()
    deadline = time.perf_counter() + give_up_s
    calls = 0
    while True:
        t0 = time.perf_counter()
        calls += 1
        if held(stub.Stats(req, timeout=RPC_TIMEOUT_S)) == want:
            return calls
        if t0 > deadline:
            raise TimeoutError(f"not reclaimed within {give_up_s} s")
        rest = 0.001 - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)


def warm_run(
    child_proc: Child, stub: Any, pb: Any, want: tuple[int, int, int], give_up_s: float
) -> dict[str, float]:
    """The channel kept busy up to the death: Stats back to back, the pidfd checked after each
    reply, until waitpid has returned and a reply shows everything reclaimed. Resolution: one
    Stats call either side. A reply sent after waitpid returned that shows the reclaim ends
    it; a reply before it that showed the reclaim already is counted as "early" (the kernel
    closes a dying process's sockets before its parent can reap it)."""
    req = pb.StatsRequest()
    poller = select.poll()
    poller.register(child_proc.pidfd, select.POLLIN)
    deadline = time.perf_counter() + give_up_s
    early = False
    t_death = None
    while time.perf_counter() < deadline:
        if t_death is None and poller.poll(0):
            child_proc.proc.wait()
            t_death = time.perf_counter()
        t0 = time.perf_counter()
        back = held(stub.Stats(req, timeout=RPC_TIMEOUT_S)) == want
        if back and t_death is None:
            early = True
        if back and t_death is not None and t0 >= t_death:
            return {"since_death": time.perf_counter() - t_death, "early": float(early)}
    raise TimeoutError(f"not reclaimed within {give_up_s} s (warm)")


def timed_calls(fn: Any, n: int) -> list[float]:
    fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def ms(samples: list[float], q: float) -> float:
    return percentile(samples, q) * 1e3


def measure(args: argparse.Namespace, out: Reporter) -> dict[str, Any]:
    import grpc
    import torch
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore import KVStoreClient
    from kvstore.v1 import kvstore_pb2 as pb
    from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

    result: dict[str, Any] = {
        "stats": [],
        "put": [],
        "put_alone": [],
        "warm": [],
        "idle_stats_call": [],
        "first_poll_hits": 0,
        "reclaimed_before_waitpid": 0,
    }
    lay = layout()
    with tempfile.NamedTemporaryFile("w", suffix=".toml", prefix="kvbench-reclaim-") as cfg:
        cfg.write(
            f"[daemon]\nlease_ttl_s = {TTL_S}\nreservation_ttl_s = {TTL_S}\n"
            f"reaper_interval_s = {REAPER_S}\n\n[limits]\nmax_pinned_share = 1.0\n"
        )
        cfg.flush()
        daemon_args = ["--config", cfg.name, "--gpu", "off"]
        with KVStoreDaemon(CPU_CAPACITY, extra_args=daemon_args) as daemon:
            channel = grpc.insecure_channel(daemon.address)
            try:
                stub = pb_grpc.KVStoreStub(channel)
                health = health_pb2_grpc.HealthStub(channel)
                with KVStoreClient(
                    daemon.address, layout=lay, model=MODEL, timeout_s=RPC_TIMEOUT_S
                ) as kv:
                    gen = torch.Generator().manual_seed(1)
                    shape = (RESERVE_BLOCKS, *lay.block_shape)
                    blocks = torch.randn(shape, generator=gen, dtype=torch.float32).to(lay.dtype)
                    lease_keys = keys(LEASE_KEYS_TAG, LEASE_BLOCKS)
                    if kv.put(lease_keys, blocks[:LEASE_BLOCKS]) != LEASE_BLOCKS:
                        raise RuntimeError("setup put stored fewer than 16 blocks")
                    # Fault every free slot into this process's mapping of the arena (a put
                    # into pages it never touched pays minor faults, ~0.1 ms per MiB, which
                    # would be charged to the reclaim).
                    filler = keys("filler", CPU_CAPACITY // lay.block_bytes - LEASE_BLOCKS)
                    for i in range(0, len(filler), RESERVE_BLOCKS):
                        part = filler[i : i + RESERVE_BLOCKS]
                        if kv.put(part, blocks[: len(part)]) != len(part):
                            raise RuntimeError("setup: the filler put stored too few blocks")
                    kv.delete(filler)
                    before = held(stub.Stats(pb.StatsRequest(), timeout=RPC_TIMEOUT_S))
                    result["before"] = before
                    check = health_pb2.HealthCheckRequest()
                    calls = 20 if args.smoke else 300
                    empty = timed_calls(lambda: health.Check(check, timeout=RPC_TIMEOUT_S), calls)
                    stats_call = timed_calls(
                        lambda: stub.Stats(pb.StatsRequest(), timeout=RPC_TIMEOUT_S), calls
                    )
                    result["empty_call"] = empty
                    result["stats_call"] = stats_call
                    soft_deadline = time.monotonic() + args.max_seconds - 40
                    for run in range(len(MODES) * args.runs):
                        mode = MODES[run % len(MODES)]
                        if run % len(MODES) == 0 and time.monotonic() > soft_deadline:
                            out.line(f"  time budget: stopping after {run} runs")
                            break
                        got = one_run(run, mode, daemon.address, kv, stub, pb, blocks, before, args)
                        result[mode].append(got["since_death"])
                        result["idle_stats_call"].append(got["idle_stats"])
                        if mode == "put":
                            result["put_alone"].append(got["put_alone"])
                        elif mode == "stats" and got["polls"] == 1:
                            result["first_poll_hits"] += 1
                        if got.get("early"):
                            result["reclaimed_before_waitpid"] += 1
                        if not args.json and (run + 1) % 15 == 0:
                            out.line(f"  {run + 1}/{len(MODES) * args.runs} runs")
                    result["after"] = held(stub.Stats(pb.StatsRequest(), timeout=RPC_TIMEOUT_S))
            finally:
                channel.close()
    return result


def one_run(
    run: int,
    mode: str,
    address: str,
    kv: Any,
    stub: Any,
    pb: Any,
    blocks: Any,
    before: tuple[int, int, int],
    args: argparse.Namespace,
) -> dict[str, float]:
    child_proc = Child(address, run)
    try:
        line = child_proc.readline(CHILD_TIMEOUT_S)
        if line != "open":
            raise RuntimeError(f"child said {line!r}, not 'open'")
        # The child's handle is open now: that is the state its death must restore. This
        # call comes after the same idle wait (the child's start) as the first poll after a
        # death, so it is timed too.
        t0 = time.perf_counter()
        want = held(stub.Stats(pb.StatsRequest(), timeout=RPC_TIMEOUT_S))
        idle_stats = time.perf_counter() - t0
        if want[:2] != before[:2]:
            raise RuntimeError(f"before the child reserved: {want}, expected {before}")
        child_proc.go()
        line = child_proc.readline(CHILD_TIMEOUT_S)
        if line != f"held {RESERVE_BLOCKS} {LEASE_BLOCKS}":
            raise RuntimeError(f"child said {line!r}")
        want = (before[0], before[1], want[2] - 1)
        if mode == "warm":
            return warm_run(child_proc, stub, pb, want, args.give_up_s) | {"idle_stats": idle_stats}
        t_death = child_proc.wait_death(CHILD_TIMEOUT_S)
        if mode == "stats":
            polls = poll_until(stub, pb, want, args.give_up_s)
            since = time.perf_counter() - t_death
            return {"since_death": since, "polls": polls, "idle_stats": idle_stats}
        ks = run_keys(run)
        stored = 0
        while True:
            got = kv.put(ks, blocks)
            stored += int(got)
            if stored == RESERVE_BLOCKS:
                break
            if time.perf_counter() - t_death > args.give_up_s:
                raise TimeoutError(f"put of the dead child's keys: {stored} stored")
        since = time.perf_counter() - t_death
        if kv.delete(ks) != RESERVE_BLOCKS:
            raise RuntimeError("delete of the put keys")
        t0 = time.perf_counter()
        if kv.put(ks, blocks) != RESERVE_BLOCKS:
            raise RuntimeError("the reference put stored fewer than 64 blocks")
        alone = time.perf_counter() - t0
        if kv.delete(ks) != RESERVE_BLOCKS:
            raise RuntimeError("delete of the put keys")
        poll_until(stub, pb, want, args.give_up_s)  # left as found
        return {"since_death": since, "put_alone": alone, "idle_stats": idle_stats}
    finally:
        child_proc.close()


def report(out: Reporter, r: dict[str, Any]) -> dict[str, Any]:
    rows = []
    summary: dict[str, Any] = {}
    for name, key in (
        ("death -> Stats shows reservations and leases back", "stats"),
        ("  the same, channel kept busy up to the death", "warm"),
        ("death -> put of the dead child's 64 keys done", "put"),
        ("  the same put into free slots (for scale)", "put_alone"),
        ("empty unary gRPC call (health Check)", "empty_call"),
        ("one Stats call (the polling resolution)", "stats_call"),
        ("one Stats call after the same idle wait, no death", "idle_stats_call"),
    ):
        xs = r[key]
        summary[key] = {"median_ms": ms(xs, 0.5), "p90_ms": ms(xs, 0.9), "n": len(xs)}
        rows.append((name, len(xs), ms(xs, 0.5), ms(xs, 0.9), min(xs) * 1e3, max(xs) * 1e3))
    out.table(
        f"Reclaim after SIGKILL: {RESERVE_BLOCKS} x 2 MiB reserved + {LEASE_BLOCKS} leased of "
        f"{CPU_CAPACITY // (2 * MIB)} slots; TTLs {TTL_S:.0f} s",
        ["ms", "n", "median", "p90", "min", "max"],
        rows,
    )
    med_stats = summary["stats"]["median_ms"] / 1e3
    med_put = summary["put"]["median_ms"] / 1e3
    gap = (summary["put"]["median_ms"] - summary["put_alone"]["median_ms"]) / 1e3
    rows = [
        (
            "reservations + leases reclaimed",
            f"{OLD_TTL_S:.0f}-{OLD_TTL_S + REAPER_S:.1f} s",
            f"{med_stats * 1e3:.2f} ms",
            f"{OLD_TTL_S / med_stats:,.0f}x",
        ),
        (
            "the dead writer's keys writable again (put done)",
            f"{OLD_TTL_S:.0f}-{OLD_TTL_S + REAPER_S:.1f} s",
            f"{med_put * 1e3:.1f} ms",
            f"{OLD_TTL_S / med_put:,.0f}x",
        ),
        (
            "its slots reusable (TTL + quarantine)",
            f"{2 * OLD_TTL_S:.0f}-{2 * OLD_TTL_S + 2 * REAPER_S:.0f} s",
            f"{med_put * 1e3:.1f} ms",
            f"{2 * OLD_TTL_S / med_put:,.0f}x",
        ),
    ]
    out.table(
        "Against the TTL-based reclaim (default TTL 30 s, reaper every 0.5 s), medians",
        ["", "TTL-based", "on close", "ratio"],
        rows,
    )
    out.line(
        textwrap.fill(
            f"Stats polls that already saw the reclaim on the first call: "
            f"{r['first_poll_hits']} of {len(r['stats'])}. The put's own cost (a 128 MiB copy "
            f"and checksum) dominates its row: death -> put done minus the same put into free "
            f"slots: {gap * 1e3:+.2f} ms (medians).",
            100,
        )
    )
    out.line(
        f"Busy-channel runs in which a Stats reply showed the reclaim before waitpid returned: "
        f"{r['reclaimed_before_waitpid']} of {len(r['warm'])}."
    )
    out.line(f"Stats (reservations, leases, handles) before: {r['before']}, after: {r['after']}")
    summary["first_poll_hits"] = r["first_poll_hits"]
    summary["ttl_ratio_stats"] = OLD_TTL_S / med_stats
    summary["ttl_ratio_put"] = OLD_TTL_S / med_put
    return summary


def extra_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--runs", type=int, default=0, help="runs per measure (default 20, quick 3, smoke 1)"
    )
    p.add_argument("--give-up-s", type=float, default=20.0, help="per reclaim wait")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=170.0,
        help="hard budget (SIGALRM); no new round of runs starts in the last 40 s",
    )


def _alarm(signum: int, frame: object) -> None:
    raise TimeoutError("bench_reclaim: time budget exceeded")


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0], extra_args)
    args.runs = args.runs or (1 if args.smoke else 3 if args.quick else 20)
    out = Reporter(args.json)
    if not args.json:
        print_header("bench_reclaim", args)
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(args.max_seconds))
    try:
        raw = measure(args, out)
    finally:
        signal.alarm(0)
    summary = report(out, raw)
    emit({"summary": summary, "raw": raw}, args)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2], int(sys.argv[3])))
    run_main(main)
