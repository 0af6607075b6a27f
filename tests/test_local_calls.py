"""Local calls (``kvstore.local_calls``) and piggy-backed releases, against a real daemon.

A same-host client sends its control calls over the session socket: same messages, same
servicer, same authentication and handle checks as gRPC, and a bad frame is refused without
harm. A get's release rides on the client's next call instead of being a call of its own.
"""

from __future__ import annotations

import socket

import pytest
from conftest import SMALL_LAYOUT, random_blocks, same_bytes, tokens

from kvstore import KVStoreClient
from kvstore import local_calls as wire
from kvstore.client.local_stub import LocalStub
from kvstore.errors import UnknownNamespaceError
from kvstore.keys import pack_keys
from kvstore.v1 import kvstore_pb2 as pb

LOOKUP = wire.METHOD_INDEX["Lookup"]


@pytest.fixture(autouse=True)
def _lookups_are_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the calls: lookups are not answered from presence tables
    (``tests/test_presence.py``)."""
    monkeypatch.setenv("KVSTORE_PRESENCE_TABLES", "0")


def client(daemon, **kw) -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="local", **kw)


class _NoGrpc:
    """A stub whose every method fails: a client given it can only use local calls."""

    def __getattr__(self, name: str):
        def refuse(*args, **kwargs):
            raise AssertionError(f"{name} went over gRPC")

        return refuse


def status_name(status: int) -> str:
    import grpc

    return next(c.name for c in grpc.StatusCode if c.value[0] == status)


def test_control_calls_go_over_the_session_socket(daemon) -> None:
    with client(daemon) as kv, client(daemon) as other:
        assert kv._session is not None and kv._session.calls
        kv._rpc = LocalStub(_NoGrpc(), lambda: kv._session)  # gRPC would fail the test
        keys = kv.hash_tokens(tokens(6))
        blocks = random_blocks(SMALL_LAYOUT, 6)
        assert kv.put(keys, blocks) == 6
        assert kv.put(keys, blocks) == 0  # present keys are deduplicated
        assert kv.lookup(keys) == 6
        assert same_bytes(kv.get(keys), blocks)
        kv.prefetch(keys)
        assert same_bytes(other.get(keys), blocks)  # another client sees the same blocks
        assert kv.delete(keys[3:]) == 3
        assert kv.lookup(keys) == 3
        assert other.get(keys).shape[0] == 3  # deleted means gone


def test_a_client_without_local_calls_uses_grpc(daemon, monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_LOCAL_CALLS", "0")
    with client(daemon) as kv:
        assert kv._session is not None and not kv._session.calls
        keys = kv.hash_tokens(tokens(3))
        blocks = random_blocks(SMALL_LAYOUT, 3, seed=5)
        assert kv.put(keys, blocks) == 3
        assert same_bytes(kv.get(keys), blocks)


@pytest.mark.parametrize("spin_us", ["0", "1000"])
def test_calls_are_answered_whether_the_client_waits_awake_or_not(
    daemon, monkeypatch, spin_us: str
) -> None:
    monkeypatch.setenv("KVSTORE_CALL_SPIN_US", spin_us)
    with client(daemon) as kv:
        assert kv._session is not None and kv._session.spin_s == float(spin_us) * 1e-6
        keys = kv.hash_tokens(tokens(4))
        blocks = random_blocks(SMALL_LAYOUT, 4, seed=8)
        assert kv.put(keys, blocks) == 4
        assert same_bytes(kv.get(keys), blocks) and kv.delete(keys) == 4


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "2e6"])
def test_a_bad_spin_setting_is_refused_with_its_name(daemon, monkeypatch, value: str) -> None:
    monkeypatch.setenv("KVSTORE_CALL_SPIN_US", value)
    with pytest.raises(ValueError, match="KVSTORE_CALL_SPIN_US"):
        client(daemon).close()


def test_another_sessions_handle_is_refused_over_a_local_call(daemon) -> None:
    with client(daemon) as alice, client(daemon) as mallory:
        keys = alice.hash_tokens(tokens(2))
        alice.put(keys, random_blocks(SMALL_LAYOUT, 2))
        assert mallory._session is not None
        request = pb.LookupRequest(handle=alice._handle, keys=pack_keys(keys))
        status, body = mallory._session.call(LOOKUP, request.SerializeToString(), 10.0)
        name, message = wire.decode_error(body)
        assert status_name(status) == "NOT_FOUND" and name == UnknownNamespaceError.__name__
        assert "handle" in message
        assert alice.lookup(keys) == 2  # alice's namespace is untouched


def raw_call(kv: KVStoreClient, frame: bytes) -> tuple[int, int, bytes]:
    """Send one frame on ``kv``'s session socket; (status, call id, body) of the reply."""
    session = kv._session
    assert session is not None
    with session._lock:
        session._sock.send(frame)
        data = session._sock.recv(wire.MAX_REPLY_BYTES)
    status, call_id, body = wire.decode_reply(memoryview(data))
    return status, call_id, bytes(body)


