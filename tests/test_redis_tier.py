"""The Redis tier against real redis-server processes (no mocks).

Each test gets its own ``redis-server`` on a unix socket (``--port 0 --save '' --appendonly
no``) in a short private temp dir (unix socket paths are limited to 107 bytes, which pytest's
tmp_path can exceed), killed and removed at the end. The cluster test starts three nodes on
free TCP ports of 127.0.0.1 once per module and forms the cluster with redis-py (no
``redis-cli`` needed). The server is ``redis-server`` on PATH, else the dev extra's
valkey-server (``tests/redis_binary.py``); everything is skipped with a message only when
neither is installed.

Most behaviour is checked with both drivers: the tier's own RESP client ("resp", the default
for unix:// and redis://) and redis-py ("redis-py", used for TLS and Cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis as redis_py
import torch
from redis_binary import NOT_INSTALLED, redis_server_binary

from kvstore.checksum import block_checksum
from kvstore.tiers import codecs
from kvstore.tiers.codecs import CODEC_FP8, BlockFormat
from kvstore.tiers.redis import HEADER_BYTES, RedisTier, RedisTierUnavailable
from kvstore.tiers.redis_tier import value as fmt

REDIS_SERVER = redis_server_binary() or "redis-server"
pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(redis_server_binary() is None, reason=NOT_INSTALLED),
]

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
DRIVERS = ["resp", "redis-py"]


def key(i: int, salt: int = 0) -> bytes:
    return (salt.to_bytes(4, "big") + i.to_bytes(4, "big")) * 4


def block(i: int, size: int) -> bytes:
    # Random bytes: a shifted, swapped or partly stale block cannot compare equal.
    return random.Random(i * 1_000_003 + size).randbytes(size)


def entry(i: int, size: int, salt: int = 0, ns: bytes = NS) -> tuple[bytes, bytes, int]:
    """``(key, block, checksum)`` for a put into namespace ``ns``: the checksum is bound to
    ``ns`` and the key (``kvstore.checksum``)."""
    k, data = key(i, salt), block(i, size)
    return k, data, block_checksum(data, ns, k)


class RedisProc:
    """One redis-server on ``<dir>/r.sock``; can be killed, frozen and restarted on the same
    socket."""

    def __init__(self, directory: str, extra: tuple[str, ...] = ()) -> None:
        self.dir = directory
        self.sock = os.path.join(directory, "r.sock")
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.sock}"

    def start(self) -> None:
        cmd = [REDIS_SERVER, "--port", "0", "--unixsocket", self.sock, "--unixsocketperm", "700"]
        cmd += ["--save", "", "--appendonly", "no", "--dir", self.dir, *self.extra]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + 10
        while not self._pong():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.01)

    def _pong(self) -> bool:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(1)
            try:
                s.connect(self.sock)
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))
            except OSError:
                return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def client(self) -> Any:
        # Any: redis-py's annotations want str keys; these tests use bytes names throughout.
        return redis_py.Redis(unix_socket_path=self.sock, protocol=2)


@pytest.fixture
def server() -> Iterator[RedisProc]:
    d = tempfile.mkdtemp(prefix="kvr-")
    srv = RedisProc(d)
    try:
        srv.start()
        yield srv
    finally:
        with contextlib.suppress(Exception):
            srv.signal(signal.SIGCONT)
        srv.kill()
        shutil.rmtree(d, ignore_errors=True)


@contextlib.asynccontextmanager
async def opened(url: str, **kw: object) -> AsyncIterator[RedisTier]:
    tier = RedisTier(url, **kw)  # type: ignore[arg-type]
    await tier.start()
    try:
        yield tier
    finally:
        await tier.close()


async def wait_up(tier: RedisTier, within_s: float) -> float:
    t0 = time.monotonic()
    while not tier.up:
        assert time.monotonic() - t0 < within_s, f"tier not up within {within_s} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def redis_name(k: bytes, ns: bytes = NS, prefix: str = "kvs") -> bytes:
    return fmt.block_name(fmt.namespace_prefix(prefix, ns), k)


# ---------------------------------------------------------------------------- basics
def test_module_name_does_not_shadow_redis_py() -> None:
    import kvstore.tiers.redis as ours
    import kvstore.tiers.redis_tier.drivers as drivers

    assert ours.__name__ == "kvstore.tiers.redis"
    assert "site-packages" in redis_py.__file__ and hasattr(redis_py, "Redis")
    assert drivers.aioredis.__name__ == "redis.asyncio"


@pytest.mark.parametrize("drv", DRIVERS)
async def test_round_trip_bit_exact(server: RedisProc, drv: str) -> None:
    sizes = [1, 4096 + 7, 512 << 10, 2 << 20]
    blocks = [entry(i, size) for i, size in enumerate(sizes)]
    async with opened(server.url, driver=drv) as tier:
        assert tier.up and tier.driver == drv
        assert await tier.put(NS, blocks) == len(blocks)
        outs = [bytearray(size) for size in sizes]
        items = [(k, c, memoryview(o)) for (k, _, c), o in zip(blocks, outs, strict=True)]
        assert await tier.get_into(NS, items) == [True] * len(sizes)
        for (_, data, _), out in zip(blocks, outs, strict=True):
            assert out == data
        # Without the expected checksum the header's is used, still checked against the bytes;
        # get_into_checked returns it: block_checksum of the block bound to its namespace and
        # key, so the daemon keeps it as is.
        outs2 = [bytearray(size) for size in sizes]
        items2 = [(k, None, memoryview(o)) for (k, _, _), o in zip(blocks, outs2, strict=True)]
        sums = await tier.get_into_checked(NS, items2)
        assert sums == [block_checksum(data, NS, k) for k, data, _ in blocks]
        pairs = zip(blocks, outs2, strict=True)
        assert sums == [block_checksum(o, NS, k) for (k, _, _), o in pairs]
        assert outs2 == outs
        stats = tier.stats()
        assert stats["hits"] == 2 * len(sizes) and stats["checksum_failures"] == 0
        assert stats["puts"] == len(sizes) and stats["logical_bytes_written"] == sum(sizes)
        assert stats["bytes_written"] == sum(sizes) + len(sizes) * HEADER_BYTES  # as stored
        assert stats["bytes_read"] == 2 * sum(sizes)
    # What Redis holds is header + raw bytes under the documented name.
    raw = server.client().get(redis_name(blocks[1][0]))
    assert raw is not None and len(raw) == HEADER_BYTES + sizes[1]
    assert raw[:4] == b"KVRB" and raw[HEADER_BYTES:] == blocks[1][1]


async def test_numpy_and_memoryview_buffers(server: RedisProc) -> None:
    np = pytest.importorskip("numpy")
    src = np.arange(4096, dtype=np.float32).reshape(64, 64)
    c = block_checksum(src, NS, key(1))
    async with opened(server.url) as tier:
        assert await tier.put(NS, [(key(1), src, c)]) == 1
        dst = np.zeros_like(src)
        assert await tier.get_into(NS, [(key(1), c, dst)]) == [True]
        assert np.array_equal(src, dst)
        dst[:] = 0
        # The checksum of the bytes whatever the buffer's dtype and shape: what the daemon keeps.
        assert await tier.get_into_checked(NS, [(key(1), None, dst)]) == [c]
        assert c == block_checksum(dst, NS, key(1))
        assert np.array_equal(src, dst)
        with pytest.raises(ValueError, match="writable"):
            await tier.get_into(NS, [(key(1), None, b"x" * src.nbytes)])


@pytest.mark.parametrize("drv", DRIVERS)
async def test_contains_is_the_leading_run(server: RedisProc, drv: str) -> None:
    async with opened(server.url, driver=drv) as tier:
        await tier.put(NS, [entry(i, 100) for i in (0, 1, 2, 4, 5)])
        keys = [key(i) for i in range(6)]
        assert await tier.contains(NS, keys) == 3  # the gap at 3 ends the run
        assert await tier.contains(NS, keys[:2]) == 2
        assert await tier.contains(NS, keys[3:]) == 0
        assert await tier.contains(NS, keys[4:]) == 2
        assert await tier.contains(NS, []) == 0
        assert await tier.get_into(NS, []) == []
        assert await tier.get_into_checked(NS, []) == []


@pytest.mark.parametrize("drv", DRIVERS)
async def test_put_is_nx(server: RedisProc, drv: str) -> None:
    k, first, c1 = entry(1, 1000)
    second = bytes(1000)
    async with opened(server.url, driver=drv) as tier:
        assert await tier.put(NS, [(k, first, c1)]) == 1
        assert await tier.put(NS, [(k, second, block_checksum(second, NS, k)), entry(2, 1000)]) == 1
        out = bytearray(1000)
        assert await tier.get_into(NS, [(k, c1, memoryview(out))]) == [True]
        assert out == first
        assert tier.stats()["puts"] == 2


async def test_put_refuses_a_block_that_does_not_match_its_checksum(server: RedisProc) -> None:
    k, data, c = entry(1, 1000)
    async with opened(server.url) as tier:
        with pytest.raises(ValueError, match="checksum"):
            await tier.put(NS, [entry(2, 1000), (k, data, c ^ 1)])
        assert await tier.contains(NS, [key(2)]) == 0  # nothing of the batch was sent
        assert tier.stats()["checksum_failures"] == 1
        with pytest.raises(ValueError):
            await tier.put(b"short", [entry(1, 10)])
        with pytest.raises(ValueError):
            await tier.put(NS, [(b"k" * 31, data, c)])


# ---------------------------------------------------------------------------- integrity
@pytest.mark.parametrize("drv", DRIVERS)
async def test_every_tampered_byte_is_a_counted_miss(server: RedisProc, drv: str) -> None:
    """Flip each byte of the stored value in turn (every header byte, payload bytes at both
    ends and in the middle): each read is a miss counted as a checksum failure, and
    ``get_into_checked`` returns no checksum for it."""
    size = 300
    k, data, c = entry(3, size)
    r = server.client()
    name = redis_name(k)
    positions = [*range(HEADER_BYTES), HEADER_BYTES, HEADER_BYTES + size // 2]
    positions.append(HEADER_BYTES + size - 1)
    async with opened(server.url, driver=drv) as tier:
        await tier.put(NS, [(k, data, c)])
        original = r.get(name)
        assert original is not None
        for n, pos in enumerate(positions, 1):
            r.setrange(name, pos, bytes([original[pos] ^ 0x01]))
            for expected in (c, None):
                out = bytearray(size)
                assert await tier.get_into(NS, [(k, expected, memoryview(out))]) == [False], pos
                got = await tier.get_into_checked(NS, [(k, expected, memoryview(out))])
                assert got == [None], pos
            assert tier.stats()["checksum_failures"] == 4 * n
            assert tier.stats()["hits"] == 0
            r.set(name, original)
        out = bytearray(size)
        assert await tier.get_into(NS, [(k, c, memoryview(out))]) == [True]
        assert out == data
        out = bytearray(size)
        assert await tier.get_into_checked(NS, [(k, None, memoryview(out))]) == [c]
        assert out == data and c == block_checksum(data, NS, k)


@pytest.mark.parametrize("drv", DRIVERS)
async def test_wrong_length_garbage_and_wrong_checksum_are_misses(
    server: RedisProc, drv: str
) -> None:
    r = server.client()
    k, data, c = entry(1, 4096)
    async with opened(server.url, driver=drv) as tier:
        await tier.put(NS, [(k, data, c), entry(2, 4096)])
        original = r.get(redis_name(k))
        assert original is not None
        r.set(redis_name(key(2)), original[:-1])  # truncated
        r.set(redis_name(key(3)), original + b"x")  # one byte too many
        r.set(redis_name(key(4)), b"garbage")
        r.set(redis_name(key(5)), bytes(HEADER_BYTES + 4096))  # right length, zero header
        # A valid header with the right length, but the caller expects another checksum.
        items = [
            (key(i), block_checksum(data, NS, key(i)), memoryview(bytearray(4096)))
            for i in (2, 3, 4, 5)
        ]
        items.append((k, c ^ 0xFF, memoryview(bytearray(4096))))
        items.append((k, c, memoryview(bytearray(4095))))  # the caller's size is wrong
        # Absent: a plain miss.
        items.append((key(6), block_checksum(data, NS, key(6)), memoryview(bytearray(4096))))
        assert await tier.get_into(NS, items) == [False] * 7
        stats = tier.stats()
        assert stats["checksum_failures"] == 6 and stats["misses"] == 7 and stats["hits"] == 0
        # The same with the checksums: none for any of them, and the good one is next.
        items.append((k, None, memoryview(bytearray(4096))))
        assert await tier.get_into_checked(NS, items) == [None] * 7 + [c]
        stats = tier.stats()
        assert stats["checksum_failures"] == 12 and stats["misses"] == 14 and stats["hits"] == 1
        # The stream stays in step after skipped values: the next read is right.
        out = bytearray(4096)
        assert await tier.get_into(NS, [(k, c, memoryview(out))]) == [True] and out == data


@pytest.mark.parametrize("drv", DRIVERS)
async def test_namespaces_are_isolated(server: RedisProc, drv: str) -> None:
    r = server.client()
    k, data, c = entry(1, 2048)
    async with opened(server.url, driver=drv) as tier:
        await tier.put(NS, [(k, data, c)])
        # What a reader of OTHER_NS would expect of these bytes under k: bound to OTHER_NS.
        c_other = block_checksum(data, OTHER_NS, k)
        assert await tier.contains(OTHER_NS, [k]) == 0
        out = bytearray(2048)
        assert await tier.get_into(OTHER_NS, [(k, c_other, memoryview(out))]) == [False]
        assert tier.stats()["checksum_failures"] == 0  # simply absent
        # The value copied under the other namespace's name is refused by its header.
        r.copy(redis_name(k), redis_name(k, OTHER_NS))
        assert await tier.contains(OTHER_NS, [k]) == 1
        assert await tier.get_into(OTHER_NS, [(k, c_other, memoryview(out))]) == [False]
        assert await tier.get_into_checked(OTHER_NS, [(k, None, memoryview(out))]) == [None]
        assert tier.stats()["checksum_failures"] == 2
        # ... and so is a value renamed under another key of the same namespace.
        r.copy(redis_name(k), redis_name(key(9)))
        c9 = block_checksum(data, NS, key(9))
        assert await tier.get_into(NS, [(key(9), c9, memoryview(out))]) == [False]
    # Another key prefix is another store.
    async with opened(server.url, driver=drv, key_prefix="other") as tier:
        assert await tier.contains(NS, [k]) == 0


@pytest.mark.parametrize("drv", DRIVERS)
async def test_intact_bytes_under_another_key_are_a_counted_miss(
    server: RedisProc, drv: str
) -> None:
    """The checksum binds the key: a block put under key A, its stored value copied byte for
    byte under key B's name in the same namespace, is a miss for B counted as a checksum
    failure, whatever checksum the caller expects (B's bound checksum of those bytes, A's, or
    none). Even with the header rewritten to name B (stating A's checksum), only the bound
    checksum can tell, and it does; the same bytes written for B with B's checksum do read."""
    r = server.client()
    size = 4096
    a, data, ca = entry(1, size)
    b = key(2)
    cb = block_checksum(data, NS, b)
    assert cb != ca  # same bytes, same namespace, other key: another checksum
    async with opened(server.url, driver=drv) as tier:
        assert await tier.put(NS, [(a, data, ca)]) == 1
        assert r.copy(redis_name(a), redis_name(b))
        assert r.get(redis_name(b)) == r.get(redis_name(a))  # intact bytes, B's name
        assert await tier.contains(NS, [b]) == 1
        for expected in (cb, ca, None):
            out = bytearray(size)
            assert await tier.get_into(NS, [(b, expected, memoryview(out))]) == [False]
            got = await tier.get_into_checked(NS, [(b, expected, memoryview(out))])
            assert got == [None], expected
        stats = tier.stats()
        assert stats["hits"] == 0 and stats["misses"] == 6 and stats["checksum_failures"] == 6

        # A header rewritten to name B, stating A's checksum, with its own checksum intact:
        # the header passes, and the payload's checksum bound to B refuses it.
        r.set(redis_name(b), fmt.pack_header(b, NS, size, ca) + data)
        for expected in (ca, None, cb):
            out = bytearray(size)
            assert await tier.get_into(NS, [(b, expected, memoryview(out))]) == [False]
            got = await tier.get_into_checked(NS, [(b, expected, memoryview(out))])
            assert got == [None], expected
        stats = tier.stats()
        assert stats["hits"] == 0 and stats["misses"] == 12 and stats["checksum_failures"] == 12

        # Control: the same bytes stored for B with B's bound checksum are B's block, and A
        # still reads as itself.
        r.set(redis_name(b), fmt.pack_header(b, NS, size, cb) + data)
        out = bytearray(size)
        assert await tier.get_into_checked(NS, [(b, None, memoryview(out))]) == [cb]
        assert out == data
        out = bytearray(size)
        assert await tier.get_into_checked(NS, [(a, ca, memoryview(out))]) == [ca]
        assert out == data
        stats = tier.stats()
        assert stats["hits"] == 2 and stats["checksum_failures"] == 12


@pytest.mark.parametrize("drv", DRIVERS)
async def test_delete(server: RedisProc, drv: str) -> None:
    async with opened(server.url, driver=drv, max_bytes_per_namespace=1 << 20) as tier:
        await tier.put(NS, [entry(i, 100) for i in range(4)])
        assert await tier.delete(NS, [key(0), key(2), key(7)]) == 2
        assert await tier.contains(NS, [key(1)]) == 1
        assert await tier.contains(NS, [key(0)]) == 0
        assert await tier.contains(NS, [key(2)]) == 0
        index = fmt.index_name(fmt.namespace_prefix("kvs", NS))
        assert server.client().zcard(index) == 2  # the index forgot them too
        assert await tier.put(NS, [entry(0, 100)]) == 1  # and a deleted key can come back


async def test_concurrent_calls_share_the_pool(server: RedisProc) -> None:
    size = 64 << 10
    async with opened(server.url, max_connections=3) as tier:
        batches = [[entry(i, size, salt=s) for i in range(8)] for s in range(12)]
        stored = await asyncio.gather(*(tier.put(NS, b) for b in batches))
        assert stored == [8] * 12
        outs = [[bytearray(size) for _ in range(8)] for _ in batches]

        async def read(s: int) -> list[bool]:
            items = [
                (k, c, memoryview(o)) for (k, _, c), o in zip(batches[s], outs[s], strict=True)
            ]
            return await tier.get_into(NS, items)

        assert await asyncio.gather(*(read(s) for s in range(12))) == [[True] * 8] * 12
        assert all(
            o == d for s in range(12) for (_, d, _), o in zip(batches[s], outs[s], strict=True)
        )


# ---------------------------------------------------------------------------- failures
@pytest.mark.parametrize("drv", DRIVERS)
async def test_killed_and_restarted_redis(server: RedisProc, drv: str) -> None:
    size = 2 << 20
    blocks = [entry(i, size) for i in range(4)]
    outs = [bytearray(size) for _ in blocks]
    items = [(k, c, memoryview(o)) for (k, _, c), o in zip(blocks, outs, strict=True)]
    async with opened(server.url, driver=drv) as tier:
        await tier.put(NS, blocks)

        async def hammer() -> BaseException:
            while True:
                try:
                    await tier.get_into(NS, items)
                    await tier.put(NS, [entry(9, size)])
                    await tier.delete(NS, [key(9)])
                except RedisTierUnavailable as exc:
                    return exc

        task = asyncio.create_task(hammer())
        await asyncio.sleep(0.2)
        assert not task.done()
        server.kill()
        # The bounds tell an answer from a hang, with room for a loaded machine; they do not
        # measure speed (the deadline itself is timeout_s, 0.5 s).
        t0 = time.monotonic()
        exc = await asyncio.wait_for(task, 30)
        assert time.monotonic() - t0 < 10.0
        assert isinstance(exc, RedisTierUnavailable)
        assert not tier.up
        for call in (
            tier.contains(NS, [key(0)]),
            tier.put(NS, [entry(5, 10)]),
            tier.get_into(NS, items[:1]),
            tier.delete(NS, [key(0)]),
        ):
            t0 = time.monotonic()
            with pytest.raises(RedisTierUnavailable):
                await call
            assert time.monotonic() - t0 < 10.0
        await asyncio.sleep(0.3)  # a few reconnection attempts fail meanwhile
        assert not tier.up
        server.start()  # same socket path
        await wait_up(tier, 30.0)
        assert tier.stats()["reconnects"] == 1
        # The restarted Redis kept nothing (no persistence); the tier works again.
        assert await tier.contains(NS, [key(0)]) == 0
        assert await tier.put(NS, blocks) == 4
        assert await tier.get_into(NS, items) == [True] * 4
        assert all(o == d for (_, d, _), o in zip(blocks, outs, strict=True))


@pytest.mark.parametrize("drv", DRIVERS)
async def test_a_frozen_redis_meets_the_deadline(server: RedisProc, drv: str) -> None:
    """SIGSTOP: the socket accepts bytes but nothing answers. Calls must give up at
    ``timeout_s``, not hang; the tier comes back after SIGCONT."""
    k, data, c = entry(1, 1 << 20)
    async with opened(server.url, driver=drv, timeout_s=0.3) as tier:
        await tier.put(NS, [(k, data, c)])
        server.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RedisTierUnavailable, match="timed out"):
            await tier.get_into(NS, [(k, c, memoryview(bytearray(1 << 20)))])
        elapsed = time.monotonic() - t0
        assert 0.25 < elapsed < 10.0
        assert not tier.up
        await asyncio.sleep(0.5)
        assert not tier.up  # PINGs time out too while it is frozen
        server.signal(signal.SIGCONT)
        await wait_up(tier, 30.0)
        out = bytearray(1 << 20)
        assert await tier.get_into(NS, [(k, c, memoryview(out))]) == [True] and out == data


