"""The ledger: the one writer of block state.

Block state is the index (key -> entry: namespace, tier bits, slots, checksum, priority, lease
count), each tier's policy membership (GPU, CPU, NVMe), the owners of pool, CPU and disk slots
and the device checksums of GPU copies, the slots quarantined after an expired reservation, the
payload checksums of fp8 CPU copies, the presence books (``kvstore.presence`` tables) and the
waiters for entries being written. Every change to it is one of this class's methods; the tiers
own slots and bytes and report here what landed (``mark_on_disk``, ``mark_in_cpu``,
``commit_entry`` ...), the movement code owns only the queues of work in flight, and the store
(``kvstore.daemon.store``) composes the public operations out of these methods. Nothing here
awaits but ``wait_for_writers``: a transition is made whole between two awaits of the one event
loop, so no lock is needed.

The GPU pool's books are here too (``pool_slots.PoolSlots``: slot owners and device checksums,
and the GPU policy): the ``DeviceTier`` makes the copies and reports each one through these
methods (``place_in_gpu``, ``complete_gpu_copy``, ``drop_gpu_copy``).

Write protocol: a RESERVED entry (a client's reservation, a fetch from Redis, a record found
on disk at start-up) becomes visible only through ``commit_entry`` / ``commit_cpu_entries``.

Invariants (``kvstore.daemon.invariants`` asserts them; the tests call it after every step):
- every keyed entry is RESERVED or COMMITTED, in a known namespace; ORPHANs are unkeyed and
  leased; ``record.entries`` counts a namespace's keyed entries and orphans;
- a RESERVED entry belongs to exactly one live reservation; a COMMITTED one to none;
- each tier's policy holds exactly the COMMITTED entries with a copy in that tier (the GPU's:
  with a complete copy);
- an entry's lease count is the number of live leases naming it plus IO in flight on it;
- the CPU bytes counted used are the bytes of the entries holding CPU slots plus quarantined
  slots; the clean bytes are those of CPU blocks with a disk copy.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

from kvstore.config import DaemonConfig
from kvstore.daemon.block_events import BlockEventFeed
from kvstore.daemon.cpu_tier import CpuSlots
from kvstore.daemon.disk_tier import DiskSlots
from kvstore.daemon.namespaces import NamespaceRecord, NamespaceTable
from kvstore.daemon.pool_slots import PoolSlots
from kvstore.daemon.presence_books import PresenceBooks
from kvstore.daemon.quotas import Pin, Quotas
from kvstore.daemon.tierstats import TierCounters
from kvstore.index import (
    BELOW_GPU,
    IN_CPU,
    IN_GPU,
    IN_NVME,
    IN_REDIS,
    BlockIndex,
    State,
    gather,
)
from kvstore.keys import Namespace
from kvstore.policy import EvictionPolicy, make_policy
from kvstore.presence import PresenceTable
from kvstore.tiers.codecs import (
    CODEC_FP8,
    CODEC_NONE,
    LOSSY,
    BlockFormat,
    block_format_of,
    codec_id,
    plan,
)
from kvstore.tiers.cpu import SharedMemoryArena, SlabAllocator

if TYPE_CHECKING:
    from kvstore.tiers.nvme import NvmeTier

log = logging.getLogger(__name__)

_COMMITTED = bytes([State.COMMITTED])  # leading_run: the state byte of a committed entry


class Ledger:
    """See the module docstring. Event-loop only."""

    def __init__(self, config: DaemonConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.limits = config.limits
        self._clock = clock
        self.cpu_slots = CpuSlots(config.cpu)
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
        self.gpu_slots = PoolSlots()  # its allocator comes with the GPU tier (``attach_pool``)
        self.gpu_policy: EvictionPolicy = make_policy(config.gpu.policy)
        # (until, in the GPU pool, offset, block bytes, its reservation's pin) of slots of
        # expired reservations: charged to their tenant until they are reusable. A heap by
        # ``until`` (a shortened reservation's quarantine ends sooner than others'); no two
        # items share a slot, so the comparison never reaches the pin.
        self.quarantine: list[tuple[float, bool, int, int, Pin | None]] = []
        # The payload checksum of each CPU copy that is an fp8 payload (its entry's checksum
        # is the decoded form's, what a reader verifies after decoding).
        self.payload_sums: dict[int, int] = {}
        # Waiters for the commit (or the end) of RESERVED entries, by entry id.
        self._written: dict[int, asyncio.Future[None]] = {}
        self._reserved_blocks = 0
        self.tables = PresenceBooks(self.index, self.cpu_slots)
        # Clients watching namespaces learn each change of a committed block's tiers.
        self.feed = BlockEventFeed()

    def close(self) -> None:
        for record in self.names.records():
            if record.presence is not None:  # clients that map it fall back to calls
                record.presence.close()
                record.presence = None
        self.cpu_slots.close()

    # ----------------------------------------------------------------- transitions the
    # store composes (the rest below are the tiers' and the store's alike)
    def add_lease(self, eid: int) -> None:
        """A reader leases ``eid`` (``drop_lease`` ends it): its slots stay put."""
        self.index.add_lease(eid)

    def key_spare_entries(self, eids: list[int], keys: Sequence[bytes], priority: int) -> None:
        """Spare slots' RESERVED entries (unkeyed: ``add_unkeyed_cpu_entries``) take the keys
        a Bind names."""
        self.index.key_many(eids, keys)
        prio = self.index.priority
        for eid in eids:
            prio[eid] = priority
        if eids:
            self.tables.note_writing(self.names[self.index.ns[eids[0]]], len(eids))

    def set_payload_sum(self, eid: int, checksum: int) -> None:
        """The checksum of ``eid``'s CPU copy as an fp8 payload (its entry's is the block's)."""
        self.payload_sums[eid] = checksum

    def release_quarantine(self, now: float) -> None:
        """Slots whose quarantine ended by ``now`` become reusable, and their pins go."""
        while self.quarantine and self.quarantine[0][0] <= now:
            _, gpu, offset, block_bytes, pin = heapq.heappop(self.quarantine)
            if gpu:
                self.gpu_slots.release_quarantined(offset, block_bytes)
            else:
                self.cpu_slots.release_quarantined(offset, block_bytes)
                if pin is not None:
                    self.quotas.unpin(pin, block_bytes, self.quotas.slabs_of([offset]))
                    for books in pin.books:
                        books.cpu_bytes -= block_bytes

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

    def recovered_namespace(self, fingerprint: bytes, block_bytes: int) -> NamespaceRecord:
        record = self.names.recovered(fingerprint, block_bytes)
        if record.usage is None:
            self.quotas.new_books(record)
        return record

    def namespace_record(self, ns_id: int) -> NamespaceRecord:
        """The record of an entry's namespace (recovered ones included)."""
        return self.names[ns_id]

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

    def drop_lossy_records(self, record: NamespaceRecord) -> None:
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

    def _note_written(self, eid: int) -> None:
        """A RESERVED entry was committed or freed: wake whoever waits for it."""
        waiter = self._written.pop(eid, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_for_writers(self, ns_id: int, keys: Sequence[bytes], wait_s: float) -> int:
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

    def committed(self, ns_id: int, key: bytes) -> int | None:
        eid = self.index.get(ns_id, key)
        if eid is None or self.index.state[eid] != State.COMMITTED:
            return None
        return eid

    def presence(self, record: NamespaceRecord) -> PresenceTable:
        """The presence table of namespace ``record`` (``PresenceBooks.table``)."""
        return self.tables.table(record)

    def leading_run(self, ns_id: int, keys: Sequence[bytes]) -> list[int]:
        # Every lookup and acquire walks its keys here: the walk runs in C (map over the dict,
        # then one gather of the state bytes), ~4x faster than a Python loop for 128 keys.
        found = list(map(self.index.ids_of(ns_id).get, keys))
        try:
            eids = cast(list[int], found[: found.index(None)])
        except ValueError:  # every key is indexed
            eids = cast(list[int], found)
        states = gather(self.index.state, eids)
        del eids[len(states) - len(states.lstrip(_COMMITTED)) :]
        return eids

    def maybe_forget_books(self, record: NamespaceRecord) -> None:
        if not record.handles and not record.entries:  # the table forgot the record
            self.quotas.forget(record)

    def release_pin(self, pin: Pin | None) -> None:
        if pin is not None:
            self.quotas.unpin(pin)

    def drop_lease(self, eid: int) -> None:
        if self.index.drop_lease(eid) == 0 and self.index.state[eid] == State.ORPHAN:
            self.free_entry(eid)

    def add_leases(self, eids: Sequence[int]) -> None:
        """``add_lease`` of each of ``eids``, in one loop (a read leases a whole run: a call
        per key would cost more than the bookkeeping). All or none: OverflowError when one of
        them has ``MAX_LEASES`` already, with no lease taken."""
        leases, most = self.index.leases, self.index.MAX_LEASES
        for i, eid in enumerate(eids):
            if leases[eid] >= most:
                for taken in eids[:i]:
                    leases[taken] -= 1
                raise OverflowError(f"entry {eid} has {most} read leases")
            leases[eid] += 1

    def drop_leases(self, eids: Sequence[int]) -> None:
        """``drop_lease`` of each of ``eids``, in one loop."""
        leases, state = self.index.leases, self.index.state
        for eid in eids:
            n = leases[eid]
            if n == 0:
                raise AssertionError(f"lease count of entry {eid} would go negative")
            leases[eid] = n - 1
            if n == 1 and state[eid] == State.ORPHAN:
                self.free_entry(eid)

    def pin(self, eid: int) -> None:
        """Pin an entry for IO in flight (a write down, a promotion): its slots stay put."""
        self.index.add_lease(eid)

    def unpin(self, eid: int) -> None:
        self.drop_lease(eid)

    def add_entry(self, key: bytes, ns_id: int, tier: int, offset: int, priority: int) -> int:
        """A new RESERVED entry (counted as reserved and as one of its namespace's entries)."""
        eid = self.index.add(key, ns_id, tier, offset, priority)
        if tier & IN_CPU:
            self.cpu_slots.place(eid, offset, self.names[ns_id].cpu_bytes, clean=False)
            self.quotas.charge_cpu(self.names[ns_id], self.names[ns_id].cpu_bytes)
            self._note_payload(self.names[ns_id], +1)
        self.names[ns_id].entries += 1
        self._reserved_blocks += 1
        self.tables.note_writing(self.names[ns_id], 1)
        return eid

    def add_cpu_entries(
        self, keys: list[bytes], ns_id: int, slots: list[int], priority: int
    ) -> list[int]:
        """``add_entry`` of each ``keys[j]`` in CPU slot ``slots[j]``, as one batch."""
        eids = self.index.add_many(keys, ns_id, IN_CPU, slots, priority)
        self._count_reserved_in_cpu(self.names[ns_id], eids, slots)
        self.tables.note_writing(self.names[ns_id], len(eids))
        return eids

    def add_unkeyed_cpu_entries(self, ns_id: int, slots: list[int], priority: int) -> list[int]:
        """``add_cpu_entries`` of entries with no key yet: spare slots, which a Bind keys
        (``key_spare_entries``). Keyed only then, they cost the key map nothing meanwhile (a
        placeholder key re-keyed would leave a deleted slot behind in it each time)."""
        eids = self.index.add_unkeyed_many(ns_id, IN_CPU, slots, priority)
        self._count_reserved_in_cpu(self.names[ns_id], eids, slots)
        return eids

    def _count_reserved_in_cpu(
        self, record: NamespaceRecord, eids: list[int], slots: list[int]
    ) -> None:
        """New RESERVED entries ``eids`` of ``record``'s namespace hold CPU ``slots``: their
        owners, quota charges, payload savings and counts."""
        self.cpu_slots.place_dirty(eids, slots)
        n = len(eids)
        self.quotas.charge_cpu(record, n * record.cpu_bytes)
        if record.cpu_codec:
            self.cpu_slots.payload_savings += n * (record.block_bytes - record.cpu_bytes)
        record.entries += n
        self._reserved_blocks += n

    def commit_entry(self, eid: int, checksum: int) -> None:
        """RESERVED -> COMMITTED: the one place an entry becomes visible."""
        self.index.commit(eid, checksum)
        if self.index.tier[eid] & IN_CPU:
            self.policy.insert(eid, self.index.priority[eid])
        self._reserved_blocks -= 1
        record = self.names[self.index.ns[eid]]
        record.blocks += 1
        self.tables.add(record, (eid,))
        self.tables.note_writing(record, -1)
        self._note_written(eid)
        self._tell(eid)

    def commit_cpu_entries(self, eids: list[int], checksums: Sequence[int]) -> None:
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
        self.tables.add(record, eids)
        self.tables.note_writing(record, -len(eids))
        if self._written:  # someone waits for a block being written
            for eid in eids:
                self._note_written(eid)
        if self.feed.watched:
            key, told = index.key, self._tiers_told
            self.feed.note_many(index.ns[eids[0]], ((key(e), told(e)) for e in eids))

    def commit_recovered(self, eid: int, checksum: int, disk_slot: int) -> None:
        """Make a block found on disk at start-up (a RESERVED entry just added) visible."""
        self.commit_entry(eid, checksum)
        self.mark_on_disk(eid, disk_slot)

    def discard_reserved(self, eid: int) -> None:
        self.free_entry(eid)

    def cpu_alloc_many(self, block_bytes: int, n: int, domain: int = 0) -> list[int]:
        """Up to ``n`` CPU slots in memory ``domain``, counted as used; fewer when no more are
        free (or a slab could not be backed)."""
        return self.cpu_slots.alloc_many(block_bytes, n, domain)

    def cpu_unalloc(self, offset: int, block_bytes: int) -> None:
        """Give back a slot from ``cpu_alloc_many`` that no entry took."""
        self.cpu_slots.unalloc(offset, block_bytes)

    def drop_cpu_copy(self, eid: int) -> None:
        """Free an entry's CPU slot; it must have a disk or GPU copy (it stays findable there)."""
        if not self.index.tier[eid] & (IN_NVME | IN_GPU):
            raise AssertionError(f"dropping the only copy of entry {eid}")
        self._free_cpu_slot(eid)
        self.policy.remove(eid)
        self._tell(eid)

    def drop_disk_copy(self, eid: int) -> None:
        """Free an entry's disk slot; it must have a CPU or GPU copy (it becomes dirty again)."""
        if not self.index.tier[eid] & (IN_CPU | IN_GPU):
            raise AssertionError(f"dropping the only copy of entry {eid}")
        self._free_disk_slot(eid)
        self.nvme_policy.remove(eid)
        self._tell(eid)

    def _free_cpu_slot(self, eid: int, in_table: bool = True) -> None:
        clean = bool(self.index.tier[eid] & IN_NVME)
        record = self.names[self.index.ns[eid]]
        if in_table:
            self.tables.unlocate(record, eid)
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
        self._tell(eid)

    def mark_in_redis(self, eid: int) -> None:
        """This host wrote the block to the shared tier."""
        self.index.tier[eid] |= IN_REDIS
        self._tell(eid)

    # ----------------------------------------------------------------- the GPU pool
    def attach_pool(self, allocator: SlabAllocator) -> None:
        """The GPU tier's slab allocator: pool slots can be had from now on."""
        if self.gpu_slots.offset:
            raise AssertionError("a GPU pool attached while entries hold pool slots")
        self.gpu_slots.allocator = allocator

    def gpu_alloc_many(self, block_bytes: int, n: int, domain: int = 0) -> list[int]:
        """Up to ``n`` pool slots, counted as used; fewer when no more are free. The pool is
        one memory domain: with a tenant policy only all-tenant callers map it."""
        assert domain == 0, "the GPU pool is one domain"
        return self.gpu_slots.alloc_many(block_bytes, n)

    def gpu_unalloc(self, offset: int, block_bytes: int) -> None:
        """Give back a slot from ``gpu_alloc_many`` that no entry took."""
        self.gpu_slots.unalloc(offset, block_bytes)

    def gpu_owner(self, offset: int) -> int | None:
        return self.gpu_slots.owner(offset)

    def place_in_gpu(self, eid: int, offset: int) -> None:
        """A (reserved or committed) entry's GPU copy is being written into pool slot
        ``offset``; ``complete_gpu_copy`` says when it is whole."""
        self.gpu_slots.place(eid, offset)
        self.index.tier[eid] |= IN_GPU

    def complete_gpu_copy(self, eid: int, dsum: int) -> None:
        """The entry's GPU copy is whole, with device checksum ``dsum``: eviction may pick it."""
        self.gpu_slots.complete(eid, dsum)
        self.gpu_policy.insert(eid, self.index.priority[eid])
        self._tell(eid)

    def drop_gpu_copy(self, eid: int) -> None:
        """Drop a GPU copy that has a copy below (the block stays stored there)."""
        if not self.index.tier[eid] & BELOW_GPU:
            raise AssertionError(f"dropping the only copy of entry {eid}")
        self.gpu_policy.remove(eid)
        self._free_gpu_slot(eid)
        self._tell(eid)

    def touch_gpu(self, eids: list[int]) -> None:
        """A read of these entries' GPU copies (those complete and committed)."""
        dsum, state = self.gpu_slots.dsum, self.index.state
        if not dsum:  # nothing in the pool (or no pool): the common case, at no cost
            return
        self.gpu_policy.touch([e for e in eids if e in dsum and state[e] == State.COMMITTED])

    def _free_gpu_slot(self, eid: int) -> None:
        self.gpu_slots.vacate(eid, self.block_bytes_of(eid))
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
        self.tables.locate(self.names[self.index.ns[eid]], eid)
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
        self.tables.locate(self.names[self.index.ns[eid]], eid)
        self._tell(eid)

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
        if self.index.tier[eid] & IN_GPU and eid in self.gpu_slots.dsum:
            self.gpu_policy.remove(eid)
        record = self.names[self.index.ns[eid]]
        record.blocks -= 1
        if record.presence is not None:
            record.presence.remove(self.index.key(eid))
        if self.feed.watched:
            self.feed.note(self.index.ns[eid], self.index.key(eid), 0)  # gone from every tier
        if self.index.leases[eid]:
            self.index.orphan(eid)
        else:
            self.free_entry(eid, in_table=False)  # its table slots lost their places above

    def forget_many(self, eids: list[int]) -> None:
        """``forget`` of each of ``eids`` as one batch where it is the common case of an
        eviction: a committed, unleased entry whose only copy is in the CPU tier (any other
        goes through ``forget``). One pass per structure and one update of each namespace's
        counts and books: an eviction used to spend ~20 us of Python per block here."""
        index = self.index
        state, tier, leases, ns_of, offset = (
            index.state,
            index.tier,
            index.leases,
            index.ns,
            index.offset,
        )
        simple: list[int] = []
        for eid in eids:
            if state[eid] == State.COMMITTED and tier[eid] == IN_CPU and not leases[eid]:
                simple.append(eid)
            else:
                self.forget(eid)
        if not simple:
            return
        self.policy.remove_many(simple)
        by_ns: dict[int, list[int]] = {}
        for eid in simple:
            by_ns.setdefault(ns_of[eid], []).append(eid)
        for ns_id, group in by_ns.items():
            record = self.names[ns_id]
            keys = [index.key(e) for e in group]
            if record.presence is not None:  # before any slot can go to another block
                record.presence.remove_many(keys)
            if self.feed.watched:
                self.feed.note_many(ns_id, ((key, 0) for key in keys))  # gone from every tier
            cpu_bytes = record.cpu_bytes
            self.cpu_slots.vacate_many([offset[eid] for eid in group], cpu_bytes)
            for eid in group:
                offset[eid] = -1
                tier[eid] = 0
            index.drop_many(group)
            if self.payload_sums:
                for eid in group:
                    self.payload_sums.pop(eid, None)
            n = len(group)
            self.quotas.charge_cpu(record, -n * cpu_bytes)
            if record.cpu_codec:
                self.cpu_slots.payload_savings -= n * (record.block_bytes - cpu_bytes)
            record.blocks -= n
            record.entries -= n
            self.names.maybe_free(record)
            self.maybe_forget_books(record)

    def quarantine_slots(self, eid: int, until: float, pin: Pin | None) -> None:
        """Take a reserved entry's slots away from it without freeing them (see ``reap``); they
        stay counted as used, and as pinned by its tenant (``pin``), until ``until``."""
        # A namespace whose CPU entries are payloads never uses the GPU pool: one size serves.
        index, bb = self.index, self.cpu_bytes_of(eid)
        if index.tier[eid] & IN_CPU:
            heapq.heappush(self.quarantine, (until, False, index.offset[eid], bb, pin))
            self.cpu_slots.quarantine(index.offset[eid], bb)
            self._note_payload(self.names[index.ns[eid]], -1)
            self.payload_sums.pop(eid, None)
            index.offset[eid] = -1
            index.tier[eid] &= ~IN_CPU
        if index.tier[eid] & IN_GPU:
            if eid in self.gpu_slots.dsum:  # cannot be: a reserved copy is not complete
                self.gpu_policy.remove(eid)
            slot = self.gpu_slots.quarantine(eid, bb)
            heapq.heappush(self.quarantine, (until, True, slot, bb, None))
            index.tier[eid] &= ~IN_GPU

    def free_entry(self, eid: int, in_table: bool = True) -> None:
        """Free every slot an entry holds and forget it. Does not touch the policies.
        ``in_table``: its presence table may still give its CPU copy's place (not after
        ``PresenceTable.remove`` of its key)."""
        state = self.index.state[eid]
        if self.index.tier[eid] & IN_CPU:
            self._free_cpu_slot(eid, in_table)
        if self.index.tier[eid] & IN_NVME:
            self._free_disk_slot(eid)
        if self.index.tier[eid] & IN_GPU:
            self._free_gpu_slot(eid)
        record = self.names[self.index.ns[eid]]
        if state == State.RESERVED:
            self._reserved_blocks -= 1
            if self.index.is_keyed(eid):
                self.tables.note_writing(record, -1)
        self.index.drop(eid)
        if state == State.RESERVED:
            self._note_written(eid)  # waiters see the key free and may write it themselves
        record.entries -= 1
        self.names.maybe_free(record)
        self.maybe_forget_books(record)

    # ----------------------------------------------------------------- block events
    def _tiers_told(self, eid: int) -> int:
        """The tiers a watcher is told hold a committed entry: a GPU copy once it is whole."""
        tiers = self.index.tier[eid] & (IN_CPU | IN_NVME | IN_REDIS)
        return tiers | IN_GPU if eid in self.gpu_slots.dsum else tiers

    def _tell(self, eid: int) -> None:
        """The watchers of a committed entry's namespace learn its tiers now."""
        if self.feed.watched and self.index.state[eid] == State.COMMITTED:
            self.feed.note(self.index.ns[eid], self.index.key(eid), self._tiers_told(eid))

    def block_entries(self, ns_id: int) -> list[tuple[bytes, int]]:
        """(key, entry) of every keyed entry of a namespace: what a watcher's snapshot covers,
        copied at once (cheap even at millions) so its tiers can be read in parts
        (``tiers_of``) between which the loop serves others."""
        return list(self.index.ids_of(ns_id).items())

    def tiers_of(self, ns_id: int, entries: Sequence[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        """(key, tiers) of those of ``entries`` still committed under their key (one that went
        meanwhile is told by its own event, queued after the snapshot)."""
        index, told = self.index, self._tiers_told
        state = index.state
        return [
            (key, told(eid))
            for key, eid in entries
            if state[eid] == State.COMMITTED and index.has_key(eid, ns_id, key)
        ]

    @property
    def reserved_blocks(self) -> int:
        return self._reserved_blocks

    @property
    def cpu_used_bytes(self) -> int:
        return self.cpu_slots.used_bytes

    @property
    def cpu_clean_bytes(self) -> int:
        return self.cpu_slots.clean_bytes