def test_bad_local_frames_are_refused_and_the_daemon_keeps_serving(daemon) -> None:
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(2))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 2))
        # An unknown method, a deadline that is no deadline, a body that does not decode.
        for frame in (
            wire.REQUEST.pack(wire.MAGIC, 250, 7, 1.0),
            wire.REQUEST.pack(wire.MAGIC, LOOKUP, 7, float("nan")),
            wire.encode_request(LOOKUP, 8, 10.0, b"\xff\xff\xff\xff"),
        ):
            status, _, body = raw_call(kv, frame)
            assert status_name(status) == "INVALID_ARGUMENT", body
        # Keys that are not 32 bytes each: the servicer's own check.
        bad = pb.LookupRequest(handle=kv._handle, keys=b"x" * 33).SerializeToString()
        status, call_id, body = raw_call(kv, wire.encode_request(LOOKUP, 9, 10.0, bad))
        assert status_name(status) == "INVALID_ARGUMENT" and call_id == 9
        assert b"multiple of 32" in body
        # Larger than one local call may be: refused, not truncated and misread.
        huge = wire.encode_request(LOOKUP, 10, 10.0, b"\0" * wire.MAX_REQUEST_BYTES)
        kv._session._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        status, call_id, body = raw_call(kv, huge)
        assert status_name(status) == "RESOURCE_EXHAUSTED" and call_id == 10
        assert kv.lookup(keys) == 2  # the session and the daemon still serve


def test_a_large_request_goes_over_grpc(daemon) -> None:
    # 3000 keys do not fit one local call (64 KiB): the client sends that lookup over gRPC.
    with client(daemon) as kv:
        kv._rpc = LocalStub(_NoGrpc(), lambda: kv._session)
        keys = kv.hash_tokens(tokens(3000))
        with pytest.raises(AssertionError, match="Lookup went over gRPC"):
            kv.lookup(keys)
        assert kv.lookup(keys[:100]) == 0  # a small one stays local


def test_a_get_releases_its_lease_with_the_next_call(daemon) -> None:
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(4))
        blocks = random_blocks(SMALL_LAYOUT, 4, seed=3)
        kv.put(keys, blocks)
        assert kv.stats().active_leases == 0
        assert same_bytes(kv.get(keys), blocks)
        # The get sent no Release: its lease is held until the next call carries it.
        assert kv.stats().active_leases == 1  # Stats carries no releases
        assert kv.lookup(keys) == 4
        assert kv.stats().active_leases == 0
        # Every kind of call carries them: a second get releases the first one's lease.
        kv.get(keys)
        kv.get(keys)
        assert kv.stats().active_leases == 1
        kv.delete(keys[:1])
        assert kv.stats().active_leases == 0


def test_pending_releases_go_in_a_release_of_their_own_past_the_bound(daemon) -> None:
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(2))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 2))
        bound = kv._releases.MAX
        leases = [kv.acquire(keys) for _ in range(bound)]
        for lease in leases[:-1]:
            lease.release()
        assert kv.stats().active_leases == bound  # released by the client, held by the daemon
        leases[-1].release()  # the bound: sent now
        assert kv.stats().active_leases == 0


def test_unknown_or_expired_leases_in_a_request_are_ignored(daemon) -> None:
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(2))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 2))
        request = pb.LookupRequest(
            handle=kv._handle, keys=pack_keys(keys), release_leases=[12345, 1 << 60]
        )
        assert kv._rpc.Lookup(request, timeout=10.0).found == 2
        too_many = pb.ReleaseRequest(handle=kv._handle, release_leases=range(5000))
        status, _, body = raw_call(
            kv,
            wire.encode_request(
                wire.METHOD_INDEX["Release"], 3, 10.0, too_many.SerializeToString()
            ),
        )
        assert status_name(status) == "INVALID_ARGUMENT" and b"max_leases_per_handle" in body


