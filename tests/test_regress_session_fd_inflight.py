"""Regression: descriptors in flight on the session socket are bounded, whatever a client does.

A slab (or presence table) descriptor sent over the session socket and not yet received is "in
flight", and Linux charges it to the sender's user, the daemon's, up to the daemon's descriptor
limit; past it every descriptor the daemon sends fails (ETOOMANYREFS), for every client. A
client that pipelined map requests without reading, and kept each dropped connection open,
held ~280 in flight per connection, without bound over reconnects: nobody could map memory.

Now the daemon sends a descriptor only once the peer has received every earlier reply (at most
one in flight per connection), a request that comes before then waits for it (a client that
reads late is still answered; one that never does is refused after ``DRAIN_S`` and its session
ends), and an ended session whose peer has not read all its replies stays counted toward the
session caps until it has, or hangs up.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import (
    SMALL_LAYOUT,
    DaemonProcess,
    config_toml,
    random_blocks,
    same_bytes,
    tokens,
    wait_healthy,
)
from test_security import TEST_RUNNER

from kvstore import KVStoreClient
from kvstore import local_calls as wire
from kvstore.address import session_socket_path
from kvstore.client.session import ClientSession
from kvstore.daemon.session import DRAIN_S
from kvstore.errors import CapacityError
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

DAEMON_UID = 2010  # a uid with no capabilities: the kernel's limit on descriptors in flight holds
FLOODERS = 12  # before the fix, ~280 descriptors each: far past the daemon's limit (~1.1k)


def raw_session(socket_path: Path) -> tuple[socket.socket, str]:
    """A session connection of our own, its hello read: (socket, session token)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(30)
    sock.connect(session_socket_path(str(socket_path)))
    hello = json.loads(sock.recv(4096))
    assert hello["ok"], hello
    return sock, hello["session"]


def map_request(slab: int) -> bytes:
    return json.dumps({"op": "map", "slab": slab}).encode()


def flood(sock: socket.socket, request: bytes, most: int = 2000) -> int:
    """The hostile client: ``request`` again and again, never a read, until the daemon stops
    taking them (its socket stays full for half a second: it reads no more) or drops it; the
    socket is left open. The number sent."""
    sock.setblocking(False)
    sent = 0
    try:
        while sent < most:
            try:
                sock.send(request)
                sent += 1
            except BlockingIOError:
                if not select.select([], [sock], [], 0.5)[1]:
                    break
    except (BrokenPipeError, ConnectionResetError):
        pass
    sock.settimeout(30)
    return sent


def receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """The next message and its descriptors (closed here, counted); None at end-of-file."""
    data, fds, _, _ = socket.recv_fds(sock, 1 << 18, 4)
    for fd in fds:
        os.close(fd)
    if not data:
        return None, fds
    if data[0] == wire.MAGIC:
        return {"call_reply": data}, fds
    return json.loads(data), fds


def wait_until_refused(address: str, token: str, timeout_s: float) -> None:
    """Bounded wait until the daemon refuses ``token`` on gRPC: it ended that session."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        while True:
            try:
                stub.Stats(pb.StatsRequest(), metadata=(("kvstore-session", token),), timeout=10)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    return
                raise
            assert time.monotonic() < deadline, "the daemon never ended the session"
            time.sleep(0.1)


def some_slab(address: str, tenant: str = "") -> int:
    """The uid of a slab of the CPU tier (a put lands there; its client mapped it)."""
    with KVStoreClient(address, layout=SMALL_LAYOUT, model="m", tenant=tenant, timeout_s=10) as kv:
        assert kv.put(kv.hash_tokens(tokens(2)), random_blocks(SMALL_LAYOUT, 2)) == 2
        assert kv._arena is not None  # shared memory: the put mapped a slab
        return next(iter(kv._arena._slabs))


def put_and_get(address: str, model: str, seed: int, tenant: str = "") -> None:
    """A fresh, well-behaved client maps the memory of its put and gets the blocks back."""
    with KVStoreClient(
        address, layout=SMALL_LAYOUT, model=model, tenant=tenant, timeout_s=10
    ) as kv:
        keys = kv.hash_tokens(tokens(2, offset=seed * 7))
        blocks = random_blocks(SMALL_LAYOUT, 2, seed=seed)
        assert kv.put(keys, blocks) == 2
        assert kv.uses_shared_memory
        assert same_bytes(kv.get(keys), blocks)


@pytest.fixture
def nonroot_daemon() -> Iterator[DaemonProcess]:
    """A daemon running as uid ``DAEMON_UID`` under a descriptor limit of ~1.1k (its own raise
    to what ``connections`` needs), whose policy lets the test runner (uid 0) in."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the daemon under another uid")
    base = Path(tempfile.mkdtemp(prefix="kvfd-", dir="/tmp"))
    base.chmod(0o711)
    d = DaemonProcess(
        base / "d",
        config_toml(
            extra="\n[connections]\nmax_connections = 64\nmax_sessions = 64\n\n" + TEST_RUNNER
        ),
    )
    d.directory.mkdir()
    os.chown(d.directory, DAEMON_UID, DAEMON_UID)
    config = d.directory / "daemon.toml"
    config.write_text(d.config_text)
    config.chmod(0o644)
    d.log = open(d.directory / "daemon.log", "ab")  # noqa: SIM115
    d.proc = subprocess.Popen(
        ["bash", "-c",
         f"ulimit -Sn 1024; exec setpriv --reuid={DAEMON_UID} --regid={DAEMON_UID} "
         f"--clear-groups {sys.executable} -m kvstore serve --address {d.address} "
         f"--config {config}"],
        stdout=d.log, stderr=subprocess.STDOUT, cwd="/tmp",
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
             "HOME": "/tmp"},
    )  # fmt: skip
    try:
        wait_healthy(d.address, proc=d.proc)
        yield d
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_unread_descriptors_held_open_leave_everyone_able_to_map(nonroot_daemon) -> None:
    """Flooders that ask for a slab again and again, never read, and keep their connections
    open: a fresh client's put and get still map their memory (before the fix, past the
    daemon's descriptor limit, its slab request ended its session and the put failed)."""
    d = nonroot_daemon
    slab = some_slab(d.address, tenant="root")
    held = [raw_session(d.socket_path)[0] for _ in range(FLOODERS)]
    try:
        for sock in held:
            assert flood(sock, map_request(slab)) >= 1
        put_and_get(d.address, "fresh", seed=3, tenant="root")
        assert d.alive()
    finally:
        for sock in held:
            sock.close()
    put_and_get(d.address, "after", seed=4, tenant="root")


