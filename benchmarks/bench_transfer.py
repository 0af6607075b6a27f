"""Block transfer throughput of the sidecar, against this machine's memcpy and a real Redis.

For blocks of 64 KiB, 512 KiB and 2 MiB (bf16 layouts: 16 tokens x 8 KV heads x 128 dims per
layer, with 1, 8 and 32 layers), moved in batches of 32 blocks, one run measures:

1. the shared-memory path of ``KVStoreClient``: ``put`` of new blocks (reserve, copy into the
   arena, checksum, commit), ``get`` into a preallocated ``out`` tensor and ``get`` into a new
   tensor (acquire, copy out, verify checksums, release); ``put(..., wait=False)``, which
   returns once the blocks are copied and their commit is sent (the last batch's time includes
   the ``flush`` that waits for them all; every block is then read back and checked); and, as
   a diagnostic, put and get with torch limited to one thread;
2. the bytes path (``transport="grpc"``): the same put and get, bytes streamed over gRPC;
3. single-thread ``np.copyto`` of each block between preallocated buffers: the limit. Also a copy
   into a newly allocated buffer, the limit of any get that returns a new tensor;
4. a real ``redis-server`` on a unix socket driven by redis-py: one SET / GET per block (see
   ``redis_client`` for the settings, the fastest measured for large values);
5. Mooncake Store in its same-host mode (``shm``: a standalone ``mooncake_client`` holds the
   segment, this run's driver is a dummy client whose buffers are shared memory, so a batch is
   one RPC and a memcpy a block in the real client), run by ``_mooncake_peer.py --transfer`` in
   ``.venv-mooncake`` (``make mooncake-env`` builds it; without it the Mooncake rows are skipped
   and the run says so): ``batch_put_from`` and ``batch_get_into`` of the same batches from and
   into registered buffers, its zero-copy batch calls, every block checked untimed; each block
   size gets one untimed round first (the segment's first touch), as kvstore's warm-up pass;
6. an empty gRPC unary call (the health check) on the client's channel, for reference.

Every measurement rotates over a working set far larger than the 32 MiB L3 (512 MiB per block
size; 128 MiB with ``--quick``), so no block is cache-hot; phases are interleaved round by round
so that load from other processes hits all of them alike. Puts always store new keys (puts of
present keys are deduplicated and cost nothing): the keys of a round are deleted before the
next. A time is the median over every batch of every round; GB/s = 1e9 bytes per second.

The rounds measure the steady state. A client's first write into a slab it has not mapped yet
also maps the slab (``MappedArena``: page tables for the whole slab), a cost paid once per slab
per client, as a serving engine maps its arena once. So a warm-up put over the whole working set
runs first, untimed for the put rows, and is reported on its own: ``shm put, first write``
(GB/s of that pass) and the first-map cost, in ms per MiB of slab the pass mapped (its time
beyond the steady-state put's, divided by the slab bytes newly mapped) and against the same
run's memcpy of a MiB.

``--smoke``: one batch of 32 blocks per size, one round; every get checked, a fresh tensor's
too, and a missing ``redis-server`` is an error (the peer is part of what it checks).

Targets, batches of 32: shm put and get of 2 MiB blocks each >= 0.8x memcpy (and >= 5x
Redis), of 64 KiB blocks >= 0.5x memcpy; at every block size, put and get each at least as fast
as Mooncake's same-host mode (where it ran). A client's first write into a fresh tier (the
warm-up pass, median batch): >= 0.5x memcpy with 2 MiB blocks, >= 0.3x with 64 KiB blocks.
The first-write table also gives the whole pass (its bytes over its time), where every slab
mapped counts, not only those a median batch maps.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _harness import (
    KVStoreDaemon,
    RedisServer,
    Reporter,
    Timing,
    emit,
    fmt_size,
    gbps,
    median_time,
    parse_args,
    print_header,
    redis_server_path,
    run_main,
    summarize,
    verdict,
)

from kvstore import KVLayout, KVStoreClient

BATCH = 32
HEADS, HEAD_DIM, TOKENS = 8, 128, 16  # 64 KiB per layer in bf16
LAYERS = {64 << 10: 1, 512 << 10: 8, 2 << 20: 32}
TARGET_SIZE = 2 << 20
TARGET_OF_MEMCPY = 0.8
SMALL_SIZE = 64 << 10
SMALL_OF_MEMCPY = 0.5  # 64 KiB blocks: per-batch calls, not the copy, bound them
FIRST_WRITE_OF_MEMCPY = 0.5  # 2 MiB blocks into slabs this client has not mapped yet
FIRST_WRITE_SMALL_OF_MEMCPY = 0.3  # 64 KiB blocks into slabs not mapped yet
TARGET_OF_REDIS = 5.0
TARGET_OF_MOONCAKE = 1.0  # every block size, put and get
REPO = Path(__file__).resolve().parent.parent
MOONCAKE_VENV = ".venv-mooncake"  # make mooncake-env (scripts/mooncake_env.sh) builds it
MOONCAKE_DRIVER = Path(__file__).resolve().parent / "_mooncake_peer.py"
MOONCAKE_READY_S = 60.0

# Rows of the throughput table, in print order: (key, label).
PATHS = [
    ("memcpy", "memcpy np.copyto, 1 thread (limit)"),
    ("memcpy_new_np", "memcpy into new np.empty (THP)"),
    ("memcpy_new_torch", "memcpy into new torch.empty"),
    ("shm_put", "kvstore shm put"),
    ("shm_put_nowait", "kvstore shm put, not waiting (wait=False)"),
    ("shm_put_first", "kvstore shm put, first write (maps slabs)"),
    ("shm_get", "kvstore shm get -> out"),
    ("shm_get_new", "kvstore shm get -> new tensor"),
    ("shm1_put", "kvstore shm put, torch 1 thread"),
    ("shm1_get", "kvstore shm get -> out, torch 1 thread"),
    ("grpc_put", "kvstore bytes put (grpc)"),
    ("grpc_get", "kvstore bytes get -> out (grpc)"),
    ("redis_put", "redis SET"),
    ("redis_get", "redis GET (-> bytes)"),
    ("redis_get_out", "redis GET + copy -> out"),
    ("mc_put", "mooncake shm batch_put_from"),
    ("mc_get", "mooncake shm batch_get_into -> out"),
]


@dataclass
class Case:
    """One block size: its layout, working set (``src``) and preallocated destination."""

    block_bytes: int
    layout: KVLayout
    src: torch.Tensor
    out: torch.Tensor
    samples: dict[str, list[float]] = field(default_factory=dict)
    first_map_bytes: int | None = None  # slab bytes the warm-up pass mapped (None: unknown)

    @property
    def n_batches(self) -> int:
        return self.src.shape[0] // BATCH

    @property
    def batch_bytes(self) -> int:
        return BATCH * self.block_bytes

    def batch(self, t: torch.Tensor, b: int) -> torch.Tensor:
        return t[b * BATCH : (b + 1) * BATCH]

    def add(self, path: str, seconds: float) -> None:
        self.samples.setdefault(path, []).append(seconds)


def make_case(block_bytes: int, working_set_bytes: int) -> Case:
    layout = KVLayout(LAYERS[block_bytes], HEADS, HEAD_DIM, TOKENS, torch.bfloat16)
    assert layout.block_bytes == block_bytes
    n_blocks = max(working_set_bytes // block_bytes // BATCH, 1) * BATCH
    src = torch.empty((n_blocks, *layout.block_shape), dtype=layout.dtype)
    rows = src.view(torch.uint8).view(n_blocks, block_bytes)
    # Random bytes, made distinct per block by its index in the first 8 bytes.
    rows.copy_(torch.randint(0, 256, (block_bytes,), dtype=torch.uint8).expand_as(rows))
    rows[:, :8].copy_(torch.arange(n_blocks, dtype=torch.int64).view(torch.uint8).view(-1, 8))
    out = torch.zeros_like(src)  # touched now: a preallocated buffer is a faulted-in buffer
    return Case(block_bytes, layout, src, out)


def new_keys(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- phases
def run_memcpy(case: Case) -> None:
    src = case.src.view(torch.uint8).numpy().reshape(-1, case.block_bytes)
    dst = case.out.view(torch.uint8).numpy().reshape(-1, case.block_bytes)
    for b in range(case.n_batches):
        lo = b * BATCH

        def copy(lo: int = lo) -> None:
            for i in range(lo, lo + BATCH):
                np.copyto(dst[i], src[i])

        case.add("memcpy", timed(copy))
    # Copies into newly allocated memory pay first-touch page faults. numpy asks for
    # transparent huge pages (madvise) on large arrays; torch.empty does not.
    for b in range(case.n_batches):
        lo = b * BATCH

        def copy_new_np(lo: int = lo) -> None:
            fresh = np.empty((BATCH, case.block_bytes), dtype=np.uint8)
            for i in range(BATCH):
                np.copyto(fresh[i], src[lo + i])

        case.add("memcpy_new_np", timed(copy_new_np))
    for b in range(case.n_batches):
        lo = b * BATCH

        def copy_new_torch(lo: int = lo) -> None:
            fresh = torch.empty((BATCH, case.block_bytes), dtype=torch.uint8).numpy()
            for i in range(BATCH):
                np.copyto(fresh[i], src[lo + i])

        case.add("memcpy_new_torch", timed(copy_new_torch))


def run_kvstore(
    case: Case,
    kv: KVStoreClient,
    prefix: str,
    fresh_get: bool,
    check_fresh: bool = False,
    not_waiting: bool = False,
) -> None:
    """Put, get into ``out`` (checked), and with ``fresh_get`` get into new tensors (checked
    too with ``check_fresh``, untimed), then delete; with ``not_waiting``, then the puts
    again with ``wait=False`` (``put_not_waiting``)."""
    keys = new_keys(case.src.shape[0])
    batches = [keys[b * BATCH : (b + 1) * BATCH] for b in range(case.n_batches)]
    for b, kb in enumerate(batches):
        blocks = case.batch(case.src, b)
        t0 = time.perf_counter()
        stored = kv.put(kb, blocks)
        case.add(f"{prefix}_put", time.perf_counter() - t0)
        if stored != BATCH:
            raise RuntimeError(f"{prefix} put stored {stored} of {BATCH} new blocks")
    # Untimed set-up and checks run on one thread, in numpy: a torch op over the working set
    # runs on torch's OpenMP pool, whose workers then spin for ~10 ms on the other core, which
    # the first batches timed after it would pay (and memcpy, timed after none, does not).
    out_rows = case.out.view(torch.uint8).numpy()
    out_rows.fill(0)
    for b, kb in enumerate(batches):
        dest = case.batch(case.out, b)
        t0 = time.perf_counter()
        got = kv.get(kb, out=dest)
        case.add(f"{prefix}_get", time.perf_counter() - t0)
        if got.shape[0] != BATCH:
            raise RuntimeError(f"{prefix} get found {got.shape[0]} of {BATCH} blocks")
    # Untimed: every block came back intact.
    if not np.array_equal(out_rows, case.src.view(torch.uint8).numpy()):
        raise RuntimeError(f"{prefix} get returned other bytes than were put")
    if fresh_get:
        for kb in batches:
            t0 = time.perf_counter()
            got = kv.get(kb)
            case.add(f"{prefix}_get_new", time.perf_counter() - t0)
            if got.shape[0] != BATCH:
                raise RuntimeError(f"{prefix} get found {got.shape[0]} of {BATCH} blocks")
            if check_fresh:
                b = batches.index(kb)
                want = case.batch(case.src, b).view(torch.uint8).numpy()
                if not np.array_equal(got.view(torch.uint8).numpy(), want):
                    raise RuntimeError(f"{prefix} get into a new tensor returned other bytes")
            del got
    deleted = kv.delete(keys)
    if deleted != len(keys):
        raise RuntimeError(f"{prefix}: deleted {deleted} of {len(keys)} blocks")
    if not_waiting:
        put_not_waiting(case, kv, prefix)


def put_not_waiting(case: Case, kv: KVStoreClient, prefix: str) -> None:
    """The puts with ``wait=False`` (each returns once its blocks are copied and its commit
    sent; its reply is read at the next put): the last batch's time includes the ``flush``
    that waits for them all. Then, untimed, every block read back and checked; deleted."""
    keys = new_keys(case.src.shape[0])
    batches = [keys[b * BATCH : (b + 1) * BATCH] for b in range(case.n_batches)]
    stored = 0
    for b, kb in enumerate(batches):
        blocks = case.batch(case.src, b)
        t0 = time.perf_counter()
        kv.put(kb, blocks, wait=False)
        if b == len(batches) - 1:
            stored = kv.flush()
        case.add(f"{prefix}_put_nowait", time.perf_counter() - t0)
    if stored != len(keys):
        raise RuntimeError(f"{prefix} puts not waiting stored {stored} of {len(keys)} blocks")
    out_rows = case.out.view(torch.uint8).numpy()
    out_rows.fill(0)
    for b, kb in enumerate(batches):
        if kv.get(kb, out=case.batch(case.out, b)).shape[0] != BATCH:
            raise RuntimeError(f"{prefix} get after puts not waiting missed blocks")
    if not np.array_equal(out_rows, case.src.view(torch.uint8).numpy()):
        raise RuntimeError(f"{prefix} puts not waiting: other bytes were read back")
    if kv.delete(keys) != len(keys):
        raise RuntimeError(f"{prefix}: not every block put without waiting was deleted")


def mapped_bytes(kv: KVStoreClient) -> int | None:
    """Bytes of slab the client has mapped (None where the tree under test does not say)."""
    arena = getattr(kv, "_arena", None)
    slabs = getattr(arena, "_slabs", None)
    if slabs is None:
        return None
    return sum(int(getattr(s, "size", 0)) for s in slabs.values())


def first_write(case: Case, kv: KVStoreClient) -> None:
    """The warm-up: put the whole working set once (each batch timed as ``shm_put_first``),
    noting how many slab bytes the client mapped doing it; then delete it."""
    before = mapped_bytes(kv)
    keys = new_keys(case.src.shape[0])
    for b in range(case.n_batches):
        blocks = case.batch(case.src, b)
        t0 = time.perf_counter()
        stored = kv.put(keys[b * BATCH : (b + 1) * BATCH], blocks)
        case.add("shm_put_first", time.perf_counter() - t0)
        if stored != BATCH:
            raise RuntimeError(f"first-write put stored {stored} of {BATCH} new blocks")
    after = mapped_bytes(kv)
    if before is not None and after is not None:
        case.first_map_bytes = after - before
    if kv.delete(keys) != len(keys):
        raise RuntimeError("first-write pass: not every block was deleted")


def first_map_cost(case: Case) -> dict[str, float] | None:
    """What mapping a slab cost the warm-up pass: its time beyond ``n_batches`` steady-state
    puts, per MiB of slab it mapped, and that against the same run's memcpy of one MiB."""
    first, steady = case.samples.get("shm_put_first"), case.samples.get("shm_put")
    if not first or not steady or not case.first_map_bytes:
        return None
    extra_s = sum(first) - len(first) * statistics.median(steady)
    mib = case.first_map_bytes / (1 << 20)
    memcpy_ms_per_mib = (
        statistics.median(case.samples["memcpy"]) * 1e3 / (case.batch_bytes / (1 << 20))
    )
    ms_per_mib = extra_s * 1e3 / mib
    pass_gbps = len(first) * case.batch_bytes / sum(first) / 1e9
    memcpy_gbps = case.batch_bytes / statistics.median(case.samples["memcpy"]) / 1e9
    return {
        "mapped_mib": mib,
        "extra_ms": extra_s * 1e3,
        "ms_per_mib": ms_per_mib,
        "memcpy_ms_per_mib": memcpy_ms_per_mib,
        "of_memcpy": ms_per_mib / memcpy_ms_per_mib,
        "pass_gbps": pass_gbps,
        "pass_of_memcpy": pass_gbps / memcpy_gbps,
    }


