"""The daemon as users meet it: a real `kvstore serve` process, real shared memory, real gRPC."""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch
from conftest import SMALL_LAYOUT, kv_channel, random_blocks, same_bytes, tokens, wait_healthy
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore import AsyncKVStoreClient, KVLayout, KVStoreClient
from kvstore.errors import (
    CapacityError,
    InvalidRequestError,
    KVStoreError,
    NamespaceMismatchError,
    UnknownNamespaceError,
)
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


def client(daemon, layout: KVLayout = SMALL_LAYOUT, **kw) -> KVStoreClient:
    kw.setdefault("model", "test-model")
    return KVStoreClient(daemon.address, layout=layout, **kw)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]
)
def test_round_trip_is_bit_exact_on_both_paths(daemon, dtype: torch.dtype) -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=16, dtype=dtype)
    blocks = random_blocks(layout, 6, seed=1)
    with client(daemon, layout) as kv, client(daemon, layout, transport="grpc") as kv_bytes:
        assert kv.uses_shared_memory and not kv_bytes.uses_shared_memory
        keys = kv.hash_tokens(tokens(6))
        assert kv.put(keys[:3], blocks[:3]) == 3
        assert kv_bytes.put(keys[3:], blocks[3:]) == 3  # the bytes path writes too
        for reader in (kv, kv_bytes):
            got = reader.get(keys)
            assert got.dtype == dtype and same_bytes(got, blocks)
        out = torch.empty((8, *layout.block_shape), dtype=dtype)
        view = kv.get(keys, out=out)
        assert view.data_ptr() == out.data_ptr() and same_bytes(view, blocks)
        out2 = torch.empty_like(out)
        assert same_bytes(kv_bytes.get(keys, out=out2), blocks)


def test_lookup_counts_the_leading_run_and_a_gap_stops_it(daemon) -> None:
    blocks = random_blocks(SMALL_LAYOUT, 5)
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(5))
        assert kv.lookup(keys) == 0
        kv.put([keys[0], keys[1], keys[3], keys[4]], blocks[[0, 1, 3, 4]])
        assert kv.lookup(keys) == 2
        assert kv.get(keys).shape[0] == 2  # get serves the same leading run
        assert kv.lookup(keys[3:]) == 2


def test_puts_are_deduplicated(daemon) -> None:
    blocks = random_blocks(SMALL_LAYOUT, 4)
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(4))
        assert kv.put(keys[:2], blocks[:2]) == 2
        assert kv.put(keys, blocks) == 2
        other = random_blocks(SMALL_LAYOUT, 4, seed=9)
        assert kv.put(keys, other) == 0  # committed blocks are immutable
        assert same_bytes(kv.get(keys), blocks)
        assert kv.stats().tiers[0].blocks == 4


def test_lru_eviction_under_pressure(daemon_factory) -> None:
    d = daemon_factory(cpu_capacity="256KiB", slab="64KiB")
    with client(d) as kv:
        capacity = kv.stats().tiers[0].capacity_bytes // SMALL_LAYOUT.block_bytes
        keys = kv.hash_tokens(tokens(capacity + 8))
        blocks = random_blocks(SMALL_LAYOUT, capacity + 8)
        for i in range(0, capacity + 8, 8):  # oldest first
            kv.put(keys[i : i + 8], blocks[i : i + 8])
            tier = kv.stats().tiers[0]
            assert tier.used_bytes <= tier.capacity_bytes
        assert kv.lookup(keys[:8]) == 0  # the oldest are gone...
        assert kv.get(keys[:1]).shape[0] == 0
        assert kv.lookup(keys[8:]) == capacity  # ...the newest all present
        assert same_bytes(kv.get(keys[-8:]), blocks[-8:])
        tier = kv.stats().tiers[0]
        assert tier.evictions == 8 and tier.blocks == capacity


