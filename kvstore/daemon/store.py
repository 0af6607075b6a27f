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
from typing import TYPE_CHECKING

from kvstore.checksum import block_checksum
from kvstore.config import DaemonConfig
from kvstore.daemon.auth import Principal
from kvstore.daemon.cpu_tier import CpuSlots
from kvstore.daemon.device import DeviceTier, make_device_pool
from kvstore.daemon.invariants import SpareBooks, check_store
from kvstore.daemon.ledger import Ledger, gather
from kvstore.daemon.movement import Mover
from kvstore.daemon.namespaces import (
    Handle,
    Lease,
    NamespaceRecord,
    NamespaceTable,
    Reservation,
)
from kvstore.daemon.quotas import Quotas, Usage
from kvstore.daemon.shared import SharedTier
from kvstore.daemon.snapshots import namespace_tier_bytes, tier_snapshots
from kvstore.daemon.tierstats import TierCounters, TierSnapshot
from kvstore.errors import (
    CapacityError,
    KVStoreError,
    LeaseExpiredError,
    UnavailableError,
    UnknownNamespaceError,
)
from kvstore.index import IN_CPU, IN_GPU, IN_NVME, BlockIndex, State
from kvstore.keys import KEY_BYTES, Namespace, SplitKeys
from kvstore.policy import EvictionPolicy
from kvstore.presence import PresenceTable
from kvstore.tiers.codecs import (
    block_format_of,
    decode,
    encode_payload,
)
from kvstore.tiers.cpu import SharedMemoryArena, SlabAllocator

if TYPE_CHECKING:
    from kvstore.tiers.gpu import DevicePool
    from kvstore.tiers.nvme import NvmeTier


log = logging.getLogger(__name__)