def run_kvstore_one_thread(case: Case, kv: KVStoreClient) -> None:
    """The shm path again with torch limited to one thread in this process. The client copies
    with ``Tensor.copy_``, which splits large copies over torch's intra-op threads; when
    another process holds a CPU, the split copy waits for it. A diagnostic, not a target."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_kvstore(case, kv, "shm1", fresh_get=False)
    finally:
        torch.set_num_threads(threads)


def redis_client(socket_path: str) -> Any:
    """redis-py set up for large values (each choice measured faster on this machine):

    * RESP2 with redis-py's pure-Python parser, and its Python command packer: with hiredis
      installed redis-py would pack with ``hiredis.pack_command``, which copies every value;
      the Python packer sends a large ``memoryview`` value as is.
    * ``socket_read_size`` 1 MiB instead of 32 KiB: GET of 2 MiB ran 1.3-2x faster.
    * one SET / GET per block, no pipeline, no MSET/MGET: MGET of 32 x 2 MiB ran ~4x slower
      than 32 GETs (pipelining large GETs was slower with every client tried); MSET was no
      faster than 32 SETs.
    * values go out as ``memoryview``s of the source tensor (no client-side copy); GET returns
      ``bytes`` that are not copied further (torch.frombuffer can wrap them): kvstore's get, in
      contrast, ends with the data in the caller's tensor.
    """
    import redis
    from redis._parsers import _RESP2Parser
    from redis._parsers.encoders import Encoder
    from redis.connection import PythonRespSerializer

    encoder = Encoder("utf-8", "strict", False)
    pool = redis.ConnectionPool(
        connection_class=redis.UnixDomainSocketConnection,
        path=socket_path,
        protocol=2,
        parser_class=_RESP2Parser,
        socket_read_size=1 << 20,
        command_packer=PythonRespSerializer(6000, encoder.encode),
    )
    return redis.Redis(connection_pool=pool)


def run_redis(case: Case, r: Any, round_no: int) -> None:
    src = case.src.view(torch.uint8).numpy().reshape(-1, case.block_bytes)
    keys = [f"bench:{case.block_bytes}:{round_no}:{i}".encode() for i in range(src.shape[0])]
    for b in range(case.n_batches):
        lo = b * BATCH
        t0 = time.perf_counter()
        for i in range(lo, lo + BATCH):
            r.set(keys[i], memoryview(src[i]))
        case.add("redis_put", time.perf_counter() - t0)
    last = None
    for b in range(case.n_batches):
        lo = b * BATCH
        t0 = time.perf_counter()
        for i in range(lo, lo + BATCH):
            last = r.get(keys[i])
        case.add("redis_get", time.perf_counter() - t0)
    if last is None or last != src[-1].tobytes():
        raise RuntimeError("redis GET returned other bytes than were SET")
    # The same GETs ending where kvstore's get ends: in the caller's tensor.
    dst = case.out.view(torch.uint8).numpy().reshape(-1, case.block_bytes)
    for b in range(case.n_batches):
        lo = b * BATCH
        t0 = time.perf_counter()
        for i in range(lo, lo + BATCH):
            dst[i] = np.frombuffer(r.get(keys[i]), dtype=np.uint8)
        case.add("redis_get_out", time.perf_counter() - t0)
    if not np.array_equal(dst, src):
        raise RuntimeError("redis GETs into the tensor returned other bytes than were SET")
    r.flushall()


def mooncake_missing() -> str | None:
    """Why Mooncake cannot run here (None: it can)."""
    py = REPO / MOONCAKE_VENV / "bin" / "python"
    if not py.exists():
        return f"{MOONCAKE_VENV} is not built here (make mooncake-env builds it)"
    if not (py.parent / "mooncake_master").exists():
        return f"{MOONCAKE_VENV} has no mooncake_master (rerun make mooncake-env)"
    return None


class MooncakePeer:
    """``_mooncake_peer.py --transfer`` in ``.venv-mooncake``: one Mooncake Store (master,
    same-host real client, segment) for the whole run; ``round`` runs one pass of batched puts
    and gets there, so its rounds interleave with the others."""

    def __init__(self, working_set_bytes: int) -> None:
        self.working_set_bytes = working_set_bytes
        # Room for the working set under Mooncake's 90% eviction watermark.
        segment = working_set_bytes * 5 // 4 + (16 << 20)
        self._tmp = tempfile.TemporaryDirectory(prefix="kvbench-transfer-mc-")
        self._log_path = os.path.join(self._tmp.name, "driver.log")
        self._log = open(self._log_path, "wb")  # noqa: SIM115 (closed in close())
        self._proc = subprocess.Popen(
            [
                str(REPO / MOONCAKE_VENV / "bin" / "python"),
                str(MOONCAKE_DRIVER),
                "--mode",
                "shm",
                "--transfer",
                "--capacity-bytes",
                str(segment),
                "--working-set-bytes",
                str(working_set_bytes),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        try:
            self._reply()
        except BaseException:
            self.close()
            raise

    def _reply(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait(timeout=MOONCAKE_READY_S)
            with open(self._log_path, errors="replace") as f:
                lines = [ln for ln in f.read().splitlines() if not ln.startswith(("I", "W"))]
            raise RuntimeError(
                f"the Mooncake driver exited {self._proc.returncode}:\n" + "\n".join(lines[-30:])
            )
        return dict(json.loads(line))

    def round(self, case: Case, timed_round: bool = True) -> None:
        n = case.src.shape[0]
        if n * case.block_bytes > self.working_set_bytes:
            raise ValueError("the Mooncake peer's buffers are smaller than this working set")
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"block_bytes": case.block_bytes, "batch": BATCH}) + "\n")
        self._proc.stdin.flush()
        reply = self._reply()
        if timed_round:
            for t in reply["put_s"]:
                case.add("mc_put", t)
            for t in reply["get_s"]:
                case.add("mc_get", t)

    def close(self) -> None:
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()  # end of input: the driver stops its store
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()
        self._tmp.cleanup()


def empty_call_timing(kv: KVStoreClient, k: int) -> Timing:
    """An empty unary RPC (gRPC health Check) on the client's own channel."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(kv._channel)
    request = health_pb2.HealthCheckRequest()
    return median_time(lambda: stub.Check(request, timeout=10), k, warmup=20)