def test_full_of_leased_blocks_is_resource_exhausted(daemon_factory) -> None:
    d = daemon_factory(cpu_capacity="64KiB", slab="64KiB")
    with client(d) as kv:
        n = kv.stats().tiers[0].capacity_bytes // SMALL_LAYOUT.block_bytes
        keys = kv.hash_tokens(tokens(n + 1))
        kv.put(keys[:n], random_blocks(SMALL_LAYOUT, n))
        with kv.acquire(keys[:n]) as lease:
            assert len(lease) == n
            with pytest.raises(CapacityError, match="leased"):
                kv.put(keys[n:], random_blocks(SMALL_LAYOUT, 1))
        assert kv.put(keys[n:], random_blocks(SMALL_LAYOUT, 1)) == 1  # room once released


def test_bad_arguments_raise_before_anything_is_sent(daemon) -> None:
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(2))
        good = random_blocks(SMALL_LAYOUT, 2)
        with pytest.raises(ValueError, match="dtype"):
            kv.put(keys, good.float())
        with pytest.raises(ValueError, match="shape"):
            kv.put(keys, good[:, :1])
        with pytest.raises(ValueError, match="2 keys but 1 blocks"):
            kv.put(keys, good[:1])
        with pytest.raises(ValueError, match="key 1 must be 32 bytes"):
            kv.lookup([keys[0], b"abc"])
        with pytest.raises(ValueError, match="sequence of 32-byte keys"):
            kv.lookup(keys[0])
        with pytest.raises(ValueError, match="out holds 1 blocks, 2 needed"):
            kv.get(keys, out=torch.empty((1, *SMALL_LAYOUT.block_shape), dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="priority"):
            kv.put(keys, good, priority=999)
        assert kv.stats().tiers[0].blocks == 0  # nothing was stored by any of them
        assert kv.put(keys, good) == 2


def open_raw(stub, layout, **fields):
    """OpenNamespace through a bare stub: (the open stream, its first reply)."""
    call = stub.OpenNamespace(pb.OpenNamespaceRequest(model="m", layout=layout, **fields))
    return call, next(call)


def test_invalid_requests_get_clear_statuses(daemon) -> None:
    with grpc.insecure_channel(daemon.address) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(pb.LookupRequest(handle=b"\x01" * 16, keys=b"k" * 32), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "unknown namespace handle" in err.value.details()
        layout = pb.Layout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype="int4")
        with pytest.raises(grpc.RpcError) as err:
            open_raw(stub, layout)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unsupported dtype 'int4'" in err.value.details()
        layout.dtype = "bfloat16"
        call, ns = open_raw(stub, layout)
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(pb.LookupRequest(handle=ns.handle, keys=b"k" * 33), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "multiple of 32" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Commit(pb.CommitRequest(reservation_id=12345, handle=ns.handle), timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as err:
            stub.PutBlocks(
                iter([pb.PutBlocksRequest(handle=ns.handle, key=b"k" * 32, data=b"x")]),
                timeout=5,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "bytes" in err.value.details()
        call.cancel()


def test_errors_come_back_as_typed_exceptions(daemon) -> None:
    with client(daemon) as kv:
        kv._handle = b"\x02" * 16  # as if the daemon had forgotten us: the client reopens, retries
        assert kv.lookup(kv.hash_tokens(tokens(1))) == 0
        assert kv._handle != b"\x02" * 16
        other = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32)
        with pytest.raises(NamespaceMismatchError, match="registered with layout"):
            client(daemon, other)  # refused while the namespace is in use
    # Unused and empty, the name is free again: nothing stored can be misread under it.
    client(daemon, other).close()
    with grpc.insecure_channel(daemon.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.KVStoreStub(ch).Lookup(pb.LookupRequest(handle=b"", keys=b""), timeout=5)
        from kvstore.client._common import translate_error

        assert isinstance(translate_error(err.value), UnknownNamespaceError)
    with client(daemon) as kv, kv_channel(kv) as ch:
        with pytest.raises(grpc.RpcError) as err:
            request = pb.LookupRequest(handle=kv._handle, keys=b"x")
            pb_grpc.KVStoreStub(ch).Lookup(request, timeout=5)
        assert isinstance(translate_error(err.value), InvalidRequestError)


RPCS = [
    "OpenNamespace",
    "Lookup",
    "Reserve",
    "Commit",
    "Abort",
    "Acquire",
    "Release",
    "Prefetch",
    "Delete",
    "Stats",
    "Bind",
]


def test_garbage_bytes_to_every_rpc_get_errors_and_the_daemon_keeps_serving(daemon) -> None:
    blocks = random_blocks(SMALL_LAYOUT, 3)
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(3))
        kv.put(keys, blocks)
    garbage = [b"\xff\xff\xff\xff\x0f", os.urandom(64), b"\x0a\xff\xff\xff\xff\xff\x01" + b"z" * 9]
    with grpc.insecure_channel(daemon.address) as ch:
        for name in RPCS:
            method = ch.unary_unary(
                f"/kvstore.v1.KVStore/{name}",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )
            for payload in garbage:
                try:
                    method(payload, timeout=5)
                except grpc.RpcError as err:
                    assert err.code() != grpc.StatusCode.UNAVAILABLE, (name, err)
        for name in ("PutBlocks",):
            stream = ch.stream_unary(
                f"/kvstore.v1.KVStore/{name}",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )
            with pytest.raises(grpc.RpcError):
                stream(iter(garbage), timeout=5)
        getter = ch.unary_stream(
            "/kvstore.v1.KVStore/GetBlocks",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        for payload in garbage:
            with pytest.raises(grpc.RpcError):
                list(getter(payload, timeout=5))
    assert daemon.alive()
    with client(daemon) as kv:  # still serving, nothing lost or altered
        assert same_bytes(kv.get(keys), blocks)


def _worker(address: str, worker: int, shared: list[int], results) -> None:
    try:
        with KVStoreClient(address, layout=SMALL_LAYOUT, model="test-model") as kv:
            shared_keys = kv.hash_tokens(shared)
            mine = kv.hash_tokens(tokens(4, offset=10_000 * (worker + 1)))
            shared_blocks = random_blocks(SMALL_LAYOUT, len(shared_keys), seed=42)
            own = random_blocks(SMALL_LAYOUT, 4, seed=worker)
            for _ in range(5):
                kv.put(shared_keys, shared_blocks)
                kv.put(mine, own)
                assert same_bytes(kv.get(shared_keys), shared_blocks)
                assert same_bytes(kv.get(mine), own)
        results.put((worker, "ok"))
    except BaseException as exc:  # report, never hang the parent
        results.put((worker, repr(exc)))


def test_many_concurrent_client_processes(daemon) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    shared = tokens(6, offset=555)
    procs = [
        ctx.Process(target=_worker, args=(daemon.address, w, shared, results)) for w in range(4)
    ]
    for p in procs:
        p.start()
    outcomes = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert outcomes == {w: "ok" for w in range(4)}
    with client(daemon) as kv:
        stats = kv.stats()
        assert stats.tiers[0].blocks == 6 + 4 * 4  # shared prefix stored once
        assert stats.active_leases == 0 and stats.active_reservations == 0


CRASHING_WRITER = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from conftest import SMALL_LAYOUT
from kvstore import KVStoreClient
kv = KVStoreClient({address!r}, layout=SMALL_LAYOUT, model="test-model")
keys = kv.hash_tokens(list(range(16 * 12)))
r = kv.reserve(keys)
for v in r.views[:6]:
    v.fill_(1.0)  # half-written, never committed
print("reserved", len(r.offsets_new), flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_client_killed_mid_put_is_reclaimed_at_once(daemon_factory) -> None:
    # TTLs far longer than the test: only the closed connection can explain the reclaim.
    d = daemon_factory(
        cpu_capacity="96KiB", slab="96KiB", reservation_ttl_s=600.0, lease_ttl_s=600.0
    )
    code = CRASHING_WRITER.format(tests=os.path.dirname(__file__), address=d.address)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -9 and "reserved 12" in proc.stdout
    with client(d) as kv:
        keys = kv.hash_tokens(list(range(16 * 12)))
        assert kv.lookup(keys) == 0  # half-written blocks were never visible
        deadline = time.monotonic() + 10
        while kv.stats().active_reservations and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = kv.stats()
        assert stats.active_reservations == 0 and stats.open_handles == 1
        assert stats.tiers[0].used_bytes == 0
        blocks = random_blocks(SMALL_LAYOUT, 12)
        assert kv.put(keys, blocks) == 12  # every slot came back to the pool, keys writable
        assert same_bytes(kv.get(keys), blocks)


def test_expired_read_lease_is_reclaimed(daemon_factory) -> None:
    d = daemon_factory(lease_ttl_s=0.5)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(2))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 2))
        kv.acquire(keys)  # never released, as by a crashed reader
        assert kv.stats().active_leases == 1
        time.sleep(1.5)
        assert kv.stats().active_leases == 0


def test_a_slot_reused_under_an_expired_lease_is_a_miss_not_wrong_data(daemon_factory) -> None:
    d = daemon_factory(cpu_capacity="16KiB", slab="16KiB", lease_ttl_s=0.3)
    with client(d) as kv:
        n = kv.stats().tiers[0].capacity_bytes // SMALL_LAYOUT.block_bytes
        keys = kv.hash_tokens(tokens(2 * n))
        kv.put(keys[:n], random_blocks(SMALL_LAYOUT, n, seed=1))
        lease = kv.acquire(keys[:n])
        time.sleep(1.0)  # the lease expires; the slots are evicted and rewritten
        kv.put(keys[n:], random_blocks(SMALL_LAYOUT, n, seed=2))
        rows = torch.empty((n, SMALL_LAYOUT.block_bytes), dtype=torch.uint8)
        assert lease.copy_into(rows) == 0  # checksum mismatch: a miss
        lease.release()


def test_tenants_are_isolated(daemon) -> None:
    blocks = random_blocks(SMALL_LAYOUT, 3)
    with client(daemon, tenant="acme") as a, client(daemon, tenant="globex") as b:
        same_tokens = tokens(3)
        a.put(a.hash_tokens(same_tokens), blocks)
        assert b.lookup(b.hash_tokens(same_tokens)) == 0
        assert b.lookup(a.hash_tokens(same_tokens)) == 0  # even a's own keys: not b's to read
        assert b.get(a.hash_tokens(same_tokens)).shape[0] == 0


def test_delete_removes_blocks(daemon) -> None:
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(3))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 3))
        assert kv.delete(keys[1:]) == 2
        assert kv.lookup(keys) == 1
        assert kv.delete(keys[1:]) == 0