@pytest.mark.parametrize("drv", DRIVERS)
async def test_down_at_start_is_not_an_error(drv: str) -> None:
    d = tempfile.mkdtemp(prefix="kvr-")
    srv = RedisProc(d)
    try:
        async with opened(srv.url, driver=drv, timeout_s=0.3) as tier:
            assert not tier.up
            with pytest.raises(RedisTierUnavailable):
                await tier.contains(NS, [key(0)])
            srv.start()
            await wait_up(tier, 30.0)
            assert await tier.put(NS, [entry(0, 10)]) == 1
            assert await tier.contains(NS, [key(0)]) == 1
    finally:
        srv.kill()
        shutil.rmtree(d, ignore_errors=True)


async def test_restart_between_calls_costs_no_failed_call(server: RedisProc) -> None:
    """Pooled connections to a Redis that restarted are noticed before use (peek for EOF)."""
    async with opened(server.url) as tier:
        assert await tier.put(NS, [entry(0, 10)]) == 1
        server.kill()
        server.start()
        assert await tier.contains(NS, [key(0)]) == 0
        assert tier.up and tier.stats()["unavailable"] == 0


@pytest.mark.parametrize("drv", DRIVERS)
async def test_error_replies_do_not_mark_the_tier_down(server: RedisProc, drv: str) -> None:
    """A full Redis (maxmemory, noeviction) refuses SETs with OOM: those blocks are not stored
    and count as errors, the rest of the batch is, and the tier stays up."""
    r = server.client()
    size = 256 << 10
    async with opened(server.url, driver=drv, max_bytes_per_namespace=1 << 30) as tier:
        used = int(r.info("memory")["used_memory"])
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", str(used + (1 << 20)))
        stored = await tier.put(NS, [entry(i, size) for i in range(8)])
        assert 1 <= stored < 8
        assert tier.up and tier.stats()["errors"] >= 8 - stored
        assert await tier.contains(NS, [key(i) for i in range(8)]) == stored
        r.config_set("maxmemory", "0")
        # The index is another namespace's string: its commands fail, the blocks still go in.
        index = fmt.index_name(fmt.namespace_prefix("kvs", OTHER_NS))
        r.set(index, b"not a sorted set")
        errors = tier.stats()["errors"]
        assert await tier.put(OTHER_NS, [entry(0, 100, ns=OTHER_NS)]) == 1
        assert tier.up and tier.stats()["errors"] > errors
        out = bytearray(100)
        assert await tier.get_into(OTHER_NS, [(key(0), None, memoryview(out))]) == [True]


