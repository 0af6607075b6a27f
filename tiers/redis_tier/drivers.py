"""The two ways the Redis tier talks to Redis, behind one small interface (``Driver``).

* ``RespDriver``: the tier's own RESP2 client (``resp``) for ``redis://`` and ``unix://``:
  payloads go from and to the caller's buffers without a copy in Python.
* ``RedisPyDriver``: redis-py for TLS (``rediss://``) and Redis Cluster
  (``redis+cluster://``, ``rediss+cluster://``: ``redis.asyncio.cluster.RedisCluster``, whose
  pipelines split a batch per node and send to the nodes concurrently, and follow MOVED/ASK).
  One copy per value each way: a SET's header and payload are joined into one bytes object (a
  command argument must be one buffer in redis-py), a GET's value arrives as bytes and is copied
  into the caller's buffer.

Both return a batch's replies in order with error replies in place as exceptions, and raise
on a connection failure. Neither retries beyond redis-py's one reconnect: the tier owns the
deadline, the up/down state and the background reconnection.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.tiers.redis_tier.resp import Command, Endpoint, RespConnectionError, RespPool

GET_WINDOW_BYTES = 8 << 20
"""GET replies requested ahead of the one being read. One GET at a time leaves the link idle for
a round trip per block (neutral on a local unix socket, ~5-25% of a 512 KiB-2 MiB block's time
over a 10 Gb/s network); a whole batch at once makes Redis buffer every reply (128 x 2 MiB =
256 MiB of output buffer on a shared server) and ran 3x slower here with redis-py."""
REDIS_PY_READ_SIZE = 1 << 20
"""redis-py's socket read size: its 32-64 KiB default made large GETs up to 2x slower."""
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def _tls_defaults(url: str) -> dict[str, Any]:
    """redis-py options a TLS URL gets unless it sets them: verify the server's host name as
    well as its certificate chain. redis-py 5 (which the ``redis>=5.0`` requirement allows)
    skips the name check unless asked (6 and later check it), which accepts any certificate the
    trusted CAs signed, for any host. A URL that sets ``ssl_check_hostname`` or turns
    verification off (``ssl_cert_reqs=none``: Python refuses a name check without it) keeps
    its own choice; URL options override these keyword defaults in redis-py."""
    parts = urlsplit(url)
    if parts.scheme not in ("rediss", "rediss+cluster"):
        return {}
    query = parse_qs(parts.query)  # as redis-py reads it: first value, names as written
    if "ssl_check_hostname" in query or query.get("ssl_cert_reqs", [""])[0].lower() == "none":
        return {}
    return {"ssl_check_hostname": True}


class Driver(Protocol):
    name: str

    async def ping(self) -> None:
        """Return if Redis (every node of a cluster) answers PING; raise otherwise."""
        ...

    async def run(self, commands: Sequence[Command]) -> list[Any]:
        """Send a batch in one round trip (per node) and return its replies in order."""
        ...

    async def get_into(
        self, names: Sequence[bytes], heads: Sequence[memoryview], outs: Sequence[memoryview]
    ) -> list[Any]:
        """GET each name: its length ``n`` if its value was ``len(head)`` to ``len(head) +
        len(out)`` bytes and now fills ``head`` then ``out[: n - len(head)]`` (unverified), None
        if absent, False if of another length, or the error reply. Nothing is written to the
        buffers after this returns or raises."""
        ...

    async def reset(self) -> None:
        """Drop every connection: the next call connects afresh."""
        ...

    async def close(self) -> None: ...


def make_driver(url: str, *, driver: str, timeout_s: float, max_connections: int) -> Driver:
    scheme = urlsplit(url).scheme
    if driver not in ("auto", "resp", "redis-py"):
        raise ValueError(f"driver {driver!r} unknown: choose 'auto', 'resp' or 'redis-py'")
    if scheme in CLUSTER_SCHEMES:
        if driver == "resp":
            raise ValueError("the RESP driver does not speak Redis Cluster")
        return RedisPyDriver(url, timeout_s=timeout_s, max_connections=max_connections)
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"Redis URL scheme {scheme!r} unknown: use redis://, rediss://, unix://, "
            "redis+cluster:// or rediss+cluster://"
        )
    if driver == "redis-py" or scheme == "rediss":
        if driver == "resp":
            raise ValueError("the RESP driver does not speak TLS (rediss://)")
        return RedisPyDriver(url, timeout_s=timeout_s, max_connections=max_connections)
    return RespDriver(Endpoint.from_url(url), max_connections=max_connections)


