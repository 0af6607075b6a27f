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
def mooncake(mode: str, segment_bytes: int, workdir: str) -> Iterator[tuple[Any, str]]:
    """A fresh master (and for ``shm`` a real client) and a connected store client: yields
    (store, metrics URL)."""
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
            rc = store.setup_dummy(LOCAL_BUFFER, LOCAL_BUFFER, f"{HOST}:{port}")
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
    if args.mode == "tcp":
        os.environ["MC_STORE_MEMCPY"] = "0"
    else:
        os.environ.pop("MC_STORE_MEMCPY", None)
    os.environ["MC_TCP_BIND_ADDRESS"] = HOST
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--capacity-bytes", type=int, required=True)
    p.add_argument("--block-bytes", type=int, default=16 << 10)
    p.add_argument("--trace", default=None)
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--json-out", required=True)
    args = p.parse_args()
    result = replay(args)
    with open(args.json_out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