async def test_async_client_round_trip(daemon) -> None:
    blocks = random_blocks(SMALL_LAYOUT, 4)
    async with AsyncKVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="test-model") as kv:
        keys = kv.hash_tokens(tokens(4))
        assert await kv.lookup(keys) == 0
        assert await kv.put(keys, blocks) == 4
        await kv.prefetch(keys)
        assert await kv.lookup(keys) == 4
        assert same_bytes(await kv.get(keys), blocks)
        out = torch.empty_like(blocks)
        assert same_bytes(await kv.get(keys, out=out), blocks)
        assert await kv.delete(keys[2:]) == 2
        assert (await kv.stats()).tiers[0].blocks == 2
    async with AsyncKVStoreClient(
        daemon.address, layout=SMALL_LAYOUT, model="test-model", transport="grpc"
    ) as kv:
        assert same_bytes(await kv.get(keys), blocks[:2])
        with pytest.raises(KVStoreError, match="shared-memory arena"):
            await kv.reserve(keys)


def test_health_and_reflection_are_on(daemon) -> None:
    with grpc.insecure_channel(daemon.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        reply = health.Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert "kvstore.v1.KVStore" in names


def test_socket_is_owner_only(daemon) -> None:
    assert os.stat(daemon.socket_path).st_mode & 0o777 == 0o600


def test_sigterm_stops_cleanly_and_unlinks_everything(daemon_factory) -> None:
    d = daemon_factory()
    assert d.proc is not None
    with client(d) as kv:
        assert (
            kv.uses_shared_memory
            and kv.put(kv.hash_tokens(tokens(1)), random_blocks(SMALL_LAYOUT, 1)) == 1
        )
        # The arena is unnamed slab files: nothing under /dev/shm another process could open.
        assert not glob.glob(f"/dev/shm/kvstore-{d.proc.pid}-*")
        assert os.path.exists(str(d.socket_path) + ".session")
    assert d.stop(signal.SIGTERM) == 0
    assert not d.socket_path.exists()
    assert not os.path.exists(str(d.socket_path) + ".session")


def test_sigint_exits_zero(daemon_factory) -> None:
    d = daemon_factory()
    assert d.stop(signal.SIGINT) == 0


def test_restarted_daemon_is_rejoined_transparently(daemon_factory) -> None:
    d = daemon_factory()
    kv = client(d)
    try:
        keys = kv.hash_tokens(tokens(2))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 2))
        d.stop()
        d.start()  # same socket, new arena, empty CPU tier
        # Another client opens the namespace first, so the daemon reuses the namespace id the
        # old client holds: only the epoch tells the old client its arena mapping is stale.
        with client(d) as other:
            blocks = random_blocks(SMALL_LAYOUT, 2, seed=11)
            assert other.put(keys, blocks) == 2
        assert kv.lookup(keys) == 2
        assert same_bytes(kv.get(keys), blocks)  # read from the new arena, not the stale one
        assert kv.put(kv.hash_tokens(tokens(3))[2:], random_blocks(SMALL_LAYOUT, 1)) == 1
    finally:
        kv.close()


