"""A minimal RESP2 client on non-blocking sockets: the Redis tier's fast path.

Why not redis-py for the bytes: on this machine a 2 MiB GET through redis-py (either parser)
moves 0.6-2 GB/s, because every value passes through asyncio's stream buffer and is copied
twice more on its way out; a SET is copied when Python 3.11's transport joins and buffers it.
Here a GET's payload is ``recv_into``'d straight into the caller's buffer and a SET's payload
goes out with ``sock_sendall`` of the caller's memoryview: 4-5 GB/s either way (see
benchmarks/bench_redis_tier.py). It speaks only what the tier sends: commands as arrays of
bulk strings, replies of the five RESP2 types.

A connection whose exchange fails or is interrupted (error, timeout, cancellation) is closed,
never reused: its position in the reply stream is unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from redis.asyncio.connection import parse_url
from redis.exceptions import BusyLoadingError, ResponseError

Part: TypeAlias = bytes | bytearray | memoryview
Arg: TypeAlias = str | bytes | bytearray | memoryview | int | list[Part]
"""A command argument. A list is one bulk string sent from several buffers (header, payload)."""
Command: TypeAlias = tuple[Arg, ...]

READ_BUFFER = 1 << 16
"""Replies are parsed from this buffer; a GET's payload bypasses it."""
SEND_DIRECT = 1 << 14
"""Arguments at least this large are sent from the caller's buffer, not copied."""
MAX_BULK = 512 << 20
"""Longest bulk string a reply may state (Redis's own ``proto-max-bulk-len`` default): a longer
one is a reply stream that makes no sense."""
MAX_DEPTH = 8
"""Deepest nesting of arrays a reply may have (the tier's replies nest at most two deep): a
deeper one is a reply stream that makes no sense, never a recursion without bound."""


class RespConnectionError(ConnectionError):
    """The connection closed, or the reply stream made no sense: the connection is dropped."""


@dataclass(frozen=True)
class Endpoint:
    path: str | None
    host: str | None
    port: int
    db: int
    username: str | None
    password: str | None

    @classmethod
    def from_url(cls, url: str) -> Endpoint:
        """``redis://[[user]:password@]host[:port][/db]`` or ``unix://[[user]:password@]/path
        [?db=N]`` (redis-py's own parser, so both clients read a URL alike)."""
        kw: dict[str, Any] = dict(parse_url(url))
        if url.startswith("rediss:"):
            raise ValueError("TLS (rediss://) is not served by the RESP fast path")
        if "path" not in kw and "host" not in kw:
            raise ValueError(f"no host or socket path in Redis URL {url!r}")
        return cls(
            path=kw.get("path"),
            host=kw.get("host"),
            port=int(kw.get("port", 6379)),
            db=int(kw.get("db", 0) or 0),
            username=kw.get("username"),
            password=kw.get("password"),
        )


def encode(commands: Sequence[Command]) -> list[Part]:
    """The wire bytes of ``commands``: small pieces coalesced, large buffers passed through."""
    chunks: list[Part] = []
    buf = bytearray()

    def add(part: Part) -> None:
        nonlocal buf
        if len(part) >= SEND_DIRECT:
            chunks.append(buf)
            chunks.append(part)
            buf = bytearray()
        else:
            buf += part

    for cmd in commands:
        buf += b"*%d\r\n" % len(cmd)
        for arg in cmd:
            if isinstance(arg, list):
                buf += b"$%d\r\n" % sum(len(p) for p in arg)
                for p in arg:
                    add(p)
                buf += b"\r\n"
                continue
            if isinstance(arg, int):
                arg = b"%d" % arg
            elif isinstance(arg, str):
                arg = arg.encode()
            buf += b"$%d\r\n" % len(arg)
            add(arg)
            buf += b"\r\n"
    chunks.append(buf)
    return [c for c in chunks if len(c)]


