"""The client's end of the daemon's session socket (``kvstore.daemon.session``).

A same-host client connects it first: the kernel tells the daemon who this process is, and the
daemon answers with a session token, which goes on every gRPC call as ``kvstore-session``
metadata. The CPU tier's memory comes over the same connection, one slab file descriptor at a
time, when a reply first names a slab.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

from kvstore.address import session_socket_path
from kvstore.errors import (
    CapacityError,
    KVStoreError,
    PermissionDeniedError,
    UnavailableError,
)

MAX_MESSAGE = 4096


class SlabUnavailable(KVStoreError):
    """The daemon will not hand over this slab (retired since, or not this caller's)."""


class ClientSession:
    """One session with the daemon; ``close`` ends it (the daemon forgets the token)."""

    def __init__(self, grpc_socket_path: str, timeout_s: float) -> None:
        path = session_socket_path(grpc_socket_path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.settimeout(timeout_s)
        self._lock = threading.Lock()
        try:
            try:
                self._connect(path, timeout_s)
            except OSError as exc:
                raise UnavailableError(
                    f"kvstore daemon unreachable: no session socket at {path} ({exc})"
                ) from None
            hello = self._receive()[0]  # the daemon's answer: a session, or why not
        except BaseException:
            self._sock.close()
            raise
        self.token: str = hello["session"]
        self.principal: str = hello.get("principal", "")

    def _connect(self, path: str, timeout_s: float) -> None:
        """Connect, waiting (up to ``timeout_s``) for a daemon that is starting or restarting."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._sock.connect(path)
                return
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _receive(self) -> tuple[dict, list[int]]:
        try:
            data, fds, _, _ = socket.recv_fds(self._sock, MAX_MESSAGE, 1)
        except OSError as exc:
            raise UnavailableError(f"the session with the daemon failed: {exc}") from None
        if not data:
            for fd in fds:
                os.close(fd)
            raise UnavailableError("the daemon closed the session")
        reply = json.loads(data)
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            message = reply.get("error", "refused")
            code = reply.get("code")
            if code == "permission":
                raise PermissionDeniedError(message)
            if code == "exhausted":
                raise CapacityError(message)
            if code == "unavailable":
                raise SlabUnavailable(message)
            raise KVStoreError(message)
        return reply, fds

    def slab(self, uid: int) -> tuple[int, int, bool]:
        """(descriptor, size, writable) of slab file ``uid``; the caller owns the descriptor.
        SlabUnavailable if the daemon will not hand it over."""
        with self._lock:
            try:
                self._sock.send(json.dumps({"op": "map", "slab": uid}).encode())
            except OSError as exc:
                raise UnavailableError(f"the session with the daemon failed: {exc}") from None
            reply, fds = self._receive()
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise KVStoreError("the daemon sent a slab without its descriptor")
        return fds[0], int(reply["size"]), bool(reply["writable"])

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("kvstore-session", self.token),)

    def close(self) -> None:
        self._sock.close()