def test_second_daemon_on_a_live_socket_refuses_to_start(daemon) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--address", daemon.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "already serving" in proc.stderr
    wait_healthy(daemon.address)


def test_stat_cli_table_and_json(daemon) -> None:
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(3))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 3))
        kv.lookup(keys)
    cli = [sys.executable, "-m", "kvstore", "stat", "--address", daemon.address]
    table = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
    assert "cpu" in table and "█" in table and "test-model/-" in table
    data = json.loads(subprocess.run([*cli, "--json"], capture_output=True, text=True).stdout)
    (cpu,) = data["tiers"]
    assert cpu["name"] == "cpu" and cpu["blocks"] == 3
    assert cpu["used_bytes"] == 3 * SMALL_LAYOUT.block_bytes
    assert cpu["capacity_bytes"] >= cpu["used_bytes"]
    assert data["namespaces"][0]["lookup_hits"] == 3


def test_stat_cli_reports_an_unreachable_daemon(tmp_path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "stat",
            "--address",
            f"unix:{tmp_path}/none.sock",
            "--timeout",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "unreachable" in proc.stderr


def test_hash_cli_prints_the_client_keys() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "hash",
            "--model",
            "meta-llama/Llama-3-8B",
            "--layers",
            "32",
            "--kv-heads",
            "8",
            "--head-dim",
            "128",
            *map(str, range(40)),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [ln.split("\t") for ln in proc.stdout.splitlines() if not ln.startswith("#")]
    from test_keys import KEYS_0_TO_39

    assert [h for _, h in lines] == KEYS_0_TO_39


def test_a_taken_address_fails_the_start_and_leaves_nothing_behind() -> None:
    import glob
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        serve = [sys.executable, "-m", "kvstore", "serve", "--address", f"127.0.0.1:{port}"]
        proc = subprocess.Popen(
            [*serve, "--cpu-capacity", "8MiB", "--gpu", "off"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1 and f"127.0.0.1:{port}" in stderr
    # Its arena (named after its pid) was unlinked; other processes' arenas are theirs.
    assert not glob.glob(f"/dev/shm/kvstore-{proc.pid}-*")