def test_a_flooding_session_is_refused_and_ended_while_others_are_served(daemon) -> None:
    """The flooder's connection gets one descriptor, nothing more while it does not read, then
    (after ``DRAIN_S``) a refusal that says why, and end-of-file; its token stops working. A
    well-behaved client on another session is served throughout."""
    slab = some_slab(daemon.address)
    flooder, token = raw_session(daemon.socket_path)
    try:
        assert flood(flooder, map_request(slab)) > 1
        put_and_get(daemon.address, "other", seed=5)  # served while the flooder waits
        wait_until_refused(daemon.address, token, DRAIN_S + 30)
        first, fds = receive(flooder)
        assert first is not None and first["ok"] and len(fds) == 1, first
        refusal, fds = receive(flooder)
        assert refusal is not None and not refusal["ok"] and not fds, refusal
        assert "unread" in refusal["error"] and "read each reply" in refusal["error"], refusal
        assert receive(flooder) == (None, [])  # end-of-file: one descriptor in all
        with pytest.raises(BrokenPipeError):
            flooder.send(map_request(slab))
        put_and_get(daemon.address, "other2", seed=6)
    finally:
        flooder.close()


def test_a_client_that_reads_late_is_answered_not_refused(daemon) -> None:
    """A map request sent while a local call's reply is still unread (an asyncio call in flight
    while another task maps a slab), and a second one pipelined behind it, are each answered
    as soon as the client has read what came before: no refusal, one descriptor at a time."""
    slab = some_slab(daemon.address)
    sock, _ = raw_session(daemon.socket_path)
    try:
        bad_call = wire.encode_request(250, 7, 10.0, b"")  # answered at once, with an error
        for message in (bad_call, map_request(slab), map_request(slab)):
            sock.send(message)
        call_reply, fds = receive(sock)
        assert call_reply is not None and "call_reply" in call_reply and not fds
        for _ in range(2):
            reply, fds = receive(sock)
            assert reply is not None and reply["ok"] and len(fds) == 1, reply
        # And the session serves on, a client's way: a request, its reply, the next.
        session = ClientSession(str(daemon.socket_path), 10.0)
        try:
            for _ in range(3):
                fd, size, _writable = session.slab(slab)
                os.close(fd)
                assert size > 0
        finally:
            session.close()
    finally:
        sock.close()


def test_an_ended_session_counts_toward_the_cap_until_its_peer_hangs_up(daemon_factory) -> None:
    """``max_sessions = 4``: a user holds at most 2. A session the daemon ended because its
    peer stopped reading still counts while the peer keeps its end open with replies unread
    (before the fix it was forgotten at once, its descriptors still in flight); once the peer
    closes, it stops counting."""
    d = daemon_factory(extra="\n[connections]\nmax_sessions = 4\n")
    slab = some_slab(d.address)
    stalled, token = raw_session(d.socket_path)
    others: list[ClientSession] = []
    try:
        assert flood(stalled, map_request(slab)) > 1
        wait_until_refused(d.address, token, DRAIN_S + 30)  # ended by the daemon
        others.append(ClientSession(str(d.socket_path), 10.0))  # its uid's second
        with pytest.raises(CapacityError, match="ended with replies their peer has not read"):
            ClientSession(str(d.socket_path), 10.0)
        stalled.close()  # the peer hangs up: its slot is freed (a bounded wait, no sleep)
        deadline = time.monotonic() + 20
        while True:
            try:
                others.append(ClientSession(str(d.socket_path), 10.0))
                break
            except CapacityError:
                assert time.monotonic() < deadline, "the closed session was never freed"
                time.sleep(0.05)
        fd, _size, _writable = others[-1].slab(slab)
        os.close(fd)
    finally:
        stalled.close()
        for session in others:
            session.close()