# lookup's hit counts: tier byte -> 1 where the block is in the GPU tier / in CPU but not GPU.
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
        self.ledger = Ledger(config, clock)
        try:
            pool = gpu_pool if gpu_pool is not None else make_device_pool(config.gpu)
        except BaseException:
            self.ledger.close()
            raise
        # The tiers get the ledger and their neighbours, never the store: the CPU tier's
        # room-maker and the NVMe movement (``Mover``) spill into Redis, Redis fetches into
        # CPU slots the Mover makes room for, and the GPU tier copies down through the Mover.
        self.mover = Mover(self.ledger)
        self.shared = SharedTier(
            self.ledger, cpu_room=self.mover.alloc_cpu, on_fetched=self.mover.note_committed
        )
        self.mover.spill = self.shared
        self.device = DeviceTier(self.ledger, pool, host=self.mover, shared=self.shared)
        self.ledger.gpu = self.device

    # Read access to the ledger's parts (Stats, the metrics, the tests); every change to them
    # is a ledger method.
    @property
    def index(self) -> BlockIndex:
        return self.ledger.index

    @property
    def names(self) -> NamespaceTable:
        return self.ledger.names

    @property
    def quotas(self) -> Quotas:
        return self.ledger.quotas

    @property
    def policy(self) -> EvictionPolicy:
        return self.ledger.policy

    @property
    def nvme_policy(self) -> EvictionPolicy:
        return self.ledger.nvme_policy

    @property
    def cpu_slots(self) -> CpuSlots:
        return self.ledger.cpu_slots

    @property
    def payload_sums(self) -> dict[int, int]:
        return self.ledger.payload_sums

    @property
    def arena(self) -> SharedMemoryArena:
        return self.ledger.arena

    @property
    def allocator(self) -> SlabAllocator:
        return self.ledger.allocator

    @property
    def cpu(self) -> TierCounters:
        return self.ledger.cpu

    @property
    def nvme(self) -> NvmeTier | None:
        return self.ledger.nvme

    @property
    def nvme_counters(self) -> TierCounters:
        return self.ledger.nvme_counters

    @property
    def redis_counters(self) -> TierCounters:
        return self.ledger.redis_counters

    @property
    def cpu_used_bytes(self) -> int:
        return self.ledger.cpu_used_bytes

    @property
    def reserved_blocks(self) -> int:
        return self.ledger.reserved_blocks

    def block_bytes_of(self, eid: int) -> int:
        return self.ledger.block_bytes_of(eid)

    def leading_run(self, ns_id: int, keys: Sequence[bytes]) -> list[int]:
        return self.ledger.leading_run(ns_id, keys)

    def presence(self, handle: Handle) -> PresenceTable:
        """The presence table of ``handle``'s namespace (``Ledger.presence``)."""
        return self.ledger.presence(handle.record)

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
        for handle in self.ledger.names.handles():
            self.close_handle(handle)
        await self.device.stop()
        await self.shared.stop()
        await self.mover.stop()
        self.close()

    def close(self) -> None:
        self.device.close()  # first: it unpins the arena the ledger's CPU slots unmap
        self.ledger.close()

    # ----------------------------------------------------------------- namespaces and handles
    def open_namespace(
        self, namespace: Namespace, priority: int = 0, principal: Principal | None = None
    ) -> Handle:
        """Register or join a namespace and hand out a new handle to it (``NamespaceTable``)
        for ``principal`` (``kvstore.daemon.auth.Principal``; None: a caller of every tenant),
        whose own budget its keys and leases are charged to (``Quotas.payer``)."""
        self.ledger.allocator.check_fits(namespace.layout.block_bytes)
        writer = principal is None or principal.may_write(namespace.tenant)
        handle = self.ledger.names.open(namespace, priority, writer)
        record = handle.record
        if not record.cpu_codec_set:
            record.cpu_codec_set = True
            record.cpu_codec, record.cpu_payload_bytes = self.ledger.cpu_codec_for(namespace)
            self.ledger.drop_lossy_records(record)
        handle.books = self.ledger.quotas.handle_books()
        if handle.record.usage is None:
            self.ledger.quotas.new_books(handle.record)
        else:
            self.ledger.quotas.bind(handle.record)
        handle.principal = principal
        handle.payer = self.ledger.quotas.payer(handle.record, principal)
        if handle.books is not None and len(self.ledger.names) == 2:
            # The bound of one handle's pins starts now (``_bound``): a handle pins past it
            # only while alone, so the other one is the only handle that may be past it.
            for other in self.ledger.names.handles():
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
        bound = self.ledger.quotas.handle_pinned
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

    def handle(self, token: bytes) -> Handle:
        """The open handle ``token`` names; UnknownNamespaceError for anything else."""
        return self.ledger.names.handle(token)

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
                self.ledger.free_entry(eid)
            self.ledger.release_pin(reservation.pin)
        for lease in leases:
            for eid in lease.eids:
                self.ledger.drop_lease(eid)
            self.ledger.release_pin(lease.pin)
        self.ledger.names.release(handle)
        self.ledger.maybe_forget_books(handle.record)
        self.ledger.quotas.unpay(handle.payer)
        handle.payer = None
        return len(reservations), len(leases)

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

    # ----------------------------------------------------------------- reads

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
        ids = self.ledger.index.ids_of(handle.ns_id)
        state = self.ledger.index.state
        eids = [e for e in map(ids.get, keys) if e is not None and state[e] == State.COMMITTED]
        if not eids:
            return
        tiers = self.ledger.index.tier
        self.mover.note_read(eids)
        self.ledger.policy.touch([e for e in eids if tiers[e] & IN_CPU])
        self.device.note_read(eids)

    async def lookup(self, handle: Handle, keys: Sequence[bytes]) -> int:
        self.check_keys(keys, "lookup")
        _distinct(keys, "lookup")  # a repeat would count as found (and as hits) each time
        record = handle.record
        self.ledger.quotas.take_keys(record, len(keys), handle.payer)
        ns_id = record.ns_id
        run = self.ledger.leading_run(ns_id, keys)
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
        run_tiers = gather(self.ledger.index.tier, run)  # counted in C, by translation tables
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
        self.ledger.cpu.hits += in_cpu
        self.ledger.cpu.misses += keys - in_gpu - in_cpu
        if self.ledger.nvme is not None:
            self.ledger.nvme_counters.hits += local - in_gpu - in_cpu
            self.ledger.nvme_counters.misses += keys - local
        if self.shared.enabled:
            self.ledger.redis_counters.hits += shared
            self.ledger.redis_counters.misses += keys - found

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
        self.ledger.quotas.take_keys(record, len(keys), handle.payer)
        self.ledger.quotas.check_pin(record, "leases", 0, payer=handle.payer)
        ns_id = record.ns_id
        wait = self.limits.write_wait_s if wait_s is None else wait_s
        eids = self.ledger.leading_run(ns_id, keys)
        pending = False
        if len(eids) < len(keys):
            eid = self.ledger.index.get(ns_id, keys[len(eids)])
            if eid is not None and self.ledger.index.state[eid] == State.RESERVED:
                # Read your writes: another client is committing this very block.
                pending = await self.ledger.wait_for_writers(ns_id, [keys[len(eids)]], wait) > 0
                eids = self.ledger.leading_run(ns_id, keys)
        # ``held`` is exactly what this call holds leases on: a call cancelled (a client's
        # deadline) or failing anywhere gives them back, since no lease id exists yet that
        # a release or close could reclaim.
        held: list[int] = []
        try:
            for eid in eids:  # pin the whole run before anything awaits
                self.ledger.add_lease(eid)
                held.append(eid)
            local_run = len(eids)
            tiers = self.ledger.index.tier
            gpu = gpu and self._maps_pool(handle)
            if not gpu:
                gpu_only = [e for e in eids if tiers[e] & IN_GPU and not tiers[e] & IN_CPU]
                if gpu_only:
                    await self.device.to_cpu(gpu_only, partial=True)  # as many as fit
            await self.mover.bring_to_cpu([e for e in eids if not (gpu and tiers[e] & IN_GPU)])
            ready = len(eids)
            for i, eid in enumerate(eids):
                servable = tiers[eid] & IN_CPU or (gpu and tiers[eid] & IN_GPU)
                if self.ledger.index.state[eid] != State.COMMITTED or not servable:
                    ready = i
                    break
            for eid in held[ready:]:
                self.ledger.drop_lease(eid)
            del held[ready:]
            eids = eids[:ready]
            if ready == local_run < len(keys) and self.shared.enabled and not pending:
                # The local run ended at a missing block: the shared tier may hold the rest.
                fetched = await self.shared.fetch(record, list(keys[ready:]))
                for eid in fetched:  # committed just now, no await since: lease them at once
                    self.ledger.add_lease(eid)
                    held.append(eid)
                eids = eids + fetched
        except BaseException:
            for eid in held:
                self.ledger.drop_lease(eid)
            raise
        if handle.closed:  # the client went away while this call waited
            for eid in held:
                self.ledger.drop_lease(eid)
            raise UnknownNamespaceError("the namespace handle was closed during the call")
        if not eids:
            return AcquireResult(0, [], [], [], pending)
        on_gpu = [bool(gpu and tiers[e] & IN_GPU) for e in eids]
        arena_eids = [e for e, g in zip(eids, on_gpu, strict=True) if not g]
        in_arena = [self.ledger.index.offset[e] for e in arena_eids]
        slabs = self.ledger.quotas.slabs_of(in_arena)
        try:
            # One tenant may pin only its share: the rest of the tier stays evictable.
            self.ledger.quotas.check_pin(
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
                self.ledger.drop_lease(eid)
            raise
        pin = self.ledger.quotas.pin(
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
        self.ledger.policy.touch(
            [e for e in eids if tiers[e] & IN_CPU and self.ledger.index.state[e] == State.COMMITTED]
        )
        self.device.note_read(eids)
        lease_id = handle.new_id(handle.leases)
        handle.leases[lease_id] = Lease(
            eids, list(keys[: len(eids)]), self._clock() + self.config.lease_ttl_s, pin
        )
        offsets = [
            self.device.offset[e] if g else self.ledger.index.offset[e]
            for e, g in zip(eids, on_gpu, strict=True)
        ]
        checksums = [
            self.device.dsum[e] if g else self.ledger.index.checksum[e]
            for e, g in zip(eids, on_gpu, strict=True)
        ]
        result = AcquireResult(lease_id, offsets, checksums, on_gpu, pending)
        if record.cpu_codec:  # every block is an arena payload (such a namespace has no pool)
            result.codecs = [record.cpu_codec] * len(eids)
            result.payload_checksums = [self.ledger.payload_sums.get(e, 0) for e in eids]
        return result

    def release(self, handle: Handle, lease_id: int) -> None:
        lease = handle.leases.pop(lease_id, None)
        if lease is None:
            raise LeaseExpiredError(f"lease {lease_id} is unknown to this handle or expired")
        for eid in lease.eids:
            self.ledger.drop_lease(eid)
        self.ledger.release_pin(lease.pin)

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
        index = self.ledger.index
        if (
            not index.has_key(eid, handle.ns_id, key)
            or index.state[eid] != State.COMMITTED
            or not index.tier[eid] & IN_CPU
        ):
            raise LeaseExpiredError(f"block {i} of lease {lease_id} no longer holds its key")
        record = handle.record
        offset = index.offset[eid]
        slot = self.ledger.arena.view[offset : offset + record.cpu_bytes]
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
            self.ledger.quotas.take_keys(record, len(keys), handle.payer)
        self.ledger.quotas.check_pin(record, "reservations", 0)
        if not record.entries and record.namespace is not None:
            # Its first block: past its tenant's share of namespaces holding blocks, refused.
            self.ledger.names.check_share(record.namespace.tenant, handle.principal, record)
        wait = self.limits.write_wait_s if wait_s is None else wait_s
        pending = 0 if spare else await self.ledger.wait_for_writers(record.ns_id, keys, wait)
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
                self.ledger.quotas.check_pin(
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
                self.ledger.cpu_unalloc(offset, bb)
            raise
        # No await from here on.
        for offset in slots[len(todo) :]:
            self.ledger.cpu_unalloc(offset, bb)
        del slots[len(todo) :]
        if not todo:
            return ReserveResult(0, offsets, False, pending)
        try:
            # Now the slabs are known: with memory domains a pin counts whole slabs.
            slabs = self.ledger.quotas.slabs_of(slots)
            self.ledger.quotas.check_pin(
                record, "reservations", len(todo) * bb, slabs, self._bound(handle)
            )
        except CapacityError:
            for offset in slots:
                self.ledger.cpu_unalloc(offset, bb)
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
        reservation.addresses = self.ledger.arena.addresses(result.offsets)
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
        self.ledger.quotas.take_keys(record, n, handle.payer)
        wait = self.limits.write_wait_s if wait_s is None else wait_s
        pending = await self.ledger.wait_for_writers(record.ns_id, keys, wait)
        if handle.closed:
            raise UnknownNamespaceError("the namespace handle was closed during the call")
        # No await from here on: the slots are checked (again: they may have expired during
        # the wait) and bound together.
        self._check_spare(spare, slots)
        todo = self._new_positions(record.ns_id, keys)
        if len(todo) == n:  # every key new (a put's usual case): no index lists to build
            bound = [spare.pop(address) for address in slots]
            new_keys, sums = keys, checksums
        else:
            bound = [spare.pop(slots[i]) for i in todo]
            new_keys, sums = [keys[i] for i in todo], [checksums[i] for i in todo]
        eids = [eid for _, eid in bound]  # (reservation id, entry)
        self.ledger.key_spare_entries(eids, new_keys, priority)
        for rid in {rid for rid, _ in bound}:
            self._take_spare_entries(handle, rid, {eid for r, eid in bound if r == rid})
        self.ledger.commit_cpu_entries(eids, sums)
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
            self.ledger.release_pin(reservation.pin)
            return
        kept = [
            (e, a)
            for e, a in zip(reservation.eids, reservation.addresses, strict=True)
            if e not in gone
        ]
        reservation.eids = [e for e, _ in kept]
        reservation.addresses = [a for _, a in kept]
        if reservation.pin is not None:
            offsets = [self.ledger.index.offset[e] for e in gone]
            nbytes = len(gone) * handle.record.cpu_bytes
            self.ledger.quotas.unpin_part(
                reservation.pin, nbytes, self.ledger.quotas.slabs_of(offsets)
            )

    def _bound(self, handle: Handle) -> Usage | None:
        """The books to bound ``handle``'s pins by (``Quotas.check_pin``): while it is the only
        open handle nobody else can be wedged, so it may pin what its tenant may."""
        return handle.books if len(self.ledger.names) > 1 else None

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
                eid = self.ledger.add_entry(keys[i], ns_id, 0, -1, priority)
                self.device.place(eid, offset)
                eids.append(eid)
        else:
            eids = self.ledger.add_cpu_entries(
                [keys[i] for i in todo], ns_id, slots[: len(todo)], priority
            )
        for i, offset in zip(todo, slots, strict=False):
            offsets[i] = offset
        reservation_id = handle.new_id(handle.reservations)
        arena_slots = [] if gpu else list(slots[: len(eids)])
        pin = self.ledger.quotas.pin(
            handle.record,
            "reservations",
            len(arena_slots) * handle.record.cpu_bytes,
            self.ledger.quotas.slabs_of(arena_slots),
            handle.books,
        )
        handle.reservations[reservation_id] = Reservation(
            eids, self._clock() + self.config.reservation_ttl_s, gpu=gpu, pin=pin
        )
        return reservation_id

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
        ids = self.ledger.index.ids_of(ns_id)
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
        self.ledger.release_pin(reservation.pin)
        eids = reservation.eids
        for eid, payload_sum in zip(eids, payload_checksums, strict=False):
            self.ledger.set_payload_sum(eid, payload_sum)
        if reservation.gpu:
            for eid, checksum in zip(eids, given, strict=True):
                self.ledger.commit_entry(eid, 0)
                self.device.mark(eid, checksum)  # the host checksum is made with a CPU copy
            self.device.policy.touch(eids)
            self.device.note_committed(eids)
        else:
            self.ledger.commit_cpu_entries(eids, given)
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
        durable = self.config.nvme.durable_puts and self.ledger.nvme is not None
        reservation = handle.reservations.get(reservation_id) if durable else None
        eids = list(reservation.eids) if reservation is not None else []
        keys = [self.ledger.index.key(e) for e in eids]
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
        if not self.config.nvme.durable_puts or self.ledger.nvme is None:
            return
        ids, state, tier = (
            self.ledger.index.ids_of(ns_id),
            self.ledger.index.state,
            self.ledger.index.tier,
        )
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
        live = [
            (e, k)
            for e, k in zip(eids, keys, strict=True)
            if self.ledger.index.has_key(e, ns_id, k)
        ]
        gpu_only = [e for e, _ in live if not self.ledger.index.tier[e] & (IN_CPU | IN_NVME)]
        if gpu_only:
            await self.device.to_cpu(gpu_only)
        results = await asyncio.gather(*(self.mover.flush(e, durable=True) for e, _ in live))
        lost = [
            k
            for (e, k), ok in zip(live, results, strict=True)
            if not ok
            and not (self.ledger.index.has_key(e, ns_id, k) and self.ledger.index.tier[e] & IN_NVME)
        ]
        if lost:
            raise UnavailableError(
                f"{len(lost)} of {len(eids)} blocks could not be made durable (the NVMe tier is "
                "full of leased blocks, or failing: see kvstore stat); those still stored are "
                "in memory, and a retry of the put writes them down"
            )

    def abort(self, handle: Handle, reservation_id: int) -> None:
        reservation = handle.reservations.get(reservation_id)
        if reservation is None or reservation.spare:  # a spare one's id is never handed out
            raise LeaseExpiredError(
                f"reservation {reservation_id} is unknown to this handle or expired"
            )
        del handle.reservations[reservation_id]
        for eid in reservation.eids:
            self.ledger.free_entry(eid)
        self.ledger.release_pin(reservation.pin)

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
        view = self.ledger.arena.view
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
        slot = self.ledger.arena.view[offset : offset + record.cpu_bytes]
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

    def delete(self, handle: Handle, keys: Sequence[bytes]) -> int:
        self.check_keys(keys, "delete")
        deleted = 0
        for key in dict.fromkeys(keys):  # a repeated key is deleted once
            eid = self.ledger.committed(handle.ns_id, key)
            if eid is not None:
                self.ledger.forget(eid)
                deleted += 1
        return deleted

    def _expire_reservation(self, reservation: Reservation, now: float) -> float:
        """A reservation (taken out of its handle) ends unused at ``now``: its entries go, and
        its slots stay quarantined, still pinned, for one more ``reservation_ttl_s`` (a
        shortened or spare one's: ``pin_grace_s``, if less), in case its writer copies late.
        Returns when the quarantine ends."""
        if reservation.pin is not None:
            self.ledger.quotas.uncount(reservation.pin)  # its slots stay pinned, quarantined
        # A shortened one (``_shorten_excess``) frees its room for a newcomer sooner.
        quarantine_s = self.config.reservation_ttl_s
        if reservation.shortened:
            quarantine_s = min(quarantine_s, self.limits.pin_grace_s)
        until = now + quarantine_s
        for eid in reservation.eids:
            self.ledger.quarantine_slots(eid, until, reservation.pin)
            self.ledger.free_entry(eid)
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
        self.ledger.release_quarantine(now)
        reservations = leases = 0
        for handle in self.ledger.names.handles():
            for rid in [r for r, v in handle.reservations.items() if v.expires_at <= now]:
                reservation = handle.reservations.pop(rid)
                until = self._expire_reservation(reservation, now)
                if reservation.spare:
                    self._forget_spare(handle, reservation, until)
                reservations += 1
            for lid in [lid for lid, v in handle.leases.items() if v.expires_at <= now]:
                lease = handle.leases.pop(lid)
                for eid in lease.eids:
                    self.ledger.drop_lease(eid)
                self.ledger.release_pin(lease.pin)
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
            self.ledger.quotas.unpin_leased(lease.pin, gone)
        for eid in gone:
            self.ledger.drop_lease(eid)

    # ----------------------------------------------------------------- the checker
    def check(self, io_idle: bool = True) -> None:
        """Assert the invariants of the ledger's module docstring and of every part's books;
        AssertionError names the first one broken. ``io_idle``: no IO is in flight (lease
        counts and byte totals must then be exact)."""
        spare = SpareBooks(
            self.spare_reserved_bytes,
            self.spare_quarantined_bytes,
            self._spare_quarantine,
            self.spare_tier_bytes,
        )
        check_store(self.ledger, spare, io_idle)

    # ----------------------------------------------------------------- stats
    @property
    def active_leases(self) -> int:
        return sum(len(h.leases) for h in self.ledger.names.handles())

    @property
    def active_reservations(self) -> int:
        return sum(len(h.reservations) for h in self.ledger.names.handles())

    @property
    def open_handles(self) -> int:
        return len(self.ledger.names)

    def tier_snapshots(self) -> list[TierSnapshot]:
        """Occupancy and counters of every tier, top down (``Stats``, the metrics)."""
        return tier_snapshots(self.ledger, self.device, self.shared)

    def namespace_tier_bytes(self) -> dict[bytes, list[tuple[str, int, int, int, str]]]:
        """By namespace fingerprint: (tier, blocks, logical, stored bytes, codec) in the tiers
        below the CPU tier (``Stats``, the metrics)."""
        return namespace_tier_bytes(self.ledger, self.shared, self.namespaces())

    def namespaces(self) -> list[NamespaceRecord]:
        return [r for r in self.ledger.names.records() if r.namespace is not None or r.blocks]