def _error(message: bytes) -> ResponseError | BusyLoadingError:
    text = message.decode(errors="replace")
    # LOADING: a restarted Redis is reading its data set; redis-py maps it the same way, and
    # the tier treats it like a connection failure (Redis is not serving yet).
    if text.startswith("LOADING"):
        return BusyLoadingError(text)
    return ResponseError(text)


class RespConnection:
    """One socket and its read buffer. Used by one task at a time (the pool sees to it)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._buf = bytearray(READ_BUFFER)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    @classmethod
    async def open(cls, ep: Endpoint) -> RespConnection:
        loop = asyncio.get_running_loop()
        addrs: list[tuple[int, Any]]
        if ep.path is not None:
            addrs = [(socket.AF_UNIX, ep.path)]
        else:
            infos = await loop.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM)
            addrs = [(family, addr) for family, _, _, _, addr in infos]
        last: OSError = OSError(f"no address for {ep.host}")
        for family, addr in addrs:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                if family != socket.AF_UNIX:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_connect(sock, addr)
            except OSError as exc:
                sock.close()
                last = exc
                continue
            except BaseException:
                sock.close()
                raise
            conn = cls(sock)
            try:
                await conn._handshake(ep)
            except BaseException:
                conn.close()
                raise
            return conn
        raise last

    async def _handshake(self, ep: Endpoint) -> None:
        cmds: list[Command] = []
        if ep.password is not None:
            auth: Command = ("AUTH", ep.password)
            cmds.append(auth if ep.username is None else ("AUTH", ep.username, ep.password))
        if ep.db:
            cmds.append(("SELECT", ep.db))
        for reply in await self.execute(cmds):
            if isinstance(reply, Exception):
                # A refused AUTH or SELECT will not fix itself by retrying this connection.
                raise RespConnectionError(f"Redis refused the connection set-up: {reply}")

    def close(self) -> None:
        self._sock.close()

    def reusable(self) -> bool:
        """False if Redis closed this idle connection (e.g. it restarted) or sent bytes no
        one asked for: a cheap non-blocking peek, so a stale connection costs no call."""
        if self._start != self._end:
            return False
        try:
            self._sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False

    # ------------------------------------------------------------------ sending
    async def send(self, commands: Sequence[Command]) -> None:
        for chunk in encode(commands):
            await self._loop.sock_sendall(self._sock, chunk)

    async def execute(self, commands: Sequence[Command]) -> list[Any]:
        """Send all commands in one write, then read one reply each (error replies are
        returned in place as exceptions)."""
        if not commands:
            return []
        await self.send(commands)
        return [await self.read_reply() for _ in commands]

    # ------------------------------------------------------------------ receiving
    async def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            if self._start == 0:
                raise RespConnectionError("a reply line longer than the read buffer")
            rest = bytes(self._view[self._start : self._end])
            self._view[: len(rest)] = rest
            self._start, self._end = 0, len(rest)
        n = await self._loop.sock_recv_into(self._sock, self._view[self._end :])
        if n == 0:
            raise RespConnectionError("Redis closed the connection")
        self._end += n

    async def _readline(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                line = bytes(self._view[self._start : i])
                self._start = i + 2
                return line
            await self._fill()

    async def _readinto(self, dest: memoryview) -> None:
        """Fill ``dest`` from the buffer, then straight from the socket."""
        n = len(dest)
        have = min(n, self._end - self._start)
        dest[:have] = self._view[self._start : self._start + have]
        self._start += have
        pos = have
        while pos < n:
            got = await self._loop.sock_recv_into(self._sock, dest[pos:])
            if got == 0:
                raise RespConnectionError("Redis closed the connection mid-reply")
            pos += got

    async def _skip(self, n: int) -> None:
        while n > 0:
            if self._start == self._end:
                await self._fill()
            k = min(n, self._end - self._start)
            self._start += k
            n -= k

    async def _crlf(self) -> None:
        while self._end - self._start < 2:
            await self._fill()
        if self._view[self._start : self._start + 2] != b"\r\n":
            raise RespConnectionError("bulk string not followed by CRLF")
        self._start += 2

    async def _read_bulk(self, n: int) -> bytes:
        """A bulk string's ``n`` bytes, its CRLF consumed. Memory follows the bytes that
        arrive, not the length stated: the buffer doubles as it fills, so a reply that states
        a huge length and sends little costs little."""
        data = bytearray(min(n, READ_BUFFER))
        filled = 0
        while True:
            await self._readinto(memoryview(data)[filled:])
            filled = len(data)
            if filled == n:
                break
            data += bytes(min(n - filled, filled))
        await self._crlf()
        return bytes(data)

    async def read_reply(self, depth: int = 0) -> Any:
        """One reply: bytes (simple or bulk string), int, None (a null), a list of replies, or
        an error reply as an exception instance. ``RespConnectionError`` when the stream ends
        or makes no sense (a bad line, a length past ``MAX_BULK``, nesting past
        ``MAX_DEPTH``)."""
        line = await self._readline()
        kind, rest = line[:1], line[1:]
        try:
            if kind == b"+":
                return rest
            if kind == b"-":
                return _error(rest)
            if kind == b":":
                return int(rest)
            if kind == b"$":
                n = int(rest)
                if n < 0:
                    return None
                if n > MAX_BULK:
                    raise RespConnectionError(f"a bulk string of {n} bytes stated: {line[:40]!r}")
                return await self._read_bulk(n)
            if kind == b"*":
                n = int(rest)
                if n >= 0 and depth >= MAX_DEPTH:
                    raise RespConnectionError(f"a reply nested deeper than {MAX_DEPTH} arrays")
                return None if n < 0 else [await self.read_reply(depth + 1) for _ in range(n)]
        except ValueError:
            pass
        raise RespConnectionError(f"unexpected reply line {line[:40]!r}")

    async def read_value_into(self, head: memoryview, out: memoryview) -> Any:
        """Read a GET reply: its length ``n`` if the value was ``len(head)`` to ``len(head) +
        len(out)`` bytes and now fills ``head`` then ``out[: n - len(head)]``, None if there was
        no value, False if it had another length (skipped), or the error reply. Any bytes
        written to ``head``/``out`` are unverified."""
        line = await self._readline()
        if line[:1] == b"$":
            try:
                n = int(line[1:])
            except ValueError:
                raise RespConnectionError(f"bad bulk length {line[:40]!r}") from None
            if n < 0:
                return None
            if not len(head) <= n <= len(head) + len(out):
                await self._skip(n + 2)
                return False
            await self._readinto(head)
            if n > len(head):
                await self._readinto(out[: n - len(head)])
            await self._crlf()
            return n
        if line[:1] == b"-":
            return _error(line[1:])
        raise RespConnectionError(f"unexpected reply to GET {line[:40]!r}")


class RespPool:
    """Connections to one endpoint, at most ``max_connections`` in use at once (further callers
    wait, inside their own deadline). ``clear`` closes the idle ones and retires those in use,
    after a failure or a restart of Redis."""

    def __init__(self, endpoint: Endpoint, max_connections: int) -> None:
        self.endpoint = endpoint
        self._idle: list[RespConnection] = []
        self._sem = asyncio.Semaphore(max_connections)
        self._generation = 0
        self._closed = False

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[RespConnection]:
        async with self._sem:
            conn = None
            while self._idle:
                candidate = self._idle.pop()
                if candidate.reusable():
                    conn = candidate
                    break
                candidate.close()
            if conn is None:
                conn = await RespConnection.open(self.endpoint)
            generation = self._generation
            try:
                yield conn
            except BaseException:
                conn.close()
                raise
            if generation == self._generation and not self._closed:
                self._idle.append(conn)
            else:
                conn.close()

    def clear(self) -> None:
        self._generation += 1
        while self._idle:
            self._idle.pop().close()

    def close(self) -> None:
        self._closed = True
        self.clear()
