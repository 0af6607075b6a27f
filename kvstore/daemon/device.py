"""The daemon's GPU tier: which blocks sit in the device pool, and moving them to and from the
CPU tier.

Workers on the daemon's GPU write blocks into pool slots themselves (a device-to-device gather)
and read them back the same way; the daemon never sees those bytes on the way. What it does:

- hands out pool slots (``alloc``), evicting the coldest unleased blocks; a victim that exists
  nowhere else is first copied down to the CPU tier (write-back);
- keeps at least ``1 - high_watermark`` of the pool free or clean in the background, coldest
  first, so an offload rarely waits on PCIe, and copies a block down at once when a tier below
  writes through (NVMe or Redis write-through need a CPU copy to start from);
- copies GPU-only blocks down for readers that cannot reach the pool (``move_down``) and promotes
  CPU blocks up for workers that asked for a prefetch (``prefetch``).

Checksums: a GPU block carries a *device checksum* (``kernels.device_checksums``, computed on the
GPU in parallel), written by the worker at commit and re-made by the daemon when it promotes a
block; a CPU copy carries the xxh3 every lower tier uses. Each crossing verifies the copy it
makes: down, the device checksum of the source after the copy (then the xxh3 of the host copy is
computed); up, the xxh3 of the host source before the copy (then the device checksum of the
result). A mismatch is a miss, counted, never wrong data.

Which entry holds which pool slot, the device checksums and the GPU policy are the ledger's
(``pool_slots.PoolSlots``, ``Ledger.gpu_policy``): this tier makes the copies and reports each
one there. Event-loop only; copies run in a worker thread on a stream of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvstore import kernels
from kvstore.checksum import checksum_seed, seeded_checksum
from kvstore.daemon.prefetch import Prefetcher
from kvstore.daemon.room import TierSlots, make_room
from kvstore.daemon.tier_contract import count_in, droppable, leading_in
from kvstore.daemon.tierstats import TierCounters, TierSnapshot
from kvstore.daemon.writeback import bytes_to_clean, pick_writeback
from kvstore.errors import CapacityError
from kvstore.index import BELOW_GPU, IN_CPU, IN_GPU, State
from kvstore.tiers.cpu import HEADER_BYTES, SlabAllocator
from kvstore.tiers.gpu import DevicePool, cuda_usable

if TYPE_CHECKING:
    from kvstore.config import GpuTierConfig
    from kvstore.daemon.ledger import Ledger
    from kvstore.daemon.quotas import Usage

log = logging.getLogger(__name__)

# Blocks per copy batch: enough to keep a copy engine busy, few enough to yield to the loop.
_BATCH = 32


def make_device_pool(config: GpuTierConfig) -> DevicePool | None:
    """The pool the config asks for, or None. "auto" without CUDA is off; "on" without it is
    an error that names what is missing."""
    if config.enabled == "off":
        return None
    reason = cuda_usable()
    if reason is None and config.device >= torch.cuda.device_count():
        reason = f"there is no CUDA device {config.device} ({torch.cuda.device_count()} visible)"
    if reason is not None:
        if config.enabled == "on":
            raise RuntimeError(f"the gpu tier is on but {reason}")
        log.info("gpu tier off: %s", reason)
        return None
    return DevicePool(config.capacity_bytes + HEADER_BYTES, torch.device("cuda", config.device))


class HostTier(Protocol):
    """The tiers below the GPU pool as it reaches them (``Mover``): promotion of blocks below
    the CPU tier, write-back of blocks new in it."""

    async def move_up(self, eids: list[int]) -> list[int]:
        """Bring blocks only on disk into the CPU tier (the NVMe tier's ``move_up``)."""
        ...

    def note_committed(self, eids: list[int]) -> None: ...


class SharedBelow(Protocol):
    """The shared Redis tier as the GPU tier reaches it: write-through of blocks copied down."""

    @property
    def enabled(self) -> bool: ...

    def note_committed(self, eids: list[int]) -> None: ...


class DeviceTier:
    """The GPU tier of the tier contract (``tier_contract.Tier``); see the module docstring.
    ``pool`` None: the tier is off and every method is a no-op.
    ``cpu_room``: room in the CPU tier for blocks copied down (``CpuRoom.alloc_cpu``);
    ``host``: the tiers below (``Mover``); ``shared``: the Redis tier (write-through)."""

    def __init__(
        self,
        ledger: Ledger,
        pool: DevicePool | None,
        cpu_room: Callable[..., Awaitable[list[int]]],
        host: HostTier,
        shared: SharedBelow,
    ) -> None:
        self.name = "gpu"
        self.ledger = ledger
        self.cpu_room = cpu_room
        self.host = host
        self.shared = shared
        self.config = ledger.config.gpu
        self.pool = pool
        self.allocator = (
            SlabAllocator(pool.size_bytes, self.config.slab_bytes) if pool is not None else None
        )
        if self.allocator is not None:
            ledger.attach_pool(self.allocator)
        self.books = ledger.gpu_slots  # read here; written by the ledger alone
        self.counters = TierCounters()
        self._moving: dict[int, asyncio.Future[bool]] = {}
        # Entries queued by a prefetch and not reached yet, with their (namespace, key).
        self._eager: deque[int] = deque()
        self._wake = asyncio.Event()
        self._room = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._copies: set[asyncio.Task[Any]] = set()
        self._cleaner: asyncio.Task[None] | None = None
        self._host: torch.Tensor | None = None
        self._stream: Any = None
        self._pinned = False
        index = ledger.index
        self._prefetcher = Prefetcher(
            ledger,
            window=_BATCH,
            wanted=lambda e: not index.tier[e] & IN_GPU and e not in self._moving,
            promote=self._promote,
            spawn=self._spawn,
        )

    @property
    def enabled(self) -> bool:
        return self.pool is not None

    # ----------------------------------------------------------------- life cycle
    async def start(self) -> None:
        if self.pool is None:
            return
        self._host = torch.frombuffer(self.ledger.arena.buffer, dtype=torch.uint8)
        if self.pool.device.type == "cuda":
            # Pinned, the arena is reached by DMA at PCIe speed, with no staging copy.
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(self._host.data_ptr(), self._host.numel(), 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of the CPU arena failed: {err}")
            self._pinned = True
            self._stream = torch.cuda.Stream(self.pool.device)
        self._cleaner = asyncio.create_task(self._clean_loop())

    async def stop(self) -> None:
        if self._cleaner is not None:
            self._cleaner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._cleaner
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._copies_done()
        if not self.ledger.config.nvme.enabled:
            return  # nothing outlives the daemon but the disk
        # Dirty GPU blocks go down so the drain to NVMe that follows finds them.
        dirty = [
            e for e in self.ledger.gpu_policy.order() if not self.ledger.index.tier[e] & BELOW_GPU
        ]
        if dirty:
            try:
                await asyncio.wait_for(
                    self.move_down(dirty, partial=True), self.ledger.config.drain_timeout_s
                )
            except TimeoutError:
                log.warning("gpu drain timed out")
            await self._copies_done()

    async def _copies_done(self) -> None:
        """Wait for copies in flight: their threads use the pool and the pinned arena, which
        ``close`` frees."""
        while self._copies:
            await asyncio.gather(*list(self._copies), return_exceptions=True)

    def close(self) -> None:
        if self._pinned and self._host is not None:
            torch.cuda.cudart().cudaHostUnregister(self._host.data_ptr())
            self._pinned = False
        self._host = None
        if self.pool is not None:
            self.pool.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _shielded(self, coro: Any) -> Any:
        """Run a copy and its bookkeeping to the end even if the caller is cancelled (a client's
        deadline, a shutdown): a copy thread cannot be stopped, and the slots and leases it
        holds must be settled after it, not while it still reads or writes them."""
        task = asyncio.create_task(coro)
        self._copies.add(task)
        task.add_done_callback(self._copies.discard)
        return await asyncio.shield(task)

    # ----------------------------------------------------------------- slots
    async def alloc(self, block_bytes: int, n: int, partial: bool = False) -> list[int]:
        """``n`` pool slots, evicting the coldest unleased blocks of the same slot size; a victim
        with no copy below is copied down first. All or nothing (CapacityError) unless
        ``partial``. One caller makes room at a time."""
        assert self.allocator is not None
        ledger, index, allocator = self.ledger, self.ledger.index, self.allocator
        allocator.check_fits(block_bytes)

        def protected(eid: int) -> bool:
            return bool(index.leases[eid]) or eid in self._moving

        slots = TierSlots(
            name="gpu",
            allocator=allocator,
            take_slots=ledger.gpu_alloc_many,
            give_back=ledger.gpu_unalloc,
            slot_of=lambda eid: self.books.offset[eid],
            owner_of=ledger.gpu_owner,
            class_of=lambda eid: (allocator.slot_bytes_for(ledger.block_bytes_of(eid)), 0),
        )
        async with self._room:
            return await make_room(
                slots,
                block_bytes,
                n,
                partial=partial,
                policy=ledger.gpu_policy,
                protected=protected,
                evict=self._evict,
                busy="leased or moving",
            )

    async def _evict(self, victims: list[int]) -> None:
        """Drop victims' GPU copies, copying the ones with no copy below down first."""
        ledger, index = self.ledger, self.ledger.index
        dirty = [v for v in victims if not index.tier[v] & BELOW_GPU]
        if dirty:
            await self.move_down(dirty, partial=True)
        tried = set(dirty)
        for v in victims:
            if (
                index.state[v] != State.COMMITTED
                or index.leases[v]
                or v in self._moving
                or not index.tier[v] & IN_GPU
            ):
                continue  # changed while the copies ran; the next round picks again
            if index.tier[v] & BELOW_GPU:
                ledger.drop_gpu_copy(v)
            elif v in tried:
                ledger.forget(v)  # the copy down failed (CPU full of leases, corrupt)
            else:
                continue  # was clean, lost its copy below meanwhile: next round
            self.counters.evictions += 1

    # ----------------------------------------------------------------- hooks from the ledger
    def note_committed(self, eids: list[int]) -> None:
        """Blocks a worker wrote into the pool were committed."""
        cfg = self.ledger.config
        if cfg.nvme.write_through or (self.shared.enabled and cfg.redis.write_through):
            self._eager.extend(eids)  # the tiers below want every block at once
        self._wake.set()

    def note_read(self, eids: list[int]) -> None:
        self.ledger.touch_gpu(eids)

    def _seed(self, eid: int) -> int:
        """The checksum seed of an entry: its namespace fingerprint and key."""
        return checksum_seed(self.ledger.fingerprint_of(eid), self.ledger.index.key(eid))

    # ----------------------------------------------------------------- copies (worker thread)
    def _stream_ctx(self) -> Any:
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def _sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def _copy_down(
        self, block_bytes: int, moves: list[tuple[int, int, int, int]]
    ) -> list[int | None]:
        """(gpu offset, cpu offset, bound device checksum, checksum seed) -> bound checksum of
        each host copy, or None where the GPU source did not match its device checksum."""
        assert self.pool is not None and self._host is not None
        srcs = [self.pool.slot(g, block_bytes) for g, _, _, _ in moves]
        with self._stream_ctx():
            for src, (_, c, _, _) in zip(srcs, moves, strict=True):
                self._host[c : c + block_bytes].copy_(src, non_blocking=True)
            sums = kernels.device_checksums(srcs)  # ordered after the copies on this stream
        self._sync()
        out: list[int | None] = []
        view = self.ledger.arena.view
        for s, (_, c, dsum, seed) in zip(sums, moves, strict=True):
            ok = s ^ seed == dsum
            out.append(seeded_checksum(view[c : c + block_bytes], seed) if ok else None)
        return out

    def _copy_up(
        self, block_bytes: int, moves: list[tuple[int, int, int, int]]
    ) -> list[int | None]:
        """(cpu offset, gpu offset, bound checksum, seed) -> bound device checksum of each GPU
        copy, or None where the host source did not match its checksum. The host bytes are
        hashed after the copy (as a client checks what it read): a source that was wrong, or
        changed while it was copied, fails there."""
        assert self.pool is not None and self._host is not None
        dsts = [self.pool.slot(g, block_bytes) for _, g, _, _ in moves]
        with self._stream_ctx():
            for dst, (c, _, _, _) in zip(dsts, moves, strict=True):
                dst.copy_(self._host[c : c + block_bytes], non_blocking=True)
            sums = kernels.device_checksums(dsts)  # ordered after the copies on this stream
        self._sync()
        view = self.ledger.arena.view
        return [
            s ^ seed if seeded_checksum(view[c : c + block_bytes], seed) == x else None
            for s, (c, _, x, seed) in zip(sums, moves, strict=True)
        ]

    # ----------------------------------------------------------------- down
    async def move_down(self, eids: list[int], partial: bool = False) -> int:
        """Give GPU-only blocks a CPU copy (keeping the GPU copy); returns how many of ``eids``
        have one afterwards. A block already moving is waited for, not copied twice.
        ``partial``: copy as many as the CPU tier has room for (else all or none)."""
        index = self.ledger.index
        eids = list(dict.fromkeys(eids))  # a key asked twice is one block
        waits = [self._moving[e] for e in eids if e in self._moving]

        def needs_copy(e: int) -> bool:
            return (
                e not in self._moving
                and index.state[e] == State.COMMITTED
                and bool(index.tier[e] & IN_GPU)
                and not index.tier[e] & IN_CPU
                and e in self.books.dsum
            )

        mine = [e for e in eids if needs_copy(e)]
        for start in range(0, len(mine), _BATCH):
            # Checked and claimed with no await in between: an entry cannot be freed (and its id
            # reused) between the check and the lease that pins it.
            part = mine[start : start + _BATCH]
            waits += [self._moving[e] for e in part if e in self._moving]  # taken meanwhile
            batch = [e for e in part if needs_copy(e)]
            if batch:
                results = self._claim(batch)
                await self._shielded(self._down_batch(batch, partial, results))
        if waits:
            await asyncio.gather(*(asyncio.shield(w) for w in waits))
        return count_in(index, eids, IN_CPU)

    async def _down_batch(self, eids: list[int], partial: bool, results: dict[int, bool]) -> None:
        ledger, index = self.ledger, self.ledger.index
        try:
            by_class: dict[tuple[int, int], list[int]] = {}
            for e in eids:
                by_class.setdefault((ledger.block_bytes_of(e), ledger.domain_of(e)), []).append(e)
            for (bb, domain), group in by_class.items():
                try:
                    slots = await self.cpu_room(
                        bb, len(group), partial=partial, keep_gpu_copies=True, domain=domain
                    )
                except CapacityError:
                    slots = []
                group, slots = self._still_wanted(
                    group,
                    slots,
                    lambda e: not index.tier[e] & IN_CPU and e in self.books.dsum,
                    functools.partial(ledger.cpu_unalloc, block_bytes=bb),
                )
                moves = [
                    (self.books.offset[e], c, self.books.dsum[e], self._seed(e))
                    for e, c in zip(group, slots, strict=True)
                ]
                try:
                    sums = await asyncio.to_thread(self._copy_down, bb, moves) if moves else []
                except BaseException:
                    for c in slots:
                        ledger.cpu_unalloc(c, bb)
                    raise
                landed = []
                for e, c, xxh in zip(group, slots, sums, strict=True):
                    if index.state[e] != State.COMMITTED or index.tier[e] & IN_CPU:
                        ledger.cpu_unalloc(c, bb)  # deleted, or given a copy another way
                    elif xxh is None:
                        ledger.cpu_unalloc(c, bb)
                        self.counters.checksum_failures += 1
                        ledger.forget(e)
                    else:
                        ledger.set_host_checksum(e, xxh)
                        ledger.mark_in_cpu(e, c)
                        self.counters.demotions += 1
                        results[e] = True
                        landed.append(e)
                if landed:
                    # New in the CPU tier: the tiers below take it from here (write-through).
                    self.host.note_committed(landed)
                    self.shared.note_committed(landed)
        finally:
            self._unclaim(eids, results)

    def _claim(self, eids: list[int]) -> dict[int, bool]:
        """Mark ``eids`` as moving (readers and evictors wait or skip) and lease them, so their
        slots stay put across the awaits. Returns the results dict ``_unclaim`` hands to
        waiters. Call with no await since the entries were checked."""
        loop = asyncio.get_running_loop()
        for e in eids:
            self._moving[e] = loop.create_future()
            self.ledger.pin(e)
        return {}

    def _unclaim(self, eids: list[int], results: dict[int, bool]) -> None:
        for e in eids:
            self._moving.pop(e).set_result(results.get(e, False))
            self.ledger.unpin(e)

    async def _clean_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._clean()
            except Exception:  # keep cleaning later: one bad round must not stop write-back
                log.exception("gpu write-back failed")

    async def _clean(self) -> None:
        before = self._dirty_bytes()
        while True:
            batch = self._next_clean_batch()
            if not batch:
                return
            if not await self.move_down(batch, partial=True):
                return  # the CPU tier takes nothing now (full of leases)
            after = self._dirty_bytes()
            if after >= before:
                # No progress: each copy down pushed another GPU block's only CPU copy out
                # (the CPU tier is smaller than the pool's clean share). Stop, do not churn.
                return
            before = after

    def _dirty_bytes(self) -> int:
        index = self.ledger.index
        return sum(
            self.ledger.block_bytes_of(e) for e in self.books.dsum if not index.tier[e] & BELOW_GPU
        )

    def _next_clean_batch(self) -> list[int]:
        """The next blocks to copy down to the CPU tier (``writeback.pick_writeback``)."""
        index, block_bytes_of = self.ledger.index, self.ledger.block_bytes_of
        high_watermark = self.config.high_watermark

        def needs_write(e: int) -> bool:
            return (
                index.state[e] == State.COMMITTED
                and e in self.books.dsum
                and e not in self._moving
                and not index.tier[e] & BELOW_GPU
            )

        def wanted() -> float:
            if self.allocator is None:
                return 0.0
            capacity = self.allocator.capacity_bytes
            used = self.books.used_bytes
            if bytes_to_clean(capacity, capacity - used, high_watermark) <= 0:
                return 0.0  # under the watermark even were every block dirty: no scan needed
            dirty = (e for e in self.ledger.gpu_policy.order() if not index.tier[e] & BELOW_GPU)
            dirty_bytes = sum(block_bytes_of(e) for e in dirty)
            return bytes_to_clean(capacity, capacity - dirty_bytes, high_watermark)

        return pick_writeback(
            eager=self._eager,
            needs_write=needs_write,
            limit=_BATCH,
            wanted=wanted,
            coldest=self.ledger.gpu_policy.order,
            bytes_of=block_bytes_of,
        )

    # ----------------------------------------------------------------- up
    def prefetch(self, ns_id: int, keys: list[bytes], payer: Usage | None = None) -> int:
        """Start promoting the run's blocks into the pool in prefix order; returns how many
        were queued (``Prefetcher``). Spends the keys like a lookup (``keys_per_s``; the
        ``payer``'s, if any)."""
        ledger = self.ledger
        ledger.quotas.take_keys(ledger.names[ns_id], len(keys), payer)
        if self.pool is None:
            return 0
        return self._prefetcher.queue(ns_id, keys)

    async def move_up(self, eids: list[int]) -> list[int]:
        """Promote blocks into the pool (from the CPU tier, bringing disk-only ones to the CPU
        first); returns the leading run of them in the pool afterwards."""
        await self._promote(eids)
        # Blocks another call was moving (up, or down: a copy down keeps the GPU copy) are
        # waited for, not skipped.
        waits = [self._moving[e] for e in eids if e in self._moving]
        if waits:
            await asyncio.gather(*(asyncio.shield(w) for w in waits))
        return leading_in(self.ledger.index, eids, IN_GPU)

    async def _promote(self, eids: list[int]) -> bool:
        """``move_up``'s work: True when every one of ``eids`` is in the pool afterwards."""
        index = self.ledger.index
        eids = [
            e
            for e in dict.fromkeys(eids)  # a key asked twice is one block
            if index.state[e] == State.COMMITTED
            and not index.tier[e] & IN_GPU
            and e not in self._moving
        ]
        if not eids:
            return True
        for e in eids:  # pinned now, with no await since the check (see move_down)
            self.ledger.pin(e)
        return bool(await self._shielded(self._to_gpu(eids)))

    async def _to_gpu(self, eids: list[int]) -> bool:
        """``_promote``'s work, on entries it leased; drops those leases when done."""
        ledger, index = self.ledger, self.ledger.index
        leased = list(eids)
        try:
            if any(not index.tier[e] & IN_CPU for e in eids):
                await self.host.move_up(eids)
            eids = [
                e
                for e in eids
                if index.state[e] == State.COMMITTED
                and index.tier[e] & IN_CPU
                and not index.tier[e] & IN_GPU
                and e not in self._moving
            ]
            results = self._claim(eids)
            try:
                by_size: dict[int, list[int]] = {}
                for e in eids:
                    by_size.setdefault(ledger.block_bytes_of(e), []).append(e)
                for bb, group in by_size.items():
                    await self._up_group(bb, group, results)
            finally:
                self._unclaim(eids, results)
            return len(eids) == len(leased) and all(results.get(e, False) for e in eids)
        finally:
            for e in leased:
                ledger.unpin(e)

    async def _up_group(self, bb: int, group: list[int], results: dict[int, bool]) -> None:
        ledger, index = self.ledger, self.ledger.index
        slots = await self.alloc(bb, len(group), partial=True)
        group, slots = self._still_wanted(
            group,
            slots,
            lambda e: bool(index.tier[e] & IN_CPU) and not index.tier[e] & IN_GPU,
            lambda g: ledger.gpu_unalloc(g, bb),
        )
        moves = [
            (index.offset[e], g, index.checksum[e], self._seed(e))
            for e, g in zip(group, slots, strict=True)
        ]
        try:
            sums = await asyncio.to_thread(self._copy_up, bb, moves) if moves else []
        except BaseException:
            for g in slots:
                ledger.gpu_unalloc(g, bb)
            raise
        for e, g, dsum in zip(group, slots, sums, strict=True):
            if index.state[e] != State.COMMITTED or index.tier[e] & IN_GPU:
                ledger.gpu_unalloc(g, bb)
            elif dsum is None:
                ledger.gpu_unalloc(g, bb)
                ledger.cpu.checksum_failures += 1
                ledger.forget(e)
            else:
                ledger.place_in_gpu(e, g)
                ledger.complete_gpu_copy(e, dsum)
                self.counters.promotions += 1
                results[e] = True

    def _still_wanted(
        self,
        group: list[int],
        slots: list[int],
        wanted: Callable[[int], bool],
        give_back: Callable[[int], None],
    ) -> tuple[list[int], list[int]]:
        """The entries of ``group`` still committed and ``wanted`` after the await that made
        ``slots`` for them (one each, in order; fewer when room was short), with their slots;
        the other slots go back. An entry deleted during that await is an orphan: it has no
        key to check a copy against, and its slot would leak."""
        index = self.ledger.index
        kept: list[int] = []
        kept_slots: list[int] = []
        for i, slot in enumerate(slots):
            e = group[i] if i < len(group) else -1
            if e >= 0 and index.state[e] == State.COMMITTED and wanted(e):
                kept.append(e)
                kept_slots.append(slot)
            else:
                give_back(slot)
        return kept, kept_slots

    # ----------------------------------------------------------------- holds, drop
    def holds(self, eid: int) -> bool:
        return bool(self.ledger.index.tier[eid] & IN_GPU)

    def drop(self, eids: list[int]) -> int:
        """Drop the GPU copies of ``eids`` that have a copy below and are neither leased nor
        moving; returns how many went."""
        gone = droppable(self.ledger.index, eids, IN_GPU, BELOW_GPU, self._moving)
        for e in gone:
            self.ledger.drop_gpu_copy(e)
        return len(gone)

    # ----------------------------------------------------------------- stats
    def snapshot(self) -> TierSnapshot | None:
        if self.pool is None:
            return None
        books = self.ledger.gpu_slots
        return TierSnapshot(
            "gpu",
            self.capacity_bytes(),
            books.used_bytes,
            len(self.ledger.gpu_policy),
            self.counters,
            extra={
                "clean_below_bytes": float(self.clean_bytes()),
                "device": float(self.pool.device.index or 0),
            },
        )

    def clean_bytes(self) -> int:
        index = self.ledger.index
        dsum = self.books.dsum
        return sum(self.ledger.block_bytes_of(e) for e in dsum if index.tier[e] & BELOW_GPU)

    def capacity_bytes(self) -> int:
        return self.allocator.capacity_bytes if self.allocator is not None else 0
