"""Regression: a hostile session peer can deny no other tenant service.

A session message of deeply nested JSON (``b"[" * 3000``) raised RecursionError out of the
daemon's JSON parse; the session was dropped without a reply and forgotten at once, while the
slab descriptor it had been sent (unread) stayed in flight, charged to the daemon's user. One
uid repeating that (map its own slab, never read, send the nested JSON) held hundreds of
descriptors in flight past its half of ``connections.max_sessions``, up to the daemon's
descriptor limit: then every send of a descriptor failed, and the other tenant's new clients
could not map memory ("the daemon closed the session").

Now every message gets an answer whatever its bytes (``parse_session_op``,
``kvstore.daemon.local_calls.decode_call``), a session that ends for any reason stays counted
toward its caller's share while its peer has replies unread, a descriptor left unread for
``DRAIN_S`` ends the session, and the share is the tenant's (with a policy), not the uid's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DaemonProcess, config_toml, wait_healthy
from test_regress_session_fd_inflight import map_request, raw_session, receive, some_slab
from test_security import access, run_as, start_as

from kvstore import local_calls as wire
from kvstore.daemon.local_calls import DecodedCall, decode_call
from kvstore.daemon.session import SessionOp, SessionOpError, parse_session_op
from kvstore.v1 import kvstore_pb2 as pb

DAEMON_UID = 2011  # no capabilities: the kernel's limit on descriptors in flight binds it
TENANT_A_UID, TENANT_A_UID2, TENANT_B_UID = 2012, 2013, 2014
FD_LIMIT = 256  # the daemon's RLIMIT_NOFILE, soft and hard
MAX_SESSIONS = 64
FLOOD = 300  # connections tenant A tries: past the daemon's descriptor limit
NESTED = b"[" * 3000

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to run the daemon and clients under other uids",
)

POLICY = (
    access("tenant-a", TENANT_A_UID, "a")
    + access("tenant-a2", TENANT_A_UID2, "a")
    + access("tenant-b", TENANT_B_UID, "b")
    + access("test-runner", 0, "root", role="operator")
)


@pytest.fixture
def limited_policy_daemon() -> Iterator[DaemonProcess]:
    """A daemon under a tenant policy (tenants a and b), running as ``DAEMON_UID`` with
    ``ulimit -n 256`` and ``max_sessions = 64``."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the daemon under another uid")
    base = Path(tempfile.mkdtemp(prefix="kvhostile-", dir="/tmp"))
    base.chmod(0o711)
    extra = f"\n[connections]\nmax_connections = 32\nmax_sessions = {MAX_SESSIONS}\n\n" + POLICY
    d = DaemonProcess(base / "d", config_toml(cpu_capacity="32MiB", extra=extra))
    d.directory.mkdir()
    os.chown(d.directory, DAEMON_UID, DAEMON_UID)
    config = d.directory / "daemon.toml"
    config.write_text(d.config_text)
    config.chmod(0o644)
    d.log = open(d.directory / "daemon.log", "ab")  # noqa: SIM115
    d.proc = subprocess.Popen(
        ["bash", "-c",
         f"ulimit -n {FD_LIMIT}; exec setpriv --reuid={DAEMON_UID} --regid={DAEMON_UID} "
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


FLOODER = f"""
import socket, time
from kvstore.address import session_socket_path
kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="flood", tenant="a", timeout_s=10)
kv.put(kv.hash_tokens(list(range(32))), blocks(2, 1))
slab = next(iter(kv._arena._slabs))
path = session_socket_path(ADDRESS.removeprefix("unix:"))
held, refused = [], 0
for _ in range({FLOOD}):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(path)
    hello = json.loads(sock.recv(4096))
    if not hello["ok"]:
        refused += 1
        sock.close()
        continue
    sock.send(json.dumps({{"op": "map", "slab": slab}}).encode())  # its reply never read
    sock.send({NESTED!r})
    held.append(sock)
    time.sleep(0.001)
print(json.dumps({{"held": len(held), "refused": refused}}), flush=True)
sys.stdin.read()  # holds every connection (and what is unread on it) until told
"""

TENANT_B = """
kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="b-model", tenant="b", timeout_s=10)
keys = kv.hash_tokens(list(range(64)))
stored = blocks(4, 7)
put = kv.put(keys, stored)
got = kv.get(keys)
print(json.dumps({"put": put, "same": bool(torch.equal(got.view(torch.uint8),
                  stored.view(torch.uint8))), "shm": kv.uses_shared_memory}))
kv.close()
"""


@needs_root
def test_one_tenant_flooding_nested_json_leaves_the_other_tenant_served(
    limited_policy_daemon: DaemonProcess,
) -> None:
    """Tenant A's uid connects 300 times, asks for its own slab, never reads, then sends
    nested JSON, and keeps every connection open: it holds at most half the sessions (before
    the fix, all 300, each with a descriptor in flight, past the daemon's limit of 256), and
    tenant B's new client still connects, maps its memory, puts and gets its bytes exactly.
    A second uid of tenant A shares A's half: it gets no session of its own."""
    d = limited_policy_daemon
    flooder = start_as(TENANT_A_UID, d.address, FLOODER)
    try:
        b = run_as(TENANT_B_UID, d.address, TENANT_B)
        assert b == {"put": 4, "same": True, "shm": True}, b
        assert flooder.result["held"] <= MAX_SESSIONS // 2, flooder.result
        assert flooder.result["refused"] >= FLOOD - MAX_SESSIONS // 2, flooder.result
        second = run_as(
            TENANT_A_UID2,
            d.address,
            """
            print(json.dumps({"error": error(lambda: KVStoreClient(
                ADDRESS, layout=LAYOUT, model="a2", tenant="a", timeout_s=10))}))
            """,
        )
        assert second == {"error": "CapacityError"}, second
        assert d.alive()
    finally:
        flooder.finish()
    # Once A hangs up, its share is free again (a bounded wait: the daemon looks each second).
    again = run_as(
        TENANT_A_UID2,
        d.address,
        """
        import time
        deadline = time.monotonic() + 30
        while True:
            try:
                kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="a2", tenant="a", timeout_s=10)
                break
            except KVStoreError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        keys = kv.hash_tokens(list(range(16)))
        print(json.dumps({"put": kv.put(keys, blocks(1, 3))}))
        """,
    )
    assert again == {"put": 1}, again


def test_nested_json_gets_an_error_and_the_session_serves_on(daemon) -> None:
    """Nested JSON, bytes that are not UTF-8, a JSON array, an op of the wrong type: each gets
    a refusal that says why, on the same connection, which then maps a slab as usual (before
    the fix the nested JSON ended the session without a reply)."""
    slab = some_slab(daemon.address)
    sock, _token = raw_session(daemon.socket_path)
    try:
        for message, why in (
            (NESTED, "nested too deeply"),
            (b"\xff\xfe\xfd{", "not a JSON object"),
            (b"[1, 2]", "not a JSON object"),
            (json.dumps({"op": "map", "slab": "1e999"}).encode(), "'slab' must be"),
            (json.dumps({"op": "map", "slab": 10**30}).encode(), "'slab' must be"),
            (json.dumps({"op": "presence", "handle": "zz"}).encode(), "'handle' must be"),
            (json.dumps({"op": ["x"]}).encode(), "unknown op"),
        ):
            sock.send(message)
            reply, fds = receive(sock)
            assert reply is not None and not reply["ok"] and not fds, (message, reply)
            assert reply["code"] == "invalid" and why in reply["error"], (message, reply)
        sock.send(map_request(slab))
        reply, fds = receive(sock)
        assert reply is not None and reply["ok"] and len(fds) == 1, reply
    finally:
        sock.close()


def test_a_local_call_frame_of_garbage_gets_an_error_reply(daemon) -> None:
    """Frames that are not calls (too short, an unknown method, a NaN deadline) and a call
    whose message does not decode each get an error reply naming the problem, and the session
    serves the next call."""
    sock, _token = raw_session(daemon.socket_path)
    try:
        lookup = wire.METHOD_INDEX["Lookup"]
        for frame, status, why in (
            (b"\x00\x01", wire.STATUS_INVALID, "not a call frame"),
            (wire.encode_request(200, 5, 1.0, b""), wire.STATUS_INVALID, "unknown method"),
            (wire.encode_request(lookup, 6, float("nan"), b""), wire.STATUS_INVALID, "deadline"),
            (wire.encode_request(lookup, 7, 5.0, b"\xff" * 40), wire.STATUS_INVALID, "decode"),
        ):
            sock.send(frame)
            reply, fds = receive(sock)
            assert reply is not None and "call_reply" in reply and not fds, reply
            got_status, _call_id, body = wire.decode_reply(memoryview(reply["call_reply"]))
            assert got_status == status, (frame, got_status, bytes(body))
            assert why in wire.decode_error(body)[1], (frame, bytes(body))
        # And a well-formed call is served: a handle nobody opened is NOT_FOUND, not dropped.
        request = pb.LookupRequest(handle=b"\x00" * 16, keys=b"\x01" * 32).SerializeToString()
        sock.send(wire.encode_request(lookup, 8, 5.0, request))
        reply, _ = receive(sock)
        assert reply is not None and "call_reply" in reply
        got_status, call_id, _ = wire.decode_reply(memoryview(reply["call_reply"]))
        assert (got_status, call_id) == (5, 8)  # NOT_FOUND
    finally:
        sock.close()


def test_the_pure_decoders_raise_their_one_error_type() -> None:
    """The entry points fuzz targets drive: every input gives an answer or the one documented
    error, nothing else."""
    assert parse_session_op(b'{"op": "map", "slab": 3}') == SessionOp("map", slab=3)
    assert parse_session_op(b'{"op": "presence", "handle": "ab"}') == SessionOp(
        "presence", handle=b"\xab"
    )
    for data in (NESTED, b"{" * 4000, b"", b"\x80", b"1e99999", b'{"op": "map", "slab": true}',
                 b'{"op": "presence", "handle": "' + b"0" * 200 + b'"}', b"x" * 5000):  # fmt: skip
        with pytest.raises(SessionOpError):
            parse_session_op(data)
    call = decode_call(wire.encode_request(0, 9, 2.0, pb.LookupRequest().SerializeToString()))
    assert isinstance(call, DecodedCall) and (call.name, call.call_id) == ("Lookup", 9)
    for frame in (b"", b"\x01" * 20, wire.encode_request(0, 1, -1.0, b""),
                  wire.encode_request(0, 1, 1.0, b"\x0a\xff\xff\xff\xff\x0f")):  # fmt: skip
        with pytest.raises(wire.FrameError):
            decode_call(frame)