# --------------------------------------------------------------------------- run
def measure_size(
    block_bytes: int,
    args: argparse.Namespace,
    redis: Any,
    rep: Reporter,
    mooncake: MooncakePeer | None = None,
) -> tuple[Case, Timing]:
    case = make_case(block_bytes, args.working_set_mib << 20)
    capacity = case.src.shape[0] * block_bytes + (128 << 20)
    rep.line(
        f"  {fmt_size(block_bytes)} blocks: {case.src.shape[0]} blocks "
        f"({fmt_size(case.src.shape[0] * block_bytes)}) in {case.n_batches} batches of "
        f"{BATCH}, {args.rounds} rounds, daemon arena {fmt_size(capacity)}"
    )
    model = f"bench-transfer-{block_bytes}"
    with (
        KVStoreDaemon(capacity) as daemon,
        KVStoreClient(daemon.address, layout=case.layout, model=model, transport="shm") as shm,
        KVStoreClient(daemon.address, layout=case.layout, model=model, transport="grpc") as kvg,
    ):
        empty = empty_call_timing(shm, 20 if args.smoke else 50 if args.quick else 300)
        first_write(case, shm)
        if mooncake is not None:
            mooncake.round(case, timed_round=False)  # its warm-up: the segment's first touch
        for rnd in range(args.rounds):
            run_memcpy(case)
            run_kvstore(case, shm, "shm", fresh_get=True, check_fresh=args.smoke, not_waiting=True)
            run_kvstore_one_thread(case, shm)
            run_kvstore(case, kvg, "grpc", fresh_get=False)
            if redis is not None:
                run_redis(case, redis, rnd)
            if mooncake is not None:
                mooncake.round(case)
    return case, empty


