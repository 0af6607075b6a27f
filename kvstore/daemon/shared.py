"""The daemon's side of the shared Redis tier: lookups past the local run, fetches into the CPU
tier, write-through and demotion to Redis.

Redis is shared by every host's daemon, so this host does not index it: ``contains`` asks it,
in one batched call, only for the keys after the local leading run. A fetched block becomes an
ordinary local block (CPU tier, then NVMe by write-back), so the next read is local.

``SharedTier`` owns the ``RedisTier`` object and the write-through queue. Every Redis call has a
deadline; when Redis is down, slow or restarting the tier is skipped (a lookup counts only local
blocks, a put is not queued), and it recovers by itself. Event-loop only.

Values are keyed with the operator's secret (``redis.mac_key_file``, ``value``): a daemon with a
Redis tier and no secret refuses to start unless ``redis.allow_unkeyed`` says otherwise, and
then warns at every start, since anyone who can write to Redis could make it serve forged
blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kvstore.daemon.tier_contract import KeyRun, count_in
from kvstore.daemon.tierstats import TierCounters, TierSnapshot
from kvstore.index import IN_CPU, IN_REDIS, State

if TYPE_CHECKING:
    from kvstore.daemon.ledger import Ledger
    from kvstore.daemon.namespaces import NamespaceRecord

log = logging.getLogger(__name__)

# Blocks per Redis call: each call must fit its deadline (a 64 MiB put measured ~0.15-0.7 s).
BATCH_BYTES = 16 << 20
# A write-through batch pins its blocks while Redis reads them: at most this share of the CPU
# tier, so that puts always find unpinned blocks to evict while write-through catches up.
BATCH_SHARE = 1 / 8
MAX_PENDING = 4096  # write-through blocks queued while Redis is down; the oldest go first


class SharedTier:
    """The shared tier of the tier contract (``tier_contract.Tier[KeyRun]``); see the module
    docstring. Created by the store; ``start``/``stop`` bracket its life."""

    def __init__(
        self,
        ledger: Ledger,
        cpu_room: Callable[..., Awaitable[list[int]]],
        on_fetched: Callable[[list[int]], None],
    ) -> None:
        """``cpu_room``: makes room in the CPU tier for fetched blocks (``CpuRoom.alloc_cpu``);
        ``on_fetched``: told of blocks fetched and committed (write-back queues them)."""
        self.name = "redis"
        self.ledger = ledger
        self.cpu_room = cpu_room
        self.on_fetched = on_fetched
        self.config = ledger.config.redis
        self.tier: Any = None  # kvstore.tiers.redis.RedisTier once started
        # Write-through queue: (entry, namespace id, key); an entry is written only if it still
        # holds that key when its turn comes (entry ids are recycled).
        self._queue: deque[tuple[int, int, bytes]] = deque()
        cpu_bytes = ledger.config.cpu.capacity_bytes
        self.batch_bytes = max(1, min(BATCH_BYTES, int(cpu_bytes * BATCH_SHARE)))
        self.dropped_while_down = 0  # blocks that left the last local tier unwritten to Redis
        self._wake = asyncio.Event()
        self._putter: asyncio.Task[None] | None = None
        self.promotions = 0
        self.demotions = 0
        self.skipped = 0  # calls skipped because the tier was down

    @property
    def enabled(self) -> bool:
        return self.tier is not None

    @property
    def down(self) -> bool:
        return self.tier is not None and not self.tier.up

    def _batches(self, eids: list[int], block_bytes: int) -> list[list[int]]:
        per_call = max(1, self.batch_bytes // max(1, block_bytes))
        return [eids[i : i + per_call] for i in range(0, len(eids), per_call)]

    def must_reach_redis(self, eid: int) -> bool:
        """A block that exists in no tier below the CPU tier and not yet in Redis: evicting it
        while Redis is down would lose it for every other host. Eviction spares such blocks
        while it can (``CpuRoom.alloc_cpu``)."""
        index = self.ledger.index
        return (
            self.tier is not None
            and self.ledger.nvme is None
            and not index.tier[eid] & IN_REDIS
            and (self.config.write_through or self.down)
        )

    async def start(self) -> None:
        if not self.config.url:
            return
        from kvstore.tiers.redis import RedisTier

        # ``kvstore serve`` checked this already (exit 2); here for daemons started otherwise.
        self.config.check_keyed()
        self.tier = RedisTier(
            self.config.url,
            timeout_s=self.config.timeout_s,
            ttl_s=self.config.ttl_s or None,
            max_bytes_per_namespace=self.config.max_bytes_per_namespace or None,
            key_prefix=self.config.key_prefix,
            mac_secret=read_mac_secret(self.config.mac_key_file),
        )
        if not self.config.keyed:
            log.warning(
                "redis tier %s WITHOUT a MAC secret (redis.allow_unkeyed): anyone who can write "
                "to this Redis can make every host serve forged KV blocks; set "
                "redis.mac_key_file (kvstore redis-secret PATH writes one)",
                self.tier.url,  # redacted: never a password in the log
            )
        await self.tier.start()  # a Redis that is down now is not fatal: it reconnects
        self._putter = asyncio.create_task(self._put_loop())

    async def stop(self) -> None:
        if self.tier is None:
            return
        if self._putter is not None:
            self._putter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._putter
        await self.tier.close()

    # ----------------------------------------------------------------- lookups and fetches
    async def contains(self, record: NamespaceRecord, keys: list[bytes]) -> int:
        """Leading keys present in Redis; 0 when it is unreachable (never a hit from a tier
        that cannot serve it)."""
        if self.tier is None or not keys or not self.tier.up:
            return 0
        # Imported here, past the check: without a Redis tier, a lookup that misses must not
        # pay the first import of redis-py (~0.3-0.8 s, in the middle of a call).
        from kvstore.tiers.redis import RedisTierUnavailable

        try:
            lossy = self.ledger.accepts_lossy(record)
            return int(await self.tier.contains(record.fingerprint, keys, lossy=lossy))
        except RedisTierUnavailable:
            self.skipped += 1
            return 0

    async def move_up(self, wanted: KeyRun) -> list[int]:
        """Copy the leading run of ``wanted.keys`` found in Redis into new CPU-tier entries;
        returns the entry ids of the leading blocks now committed locally (in key order)."""
        if self.tier is None:
            return []
        record, keys = wanted.record, wanted.keys
        from kvstore.tiers.redis import RedisTierUnavailable  # as in contains

        ledger, index = self.ledger, self.ledger.index
        ns_id = record.ns_id
        n = await self.contains(record, keys)
        claim = list(dict.fromkeys(keys[:n]))
        for i, key in enumerate(claim):
            if index.get(ns_id, key) is not None:  # indexed meanwhile (a put, another fetch)
                claim = claim[:i]
                break
        if not claim:
            return []
        bb = record.block_bytes
        slots = await self.cpu_room(
            bb, len(claim), partial=True, domain=record.domain, record=record
        )
        # Claim entries (RESERVED: invisible, and a concurrent fetch of a key skips it) before
        # the next await; stop at a key someone indexed while room was being made.
        eids: list[int] = []
        for key, offset in zip(claim, slots, strict=False):
            if index.get(ns_id, key) is not None or ledger.namespace_record(ns_id) is not record:
                break
            eids.append(ledger.add_entry(key, ns_id, IN_CPU, offset, record.priority))
        for offset in slots[len(eids) :]:
            ledger.cpu_unalloc(offset, bb)
        views = [ledger.arena.view[index.offset[e] : index.offset[e] + bb] for e in eids]
        keys_of = [index.key(e) for e in eids]
        sums: list[int | None] = []
        try:
            for part in self._batches(list(range(len(eids))), bb):
                try:
                    sums += await self.tier.get_into_checked(
                        record.fingerprint,
                        [(keys_of[i], None, views[i]) for i in part],
                        lossy=ledger.accepts_lossy(record),
                    )
                except RedisTierUnavailable:
                    self.skipped += 1
                    break
        except BaseException:
            for eid in eids:  # cancelled or failed: the daemon's own reservation ends here
                ledger.discard_reserved(eid)
            raise
        sums += [None] * (len(eids) - len(sums))
        run: list[int] = []
        leading = True
        for eid, checksum in zip(eids, sums, strict=True):
            if checksum is None:  # absent, or failed verification
                ledger.discard_reserved(eid)
                leading = False
                continue
            # The checksum the tier just verified the slot's bytes against (bound to namespace
            # and key, not hashed again): the checksum every local tier keeps from now on.
            ledger.commit_entry(eid, checksum)  # the fetch was the daemon's reservation
            self.on_fetched([eid])
            ledger.mark_in_redis(eid)
            self.promotions += 1
            if leading:
                run.append(eid)
        return run

    # ----------------------------------------------------------------- down: write-through
    def note_committed(self, eids: list[int]) -> None:
        if self.tier is None or not self.config.write_through:
            return
        # Queued even while Redis is down: the put loop waits for it to come back, so a block
        # committed during an outage still reaches the other hosts afterwards (bounded).
        index = self.ledger.index
        self._queue.extend((e, index.ns[e], index.key(e)) for e in eids)
        while len(self._queue) > MAX_PENDING:
            self._queue.popleft()
            self.skipped += 1
        self._wake.set()

    async def move_down(self, eids: list[int]) -> int:
        """Write CPU blocks that are about to leave the last local tier to Redis first; returns
        how many of ``eids`` this host has written there. The ones Redis could not take (it is
        down) are counted in ``dropped_while_down``."""
        await self._demote(eids)
        return count_in(self.ledger.index, eids, IN_REDIS)

    async def _demote(self, eids: list[int]) -> None:
        index = self.ledger.index
        todo = [(e, index.ns[e], index.key(e)) for e in eids if not index.tier[e] & IN_REDIS]
        by_size: dict[int, list[tuple[int, int, bytes]]] = {}
        for item in todo:
            by_size.setdefault(self.ledger.block_bytes_of(item[0]), []).append(item)
        for bb, items in by_size.items():
            for part in self._batches(items, bb):  # type: ignore[arg-type]
                if not await self._put(part):  # type: ignore[arg-type]
                    self.dropped_while_down += sum(
                        1 for e, _, _ in todo if not index.tier[e] & IN_REDIS
                    )
                    return

    async def _put_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                if self.tier is not None and not self.tier.up:
                    await asyncio.sleep(0.2)  # the tier reconnects by itself; keep the queue
                    continue
                eid, ns_id, key = self._queue[0]
                if not self.ledger.index.has_key(eid, ns_id, key):
                    # Deleted or evicted since: its namespace may be forgotten too.
                    self._queue.popleft()
                    continue
                bb = self.ledger.namespace_record(ns_id).block_bytes
                n = max(1, min(len(self._queue), self.batch_bytes // max(1, bb)))
                batch = [self._queue.popleft() for _ in range(n)]
                if not await self._put(batch):
                    self._queue.extendleft(reversed(batch))  # retried once Redis is back

    async def _put(self, items: list[tuple[int, int, bytes]]) -> bool:
        """Write CPU blocks, each (entry, namespace id, key), to Redis; False when Redis was
        unreachable (nothing is lost: the caller may retry). An entry that no longer holds its
        key, or left the CPU tier, is skipped."""
        from kvstore.tiers.redis import RedisTierUnavailable

        ledger, index = self.ledger, self.ledger.index
        by_ns: dict[int, list[tuple[int, bytes]]] = {}
        for e, ns_id, key in items:
            if (
                index.has_key(e, ns_id, key)
                and index.state[e] == State.COMMITTED
                and index.tier[e] & IN_CPU
                and not index.tier[e] & IN_REDIS
            ):
                by_ns.setdefault(ns_id, []).append((e, key))
        if not by_ns or self.tier is None:
            return True
        live = [e for group in by_ns.values() for e, _ in group]
        for e in live:
            ledger.pin(e)  # the slots stay put while Redis reads them
        try:
            # Everything Redis will read is named now, before the first await: an entry deleted
            # meanwhile keeps its slot (pinned) but loses its key.
            calls = []
            for ns_id, group in by_ns.items():
                record = ledger.namespace_record(ns_id)
                bb = record.block_bytes
                blocks = [
                    (
                        key,
                        ledger.arena.view[index.offset[e] : index.offset[e] + bb],
                        index.checksum[e],
                    )
                    for e, key in group
                ]
                # A tenant's per-namespace quota_redis, else the tier's own bound.
                bound = record.usage.quota.redis_bytes if record.usage is not None else 0
                how = ledger.codec_of(record, "redis")
                calls.append((record.fingerprint, ns_id, group, blocks, how, bound or None))
            for fingerprint, ns_id, group, blocks, (codec, block_format), bound in calls:
                try:
                    await self.tier.put(
                        fingerprint,
                        blocks,
                        codec=codec,
                        block_format=block_format,
                        max_bytes=bound,
                    )
                except RedisTierUnavailable:
                    self.skipped += 1
                    return False
                except ValueError as exc:  # a CPU copy that no longer matches its checksum
                    log.warning("not sent to redis: %s", exc)
                    ledger.cpu.checksum_failures += 1
                    continue
                for e, key in group:
                    if index.has_key(e, ns_id, key) and index.state[e] == State.COMMITTED:
                        ledger.mark_in_redis(e)
                self.demotions += len(group)
        finally:
            for e in live:
                ledger.unpin(e)
        return True

    def stats(self) -> dict[str, Any]:
        if self.tier is None:
            return {}
        return dict(self.tier.stats())

    # ----------------------------------------------------------------- the rest of the contract
    def holds(self, eid: int) -> bool:
        """Whether this host wrote the block to Redis (another host's copy is not known here,
        and any copy may have expired since)."""
        return bool(self.ledger.index.tier[eid] & IN_REDIS)

    def drop(self, eids: list[int]) -> int:
        """Nothing: the values are every host's, and go by TTL or by Redis's own eviction."""
        return 0

    @property
    def counters(self) -> TierCounters:
        """The running totals, brought up to date from the Redis client's own."""
        c = self.ledger.redis_counters
        stats = self.stats()
        c.promotions = self.promotions
        c.demotions = self.demotions
        c.checksum_failures = int(stats.get("checksum_failures", 0))
        c.evictions = int(stats.get("evictions", 0))
        return c

    def snapshot(self) -> TierSnapshot | None:
        """What this host wrote (Redis is shared: other hosts' values are not counted); the
        capacity is ``max_bytes_per_namespace`` (0: unbounded here)."""
        if self.tier is None:
            return None
        stats = self.stats()
        extra = {k: float(v) for k, v in stats.items() if k in _SNAPSHOT_EXTRAS}
        extra["skipped_while_down"] = float(self.skipped)
        extra["dropped_while_down"] = float(self.dropped_while_down)
        return TierSnapshot(
            "redis",
            self.config.max_bytes_per_namespace,
            int(stats.get("bytes_written", 0)),
            int(stats.get("puts", 0)),
            self.counters,
            up=bool(stats.get("up", False)),
            extra=extra,
            logical_bytes=int(stats.get("logical_bytes_written", 0)),
            stored_bytes=int(stats.get("bytes_written", 0)),
        )