def test_a_stopped_daemon_fails_fast_and_a_restarted_one_is_rejoined(daemon_factory) -> None:
    import time

    from kvstore.errors import UnavailableError

    d = daemon_factory()
    kv = client(d, timeout_s=120.0)
    try:
        keys = kv.hash_tokens(tokens(2))
        blocks = random_blocks(SMALL_LAYOUT, 2, seed=8)
        kv.put(keys, blocks)
        d.stop()
        start = time.monotonic()
        with pytest.raises(UnavailableError):
            kv.lookup(keys)  # the session broke: gRPC answers, at once, as it would have
        # Not the 120 s a wait for a daemon would take: the margin is wide enough that a
        # loaded machine cannot make a fast failure look slow.
        assert time.monotonic() - start < 60.0
        d.start()
        # gRPC may still be backing off from the failed connect (its own reconnect policy):
        # retry until it reconnects, as any caller of a restarted daemon does.
        deadline = time.monotonic() + 30.0
        while True:
            try:
                found = kv.lookup(keys)
                break
            except UnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert found == 0  # a new daemon: rejoined, its CPU tier empty
        assert kv._session is not None and kv._session.calls  # the new session's calls
        assert kv.put(keys, blocks) == 2 and same_bytes(kv.get(keys), blocks)
    finally:
        kv.close()


def test_a_local_call_that_waits_is_answered_and_the_session_serves_on(daemon) -> None:
    # Most local calls finish without waiting and are answered from the socket's callback; a
    # put that meets keys another client is writing waits (at most its deadline) and is
    # finished by a task. Its answer must come, and the connection must be read again after.
    with client(daemon) as writer, client(daemon, timeout_s=1.0) as kv:
        kv._rpc = LocalStub(_NoGrpc(), lambda: kv._session)
        keys = kv.hash_tokens(tokens(4))
        blocks = random_blocks(SMALL_LAYOUT, 4)
        reservation = writer.reserve(keys)  # being written, not committed
        count = kv.put(keys, blocks)  # waits for that writer until its deadline
        assert count == 0 and count.pending == 4
        for j, i in enumerate(reservation.indices):
            reservation.views[j].copy_(blocks[i])
        assert reservation.commit() == 4
        assert kv.lookup(keys) == 4  # the session is read again after the waiting call
        assert kv.put(keys, blocks) == 0
        assert same_bytes(kv.get(keys), blocks)


_LOOKUP_WITHOUT_REDIS = """
import asyncio, sys
from kvstore import KVLayout
from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig
from kvstore.daemon.store import BlockStore
from kvstore.keys import Namespace, block_hashes

async def main():
    cpu = CpuTierConfig(capacity_bytes=4 << 20, prefault=False)
    store = BlockStore(DaemonConfig(gpu=GpuTierConfig(enabled="off"), cpu=cpu))
    await store.start()
    try:
        ns = Namespace(model="m", layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=64))
        handle = store.open_namespace(ns)
        keys = block_hashes(ns.seed, list(range(64)), 16)
        assert await store.lookup(handle, keys) == 0
        print("redis" in sys.modules)
    finally:
        await store.stop()
        store.close()

asyncio.run(main())
"""


def test_a_lookup_that_misses_does_not_import_redis_without_a_redis_tier() -> None:
    # The first lookup with a miss imported redis-py in the middle of the call (0.3-0.8 s on a
    # busy machine) although the daemon has no Redis tier. A fresh interpreter: this one has
    # imported it already.
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _LOOKUP_WITHOUT_REDIS], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


