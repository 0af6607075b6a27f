"""Mooncake Store as bench_trace's peer: one replay of the trace, run in ``.venv-mooncake``.

``bench_trace.py`` starts this module with ``.venv-mooncake/bin/python`` (``scripts/
mooncake_env.sh`` builds it from ``mooncake-transfer-engine-non-cuda`` on PyPI) and reads one
JSON document back from ``--json-out``. Nothing of kvstore is imported here: only numpy,
Mooncake's wheel and ``_trace_sim`` (the same trace, keys and block bytes as every other store).

Each run starts empty: a fresh ``mooncake_master`` (its HTTP metadata server embedded, every
port on 127.0.0.1, ``MC_TCP_BIND_ADDRESS=127.0.0.1``, its eviction settings left at their
defaults) and, per mode, a segment of exactly ``--capacity-bytes`` (Mooncake refuses a segment
under 16 MiB: a smaller capacity is raised to that, and said so):

* ``tcp``: the Python store client (``MooncakeDistributedStore.setup``, protocol ``tcp``) mounts
  the segment in this process, with ``MC_STORE_MEMCPY=0``: every block moves through the TCP
  transport over loopback, as it would to a segment on another host.
* ``embedded``: the same, with Mooncake's default for a TCP-only host (``MC_STORE_MEMCPY``
  unset: a block bound for the client's own segment is a local memcpy, no TCP).
* ``shm``: Mooncake's same-host mode. A standalone ``mooncake_client`` process (the "real
  client") mounts the segment; this process is a dummy client (``setup_dummy``) that speaks to
  it over RPC and hands it its buffers as shared memory (``alloc_from_mem_pool`` +
  ``register_buffer``: memfd segments passed over the IPC socket), so a put or get is one RPC
  and a memcpy in the real client.

Per request: ``batch_is_exist`` finds the leading run of stored blocks, ``batch_get_into``
reads it into registered memory (a block that went between the two calls ends the run), then
``batch_put_from`` puts the blocks after the leading run: three round trips, the same request
as the Redis replay. A put refused (a negative code: ``-200`` NO_AVAILABLE_HANDLE when no
space could be allocated, ``-705`` when the block is already stored) is counted by code.
Every hit's bytes are checked against its key, untimed.

Reported (JSON): per-request hits and latency, blocks held at the end (the master's
``master_key_count``), bytes allocated against capacity, and the master's eviction counters.

    .venv-mooncake/bin/python benchmarks/_mooncake_peer.py --mode shm --capacity-bytes N \
        --block-bytes 16384 [--trace PATH] [--requests N] --json-out OUT.json

``--transfer`` (``bench_transfer.py``'s peer): block throughput instead of a replay. The store
is set up once (a segment of ``--capacity-bytes``; in ``shm`` mode a memory pool holding two
buffers of ``--working-set-bytes``, the source of puts and the destination of gets, both shared
with the real client); then each line read from stdin, ``{"block_bytes": N, "batch": B}``, runs
one round over the working set cut in blocks of N: ``batch_put_from`` of each batch of B new
keys, ``batch_get_into`` of each into the registered destination (Mooncake's zero-copy batch
calls: in ``shm`` mode one RPC and one memcpy a block in the real client), every block checked
untimed, then ``remove_all(force=True)`` (gets hold 10 s leases; kvstore's bench deletes its
keys between rounds too). It answers one JSON line per round on stdout, ``{"put_s": [...],
"get_s": [...]}`` (seconds per batch); anything Mooncake's libraries write to stdout goes to
stderr. An empty line or end of input ends it.

    .venv-mooncake/bin/python benchmarks/_mooncake_peer.py --mode shm --transfer \
        --capacity-bytes N --working-set-bytes N
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _trace_sim import BlockContent, default_trace_path, load_trace

MODES = ("tcp", "embedded", "shm")
MIN_SEGMENT = 16 << 20  # Mooncake refuses a smaller global segment
LOCAL_BUFFER = 16 << 20  # the client's transfer buffer (not store capacity)
READY_TIMEOUT_S = 30.0
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str, log: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {tail(log)}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {HOST}:{port} in {READY_TIMEOUT_S:.0f} s")


def tail(path: str, n: int = 2000) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return f.read()[-n:]
    return ""


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def mooncake(
    mode: str, segment_bytes: int, workdir: str, pool_bytes: int = LOCAL_BUFFER
) -> Iterator[tuple[Any, str]]:
    """A fresh master (and for ``shm`` a real client) and a connected store client: yields
    (store, metrics URL). ``pool_bytes``: the ``shm`` client's shared memory pool."""
    bindir = Path(sys.executable).parent
    master_bin = shutil.which("mooncake_master", path=str(bindir)) or "mooncake_master"
    rpc, http, metrics = free_port(), free_port(), free_port()
    metadata = f"http://{HOST}:{http}/metadata"
    procs: list[subprocess.Popen[bytes]] = []
    store = None
    try:
        log = os.path.join(workdir, "master.log")
        with open(log, "wb") as out:
            procs.append(
                subprocess.Popen(
                    [
                        master_bin,
                        f"--rpc_port={rpc}",
                        f"--rpc_address={HOST}",
                        "--enable_http_metadata_server=true",
                        f"--http_metadata_server_host={HOST}",
                        f"--http_metadata_server_port={http}",
                        f"--metrics_host={HOST}",
                        f"--metrics_port={metrics}",
                        "--logtostderr",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
        wait_port(rpc, procs[0], "mooncake_master", log)
        wait_port(http, procs[0], "mooncake_master (metadata)", log)
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        if mode == "shm":
            client_bin = shutil.which("mooncake_client", path=str(bindir)) or "mooncake_client"
            port = free_port()
            clog = os.path.join(workdir, "client.log")
            with open(clog, "wb") as out:
                procs.append(
                    subprocess.Popen(
                        [
                            client_bin,
                            f"--host={HOST}",
                            f"--port={port}",
                            f"--global_segment_size={segment_bytes}",
                            f"--master_server_address={HOST}:{rpc}",
                            f"--metadata_server={metadata}",
                            "--protocol=tcp",
                            "--logtostderr",
                        ],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )
            wait_port(port, procs[-1], "mooncake_client", clog)
            rc = store.setup_dummy(pool_bytes, LOCAL_BUFFER, f"{HOST}:{port}")
        else:
            rc = store.setup(
                HOST, metadata, segment_bytes, LOCAL_BUFFER, "tcp", "", f"{HOST}:{rpc}"
            )
        if rc != 0:
            raise RuntimeError(f"Mooncake store client setup ({mode}) returned {rc}")
        yield store, f"http://{HOST}:{metrics}/metrics"
    finally:
        if store is not None:
            with contextlib.suppress(Exception):
                store.close()
        for p in reversed(procs):
            stop(p)


def master_metrics(url: str) -> dict[str, float]:
    """The master's Prometheus counters and gauges without labels."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+) ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def buffers(store: Any, mode: str, rows: int, block_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Two registered (rows, block_bytes) arrays: source of puts, destination of gets. In
    ``shm`` mode they are shared memory the real client maps."""
    n = rows * block_bytes
    arrays = []
    for _ in range(2):
        if mode == "shm":
            ptr = store.alloc_from_mem_pool(n)
            if not ptr:
                raise RuntimeError(f"alloc_from_mem_pool({n}) failed")
            a = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))
        else:
            a = np.zeros(n, dtype=np.uint8)
        rc = store.register_buffer(a.ctypes.data, n)
        if rc != 0:
            raise RuntimeError(f"register_buffer returned {rc} ({mode})")
        arrays.append(a.reshape(rows, block_bytes))
    return arrays[0], arrays[1]


def replay(args: argparse.Namespace) -> dict[str, Any]:
    trace = Path(args.trace) if args.trace else default_trace_path()
    chains = load_trace(trace, args.requests)
    bb = args.block_bytes
    content = BlockContent(bb)
    segment = max(args.capacity_bytes, MIN_SEGMENT)
    longest = max(len(c.keys) for c in chains)
    set_env(args.mode)
    hits: list[int] = []
    latency: list[float] = []
    put_codes: Counter[int] = Counter()
    get_lost = 0  # found by batch_is_exist, gone by batch_get_into
    with (
        tempfile.TemporaryDirectory(prefix="kvbench-mooncake-") as workdir,
        mooncake(args.mode, segment, workdir) as (store, metrics_url),
    ):
        src, out = buffers(store, args.mode, longest, bb)
        src_ptrs = [int(src[i].ctypes.data) for i in range(longest)]
        out_ptrs = [int(out[i].ctypes.data) for i in range(longest)]
        sizes = [bb] * longest
        started = time.monotonic()
        for i, chain in enumerate(chains):
            keys = [k.hex() for k in chain.keys]
            n = len(keys)
            content.fill(chain.keys, src)
            t0 = time.perf_counter()
            found = store.batch_is_exist(keys)
            m = 0
            while m < n and found[m] == 1:
                m += 1
            got = 0
            if m:
                read = store.batch_get_into(keys[:m], out_ptrs[:m], sizes[:m])
                while got < m and read[got] == bb:
                    got += 1
            if m < n:
                put = store.batch_put_from(keys[m:], src_ptrs[m:n], sizes[m:n])
            latency.append(time.perf_counter() - t0)
            hits.append(got)
            get_lost += m - got
            if m < n:
                put_codes.update(int(c) for c in put)
            # Untimed: every hit holds the bytes derived from its key.
            if not np.array_equal(out[:got], src[:got]):
                raise AssertionError(
                    f"mooncake {args.mode}: request {i}: a block read back differs from the one put"
                )
        elapsed = time.monotonic() - started
        end = master_metrics(metrics_url)
    capacity = end.get("master_total_capacity_bytes", float(segment))
    allocated = end.get("master_allocated_bytes", 0.0)
    return {
        "mode": args.mode,
        "requests": len(chains),
        "hits": hits,
        "latency_s": latency,
        "held_at_end": int(end.get("master_key_count", 0)),
        "segment_bytes": segment,
        "segment_raised": segment > args.capacity_bytes,
        "capacity_bytes": capacity,
        "allocated_bytes_at_end": allocated,
        "allocated_over_capacity": allocated / capacity if capacity else None,
        "puts": sum(put_codes.values()),
        "puts_refused_no_space": put_codes.get(-200, 0),
        "puts_already_stored": put_codes.get(-705, 0),
        "put_codes": {str(k): v for k, v in sorted(put_codes.items())},
        "get_lost_after_exist": get_lost,
        "evicted_keys": int(end.get("master_evicted_key_count", 0)),
        "eviction_rounds": int(end.get("master_successful_evictions_total", 0)),
        "eviction_attempts": int(end.get("master_attempted_evictions_total", 0)),
        "put_start_alloc_failures": int(end.get("master_put_start_alloc_failures_total", 0)),
        "replay_wall_s": elapsed,
    }


def set_env(mode: str) -> None:
    if mode == "tcp":
        os.environ["MC_STORE_MEMCPY"] = "0"
    else:
        os.environ.pop("MC_STORE_MEMCPY", None)
    os.environ["MC_TCP_BIND_ADDRESS"] = HOST


def transfer(args: argparse.Namespace) -> int:
    """``--transfer``: rounds of batched puts and gets, one per line of stdin (see above)."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # Mooncake's own output must not mix with the replies
    set_env(args.mode)
    ws = args.working_set_bytes
    rounds = 0
    with (
        tempfile.TemporaryDirectory(prefix="kvbench-mooncake-") as workdir,
        mooncake(args.mode, max(args.capacity_bytes, MIN_SEGMENT), workdir, 2 * ws + (1 << 20)) as (
            store,
            _,
        ),
    ):
        src_flat, out_flat = (a.reshape(-1) for a in buffers(store, args.mode, 1, ws))
        src_flat[:] = np.random.default_rng(0).integers(0, 256, ws, dtype=np.uint8)
        replies.write(json.dumps({"ready": True}) + "\n")
        for line in sys.stdin:
            if not line.strip():
                break
            req = json.loads(line)
            bb, batch = int(req["block_bytes"]), int(req["batch"])
            n = ws // bb // batch * batch
            src, out = src_flat[: n * bb].reshape(n, bb), out_flat[: n * bb].reshape(n, bb)
            # Blocks distinct per round and index in their first 8 bytes.
            src[:, :8] = (
                (np.arange(n, dtype=np.int64) + (rounds << 32)).view(np.uint8).reshape(n, 8)
            )
            out[:] = 0
            keys = [f"t{bb}:{rounds}:{i}" for i in range(n)]
            src_ptrs = [int(src_flat.ctypes.data) + i * bb for i in range(n)]
            out_ptrs = [int(out_flat.ctypes.data) + i * bb for i in range(n)]
            sizes = [bb] * batch
            put_s, get_s = [], []
            for lo in range(0, n, batch):
                t0 = time.perf_counter()
                codes = store.batch_put_from(
                    keys[lo : lo + batch], src_ptrs[lo : lo + batch], sizes
                )
                put_s.append(time.perf_counter() - t0)
                if any(c != 0 for c in codes):
                    raise RuntimeError(f"batch_put_from of {bb}-byte blocks returned {codes}")
            for lo in range(0, n, batch):
                t0 = time.perf_counter()
                got = store.batch_get_into(keys[lo : lo + batch], out_ptrs[lo : lo + batch], sizes)
                get_s.append(time.perf_counter() - t0)
                if any(g != bb for g in got):
                    raise RuntimeError(f"batch_get_into of {bb}-byte blocks returned {got}")
            if not np.array_equal(out, src):
                raise AssertionError(f"mooncake {args.mode}: a block read back differs")
            rc = store.remove_all(True)
            if rc < 0:
                raise RuntimeError(f"remove_all returned {rc}")
            rounds += 1
            replies.write(json.dumps({"put_s": put_s, "get_s": get_s}) + "\n")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--capacity-bytes", type=int, required=True)
    p.add_argument("--transfer", action="store_true", help="block throughput (see above)")
    p.add_argument("--working-set-bytes", type=int, default=64 << 20)
    p.add_argument("--block-bytes", type=int, default=16 << 10)
    p.add_argument("--trace", default=None)
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if args.transfer:
        return transfer(args)
    if args.json_out is None:
        p.error("--json-out is required for a replay")
    result = replay(args)
    with open(args.json_out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