def summarize_case(case: Case) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for path, _ in PATHS:
        samples = case.samples.get(path)
        if not samples:
            continue
        t = summarize(samples)
        out[path] = {
            "gbps": gbps(case.batch_bytes, t.median_s),
            "median_batch_ms": t.median_s * 1e3,
            "p99_batch_ms": t.p99_s * 1e3,
            "batches": t.n,
        }
    return out


def ratio(res: dict[str, dict[str, float]], a: str, b: str) -> float | None:
    if a in res and b in res:
        return res[a]["gbps"] / res[b]["gbps"]
    return None


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--working-set-mib", type=int, default=None, help="per block size")
    p.add_argument("--rounds", type=int, default=None, help="passes over the working set")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis peer")
    p.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake peer")


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0], add_args)
    if args.working_set_mib is None:
        args.working_set_mib = 1 if args.smoke else 128 if args.quick else 512
    if args.rounds is None:
        args.rounds = 1 if args.smoke else 2 if args.quick else 3
    rep = Reporter(args.json)
    if not args.json:
        print_header("bench_transfer", args)

    use_redis = not args.no_redis and redis_server_path() is not None
    if args.smoke and not args.no_redis and not use_redis:
        raise RuntimeError("redis-server not found: --smoke runs the Redis peer (or --no-redis)")
    if not use_redis:
        rep.line(
            "  redis: skipped (" + ("--no-redis" if args.no_redis else "no redis-server") + ")"
        )
    mc_skipped = "--no-mooncake" if args.no_mooncake else mooncake_missing()
    if mc_skipped:
        rep.line(f"  Mooncake Store SKIPPED: {mc_skipped}")
    results: dict[int, dict[str, dict[str, float]]] = {}
    first_maps: dict[int, dict[str, float] | None] = {}
    empties: list[Timing] = []
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        r = None
        if use_redis:
            server = stack.enter_context(RedisServer())
            r = redis_client(server.socket_path)
            stack.callback(r.connection_pool.disconnect)
        mc = None
        if not mc_skipped:
            ws = max(
                max((args.working_set_mib << 20) // bb // BATCH, 1) * BATCH * bb for bb in LAYERS
            )
            mc = MooncakePeer(ws)
            stack.callback(mc.close)
            rep.line(f"  Mooncake Store: same-host mode (shm), buffers of {fmt_size(ws)}")
        for block_bytes in sorted(LAYERS):
            case, empty = measure_size(block_bytes, args, r, rep, mc)
            results[block_bytes] = summarize_case(case)
            first_maps[block_bytes] = first_map_cost(case)
            empties.append(empty)
            del case
    elapsed = time.monotonic() - started

    sizes = sorted(results)
    heads = ["GB/s (median batch of 32)"] + [fmt_size(s) for s in sizes]
    rows = [
        [label] + [results[s].get(path, {}).get("gbps") for s in sizes] for path, label in PATHS
    ]
    rep.table("Throughput", heads, rows)

    ratio_defs = [
        ("shm put / memcpy", "shm_put", "memcpy", TARGET_OF_MEMCPY),
        ("shm get / memcpy", "shm_get", "memcpy", TARGET_OF_MEMCPY),
        ("shm put, not waiting / memcpy", "shm_put_nowait", "memcpy", TARGET_OF_MEMCPY),
        ("shm put, first write / memcpy", "shm_put_first", "memcpy", FIRST_WRITE_OF_MEMCPY),
        ("shm put / redis SET", "shm_put", "redis_put", TARGET_OF_REDIS),
        ("shm get / redis GET", "shm_get", "redis_get", TARGET_OF_REDIS),
        ("shm get / redis GET + copy", "shm_get", "redis_get_out", None),
        ("shm put, torch 1 thread / memcpy", "shm1_put", "memcpy", None),
        ("shm get, torch 1 thread / memcpy", "shm1_get", "memcpy", None),
        ("shm get new / memcpy new torch", "shm_get_new", "memcpy_new_torch", None),
        ("bytes put / redis SET", "grpc_put", "redis_put", None),
        ("bytes get / redis GET", "grpc_get", "redis_get", None),
        ("shm put / mooncake shm put", "shm_put", "mc_put", None),
        ("shm put, not waiting / mooncake shm put", "shm_put_nowait", "mc_put", None),
        ("shm get / mooncake shm get", "shm_get", "mc_get", None),
        ("mooncake shm put / memcpy", "mc_put", "memcpy", None),
        ("mooncake shm get / memcpy", "mc_get", "memcpy", None),
    ]
    ratios: dict[str, dict[int, float | None]] = {}
    targets: list[dict[str, Any]] = []
    ratio_rows = []
    for label, a, b, target in ratio_defs:
        ratios[label] = {s: ratio(results[s], a, b) for s in sizes}
        row: list[Any] = [label] + [ratios[label][s] for s in sizes]
        got = ratios[label].get(TARGET_SIZE)
        if target is not None:
            status = verdict(got is not None and got >= target) if got is not None else "n/a"
            row += [f">= {target:g}", status]
            targets.append(
                {
                    "ratio": label,
                    "block_bytes": TARGET_SIZE,
                    "target": target,
                    "value": got,
                    "status": status,
                }
            )
        else:
            row += ["", ""]
        ratio_rows.append(row)
    small = [
        ("shm put / memcpy", SMALL_SIZE, SMALL_OF_MEMCPY),
        ("shm put, not waiting / memcpy", SMALL_SIZE, SMALL_OF_MEMCPY),
        ("shm get / memcpy", SMALL_SIZE, SMALL_OF_MEMCPY),
        ("shm put, first write / memcpy", SMALL_SIZE, FIRST_WRITE_SMALL_OF_MEMCPY),
    ]
    if not mc_skipped:
        small += [
            (label, s, TARGET_OF_MOONCAKE)
            for s in sizes
            for label in (
                "shm put / mooncake shm put",
                "shm put, not waiting / mooncake shm put",
                "shm get / mooncake shm get",
            )
        ]
    for label, size, target in small:
        got = ratios[label].get(size)
        status = verdict(got >= target) if got is not None else "n/a"
        targets.append(
            {
                "ratio": label,
                "block_bytes": size,
                "target": target,
                "value": got,
                "status": status,
            }
        )
    rep.table(
        "Ratios (x)", ["ratio"] + [fmt_size(s) for s in sizes] + ["target @2 MiB", ""], ratio_rows
    )

    lat_rows = []
    for s, e in zip(sizes, empties, strict=True):
        put_ms = results[s]["shm_put"]["median_batch_ms"]
        get_ms = results[s]["shm_get"]["median_batch_ms"]
        lat_rows.append(
            [
                fmt_size(s),
                e.median_s * 1e6,
                e.p99_s * 1e6,
                put_ms,
                get_ms,
                100 * 2 * e.median_s * 1e3 / put_ms,
            ]
        )
    rep.table(
        "Latency: empty gRPC unary call (health Check, same channel) vs a 32-block batch",
        [
            "daemon for",
            "empty p50 us",
            "empty p99 us",
            "shm put ms",
            "shm get ms",
            "2 RPCs % of put",
        ],
        lat_rows,
    )
    map_rows = []
    for s in sizes:
        fm = first_maps[s]
        if fm is None:
            map_rows.append([fmt_size(s), None, None, None, None, None, None])
        else:
            map_rows.append(
                [
                    fmt_size(s),
                    fm["mapped_mib"],
                    fm["ms_per_mib"],
                    fm["memcpy_ms_per_mib"],
                    fm["of_memcpy"],
                    fm["pass_gbps"],
                    fm["pass_of_memcpy"],
                ]
            )
    rep.table(
        "First write: a client mapping slabs (the warm-up pass beyond steady-state puts; whole)",
        [
            "blocks",
            "slab MiB mapped",
            "ms / MiB mapped",
            "memcpy ms / MiB",
            "x memcpy",
            "pass GB/s",
            "pass x memcpy",
        ],
        map_rows,
    )
    empty_all = statistics.median(e.median_s for e in empties)
    rep.table(
        "Targets",
        ["target", "blocks", "value", "needed", "status"],
        [
            [t["ratio"], fmt_size(t["block_bytes"]), t["value"], f">= {t['target']:g}", t["status"]]
            for t in targets
        ],
    )
    rep.line(f"elapsed {elapsed:.0f}s; load {', '.join(f'{x:.2f}' for x in os.getloadavg())}")

    emit(
        {
            "benchmark": "transfer",
            "batch_blocks": BATCH,
            "working_set_bytes_per_size": args.working_set_mib << 20,
            "rounds": args.rounds,
            "results": {str(s): results[s] for s in sizes},
            "ratios": {k: {str(s): v for s, v in d.items()} for k, d in ratios.items()},
            "targets": targets,
            "first_map": {str(s): first_maps[s] for s in sizes},
            "mooncake_skipped": mc_skipped,
            "empty_call_us": {
                "median": empty_all * 1e6,
                "per_daemon": {str(s): e.to_dict() for s, e in zip(sizes, empties, strict=True)},
            },
            "elapsed_s": elapsed,
        },
        args,
    )
    return 0


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    run_main(main)