async def test_an_async_call_whose_reply_a_slab_request_read_is_woken(daemon) -> None:
    # A slab request (another thread, or the loop) that reads a call's reply keeps it for that
    # call and wakes it. Here the reply is read that way just before the call starts waiting:
    # without the wake-up it would wait for its deadline, and fail.
    import time

    from kvstore import AsyncKVStoreClient
    from kvstore.client.session import SlabUnavailable

    async with AsyncKVStoreClient(
        daemon.address, layout=SMALL_LAYOUT, model="local", timeout_s=3.0
    ) as kv:
        keys = kv.hash_tokens(tokens(3))
        await kv.put(keys, random_blocks(SMALL_LAYOUT, 3))
        session = kv._session
        read = session._read_reply
        stolen = []

        def read_after_a_slab_request(call_id: int):
            if not stolen:
                time.sleep(0.2)  # the reply is queued by now
                session._lock.release()  # held by the call while it reads: let slab take it
                try:
                    with pytest.raises(SlabUnavailable):
                        session.slab(1 << 30)  # reads the call's reply first, keeps it
                finally:
                    session._lock.acquire()
                stolen.append(session._kept is not None)
                return None  # as if the reply had not come yet
            return read(call_id)

        session._read_reply = read_after_a_slab_request
        assert await kv.lookup(keys) == 3  # woken: at its deadline the call would raise
        assert stolen == [True]


def test_a_frame_sent_during_a_call_is_answered_after_it_in_order(daemon) -> None:
    # One call in flight per connection: a frame that comes while a call waits (a reserve that
    # meets keys another client is writing) is held, not run beside it, and answered after it.
    with client(daemon) as writer, client(daemon) as kv:
        keys = kv.hash_tokens(tokens(4))
        reservation = writer.reserve(keys)  # being written, not committed
        session = kv._session
        assert session is not None
        packed = pack_keys(keys)
        reserve = pb.ReserveRequest(handle=kv._handle, keys=packed).SerializeToString()
        lookup = pb.LookupRequest(handle=kv._handle, keys=packed).SerializeToString()
        with session._lock:
            session._sock.send(wire.encode_request(wire.METHOD_INDEX["Reserve"], 1, 1.0, reserve))
            session._sock.send(wire.encode_request(LOOKUP, 2, 10.0, lookup))
            replies = [
                wire.decode_reply(memoryview(session._sock.recv(wire.MAX_REPLY_BYTES)))
                for _ in range(2)
            ]
        assert [(status, call_id) for status, call_id, _ in replies] == [(0, 1), (0, 2)]
        assert pb.ReserveResponse.FromString(replies[0][2]).pending == 4  # it waited
        assert pb.LookupResponse.FromString(replies[1][2]).found == 0
        reservation.abort()
        assert kv.put(keys, random_blocks(SMALL_LAYOUT, 4)) == 4  # the session serves on
        assert kv.lookup(keys) == 4


async def test_an_error_that_escapes_the_servicer_answers_unknown_as_grpc_does() -> None:
    # The servicer turns its errors into statuses itself; one that escapes it (here a reply
    # that does not serialize) ended the session, and the client then sent the call again over
    # gRPC. grpc.aio answers UNKNOWN; so does a local call now, and the session serves on.
    from kvstore.daemon.local_calls import LocalCalls

    class Servicer:
        def __getattr__(self, name: str):
            async def method(request, context):
                return object()  # not a message

            return method

    calls = LocalCalls(Servicer())
    request = pb.LookupRequest(handle=b"h", keys=b"").SerializeToString()
    served = calls.serve("token", wire.encode_request(LOOKUP, 5, 10.0, request))
    assert not isinstance(served, bytes)
    status, call_id, body = wire.decode_reply(memoryview(await served))
    assert status_name(status) == "UNKNOWN" and call_id == 5
    assert "Unexpected" in wire.decode_error(body)[1]


class _InProcess:
    """A real ``BlockStore`` and ``KVStoreServicer`` in this process, served by ``LocalCalls``
    (``servicer``: the servicer class, a subclass to add a call that waits)."""

    def __init__(self, servicer=None) -> None:
        from kvstore import KVLayout
        from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig
        from kvstore.daemon.local_calls import LocalCalls
        from kvstore.daemon.service import KVStoreServicer
        from kvstore.daemon.store import BlockStore
        from kvstore.keys import Namespace

        cpu = CpuTierConfig(capacity_bytes=4 << 20, prefault=False)
        self.store = BlockStore(DaemonConfig(gpu=GpuTierConfig(enabled="off"), cpu=cpu))
        self.calls = LocalCalls((servicer or KVStoreServicer)(self.store))
        self.namespace = Namespace(
            model="m", layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=64)
        )

    async def __aenter__(self) -> _InProcess:
        await self.store.start()
        self.handle = self.store.open_namespace(self.namespace)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.store.stop()
        self.store.close()

    def keys(self, n: int, offset: int = 0) -> list[bytes]:
        from kvstore.keys import block_hashes

        return block_hashes(self.namespace.seed, list(range(offset, offset + 16 * n)), 16)

    def serve(self, method: str, request, timeout_s: float = 10.0):
        frame = wire.encode_request(
            wire.METHOD_INDEX[method], 7, timeout_s, request.SerializeToString()
        )
        return self.calls.serve("token", frame)


