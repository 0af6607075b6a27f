"""The session socket: how a same-host client proves who it is and gets its memory.

gRPC does not tell a server which process is at the other end of a unix socket, so beside the
gRPC socket the daemon listens on a second one (``<socket>.session``, ``SOCK_SEQPACKET``). When
a client connects, the kernel tells the daemon its uid, gid and pid (``SO_PEERCRED``); the
tenant policy turns them into a principal (``kvstore.daemon.auth``), and the daemon answers
with a random session token that the client sends as ``kvstore-session`` metadata on its gRPC
calls. The session, and the token with it, lives exactly as long as that connection: a client
that exits or dies is forgotten when the kernel closes its socket.

Over the same connection the client asks for the CPU tier's memory, one slab file at a time,
when a reply first names a slab (``SharedMemoryArena.address``); each comes as a file
descriptor (``SCM_RIGHTS``), never a name: only slabs of the tenants the principal may use,
read-only where it may only read. Opening a client therefore maps nothing up front, whatever
the tier's size.

Messages are one JSON object each (a datagram of the seqpacket socket):
``{"op": "map", "slab": UID}`` -> ``{"ok": true, "size": N, "writable": B}`` plus the
descriptor, or ``{"ok": false, "error": "..."}``; ``{"op": "presence", "handle": HEX}`` ->
``{"ok": true, "ask_on_miss": B}`` plus a read-only descriptor of the presence table
(``kvstore.presence``) of the namespace that handle (the principal's own) names. The first
message from the daemon is ``{"ok": true, "session": TOKEN, "principal": NAME, "calls": B}``
or an error (then it closes). With ``calls`` true the connection also carries local calls
(``kvstore.local_calls``): binary frames, one call in flight at a time, run as the session's
principal.

Every message gets an answer, whatever its bytes: ``parse_session_op`` (pure, for fuzzing)
turns a datagram into a ``SessionOp`` or a ``SessionOpError`` naming the problem (too long, not
UTF-8 JSON, nested past the parser's depth, an unknown op, a field of the wrong type), which the
peer gets back as a refusal on a session that serves on; a local call frame that does not decode
gets an error reply (``kvstore.daemon.local_calls.decode_call``). A session ends only when its
peer hangs up, a send to it fails, it leaves a descriptor unread (below), or the daemon stops;
whatever ends it, what it held is accounted for the same way (``_linger``).

A descriptor sent and not yet received by the peer is *in flight*, and Linux charges it to the
sender's user, the daemon's, up to the daemon's descriptor limit (``RLIMIT_NOFILE``); past it,
every send of a descriptor fails (``ETOOMANYREFS``), for every client. So the daemon bounds them
by construction, and charges them to the caller whose peer holds them:

- it sends a descriptor only when the peer has received everything sent to it before
  (``_unread``): at most one is in flight per connection;
- a connection that still has something unread is never forgotten: when its session ends it
  stays counted toward ``connections.max_sessions`` and toward its caller's share, shut both
  ways, its token refused, until its peer has read all of it or hung up (``_linger``). What
  then sits in the peer's receive queue is the kernel's, not the daemon's to free; it is
  counted against that caller until the peer reads it or hangs up;
- a caller's share is half of ``max_sessions``: with a tenant policy per tenant (the first its
  rules name, so the several uids of one tenant share one half), without one per uid
  (``share_key``). One caller can therefore never take the sessions another needs;
- ``max_sessions`` fits under the descriptor limit: at start the soft limit is raised to the
  hard one, and a ``max_sessions`` that would not fit beside the descriptors the daemon holds is
  lowered, with a warning naming both numbers (``fit_sessions``; the start is refused when not
  even two fit). Sessions (open or lingering) hold at most ``max_sessions`` sockets and as many
  descriptors in flight, so they cannot exhaust either (other processes of the daemon's user
  sending descriptors count in the kernel's same total: run the daemon as a user of its own);
- a peer that does not read a descriptor within ``DRAIN_S`` of its sending is cut off: a
  refusal saying why, its session ended (``_watch``), whether or not it sends anything more.

A request that comes while an earlier reply is unread waits for the peer to read it: a client
that sends one request and reads its reply before the next (``kvstore.client.session``) is
answered at once; one that still holds a local call's reply unread (an asyncio call in flight
while another task maps a slab) is answered as soon as it reads it; one that leaves a reply
unread for ``DRAIN_S`` is refused with a message and its session ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import resource
import secrets
import socket
import struct
import termios
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvstore import local_calls
from kvstore.daemon.auth import SESSION_TOKEN_BYTES, Policy, Principal
from kvstore.errors import KVStoreError
from kvstore.presence import PresenceTable
from kvstore.tiers.cpu import SharedMemoryArena

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # pid, uid, gid
_INT = struct.Struct("i")
_SIOCOUTQ = termios.TIOCOUTQ  # the same request number for sockets (SIOCOUTQ)
MAX_MESSAGE = 4096
DRAIN_S = 5.0
"""How long a session request waits for the peer to receive the daemon's earlier replies
before the daemon refuses it and ends the session (a client reading its replies takes
microseconds)."""
SPARE_FDS = 64
"""Descriptors kept free beside the sessions and those the daemon held at start: slabs and
presence tables made later, a descriptor being exported, files opened for a moment."""
LINGER_POLL_S = 1.0
"""The longest pause between two looks at whether the peer of an ended session has received
everything sent to it (or hung up): that session stays counted until it has."""

PresenceOf = Callable[[Principal, bytes], "tuple[PresenceTable, bool]"]
"""(principal, handle token) -> (its namespace's presence table, ask the daemon on a miss);
``UnknownNamespaceError`` for a handle the principal did not open."""

Calls = Callable[[str, bytes, Callable[[bytes], None]], "bytes | Awaitable[bytes]"]
"""``LocalCalls.serve``: (session token, call frame, answer) -> the reply frame, or a task that
gives it to ``answer``."""


class SessionOpError(ValueError):
    """A session message that is not a request this socket serves; its text says why (it goes
    back to the peer as ``{"ok": false, "code": "invalid", "error": "bad request: ..."}``)."""


@dataclass(frozen=True)
class SessionOp:
    """A decoded session request: ``kind`` "map" names ``slab`` (a slab uid), "presence" names
    ``handle`` (a namespace handle's bytes)."""

    kind: str
    slab: int = -1
    handle: bytes = b""


_MAX_HANDLE_HEX = 2 * 64  # far more than a handle (16 bytes); keeps a forged one short


def parse_session_op(data: bytes) -> SessionOp:
    """The session request ``data`` (one datagram) asks for; ``SessionOpError`` naming the
    problem for anything else, whatever the bytes (too long, not UTF-8 JSON, nested past the
    parser's depth, not an object, an unknown op, a field of the wrong type or range). Pure: no
    socket, no state; nothing else escapes it."""
    if len(data) > MAX_MESSAGE:
        raise SessionOpError(f"a session message is at most {MAX_MESSAGE} bytes")
    try:
        request = json.loads(data)
    except RecursionError:
        raise SessionOpError("not a JSON object: nested too deeply") from None
    except Exception as exc:  # ValueError, UnicodeDecodeError, MemoryError: the peer's bytes
        raise SessionOpError(f"not a JSON object: {type(exc).__name__}: {exc}") from None
    if not isinstance(request, dict):
        raise SessionOpError(f"not a JSON object but a {type(request).__name__}")
    op = request.get("op")
    if op == "map":
        slab = request.get("slab")
        if type(slab) is not int or not 0 <= slab < 1 << 64:
            raise SessionOpError("map: 'slab' must be a slab uid (an integer in [0, 2**64))")
        return SessionOp("map", slab=slab)
    if op == "presence":
        text = request.get("handle")
        if not isinstance(text, str) or len(text) > _MAX_HANDLE_HEX:
            raise SessionOpError("presence: 'handle' must be a namespace handle in hex")
        try:
            handle = bytes.fromhex(text)
        except ValueError:
            raise SessionOpError("presence: 'handle' must be a namespace handle in hex") from None
        return SessionOp("presence", handle=handle)
    shown = repr(op) if isinstance(op, str | int | float | bool | None) else type(op).__name__
    raise SessionOpError(f"unknown op {shown[:64]} (the ops are 'map' and 'presence')")


@dataclass
class Session:
    token: str
    principal: Principal
    pid: int
    uid: int
    share: tuple[str, object] = ("", None)
    """Whose share of ``max_sessions`` it counts toward (``share_key``)."""
    open: bool = True
    """False once the session ended: its token is refused, and it is only still counted while
    its peer has not received everything sent to it (``SessionServer._linger``)."""
    end: Callable[[BaseException], None] | None = None
    """Ends the session from outside its reader (a descriptor left unread: ``_watch``)."""
    watch: asyncio.TimerHandle | None = None
    """Looks, ``DRAIN_S`` after a descriptor was sent, whether the peer has received it."""


def share_key(principal: Principal, uid: int) -> tuple[str, object]:
    """Whose share of the sessions a peer's session counts toward: with a tenant policy, the
    tenant the principal's rules name first by name (the one ``Quotas.payer`` charges by
    default), so the several uids of one tenant hold one share together, not one each; without
    a policy (or for a principal whose rules name no tenant), its uid."""
    own = principal.own
    if own:
        return ("tenant", min(own))
    return ("uid", uid)


class _PeerBehind(Exception):
    """The peer has not yet received everything sent to it: no descriptor may be sent now."""


class _Stalled(OSError):
    """The peer left a reply unread for ``DRAIN_S`` while a request of it waited."""


def _unread(conn: socket.socket) -> int:
    """What the daemon sent on ``conn`` that its peer has not received yet, in the kernel's
    accounting of the send buffer: zero exactly when nothing is in flight to the peer (for a
    unix socket, ``SIOCOUTQ`` counts the messages queued on the peer's end until it reads
    them, or closes its end: the kernel drops them then)."""
    return _INT.unpack(fcntl.ioctl(conn.fileno(), _SIOCOUTQ, bytes(_INT.size)))[0]


def fit_sessions(max_sessions: int, reserved_fds: int = 0) -> int:
    """How many sessions the daemon may count: ``max_sessions``, or fewer when that many would
    not fit under its descriptor limit beside what it holds already (the descriptors open now,
    ``reserved_fds`` more for its other connections, ``SPARE_FDS``), with a warning naming both
    numbers. The soft ``RLIMIT_NOFILE`` is raised to the hard one first. Each counted session
    holds one descriptor (its socket) and at most one more in flight, charged to the daemon's
    user against that same limit: so neither can reach it through sessions. RuntimeError when
    not even two sessions fit (one per caller of a pair)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and hard != resource.RLIM_INFINITY:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return max_sessions
    held = len(os.listdir("/proc/self/fd"))
    budget = soft - held - reserved_fds - SPARE_FDS
    if max_sessions <= budget:
        return max_sessions
    if budget < 2:
        raise RuntimeError(
            f"the descriptor limit ({soft}, RLIMIT_NOFILE) leaves no room for sessions: "
            f"{held} descriptors are open, {reserved_fds} kept for other connections and "
            f"{SPARE_FDS} spare; raise it (ulimit -n) or lower connections.max_connections"
        )
    log.warning(
        "connections.max_sessions is %d, but the descriptor limit %d (RLIMIT_NOFILE; %d open, "
        "%d kept for other connections, %d spare) fits %d sessions: at most %d are served",
        max_sessions,
        soft,
        held,
        reserved_fds,
        SPARE_FDS,
        budget,
        budget,
    )
    return budget


class SessionServer:
    """Accepts session connections on the daemon's event loop. ``tenant_of_domain`` names the
    tenant whose memory a slab's domain is (None: domain 0, every tenant's when there is no
    policy)."""

    def __init__(
        self,
        path: str,
        policy: Policy,
        arena: SharedMemoryArena,
        tenant_of_domain: Callable[[int], str | None],
        max_sessions: int,
        socket_mode: int,
        reserved_fds: int = 0,
    ) -> None:
        self.path = path
        self.policy = policy
        self.arena = arena
        self._tenant_of_domain = tenant_of_domain
        self.max_sessions = max_sessions
        """``connections.max_sessions``, fitted to the descriptor limit at ``start``."""
        self.socket_mode = socket_mode
        self.reserved_fds = reserved_fds
        """Descriptors the daemon keeps for its other connections (gRPC's), not sessions."""
        self._sessions: dict[str, Session] = {}
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self.calls: Calls | None = None
        """Serves a local call frame of a session (its token, the frame, where to send the
        reply): the reply frame at once, or a task that sends it."""
        self.presence: PresenceOf | None = None
        """The presence table of the namespace a handle of the session's principal names,
        and whether a key it lacks may still be found by a lookup (the Redis tier)."""

    def principal(self, token: str) -> Principal | None:
        """The principal of the live session ``token`` names (None: unknown or closed)."""
        session = self._sessions.get(token)
        return session.principal if session is not None and session.open else None

    def __len__(self) -> int:
        """Sessions counted toward ``max_sessions``: the open ones, and the ended ones whose
        peer has not yet received everything sent to it."""
        return len(self._sessions)

    async def start(self) -> None:
        self.max_sessions = fit_sessions(self.max_sessions, self.reserved_fds)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # the caller checked that no live daemon owns the directory
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(self.path)
            os.chmod(self.path, self.socket_mode)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._accepting = asyncio.create_task(self._accept_loop())

    async def stop(self) -> None:
        tasks = [t for t in (self._accepting, *self._serving) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _accept_loop(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:  # EMFILE and the like: wait rather than spin
                log.warning("session socket accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._serve(conn))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, conn: socket.socket) -> None:
        token = ""
        session: Session | None = None
        try:
            try:
                conn.setblocking(False)
                pid, uid, gid = _UCRED.unpack(
                    conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
                )
                principal = self.policy.for_unix_peer(uid, gid)
                if principal is None:
                    self._send(conn, {"ok": False, "code": "permission", "error": (
                        f"uid {uid} (gid {gid}) is not in the daemon's tenant policy"
                    )})  # fmt: skip
                    return
                # One caller (a tenant with a policy, a uid without) may hold at most half
                # the sessions, so it cannot lock the others out. Ended sessions whose peer
                # has not read all its replies count (_linger).
                share = share_key(principal, uid)
                mine = sum(1 for s in self._sessions.values() if s.share == share)
                if len(self._sessions) >= self.max_sessions or mine >= max(
                    1, self.max_sessions // 2
                ):
                    ended = sum(1 for s in self._sessions.values() if not s.open)
                    whose = f"{share[0]} {share[1]!r}" if share[0] == "tenant" else f"uid {uid}"
                    self._send(conn, {"ok": False, "code": "exhausted", "error": (
                        f"too many sessions ({len(self._sessions)} open, {mine} of {whose}"
                        + (f"; {ended} of them ended with replies their peer has not read "
                           "yet, counted until it reads them or hangs up" if ended else "")
                        + f"; connections.max_sessions is {self.max_sessions}, half of it "
                        "per tenant, or per uid without a policy)"
                    )})  # fmt: skip
                    return
                token = secrets.token_hex(SESSION_TOKEN_BYTES)
                principal = dataclasses.replace(principal, session=token)
                session = Session(token, principal, pid, uid, share=share)
                self._sessions[token] = session
                calls = self.calls
                self._send(conn, {
                    "ok": True, "session": token, "principal": principal.name,
                    "calls": calls is not None,
                })  # fmt: skip
                await self._read_messages(conn, session, calls)
            except _Stalled as exc:
                assert session is not None
                log.info("session of uid %d (pid %d) ended: %s", session.uid, session.pid, exc)
            except OSError as exc:
                log.debug("session ended: %s", exc)
            except Exception:  # never skips _linger; a cancellation (a stop) goes through
                log.exception("session ended by an unexpected error")
            if session is not None:
                await self._linger(conn, session)
        finally:
            if session is not None and session.watch is not None:
                session.watch.cancel()
            self._sessions.pop(token, None)
            conn.close()

    async def _linger(self, conn: socket.socket, session: Session) -> None:
        """The session has ended (its token is refused from now on); while its peer has not
        received everything sent to it (a descriptor among it, perhaps: in flight, charged to
        the daemon), it stays counted toward the session caps, so that a peer that stops
        reading and keeps its end open cannot make the daemon forget its descriptors and take
        more on a new connection. The connection is shut both ways: a peer that reads on gets
        its replies, then end-of-file; its sends fail. Returns once the peer has received all
        of it, or closed its end (the kernel drops what it had not read)."""
        session.open = False
        session.end = None
        if session.watch is not None:
            session.watch.cancel()
            session.watch = None
        if not _unread(conn):
            return
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        # What the peer sent and the daemon did not read: dropped now (nothing more comes).
        with contextlib.suppress(OSError):
            for _ in range(100_000):
                if not conn.recv(MAX_MESSAGE):
                    break
        delay = 0.001
        while _unread(conn):
            await asyncio.sleep(delay)
            delay = min(2 * delay, LINGER_POLL_S)

    async def _read_messages(
        self, conn: socket.socket, session: Session, calls: Calls | None
    ) -> None:
        """Answer the connection's messages until it closes. A reader callback, not a
        ``sock_recv`` per message (a future and two epoll changes fewer per call): each call is
        read there and run by a task of its own, which sends its reply itself. One call in
        flight per connection, as the client sends them: a message that comes while a call
        runs is held until that call is answered, and the connection is not read meanwhile.
        The reader stays registered across calls (a client waits for each reply, so nothing
        comes in between): two epoll changes per call fewer than taking it off and back.
        A session request whose answer carries a descriptor while the peer has not received
        an earlier reply waits, the same way, until it has (``_answer_once_read``)."""
        loop = asyncio.get_running_loop()
        fd = conn.fileno()
        limit = local_calls.MAX_REQUEST_BYTES if calls is not None else MAX_MESSAGE
        ended: asyncio.Future[None] = loop.create_future()
        running: asyncio.Future[Any] | None = None  # the call, or the request, in flight
        held: bytes | None = None  # a message that came while it ran
        reading = True

        def end(exc: BaseException | None) -> None:
            loop.remove_reader(fd)
            if not ended.done():
                if exc is None:
                    ended.set_result(None)
                else:
                    ended.set_exception(exc)

        def answer(reply: bytes | None) -> None:
            """The running call's reply, from its task (None: the waiting request was
            answered): send it, then serve what came meanwhile."""
            nonlocal running, held, reading
            running = None
            if ended.done():
                return
            if reply is not None:
                try:
                    conn.send(reply)  # non-blocking, as _send
                except BaseException as exc:  # ends the session, reported below
                    end(exc)
                    return
            if held is not None:
                data, held = held, None
                serve(data)
            if running is None and not reading and not ended.done():
                loop.add_reader(fd, readable)
                reading = True

        def waited(task: asyncio.Future[None]) -> None:
            """The request that waited for the peer to read was answered (or refused)."""
            if task.cancelled():
                return
            exc = task.exception()
            if exc is not None:
                end(exc)
            else:
                answer(None)

        def readable() -> None:
            nonlocal held, reading
            try:
                data = conn.recv(limit + 1)
            except BlockingIOError:
                return
            except OSError as exc:
                end(exc)
                return
            if not data:
                end(None)
                return
            if running is not None:  # hold it, and read no more until the call is answered
                held = data
                loop.remove_reader(fd)
                reading = False
                return
            serve(data)

        def serve(data: bytes) -> None:
            nonlocal running, reading
            try:
                if data[0] != local_calls.MAGIC or calls is None:
                    # Whatever the bytes, an answer: _answer replies to a message that does
                    # not parse (parse_session_op), and ends the session only when a send
                    # fails.
                    try:
                        self._answer(conn, session, data[:MAX_MESSAGE])
                    except _PeerBehind:  # read no more until it has received the earlier ones
                        running = asyncio.ensure_future(
                            self._answer_once_read(conn, session, data[:MAX_MESSAGE])
                        )
                        running.add_done_callback(waited)
                        if reading:
                            loop.remove_reader(fd)
                            reading = False
                    return
                if len(data) > limit:  # truncated: the datagram was larger than allowed
                    call_id = local_calls.REQUEST.unpack_from(data)[2]
                    reply = local_calls.encode_error(
                        call_id,
                        local_calls.STATUS_EXHAUSTED,
                        "CapacityError",
                        f"a local call is at most {limit} bytes: send it over gRPC",
                    )
                else:
                    try:
                        served = calls(session.token, data, answer)
                    except Exception as exc:  # LocalCalls.serve answers errors; never dropped
                        log.exception("local call not served")
                        served = local_calls.encode_error(
                            local_calls.call_id_of(data),
                            local_calls.STATUS_INTERNAL,
                            "",
                            f"the call was not served: {type(exc).__name__}",
                        )
                    if not isinstance(served, bytes):
                        running = asyncio.ensure_future(served)  # it calls ``answer``
                        return
                    reply = served
                conn.send(reply)  # non-blocking, as _send
            except BaseException as exc:  # a send failed: ends the session, reported below
                end(exc)

        def stalled(exc: BaseException) -> None:
            """A descriptor sent was still unread ``DRAIN_S`` later (``_watch``)."""
            if running is not None:
                running.cancel()
            end(exc)

        session.end = stalled

        loop.add_reader(fd, readable)
        try:
            await ended
        finally:
            loop.remove_reader(fd)
            if running is not None:
                running.cancel()

    async def _answer_once_read(self, conn: socket.socket, session: Session, data: bytes) -> None:
        """Answer the session request ``data`` as soon as the peer has received every earlier
        reply (nothing is sent on the connection meanwhile: it is not read), looking again
        after 1 ms, 2 ms, ... up to 50 ms apart. After ``DRAIN_S``: refuse it with a message
        (no descriptor) and end the session (``_Stalled``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_S
        delay = 0.001
        while True:
            await asyncio.sleep(delay)
            if not _unread(conn):
                with contextlib.suppress(_PeerBehind):  # not again: nothing was sent since
                    self._answer(conn, session, data)
                    return
            if loop.time() >= deadline:
                break
            delay = min(2 * delay, 0.05)
        message = (
            f"an earlier reply on this session was still unread after {DRAIN_S:g} s; the "
            "daemon sends a descriptor only once the peer has received every earlier reply: "
            "read each reply before sending the next request. The session is closed"
        )
        with contextlib.suppress(BlockingIOError):
            self._send(conn, {"ok": False, "code": "invalid", "error": message})
        raise _Stalled(message)

    def _answer(self, conn: socket.socket, session: Session, data: bytes) -> None:
        """Answer the session request ``data``: a descriptor and its reply, or a refusal that
        says why (a message that does not parse among them); ``_PeerBehind`` when a descriptor
        is due and the peer has not yet received an earlier reply. OSError only when a send
        fails (the session ends then)."""
        try:
            op = parse_session_op(data)
        except SessionOpError as exc:
            self._send(conn, {"ok": False, "code": "invalid", "error": f"bad request: {exc}"})
            return
        if op.kind == "presence":
            self._answer_presence(conn, session, op.handle)
            return
        uid = op.slab
        access = self._access(session.principal, uid)
        if access is None:
            # The same answer for a retired slab and another tenant's: nothing says which.
            self._send(conn, {"ok": False, "code": "unavailable", "error": (
                f"slab {uid} is not available to this session"
            )})  # fmt: skip
            return
        if _unread(conn):  # checked again as it is sent; here to export nothing meanwhile
            raise _PeerBehind
        try:
            fd = self.arena.export(uid, writable=access)
        except OSError as exc:  # out of descriptors: refused, the session lives on
            log.warning("slab not handed over: %s", exc)
            self._send(conn, {"ok": False, "code": "unavailable", "error": (
                f"slab {uid} cannot be handed over now ({exc.strerror or exc})"
            )})  # fmt: skip
            return
        try:
            size = os.fstat(fd).st_size
            self._send_fd(conn, session, {"ok": True, "size": size, "writable": access}, fd)
        finally:
            os.close(fd)

    def _answer_presence(self, conn: socket.socket, session: Session, handle: bytes) -> None:
        """``{"op": "presence", "handle": HEX}``: the presence table of the handle's namespace
        (``kvstore.presence``), read-only, if the session's principal opened the handle."""
        if self.presence is None:
            self._send(conn, {"ok": False, "code": "invalid", "error": "no presence tables"})
            return
        if _unread(conn):  # checked again as it is sent; here to export nothing meanwhile
            raise _PeerBehind
        try:
            table, ask_on_miss = self.presence(session.principal, handle)
            fd = table.export()
        except KVStoreError as exc:  # the same answer for a closed handle and another's
            self._send(conn, {"ok": False, "code": "unavailable", "error": str(exc)})
            return
        except OSError as exc:  # out of memory or descriptors: refused, the session lives on
            log.warning("presence table not handed over: %s", exc)
            self._send(conn, {"ok": False, "code": "unavailable", "error": (
                f"no presence table now ({exc.strerror or exc}): use Lookup"
            )})  # fmt: skip
            return
        try:
            self._send_fd(conn, session, {"ok": True, "ask_on_miss": ask_on_miss}, fd)
        finally:
            os.close(fd)

    def _access(self, principal: Principal, uid: int) -> bool | None:
        """None: may not map slab ``uid`` (or it is gone); else whether it may write it."""
        found = self.arena.file(uid)
        if found is None:
            return None
        domain = found[1].domain
        if principal.all_tenants:
            return True
        tenant = self._tenant_of_domain(domain)
        if tenant is None or not principal.may_read(tenant):
            return None
        return principal.may_write(tenant)

    @staticmethod
    def _send(conn: socket.socket, message: dict[str, object]) -> None:
        # Non-blocking: a client that does not read its replies fills its queue, and its
        # session ends (it stays counted while they are unread: _linger).
        conn.send(json.dumps(message).encode())

    def _send_fd(
        self, conn: socket.socket, session: Session, message: dict[str, object], fd: int
    ) -> None:
        """Send ``message`` with descriptor ``fd``, only if the peer has received everything
        sent to it before (``_PeerBehind`` if not): the one place a descriptor leaves the
        daemon, so at most one is ever in flight on a connection (module docstring). Whether
        the peer received it is looked at again ``DRAIN_S`` later (``_watch``)."""
        if _unread(conn):
            raise _PeerBehind
        socket.send_fds(conn, [json.dumps(message).encode()], [fd])
        if session.watch is not None:  # the earlier descriptor was received (nothing unread)
            session.watch.cancel()
        session.watch = asyncio.get_running_loop().call_later(DRAIN_S, self._watch, conn, session)

    def _watch(self, conn: socket.socket, session: Session) -> None:
        """``DRAIN_S`` after a descriptor was sent: a peer that has not received it yet stops
        reading (or reads too slowly to be served); its session ends (token refused) whether
        or not it sends anything more, and stays counted until it reads or hangs up
        (``_linger``)."""
        session.watch = None
        end = session.end
        if not session.open or end is None:
            return
        try:
            behind = _unread(conn)
        except OSError:
            return  # closed meanwhile: the reader ends the session
        if not behind:
            return
        message = (
            f"a descriptor sent on this session was still unread after {DRAIN_S:g} s: read "
            "each reply before sending the next request. The session is closed"
        )
        with contextlib.suppress(OSError):
            self._send(conn, {"ok": False, "code": "invalid", "error": message})
        end(_Stalled(message))
