"""Moving blocks between the CPU tier and the NVMe tier: write-back, promotion, prefetch.

``Mover`` owns the NVMe tier object and the work in flight between tiers: the background
flusher, promotions (deduplicated: a second reader of a block being promoted awaits the first
promotion), prefetch tasks and the drain at shutdown. It changes block state only through the
ledger's methods (``kvstore.daemon.ledger``); below the CPU tier, when there is no NVMe tier,
it spills into the tier it is handed (``spill``: the shared Redis tier). Runs on the daemon's
event loop; the tier does its IO in its own threads.

Every IO holds a lease on its entry for its duration, so the entry's slots are never freed or
reused under it; an entry deleted meanwhile becomes an ORPHAN and its slots go with the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from kvstore.checksum import block_checksum
from kvstore.daemon.cpu_room import CpuRoom
from kvstore.daemon.prefetch import Prefetcher
from kvstore.daemon.tier_contract import count_in, droppable, leading_in
from kvstore.daemon.writeback import bytes_to_clean, pick_writeback
from kvstore.index import IN_CPU, IN_GPU, IN_NVME, State
from kvstore.ratelog import RateLimitedLog
from kvstore.tiers.codecs import LOSSY, BlockFormat, block_format_of, encode_payload

if TYPE_CHECKING:
    from kvstore.daemon.ledger import Ledger
    from kvstore.daemon.namespaces import NamespaceRecord
    from kvstore.daemon.quotas import Usage
    from kvstore.daemon.tierstats import TierCounters, TierSnapshot

log = logging.getLogger(__name__)
_io_log = RateLimitedLog(log)  # a failing disk fails every write

# The CPU and NVMe bits: a CPU block is dirty when it has no disk copy (a GPU copy above it
# does not make it durable).
_LOCAL = IN_CPU | IN_NVME


def encode_payload_privately(
    block: Any, fmt: BlockFormat, slot: memoryview, namespace: bytes, key: bytes
) -> tuple[int, int]:
    """``codecs.encode_payload`` of ``block`` into an arena ``slot``, encoded and hashed in
    private memory and only then copied into the slot: the checksums vouch for this block
    whatever else writes into the shared slot meanwhile (a stalled writer's late copy), as a
    client's put does (``kvstore.client.payloads``). Blocks: run it off the loop."""
    private = memoryview(bytearray(slot.nbytes))
    sums = encode_payload(block, fmt, private, namespace, key)
    slot[:] = private
    return sums


REFUSED_LOSSY = "refused: lossy"
"""What a promotion reads of a lossy disk record of a namespace configured lossless here."""


async def _refused_lossy() -> str:
    return REFUSED_LOSSY


class Mover:
    """The NVMe tier of the tier contract (``tier_contract.Tier``); see the module docstring.
    Created by the store; ``start``/``stop`` bracket its life.
    ``cpu_room`` makes room in the CPU tier (for promotions); the Mover hands it its
    write-back (``flush``) for dirty victims."""

    def __init__(self, ledger: Ledger, cpu_room: CpuRoom) -> None:
        self.name = "nvme"
        self.ledger = ledger
        self.cpu_room = cpu_room
        self.config = ledger.config.nvme
        self._promoting: dict[int, asyncio.Future[bool]] = {}
        self._flushing: dict[int, asyncio.Future[bool]] = {}
        self._write_through: deque[int] = deque()
        self._prefetched = bytearray()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        # Entries whose CPU copy is the fp8 form of a lossless disk record (written before
        # their namespace's ``cpu = "fp8"`` rule): their checksum is now that form's, which no
        # record on disk has, so the record's own is kept here for their next promotion, with
        # the (disk slot, namespace, key, entry checksum) it holds for (an entry id is reused:
        # checked on use).
        self._lossless: dict[int, tuple[int, int, bytes, int, int]] = {}
        self._lossless_prune_at = 1024
        self._flusher: asyncio.Task[None] | None = None
        self._batches = 0  # write-back batches in flight
        cpu_room.write_down, cpu_room.writing = self.flush, self._flushing
        index = ledger.index
        # Blocks in the GPU pool are not read from disk: a CPU reader gets a copy from the pool.
        self._prefetcher = Prefetcher(
            ledger,
            window=2 * self.config.io_threads,  # the head of the prefix is ready first
            wanted=lambda e: not index.tier[e] & (IN_CPU | IN_GPU) and e not in self._promoting,
            promote=self._promote_prefetched,
            spawn=self._spawn,
        )

    @property
    def enabled(self) -> bool:
        return self.ledger.nvme is not None

    @property
    def idle(self) -> bool:
        """No movement in flight or due (checkers and tests wait for this)."""
        return not (
            self._flushing or self._promoting or self._tasks or self._batches or self._wake.is_set()
        )

    # ----------------------------------------------------------------- life cycle
    async def start(self) -> None:
        if not self.config.enabled:
            return
        from kvstore.tiers.nvme import NvmeTier

        tier = NvmeTier(
            self.config.path,
            self.config.capacity_bytes,
            codec=None if self.config.codec == "none" else self.config.codec,
            direct_io=self.config.direct_io,
            io_threads=self.config.io_threads,
        )
        records = await tier.open()
        self.ledger.disk.tier = tier
        self._recover(records)
        self._flusher = asyncio.create_task(self._flush_loop())

    def _recover(self, records: list[Any]) -> None:
        """Index every block found on disk, oldest first so the LRU order approximates age."""
        ledger, index = self.ledger, self.ledger.index
        for rec in sorted(records, key=lambda r: r.seq):
            ns = ledger.recovered_namespace(rec.namespace, rec.length)
            old = index.get(ns.ns_id, rec.key)
            if old is not None:  # an older record of the same key: keep the newest
                ledger.forget(old)
            eid = ledger.add_entry(rec.key, ns.ns_id, 0, -1, 0)
            ledger.commit_recovered(eid, rec.checksum, rec.slot)

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        tier = self.ledger.nvme
        if tier is None:
            return
        # Write dirty blocks down so a restart finds them: coldest first, within the budget.
        dirty = [e for e in self.ledger.policy.order() if not self.ledger.index.tier[e] & IN_NVME]
        try:
            await asyncio.wait_for(self.move_down(dirty), self.ledger.config.drain_timeout_s)
        except TimeoutError:
            log.warning("drain timed out; %d dirty blocks may not be on disk", len(dirty))
        await tier.close()

    # ----------------------------------------------------------------- the tier contract
    async def move_down(self, eids: list[int]) -> int:
        """Write CPU blocks to disk (keeping their CPU copies), a window of ``2 * io_threads``
        at a time; returns how many of ``eids`` are on disk afterwards."""
        window = 2 * self.config.io_threads
        for i in range(0, len(eids), window):
            await asyncio.gather(*(self.flush(e) for e in eids[i : i + window]))
        return count_in(self.ledger.index, eids, IN_NVME)

    def holds(self, eid: int) -> bool:
        return bool(self.ledger.index.tier[eid] & IN_NVME)

    def drop(self, eids: list[int]) -> int:
        """Drop the disk copies of ``eids`` that have a CPU or GPU copy and are neither leased
        nor being written or promoted (each becomes dirty again); returns how many went."""
        busy = self._flushing.keys() | self._promoting.keys()
        gone = droppable(self.ledger.index, eids, IN_NVME, IN_CPU | IN_GPU, busy)
        for e in gone:
            self.ledger.drop_disk_copy(e)
        return len(gone)

    @property
    def counters(self) -> TierCounters:
        return self.ledger.nvme_counters

    def snapshot(self) -> TierSnapshot | None:
        return self.ledger.disk.snapshot()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----------------------------------------------------------------- hooks from the ledger
    def note_committed(self, eids: list[int]) -> None:
        if self.ledger.nvme is None:
            return
        if self.config.write_through:
            self._write_through.extend(eids)
        self._wake.set()

    def note_read(self, eids: list[int]) -> None:
        flags = self._prefetched
        for eid in eids:
            if eid < len(flags) and flags[eid]:
                flags[eid] = 0
                self.ledger.nvme_counters.prefetch_hits += 1

    # ----------------------------------------------------------------- CPU room

    # ----------------------------------------------------------------- down: write-back
    async def flush(self, eid: int, durable: bool = False) -> bool:
        """Write a CPU block to disk (keeping its CPU copy). True when it is on disk.
        ``durable``: a durable put waits for it, so room is made as ``_disk_slot`` makes it for
        such writes; a write-back of the block in flight that failed is tried again so."""
        pending = self._flushing.get(eid)
        if pending is not None:
            ok = await asyncio.shield(pending)
            if ok or not durable:
                return ok
            pending = self._flushing.get(eid)
            if pending is not None:  # another caller tries again already
                return await asyncio.shield(pending)
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._flushing[eid] = future
        try:
            ok = await self._flush_one(eid, durable)
        except BaseException:
            future.set_result(False)
            raise
        finally:
            del self._flushing[eid]
        future.set_result(ok)
        return ok

    async def _flush_one(self, eid: int, durable: bool = False) -> bool:
        ledger, index, tier = self.ledger, self.ledger.index, self.ledger.nvme
        if tier is None or index.state[eid] != State.COMMITTED:
            return False
        if index.tier[eid] & IN_NVME:
            return True
        if not index.tier[eid] & IN_CPU:
            return False
        block_bytes = ledger.block_bytes_of(eid)
        record = ledger.namespace_record(index.ns[eid])
        if not self._nvme_quota_room(record, block_bytes):
            return False  # at its quota_nvme, its own disk blocks all busy: stays in memory
        codec, block_format = ledger.codec_of(record, "nvme")
        slot = self._disk_slot(
            tier.payload_bytes_for(block_bytes, codec, block_format),
            record.owner,
            take_copies_above=durable,
        )
        if slot is None:
            return False
        key, fingerprint = index.key(eid), ledger.fingerprint_of(eid)
        checksum, offset = index.checksum[eid], index.offset[eid]
        # A payload entry (``cpu = "fp8"``) is written down as it is: verified against its
        # payload checksum here, decoded once by the tier against ``checksum`` (its decoded
        # form's), never re-encoded.
        cpu_bytes = record.cpu_bytes
        encoded = block_bytes if record.cpu_codec else 0
        slot_sum = ledger.payload_sums.get(eid, checksum) if encoded else checksum
        ledger.pin(eid)
        writing = (record.usage, record.owner)
        for books in writing:
            books.nvme_writing += block_bytes
        try:
            data = ledger.arena.view[offset : offset + cpu_bytes]
            # Verified on the way down: a CPU copy that no longer matches its checksum (a
            # client scribbled on its slot) must not be made durable. A raw block is verified
            # by the tier itself, against this very checksum, on its write thread just before
            # its bytes go out (a ValueError below), so it costs no hop of its own here; a
            # payload entry is checked here against its payload checksum (the tier checks
            # what it decodes to).
            if encoded and (
                await asyncio.to_thread(block_checksum, data, fingerprint, key) != slot_sum
            ):
                tier.free(slot)
                ledger.cpu.checksum_failures += 1
                ledger.forget(eid)
                return False
            from kvstore.tiers.nvme import NvmeIOError

            try:
                await tier.write(
                    slot,
                    key,
                    fingerprint,
                    data,
                    checksum,
                    # Write-back and write-through promise a process crash, not a power loss
                    # (docs/operations.md): no fdatasync barriers unless a durable put waits.
                    durable=durable,
                    codec=codec,
                    block_format=block_format,
                    encoded_length=encoded,
                )
            except NvmeIOError as exc:
                ledger.nvme_counters.io_errors += 1
                _io_log.warning("nvme write", f"nvme write failed: {exc}")
                return False
            except ValueError as exc:
                # The tier re-verifies as it copies: the slot changed after the check above (a
                # client scribbled on it). Never made durable; the CPU copy is as suspect.
                ledger.cpu.checksum_failures += 1
                _io_log.warning("scribbled", f"not written down: {exc}")
                if index.state[eid] == State.COMMITTED:
                    ledger.forget(eid)
                return False
            if index.state[eid] != State.COMMITTED:  # deleted while writing
                tier.free(slot)
                return False
            ledger.mark_on_disk(eid, slot)
            ledger.nvme_counters.demotions += 1
            return True
        finally:
            for books in writing:
                books.nvme_writing -= block_bytes
            ledger.unpin(eid)

    def _nvme_quota_room(self, record: NamespaceRecord, block_bytes: int) -> bool:
        """Bring ``record``'s namespace and tenant within their ``quota_nvme`` for one more
        block by evicting their own coldest disk blocks; False when they cannot."""
        ledger, index, quotas = self.ledger, self.ledger.index, self.ledger.quotas
        for books, where in ((record.usage, "namespace"), (record.owner, "tenant")):
            # Writes in flight count: a batch's blocks are all checked before any lands.
            excess = quotas.over(books, "nvme", block_bytes + books.nvme_writing)
            if not excess:
                continue
            victims, freed = self.cpu_room.own_coldest(
                ledger.nvme_policy.order(),
                record,
                where,
                excess,
                lambda eid: not index.leases[eid] and eid not in self._promoting,
            )
            if freed < excess:
                return False
            self._evict_disk(victims)
        return True

    def _disk_slot(
        self, payload_bytes: int, requester: Usage | None = None, take_copies_above: bool = False
    ) -> int | None:
        """A free disk slot for a payload of ``payload_bytes`` (its codec's bound), making room
        when the tier is full: the coldest unprotected disk block goes, and when its slot is of
        another size, its whole slab goes (the slab then returns to the pool, where this size
        takes it), as in the CPU tier. A disk-only victim is gone; a victim with a copy above
        just loses its disk copy (it becomes dirty again). A block of another tenant than
        ``requester`` goes only while that tenant keeps its ``guaranteed_nvme``.

        Write-back leaves a slab of another size alone while one of its blocks has a copy
        above (two sizes would take slabs from each other on every write-back). A durable put's
        write (``take_copies_above``) cannot wait for those copies to go: it takes such a slab
        too, or a size without a disk slab of its own would have every durable put refused
        while the disk's slabs all held blocks cached above (with durable puts, the recent
        ones all are)."""
        ledger, index, tier = self.ledger, self.ledger.index, self.ledger.nvme
        assert tier is not None
        quotas = ledger.quotas
        slot_size = tier.slot_bytes_for(payload_bytes)
        block_bytes = payload_bytes
        stuck: set[int] = set()
        for _ in range(4):  # a few slabs at most per call: the caller may try again later
            slot: int | None = tier.allocate(block_bytes)
            if slot is not None:
                return slot

            def protected(eid: int) -> bool:
                return (
                    bool(index.leases[eid])
                    or eid in self._promoting
                    or (
                        bool(quotas.guaranteed_nvme)
                        and quotas.spared(
                            requester,
                            "nvme",
                            self.cpu_room.owner_books(eid),
                            ledger.block_bytes_of(eid),
                        )
                    )
                )

            victim = None
            for eid in ledger.nvme_policy.order():  # coldest first
                if protected(eid):
                    continue
                same = tier.slot_size(index.disk[eid]) == slot_size
                if same or tier.slab_of(index.disk[eid]) not in stuck:
                    victim = eid
                    break
            if victim is None:
                return None
            if tier.slot_size(index.disk[victim]) == slot_size:
                self._evict_disk([victim])
                continue
            slab = tier.slab_of(index.disk[victim])
            owners = [ledger.disk_owner(s) for s in tier.live_slots(slab)]
            above = not take_copies_above
            if any(
                e is None or protected(e) or (above and index.tier[e] & (IN_CPU | IN_GPU))
                for e in owners
            ):
                # A slot being written, a block being read, or a block with a copy above:
                # dropping that copy would only make it dirty again, and two sizes taking a
                # slab from each other on every write-back would churn without end.
                stuck.add(slab)
                continue
            guard = quotas.guard(
                requester, "nvme", self.cpu_room.owner_books, ledger.block_bytes_of
            )
            if guard is not None:
                take = guard()  # the whole slab goes: its tenants' guarantees, together
                if not all(take(e) for e in owners if e is not None):
                    stuck.add(slab)
                    continue
            self._evict_disk([e for e in owners if e is not None])
        return tier.allocate(block_bytes)

    def _evict_disk(self, victims: list[int]) -> None:
        ledger, index = self.ledger, self.ledger.index
        for v in victims:
            if index.tier[v] & (IN_CPU | IN_GPU):
                ledger.drop_disk_copy(v)  # still stored above the disk
            else:
                ledger.forget(v)
            ledger.nvme_counters.evictions += 1

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                batch = self._next_flush_batch()
                if not batch:
                    break
                dirty_before = self._dirty_bytes()
                self._batches += 1
                try:
                    results = await asyncio.gather(*(self.flush(e) for e in batch))
                finally:
                    self._batches -= 1
                if not any(results):
                    break  # the disk takes nothing now (full of leased blocks, IO errors)
                if self._dirty_bytes() >= dirty_before and not self.config.write_through:
                    # No progress: each write made room on disk by dropping the disk copy of
                    # another CPU block, which is dirty again. Stop; do not churn.
                    break

    def _dirty_bytes(self) -> int:
        """Bytes of CPU blocks with no disk copy."""
        ledger = self.ledger
        return ledger.cpu_used_bytes - ledger.cpu_clean_bytes

    def _next_flush_batch(self) -> list[int]:
        """The next blocks to write down to the NVMe tier (``writeback.pick_writeback``)."""
        ledger, index = self.ledger, self.ledger.index

        def needs_write(e: int) -> bool:
            return (
                index.state[e] == State.COMMITTED
                and index.tier[e] & _LOCAL == IN_CPU
                and e not in self._flushing
            )

        def wanted() -> float:
            capacity = ledger.allocator.capacity_bytes
            free_or_clean = capacity - ledger.cpu_used_bytes + ledger.cpu_clean_bytes
            return bytes_to_clean(capacity, free_or_clean, ledger.config.cpu.high_watermark)

        return pick_writeback(
            eager=self._write_through,
            needs_write=needs_write,
            # Large enough that the tier can group many writes under one pair of fdatasyncs.
            limit=max(2 * self.config.io_threads, 32),
            eager_only=self.config.write_through,
            wanted=wanted,
            coldest=ledger.policy.order,
            bytes_of=ledger.cpu_bytes_of,
        )

    # ----------------------------------------------------------------- up: promotion, prefetch
    async def move_up(self, eids: list[int]) -> list[int]:
        """Promote the blocks of a run that are only on disk; returns the leading run of them
        now in the CPU tier. A block already being promoted (by another reader or a prefetch)
        is waited for, not read twice."""
        index = self.ledger.index
        waits: list[asyncio.Future[bool]] = []
        mine: list[int] = []
        for eid in dict.fromkeys(eids):  # a key asked twice is read once
            if index.tier[eid] & IN_CPU:
                continue
            pending = self._promoting.get(eid)
            if pending is not None:
                waits.append(pending)
            else:
                mine.append(eid)
        if mine:
            await self._promote_many(mine)
        if waits:
            await asyncio.gather(*(asyncio.shield(w) for w in waits))
        return leading_in(index, eids, IN_CPU)

    async def _promote_many(self, eids: list[int]) -> list[bool]:
        """Read disk-only blocks of one size into new CPU slots, concurrently. ``eids`` must be
        distinct and not being promoted already (``move_up`` and ``_prefetch`` see to
        it). Each read is checked against the key it was started for: an entry deleted (and
        its id perhaps reused) while room was made or the disk was read is not touched."""
        ledger, index, tier = self.ledger, self.ledger.index, self.ledger.nvme
        if len(set(eids)) != len(eids) or any(e in self._promoting for e in eids):
            raise AssertionError("promotion of a repeated entry or of one already promoting")
        loop = asyncio.get_running_loop()
        futures = {}
        for eid in eids:
            futures[eid] = self._promoting[eid] = loop.create_future()
            ledger.pin(eid)  # pins the disk copy (and the entry id) for the read
        results = [False] * len(eids)
        offsets: list[int] = []
        block_bytes = 0
        detached = False  # the caller gave up during the reads: they end the promotion

        def end() -> None:
            self._unalloc(offsets, block_bytes)
            for i, eid in enumerate(eids):
                del self._promoting[eid]
                futures[eid].set_result(results[i])
                ledger.unpin(eid)

        try:
            todo = [
                i
                for i, e in enumerate(eids)
                if tier is not None
                and index.state[e] == State.COMMITTED
                and index.tier[e] & IN_NVME
                and not index.tier[e] & IN_CPU
            ]
            if todo and tier is not None:
                # One namespace per call: its block size and memory domain are the slots'. A
                # block of another namespace here (an entry id reused) is not this call's.
                ns_id = index.ns[eids[todo[0]]]
                todo = [i for i in todo if index.ns[eids[i]] == ns_id]
                first = ledger.namespace_record(ns_id)
                block_bytes = first.cpu_bytes  # the slots' (a payload's, ``cpu = "fp8"``)
                offsets = await self.cpu_room.alloc_cpu(
                    block_bytes, len(todo), partial=True, domain=first.domain, record=first
                )
                # Re-checked after the await: deleted meanwhile (an orphan now), or given a CPU
                # copy another way, is no longer this promotion's to read.
                todo = [
                    i
                    for i in todo[: len(offsets)]
                    if index.state[eids[i]] == State.COMMITTED
                    and index.tier[eids[i]] & IN_NVME
                    and not index.tier[eids[i]] & IN_CPU
                ]
                idents = [
                    (index.disk[eids[i]], index.key(eids[i]), ledger.fingerprint_of(eids[i]))
                    for i in todo
                ]
                # Each read: the checksum its bytes were verified against, or for a payload
                # (decoded-form checksum, payload checksum); None: a miss; REFUSED_LOSSY: not
                # read, a lossy record of a namespace configured lossless here.
                reads: list[Awaitable[int | tuple[int, int] | str | None]] = []
                lossless: dict[int, int] = {}  # j -> checksum of the lossless record read
                exact = not ledger.accepts_lossy(first)
                for j, ((disk, key, fp), offset, i) in enumerate(
                    zip(idents, offsets, todo, strict=False)
                ):
                    view = ledger.arena.view[offset : offset + block_bytes]
                    args = (disk, key, fp, index.checksum[eids[i]], view)
                    if exact and tier.codec_of(disk) in LOSSY:
                        reads.append(_refused_lossy())  # never read: dropped in _take_read
                    elif not first.cpu_codec:
                        reads.append(tier.read_into_checked(*args))
                    elif tier.codec_of(disk) in LOSSY:
                        reads.append(self._read_payload(tier, *args))
                    else:
                        lossless[j] = self._lossless_sum(eids[i], disk, ns_id, key)
                        args = (disk, key, fp, lossless[j], view)
                        reads.append(self._read_encoded(tier, first, *args))

                def take(oks: list[Any]) -> None:
                    """Give each entry read intact its new CPU copy."""
                    for j, (i, (_, key, _), ok) in enumerate(zip(todo, idents, oks, strict=True)):
                        if self._take_read(eids[i], key, ok, j, offsets, lossless, ns_id):
                            results[i] = True

                reading = asyncio.gather(*reads, return_exceptions=True)
                try:
                    oks = await asyncio.shield(reading)
                except asyncio.CancelledError:
                    # The caller gave up, but the reads go on in the tier's IO threads, into
                    # these slots: the promotion ends when they do, not now. Its slots freed
                    # now, the next block put in one was overwritten by a read nobody waited
                    # for; unregistered now, every retry of an impatient reader started
                    # another read into more slots. A retry waits for this one instead.
                    detached = True

                    def finish(done: asyncio.Future[list[Any]]) -> None:
                        try:
                            if not done.cancelled():
                                take(done.result())
                        finally:
                            end()

                    reading.add_done_callback(finish)
                    raise
                take(oks)
        finally:
            if not detached:
                end()
        return results

    def _take_read(
        self,
        e: int,
        key: bytes,
        ok: Any,
        j: int,
        offsets: list[int],
        lossless: dict[int, int],
        ns_id: int,
    ) -> bool:
        """Install the CPU copy read for entry ``e`` into ``offsets[j]`` (then -1: taken), if
        the entry is still the block read and the read verified; False otherwise (the slot goes
        back to the pool with the others)."""
        ledger, index = self.ledger, self.ledger.index
        if not index.has_key(e, index.ns[e], key) or index.state[e] != State.COMMITTED:
            return False  # deleted while reading: the slot goes back to the pool
        if index.tier[e] & IN_CPU:
            return False
        if ok is REFUSED_LOSSY:
            # A lossy form of a namespace configured lossless here: not its committed bytes.
            # Dropped, so a put stores the block exactly again.
            ledger.nvme_counters.lossy_refused += 1
            ledger.forget(e)
            return False
        if ok is None or isinstance(ok, BaseException):
            # Corrupt, torn or unreadable on disk: a miss, counted.
            ledger.nvme_counters.checksum_failures += 1
            ledger.forget(e)
            return False
        if isinstance(ok, tuple):  # a payload: (decoded-form, payload checksum)
            ok, payload_sum = ok
            ledger.set_payload_sum(e, payload_sum)
        if j in lossless and ok != lossless[j]:
            self._keep_lossless_sum(e, index.disk[e], ns_id, key, ok, lossless[j])
        if ok != index.checksum[e]:
            # A lossy record: the CPU copy is its decoded form, verified against the checksum
            # taken of that form when it was encoded.
            ledger.set_host_checksum(e, ok)
        ledger.mark_in_cpu(e, offsets[j])
        offsets[j] = -1  # taken by the entry
        ledger.nvme_counters.promotions += 1
        return True

    def _lossless_sum(self, eid: int, disk: int, ns_id: int, key: bytes) -> int:
        """The checksum to read ``eid``'s lossless disk record with: its own, kept when an
        earlier promotion gave the entry its fp8 form's (``_lossless``), else the entry's."""
        checksum = self.ledger.index.checksum[eid]
        kept = self._lossless.get(eid)
        if kept is None:
            return checksum
        if kept[:4] != (disk, ns_id, key, checksum):  # another block's, or a copy since
            del self._lossless[eid]
            return checksum
        return kept[4]

    def _keep_lossless_sum(
        self, eid: int, disk: int, ns_id: int, key: bytes, entry_sum: int, record_sum: int
    ) -> None:
        if len(self._lossless) >= self._lossless_prune_at:  # drop those of gone copies
            index = self.ledger.index
            self._lossless = {
                e: v
                for e, v in self._lossless.items()
                if index.has_key(e, v[1], v[2])
                and (index.disk[e], index.checksum[e]) == (v[0], v[3])
            }
            self._lossless_prune_at = max(1024, 2 * len(self._lossless))
        self._lossless[eid] = (disk, ns_id, key, entry_sum, record_sum)

    def _unalloc(self, offsets: list[int], block_bytes: int) -> None:
        for offset in offsets:
            if offset >= 0:
                self.ledger.cpu_unalloc(offset, block_bytes)

    @staticmethod
    async def _read_payload(
        tier: Any, disk: int, key: bytes, fp: bytes, checksum: int, out: memoryview
    ) -> tuple[int, int] | None:
        """An fp8 record's payload promoted into a CPU tier of payloads: read, and its checksum
        taken, in private memory, then copied into the arena slot ``out`` (the checksum vouches
        for what came from disk, whatever writes into the shared slot meanwhile). (Its
        decoded-form checksum, its payload checksum); None: a miss."""
        private = bytearray(out.nbytes)
        got: tuple[int, int] | None = await tier.read_payload_into(disk, key, fp, checksum, private)
        if got is not None:
            await asyncio.to_thread(out.__setitem__, slice(None), private)
        return got

    @staticmethod
    async def _read_encoded(
        tier: Any,
        record: NamespaceRecord,
        disk: int,
        key: bytes,
        fp: bytes,
        checksum: int,
        out: memoryview,
    ) -> tuple[int, int] | None:
        """A lossless record promoted into a CPU tier of payloads (written before the
        namespace's ``cpu = "fp8"`` rule, or under a lossless NVMe codec): read and verified
        as it is, then encoded into ``out`` off the loop, as a put of it would be now. (Its
        decoded-form checksum, its payload checksum); None: a miss. Without this such a record
        was a miss, and the block was dropped."""
        fmt = block_format_of(record.namespace.layout) if record.namespace else None
        if fmt is None:
            return None
        block = bytearray(record.block_bytes)
        if await tier.read_into_checked(disk, key, fp, checksum, block) is None:
            return None
        sums: tuple[int, int] = await asyncio.to_thread(
            encode_payload_privately, memoryview(block), fmt, out, fp, key
        )
        return sums

    def prefetch(self, ns_id: int, keys: list[bytes], payer: Usage | None = None) -> int:
        """Start promoting the run's disk-only blocks in prefix order; returns how many were
        queued (``Prefetcher``). Spends the keys like a lookup (``keys_per_s``; the
        ``payer``'s, if any)."""
        ledger = self.ledger
        ledger.quotas.take_keys(ledger.names[ns_id], len(keys), payer)
        if ledger.nvme is None:
            return 0
        return self._prefetcher.queue(ns_id, keys)

    async def _promote_prefetched(self, eids: list[int]) -> bool:
        """A prefetch window's promotion; its blocks are marked prefetched (a read that finds
        one counts a prefetch hit). True when all came up."""
        results = await self._promote_many(eids)
        for eid, ok in zip(eids, results, strict=True):
            if ok:
                if eid >= len(self._prefetched):
                    self._prefetched.extend(bytes(eid + 1 - len(self._prefetched) + 1024))
                self._prefetched[eid] = 1
        return all(results)
