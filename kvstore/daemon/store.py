"""The daemon's block store: the public operations, composed over the ledger and the tiers.

The parts, bottom up: the ledger (``ledger``: the only writer of block state, with
``namespaces`` records and handles, ``quotas``, and the ``pool_slots``, ``cpu_tier`` and
``disk_tier`` slot tables); the four tiers, each keeping the tier contract (``tier_contract``)
and handed the ledger and its neighbours, never the store (``device``: the GPU pool;
``cpu_room``: the CPU tier and room in it; ``movement``: the NVMe tier's write-back, promotion
and prefetch; ``shared``: Redis); the checker (``invariants``) and the Stats views
(``snapshots``); and the operations, in ``store_reads``, ``store_writes`` and ``store_spares``,
which ``BlockStore`` composes with namespaces and handles and reaping. Every method runs on the
daemon's event loop; bytes move in executors (the NVMe tier's IO threads, ``asyncio.to_thread``
for checksums), so the loop never blocks on a copy or a disk.

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

Movement: puts land in the CPU tier. With an NVMe tier, write-back keeps at least
``1 - high_watermark`` of the CPU tier free or clean (already on disk) by writing its coldest
dirty blocks down in the background, so a put rarely waits; with ``write_through`` every commit
is written down at once. Evicting a clean block only drops its CPU copy; a dirty victim is
written down first. A block whose checksum fails on the way down or up is dropped and counted: a
miss, never wrong data. The invariants are listed in the ledger's docstring; ``check`` asserts
them.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvstore.config import DaemonConfig
from kvstore.daemon.auth import Principal
from kvstore.daemon.block_events import Watcher
from kvstore.daemon.cpu_room import CpuRoom
from kvstore.daemon.cpu_tier import CpuSlots
from kvstore.daemon.device import DeviceTier, make_device_pool
from kvstore.daemon.invariants import SpareBooks, check_store
from kvstore.daemon.ledger import Ledger
from kvstore.daemon.movement import Mover
from kvstore.daemon.namespaces import (
    Handle,
    Lease,
    NamespaceRecord,
    NamespaceTable,
    Reservation,
)
from kvstore.daemon.quotas import Quotas
from kvstore.daemon.shared import SharedTier
from kvstore.daemon.snapshots import namespace_tier_bytes
from kvstore.daemon.store_parts import AcquireResult, BindResult, ReserveResult
from kvstore.daemon.store_reads import ReadOps
from kvstore.daemon.store_spares import SpareOps
from kvstore.daemon.tier_contract import Tier
from kvstore.daemon.tierstats import TierCounters, TierSnapshot
from kvstore.errors import UnknownNamespaceError
from kvstore.index import BlockIndex
from kvstore.keys import KEY_BYTES, Namespace
from kvstore.policy import EvictionPolicy
from kvstore.presence import PresenceTable
from kvstore.tiers.cpu import SharedMemoryArena, SlabAllocator

if TYPE_CHECKING:
    from kvstore.tiers.gpu import DevicePool
    from kvstore.tiers.nvme import NvmeTier


log = logging.getLogger(__name__)

__all__ = [
    "AcquireResult",
    "BindResult",
    "BlockStore",
    "Handle",
    "ReserveResult",
    "TierCounters",
    "TierSnapshot",
]


class BlockStore(ReadOps, SpareOps):
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
        # Spare slots are RESERVED entries with no key until a Bind keys them; the reserve
        # that makes them is given stand-in keys: a secret prefix (no client can name one, so
        # none can wait on or collide with it) and a count.
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
        # The tiers get the ledger and their neighbours, never the store. Room in the CPU
        # tier (``CpuRoom``) writes dirty victims down through the NVMe write-back (``Mover``,
        # which takes its promotions' slots from it) or spills them into Redis; Redis fetches
        # into slots it makes; the GPU tier copies down through the Mover.
        self.cpu_room = CpuRoom(self.ledger)
        self.mover = Mover(self.ledger, self.cpu_room)
        self.shared = SharedTier(
            self.ledger, cpu_room=self.cpu_room.alloc_cpu, on_fetched=self.mover.note_committed
        )
        self.cpu_room.spill = self.shared
        self.device = DeviceTier(
            self.ledger,
            pool,
            cpu_room=self.cpu_room.alloc_cpu,
            host=self.mover,
            shared=self.shared,
        )
        self.cpu_room.bring_up = self.mover.move_up
        # The four tiers of the tier contract, top down.
        self.tiers: tuple[Tier[Any], ...] = (self.device, self.cpu_room, self.mover, self.shared)

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
        for tier in self.tiers:
            await tier.start()

    async def stop(self) -> None:
        """Write dirty blocks down (bounded by ``drain_timeout_s``), close tiers, unlink."""
        for task in list(self._spare_tasks):
            task.cancel()
        for handle in self.ledger.names.handles():
            self.close_handle(handle)
        # The GPU tier first: its dirty blocks go down to the CPU tier, and from there to disk
        # with the NVMe tier's drain, which comes last; the shared tier's queue is given up.
        for tier in (self.device, self.shared, self.cpu_room, self.mover):
            await tier.stop()
        self.close()

    def close(self) -> None:
        self.ledger.feed.close()
        self.device.close()  # first: it unpins the arena the ledger's CPU slots unmap
        self.ledger.close()

    # ----------------------------------------------------------------- block events
    def watch_blocks(self, handle: Handle, who: str) -> Watcher:
        """A watch of ``handle``'s namespace by caller ``who``: it learns each change of a
        committed block's tiers, starting with a snapshot, and ends with the handle."""
        if handle.closed:
            raise UnknownNamespaceError("the namespace handle is closed: open it again")
        return self.ledger.feed.watch(handle.ns_id, handle, who)

    def unwatch_blocks(self, watcher: Watcher) -> None:
        self.ledger.feed.unwatch(watcher)

    def watched_batch(self, watcher: Watcher) -> tuple[bool, list[tuple[bytes, int]]]:
        """(reset, items): if the watcher is new or fell behind, every (key, entry) of its
        namespace, whose tiers ``snapshot_part`` reads a part at a time; else the (key, tiers)
        changed since its last batch (``Watcher.take``)."""
        return watcher.take(self.ledger.block_entries)

    def snapshot_part(
        self, watcher: Watcher, entries: Sequence[tuple[bytes, int]]
    ) -> list[tuple[bytes, int]]:
        return self.ledger.tiers_of(watcher.ns_id, entries)

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
        self.ledger.feed.close_owner(handle)
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

    # ----------------------------------------------------------------- waiting for writers

    # ----------------------------------------------------------------- reads

    # ----------------------------------------------------------------- writes

    # ----------------------------------------------------------------- spare slots

    # ----------------------------------------------------------------- slots and removal

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
        return [snap for tier in self.tiers if (snap := tier.snapshot()) is not None]

    def namespace_tier_bytes(self) -> dict[bytes, list[tuple[str, int, int, int, str]]]:
        """By namespace fingerprint: (tier, blocks, logical, stored bytes, codec) in the tiers
        below the CPU tier (``Stats``, the metrics)."""
        return namespace_tier_bytes(self.ledger, self.shared, self.namespaces())

    def namespaces(self) -> list[NamespaceRecord]:
        return [r for r in self.ledger.names.records() if r.namespace is not None or r.blocks]
