"""The client's end of the daemon's session socket (``kvstore.daemon.session``).

A same-host client connects it first: the kernel tells the daemon who this process is, and the
daemon answers with a session token, which goes on every gRPC call as ``kvstore-session``
metadata. The CPU tier's memory comes over the same connection, one slab file descriptor at a
time, when a reply first names a slab; so do local calls (``kvstore.local_calls``), when the
daemon offers them: the control RPCs of a batch at a socket's round trip instead of gRPC's.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from functools import partial

from kvstore import local_calls
from kvstore.address import session_socket_path
from kvstore.errors import (
    CapacityError,
    KVStoreError,
    PermissionDeniedError,
    UnavailableError,
)

MAX_MESSAGE = 4096
_REPLY_BYTES = local_calls.REPLY.size
DEFAULT_SPIN_US = 300
"""How long a blocking local call waits awake for its reply by default: about what a batch's call
takes on this class of machine (``benchmarks/bench_client_ab.py``)."""
_unpack_reply = local_calls.REPLY.unpack_from


def _spin_s() -> float:
    text = os.environ.get("KVSTORE_CALL_SPIN_US", str(DEFAULT_SPIN_US))
    try:
        spin_us = float(text)
    except ValueError:
        spin_us = -1.0
    if not 0 <= spin_us <= 1e6:  # also NaN
        raise ValueError(f"KVSTORE_CALL_SPIN_US must be microseconds in [0, 1000000], got {text!r}")
    return spin_us * 1e-6


class SlabUnavailable(KVStoreError):
    """The daemon will not hand over this slab (retired since, or not this caller's)."""


class SessionBroken(UnavailableError):
    """The session connection failed during a local call (the daemon stopped or restarted)."""


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
        self.calls = bool(hello.get("calls")) and os.environ.get("KVSTORE_LOCAL_CALLS") != "0"
        """The daemon serves local calls on this connection (``KVSTORE_LOCAL_CALLS=0``: never
        use them)."""
        self.presence_tables = os.environ.get("KVSTORE_PRESENCE_TABLES") != "0"
        """Answer lookups from the namespace's presence table where it can
        (``KVSTORE_PRESENCE_TABLES=0``: always call)."""
        self.spin_s = _spin_s()
        """How long a blocking local call waits awake for its reply (``_await_reply``;
        ``KVSTORE_CALL_SPIN_US=0``: never)."""
        self._call_id = 0
        self._reply = bytearray(local_calls.MAX_REPLY_BYTES)
        # A call reply read by ``slab`` (another thread, or the loop while an asyncio call
        # waits): kept for the call waiting on it, which ``_wake`` wakes.
        self._kept: tuple[int, bytes] | None = None
        self._wake: Callable[[], object] | None = None
        self._acall_lock: asyncio.Lock | None = None
        # A call sent by ``post`` whose reply has not been read (at most one), and the replies
        # read for such calls (or the error reading one met) until ``settle`` takes them.
        self._posted: int | None = None
        self._settled: dict[int, tuple[int, bytes] | KVStoreError] = {}
        self._readable = select.poll()
        self._readable.register(self._sock, select.POLLIN)

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
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._sock, MAX_MESSAGE, 1)
            except OSError as exc:
                raise UnavailableError(f"the session with the daemon failed: {exc}") from None
            if not data:
                for fd in fds:
                    os.close(fd)
                raise UnavailableError("the daemon closed the session")
            if data[0] != local_calls.MAGIC:
                break
            for fd in fds:  # a call reply carries none
                os.close(fd)
            self._keep_reply(data)
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

    def _descriptor(self, request: dict[str, object], what: str) -> tuple[int, dict]:
        """Send ``request`` and receive (the descriptor its reply carries, the reply)."""
        with self._lock:
            self._read_posted()
            try:
                self._sock.send(json.dumps(request).encode())
            except OSError as exc:
                raise UnavailableError(f"the session with the daemon failed: {exc}") from None
            reply, fds = self._receive()
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise KVStoreError(f"the daemon sent {what} without its descriptor")
        return fds[0], reply

    def slab(self, uid: int) -> tuple[int, int, bool]:
        """(descriptor, size, writable) of slab file ``uid``; the caller owns the descriptor.
        SlabUnavailable if the daemon will not hand it over."""
        fd, reply = self._descriptor({"op": "map", "slab": uid}, "a slab")
        return fd, int(reply["size"]), bool(reply["writable"])

    def presence(self, handle: bytes) -> tuple[int, bool]:
        """(descriptor, ask_on_miss) of the presence table (``kvstore.presence``) of the
        namespace ``handle`` names; the caller owns the descriptor. ``SlabUnavailable`` if the
        daemon will not hand it over, ``KVStoreError`` if it keeps none."""
        request: dict[str, object] = {"op": "presence", "handle": handle.hex()}
        fd, reply = self._descriptor(request, "a presence table")
        return fd, bool(reply.get("ask_on_miss", True))

    def busy(self) -> bool:
        """An asyncio call of this session is in flight: a blocking request now (a table, a
        slab) would stall the event loop until the daemon answers that call first."""
        return self._acall_lock is not None and self._acall_lock.locked()

    def quiet(self) -> bool:
        """Nothing waits to be read on the connection: the daemon has not closed it (a
        daemon sends nothing unasked), and no late reply waits to be dropped. A poll, ~1 us.
        The reply to a posted call is expected: read and kept, then the poll is made again."""
        if not self._readable.poll(0):
            return True
        if self._posted is None:
            return False
        with self._lock:
            self._read_posted()
        return not self._readable.poll(0)

    def call(self, method: int, request: bytes, timeout_s: float) -> tuple[int, memoryview]:
        """One local call: (status, body) of its reply (``kvstore.local_calls``). The body is a
        view of this session's reply buffer, valid until the next call. SessionBroken when the
        connection fails; UnavailableError when no reply comes in time."""
        with self._lock:
            call_id = self._send_call(method, request, timeout_s)
            try:
                if self._kept is None:
                    # The usual case, read inline: the next datagram is this call's reply.
                    self._await_reply()
                    n = self._sock.recv_into(self._reply)
                    if n >= _REPLY_BYTES and self._reply[0] == local_calls.MAGIC:
                        _, status, got_id = _unpack_reply(self._reply)
                        if got_id == call_id:
                            return status, memoryview(self._reply)[_REPLY_BYTES:n]
                    if n == 0:
                        raise SessionBroken("the daemon closed the session")
                    # Not it (a late reply to a call that stopped waiting, a stray message):
                    # dropped, as ``_read_reply`` drops them.
                got = self._read_reply(call_id, wait=True)
                assert got is not None  # waiting: a reply, or an exception
                return got
            except TimeoutError:  # as a gRPC deadline: the call may have run; never retried
                raise UnavailableError(
                    f"kvstore daemon unreachable: no reply to a local call within {timeout_s}s"
                ) from None
            except OSError as exc:
                raise SessionBroken(f"the session with the daemon failed: {exc}") from None

    def post(self, method: int, request: bytes, timeout_s: float) -> int:
        """Send one local call and return at once, with its id for ``settle``: the caller goes
        on while the daemon works. The daemon serves a connection's calls in the order sent, so
        every later call sees what this one did. At most one posted call is unread: posting
        another, or any call or request, reads the earlier one's reply first (kept for
        ``settle``). SessionBroken when the send fails."""
        with self._lock:
            self._posted = call_id = self._send_call(method, request, timeout_s)
        return call_id

    def read_posted(self) -> None:
        """Wait for the reply to the posted call, if one is unread, and keep it for settle:
        before a call that may not go over this connection (gRPC), which the daemon would
        otherwise serve beside it rather than after it."""
        if self._posted is not None:
            with self._lock:
                self._read_posted()

    def _send_call(self, method: int, request: bytes, timeout_s: float) -> int:
        """Send a local call's frame (after reading the posted call's reply, if one is
        unread); its id. Called with the lock held. SessionBroken when the send fails."""
        self._read_posted()
        self._call_id = call_id = (self._call_id + 1) & 0xFFFFFFFF
        frame = local_calls.encode_request(method, call_id, timeout_s, request)
        try:
            wait = timeout_s + 1.0  # the daemon answers by timeout_s
            if self._sock.gettimeout() != wait:
                self._sock.settimeout(wait)
            self._sock.send(frame)
        except OSError as exc:
            raise SessionBroken(f"the session with the daemon failed: {exc}") from None
        return call_id

    def settle(self, call_id: int) -> tuple[int, bytes]:
        """(status, body) of the reply to the call ``post`` sent as ``call_id``, waiting for it
        if it has not come. Each is taken once. UnavailableError (SessionBroken when the
        connection failed) when no reply came, or it was taken already."""
        with self._lock:
            if self._posted == call_id:
                self._read_posted()
            got = self._settled.pop(call_id, None)
        if got is None:
            raise UnavailableError(f"no reply is kept for local call {call_id}")
        if isinstance(got, KVStoreError):
            raise got
        return got

    def _read_posted(self) -> None:
        """Read the reply to the posted call, if one is unread, and keep it (or the error met
        reading it) for ``settle``. Called with the lock held, before anything else is sent or
        read: the daemon answers in order, so that reply comes first."""
        call_id, self._posted = self._posted, None
        if call_id is None:
            return
        outcome: tuple[int, bytes] | KVStoreError
        try:
            self._await_reply()
            got = self._read_reply(call_id, wait=True)
            assert got is not None  # waiting: a reply, or an exception
            outcome = (got[0], bytes(got[1]))  # the buffer is the next call's
        except TimeoutError:
            outcome = UnavailableError(
                "kvstore daemon unreachable: no reply to a posted local call in time"
            )
        except OSError as exc:
            outcome = SessionBroken(f"the session with the daemon failed: {exc}")
        except KVStoreError as exc:
            outcome = exc
        self._settled[call_id] = outcome

    def _await_reply(self) -> None:
        """Wait awake, for up to ``self.spin_s``, for a call's reply to arrive, before a read
        that blocks: the daemon answers a local call in tens of microseconds, and waking a
        thread blocked in ``recv`` costs about as much again (more on a virtual machine).
        Each turn yields the CPU (``sched_yield``), so a daemon or client sharing the core
        still runs; past ``spin_s`` the read blocks as before."""
        spin_s = self.spin_s
        if spin_s <= 0:
            return
        poll, clock, yield_cpu = self._readable.poll, time.perf_counter, os.sched_yield
        end = clock() + spin_s
        while not poll(0) and clock() < end:
            yield_cpu()

    def _keep_reply(self, data: bytes) -> None:
        """A call reply that ``slab`` read: keep it for the call waiting on it (a late reply
        to a call that stopped waiting is dropped when the next call looks)."""
        try:
            _, call_id, _ = local_calls.decode_reply(memoryview(data))
        except ValueError:
            return
        self._kept = (call_id, data)
        wake = self._wake
        if wake is not None:
            wake()

    def _take_kept(self, call_id: int) -> memoryview | None:
        kept, self._kept = self._kept, None
        if kept is None or kept[0] != call_id:
            return None
        return memoryview(kept[1])

    def _read_reply(self, call_id: int, wait: bool = False) -> tuple[int, memoryview] | None:
        """The reply to ``call_id`` if it is here (kept, or queued on the socket); None when
        it has not come yet. ``wait``: read until it comes (the socket's timeout bounds each
        read). Called with the lock held, the socket readable or not."""
        while True:
            kept = self._take_kept(call_id)
            if kept is not None:
                status, _, body = local_calls.decode_reply(kept)
                return status, body
            # Not waiting: a zero-timeout poll first, since the socket has a timeout and a read
            # of an empty queue would wait for it (MSG_DONTWAIT does not stop Python's own wait).
            if not wait and not self._readable.poll(0):
                return None
            n = self._sock.recv_into(self._reply)
            if n == 0:
                raise SessionBroken("the daemon closed the session")
            reply = memoryview(self._reply)[:n]
            if reply[0] != local_calls.MAGIC:
                continue  # not a call reply (none is expected): skip it
            status, got_id, body = local_calls.decode_reply(reply)
            if got_id == call_id:
                return status, body

    async def acall(self, method: int, request: bytes, timeout_s: float) -> tuple[int, bytes]:
        """``call`` for an asyncio caller: the reply is awaited on the event loop (the socket's
        readiness, never a blocking read), so the loop runs on while the daemon works. Calls of
        one session take turns (one in flight per connection)."""
        if self._acall_lock is None:
            self._acall_lock = asyncio.Lock()
        async with self._acall_lock:
            loop = asyncio.get_running_loop()
            fd = self._sock.fileno()
            with self._lock:
                self._call_id = call_id = (self._call_id + 1) & 0xFFFFFFFF
                frame = local_calls.encode_request(method, call_id, timeout_s, request)
                try:
                    self._sock.send(frame)
                except OSError as exc:
                    raise SessionBroken(f"the session with the daemon failed: {exc}") from None
            deadline = loop.time() + timeout_s + 1.0  # the daemon answers by timeout_s
            try:
                while True:
                    with self._lock:
                        got = self._read_reply(call_id)
                    if got is not None:
                        status, body = got
                        return status, bytes(body)  # the buffer is the next call's
                    ready = loop.create_future()

                    def wake(ready: asyncio.Future[None] = ready) -> None:
                        if not ready.done():
                            ready.set_result(None)

                    self._wake = partial(loop.call_soon_threadsafe, wake)
                    loop.add_reader(fd, wake)
                    if self._kept is not None:  # kept before ``_wake`` was set: look again
                        wake()
                    try:
                        async with asyncio.timeout_at(deadline):
                            await ready
                    except TimeoutError:
                        raise UnavailableError(
                            "kvstore daemon unreachable: no reply to a local call within "
                            f"{timeout_s}s"
                        ) from None
                    finally:
                        loop.remove_reader(fd)
                        self._wake = None
            except OSError as exc:
                raise SessionBroken(f"the session with the daemon failed: {exc}") from None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("kvstore-session", self.token),)

    def close(self) -> None:
        self._sock.close()