@pytest.mark.parametrize("drv", DRIVERS)
async def test_auth_and_db_from_the_url(drv: str) -> None:
    d = tempfile.mkdtemp(prefix="kvr-")
    srv = RedisProc(d, extra=("--requirepass", "s3cret"))
    try:
        srv.start()
        async with opened(f"unix://:s3cret@{srv.sock}?db=3", driver=drv) as tier:
            assert tier.up
            assert await tier.put(NS, [entry(0, 10)]) == 1
            assert "s3cret" not in tier.url
        r = redis_py.Redis(unix_socket_path=srv.sock, password="s3cret", db=3)
        assert r.exists(redis_name(key(0))) == 1
        async with opened(f"unix://:wrong@{srv.sock}", driver=drv, timeout_s=0.2) as tier:
            assert not tier.up  # refused AUTH: down, retrying in the background
            with pytest.raises(RedisTierUnavailable) as info:
                await tier.contains(NS, [key(0)])
            assert "wrong" not in str(info.value)
    finally:
        srv.kill()
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------- capacity
@pytest.mark.parametrize("drv", DRIVERS)
async def test_per_namespace_byte_bound(server: RedisProc, drv: str) -> None:
    size = 10_000
    bound = 10 * (HEADER_BYTES + size) + 5  # room for 10 blocks
    r = server.client()
    async with opened(server.url, driver=drv, max_bytes_per_namespace=bound) as tier:
        await tier.put(OTHER_NS, [entry(i, size, salt=7, ns=OTHER_NS) for i in range(8)])
        for b in range(5):  # 25 blocks in batches of 5
            await tier.put(NS, [entry(i, size) for i in range(5 * b, 5 * b + 5)])
            await asyncio.sleep(0.002)  # distinct microsecond scores across batches
        index = fmt.index_name(fmt.namespace_prefix("kvs", NS))
        held = [n for n in r.scan_iter(match=redis_name(b"", NS) + b"*") if n != index]
        stored = sum(len(r.get(n) or b"") for n in held)
        assert stored <= bound and len(held) == 10
        assert await tier.contains(NS, [key(i) for i in range(15, 25)]) == 10  # the newest
        assert await tier.contains(NS, [key(i) for i in range(15)]) == 0
        assert tier.stats()["evictions"] == 15
        assert await tier.contains(OTHER_NS, [key(i, salt=7) for i in range(8)]) == 8

        # One batch larger than the bound keeps its leading blocks (a prefix's head).
        batch = [entry(i, size, salt=1) for i in range(14)]
        await tier.put(NS, batch)
        assert await tier.contains(NS, [k for k, _, _ in batch]) == 10
        assert await tier.contains(NS, [key(i) for i in range(15, 25)]) == 0


