"""The daemon's block store: namespaces and their handles, the index, leases, reservations, and
the tiers.

``BlockStore`` is the one owner of the index and of every block state transition. Its parts,
each with one job: ``namespaces`` (records and handles: who may reach what), ``cpu_tier`` (the
arena's slots, their owners and bytes), ``device`` (the GPU pool), ``movement`` (the NVMe tier
and the IO between tiers), ``shared`` (Redis), ``room`` (making room in a tier, across block
sizes), ``invariants`` (the checker) and ``snapshots`` (what Stats shows). The parts change the
index only through the store's methods, so every transition is made, and checked, here. There
is one write protocol: a RESERVED entry (from a client's reservation, a fetch from Redis or a
record found on disk at start-up) becomes visible only through ``_commit_entry``. Every method
runs on the daemon's event loop; bytes move in executors (the NVMe tier's IO threads,
``asyncio.to_thread`` for checksums), so the loop never blocks on a copy or a disk.

Callers. A client opens a namespace and gets a ``Handle``: 16 random bytes, unguessable, known
only to this daemon instance, alive while the client's OpenNamespace stream is open. Every
reservation and lease belongs to one handle, under a random id; a call naming an id its handle
does not hold is refused. Closing a handle (the client closed its stream or died) aborts its
reservations and releases its leases at once.

Write protocol (two-phase): ``reserve`` allocates slots and creates RESERVED entries, invisible
to readers; the client copies into the slots and computes each block's checksum from what it
copied (``kvstore.checksum``: bound to namespace and key); ``commit`` makes them visible with
those checksums. A reservation not committed within ``reservation_ttl_s`` is reclaimed by
``reap``. A put that meets keys another client is writing waits (bounded) for that commit, so a
put followed by a get reads its write whoever wrote it.

Read protocol: ``acquire`` takes a read lease on the leading run of committed blocks, promoting
blocks that are only on disk into the CPU tier first; the client copies out, verifies each
block's checksum against the key it asked for, and calls ``release``. A leased block is never
evicted or freed. A lease remembers the (namespace, key) of every entry it pins; the bytes path
checks that each entry still holds that key at the moment it copies the bytes out.

Invariants (``check`` asserts them; the tests call it after every step):
- every keyed entry is RESERVED or COMMITTED, in a known namespace; ORPHANs are unkeyed and
  leased; ``record.entries`` counts a namespace's keyed entries and orphans;
- a RESERVED entry belongs to exactly one live reservation; a COMMITTED one to none;
- each tier's policy holds exactly the COMMITTED entries with a copy in that tier;
- an entry's lease count is the number of live leases naming it plus IO in flight on it;
- the CPU bytes counted used are the bytes of the entries holding CPU slots plus quarantined
  slots; the clean bytes are those of CPU blocks with a disk copy.

Movement (``movement.py`` holds the background parts): puts land in the CPU tier. With an NVMe
tier, write-back keeps at least ``1 - high_watermark`` of the CPU tier free or clean (already on
disk) by writing its coldest dirty blocks down in the background, so a put rarely waits; with
``write_through`` every commit is written down at once. Evicting a clean block only drops its
CPU copy; a dirty victim is written down first. A block whose checksum fails on the way down or
up is dropped and counted: a miss, never wrong data.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import itemgetter
from typing import TYPE_CHECKING, cast

import numpy as np

from kvstore.checksum import block_checksum
from kvstore.config import DaemonConfig
from kvstore.daemon.auth import Principal
from kvstore.daemon.cpu_tier import CpuSlots
from kvstore.daemon.disk_tier import DiskSlots
from kvstore.daemon.namespaces import (
    Handle,
    Lease,
    NamespaceRecord,
    NamespaceTable,
    Reservation,
)
from kvstore.daemon.quotas import Pin, Quotas, Usage
from kvstore.daemon.tierstats import TierCounters, TierSnapshot
from kvstore.errors import (
    CapacityError,
    KVStoreError,
    LeaseExpiredError,
    UnavailableError,
    UnknownNamespaceError,
)
from kvstore.index import IN_CPU, IN_GPU, IN_NVME, IN_REDIS, BlockIndex, State
from kvstore.keys import KEY_BYTES, Namespace, SplitKeys
from kvstore.policy import EvictionPolicy, make_policy
from kvstore.presence import PresenceTable, fingerprints
from kvstore.tiers.codecs import (
    CODEC_FP8,
    CODEC_NONE,
    LOSSY,
    BlockFormat,
    block_format_of,
    codec_id,
    decode,
    encode_payload,
    plan,
)
from kvstore.tiers.cpu import SharedMemoryArena, SlabAllocator

if TYPE_CHECKING:
    from kvstore.tiers.gpu import DevicePool
    from kvstore.tiers.nvme import NvmeTier


log = logging.getLogger(__name__)

_COMMITTED = bytes([State.COMMITTED])  # leading_run: the state byte of a committed entry
# lookup's hit counts: tier byte -> 1 where the block is in the GPU tier / in CPU but not GPU.


def _gather(field: bytearray, eids: list[int]) -> bytes:
    """``field[eid]`` of each entry, in order, gathered in C (``itemgetter`` of n > 1 indices
    gives a tuple: ~2.4x faster than ``bytes(map(field.__getitem__, eids))`` at 128)."""
    if len(eids) > 1:
        return bytes(itemgetter(*eids)(field))
    return bytes([field[eids[0]]]) if eids else b""


_IS_GPU = bytes(1 if t & IN_GPU else 0 for t in range(256))
_IS_CPU_ONLY = bytes(1 if t & IN_CPU and not t & IN_GPU else 0 for t in range(256))
MAX_TALLY_KEYS = 1 << 32
"""The most keys one tally of lookups answered from a presence table may count. A client sends
its tally at least once a second while it looks up (``presence_link.FLUSH_S``) and answers
well under 10**9 keys a second, so an honest tally is far below it; a forged one is refused
rather than added (the counts feed uint64 fields of ``Stats``, saturated there)."""


@dataclass
class ReserveResult:
    reservation_id: int  # 0 when nothing was reserved
    offsets: list[int]  # per key: slot offset, or -1 (present, being written, or a repeat)
    gpu: bool  # the offsets are GPU pool offsets
    pending: int = 0  # keys another client was still writing when the wait ended
    codec: int = 0  # what the arena slots take: the block (0) or its fp8 payload (``cpu_bytes``)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter((self.reservation_id, self.offsets, self.gpu))


@dataclass
class BindResult:
    committed: int  # keys newly stored
    pending: int  # keys another client was still writing when the wait ended
    unbound: list[int]  # the slots named that stay spare (a key present, repeated or pending)


@dataclass
class AcquireResult:
    lease_id: int  # 0 when nothing was found
    offsets: list[int]
    checksums: list[int]
    on_gpu: list[bool]
    pending: bool = False  # the run ended at a key another client was still writing
    # Per block, where any arena block is an fp8 payload: its codec and its payload checksum
    # (``checksums`` are then of the decoded form, what a reader verifies after decoding).
    codecs: list[int] | None = None
    payload_checksums: list[int] | None = None

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter((self.lease_id, self.offsets, self.checksums, self.on_gpu))


def _distinct(keys: Sequence[bytes], what: str) -> None:
    if len(set(keys)) != len(keys):
        raise ValueError(f"{what}: a key is repeated (a prefix chain never repeats a key)")


class BlockStore:
    """Owns the namespaces and handles, the block index, the CPU arena, the GPU and NVMe tiers
    (when configured), one eviction policy per tier, the leases and the reservations.
    Event-loop only.

    ``gpu_pool``: a device pool made by the caller instead of the one ``config.gpu`` asks for
    (tests drive the GPU tier's logic with a pool on a CPU device).
    """

    def __init__(
        self,
        config: DaemonConfig,
        clock: Callable[[], float] = time.monotonic,
        gpu_pool: DevicePool | None = None,
    ) -> None:
        self.config = config
        self.limits = config.limits
        self._clock = clock
        # Spare slots are RESERVED entries keyed by placeholders until a Bind keys them: a
        # secret prefix (no client can name one, so none can wait on or collide with it) and
        # a count.
        self._spare_prefix = secrets.token_bytes(KEY_BYTES - 8)
        self._spare_count = itertools.count()
        self._spare_tasks: set[asyncio.Task[None]] = set()  # grant_spare_soon's
        # Bytes of spare slots all handles hold, of those expired (or their handle closed) and
        # still quarantined, and of grants under way: together within ``spare_tier_bytes``.
        self.spare_reserved_bytes = 0
        self.spare_quarantined_bytes = 0
        self._spare_quarantine: list[tuple[float, int]] = []  # (until, bytes), a heap
        self._spare_granting_bytes = 0
        self.cpu_slots = CpuSlots(config.cpu)
        from kvstore.daemon.device import DeviceTier, make_device_pool

        try:
            pool = gpu_pool if gpu_pool is not None else make_device_pool(config.gpu)
        except BaseException:
            self.cpu_slots.close()
            raise
        self.index = BlockIndex()
        self.policy: EvictionPolicy = make_policy(config.cpu.policy)
        self.nvme_policy: EvictionPolicy = make_policy(config.nvme.policy)
        self.redis_counters = TierCounters()
        self.disk = DiskSlots()  # its NvmeTier is opened by the Mover's start()
        self.names = NamespaceTable(config.limits, tenant_domains=config.auth.has_policy)
        self.quotas = Quotas(
            config,
            slab_of=self.allocator.slab_of,
            slab_bytes=self.allocator.slab_bytes,
            clock=clock,
            domains=config.auth.has_policy,
        )
        # (until, in the GPU pool, offset, block bytes, its reservation's pin) of slots of
        # expired reservations: charged to their tenant until they are reusable. A heap by
        # ``until`` (a shortened reservation's quarantine ends sooner than others'); no two
        # items share a slot, so the comparison never reaches the pin.
        self._quarantine: list[tuple[float, bool, int, int, Pin | None]] = []
        # The payload checksum of each CPU copy that is an fp8 payload (its entry's checksum
        # is the decoded form's, what a reader verifies after decoding).
        self.payload_sums: dict[int, int] = {}
        # Waiters for the commit (or the end) of RESERVED entries, by entry id.
        self._written: dict[int, asyncio.Future[None]] = {}
        self._reserved_blocks = 0
        from kvstore.daemon.movement import Mover
        from kvstore.daemon.shared import SharedTier

        self.mover = Mover(self)
        self.shared = SharedTier(self)
        self.device = DeviceTier(self, pool)

    @property
    def arena(self) -> SharedMemoryArena:
        return self.cpu_slots.arena

    @property
    def allocator(self) -> SlabAllocator:
        return self.cpu_slots.allocator

    @property
    def cpu(self) -> TierCounters:
        return self.cpu_slots.counters

    @property
    def nvme(self) -> NvmeTier | None:
        """The NVMe tier's IO object, once the Mover opened it (None without one)."""
        return self.disk.tier

    @property
    def nvme_counters(self) -> TierCounters:
        return self.disk.counters

    async def start(self) -> None:
        """Open the NVMe tier (recovering what it holds), connect the shared tier, and start
        background movement."""
        await self.device.start()
        await self.mover.start()
        await self.shared.start()

    async def stop(self) -> None:
        """Write dirty blocks down (bounded by ``drain_timeout_s``), close tiers, unlink."""
        for task in list(self._spare_tasks):
            task.cancel()
        for handle in self.names.handles():
            self.close_handle(handle)
        await self.device.stop()
        await self.shared.stop()
        await self.mover.stop()
        self.close()

    def close(self) -> None:
        for record in self.names.records():
            if record.presence is not None:  # clients that map it fall back to calls
                record.presence.close()
                record.presence = None
        self.device.close()
        self.cpu_slots.close()

    # ----------------------------------------------------------------- namespaces and handles
    def open_namespace(
        self, namespace: Namespace, priority: int = 0, principal: Principal | None = None
    ) -> Handle:
        """Register or join a namespace and hand out a new handle to it (``NamespaceTable``)
        for ``principal`` (``kvstore.daemon.auth.Principal``; None: a caller of every tenant),
        whose own budget its keys and leases are charged to (``Quotas.payer``)."""
        self.allocator.check_fits(namespace.layout.block_bytes)
        writer = principal is None or principal.may_write(namespace.tenant)
        handle = self.names.open(namespace, priority, writer)
        record = handle.record
        if not record.cpu_codec_set:
            record.cpu_codec_set = True
            record.cpu_codec, record.cpu_payload_bytes = self.cpu_codec_for(namespace)
            self._drop_lossy_records(record)
        handle.books = self.quotas.handle_books()
        if handle.record.usage is None:
            self.quotas.new_books(handle.record)
        else:
            self.quotas.bind(handle.record)
        handle.principal = principal
        handle.payer = self.quotas.payer(handle.record, principal)
        if handle.books is not None and len(self.names) == 2:
            # The bound of one handle's pins starts now (``_bound``): a handle pins past it
            # only while alone, so the other one is the only handle that may be past it.
            for other in self.names.handles():
                if other is not handle:
                    self._shorten_excess(other)
        return handle

    def _shorten_excess(self, handle: Handle) -> None:
        """Bring forward, to ``limits.pin_grace_s`` from now, the expiry of what takes
        ``handle`` past the pinned bound of one handle (it pinned more while it was alone), so
        that a newcomer finds room within a bounded time. It keeps, untouched, its
        reservations in order while they fit the bound, then the leading blocks of its leases
        in order (a lease is cut: its leading blocks are a usable prefix); only the rest
        expires sooner. A reservation is kept or shortened whole (its commit is). Shortening
        never extends an expiry and never goes below the bound, so a caller opening and
        closing handles over and over cannot take from the first what the bound gives it."""
        books = handle.books
        bound = self.quotas.handle_pinned
        if books is None or books.pinned_bytes <= bound:
            return
        until = self._clock() + self.limits.pin_grace_s
        room = bound
        for reservation in handle.reservations.values():
            nbytes = reservation.pin.nbytes if reservation.pin is not None else 0
            if nbytes <= room:
                room -= nbytes
            elif until < reservation.expires_at:
                reservation.expires_at = until
                reservation.shortened = True
        kept: set[int] = set()  # a block leased twice counts once (``Quotas.pin``)
        for lease in handle.leases.values():
            pinned = set(lease.pin.eids) if lease.pin is not None else set()
            bb = lease.pin.block_bytes if lease.pin is not None else 0
            cut = len(lease.eids)
            for i, eid in enumerate(lease.eids):
                if eid in pinned and eid not in kept:
                    if bb > room:
                        cut = i
                        break
                    room -= bb
                    kept.add(eid)
            lease.shorten(cut, until)

    def recovered_namespace(self, fingerprint: bytes, block_bytes: int) -> NamespaceRecord:
        record = self.names.recovered(fingerprint, block_bytes)
        if record.usage is None:
            self.quotas.new_books(record)
        return record

    def namespace_record(self, ns_id: int) -> NamespaceRecord:
        """The record of an entry's namespace (recovered ones included)."""
        return self.names[ns_id]

    def handle(self, token: bytes) -> Handle:
        """The open handle ``token`` names; UnknownNamespaceError for anything else."""
        return self.names.handle(token)

    def close_handle(self, handle: Handle) -> tuple[int, int]:
        """The client is gone (or done): abort its reservations and release its leases now.
        Returns (reservations, leases) reclaimed."""
        if handle.closed:
            return 0, 0
        handle.closed = True
        reservations = list(handle.reservations.values())
        leases = list(handle.leases.values())
        handle.reservations.clear()
        handle.leases.clear()
        handle.spare_slots.clear()
        handle.spare_ready.clear()
        now = self._clock()
        for reservation in reservations:
            if reservation.spare:
                # Its client copies into spare slots before its next call, the one that would
                # tell it the handle is gone (a dropped stream): quarantined as if they had
                # expired, never handed to another writer while it may still write them.
                until = self._expire_reservation(reservation, max(now, reservation.expires_at))
                self._forget_spare(handle, reservation, until)
                continue
            # The writer is gone: nothing can still copy into these slots (a stalled writer
            # of a closed stream that did would fail its readers' checksums, never pass them).
            for eid in reservation.eids:
                self._free_entry(eid)
            self._unpin(reservation.pin)
        for lease in leases:
            for eid in lease.eids:
                self._drop_one_lease(eid)
            self._unpin(lease.pin)
        self.names.release(handle)
        self._maybe_forget_books(handle.record)
        self.quotas.unpay(handle.payer)
        handle.payer = None
        return len(reservations), len(leases)

    def block_bytes_of(self, eid: int) -> int:
        return self.names[self.index.ns[eid]].block_bytes

    def domain_of(self, eid: int) -> int:
        """The memory domain (tenant) whose slabs hold this entry's CPU copy."""
        return self.names[self.index.ns[eid]].domain

    def fingerprint_of(self, eid: int) -> bytes:
        return self.names[self.index.ns[eid]].fingerprint

    def codec_of(self, record: NamespaceRecord, tier: str) -> tuple[int, BlockFormat | None]:
        """The codec a block of ``record`` is written with in ``tier`` ("nvme" or "redis"), as
        the configuration chooses it (``[[codecs]]``, then the tier's default), and the block
        format a lossy codec needs (None: unknown, so only the codec's lossless part applies;
        e.g. a namespace recovered from disk that no client has opened since)."""
        default = self.config.nvme.codec if tier == "nvme" else self.config.redis.codec
        ns = record.namespace
        name = default
        if ns is not None:
            for rule in self.config.codecs:
                if rule.matches(ns.model, ns.tenant):
                    name = getattr(rule, tier) or default
                    break
        return codec_id(name), None if ns is None else block_format_of(ns.layout)

    def _drop_lossy_records(self, record: NamespaceRecord) -> None:
        """At a namespace's first open (its rules known at last: a namespace recovered from
        disk has no identity before), drop its lossy NVMe records if this host keeps it
        lossless: ``lookup`` would count them, and every read refuse them."""
        tier = self.nvme
        if tier is None or not record.entries or not tier.holds_lossy():
            return  # the usual case, decided without a walk over the namespace's entries
        if self.accepts_lossy(record):
            return
        index = self.index
        lossy = [
            eid
            for eid in list(index.ids_of(record.ns_id).values())
            if index.state[eid] == State.COMMITTED
            and index.tier[eid] == IN_NVME
            and tier.codec_of(index.disk[eid]) in LOSSY
        ]
        for eid in lossy:
            self.forget(eid)
        self.nvme_counters.lossy_refused += len(lossy)

    def accepts_lossy(self, record: NamespaceRecord) -> bool:
        """Whether a read of ``record``'s blocks may yield a lossy codec's decoded form: where
        this host's configuration chose a lossy codec for one of the namespace's tiers. Of a
        namespace configured lossless here, a lossy record (one an earlier rule wrote down, or
        another host wrote to Redis) is a miss: it reads exactly its committed bytes."""
        if record.cpu_codec:
            return True
        return any(self.codec_of(record, tier)[0] in LOSSY for tier in ("nvme", "redis"))

    def cpu_codec_for(self, namespace: Namespace) -> tuple[int, int]:
        """(codec, payload bytes) of a namespace's CPU-tier entries (``[[codecs]]`` cpu): fp8
        where a rule opts in and its layout can be encoded (``codecs.plan``), else (none, 0)."""
        for rule in self.config.codecs:
            if rule.matches(namespace.model, namespace.tenant):
                if rule.cpu != "fp8":
                    return CODEC_NONE, 0
                bb = namespace.layout.block_bytes
                codec, payload = plan(CODEC_FP8, block_format_of(namespace.layout), bb)
                return (codec, payload) if codec == CODEC_FP8 else (CODEC_NONE, 0)
        return CODEC_NONE, 0

    def _note_payload(self, record: NamespaceRecord, sign: int) -> None:
        """A CPU copy of ``record``'s came (+1) or went (-1): Stats' logical CPU bytes."""
        if record.cpu_codec:
            self.cpu_slots.payload_savings += sign * (record.block_bytes - record.cpu_bytes)

    def cpu_bytes_of(self, eid: int) -> int:
        """Bytes of an entry's CPU-tier copy (its slot's length): its block, or its payload."""
        return self.names[self.index.ns[eid]].cpu_bytes

    def check_keys(self, keys: Sequence[bytes], what: str) -> None:
        """The per-request bounds every call with keys obeys (ValueError names the bound)."""
        if len(keys) > self.limits.max_keys_per_request:
            raise ValueError(
                f"{what}: {len(keys)} keys, more than limits.max_keys_per_request "
                f"({self.limits.max_keys_per_request})"
            )
        # Keys split from a request's packed field are 32 bytes each by construction; others
        # are measured in C (map, set): the common case.
        if type(keys) is SplitKeys or set(map(len, keys)) <= {KEY_BYTES}:
            return
        for i, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                raise ValueError(f"{what}: key {i} is {len(key)} bytes, not {KEY_BYTES}")

    # ----------------------------------------------------------------- waiting for writers
    def _note_written(self, eid: int) -> None:
        """A RESERVED entry was committed or freed: wake whoever waits for it."""
        waiter = self._written.pop(eid, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait_for_writers(self, ns_id: int, keys: Sequence[bytes], wait_s: float) -> int:
        """Wait (at most ``wait_s``) until none of ``keys`` is being written; returns how many
        still are then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, min(wait_s, self.limits.write_wait_s))
        state = self.index.state
        while True:
            pending = []
            ids = self.index.ids_of(ns_id)  # anew after each wait: the namespace's may be new
            if ids.keys().isdisjoint(keys):  # all new (the common case of a put)
                return 0
            for key in keys:
                eid = ids.get(key)
                if eid is not None and state[eid] == State.RESERVED:
                    waiter = self._written.get(eid)
                    if waiter is None:
                        waiter = self._written[eid] = loop.create_future()
                    pending.append(waiter)
            remaining = deadline - loop.time()
            if not pending or remaining <= 0:
                return len(pending)
            await asyncio.wait(set(pending), timeout=remaining)

    # ----------------------------------------------------------------- reads
    def _committed(self, ns_id: int, key: bytes) -> int | None:
        eid = self.index.get(ns_id, key)
        if eid is None or self.index.state[eid] != State.COMMITTED:
            return None
        return eid

    def presence(self, handle: Handle) -> PresenceTable:
        """The presence table of ``handle``'s namespace (``kvstore.presence``), made from its
        committed keys (and their CPU copies' places) when first asked for; the store keeps it
        from then on."""
        record = handle.record
        if record.presence is None:
            # In C but for the places (~50 ms per million keys, places apart): a namespace
            # recovered from a large NVMe tier is first asked for on the event loop.
            ids = self.index.ids_of(record.ns_id)
            eids = list(ids.values())
            states = np.frombuffer(_gather(self.index.state, eids), np.uint8)
            committed = states == State.COMMITTED
            fps = fingerprints(b"".join(ids))[committed]
            places, sums = self._places_of(record, list(compress(eids, committed.tolist())))
            record.presence = PresenceTable.of_fingerprints(
                fps,
                None if places is None else np.array(places, dtype=np.uint64),
                None if sums is None else np.array(sums, dtype=np.uint64),
            )
        return cast(PresenceTable, record.presence)

    def _places_of(
        self, record: NamespaceRecord, eids: Sequence[int]
    ) -> tuple[list[int] | None, list[int] | None]:
        """(places, checksums) of ``record``'s entries ``eids`` in its presence table: each
        CPU copy's address plus one and that copy's checksum, a place 0 for an entry with no
        CPU copy; (None, None), no places at all, where a client cannot read the copies itself
        (fp8 payloads, which only a lease's decode reads)."""
        if record.cpu_codec:
            return None, None
        index = self.index
        tier, offset, checksum = index.tier, index.offset, index.checksum
        offsets = [offset[e] if tier[e] & IN_CPU else -1 for e in eids]
        places = [a + 1 if a >= 0 else 0 for a in self.arena.addresses(offsets)]
        return places, [checksum[e] for e in eids]

    def _presence_locate(self, eid: int) -> None:
        """Tell ``eid``'s presence table where its CPU copy now is (or that it has none)."""
        record = self.names[self.index.ns[eid]]
        if record.presence is not None and self.index.state[eid] == State.COMMITTED:
            places, sums = self._places_of(record, (eid,))
            place, checksum = (places[0], sums[0]) if places and sums else (0, 0)
            record.presence.locate(self.index.key(eid), place, checksum)

    def _presence_add(self, record: NamespaceRecord, eids: Sequence[int]) -> None:
        """Note ``eids`` committed in ``record``'s presence table, if it has one. Never raises
        into a commit: a table that cannot be kept (a rebuild out of memory or descriptors)
        is retired, so its clients call, and made afresh when next asked for."""
        table = record.presence
        if table is None:
            return
        try:
            places, sums = self._places_of(record, eids)
            record.presence = table.add_many(map(self.index.key, eids), places, sums)
        except Exception:
            log.exception("presence table of %s dropped", record.name)
            table.retire()
            record.presence = None

    def leading_run(self, ns_id: int, keys: Sequence[bytes]) -> list[int]:
        # Every lookup and acquire walks its keys here: the walk runs in C (map over the dict,
        # then one gather of the state bytes), ~4x faster than a Python loop for 128 keys.
        found = list(map(self.index.ids_of(ns_id).get, keys))
        try:
            eids = cast(list[int], found[: found.index(None)])
        except ValueError:  # every key is indexed
            eids = cast(list[int], found)
        states = _gather(self.index.state, eids)
        del eids[len(states) - len(states.lstrip(_COMMITTED)) :]
        return eids

    def count_table_lookups(
        self, handle: Handle, keys: int, found: int, in_cpu: int | None = None
    ) -> None:
        """Count lookups a client answered from its presence table (``keys`` asked,
        ``found`` leading keys found, ``in_cpu`` of them with a CPU copy in the table) as its
        namespace's hits and misses, when the handle is the namespace's own tenant's, and as
        the tiers' where the split is known (``_count_tier_lookups``). Not charged to
        ``keys_per_s``: they cost the daemon nothing."""
        if keys > MAX_TALLY_KEYS:
            raise ValueError(
                f"table_keys ({keys}) exceeds {MAX_TALLY_KEYS}, more than a client answers "
                "between two calls"
            )
        if not 0 <= found <= keys:
            raise ValueError(f"table_found ({found}) exceeds table_keys ({keys})")
        if in_cpu is not None and not 0 <= in_cpu <= found:
            raise ValueError(f"table_in_cpu ({in_cpu}) exceeds table_found ({found})")
        if not handle.writable:
            # A reader of a shared namespace: what it says it looked up costs it nothing, so
            # it does not get to move the owner's hit rates.
            return
        record = handle.record
        record.lookup_hits += found
        record.lookup_misses += keys - found
        # The table knows a found block's CPU copy (its place) and no other tier: the rest
        # are on NVMe only where there is no GPU tier, and a namespace stored with a codec
        # has no places at all. Elsewhere the daemon's own lookups are the tiers' only count.
        if in_cpu is not None and not self.device.enabled and not record.cpu_codec:
            self._count_tier_lookups(keys, 0, in_cpu, found, 0)

    def note_table_reads(self, handle: Handle, keys: Sequence[bytes]) -> None:
        """Blocks a client read itself from the places of its presence table: read now, for
        the eviction policies (``acquire``'s bookkeeping, less the lease). Keys no longer
        committed are skipped. Not charged to ``keys_per_s`` (the reads cost the daemon
        nothing; this is a dict lookup per key, within ``max_keys_per_request``)."""
        self.check_keys(keys, "table_reads")
        ids = self.index.ids_of(handle.ns_id)
        state = self.index.state
        eids = [e for e in map(ids.get, keys) if e is not None and state[e] == State.COMMITTED]
        if not eids:
            return
        tiers = self.index.tier
        self.mover.note_read(eids)
        self.policy.touch([e for e in eids if tiers[e] & IN_CPU])
        self.device.note_read(eids)

    async def lookup(self, handle: Handle, keys: Sequence[bytes]) -> int:
        self.check_keys(keys, "lookup")
        _distinct(keys, "lookup")  # a repeat would count as found (and as hits) each time
        record = handle.record
        self.quotas.take_keys(record, len(keys), handle.payer)
        ns_id = record.ns_id
        run = self.leading_run(ns_id, keys)
        local = len(run)
        shared = 0
        if local < len(keys):
            # One batched call for the rest of the run; 0 when Redis is unreachable.
            shared = await self.shared.contains(record, list(keys[local:]))
        found = local + shared
        # Hits and misses are counted per key asked by lookup, the call engines make before
        # every prefill; a get that follows it asks only for what lookup found. A block is a hit
        # of the highest tier that holds it.
        record.lookup_hits += found
        record.lookup_misses += len(keys) - found
        run_tiers = _gather(self.index.tier, run)  # counted in C, by translation tables
        in_gpu = run_tiers.translate(_IS_GPU).count(1)
        in_cpu = run_tiers.translate(_IS_CPU_ONLY).count(1)
        self._count_tier_lookups(len(keys), in_gpu, in_cpu, local, shared)
        return found

    def _count_tier_lookups(
        self, keys: int, in_gpu: int, in_cpu: int, local: int, shared: int
    ) -> None:
        """Count ``keys`` looked up as the tiers' hits and misses: a block is a hit of the
        highest tier that holds it (``in_gpu``, ``in_cpu`` and not the GPU, the rest of the
        ``local`` run on NVMe, ``shared`` in Redis past it), a miss of every tier above."""
        found = local + shared
        if self.device.enabled:
            self.device.counters.hits += in_gpu
            self.device.counters.misses += keys - in_gpu
        self.cpu.hits += in_cpu
        self.cpu.misses += keys - in_gpu - in_cpu
        if self.nvme is not None:
            self.nvme_counters.hits += local - in_gpu - in_cpu
            self.nvme_counters.misses += keys - local
        if self.shared.enabled:
            self.redis_counters.hits += shared
            self.redis_counters.misses += keys - found

    async def acquire(
        self,
        handle: Handle,
        keys: Sequence[bytes],
        gpu: bool = False,
        wait_s: float | None = None,
    ) -> AcquireResult:
        """Lease the leading run of present blocks, bringing the ones the reader cannot reach
        into the CPU tier.

        ``gpu``: the reader maps the GPU pool, so a block there is served from its pool slot
        (``on_gpu``; its offset is a pool offset and its checksum the device checksum).
        Otherwise every block is served from the CPU arena. A run that meets a key another
        client is writing waits (at most ``wait_s``, default ``limits.write_wait_s``) for it.
        Keys must be distinct.
        """
        self.check_keys(keys, "acquire")
        _distinct(keys, "acquire")
        if len(handle.leases) >= self.limits.max_leases_per_handle:
            raise CapacityError(
                f"this handle holds {len(handle.leases)} leases "
                "(limits.max_leases_per_handle): release some first"
            )
        record = handle.record
        self.quotas.take_keys(record, len(keys), handle.payer)
        self.quotas.check_pin(record, "leases", 0, payer=handle.payer)
        ns_id = record.ns_id
        wait = self.limits.write_wait_s if wait_s is None else wait_s
        eids = self.leading_run(ns_id, keys)
        pending = False
        if len(eids) < len(keys):
            eid = self.index.get(ns_id, keys[len(eids)])
            if eid is not None and self.index.state[eid] == State.RESERVED:
                # Read your writes: another client is committing this very block.
                pending = await self._wait_for_writers(ns_id, [keys[len(eids)]], wait) > 0
                eids = self.leading_run(ns_id, keys)
        # ``held`` is exactly what this call holds leases on: a call cancelled (a client's
        # deadline) or failing anywhere gives them back, since no lease id exists yet that
        # a release or close could reclaim.
        held: list[int] = []
        try:
            for eid in eids:  # pin the whole run before anything awaits
                self.index.add_lease(eid)
                held.append(eid)
            local_run = len(eids)
            tiers = self.index.tier
            gpu = gpu and self._maps_pool(handle)
            if not gpu:
                gpu_only = [e for e in eids if tiers[e] & IN_GPU and not tiers[e] & IN_CPU]
                if gpu_only:
                    await self.device.to_cpu(gpu_only, partial=True)  # as many as fit
            await self.mover.bring_to_cpu([e for e in eids if not (gpu and tiers[e] & IN_GPU)])
            ready = len(eids)
            for i, eid in enumerate(eids):
                servable = tiers[eid] & IN_CPU or (gpu and tiers[eid] & IN_GPU)
                if self.index.state[eid] != State.COMMITTED or not servable:
                    ready = i
                    break
            for eid in held[ready:]:
                self._drop_one_lease(eid)
            del held[ready:]
            eids = eids[:ready]
            if ready == local_run < len(keys) and self.shared.enabled and not pending:
                # The local run ended at a missing block: the shared tier may hold the rest.
                fetched = await self.shared.fetch(record, list(keys[ready:]))
                for eid in fetched:  # committed just now, no await since: lease them at once
                    self.index.add_lease(eid)
                    held.append(eid)
                eids = eids + fetched
        except BaseException:
            for eid in held:
                self._drop_one_lease(eid)
            raise
        if handle.closed:  # the client went away while this call waited
            for eid in held:
                self._drop_one_lease(eid)
            raise UnknownNamespaceError("the namespace handle was closed during the call")
        if not eids:
            return AcquireResult(0, [], [], [], pending)
        on_gpu = [bool(gpu and tiers[e] & IN_GPU) for e in eids]
        arena_eids = [e for e, g in zip(eids, on_gpu, strict=True) if not g]
        in_arena = [self.index.offset[e] for e in arena_eids]
        slabs = self.quotas.slabs_of(in_arena)
        try:
            # One tenant may pin only its share: the rest of the tier stays evictable.
            self.quotas.check_pin(
                record,
                "leases",
                len(in_arena) * record.cpu_bytes,
                slabs,
                self._bound(handle),
                arena_eids,
                handle.payer,
            )
        except CapacityError:
            for eid in held:
                self._drop_one_lease(eid)
            raise
        pin = self.quotas.pin(
            record,
            "leases",
            len(in_arena) * record.cpu_bytes,
            slabs,
            handle.books,
            arena_eids,
            handle.payer,
        )
        self.mover.note_read(eids)
        # Committed only: an entry deleted during an await above is an orphan, out of policies.
        self.policy.touch(
            [e for e in eids if tiers[e] & IN_CPU and self.index.state[e] == State.COMMITTED]
        )
        self.device.note_read(eids)
        lease_id = handle.new_id(handle.leases)
        handle.leases[lease_id] = Lease(
            eids, list(keys[: len(eids)]), self._clock() + self.config.lease_ttl_s, pin
        )
        offsets = [
            self.device.offset[e] if g else self.index.offset[e]
            for e, g in zip(eids, on_gpu, strict=True)
        ]
        checksums = [
            self.device.dsum[e] if g else self.index.checksum[e]
            for e, g in zip(eids, on_gpu, strict=True)
        ]
        result = AcquireResult(lease_id, offsets, checksums, on_gpu, pending)
        if record.cpu_codec:  # every block is an arena payload (such a namespace has no pool)
            result.codecs = [record.cpu_codec] * len(eids)
            result.payload_checksums = [self.payload_sums.get(e, 0) for e in eids]
        return result

    def release(self, handle: Handle, lease_id: int) -> None:
        lease = handle.leases.pop(lease_id, None)
        if lease is None:
            raise LeaseExpiredError(f"lease {lease_id} is unknown to this handle or expired")
        for eid in lease.eids:
            self._drop_one_lease(eid)
        self._unpin(lease.pin)

    def _maybe_forget_books(self, record: NamespaceRecord) -> None:
        if not record.handles and not record.entries:  # the table forgot the record
            self.quotas.forget(record)

    def _unpin(self, pin: Pin | None) -> None:
        if pin is not None:
            self.quotas.unpin(pin)

    def _drop_one_lease(self, eid: int) -> None:
        if self.index.drop_lease(eid) == 0 and self.index.state[eid] == State.ORPHAN:
            self._free_entry(eid)

    def pin(self, eid: int) -> None:
        """Pin an entry for IO in flight (a write down, a promotion): its slots stay put."""
        self.index.add_lease(eid)

    def unpin(self, eid: int) -> None:
        self._drop_one_lease(eid)

    def read_leased(self, handle: Handle, lease_id: int, i: int) -> tuple[bytes, bytes, int, int]:
        """Block ``i`` of a lease, copied out of the arena now (the bytes path): (key, bytes,
        checksum, codec id). Checked at the moment of the copy: the lease is live and its
        entry still holds the key it was leased for, committed, in the CPU tier.
        LeaseExpiredError otherwise, never another block's bytes. A codec (not 0: a payload
        namespace's CPU copy): the bytes are the payload; ``decode_leased`` gives the block
        the checksum is of."""
        lease = handle.leases.get(lease_id)
        if lease is None or i >= len(lease.eids):  # expired (or its block ``i`` was cut)
            raise LeaseExpiredError(f"lease {lease_id} expired while its blocks were streamed")
        eid, key = lease.eids[i], lease.keys[i]
        index = self.index
        if (
            not index.has_key(eid, handle.ns_id, key)
            or index.state[eid] != State.COMMITTED
            or not index.tier[eid] & IN_CPU
        ):
            raise LeaseExpiredError(f"block {i} of lease {lease_id} no longer holds its key")
        record = handle.record
        offset = index.offset[eid]
        slot = self.arena.view[offset : offset + record.cpu_bytes]
        return key, bytes(slot), index.checksum[eid], record.cpu_codec

    @staticmethod
    def decode_leased(record: NamespaceRecord, payload: bytes) -> bytes | None:
        """The block a payload copied by ``read_leased`` decodes to (~1 ms for a 2 MiB block,
        so callers run it off the event loop); None when it does not decode (a miss). The
        reader checks it against the decoded form's checksum."""
        block = bytearray(record.block_bytes)
        if not decode(
            record.cpu_codec, memoryview(payload), memoryview(block), memoryview(bytearray(0))
        ):
            return None
        return bytes(block)

    # ----------------------------------------------------------------- writes
    async def reserve(
        self,
        handle: Handle,
        keys: Sequence[bytes],
        priority: int = -1,
        gpu: bool = False,
        wait_s: float | None = None,
        spare: bool = False,
    ) -> ReserveResult:
        """Reserve a slot for each key not present: offsets (-1 where a key is present, being
        written, or repeats an earlier key of the call), whether they are in the GPU pool.

        ``gpu``: the writer maps the GPU pool and would rather write there (a device-to-device
        copy); the slots come from the pool when it can make room for all of them, else from
        the CPU arena. All or nothing: when the CPU tier cannot make room for every new key (the
        rest is leased or being written) nothing is reserved and CapacityError says how many
        slots were missing. Keys another client is writing are waited for (at most ``wait_s``,
        default ``limits.write_wait_s``), so that a put returning means the block is readable;
        those still being written then are counted in ``pending``.
        """
        self.check_keys(keys, "reserve")
        record = handle.record
        priority = record.priority if priority < 0 else priority
        if priority > 255:
            raise ValueError(f"priority must be in [0, 255], got {priority}")
        if len(handle.reservations) >= self.limits.max_reservations_per_handle:
            raise CapacityError(
                f"this handle holds {len(handle.reservations)} reservations "
                "(limits.max_reservations_per_handle): commit or abort some first"
            )
        if not spare:  # spare slots' keys are placeholders: their Bind spends the keys
            self.quotas.take_keys(record, len(keys), handle.payer)
        self.quotas.check_pin(record, "reservations", 0)
        if not record.entries and record.namespace is not None:
            # Its first block: past its tenant's share of namespaces holding blocks, refused.
            self.names.check_share(record.namespace.tenant, handle.principal, record)
        wait = self.limits.write_wait_s if wait_s is None else wait_s
        pending = 0 if spare else await self._wait_for_writers(record.ns_id, keys, wait)
        if not spare:
            await self._persist_present(record.ns_id, keys)
        if handle.closed:
            raise UnknownNamespaceError("the namespace handle was closed during the call")
        offsets = [-1] * len(keys)
        if gpu and self._maps_pool(handle):
            reserved = await self._reserve_gpu(handle, keys, priority, offsets)
            if reserved is not None:
                return ReserveResult(reserved, offsets, True, pending)
        bb = record.cpu_bytes
        slots: list[int] = []
        try:
            for _ in range(8):
                todo = self._new_positions(record.ns_id, keys)
                if len(slots) >= len(todo):
                    break
                # Refused before any room is made for it: past its pinned share.
                self.quotas.check_pin(
                    record, "reservations", len(todo) * bb, [], self._bound(handle)
                )
                # Making room may wait for dirty victims to reach the disk; other calls run
                # meanwhile and may reserve some of these keys, hence the loop.
                slots += await self.mover.alloc_cpu(
                    bb,
                    len(todo) - len(slots),
                    domain=record.domain,
                    record=record,
                    held_bytes=len(slots) * bb,
                )
            else:
                raise CapacityError("cpu tier full: the keys to reserve kept changing")
            if handle.closed:
                raise UnknownNamespaceError("the namespace handle was closed during the call")
        except BaseException:
            for offset in slots:
                self.cpu_unalloc(offset, bb)
            raise
        # No await from here on.
        for offset in slots[len(todo) :]:
            self.cpu_unalloc(offset, bb)
        del slots[len(todo) :]
        if not todo:
            return ReserveResult(0, offsets, False, pending)
        try:
            # Now the slabs are known: with memory domains a pin counts whole slabs.
            slabs = self.quotas.slabs_of(slots)
            self.quotas.check_pin(
                record, "reservations", len(todo) * bb, slabs, self._bound(handle)
            )
        except CapacityError:
            for offset in slots:
                self.cpu_unalloc(offset, bb)
            raise
        rid = self._add_reservation(handle, keys, todo, slots, priority, offsets)
        if spare:
            reservation = handle.reservations[rid]
            reservation.spare = True
            reservation.expires_at = self._clock() + self.spare_ttl_s
            # Quarantined as briefly once expired (``reap``): its writer stopped writing half
            # its life before, and a client that leaves slots unused under load must not
            # leave them pinned for a whole reservation_ttl_s.
            reservation.shortened = True
            self.spare_reserved_bytes += len(reservation.eids) * bb
        return ReserveResult(rid, offsets, False, pending, record.cpu_codec)

    # ----------------------------------------------------------------- spare slots
    @property
    def spare_ttl_s(self) -> float:
        """How long unbound spare slots live: briefly (an idle client's come back soon), and
        no longer than a reservation shortened for a newcomer (``pin_grace_s``), so a client
        that writes into them within half of it never writes into a slot given to another."""
        return min(self.config.reservation_ttl_s, self.limits.pin_grace_s)

    def spare_bytes(self, record: NamespaceRecord) -> int:
        """The spare slot bytes one handle of ``record`` may hold: ``limits.max_spare_bytes``,
        and at most 1/16 of the room its blocks may take (the CPU tier, its namespace's and
        its tenant's CPU quotas): making spare slots may evict, as a reservation may, so on a
        small tier or under a small quota they are not made at all rather than crowd out the
        blocks they are for."""
        room = self.config.cpu.capacity_bytes
        for books in (record.usage, record.owner):
            quota = books.quota.cpu_bytes if books is not None else 0
            if quota:
                room = min(room, quota)
        return min(self.limits.max_spare_bytes, room // 16)

    @property
    def spare_tier_bytes(self) -> int:
        """The spare slot bytes all handles together may hold, quarantined ones included: 1/8
        of the CPU tier, so that however many clients put at once (or open, put and close), slots
        reserved ahead never crowd out the blocks. First come, first served: a handle refused
        here puts in two calls (Reserve, Commit), as a lone put does."""
        return self.config.cpu.capacity_bytes // 8

    def spare_fits(self, handle: Handle, wanted: int) -> bool:
        """Whether ``wanted`` spare slots could ever be granted to ``handle``, whatever it and
        the others hold (a put of large blocks asks for more than the bounds allow: checked
        before any grant is tried or scheduled, so such puts pay nothing for asking)."""
        record = handle.record
        nbytes = wanted * record.cpu_bytes
        return (
            0 < wanted <= self.limits.max_keys_per_request
            and not record.cpu_codec
            and nbytes <= self.spare_bytes(record)
            and nbytes <= self.spare_tier_bytes
        )

    async def grant_spare(self, handle: Handle, wanted: int) -> int:
        """Reserve ``wanted`` spare slots for ``handle``'s next puts, all or none, as a
        reservation marked ``spare`` (its id; 0 when none), and note each slot's address in
        ``handle.spare_slots``. None for a namespace whose slots take payloads, past
        ``spare_bytes`` with those it holds, or when the reservation is refused (tier full,
        pinned share, too many reservations). Best effort: it raises nothing, since the call
        that asks has done its own work already."""
        record = handle.record
        if not self.spare_fits(handle, wanted) or not handle.writable or handle.closed:
            return 0
        # Grants under way count too: they may all wait at once (room being made).
        held = handle.spare_granting_slots
        held += sum(len(r.eids) for r in handle.reservations.values() if r.spare)
        nbytes = wanted * record.cpu_bytes
        if (held + wanted) * record.cpu_bytes > self.spare_bytes(record):
            return 0
        taken = (
            self.spare_reserved_bytes + self.spare_quarantined_bytes + self._spare_granting_bytes
        )
        if taken + nbytes > self.spare_tier_bytes:
            return 0
        prefix, count = self._spare_prefix, self._spare_count
        placeholders = [prefix + next(count).to_bytes(8, "little") for _ in range(wanted)]
        handle.spare_granting_slots += wanted
        self._spare_granting_bytes += nbytes
        try:
            result = await self.reserve(handle, placeholders, spare=True)
        except KVStoreError:
            return 0
        finally:
            handle.spare_granting_slots -= wanted
            self._spare_granting_bytes -= nbytes
        rid = result.reservation_id
        reservation = handle.reservations[rid]  # no await since it was made
        reservation.addresses = self.arena.addresses(result.offsets)
        handle.spare_slots.update(
            (address, (rid, eid))
            for address, eid in zip(reservation.addresses, reservation.eids, strict=True)
        )
        return rid

    def _forget_spare(self, handle: Handle, reservation: Reservation, until: float) -> None:
        """A spare reservation expired (or its handle closed) and its slots are quarantined
        until ``until``: they are no longer spare (a Bind naming them is refused), and count
        toward ``spare_tier_bytes`` until ``reap`` releases them."""
        for address in reservation.addresses:
            handle.spare_slots.pop(address, None)
        nbytes = len(reservation.eids) * handle.record.cpu_bytes
        self.spare_reserved_bytes -= nbytes
        self.spare_quarantined_bytes += nbytes
        heapq.heappush(self._spare_quarantine, (until, nbytes))

    def grant_spare_soon(self, handle: Handle, wanted: int) -> None:
        """``grant_spare`` in the background (one at a time per handle), for a later reply to
        hand out (``take_spare``): the slots are made while the client copies its next put."""
        if wanted <= 0 or handle.spare_granting or handle.closed:
            return
        handle.spare_granting = True

        async def grant() -> None:
            try:
                rid = await self.grant_spare(handle, wanted)
                if rid:
                    handle.spare_ready.append(rid)
            finally:
                handle.spare_granting = False

        def start() -> None:  # after the reply went out: a task costs the call nothing then
            if handle.closed:
                handle.spare_granting = False
                return
            task = asyncio.get_running_loop().create_task(grant())
            self._spare_tasks.add(task)
            task.add_done_callback(self._spare_tasks.discard)

        asyncio.get_running_loop().call_soon(start)

    def take_spare(self, handle: Handle) -> tuple[list[int], float]:
        """The addresses of the spare slots granted to ``handle`` and not handed out yet, and
        how long the client may write into them: half the time the soonest to expire has
        left, so a copy never lands in a slot reclaimed meanwhile. ([], 0) when none."""
        now = self._clock()
        addresses: list[int] = []
        left = float("inf")
        for rid in handle.spare_ready:
            reservation = handle.reservations.get(rid)
            if reservation is None or not reservation.spare or reservation.expires_at <= now:
                continue  # expired (or cut short) before it was handed out
            left = min(left, reservation.expires_at - now)
            addresses += reservation.addresses
        handle.spare_ready = []
        return addresses, (left / 2 if addresses else 0.0)

    async def bind(
        self,
        handle: Handle,
        keys: Sequence[bytes],
        slots: Sequence[int],
        checksums: Sequence[int],
        priority: int = -1,
        wait_s: float | None = None,
    ) -> BindResult:
        """A put in one call: commit ``keys[i]`` with the block its writer already copied into
        spare slot ``slots[i]`` (an address this handle was granted), bound to
        ``checksums[i]``. Keys present, repeated, or still being written by another client
        after the wait (as ``reserve``) are not written; their slots stay spare. Refused, with
        nothing changed, when a slot is named twice or is not a spare slot of this handle
        (expired, bound already, never granted: LeaseExpiredError)."""
        self.check_keys(keys, "bind")
        n = len(keys)
        if len(slots) != n or len(checksums) != n:
            raise ValueError(
                f"bind names {n} keys, {len(slots)} slots and {len(checksums)} checksums: it "
                "needs one slot and one checksum per key"
            )
        if len(set(slots)) != n:
            raise ValueError("bind names a spare slot twice: each key needs a slot of its own")
        record = handle.record
        priority = record.priority if priority < 0 else priority
        if priority > 255:
            raise ValueError(f"priority must be in [0, 255], got {priority}")
        spare = handle.spare_slots
        self._check_spare(spare, slots)  # before the keys are spent: a refusal costs none
        self.quotas.take_keys(record, n, handle.payer)
        wait = self.limits.write_wait_s if wait_s is None else wait_s
        pending = await self._wait_for_writers(record.ns_id, keys, wait)
        if handle.closed:
            raise UnknownNamespaceError("the namespace handle was closed during the call")
        # No await from here on: the slots are checked (again: they may have expired during
        # the wait) and bound together.
        self._check_spare(spare, slots)
        todo = self._new_positions(record.ns_id, keys)
        index = self.index
        if len(todo) == n:  # every key new (a put's usual case): no index lists to build
            bound = [spare.pop(address) for address in slots]
            new_keys, sums = keys, checksums
        else:
            bound = [spare.pop(slots[i]) for i in todo]
            new_keys, sums = [keys[i] for i in todo], [checksums[i] for i in todo]
        eids = [eid for _, eid in bound]  # (reservation id, entry)
        index.rekey_many(eids, new_keys)
        prio = index.priority
        for eid in eids:
            prio[eid] = priority
        for rid in {rid for rid, _ in bound}:
            self._take_spare_entries(handle, rid, {eid for r, eid in bound if r == rid})
        self._commit_cpu_entries(eids, sums)
        self.mover.note_committed(eids)
        self.shared.note_committed(eids)
        unbound = []
        if len(todo) < n:
            bound_at = set(todo)
            unbound = [slots[i] for i in range(n) if i not in bound_at]
        # Durable: the blocks bound now, and those of the keys found stored already.
        await self._persist_present(record.ns_id, keys)
        return BindResult(len(eids), pending, unbound)

    @staticmethod
    def _check_spare(spare: dict[int, tuple[int, int]], slots: Sequence[int]) -> None:
        missing = sum(1 for address in slots if address not in spare)
        if missing:
            raise LeaseExpiredError(
                f"{missing} of the {len(slots)} slots named are not spare slots of this handle "
                "(expired, bound already, or never granted): nothing was stored"
            )

    def _take_spare_entries(self, handle: Handle, rid: int, gone: set[int]) -> None:
        """Entries ``gone`` of spare reservation ``rid`` were bound: they leave it, and its
        pin (a reservation left empty goes)."""
        reservation = handle.reservations[rid]
        self.spare_reserved_bytes -= len(gone) * handle.record.cpu_bytes
        if len(gone) == len(reservation.eids):  # all of it (the usual case)
            del handle.reservations[rid]
            self._unpin(reservation.pin)
            return
        kept = [
            (e, a)
            for e, a in zip(reservation.eids, reservation.addresses, strict=True)
            if e not in gone
        ]
        reservation.eids = [e for e, _ in kept]
        reservation.addresses = [a for _, a in kept]
        if reservation.pin is not None:
            offsets = [self.index.offset[e] for e in gone]
            nbytes = len(gone) * handle.record.cpu_bytes
            self.quotas.unpin_part(reservation.pin, nbytes, self.quotas.slabs_of(offsets))

    def _bound(self, handle: Handle) -> Usage | None:
        """The books to bound ``handle``'s pins by (``Quotas.check_pin``): while it is the only
        open handle nobody else can be wedged, so it may pin what its tenant may."""
        return handle.books if len(self.names) > 1 else None

    def prefetch(self, handle: Handle, keys: list[bytes], gpu: bool = False) -> int:
        """Start promoting the run of ``keys`` (into the GPU pool with ``gpu``, for a caller
        that maps it; else into the CPU tier); returns how many blocks were queued."""
        self.check_keys(keys, "prefetch")
        if gpu and self._maps_pool(handle):
            return self.device.prefetch(handle.ns_id, keys, handle.payer)
        return self.mover.prefetch(handle.ns_id, keys, handle.payer)

    def _maps_pool(self, handle: Handle) -> bool:
        """Whether ``handle``'s caller may be given GPU pool slots: the pool is one undivided
        allocation, handed only to callers of every tenant (``OpenNamespace``); anyone else
        could only hold its slots and blocks, never use them."""
        principal = handle.principal
        return (
            self.device.enabled
            and getattr(principal, "all_tenants", True)
            and not handle.record.cpu_codec  # not built for payload entries
        )

    def _add_reservation(
        self,
        handle: Handle,
        keys: Sequence[bytes],
        todo: list[int],
        slots: list[int],
        priority: int,
        offsets: list[int],
        gpu: bool = False,
    ) -> int:
        """RESERVED entries for ``keys[todo[j]]`` in ``slots[j]`` (arena or, ``gpu``, pool
        slots), noted in ``offsets``; returns the new reservation's id. No await."""
        ns_id = handle.ns_id
        if gpu:
            eids = []
            for i, offset in zip(todo, slots, strict=False):
                eid = self.add_entry(keys[i], ns_id, 0, -1, priority)
                self.device.place(eid, offset)
                eids.append(eid)
        else:
            eids = self._add_cpu_entries(
                [keys[i] for i in todo], ns_id, slots[: len(todo)], priority
            )
        for i, offset in zip(todo, slots, strict=False):
            offsets[i] = offset
        reservation_id = handle.new_id(handle.reservations)
        arena_slots = [] if gpu else list(slots[: len(eids)])
        pin = self.quotas.pin(
            handle.record,
            "reservations",
            len(arena_slots) * handle.record.cpu_bytes,
            self.quotas.slabs_of(arena_slots),
            handle.books,
        )
        handle.reservations[reservation_id] = Reservation(
            eids, self._clock() + self.config.reservation_ttl_s, gpu=gpu, pin=pin
        )
        return reservation_id

    def add_entry(self, key: bytes, ns_id: int, tier: int, offset: int, priority: int) -> int:
        """A new RESERVED entry (counted as reserved and as one of its namespace's entries)."""
        eid = self.index.add(key, ns_id, tier, offset, priority)
        if tier & IN_CPU:
            self.cpu_slots.place(eid, offset, self.names[ns_id].cpu_bytes, clean=False)
            self.quotas.charge_cpu(self.names[ns_id], self.names[ns_id].cpu_bytes)
            self._note_payload(self.names[ns_id], +1)
        self.names[ns_id].entries += 1
        self._reserved_blocks += 1
        return eid

    def _add_cpu_entries(
        self, keys: list[bytes], ns_id: int, slots: list[int], priority: int
    ) -> list[int]:
        """``add_entry`` of each ``keys[j]`` in CPU slot ``slots[j]``, as one batch."""
        record = self.names[ns_id]
        eids = self.index.add_many(keys, ns_id, IN_CPU, slots, priority)
        self.cpu_slots.place_dirty(eids, slots)
        n = len(eids)
        self.quotas.charge_cpu(record, n * record.cpu_bytes)
        if record.cpu_codec:
            self.cpu_slots.payload_savings += n * (record.block_bytes - record.cpu_bytes)
        record.entries += n
        self._reserved_blocks += n
        return eids

    async def _reserve_gpu(
        self, handle: Handle, keys: Sequence[bytes], priority: int, offsets: list[int]
    ) -> int | None:
        """Reserve pool slots for the new keys (filling ``offsets``): the reservation id, 0 when
        every key is present, or None when the pool cannot take them all (use the CPU tier)."""
        bb = handle.record.block_bytes
        try:
            slots = await self.device.alloc(bb, len(self._new_positions(handle.ns_id, keys)))
        except (CapacityError, ValueError):
            return None
        todo = self._new_positions(handle.ns_id, keys)  # no await from here on
        if len(slots) < len(todo) or handle.closed:
            for offset in slots:
                self.device.unalloc(offset, bb)
            if handle.closed:
                raise UnknownNamespaceError("the namespace handle was closed during the call")
            return None
        for offset in slots[len(todo) :]:
            self.device.unalloc(offset, bb)
        if not todo:
            return 0
        return self._add_reservation(handle, keys, todo, slots, priority, offsets, gpu=True)

    def _new_positions(self, ns_id: int, keys: Sequence[bytes]) -> list[int]:
        """Positions of the keys to write: not indexed, first occurrence in the call."""
        ids = self.index.ids_of(ns_id)
        if len(set(keys)) == len(keys):  # no repeats (the common case): one test a key
            return [i for i, key in enumerate(keys) if key not in ids]
        todo: list[int] = []
        seen: set[bytes] = set()
        for i, key in enumerate(keys):
            if key not in seen and key not in ids:
                todo.append(i)
            seen.add(key)
        return todo

    def commit(
        self,
        handle: Handle,
        reservation_id: int,
        checksums: Sequence[int],
        device_checksums: Sequence[int] = (),
        codec: int = 0,
        payload_bytes: int = 0,
        payload_checksums: Sequence[int] = (),
    ) -> int:
        """Make a reservation's blocks visible. A CPU reservation carries each block's bound
        checksum (``checksums``), a GPU one their bound device checksums. A reservation of a
        ``cpu = "fp8"`` namespace names the codec and payload length its slots were given and
        each payload's checksum beside its decoded form's (``checksums``); a commit that does
        not match the namespace and reservation is refused (ValueError) and changes nothing."""
        reservation = handle.reservations.get(reservation_id)
        if reservation is None or reservation.spare:  # a spare one's id is never handed out
            raise LeaseExpiredError(
                f"reservation {reservation_id} is unknown to this handle or expired; nothing "
                "was stored"
            )
        record = handle.record
        want_codec = 0 if reservation.gpu else record.cpu_codec
        want_bytes = record.cpu_payload_bytes if want_codec else 0
        want_sums = len(reservation.eids) if want_codec else 0
        if (codec, payload_bytes, len(payload_checksums)) != (want_codec, want_bytes, want_sums):
            raise ValueError(
                f"commit names codec {codec}, {payload_bytes}-byte payloads and "
                f"{len(payload_checksums)} payload checksums; this reservation's slots take "
                + (
                    f"fp8 payloads (codec {want_codec}) of {want_bytes} bytes, one checksum each "
                    f"({want_sums})"
                    if want_codec
                    else "whole blocks (codec 0, no payload length or payload checksums)"
                )
                + ": nothing was stored"
            )
        given, other, kind = (
            (device_checksums, checksums, "device checksums")
            if reservation.gpu
            else (checksums, device_checksums, "checksums")
        )
        if len(given) != len(reservation.eids) or other:
            raise ValueError(
                f"commit carries {len(checksums)} checksums and {len(device_checksums)} device "
                f"checksums for {len(reservation.eids)} blocks of a "
                f"{'gpu' if reservation.gpu else 'cpu'} reservation: it needs one of the {kind} "
                "per block and none of the other"
            )
        del handle.reservations[reservation_id]
        self._unpin(reservation.pin)
        eids = reservation.eids
        for eid, payload_sum in zip(eids, payload_checksums, strict=False):
            self.payload_sums[eid] = payload_sum
        if reservation.gpu:
            for eid, checksum in zip(eids, given, strict=True):
                self._commit_entry(eid, 0)
                self.device.mark(eid, checksum)  # the host checksum is made with a CPU copy
            self.device.policy.touch(eids)
            self.device.note_committed(eids)
        else:
            self._commit_cpu_entries(eids, given)
            self.mover.note_committed(eids)
            self.shared.note_committed(eids)
        return len(eids)

    async def commit_durably(
        self,
        handle: Handle,
        reservation_id: int,
        checksums: Sequence[int],
        device_checksums: Sequence[int] = (),
        codec: int = 0,
        payload_bytes: int = 0,
        payload_checksums: Sequence[int] = (),
    ) -> int:
        """``commit``, acknowledged as ``nvme.durable_puts`` asks: with it, only once every
        block of the reservation is on disk and fdatasync'd (UnavailableError otherwise: the
        blocks are then readable but not durable, and the caller may retry the put)."""
        durable = self.config.nvme.durable_puts and self.nvme is not None
        reservation = handle.reservations.get(reservation_id) if durable else None
        eids = list(reservation.eids) if reservation is not None else []
        keys = [self.index.key(e) for e in eids]
        committed = self.commit(
            handle,
            reservation_id,
            checksums,
            device_checksums,
            codec,
            payload_bytes,
            payload_checksums,
        )
        if durable and eids:
            await self.persist(handle.ns_id, eids, keys)
        return committed

    async def _persist_present(self, ns_id: int, keys: Sequence[bytes]) -> None:
        """With ``nvme.durable_puts``, write to disk durably the blocks of ``keys`` that are
        committed but not on disk, or join their writes in flight (UnavailableError if one
        cannot be made durable). A put is acknowledged only once all its blocks are durable,
        those it found stored already included: a put that failed to persist, retried, found
        its blocks in memory and was acknowledged with none of them on disk; and a put racing
        another writer's durable put of a key was acknowledged before that write ended."""
        if not self.config.nvme.durable_puts or self.nvme is None:
            return
        ids, state, tier = self.index.ids_of(ns_id), self.index.state, self.index.tier
        eids, found = [], []
        for key in keys:
            eid = ids.get(key)
            if eid is not None and state[eid] == State.COMMITTED and not tier[eid] & IN_NVME:
                eids.append(eid)
                found.append(key)
        if eids:
            await self.persist(ns_id, eids, found)

    async def persist(self, ns_id: int, eids: list[int], keys: list[bytes]) -> None:
        """Write committed blocks to disk durably now (waiting for writes in flight); blocks
        deleted before it starts need nothing. UnavailableError if one could not be made
        durable, or is gone by the end without its write having succeeded: the daemon cannot
        tell a client's delete from an eviction (a failed write-back evicts), and a put is
        acknowledged only with its blocks on disk."""
        live = [(e, k) for e, k in zip(eids, keys, strict=True) if self.index.has_key(e, ns_id, k)]
        gpu_only = [e for e, _ in live if not self.index.tier[e] & (IN_CPU | IN_NVME)]
        if gpu_only:
            await self.device.to_cpu(gpu_only)
        results = await asyncio.gather(*(self.mover.flush(e, durable=True) for e, _ in live))
        lost = [
            k
            for (e, k), ok in zip(live, results, strict=True)
            if not ok and not (self.index.has_key(e, ns_id, k) and self.index.tier[e] & IN_NVME)
        ]
        if lost:
            raise UnavailableError(
                f"{len(lost)} of {len(eids)} blocks could not be made durable (the NVMe tier is "
                "full of leased blocks, or failing: see kvstore stat); those still stored are "
                "in memory, and a retry of the put writes them down"
            )

    def _commit_entry(self, eid: int, checksum: int) -> None:
        """RESERVED -> COMMITTED: the one place an entry becomes visible."""
        self.index.commit(eid, checksum)
        if self.index.tier[eid] & IN_CPU:
            self.policy.insert(eid, self.index.priority[eid])
        self._reserved_blocks -= 1
        record = self.names[self.index.ns[eid]]
        record.blocks += 1
        self._presence_add(record, (eid,))
        self._note_written(eid)

    def _commit_cpu_entries(self, eids: list[int], checksums: Sequence[int]) -> None:
        """``_commit_entry`` of a CPU reservation's entries (one namespace), then the policy's
        ``touch`` of them, as one batch."""
        index = self.index
        if not eids:
            return
        state, checksum_of = index.state, index.checksum
        for eid in eids:
            if state[eid] != State.RESERVED or not index.tier[eid] & IN_CPU:
                raise AssertionError(
                    f"commit of entry {eid} in state {State(state[eid]).name}, tier "
                    f"{index.tier[eid]}: a CPU reservation's entries are RESERVED in the CPU tier"
                )
        for eid, checksum in zip(eids, checksums, strict=True):
            state[eid] = State.COMMITTED
            checksum_of[eid] = checksum
        priority = index.priority
        self.policy.insert_touched(eids, [priority[e] for e in eids])
        self._reserved_blocks -= len(eids)
        record = self.names[index.ns[eids[0]]]
        record.blocks += len(eids)
        self._presence_add(record, eids)
        if self._written:  # someone waits for a block being written
            for eid in eids:
                self._note_written(eid)

    def commit_fetched(self, eid: int, checksum: int) -> None:
        """Make a block fetched from the shared tier into a RESERVED entry visible (the same
        transition as ``commit``; the fetch is a reservation the daemon itself holds)."""
        self._commit_entry(eid, checksum)
        self.mover.note_committed([eid])

    def commit_recovered(self, eid: int, checksum: int, disk_slot: int) -> None:
        """Make a block found on disk at start-up (a RESERVED entry just added) visible."""
        self._commit_entry(eid, checksum)
        self.mark_on_disk(eid, disk_slot)

    def discard_reserved(self, eid: int) -> None:
        self._free_entry(eid)

    def abort(self, handle: Handle, reservation_id: int) -> None:
        reservation = handle.reservations.get(reservation_id)
        if reservation is None or reservation.spare:  # a spare one's id is never handed out
            raise LeaseExpiredError(
                f"reservation {reservation_id} is unknown to this handle or expired"
            )
        del handle.reservations[reservation_id]
        for eid in reservation.eids:
            self._free_entry(eid)
        self._unpin(reservation.pin)

    async def put_block(
        self,
        handle: Handle,
        key: bytes,
        chunks: Sequence[bytes],
        checksum: int,
        priority: int = -1,
    ) -> bool:
        """The bytes path: store one block whose bytes arrived over gRPC in ``chunks``. The
        client's checksum (bound to namespace and key) is verified against what was copied
        into the slot before the block is committed. True if newly stored."""
        record = handle.record
        size = sum(len(c) for c in chunks)
        if size != record.block_bytes:
            raise ValueError(
                f"block for key {key.hex()[:16]}… is {size} bytes, "
                f"the namespace's blocks are {record.block_bytes}"
            )
        if record.cpu_codec:
            return await self._put_block_encoded(handle, key, b"".join(chunks), checksum, priority)
        reserved = await self.reserve(handle, [key], priority)
        if not reserved.reservation_id:
            return False
        offset = reserved.offsets[0]
        view = self.arena.view
        for chunk in chunks:
            view[offset : offset + len(chunk)] = chunk
            offset += len(chunk)
        data = view[reserved.offsets[0] : reserved.offsets[0] + size]
        if block_checksum(data, record.fingerprint, key) != checksum:
            self.abort(handle, reserved.reservation_id)
            raise ValueError(
                f"block for key {key.hex()[:16]}… does not match its checksum: not stored"
            )
        await self.commit_durably(handle, reserved.reservation_id, [checksum])
        return True

    async def _put_block_encoded(
        self, handle: Handle, key: bytes, block: bytes, checksum: int, priority: int
    ) -> bool:
        """``put_block`` into a ``cpu = "fp8"`` namespace: the block is verified, then encoded
        here (off the loop) into its payload slot, and committed with the checksums of the
        payload and of its decoded form, as a client's arena put would."""
        record = handle.record
        fingerprint = record.fingerprint
        if await asyncio.to_thread(block_checksum, block, fingerprint, key) != checksum:
            raise ValueError(
                f"block for key {key.hex()[:16]}… does not match its checksum: not stored"
            )
        reserved = await self.reserve(handle, [key], priority)
        if not reserved.reservation_id:
            return False
        offset = reserved.offsets[0]
        slot = self.arena.view[offset : offset + record.cpu_bytes]
        fmt = block_format_of(record.namespace.layout) if record.namespace else None
        # Encoded and hashed in private memory: the checksums vouch for this block whatever
        # writes into the shared slot, and the thread never touches the slot, so a put given
        # up meanwhile (its slot freed, maybe reused) cannot write into another block.
        private = memoryview(bytearray(record.cpu_bytes))
        try:
            assert fmt is not None  # a namespace with an fp8 cpu codec has a known format
            sums = await asyncio.to_thread(encode_payload, block, fmt, private, fingerprint, key)
        except BaseException:
            # Aborted unless it is gone already (reaped, its handle closed): an abort of it
            # would raise in place of what ended the encode.
            if reserved.reservation_id in handle.reservations:
                self.abort(handle, reserved.reservation_id)
            raise
        if reserved.reservation_id in handle.reservations:  # still live: no await until commit
            slot[:] = private
        await self.commit_durably(
            handle,
            reserved.reservation_id,
            [sums[0]],
            codec=record.cpu_codec,
            payload_bytes=record.cpu_payload_bytes,
            payload_checksums=[sums[1]],
        )
        return True

    # ----------------------------------------------------------------- slots and removal
    def cpu_alloc(self, block_bytes: int, domain: int = 0) -> int | None:
        """A CPU slot in memory ``domain``, counted as used; None when none is free (or its
        slab could not be backed)."""
        return self.cpu_slots.alloc(block_bytes, domain)

    def cpu_unalloc(self, offset: int, block_bytes: int) -> None:
        """Give back a slot from ``cpu_alloc`` that no entry took."""
        self.cpu_slots.unalloc(offset, block_bytes)

    def drop_cpu_copy(self, eid: int) -> None:
        """Free an entry's CPU slot; it must have a disk or GPU copy (it stays findable there)."""
        if not self.index.tier[eid] & (IN_NVME | IN_GPU):
            raise AssertionError(f"dropping the only copy of entry {eid}")
        self._free_cpu_slot(eid)
        self.policy.remove(eid)

    def drop_disk_copy(self, eid: int) -> None:
        """Free an entry's disk slot; it must have a CPU or GPU copy (it becomes dirty again)."""
        if not self.index.tier[eid] & (IN_CPU | IN_GPU):
            raise AssertionError(f"dropping the only copy of entry {eid}")
        self._free_disk_slot(eid)
        self.nvme_policy.remove(eid)

    def _free_cpu_slot(self, eid: int) -> None:
        clean = bool(self.index.tier[eid] & IN_NVME)
        record = self.names[self.index.ns[eid]]
        if (
            record.presence is not None
            and self.index.state[eid] == State.COMMITTED  # an orphan's key left with forget
        ):
            # Before the slot can go to another block: readers of the table ask from now on.
            places, _ = self._places_of(record, (eid,))
            if places:
                record.presence.unlocate(self.index.key(eid), places[0])
        self.cpu_slots.vacate(self.index.offset[eid], record.cpu_bytes, clean)
        self.quotas.charge_cpu(record, -record.cpu_bytes)
        self._note_payload(record, -1)
        self.payload_sums.pop(eid, None)
        self.index.offset[eid] = -1
        self.index.tier[eid] &= ~IN_CPU

    def disk_owner(self, slot: int) -> int | None:
        """The entry whose disk copy is in ``slot`` (None: a slot being written)."""
        return self.disk.owner(slot)

    def _free_disk_slot(self, eid: int) -> None:
        self.disk.vacate(self.index.disk[eid])
        record = self.names[self.index.ns[eid]]
        self.quotas.charge_nvme(record, -record.block_bytes)
        if self.index.tier[eid] & IN_CPU:
            self.cpu_slots.note_clean(self.cpu_bytes_of(eid), clean=False)
        self.index.disk[eid] = -1
        self.index.tier[eid] &= ~IN_NVME

    def mark_on_disk(self, eid: int, slot: int) -> None:
        self.disk.place(eid, slot)
        record = self.names[self.index.ns[eid]]
        self.quotas.charge_nvme(record, record.block_bytes)
        self.index.disk[eid] = slot
        self.index.tier[eid] |= IN_NVME
        if self.index.tier[eid] & IN_CPU:
            self.cpu_slots.note_clean(self.cpu_bytes_of(eid), clean=True)
        self.nvme_policy.insert(eid, self.index.priority[eid])

    def mark_in_redis(self, eid: int) -> None:
        """This host wrote the block to the shared tier."""
        self.index.tier[eid] |= IN_REDIS

    def mark_in_gpu(self, eid: int) -> None:
        self.index.tier[eid] |= IN_GPU

    def unmark_in_gpu(self, eid: int) -> None:
        self.index.tier[eid] &= ~IN_GPU

    def set_host_checksum(self, eid: int, checksum: int) -> None:
        """The checksum of a block's first host copy (a GPU block copied down)."""
        self.index.checksum[eid] = checksum

    def cpu_owner(self, offset: int) -> int | None:
        """The entry whose CPU copy is in slot ``offset`` (None: a quarantined slot)."""
        return self.cpu_slots.owner(offset)

    def relocate_cpu(self, eid: int, avoid_slab: int) -> bool:
        """Move a committed, unleased block to a free slot of its class outside ``avoid_slab``
        (a slab being drained), verified against its checksum. False when its class has no
        such free slot; a block that fails verification is dropped (a miss, counted)."""
        index = self.index
        if index.state[eid] != State.COMMITTED or index.leases[eid]:
            return False
        new = self.cpu_slots.relocate(
            eid,
            index.offset[eid],
            self.cpu_bytes_of(eid),
            avoid_slab,
            self.fingerprint_of(eid),
            index.key(eid),
            self.payload_sums.get(eid, 0)
            if self.names[index.ns[eid]].cpu_codec
            else index.checksum[eid],
        )
        if new is None:
            return False
        if new < 0:  # the block was damaged where it was
            self.cpu.checksum_failures += 1
            self.forget(eid)  # its slot is free all the same
            return True
        index.offset[eid] = new
        self._presence_locate(eid)
        return True

    def mark_in_cpu(self, eid: int, offset: int) -> None:
        clean = bool(self.index.tier[eid] & IN_NVME)
        record = self.names[self.index.ns[eid]]
        self.cpu_slots.place(eid, offset, record.cpu_bytes, clean)
        self.quotas.charge_cpu(record, record.cpu_bytes)
        self._note_payload(record, +1)
        self.index.offset[eid] = offset
        self.index.tier[eid] |= IN_CPU
        self.policy.insert(eid, self.index.priority[eid])
        self._presence_locate(eid)

    def forget(self, eid: int) -> None:
        """Remove a committed entry from every tier (evicted from the last tier holding it, or
        found corrupt). A leased entry keeps its slots until its last lease goes."""
        if self.index.state[eid] != State.COMMITTED:
            raise AssertionError(
                f"forget of entry {eid} in state {State(self.index.state[eid]).name}"
            )
        if self.index.tier[eid] & IN_CPU:
            self.policy.remove(eid)
        if self.index.tier[eid] & IN_NVME:
            self.nvme_policy.remove(eid)
        if self.index.tier[eid] & IN_GPU:
            self.device.forget_hook(eid)
        record = self.names[self.index.ns[eid]]
        record.blocks -= 1
        if record.presence is not None:
            record.presence.remove(self.index.key(eid))
        if self.index.leases[eid]:
            self.index.orphan(eid)
        else:
            self._free_entry(eid)

    def delete(self, handle: Handle, keys: Sequence[bytes]) -> int:
        self.check_keys(keys, "delete")
        deleted = 0
        for key in dict.fromkeys(keys):  # a repeated key is deleted once
            eid = self._committed(handle.ns_id, key)
            if eid is not None:
                self.forget(eid)
                deleted += 1
        return deleted

    def _quarantine_slots(self, eid: int, until: float, pin: Pin | None) -> None:
        """Take a reserved entry's slots away from it without freeing them (see ``reap``); they
        stay counted as used, and as pinned by its tenant (``pin``), until ``until``."""
        # A namespace whose CPU entries are payloads never uses the GPU pool: one size serves.
        index, bb = self.index, self.cpu_bytes_of(eid)
        if index.tier[eid] & IN_CPU:
            heapq.heappush(self._quarantine, (until, False, index.offset[eid], bb, pin))
            self.cpu_slots.quarantine(index.offset[eid], bb)
            self._note_payload(self.names[index.ns[eid]], -1)
            self.payload_sums.pop(eid, None)
            index.offset[eid] = -1
            index.tier[eid] &= ~IN_CPU
        if index.tier[eid] & IN_GPU:
            slot = self.device.take_slot_away(eid)
            heapq.heappush(self._quarantine, (until, True, slot, bb, None))
            index.tier[eid] &= ~IN_GPU

    def _free_entry(self, eid: int) -> None:
        """Free every slot an entry holds and forget it. Does not touch the policies."""
        state = self.index.state[eid]
        if self.index.tier[eid] & IN_CPU:
            self._free_cpu_slot(eid)
        if self.index.tier[eid] & IN_NVME:
            self._free_disk_slot(eid)
        if self.index.tier[eid] & IN_GPU:
            self.device.free_slot(eid)
        if state == State.RESERVED:
            self._reserved_blocks -= 1
        record = self.names[self.index.ns[eid]]
        self.index.drop(eid)
        if state == State.RESERVED:
            self._note_written(eid)  # waiters see the key free and may write it themselves
        record.entries -= 1
        self.names.maybe_free(record)
        self._maybe_forget_books(record)

    def _expire_reservation(self, reservation: Reservation, now: float) -> float:
        """A reservation (taken out of its handle) ends unused at ``now``: its entries go, and
        its slots stay quarantined, still pinned, for one more ``reservation_ttl_s`` (a
        shortened or spare one's: ``pin_grace_s``, if less), in case its writer copies late.
        Returns when the quarantine ends."""
        if reservation.pin is not None:
            self.quotas.uncount(reservation.pin)  # its slots stay pinned, quarantined
        # A shortened one (``_shorten_excess``) frees its room for a newcomer sooner.
        quarantine_s = self.config.reservation_ttl_s
        if reservation.shortened:
            quarantine_s = min(quarantine_s, self.limits.pin_grace_s)
        until = now + quarantine_s
        for eid in reservation.eids:
            self._quarantine_slots(eid, until, reservation.pin)
            self._free_entry(eid)
        return until

    def reap(self) -> tuple[int, int]:
        """Reclaim expired reservations and leases: (reservations, leases) reclaimed.

        The slots of an expired reservation are quarantined for one more ``reservation_ttl_s``
        before reuse: its writer may be alive but stalled, and could resume copying into them.
        A late copy into a reused slot cannot pass for the new owner's block (checksums are
        computed from what the writer copied, and readers verify them), but it would turn that
        block into a miss; the quarantine keeps such late copies harmless."""
        now = self._clock()
        spare_quarantine = self._spare_quarantine  # released with their slots, just below
        while spare_quarantine and spare_quarantine[0][0] <= now:
            self.spare_quarantined_bytes -= heapq.heappop(spare_quarantine)[1]
        while self._quarantine and self._quarantine[0][0] <= now:
            _, gpu, offset, block_bytes, pin = heapq.heappop(self._quarantine)
            if gpu:
                self.device.unalloc(offset, block_bytes)
            else:
                self.cpu_slots.release_quarantined(offset, block_bytes)
                if pin is not None:
                    self.quotas.unpin(pin, block_bytes, self.quotas.slabs_of([offset]))
                    for books in pin.books:
                        books.cpu_bytes -= block_bytes
        reservations = leases = 0
        for handle in self.names.handles():
            for rid in [r for r, v in handle.reservations.items() if v.expires_at <= now]:
                reservation = handle.reservations.pop(rid)
                until = self._expire_reservation(reservation, now)
                if reservation.spare:
                    self._forget_spare(handle, reservation, until)
                reservations += 1
            for lid in [lid for lid, v in handle.leases.items() if v.expires_at <= now]:
                lease = handle.leases.pop(lid)
                for eid in lease.eids:
                    self._drop_one_lease(eid)
                self._unpin(lease.pin)
                leases += 1
            for lease in handle.leases.values():
                if lease.cut is not None and lease.cut_expires_at <= now:
                    self._end_cut(lease)
        return reservations, leases

    def _end_cut(self, lease: Lease) -> None:
        """The cut part of a lease (``Lease.cut``) expired: its blocks are no longer leased;
        its leading part stays leased until the lease's own expiry."""
        assert lease.cut is not None
        gone = lease.eids[lease.cut :]
        del lease.eids[lease.cut :], lease.keys[lease.cut :]
        lease.cut = None
        if lease.pin is not None:
            self.quotas.unpin_leased(lease.pin, gone)
        for eid in gone:
            self._drop_one_lease(eid)

    # ----------------------------------------------------------------- the checker
    def check(self, io_idle: bool = True) -> None:
        """Assert the invariants of the module docstring and of every part's books;
        AssertionError names the first one broken. ``io_idle``: no IO is in flight (lease
        counts and byte totals must then be exact)."""
        from kvstore.daemon.invariants import check_store

        check_store(self, io_idle)

    # ----------------------------------------------------------------- stats
    @property
    def active_leases(self) -> int:
        return sum(len(h.leases) for h in self.names.handles())

    @property
    def active_reservations(self) -> int:
        return sum(len(h.reservations) for h in self.names.handles())

    @property
    def reserved_blocks(self) -> int:
        return self._reserved_blocks

    @property
    def open_handles(self) -> int:
        return len(self.names)

    @property
    def cpu_used_bytes(self) -> int:
        return self.cpu_slots.used_bytes

    @property
    def cpu_clean_bytes(self) -> int:
        return self.cpu_slots.clean_bytes

    def tier_snapshots(self) -> list[TierSnapshot]:
        """Occupancy and counters of every tier, top down (``Stats``, the metrics)."""
        from kvstore.daemon.snapshots import tier_snapshots

        return tier_snapshots(self)

    def namespace_tier_bytes(self) -> dict[bytes, list[tuple[str, int, int, int, str]]]:
        """By namespace fingerprint: (tier, blocks, logical, stored bytes, codec) in the tiers
        below the CPU tier (``Stats``, the metrics)."""
        from kvstore.daemon.snapshots import namespace_tier_bytes

        return namespace_tier_bytes(self)

    def namespaces(self) -> list[NamespaceRecord]:
        return [r for r in self.names.records() if r.namespace is not None or r.blocks]
