"""``NvmeTier``: the NVMe tier's mechanism as the daemon drives it (see the class docstring)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvstore.errors import KVStoreError
from kvstore.keys import FINGERPRINT_BYTES, KEY_BYTES
from kvstore.tiers import codecs
from kvstore.tiers.codecs import BlockFormat
from kvstore.tiers.nvme import ondisk as fmt
from kvstore.tiers.nvme import recovery
from kvstore.tiers.nvme.alloc import SlotAllocator
from kvstore.tiers.nvme.check import scrub, tombstone_orphans
from kvstore.tiers.nvme.diskio import FlushBarrier
from kvstore.tiers.nvme.meta import MetadataWriter
from kvstore.tiers.nvme.occupancy import Occupancy
from kvstore.tiers.nvme.ondisk import FILE_NAME, KIND_RECORD, PAGE, Geometry, Header, round_up
from kvstore.tiers.nvme.reads import MISS_COUNTER, RecordReader
from kvstore.tiers.nvme.recordio import RecordIO
from kvstore.tiers.nvme.records import (
    ALLOCATED,
    FREE,
    FREE_AFTER_WRITE,
    LIVE,
    WRITING,
    CheckProblem,
    CheckReport,
    Ident,
    NamespaceIds,
    NvmeRecord,
    RecordTable,
    SeqCounter,
)
from kvstore.tiers.nvme.scan import scan_records
from kvstore.tiers.nvme.slabfile import SlabFile, open_slab_file
from kvstore.tiers.nvme.tombstones import Tombstones

log = logging.getLogger(__name__)

DEFAULT_SLAB_BYTES = 256 << 20
"""Large slabs waste less at their tails (a 2 MiB block's slot is 2 MiB + 4 KiB)."""

T = TypeVar("T")


class NvmeIOError(KVStoreError, OSError):
    """A write could not be made durable (disk full, EIO). The tier has freed the slot."""


class NvmeTier:
    """The bytes of the NVMe tier: one slab file under ``directory`` and its slot allocation.

    Owns the file, the slot allocator (size classes carved from slabs, as in the CPU tier), the
    IO threads and the per-slot record identity it needs to verify reads. It knows nothing of
    eviction: the daemon's index decides which block lives where and which goes, and frees a
    slot when ``allocate`` returns None. Slot handles are byte offsets in the file.

    Slabs: a slab is carved for one slot size when a size needs room, and goes back to the pool
    when its last slot is freed, so any mix of block sizes shares the file. ``allocate``
    returns None only when no slab of the size has a free slot and the pool is empty; the
    daemon then frees a block of that size, or empties a slab of another size (``carved_slabs``,
    ``live_slots``, ``slab_of``): which, is its policy's choice. A slab's new carving is
    written to its descriptor (and the metadata) before any record in it commits, and no byte
    of it is written before every tombstone of the old carving has landed.

    Concurrency contract. Every method is called on the daemon's event loop thread.
    ``allocate`` (O(log slabs)), ``free``, ``stats``, ``slab_of``, ``carved_slabs`` and
    ``live_slots`` are sync and never block (a ``free`` that empties a slab also looks through
    the tombstones in flight). ``open``, ``write``, ``read_into``, ``sync``, ``drain`` and
    ``close`` are coroutines whose IO runs on threads (``os.preadv``/``pwritev`` release the
    GIL): ``io_threads`` threads for reads and ``io_threads`` more for writes, so a read never
    queues behind writes, and one thread for fdatasync. ``check`` is sync and blocks
    its caller while it reads the whole tier: for start-up, the CLI and tests.

    Checksums: every checksum the tier takes, stores and hands out is
    ``kvstore.checksum.block_checksum(data, namespace, key)``, and every read verifies the bytes
    against the key and namespace they are read for, so a header that names another key never
    vouches for a payload.

    Slot life: ``allocate`` -> ``write`` (once) -> any number of ``read_into`` -> ``free``. A
    ``write`` that raises has freed the slot. ``free`` during a write takes effect when the write
    ends; a cancelled ``write`` frees its slot the same way (the caller must not free it). The
    buffer given to ``write`` must not change until it returns; ``out`` of a cancelled
    ``read_into`` may still be written until its IO ends (``close`` waits for that).

    Write modes: what a record survives once ``write`` has returned.

    * ``write(..., durable=True)`` (the default): a process crash (``kill -9``) and a power loss
      or kernel crash. Protocol: payload; the slab's descriptor and the metadata if its carving
      is new; flush barrier; header page; flush barrier; return. The header is the commit record
      and is written only once the payload (and the carving that lets recovery find the slot)
      is on stable storage, so a crash at any point leaves either the complete record or a slot
      with no valid header of this write; the header is one 4 KiB write with its checksum in
      the first sector, never half-valid. The barriers are group-committed fdatasyncs (writers
      in flight together share one): they keep that order across a power loss and commit the
      extent metadata of the preallocated file, which O_DIRECT alone does not. "Stable
      storage" is what fdatasync promises: a device that acknowledges flushes it has not done
      defeats it.
    * ``write(..., durable=False)``: a process crash only. The same writes without the
      barriers (a new carving first; then payload and header, in that order, in one job on
      a write thread): when it returns, the kernel holds every byte (the page cache, or the
      device itself under O_DIRECT), so the daemon's death loses nothing. A power loss or
      kernel crash before the bytes reach stable storage may lose the record, or bring it back
      as a record whose payload fails its checksum (the header reached the disk, the payload did
      not): a miss at read and "corrupt" in ``check``, never another block's bytes, because
      the checksum binds key and namespace. Costs no fdatasync.
    * ``await sync()``: a barrier. When it returns, every write that returned before it was
      called, in either mode, survives a power loss as a durable write does. Concurrent callers
      (and durable writers) share fdatasyncs. It does not wait for writes still in flight, and
      it does not cover frees (a freed record may come back, bit-exact, until its tombstone is
      flushed: see the free rule).

    A daemon that acknowledges a put only once it is durable either writes with
    ``durable=True`` or writes plain and acknowledges a batch after one ``sync()``. Writes
    before ``open`` returns (formatting, repairs) and at ``close`` are always durable.

    Free rule: ``free`` returns the slot to the allocator at once and writes a tombstone header
    (kind tombstone, a fresh sequence number) over the record's header in the background. The
    tombstone is flushed before the slot's next payload write starts (``write`` waits for it), so
    an old header never describes new bytes. A freed record is not recovered once its tombstone
    is flushed: milliseconds after ``free``, and always before ``close`` returns. A crash inside
    that window can bring it back, intact and bit-exact (committed blocks are immutable).

    Recovery: ``open`` reads the two metadata copies and every slab's descriptor (see
    ``recovery``), then every header of every carved slab (in parallel, 4 KiB each) and returns
    the valid records, oldest first. Of two valid records of one key the newer (sequence number)
    stays and the older is tombstoned. Headers are always scanned rather than trusted from a
    checkpoint, so a header damaged while the daemon was down drops its record at open.
    Payloads are verified by every ``read_into`` and by ``check``. Damaged metadata loses only
    the records nothing else vouches for: one damaged metadata copy, none (the other copy); both
    copies, none (the slab descriptors rebuild them); a slab's descriptor, none (the metadata's
    slab map); a descriptor and both copies, that slab's records. A truncated file keeps every
    record wholly inside what is left and grows back to its capacity. Open rewrites whatever
    metadata it found damaged.

    Geometry: the file records its capacity and slab size, and an open configured with others
    is refused (NvmeFormatError naming both, nothing written) rather than adopting the file's
    (the daemon's capacity accounting and its operator's intent follow the configuration) or
    reformatting it (a mistyped size must not wipe the tier). To resize, delete the file. A
    file of an older format version is reformatted with a warning (its records cannot be
    verified by this version's checksums); one of a newer version is refused.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        codec: str | None = None,
        direct_io: bool = True,
        io_threads: int = 4,
        slab_bytes: int = DEFAULT_SLAB_BYTES,
    ) -> None:
        default_codec = codecs.codec_id(codec or "none")
        if io_threads < 1:
            raise ValueError(f"io_threads must be positive, got {io_threads}")
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, FILE_NAME)
        self.geometry = Geometry.plan(capacity_bytes, slab_bytes)
        self.capacity_bytes = capacity_bytes
        self.codec = codec
        self.direct_io = False  # whether O_DIRECT is in use: known after open
        self.preallocated = False  # whether fallocate reserved the whole file: after open
        self._codec = default_codec
        self._want_direct = direct_io
        self._alloc = SlotAllocator(self.geometry)
        self._namespaces = NamespaceIds()
        self._tables: list[RecordTable | None] = [None] * len(self.geometry.slab_sizes)
        self._reserved = 0  # slots allocated and not (yet) committed
        self._tasks: set[asyncio.Future[Any]] = set()
        self._file: SlabFile | None = None
        self._io = RecordIO(-1, False)  # the open file's, once open
        self._format_id = 0
        self._seq = SeqCounter()
        # Made by open, from what it finds in the file:
        self._meta: MetadataWriter  # the metadata copies and slab descriptors
        self._tombs: Tombstones  # the tombstones in flight, failed, and to settle
        self._state = "new"
        self._read_only = False
        self._damage: list[tuple[int, str]] = []  # what a read-only open found and left
        # Threads start on first use; open() hands the flusher its descriptor.
        self._read_pool = ThreadPoolExecutor(io_threads, thread_name_prefix="nvme-read")
        self._write_pool = ThreadPoolExecutor(io_threads, thread_name_prefix="nvme-write")
        self._flush = FlushBarrier(ThreadPoolExecutor(1, thread_name_prefix="nvme-flush"))
        counters = ("reads", "writes", "durable_writes", "syncs", "read_bytes", "write_bytes")
        self._counters = dict.fromkeys((*counters, "misses", *MISS_COUNTER.values()), 0)
        self._occupancy = Occupancy()
        self._reader = RecordReader(self._record_table, self._read_pool, self._counters)

    @staticmethod
    def slot_bytes_for(payload_bytes: int) -> int:
        """The slot a record whose payload is at most ``payload_bytes`` takes."""
        return PAGE + round_up(payload_bytes)

    def payload_bytes_for(
        self,
        block_bytes: int,
        codec: int | str | None = None,
        block_format: BlockFormat | None = None,
    ) -> int:
        """What to ``allocate`` for a block of ``block_bytes`` written with ``codec`` (the tier's
        default when None): the codec's bound on its payload (``codecs.plan``). Capacity is
        counted in the slots that gives, so an fp8 record takes about half a bf16 block's."""
        return codecs.plan(self._codec if codec is None else codec, block_format, block_bytes)[1]

    def slot_size(self, slot: int) -> int:
        """Bytes of the slot ``slot`` (of its slab's carving)."""
        return self._alloc.slot_bytes_at(slot)

    # ------------------------------------------------------------------ life cycle
    async def open(self, *, read_only: bool = False, create: bool = True) -> list[NvmeRecord]:
        """Create the file, or recover it: every intact committed record, oldest first.

        Raises NvmeFormatError, writing nothing, when the file holds a tier of another geometry
        (capacity or slab size: the message names both; the configuration is wrong, or the file
        must be deleted to start an empty tier of the new size) or of a newer format. A file of
        an older format, or holding no tier metadata at all, is formatted (logged), unless
        ``create`` is False: then that is an NvmeFormatError too, and a missing file a
        FileNotFoundError. RuntimeError if another process holds the file.

        ``read_only``: open the file read-only (a shared lock, so not while a daemon has it) and
        write nothing, ever: no repair, no tombstone, no clean mark; for ``check`` and
        inspection. ``allocate``, ``write`` and ``free`` raise; ``check`` reports what a
        read-write open would repair (kind "metadata")."""
        if self._state != "new":
            raise RuntimeError(f"open of a tier that is {self._state}")
        self._state = "opening"
        self._read_only = read_only
        try:
            file = await self._run(self._write_pool, self._io_open, create and not read_only)
            self._io = io = file.io
            self.direct_io, self.preallocated = io.direct_io, file.preallocated
            found = file.found
            self._format_id, self._seq.next = found.format_id, found.next_seq
            geo, seq, write, flush = self.geometry, self._seq, self._write_page, self._flush
            self._meta = MetadataWriter(
                geo, found.format_id, found.generation, found.descriptors, seq, write, flush
            )
            self._tombs = Tombstones(
                geo,
                found.format_id,
                seq,
                write,
                flush,
                self._track,
                self._counters,
                self._write_pages,
            )
            self._flush.fd = io.fd
            records = await self._recover(found)
            if read_only:
                self._damage = list(found.damage)
            else:
                await self._meta.repair(self._alloc, found.meta_ok)
            clean = found.clean
        except BaseException:
            await self._shutdown()
            self._state = "closed"
            raise
        self._state = "open"
        log.info(
            "nvme tier %s: %d records recovered after %s shutdown, O_DIRECT %s",
            self.path,
            len(records),
            "a clean" if clean else "an unclean",
            "on" if self.direct_io else "off",
        )
        return records

    def _io_open(self, create: bool) -> SlabFile:
        # Kept as it is opened (on the thread): an open whose caller was cancelled still has
        # its file closed by _shutdown, which waits for this thread first.
        self._file = open_slab_file(
            self.directory,
            self.path,
            self.geometry,
            read_only=self._read_only,
            create=create,
            direct_io=self._want_direct,
        )
        return self._file

    async def drain(self) -> None:
        """Wait until every write and background tombstone started so far has finished."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Finish all IO, retry failed tombstones, mark the state clean, release the file."""
        if self._state != "open":
            return
        self._state = "closing"
        if self._read_only:
            await self._shutdown()
            self._state = "closed"
            return
        try:
            await self.drain()
            await self._tombs.retry_failed()
            await self._meta.write(self._alloc, clean=True)
            await self._flush.barrier()
        except OSError as exc:
            # Nothing is lost: the next open scans every header whatever the flag says.
            log.warning("nvme tier %s: clean-shutdown mark failed: %s", self.path, exc)
        finally:
            await self._shutdown()
            self._state = "closed"

    async def _shutdown(self) -> None:
        # Pools first, waiting for every queued IO: a cancelled caller's IO may still run, and
        # closing the descriptor under it could let it touch whatever file reuses the number.
        for executor in (self._read_pool, self._write_pool, self._flush.executor):
            await asyncio.to_thread(executor.shutdown, True)
        if self._file is not None:
            self._file.close()
            self._file = None

    def _require_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"nvme tier is {self._state}, not open")

    def _require_writable(self) -> None:
        self._require_open()
        if self._read_only:
            raise RuntimeError("nvme tier is open read-only")

    # ------------------------------------------------------------------ slots
    def allocate(self, block_bytes: int) -> int | None:
        """A free slot for a payload of ``block_bytes`` (a block's size for lossless codecs,
        ``payload_bytes_for`` for any), or None when no slab carved for that slot size has a
        free slot and no slab is left in the pool: evict a block of that size and ask again,
        or empty a slab of another size (``live_slots``) and ask again."""
        self._require_writable()
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        slot_bytes = self.slot_bytes_for(block_bytes)
        if slot_bytes > self.geometry.slab_bytes - PAGE:
            raise ValueError(
                f"a {block_bytes}-byte block does not fit a {self.geometry.slab_bytes}-byte slab"
                " (its first page is the slab's descriptor)"
            )
        slot = self._alloc.allocate(slot_bytes)
        if slot is not None:
            slab, i = self._alloc.locate(slot)
            table = self._tables[slab]
            if table is None:  # newly carved
                table = RecordTable(self._alloc.slot_count(slab), self._namespaces)
                self._tables[slab] = table
            assert table.state[i] == FREE, f"allocator out of sync: slot {slot} given twice"
            table.state[i] = ALLOCATED
            self._reserved += 1
        return slot

    def free(self, slot: int) -> None:
        """Give the slot back; its record is invalidated on disk lazily (see the free rule).
        A slab left with no slot in use goes back to the pool of uncarved slabs."""
        self._require_writable()
        table, i = self._record_table(slot)
        state = table.state[i]
        if state == FREE:
            raise ValueError(f"free of slot {slot}, which is not allocated")
        if state & ~FREE_AFTER_WRITE == WRITING:
            table.state[i] = WRITING | FREE_AFTER_WRITE
            return
        if state == LIVE:
            self._occupancy.add(self._alloc.slot_bytes_at(slot), table, i, -1)
        else:
            self._reserved -= 1
        self._release(slot, table, i, tombstone=state == LIVE)

    def slab_of(self, slot: int) -> int:
        """The slab that holds ``slot``."""
        return self.geometry.slab_of(slot)

    def carved_slabs(self) -> dict[int, int]:
        """Slot bytes of every carved slab, by slab; the other slabs are in the pool."""
        return {slab: self._alloc.slab_slot_bytes[slab] for slab in self._alloc.carved()}

    def live_slots(self, slab: int) -> list[int]:
        """The slots of ``slab`` in use (allocated, being written, or holding a record); [] for
        a slab in the pool. Freeing them all returns the slab to the pool, where any block size
        can take it: how the daemon's policy makes room for a size ``allocate`` refuses."""
        table = self._tables[slab]
        if table is None:
            return []
        return [s for i, s in enumerate(self._alloc.slots(slab)) if table.state[i] != FREE]

    def _record_table(self, slot: int) -> tuple[RecordTable, int]:
        """The record table of the slot's slab and the slot's index in it; ValueError if
        ``slot`` is not a slot of a carved slab."""
        slab, i = self._alloc.locate(slot)
        table = self._tables[slab]
        assert table is not None, f"carved slab {slab} has no record table"
        return table, i

    def _release(self, slot: int, table: RecordTable, i: int, *, tombstone: bool) -> None:
        table.state[i] = FREE
        if tombstone:
            self._start_tombstone(slot)
        if self._alloc.release(slot):
            self._return_slab(self.geometry.slab_of(slot))

    def _return_slab(self, slab: int) -> None:
        """Uncarve an empty slab. Nothing is written: its descriptor keeps the old carving
        until a new one is persisted, and recovery releases a slab with no record again. The
        old carving's tombstones still in flight or failed are settled before any payload of
        the next carving goes into the slab (``Tombstones.settle_slab``): a late tombstone must
        never land in the new carving's bytes, and an old header must never survive to describe
        them."""
        self._tombs.uncarving(slab)
        self._alloc.uncarve(slab)
        self._tables[slab] = None

    def _start_tombstone(self, slot: int) -> None:
        pages = self._alloc.slot_bytes_at(slot) // PAGE  # of this carving, whatever comes next
        self._tombs.start(slot, pages)

    def _track(self, fut: asyncio.Future[Any]) -> None:
        self._tasks.add(fut)
        fut.add_done_callback(self._untrack)

    def _untrack(self, fut: asyncio.Future[Any]) -> None:
        self._tasks.discard(fut)
        if not fut.cancelled():
            fut.exception()  # marks it retrieved; an awaiting caller still gets it raised

    # ------------------------------------------------------------------ write
    async def write(
        self,
        slot: int,
        key: bytes,
        namespace: bytes,
        data: Any,
        checksum: int,
        *,
        durable: bool = True,
        codec: int | str | None = None,
        block_format: BlockFormat | None = None,
        encoded_length: int = 0,
    ) -> None:
        """Store a block in an allocated slot: on stable storage when it returns if ``durable``,
        else held by the kernel (see the class docstring's write modes). ``checksum`` is the
        block's checksum bound to its key and namespace, ``block_checksum(data, namespace,
        key)``. ``codec`` (the tier's default when None) encodes it, on an IO thread; a lossy
        codec is applied only with the block's ``block_format`` (else its lossless part is, see
        ``codecs.plan``), and the slot must be of ``payload_bytes_for`` the same arguments.
        Raises NvmeIOError on an IO failure and ValueError if ``data`` does not match
        ``checksum`` or its payload cannot fit the slot; after either the slot is free again.

        ``encoded_length``: ``data`` is already the fp8 payload of a block of that many bytes
        (a CPU-tier entry of a ``cpu = "fp8"`` namespace), and ``checksum`` is its decoded
        form's. It is stored as it is (lz4 over it for ``fp8+lz4``), never re-encoded; it is
        decoded once to verify it against ``checksum`` (ValueError if it does not decode to
        it)."""
        self._require_writable()
        table, i = self._record_table(slot)
        if table.state[i] != ALLOCATED:
            raise ValueError(f"write to slot {slot}, which is not allocated and unwritten")
        if len(key) != KEY_BYTES or len(namespace) != FINGERPRINT_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes and namespace {FINGERPRINT_BYTES}")
        view = memoryview(data).cast("B")
        slot_bytes = self._alloc.slot_bytes_at(slot)
        length = encoded_length or view.nbytes
        planned, bound = codecs.plan(self._codec if codec is None else codec, block_format, length)
        if encoded_length and (planned not in codecs.LOSSY or view.nbytes != bound):
            raise ValueError(
                f"a {view.nbytes}-byte payload of a {length}-byte block cannot be stored with "
                f"{codecs.NAME_OF[planned]} (an fp8 payload of it is {bound} bytes)"
            )
        if view.nbytes == 0 or bound > slot_bytes - PAGE:
            raise ValueError(
                f"{view.nbytes}-byte block ({codecs.NAME_OF[planned]}: up to {bound} bytes) "
                f"does not fit a {slot_bytes}-byte slot"
            )
        table.state[i] = WRITING
        task = asyncio.ensure_future(
            self._write_record(
                slot,
                table,
                i,
                bytes(key),
                bytes(namespace),
                view,
                checksum,
                durable,
                (planned, block_format),
                length,
            )
        )
        self._track(task)
        try:
            # Shielded: a cancelled caller leaves the IO to finish and the slot in a known state.
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                table.state[i] = WRITING | FREE_AFTER_WRITE
            elif not task.cancelled() and task.exception() is None and not task.result():
                self.free(slot)  # committed just as the caller gave up (and not freed yet)
            raise

    async def _write_record(
        self,
        slot: int,
        table: RecordTable,
        i: int,
        key: bytes,
        namespace: bytes,
        view: memoryview,
        checksum: int,
        durable: bool,
        coding: tuple[int, BlockFormat | None],
        length: int,
    ) -> bool:
        """The write itself; True if a ``free`` that arrived during it has been applied.
        ``length`` is the block's (more than ``view``'s when ``view`` is its fp8 payload)."""
        seq = self._seq.take()
        header_tried = False
        try:
            await self._tombs.settle_slab(self.geometry.slab_of(slot))
            await self._tombs.settle(slot)
            io, block = self._io, (slot, key, namespace, view, checksum)
            pages = self._alloc.slot_bytes_at(slot) // PAGE
            if not durable:
                # No barrier to order: the carving first, then payload and header in one job.
                await self._meta.persist_carving(self._alloc, self.geometry.slab_of(slot))
                try:
                    record = (key, namespace, view, checksum)
                    stored, codec, decoded, stored_sum = await self._run(
                        self._write_pool, io.write_record, slot, record, coding, length, pages, seq
                    )
                except ValueError:
                    raise  # raised before anything of this record was written
                except BaseException:
                    header_tried = True  # the header may have landed (or still may)
                    raise
            else:
                if length != view.nbytes:  # an fp8 payload: stored as it is
                    w = self._run(self._write_pool, io.write_encoded, *block, coding[0], length)
                else:
                    w = self._run(self._write_pool, io.write_payload, *block, *coding)
                stored, codec, decoded, stored_sum = await w
                # Recovery looks for headers only where the slab map on disk says slots are.
                await self._meta.persist_carving(self._alloc, self.geometry.slab_of(slot))
                await self._flush.barrier()
                fields = (pages, slot, seq, self._format_id, key, namespace, length, stored)
                header = fmt.pack_header(Header(KIND_RECORD, codec, *fields, decoded, stored_sum))
                header_tried = True
                await self._write_page(slot, header)
                await self._flush.barrier()
        except BaseException as exc:
            # A header whose write or flush reported an error may still have landed, so such a
            # slot is tombstoned before anyone can reuse it.
            self._reserved -= 1
            self._release(slot, table, i, tombstone=header_tried)
            if isinstance(exc, OSError):
                self._counters["io_errors"] += 1
                raise NvmeIOError(
                    exc.errno or errno.EIO, f"write of slot {slot} failed: {exc.strerror or exc}"
                ) from exc
            raise
        free_now = table.state[i] & FREE_AFTER_WRITE
        ident = Ident(key, namespace, length, stored, codec, decoded, seq)
        table.set_record(i, ident, committed=checksum)
        table.state[i] = LIVE
        self._reserved -= 1
        self._occupancy.add(self._alloc.slot_bytes_at(slot), table, i, +1)
        self._counters["writes"] += 1
        self._counters["durable_writes"] += durable
        self._counters["write_bytes"] += 2 * PAGE + round_up(stored)
        if free_now:
            self.free(slot)
        return bool(free_now)

    async def sync(self) -> None:
        """Return once every write that returned before this call is on stable storage (one
        fdatasync, shared with concurrent callers and durable writers). Raises OSError if the
        fdatasync fails: then nothing written since the last successful barrier is known to be
        durable."""
        self._require_writable()
        await self._flush.barrier()
        self._counters["syncs"] += 1

    async def _write_page(self, offset: int, page: bytes | bytearray) -> None:
        """Write whole pages (a header, a descriptor, metadata) at ``offset``, on a write
        thread."""
        await self._run(self._write_pool, self._io.write_at, offset, page)

    async def _write_pages(self, pages: list[tuple[int, bytearray]]) -> list[OSError | None]:
        """Write header pages (tombstones) at their offsets in one job on a write thread."""
        return await self._run(self._write_pool, self._io.write_pages, pages)

    # ------------------------------------------------------------------ read
    async def read_into(
        self, slot: int, key: bytes, namespace: bytes, checksum: int, out: Any
    ) -> bool:
        """Read the block in ``slot`` into ``out`` (exactly its length). False, a miss, when the
        record on disk is not this block intact: short read, header mismatch, checksum or
        decoding failure, IO error. ``out`` holds undefined bytes after a miss."""
        return await self.read_into_checked(slot, key, namespace, checksum, out) is not None

    async def read_into_checked(
        self, slot: int, key: bytes, namespace: bytes, checksum: int, out: Any
    ) -> int | None:
        """``read_into``, returning the checksum ``out``'s bytes were verified against (None: a
        miss). ``checksum`` is the block's committed checksum or the record's own; they differ
        only for a record a lossy codec wrote, whose read yields its decoded form, verified
        against (and returning) the checksum of that form taken when it was encoded. Test ``is
        None``: a checksum may be 0."""
        return await self._reader.read_into_checked(self._io, slot, key, namespace, checksum, out)

    def holds_lossy(self) -> bool:
        """Whether any live record was written by a lossy codec."""
        return self._occupancy.holds_lossy()

    def codec_of(self, slot: int) -> int | None:
        """The codec id of the committed record in ``slot``; None when it holds none."""
        return self._reader.codec_of(slot)

    async def read_payload_into(
        self, slot: int, key: bytes, namespace: bytes, checksum: int, out: Any
    ) -> tuple[int, int] | None:
        """Read the fp8 payload a lossy record holds (lz4 undone, never decoded into the block)
        into ``out`` (exactly the payload's length): (the record's decoded-form checksum, the
        payload's checksum), or None, a miss: not this block's intact fp8 record (a lossless
        record too: its block is not a payload). For a CPU tier of payloads."""
        return await self._reader.read_payload_into(self._io, slot, key, namespace, checksum, out)

    async def _run(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    # ------------------------------------------------------------------ recovery
    async def _recover(self, found: recovery.Found) -> list[NvmeRecord]:
        """Scan the headers of every carved slab; the newest record of each key that lies
        wholly inside the file (a truncated file keeps what it still holds) is recovered."""
        slab_map = found.slab_map
        self._alloc = SlotAllocator.restore(self.geometry, slab_map, set())
        scanned = await scan_records(
            self._io.fd, self._alloc, found.size, self._format_id, self._seq.next - 1
        )
        self._seq.next = scanned.max_seq + 1
        live = {h.slot for h in scanned.newest}
        self._alloc = SlotAllocator.restore(self.geometry, slab_map, live)
        for slab in self._alloc.carved():
            self._tables[slab] = RecordTable(self._alloc.slot_count(slab), self._namespaces)
        records = []
        for h in scanned.newest:
            table, i = self._record_table(h.slot)
            ident = Ident(h.key, h.namespace, h.length, h.stored_length, h.codec, h.checksum, h.seq)
            table.set_record(i, ident)
            table.state[i] = LIVE
            self._occupancy.add(self._alloc.slot_bytes_at(h.slot), table, i, +1)
            records.append(NvmeRecord(h.slot, *ident[:4], h.checksum, h.seq))
        for slot in scanned.stale:  # older copies of a key: free, invalidated before reuse
            if self._read_only:  # left as they are: the next read-write open's job
                self._tombs.failed[slot] = self._alloc.slot_bytes_at(slot) // PAGE
            else:
                self._start_tombstone(slot)
        if not self._read_only:  # slabs without a record go back to the pool
            for slab in self._alloc.carved():
                if self._alloc.used[slab] == 0:
                    self._return_slab(slab)
        await self.drain()
        return records

    # ------------------------------------------------------------------ check, stats
    def check(self, fix: bool = False) -> CheckReport:
        """Verify every slot of every carved slab: a live slot's header and payload against its
        record, a free slot's header against being a record. Blocks the caller while it reads
        the whole tier; slots with a write or a tombstone in flight are skipped. With ``fix``,
        damaged live records are freed (the report names their keys: drop them from the index)
        and orphans are tombstoned (a tier opened read-only cannot fix: ValueError)."""
        self._require_open()
        if fix and self._read_only:
            raise ValueError("check(fix=True) of a tier opened read-only")
        problems = [CheckProblem(at, "metadata", None, what) for at, what in self._damage]
        tombs = self._tombs
        checked, ok, found = scrub(
            self._io, self._alloc, self._tables, tombs.in_flight, tombs.failed, self._format_id
        )
        problems += found
        if fix and problems:
            self._fix(problems)
        return CheckReport(checked, ok, problems, fix)

    def _fix(self, problems: list[CheckProblem]) -> None:
        # Orphans first: freeing a damaged record may return its slab to the pool.
        tombstone_orphans(self._io, self._alloc, self._tombs, problems)
        for p in problems:
            if p.kind not in ("orphan", "metadata"):  # metadata: reported by read-only opens
                table, i = self._record_table(p.slot)
                if table.state[i] == LIVE:
                    self.free(p.slot)  # tombstoned in the background, like any free

    def namespace_bytes(self) -> dict[bytes, tuple[int, int, int]]:
        """(blocks, logical bytes, slot bytes) of the live records, by namespace fingerprint."""
        return self._occupancy.by_namespace(self._namespaces.names)

    def stats(self) -> dict[str, int | float | bool]:
        """Occupancy and counters. ``used_bytes``: slot bytes of the committed records (a record
        holds its whole slot: what capacity counts); ``logical_bytes``: the raw blocks they
        hold; ``stored_bytes``: the pages they fill; ``compression_ratio``: raw bytes / stored
        payload pages over the live records; ``records_<codec>``: live records by the codec that
        wrote them."""
        occupancy = self._occupancy
        return {
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": occupancy.used_bytes,
            "logical_bytes": occupancy.raw_bytes,
            **occupancy.by_codec(),
            "stored_bytes": occupancy.stored_with_headers,
            "blocks": occupancy.blocks,
            "reserved_slots": self._reserved,
            "compression_ratio": occupancy.compression_ratio,
            "direct_io": self.direct_io,
            "preallocated": self.preallocated,
            "flushes": self._flush.flushes,
            **self._counters,
        }
