"""Guards: local calls (``kvstore.local_calls``, stepped in the session socket's callback)
against a client that abuses them, through a real daemon. Deadlines at the edges of an f32 (a
nanosecond, 3.4e38, infinity) are answered and leave the session serving; a client that floods
calls without reading a reply costs the daemon one bounded send queue, then its session; a
session closed while its call waits ends that call (its cleanup runs) and the writer it waited
for commits as usual. In every case the daemon keeps serving everyone else."""

from __future__ import annotations

import json
import socket

import grpc
import torch
from conftest import SMALL_LAYOUT, random_blocks, same_bytes, tokens

from kvstore import KVStoreClient
from kvstore import local_calls as wire
from kvstore.address import session_socket_path
from kvstore.keys import pack_keys
from kvstore.v1 import kvstore_pb2 as pb

LOOKUP = wire.METHOD_INDEX["Lookup"]
ACQUIRE = wire.METHOD_INDEX["Acquire"]


def client(daemon) -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="abuse")


def raw_session(daemon) -> socket.socket:
    """A session connection of our own (this process's uid: the daemon's owner)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(30)
    sock.connect(session_socket_path(str(daemon.socket_path)))
    hello = json.loads(sock.recv(4096))
    assert hello["ok"] and hello["calls"], hello
    return sock


def status_name(status: int) -> str:
    return next(c.name for c in grpc.StatusCode if c.value[0] == status)


def test_deadlines_at_the_edges_of_an_f32_are_answered(daemon) -> None:
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(3))
        blocks = random_blocks(SMALL_LAYOUT, 3)
        assert kv.put(keys, blocks) == 3
        session = kv._session
        assert session is not None
        lookup = pb.LookupRequest(handle=kv._handle, keys=pack_keys(keys)).SerializeToString()
        acquire = pb.AcquireRequest(handle=kv._handle, keys=pack_keys(keys)).SerializeToString()
        for call_id, deadline in enumerate((1e-9, 3.4e38, float("inf")), start=1):
            for method, body in ((LOOKUP, lookup), (ACQUIRE, acquire)):
                with session._lock:
                    session._sock.send(wire.encode_request(method, call_id, deadline, body))
                    status, got_id, reply = wire.decode_reply(
                        memoryview(session._sock.recv(wire.MAX_REPLY_BYTES))
                    )
                assert got_id == call_id
                assert status_name(status) in ("OK", "DEADLINE_EXCEEDED"), bytes(reply)
                if method == ACQUIRE and status == 0:
                    lease = pb.AcquireResponse.FromString(reply).lease_id
                    assert lease
                    release = pb.ReleaseRequest(lease_id=lease, handle=kv._handle)
                    kv._rpc.Release(release, timeout=10)
        assert same_bytes(kv.get(keys), blocks)  # the session and the daemon serve on


def test_a_client_that_floods_calls_without_reading_loses_only_its_session(daemon) -> None:
    flooder = raw_session(daemon)
    flooder.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    flooder.setblocking(False)
    frame = wire.encode_request(
        LOOKUP, 1, 10.0, pb.LookupRequest(handle=b"x" * 16, keys=b"").SerializeToString()
    )
    sent, ended = 0, False
    for _ in range(200_000):  # far more replies than its socket can queue
        try:
            flooder.send(frame)
            sent += 1
        except BlockingIOError:
            # The daemon stopped reading us (its reply queue to us is full): wait for it.
            flooder.settimeout(30)
            try:
                flooder.send(frame)
                sent += 1
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                ended = True
                break
            flooder.setblocking(False)
        except (BrokenPipeError, ConnectionResetError):
            ended = True
            break
    assert ended, f"{sent} calls sent and never read, the session still open"
    flooder.close()
    with client(daemon) as kv:  # everyone else is served
        keys = kv.hash_tokens(tokens(2))
        blocks = random_blocks(SMALL_LAYOUT, 2, seed=1)
        assert kv.put(keys, blocks) == 2
        assert same_bytes(kv.get(keys), blocks)


def test_a_session_closed_during_a_waiting_call_ends_that_call_only(daemon) -> None:
    with client(daemon) as writer, client(daemon) as reader:
        keys = writer.hash_tokens(tokens(4))
        blocks = random_blocks(SMALL_LAYOUT, 4, seed=2)
        reservation = writer.reserve(keys)  # being written: the reader's acquire waits for it
        session = reader._session
        assert session is not None
        acquire = pb.AcquireRequest(handle=reader._handle, keys=pack_keys(keys))
        session._sock.send(wire.encode_request(ACQUIRE, 1, 60.0, acquire.SerializeToString()))
        session._sock.close()  # gone mid-call
        reservation.fill_from(blocks.view(torch.uint8).reshape(4, SMALL_LAYOUT.block_bytes))
        assert reservation.commit() == 4
        assert same_bytes(writer.get(keys), blocks)
    with client(daemon) as other:
        assert same_bytes(other.get(keys), blocks)
        assert other.delete(keys) == 4
        assert other.lookup(keys) == 0
