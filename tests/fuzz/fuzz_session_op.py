"""Fuzz target: session-socket requests (``kvstore.daemon.session``): the pure decoder
``parse_session_op`` and the daemon's answer to a datagram (``SessionServer._answer``) over a
real ``SOCK_SEQPACKET`` socket pair, with a real store's shared-memory arena behind it.

Input: a mode byte, then the datagram. Mode bit 0 set: the datagram is replaced by a well-formed
request for something real (a live slab's uid, or the live handle's presence table), so the
descriptor-sending path runs too.

Contract of ``parse_session_op`` (``/tmp/kv-findings/session-entrypoints.md``): a
``SessionOp`` ("map" with an int slab in [0, 2**64), or "presence" with a handle of at most 64
bytes), or ``SessionOpError`` with a message, and nothing else; a map request of a slab uid
round-trips. Contract of the answer: every datagram gets exactly one JSON object reply, ``ok``
true (with a descriptor, for a slab or presence table this session may have) or false with a
``code`` and an ``error`` message; the session's store is left as it was."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import _harness
import atheris

with atheris.instrument_imports(include=["kvstore"]):
    from kvstore.config import AuthConfig
    from kvstore.daemon.auth import OWNER, Policy
    from kvstore.daemon.session import (
        MAX_MESSAGE,
        Session,
        SessionOp,
        SessionOpError,
        SessionServer,
        parse_session_op,
    )

from _daemon import Daemon

CODES = {"invalid", "unavailable", "permission", "exhausted"}
_daemon: Daemon | None = None
_server: SessionServer | None = None


def check_parse(data: bytes) -> None:
    try:
        op = parse_session_op(data)
    except SessionOpError as exc:
        assert str(exc), "a SessionOpError without a message"
        return
    assert isinstance(op, SessionOp)
    if op.kind == "map":
        assert type(op.slab) is int and 0 <= op.slab < 1 << 64, op
        again = parse_session_op(json.dumps({"op": "map", "slab": op.slab}).encode())
        assert again.slab == op.slab
    else:
        assert op.kind == "presence" and isinstance(op.handle, bytes) and len(op.handle) <= 64
        again = parse_session_op(json.dumps({"op": "presence", "handle": op.handle.hex()}).encode())
        assert again.handle == op.handle


def answer(data: bytes) -> None:
    global _daemon, _server
    if _daemon is None:
        _daemon = Daemon()
        _server = SessionServer(
            "/nonexistent", Policy.from_config(AuthConfig()), _daemon.store.arena,
            _daemon.store.names.tenant_of_domain, 64, 0o600,
        )  # fmt: skip
        _server.presence = _daemon.servicer.presence_of
    assert _server is not None
    store = _daemon.store
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    handle = store.open_namespace(_daemon.keeper.record.namespace)  # type: ignore[arg-type]
    session = Session("fuzz", OWNER, 0, 0)
    try:
        ours.setblocking(False)
        before = _daemon.snapshot()
        _daemon.loop.run_until_complete(
            _on_loop(_server._answer, ours, session, data[:MAX_MESSAGE])
        )
        message, fds, _, _ = socket.recv_fds(theirs, 65536, 4, socket.MSG_DONTWAIT)
        for fd in fds:
            os.close(fd)
        reply = json.loads(message)
        assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), reply
        if reply["ok"]:
            assert len(fds) == 1, reply
        else:
            assert not fds and reply.get("code") in CODES and reply.get("error"), reply
        assert _daemon.snapshot() == before
    finally:
        if session.watch is not None:
            session.watch.cancel()
        store.close_handle(handle)
        ours.close()
        theirs.close()


async def _on_loop(fn: Any, *args: Any) -> None:
    """The daemon answers on its event loop (it schedules a look at the peer from there)."""
    fn(*args)


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    mode, body = data[0], data[1:]
    check_parse(body)
    if mode & 1 and _daemon is not None:
        arena = _daemon.store.arena
        uids = sorted(arena._by_uid)  # the live slab files
        if mode & 2 or not uids:
            handle = _daemon.keeper.token
            body = json.dumps({"op": "presence", "handle": handle.hex()}).encode()
        else:
            body = json.dumps({"op": "map", "slab": uids[mode >> 2 and (mode >> 2) % len(uids)]})
            body = body.encode()
    answer(body)


if __name__ == "__main__":
    _harness.main(TestOneInput)