async def test_a_call_that_does_not_wait_is_answered_without_a_task() -> None:
    # A lookup (and every call that finds what it needs in memory) is run to its end in the
    # socket's callback: the reply frame comes back at once, no task, no timer, no loop pass.
    # The servicer is the same, so are its errors.
    async with _InProcess() as kv:
        keys = kv.keys(3)
        reserved = await kv.store.reserve(kv.handle, keys)
        kv.store.commit(kv.handle, reserved.reservation_id, [0, 0, 0])
        lookup = pb.LookupRequest(handle=kv.handle.token, keys=pack_keys(keys + kv.keys(1, 99)))
        served = kv.serve("Lookup", lookup)
        assert isinstance(served, bytes)
        status, call_id, body = wire.decode_reply(memoryview(served))
        assert (status, call_id) == (0, 7)
        assert pb.LookupResponse.FromString(body).found == 3
        # An unknown handle: the same status and error name as over gRPC, also at once.
        served = kv.serve("Lookup", pb.LookupRequest(handle=b"x" * 16, keys=pack_keys(keys)))
        assert isinstance(served, bytes)
        status, _, body = wire.decode_reply(memoryview(served))
        assert status_name(status) == "NOT_FOUND"
        assert wire.decode_error(body)[0] == "UnknownNamespaceError"


async def test_a_call_that_waits_is_handed_to_a_task_under_its_deadline() -> None:
    # A call stepped in the callback that then waits is finished by a task, from where it
    # stopped: a reserve that meets keys being written waits for them; a call that would wait
    # past its deadline is cancelled there (its cleanup runs) and answers DEADLINE_EXCEEDED.
    import asyncio

    from kvstore.daemon.service import KVStoreServicer

    cleaned = []

    class Waits(KVStoreServicer):
        async def Abort(self, request, context):
            try:
                await asyncio.Event().wait()
            finally:
                cleaned.append(True)

    async with _InProcess(Waits) as kv:
        keys = kv.keys(2)
        writing = await kv.store.reserve(kv.handle, keys)
        reserve = pb.ReserveRequest(handle=kv.handle.token, keys=pack_keys(keys))
        served = kv.serve("Reserve", reserve, timeout_s=0.5)
        assert not isinstance(served, bytes)
        status, call_id, body = wire.decode_reply(memoryview(await served))
        assert (status, call_id) == (0, 7)
        assert pb.ReserveResponse.FromString(body).pending == 2  # it waited for the writer
        kv.store.abort(kv.handle, writing.reservation_id)

        served = kv.serve("Abort", pb.AbortRequest(handle=kv.handle.token), timeout_s=0.2)
        assert not isinstance(served, bytes)
        status, _, _ = wire.decode_reply(memoryview(await asyncio.wait_for(served, 30)))
        assert status_name(status) == "DEADLINE_EXCEEDED" and cleaned == [True]


def test_a_late_reply_to_an_abandoned_call_is_dropped_and_the_next_call_gets_its_own(
    daemon,
) -> None:
    # A reply still queued from a call that stopped waiting (here: sent raw, never read) is
    # the first datagram the next call reads; it is dropped, and the call reads its own.
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(2))
        assert kv.put(keys, random_blocks(SMALL_LAYOUT, 2)) == 2
        session = kv._session
        assert session is not None
        stale = pb.LookupRequest(handle=kv._handle, keys=pack_keys(keys[:1])).SerializeToString()
        with session._lock:
            session._sock.send(wire.encode_request(LOOKUP, 0xFFFF_FFF0, 10.0, stale))
        assert kv.lookup(keys) == 2  # not the stale reply's 1
        assert kv.lookup(keys[:1]) == 1