class RespDriver:
    name = "resp"

    def __init__(self, endpoint: Endpoint, *, max_connections: int) -> None:
        self._pool = RespPool(endpoint, max_connections)

    async def ping(self) -> None:
        async with self._pool.connection() as conn:
            (reply,) = await conn.execute([("PING",)])
        if reply != b"PONG":
            raise RespConnectionError(f"PING answered {reply!r}")

    async def run(self, commands: Sequence[Command]) -> list[Any]:
        async with self._pool.connection() as conn:
            return await conn.execute(commands)

    async def get_into(
        self, names: Sequence[bytes], heads: Sequence[memoryview], outs: Sequence[memoryview]
    ) -> list[Any]:
        sizes = [len(h) + len(o) for h, o in zip(heads, outs, strict=True)]
        results: list[Any] = []
        async with self._pool.connection() as conn:
            sent = ahead = 0
            for i in range(len(names)):
                batch: list[Command] = []
                while sent < len(names) and (sent == i or ahead + sizes[sent] <= GET_WINDOW_BYTES):
                    batch.append(("GET", names[sent]))
                    ahead += sizes[sent]
                    sent += 1
                if batch:
                    await conn.send(batch)
                results.append(await conn.read_value_into(heads[i], outs[i]))
                ahead -= sizes[i]
        return results

    async def reset(self) -> None:
        self._pool.clear()

    async def close(self) -> None:
        self._pool.close()


def _join(arg: Any) -> Any:
    return b"".join(arg) if isinstance(arg, list) else arg


class RedisPyDriver:
    def __init__(self, url: str, *, timeout_s: float, max_connections: int) -> None:
        parts = urlsplit(url)
        self._cluster = parts.scheme in CLUSTER_SCHEMES
        self._tls = _tls_defaults(url)
        self.name = "redis-py-cluster" if self._cluster else "redis-py"
        if self._cluster:
            url = urlunsplit(parts._replace(scheme=CLUSTER_SCHEMES[parts.scheme]))
        self._url = url
        self._timeout_s = timeout_s
        self._max_connections = max_connections
        self._client = self._connect()

    def _connect(self) -> Any:
        common: dict[str, Any] = {
            "socket_timeout": self._timeout_s,
            "socket_connect_timeout": self._timeout_s,
            "socket_read_size": REDIS_PY_READ_SIZE,
            # One immediate retry on a fresh connection (a stale pooled one after a Redis
            # restart); the tier's deadline bounds it, the tier's own loop does the backoff.
            "retry": Retry(NoBackoff(), 1),
            **self._tls,
        }
        if self._cluster:
            return RedisCluster.from_url(self._url, **common)
        pool = aioredis.BlockingConnectionPool.from_url(
            self._url, max_connections=self._max_connections, timeout=None, **common
        )
        return aioredis.Redis(connection_pool=pool)

    async def ping(self) -> None:
        # A cluster's PING goes to every node and is true only if all answered.
        if not await self._client.ping():
            raise ConnectionError("PING failed")

    async def run(self, commands: Sequence[Command]) -> list[Any]:
        if not commands:
            return []
        pipe = self._client.pipeline(transaction=False)
        for cmd in commands:
            pipe.execute_command(*(_join(a) for a in cmd))
        return list(await pipe.execute(raise_on_error=False))

    async def get_into(
        self, names: Sequence[bytes], heads: Sequence[memoryview], outs: Sequence[memoryview]
    ) -> list[Any]:
        results: list[Any] = []
        i = 0
        while i < len(names):
            # Windows bound the values held at once, as on the RESP path.
            j, window = i, 0
            while j < len(names) and (j == i or window + len(outs[j]) <= GET_WINDOW_BYTES):
                window += len(outs[j])
                j += 1
            values = await self.run([("GET", names[k]) for k in range(i, j)])
            for k, value in zip(range(i, j), values, strict=True):
                head, out = heads[k], outs[k]
                if value is None or isinstance(value, Exception):
                    results.append(value)
                elif not len(head) <= len(value) <= len(head) + len(out):
                    results.append(False)
                else:
                    view = memoryview(value)
                    head[:] = view[: len(head)]
                    out[: len(value) - len(head)] = view[len(head) :]
                    results.append(len(value))
            i = j
        return results

    async def reset(self) -> None:
        if self._cluster:
            # A fresh client re-reads the topology, which may have changed while it was down.
            old, self._client = self._client, self._connect()
            with contextlib.suppress(Exception):
                await old.aclose()
        else:
            await self._client.connection_pool.disconnect()

    async def close(self) -> None:
        if self._cluster:
            await self._client.aclose()
        else:
            # A client given its pool leaves the pool open on aclose(): close it too, or its
            # connections (TLS sessions included) stay open until garbage collection.
            await self._client.aclose(close_connection_pool=True)
