"""``RedisTier``: the Redis shared tier's mechanism as the daemon drives it (see the class)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.exceptions

from kvstore.checksum import block_checksum
from kvstore.errors import KVStoreError
from kvstore.tiers import codecs
from kvstore.tiers.codecs import CODEC_NONE, BlockFormat
from kvstore.tiers.redis_tier import value as fmt
from kvstore.tiers.redis_tier.drivers import Driver, make_driver
from kvstore.tiers.redis_tier.resp import Command

log = logging.getLogger(__name__)

T = TypeVar("T")

BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 1.0
"""Reconnection attempts: 50 ms, doubling, at most 1 s apart (with +-25% jitter so that the
daemons of many hosts do not knock on a restarted Redis in step)."""

_UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    EOFError,
    redis.exceptions.RedisError,
    redis.exceptions.RedisClusterException,
)
"""Failures that mean Redis cannot serve now: connection refused/reset/closed, a timeout (both
the builtin TimeoutError and redis-py's), LOADING, cluster down. A bad argument (ValueError,
TypeError) is the caller's bug and propagates as itself."""


class RedisTierUnavailable(KVStoreError):
    """Redis is down, slow past the deadline, or restarting; the tier is reconnecting."""


class RedisTier:
    """The bytes of the shared Redis tier: blocks of many hosts in one Redis or Redis Cluster.

    Owns its connections to Redis, the value format (``value``: a 96-byte header naming key,
    namespace fingerprint or MAC, codec, lengths and checksums, then the payload), the
    per-namespace capacity bound and the up/down state. It keeps no index: other hosts write
    this Redis, so the daemon asks in batches. It knows nothing of eviction policy beyond the
    bound below.

    URLs: ``redis://[[user]:password@]host[:port][/db]``, ``unix://[[user]:password@]/path
    [?db=N]``, ``rediss://...`` (TLS), and Redis Cluster as ``redis+cluster://host:port`` or
    ``rediss+cluster://host:port`` (any one node; the rest are discovered). ``driver``:
    ``"auto"`` uses the tier's own RESP client for redis:// and unix:// (payloads go from and to
    the caller's buffers with no copy in Python) and redis-py for TLS and Cluster (one copy per
    value each way); ``"redis-py"`` forces redis-py everywhere.

    Names in Redis: block ``<key_prefix>:<namespace hex>:<key hex>`` (no hash tag, so in a
    cluster the blocks of one namespace spread over every slot); the namespace's age index (a
    sorted set, only when bounded) ``<key_prefix>:<namespace hex>:age``.

    Concurrency contract. Every method is called on the daemon's event loop thread; ``up`` and
    ``stats`` are sync and O(1); the rest are coroutines, each one batch in one round trip (per
    node) unless stated, and any number may run at once (each takes its own connection, at most
    ``max_connections``; more wait within their deadline). Each call finishes within
    ``timeout_s`` (connecting and waiting for a connection included) or raises
    ``RedisTierUnavailable``; it never hangs. A call that fails to reach Redis or times out
    marks the tier down: ``up`` turns False, every call raises ``RedisTierUnavailable`` at once
    (no round trip), and a background task PINGs Redis with exponential backoff (50 ms to 1 s)
    on fresh connections; ``up`` is True again after the first PING that succeeds. A Redis
    that is down at ``start`` is not an error. Error replies to single commands (e.g. OOM under
    ``maxmemory`` with ``noeviction``) do not mark the tier down: they count in ``errors`` and
    read as "absent" / "not stored". A cancelled call closes the connection it was using. In a
    cluster, ``up`` means every node answered PING, and a batch that meets a failed node fails
    as a whole. A batch must fit its deadline: at the default 0.5 s, 128 blocks of 2 MiB take
    ~75 ms (get) and ~175 ms (put) on the RESP path here, but ~0.15 s and ~0.7 s through
    redis-py (TLS, Cluster): split larger batches or raise ``timeout_s``.

    Blocks are immutable: ``put`` is SET NX (a present key keeps its bytes) and verifies each
    block against its checksum before sending it (``ValueError`` on a mismatch, nothing sent).
    ``get_into`` verifies the header (key, namespace, length, codec, its own checksum; the
    caller's checksum when given) and the payload's xxh3-64; a missing value is a miss, a
    present but wrong one (other length, any changed byte) a miss counted in
    ``checksum_failures``. It returns True only for verified bytes. ``get_into_checked`` is the
    same read returning, for verified bytes, the checksum they matched (None for a miss): the
    xxh3-64 of the raw block, i.e. ``block_checksum`` of ``out`` (codec none is the only one
    read), so the caller keeps it without hashing the block again. Both write payloads straight
    into ``out``, so after a miss, a raise or a cancellation ``out`` holds unspecified bytes;
    nothing is written to it after the call ends.

    Keyed values. With ``mac_secret`` every value written carries a keyed MAC and a read
    verifies it before trusting anything else of the value: a value without one (written by a
    host without the secret, or forged by anyone with kvstore's public code) or with a wrong one
    is a miss counted in ``mac_failures``; without it only unkeyed values are read. The class
    leaves the secret optional; the daemon refuses a Redis tier without one unless its operator
    sets ``redis.allow_unkeyed`` (``kvstore.daemon.shared``).

    Capacity. ``ttl_s``: every SET carries an expiry (PX); reads do not refresh it.
    ``max_bytes_per_namespace``: a bound on the value bytes (header + block) of each namespace,
    kept with the age index: a put adds its keys (ZADD NX, scored by time in microseconds, the
    first block of a batch newest so a prefix's head outlives its tail), reads the count in the
    same round trip and, when over, pops the oldest (ZPOPMIN) and deletes them (a second and
    third round trip, within the same deadline). The bound assumes one block size per
    namespace (true of kvstore namespaces) and the same settings on every host. Keys the index
    does not know (a put cut off between SET and ZADD) are bounded only by ``ttl_s`` and Redis's
    own limit: run Redis with ``maxmemory`` and ``maxmemory-policy allkeys-lru`` as the global
    bound; the per-namespace bound keeps one model or tenant from taking all of it.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 0.5,
        ttl_s: float | None = None,
        max_bytes_per_namespace: int | None = None,
        key_prefix: str = "kvs",
        driver: str = "auto",
        max_connections: int = 8,
        mac_secret: bytes | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if ttl_s is not None and not ttl_s >= 0.001:
            raise ValueError(f"ttl_s must be at least 1 ms, got {ttl_s}")
        if max_bytes_per_namespace is not None and max_bytes_per_namespace <= 0:
            raise ValueError(f"max_bytes_per_namespace must be positive: {max_bytes_per_namespace}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be positive, got {max_connections}")
        self.url = _redacted(url)  # for logs and stats pages: never the password
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self.max_bytes_per_namespace = max_bytes_per_namespace
        self.key_prefix = fmt.check_key_prefix(key_prefix)
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        # With a shared secret every value written is keyed and only keyed values verified
        # with it are read (``value``): Redis writers without it cannot forge a block.
        self._mac_key = fmt.mac_key(mac_secret) if mac_secret is not None else None
        self._driver: Driver = make_driver(
            url, driver=driver, timeout_s=timeout_s, max_connections=max_connections
        )
        self.driver = self._driver.name
        self._up = False
        self._state = "new"
        self._reconnect_task: asyncio.Task[None] | None = None
        self._by_ns: dict[bytes, list[int]] = {}  # namespace -> [blocks, logical, stored] put
        self._counters = dict.fromkeys(
            (
                "hits",
                "misses",
                "puts",
                "bytes_written",
                "logical_bytes_written",
                "bytes_read",
                "checksum_failures",
                "mac_failures",
                "lossy_refused",
                "errors",
                "reconnects",
                "evictions",
                "deletes",
                "unavailable",
            ),
            0,
        )

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        """Connect and PING. If Redis does not answer, ``up`` stays False and the tier keeps
        trying in the background."""
        if self._state != "new":
            raise RuntimeError(f"start of a tier that is {self._state}")
        self._state = "open"
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._driver.ping()
        except _UNAVAILABLE as exc:
            log.warning(
                "redis tier %s not reachable at start (%s); retrying",
                self.url,
                str(exc) or type(exc).__name__,  # a timeout has no message of its own
            )
            self._start_reconnecting()
            return
        self._up = True

    async def close(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        self._up = False
        task, self._reconnect_task = self._reconnect_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        # Closing sockets does not wait on Redis, but redis-py's close is a coroutine: bound it.
        with contextlib.suppress(TimeoutError, *_UNAVAILABLE):
            async with asyncio.timeout(self.timeout_s):
                await self._driver.close()

    @property
    def up(self) -> bool:
        return self._up

    def stats(self) -> dict[str, Any]:
        return {"up": self._up, **self._counters}

    def namespace_bytes(self) -> dict[bytes, tuple[int, int, int]]:
        """(blocks, logical bytes, stored bytes) this tier object has written, by namespace:
        Redis is shared and evicts by itself, so this is what this host put, not what Redis
        holds now."""
        return {ns: (b, raw, stored) for ns, (b, raw, stored) in self._by_ns.items()}

    # ------------------------------------------------------------------ up / down
    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        if not self._up:
            self._counters["unavailable"] += 1
            state = {"new": "not started", "closed": "closed"}.get(self._state, "down")
            raise RedisTierUnavailable(f"redis tier {self.url} is {state}")
        try:
            async with asyncio.timeout(self.timeout_s):
                return await fn()
        except _UNAVAILABLE as exc:
            self._counters["errors"] += 1
            self._counters["unavailable"] += 1
            what = "timed out" if isinstance(exc, TimeoutError) else f"failed: {exc!r}"
            self._mark_down(what)
            raise RedisTierUnavailable(f"redis tier {self.url}: call {what}") from exc

    def _check_replies(self, replies: list[Any]) -> None:
        # LOADING (a restarted Redis reading its data) or a cluster node down, answered per
        # command: Redis is not serving, so the batch fails as a whole.
        for reply in replies:
            if isinstance(reply, redis.exceptions.ConnectionError | redis.exceptions.ClusterError):
                raise reply

    def _mark_down(self, why: str) -> None:
        if self._up:
            log.warning("redis tier %s down (%s); reconnecting", self.url, why)
        self._up = False
        self._start_reconnecting()

    def _start_reconnecting(self) -> None:
        if self._state == "open" and (self._reconnect_task is None or self._reconnect_task.done()):
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        delay = BACKOFF_FIRST_S
        while self._state == "open":
            await asyncio.sleep(delay * random.uniform(0.75, 1.25))
            delay = min(delay * 2, BACKOFF_MAX_S)
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._driver.reset()
                    await self._driver.ping()
            except _UNAVAILABLE as exc:
                log.debug("redis tier %s: reconnect failed: %r", self.url, exc)
                continue
            self._up = True
            self._counters["reconnects"] += 1
            log.warning("redis tier %s is up again", self.url)
            return

    # ------------------------------------------------------------------ calls
    async def contains(self, namespace: bytes, keys: Sequence[bytes], lossy: bool = True) -> int:
        """How many leading keys are present (one command each, one round trip), as far as
        their values' codec and flags bytes tell (two bytes a key): a value this tier would
        refuse on sight counts as absent, as ``get_into_checked`` reads it. Those are values
        keyed when this tier is not, unkeyed ones when it is (a host without the secret, or
        anyone forging a value with kvstore's public code), and with ``lossy`` False the ones a
        lossy codec wrote. A key with an error reply ends the run, as an absent one does. Only a
        read checks the rest: a keyed-looking forgery or a damaged value counts here and
        misses there."""
        prefix = fmt.namespace_prefix(self.key_prefix, fmt.check_namespace(namespace))
        names = [fmt.block_name(prefix, fmt.check_key(k)) for k in keys]
        if not names:
            return 0
        at = fmt.CODEC_OFFSET  # the codec byte, then the low byte of the flags
        cmds: list[Command] = [("GETRANGE", n, at, at + 1) for n in names]
        replies = await self._call(lambda: self._run(cmds))
        keyed = self._mac_key is not None
        found = 0
        for reply in replies:
            if isinstance(reply, Exception):
                self._counters["errors"] += 1
            if not isinstance(reply, bytes | bytearray) or len(reply) != 2:
                break  # absent (an empty reply), an error, or too short to be a value
            codec, flags = reply[0], reply[1]
            if (not lossy and codec in codecs.LOSSY) or bool(flags & fmt.KEYED) != keyed:
                break
            found += 1
        return found

    async def put(
        self,
        namespace: bytes,
        blocks: Sequence[tuple[bytes, Any, int]],
        *,
        codec: int = CODEC_NONE,
        block_format: BlockFormat | None = None,
        max_bytes: int | None = None,
    ) -> int:
        """Store ``(key, block bytes, bound checksum)`` blocks; returns how many were newly
        stored (a present key is left as it is; a batch larger than the namespace's bound counts
        the tail blocks it stored and at once evicted). Raises ValueError, before sending
        anything, if a block does not match its checksum. ``codec`` encodes the values (in a
        thread, off the event loop); a lossy one applies only with the blocks' ``block_format``
        (``codecs.plan``). The blocks must not change until it returns. ``max_bytes``: this
        namespace's bound instead of ``max_bytes_per_namespace`` (a tenant's per-namespace
        quota)."""
        bound = self.max_bytes_per_namespace if max_bytes is None else max_bytes
        prefix = fmt.namespace_prefix(self.key_prefix, fmt.check_namespace(namespace))
        cmds: list[Command] = []
        keys: list[bytes] = []
        sizes: list[int] = []
        views = []
        for key, data, checksum in blocks:
            fmt.check_key(key)
            view = _flat(data, writable=False)
            if block_checksum(view, namespace, key) != checksum:
                self._counters["checksum_failures"] += 1
                raise ValueError(f"block {key.hex()} does not match its checksum")
            views.append((key, view, checksum))
        planned = [codecs.plan(codec, block_format, len(v))[0] for _, v, _ in views]
        if self._mac_key is not None or any(p != CODEC_NONE for p in planned):
            values = await asyncio.to_thread(
                _encode_values, namespace, views, planned, block_format, self._mac_key
            )
        else:
            values = [[fmt.pack_header(k, namespace, len(v), c), v] for k, v, c in views]
        for (key, _, _), value in zip(views, values, strict=True):
            cmd: Command = ("SET", fmt.block_name(prefix, key), value, "NX")
            cmds.append(cmd if self._ttl_ms is None else (*cmd, "PX", self._ttl_ms))
            keys.append(key)
            sizes.append(sum(len(part) for part in value))
        logical = [len(view) for _, view, _ in views]
        if not cmds:
            return 0
        n_sets = len(cmds)
        index = fmt.index_name(prefix)
        if bound is not None:
            now_us = time.time_ns() // 1000
            if self._ttl_ms is not None:
                # Entries older than the TTL name expired blocks: drop them so they are not
                # counted against the bound.
                cutoff = now_us - self._ttl_ms * 1000
                cmds.append(("ZREMRANGEBYSCORE", index, "-inf", f"({cutoff}"))
            pairs: list[Any] = []
            for i, key in enumerate(keys):
                pairs += [now_us - i, key]
            cmds.append(("ZADD", index, "NX", *pairs))
            cmds.append(("ZCARD", index))
            if self._ttl_ms is not None:
                cmds.append(("PEXPIRE", index, self._ttl_ms))

        async def run() -> list[Any]:
            replies = await self._run(cmds)
            if bound is not None:
                count_at = n_sets + (2 if self._ttl_ms is not None else 1)
                await self._enforce_bound(prefix, index, replies[count_at], max(sizes), bound)
            return replies

        replies = await self._call(run)
        stored = written = raw = 0
        for size, n, reply in zip(sizes, logical, replies[:n_sets], strict=True):
            if isinstance(reply, Exception):
                self._counters["errors"] += 1
            elif reply is not None and reply is not False:
                stored += 1
                written += size
                raw += n
        if stored:
            per = self._by_ns.setdefault(namespace, [0, 0, 0])
            per[0] += stored
            per[1] += raw
            per[2] += written
        self._counters["puts"] += stored
        self._counters["bytes_written"] += written
        self._counters["logical_bytes_written"] += raw
        return stored

    async def _enforce_bound(
        self, prefix: bytes, index: bytes, count: Any, block: int, bound: int
    ) -> None:
        if not isinstance(count, int):
            if isinstance(count, Exception):
                self._counters["errors"] += 1
            return
        excess = count - bound // block
        if excess <= 0:
            return
        (popped,) = await self._run([("ZPOPMIN", index, excess)])
        members = _zpop_members(popped)
        if members:
            await self._run([("DEL", fmt.block_name(prefix, m)) for m in members])
            self._counters["evictions"] += len(members)

    async def get_into(
        self, namespace: bytes, items: Sequence[tuple[bytes, int | None, Any]]
    ) -> list[bool]:
        """Read ``(key, expected checksum, out)`` items, ``out`` a writable buffer of the
        block's length; True where ``out`` now holds the verified block. ``expected`` None
        trusts the checksum in the value's header (still verified against the payload): for
        blocks another host wrote, whose checksum this host has not seen."""
        return [c is not None for c in await self.get_into_checked(namespace, items)]

    async def get_into_checked(
        self,
        namespace: bytes,
        items: Sequence[tuple[bytes, int | None, Any]],
        lossy: bool = True,
    ) -> list[int | None]:
        """``get_into``, returning for each item the checksum that ``out``'s bytes were verified
        against (``block_checksum(out, namespace, key)``), or None for a miss. Test ``is None``: a
        checksum may be 0. ``lossy`` False: a value a lossy codec wrote is a miss (counted in
        ``lossy_refused``), for a namespace this host keeps lossless."""
        prefix = fmt.namespace_prefix(self.key_prefix, fmt.check_namespace(namespace))
        names, outs = [], []
        for key, _, out in items:
            names.append(fmt.block_name(prefix, fmt.check_key(key)))
            outs.append(_flat(out, writable=True))
        if not names:
            return []
        heads_buf = bytearray(fmt.HEADER_BYTES * len(names))
        heads = [
            memoryview(heads_buf)[i * fmt.HEADER_BYTES : (i + 1) * fmt.HEADER_BYTES]
            for i in range(len(names))
        ]

        async def run() -> list[Any]:
            results = await self._driver.get_into(names, heads, outs)
            self._check_replies(results)
            return results

        results = list(await self._call(run))
        stated: list[fmt.ValueHeader | None] = []
        decode: list[tuple[int, fmt.ValueHeader]] = []
        for i, ((key, expected, _), head, out, result) in enumerate(
            zip(items, heads, outs, results, strict=True)
        ):
            h = None
            if type(result) is int:  # the value's length
                h = fmt.parse_header(
                    head, key, namespace, len(out), expected, self._mac_key is not None
                )
                if h is None and self._mac_key is not None and not fmt.is_keyed(head):
                    self._counters["mac_failures"] += 1  # a value without a MAC
                if h is not None and result != h.header_bytes + h.stored_length:
                    h = None
                if h is not None and not lossy and h.codec in codecs.LOSSY:
                    self._counters["lossy_refused"] += 1
                    h = None
                    results[i] = None  # a miss, not a failed verification
                if h is not None and (h.codec != CODEC_NONE or h.header_bytes != len(head)):
                    decode.append((i, h))
            stated.append(h)
        if self._mac_key is not None:  # before anything else of a value is trusted
            keyed = [(i, h) for i, h in enumerate(stated) if h is not None]
            macs = await asyncio.to_thread(
                _check_macs, self._mac_key, namespace, heads, outs, keyed
            )
            for (i, _), ok in zip(keyed, macs, strict=True):
                if not ok:
                    stated[i] = None
                    self._counters["mac_failures"] += 1
            decode = [(i, h) for i, h in decode if stated[i] is not None]
        if decode:  # payloads that are not the block itself: decoded off the event loop
            # Into private buffers, copied into ``outs`` here on the loop: a caller that gives up
            # (cancelled: its deadline, its client gone) frees its buffers (CPU-tier slots) at
            # once, while the decoding thread runs on; writing ``outs`` there, it overwrote the
            # block put in a freed slot next.
            blocks = await asyncio.to_thread(_decode_values, namespace, items, heads, outs, decode)
            for (i, _), decoded in zip(decode, blocks, strict=True):
                if decoded is None:
                    stated[i] = None
                else:
                    outs[i][:] = decoded
        sums: list[int | None] = []
        for (key, _, _), out, result, h in zip(items, outs, results, stated, strict=True):
            verified = None
            if h is not None and block_checksum(out, namespace, key) == h.checksum:
                verified = h.checksum
            if verified is not None:
                self._counters["hits"] += 1
                self._counters["bytes_read"] += len(out)
            else:
                self._counters["misses"] += 1
                if isinstance(result, Exception):
                    self._counters["errors"] += 1
                elif result is not None:  # False: a value of a length no header can state
                    self._counters["checksum_failures"] += 1
                    log.warning("redis tier: block %s failed verification (a miss)", key.hex())
            sums.append(verified)
        return sums

    async def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """Delete blocks (and their age-index entries); returns how many were present."""
        prefix = fmt.namespace_prefix(self.key_prefix, fmt.check_namespace(namespace))
        keys = [fmt.check_key(k) for k in keys]
        if not keys:
            return 0
        # Always ZREM: another host may bound this namespace even if this one does not.
        cmds: list[Command] = [("DEL", fmt.block_name(prefix, k)) for k in keys]
        cmds.append(("ZREM", fmt.index_name(prefix), *keys))
        replies = await self._call(lambda: self._run(cmds))
        deleted = sum(1 for r in replies[: len(keys)] if r == 1)
        self._counters["errors"] += sum(isinstance(r, Exception) for r in replies)
        self._counters["deletes"] += deleted
        return deleted

    async def _run(self, cmds: list[Command]) -> list[Any]:
        replies = await self._driver.run(cmds)
        self._check_replies(replies)
        return replies


_SECRET_QUERY_KEYS = ("password", "ssl_password")


def _redacted(url: str) -> str:
    """The URL without its passwords (``user:password@`` and ``?password=`` /
    ``?ssl_password=``, which redis-py also reads), for logs and messages."""
    base, sep, query = url.partition("?")
    parts = urlsplit(base)
    if parts.password is not None:
        user = parts.username or ""
        host = parts.netloc.rsplit("@", 1)[1]
        base = urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(k.lower() in _SECRET_QUERY_KEYS for k, _ in pairs):
        query = urlencode(
            [(k, "***" if k.lower() in _SECRET_QUERY_KEYS else v) for k, v in pairs], safe="*/:"
        )
    return base + sep + query


def _encode_values(
    namespace: bytes,
    views: list[tuple[bytes, memoryview, int]],
    planned: list[int],
    block_format: BlockFormat | None,
    mac_key: bytes | None = None,
) -> list[list[Any]]:
    """Each block's value parts, [header, payload], encoded with its planned codec (on a
    thread). A lossy payload is decoded once here, so its header states the checksum of the
    block a read will yield. ``mac_key``: keyed values (``value``)."""
    out: list[list[Any]] = []
    for (key, view, checksum), codec in zip(views, planned, strict=True):
        raw = (mac_key, view) if mac_key is not None else None
        if codec == CODEC_NONE:
            out.append([fmt.pack_header(key, namespace, len(view), checksum, keyed=raw), view])
            continue
        scratch = memoryview(bytearray(codecs.scratch_bytes(len(view))))
        used, payload = codecs.encode(codec, view, block_format, scratch)
        if used == CODEC_NONE:
            out.append([fmt.pack_header(key, namespace, len(view), checksum, keyed=raw), view])
            continue
        decoded = checksum
        if used in codecs.LOSSY:
            assert block_format is not None
            frame = scratch[: codecs.fp8_payload_bytes(block_format)]
            back = memoryview(bytearray(len(view)))
            if not codecs.fp8_decode(frame, back):
                raise AssertionError("a fresh fp8 payload failed to decode")
            decoded = block_checksum(back, namespace, key)
        data = bytes(payload)
        stored = block_checksum(data, namespace, key)
        keyed = (mac_key, data) if mac_key is not None else None
        head = fmt.pack_header(key, namespace, len(view), decoded, used, len(data), stored, keyed)
        out.append([head, data])
    return out


def _check_macs(
    mac_key: bytes,
    namespace: bytes,
    heads: list[memoryview],
    outs: list[memoryview],
    todo: list[tuple[int, fmt.ValueHeader]],
) -> list[bool]:
    """Whether each keyed value's MAC is right (on a thread). A keyed value has a full-size
    header, so its payload is the head of ``outs[i]``."""
    return [
        hmac.compare_digest(
            h.mac, fmt.mac(mac_key, namespace, heads[i], outs[i][: h.stored_length])
        )
        for i, h in todo
    ]


def _decode_values(
    namespace: bytes,
    items: Sequence[tuple[bytes, int | None, Any]],
    heads: list[memoryview],
    outs: list[memoryview],
    todo: list[tuple[int, fmt.ValueHeader]],
) -> list[bytearray | None]:
    """Turn values whose payload is not the block itself into blocks (on a thread): the block
    of each, in memory of its own (never ``outs``, which the caller may free meanwhile), or
    None where the payload fails its checksum or does not decode. The payload arrived at the
    tail of ``heads[i]`` and the head of ``outs[i]``, and is copied out first; it is checked
    against its checksum, then decoded. A version 2 value (an 80-byte header) is the raw block
    shifted by 16 bytes."""
    blocks: list[bytearray | None] = []
    for i, h in todo:
        head, out, key = heads[i], outs[i], items[i][0]
        spill = len(head) - h.header_bytes  # payload bytes that landed in ``head``
        payload = bytes(head[h.header_bytes :]) + bytes(out[: h.stored_length - spill])
        if h.codec == CODEC_NONE:
            blocks.append(bytearray(payload))
            continue
        if block_checksum(payload, namespace, key) != h.stored_checksum:
            blocks.append(None)
            continue
        block = bytearray(len(out))
        scratch = memoryview(bytearray(codecs.scratch_bytes(len(out))))
        ok = codecs.decode(h.codec, memoryview(payload), memoryview(block), scratch)
        blocks.append(block if ok else None)
    return blocks


def _flat(buf: Any, *, writable: bool) -> memoryview:
    view = memoryview(buf)
    if writable and view.readonly:
        raise ValueError("out buffers must be writable")
    if not view.c_contiguous:
        raise ValueError("block buffers must be C-contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if not len(view):
        raise ValueError("blocks must not be empty")
    return view


def _zpop_members(reply: Any) -> list[bytes]:
    """Members of a ZPOPMIN reply: a flat [member, score, ...] (RESP2) or [[member, score],
    ...] (redis-py's RESP3 / callbacks)."""
    if not isinstance(reply, list) or not reply:
        return []
    if isinstance(reply[0], list | tuple):
        return [bytes(pair[0]) for pair in reply]
    return [bytes(m) for m in reply[0::2]]