# The Redis client's counters a snapshot shows beside the occupancy.
_SNAPSHOT_EXTRAS = (
    "bytes_written",
    "logical_bytes_written",
    "bytes_read",
    "errors",
    "reconnects",
    "unavailable",
    "mac_failures",
    "lossy_refused",
)


def read_mac_secret(path: str) -> bytes | None:
    """The Redis values' MAC secret from ``redis.mac_key_file``, None without one: the file's
    bytes, surrounding whitespace stripped (``kvstore redis-secret`` writes 64 hex digits and a
    newline; the hex text itself is the secret). A file that cannot be read or holds under 16
    bytes refuses the start: a daemon that wrote unkeyed values, or keyed them with an empty
    secret, would silently give up the promise. A file others may read is warned about: whoever
    reads it can forge values every host serves."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            secret = f.read().strip()
    except OSError as exc:
        raise ValueError(f"redis.mac_key_file: cannot read {path}: {exc}") from None
    if len(secret) < 16:
        raise ValueError(f"redis.mac_key_file: {path} holds fewer than 16 bytes of secret")
    if stat.S_IMODE(mode) & 0o077:
        log.warning(
            "redis.mac_key_file %s is readable by others (mode %o): whoever reads it can forge "
            "values every host serves; chmod 600 it",
            path,
            stat.S_IMODE(mode),
        )
    return secret