@pytest.mark.parametrize("drv", DRIVERS)
async def test_ttl_expiry(server: RedisProc, drv: str) -> None:
    r = server.client()
    async with opened(server.url, driver=drv, ttl_s=0.8, max_bytes_per_namespace=1 << 20) as tier:
        await tier.put(NS, [entry(i, 100) for i in range(3)])
        assert await tier.contains(NS, [key(i) for i in range(3)]) == 3
        ttl = r.pttl(redis_name(key(0)))
        assert 0 < ttl <= 800
        await asyncio.sleep(1.0)
        assert await tier.contains(NS, [key(i) for i in range(3)]) == 0
        out = bytearray(100)
        assert await tier.get_into(NS, [(key(0), None, memoryview(out))]) == [False]
        # The age index expires with its blocks, and a later put drops stale entries.
        index = fmt.index_name(fmt.namespace_prefix("kvs", NS))
        assert r.exists(index) == 0
        await tier.put(NS, [entry(5, 100)])
        assert r.zcard(index) == 1


# ---------------------------------------------------------------------------- cluster
def _free_port() -> int:
    """A port p with p and p + 10000 (the cluster bus) both free on 127.0.0.1."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


def _pong(client: Any) -> bool:
    try:
        return bool(client.ping())
    except redis_py.ConnectionError:
        return False


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[int]]:
    d = tempfile.mkdtemp(prefix="kvrc-")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports: list[int] = []
        for n in range(3):
            port = _free_port()
            node = os.path.join(d, str(n))
            os.mkdir(node)
            procs.append(
                subprocess.Popen(
                    [
                        *(REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1"),
                        *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
                        *("--cluster-node-timeout", "2000", "--save", "", "--appendonly", "no"),
                        *("--dir", node),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
            ports.append(port)
        # Formed with redis-py, as ``redis-cli --cluster create --cluster-replicas 0`` does it
        # (the dev extra's server ships no redis-cli): each node takes a third of the 16384
        # slots, node 0 meets the others, and every node must report cluster_state:ok.
        nodes = [redis_py.Redis(host="127.0.0.1", port=p, socket_timeout=5) for p in ports]
        deadline = time.monotonic() + 10
        for node_client, proc in zip(nodes, procs, strict=True):
            while not _pong(node_client):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"cluster node did not start (exit {proc.poll()})")
                time.sleep(0.05)
        bounds = [0, 5461, 10923, 16384]
        for i, node_client in enumerate(nodes):
            node_client.execute_command("CLUSTER", "ADDSLOTSRANGE", bounds[i], bounds[i + 1] - 1)
        for port in ports[1:]:
            nodes[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        deadline = time.monotonic() + 20
        while not all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") for c in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        for c in nodes:
            c.close()
        yield ports
    finally:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(d, ignore_errors=True)


async def test_cluster_spreads_a_namespace_over_nodes(cluster: list[int]) -> None:
    url = f"redis+cluster://127.0.0.1:{cluster[0]}"
    size = 8192
    blocks = [entry(i, size, salt=42) for i in range(48)]
    bound = 40 * (HEADER_BYTES + size)
    async with opened(url, max_bytes_per_namespace=bound) as tier:
        assert tier.up and tier.driver == "redis-py-cluster"
        assert await tier.put(NS, blocks) == 48  # the last 8 are over the bound: evicted
        keys = [k for k, _, _ in blocks]
        assert await tier.contains(NS, keys) == 40
        outs = [bytearray(size) for _ in range(40)]
        kept = blocks[:40]
        items = [(k, c, memoryview(o)) for (k, _, c), o in zip(kept, outs, strict=True)]
        assert await tier.get_into(NS, items) == [True] * 40
        assert all(o == d for (_, d, _), o in zip(kept, outs, strict=True))
        items = [(k, None, memoryview(o)) for (k, _, _), o in zip(kept, outs, strict=True)]
        sums = [block_checksum(d, NS, k) for k, d, _ in kept]
        assert await tier.get_into_checked(NS, items) == sums
        assert tier.stats()["evictions"] == 8
        # Every node holds some of the namespace's blocks: no hash tag pinned them to a slot.
        counts = [redis_py.Redis(port=p).dbsize() for p in cluster]
        assert all(c > 0 for c in counts), counts
        # Leading-run semantics across slots: a gap stops the run.
        assert await tier.delete(NS, [keys[17]]) == 1
        assert await tier.contains(NS, keys) == 17
        await tier.delete(NS, keys)
        assert await tier.contains(NS, keys) == 0


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "rediss://u:pw1@h:6379/0?ssl_password=pw2&password=pw3&ssl_ca_certs=/c.crt",
            "rediss://u:***@h:6379/0?ssl_password=***&password=***&ssl_ca_certs=/c.crt",
        ),
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("unix:///tmp/r.sock?db=1", "unix:///tmp/r.sock?db=1"),
        ("redis://h:6379", "redis://h:6379"),
    ],
)
def test_urls_in_logs_and_stats_never_carry_a_password(url: str, shown: str) -> None:
    from kvstore.tiers.redis_tier.tier import _redacted

    assert _redacted(url) == shown


# ---------------------------------------------------------------------------- codecs
def kv_value(i: int) -> tuple[bytes, bytes, int]:
    """A bf16 KV-like block of shape CODEC_FMT (half its head dims zero: lz4 has work), its key
    and checksum."""
    g = torch.Generator().manual_seed(i)
    x = torch.randn(CODEC_FMT.shape, generator=g) * torch.logspace(-2, 1, 2 * 2 * 3).view(
        2, 2, 1, 3, 1
    )
    x[..., 32:] = 0
    data = x.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    return key(i), data, block_checksum(data, NS, key(i))


CODEC_FMT = BlockFormat("bfloat16", (2, 2, 16, 3, 64))


@pytest.mark.parametrize("drv", DRIVERS)
async def test_values_of_every_codec_are_read_whatever_the_writer_is_configured_with(
    server: RedisProc, drv: str
) -> None:
    written = {}
    async with opened(server.url, driver=drv) as tier:
        for i, name in enumerate(("none", "lz4", "fp8", "fp8+lz4")):
            k, data, c = kv_value(i)
            assert await tier.put(
                NS, [(k, data, c)], codec=codecs.NAMES[name], block_format=CODEC_FMT
            )
            written[k] = (name, data, c)
        s = tier.stats()
        assert s["bytes_written"] < s["logical_bytes_written"]  # what Redis holds is smaller
    raw = server.client()
    for k, (name, data, _) in written.items():
        value = raw.get(redis_name(k))
        assert value[5] == codecs.NAMES[name]  # the value names the codec that wrote it
        if name.startswith("fp8"):
            assert len(value) < HEADER_BYTES + len(data) // 2 + 1024
    async with opened(server.url, driver=drv) as reader:  # a reader with no codec configured
        for k, (name, data, c) in written.items():
            out = bytearray(len(data))
            (got,) = await reader.get_into_checked(NS, [(k, None, memoryview(out))])
            assert got is not None and got == block_checksum(out, NS, k)
            if name in ("none", "lz4"):
                assert bytes(out) == data and got == c
            else:  # the deterministic decoded form, whose checksum the writer stated
                assert bytes(out) == codecs.round_trip(CODEC_FP8, memoryview(data), CODEC_FMT)
        assert reader.stats()["checksum_failures"] == 0


@pytest.mark.parametrize("drv", DRIVERS)
async def test_a_lossless_reader_finds_and_reads_no_lossy_value(
    server: RedisProc, drv: str
) -> None:
    """A reader of a namespace its host keeps lossless: a value a lossy codec wrote is absent
    to ``contains`` and a miss to ``get_into_checked`` alike (its lookups said found while
    every get missed); a lossy reader finds and reads every value."""
    values = [kv_value(i) for i in range(4)]
    async with opened(server.url, driver=drv) as tier:
        for (k, data, c), name in zip(values, ("none", "lz4", "fp8", "none"), strict=True):
            assert await tier.put(
                NS, [(k, data, c)], codec=codecs.NAMES[name], block_format=CODEC_FMT
            )
        keys = [k for k, _, _ in values]
        assert await tier.contains(NS, keys) == 4
        assert await tier.contains(NS, keys, lossy=False) == 2  # the fp8 value ends the run
        assert await tier.contains(NS, keys[3:], lossy=False) == 1
        assert await tier.contains(NS, [key(99)], lossy=False) == 0  # absent
        k, data, _ = values[2]
        out = bytearray(len(data))
        assert await tier.get_into_checked(NS, [(k, None, memoryview(out))], lossy=False) == [None]
        assert tier.stats()["lossy_refused"] == 1 and tier.stats()["checksum_failures"] == 0
        (got,) = await tier.get_into_checked(NS, [(k, None, memoryview(out))])
        assert got is not None


async def test_a_read_given_up_while_its_value_decodes_never_writes_the_buffer_afterwards(
    server: RedisProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The daemon fetches into CPU-tier slots and frees them at once when the fetch is cancelled
    # (its caller's deadline, its client gone); the decoding thread ran on and wrote into the
    # freed slot, destroying the block put there next. Held in the decode until the read is
    # cancelled and the buffer holds "the next block", the thread must leave it alone.
    entered, go, finished = threading.Event(), threading.Event(), threading.Event()
    real_decode = codecs.decode

    def held_decode(*args: Any) -> bool:
        entered.set()
        go.wait(30)
        try:
            return real_decode(*args)
        finally:
            finished.set()

    async with opened(server.url) as tier:
        k, data, c = kv_value(3)
        assert await tier.put(NS, [(k, data, c)], codec=codecs.NAMES["lz4"], block_format=CODEC_FMT)
        monkeypatch.setattr(codecs, "decode", held_decode)
        slot = bytearray(len(data))
        read = asyncio.ensure_future(tier.get_into_checked(NS, [(k, None, memoryview(slot))]))
        assert await asyncio.to_thread(entered.wait, 30), "the decode never started"
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        slot[:] = b"N" * len(slot)  # the slot, freed, holds the next block now
        go.set()
        assert await asyncio.to_thread(finished.wait, 30)
        await asyncio.sleep(0)
        assert bytes(slot) == b"N" * len(slot), "the abandoned decode overwrote the buffer"
        monkeypatch.setattr(codecs, "decode", real_decode)
        out = bytearray(len(data))  # and a read that is not given up still gets the block
        assert await tier.get_into_checked(NS, [(k, None, memoryview(out))]) == [c]
        assert bytes(out) == data


@pytest.mark.parametrize("drv", DRIVERS)
async def test_a_corrupt_encoded_value_is_a_miss(server: RedisProc, drv: str) -> None:
    async with opened(server.url, driver=drv) as tier:
        items = [kv_value(i) for i in range(3)]
        for (k, data, c), name in zip(items, ("lz4", "fp8", "fp8+lz4"), strict=True):
            await tier.put(NS, [(k, data, c)], codec=codecs.NAMES[name], block_format=CODEC_FMT)
        raw = server.client()
        for k, data, _ in items:
            value = bytearray(raw.get(redis_name(k)))
            value[HEADER_BYTES + 700] ^= 0x08  # inside the payload; the header is intact
            raw.set(redis_name(k), bytes(value))
            out = bytearray(len(data))
            assert await tier.get_into_checked(NS, [(k, None, memoryview(out))]) == [None]
        assert tier.stats()["checksum_failures"] == 3


@pytest.mark.parametrize("drv", DRIVERS)
async def test_version_2_values_are_still_read(server: RedisProc, drv: str) -> None:
    k, data, c = kv_value(7)
    raw = server.client()
    raw.set(redis_name(k), fmt.pack_header_v2(k, NS, len(data), c) + data)
    async with opened(server.url, driver=drv) as tier:
        out = bytearray(len(data))
        assert await tier.get_into_checked(NS, [(k, c, memoryview(out))]) == [c]
        assert bytes(out) == data
        # A version 2 header re-stamped to claim another codec is refused.
        bad = bytearray(fmt.pack_header_v2(k, NS, len(data), c))
        bad[5] = codecs.CODEC_LZ4
        raw.set(redis_name(k), bytes(bad) + data)
        assert await tier.get_into_checked(NS, [(k, None, memoryview(out))]) == [None]
