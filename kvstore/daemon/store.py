"""The daemon's block store: namespaces, the index, leases, reservations, and the tiers.

``BlockStore`` is the one owner of the index. Every method runs on the daemon's event loop;
bytes move in executors (the NVMe tier's IO threads, ``asyncio.to_thread`` for checksums), so
the loop never blocks on a copy or a disk.

Write protocol (two-phase): ``reserve`` allocates CPU slots and creates RESERVED entries,
invisible to readers; the client copies into the slots; ``commit`` makes them visible with their
checksums. A reservation not committed within ``reservation_ttl_s`` is reclaimed by ``reap``.

Read protocol: ``acquire`` takes a read lease on the leading run of committed blocks, promoting
blocks that are only on disk into the CPU tier first (a second reader of a block being promoted
waits for that promotion instead of reading the disk again); the client copies out, verifies the
checksums and calls ``release``. A leased block is never evicted or freed. Leases expire after
``lease_ttl_s``; a client copying after its lease expired detects a reused slot by checksum.

Movement (``movement.py`` holds the background parts): puts land in the CPU tier. With an NVMe
tier, write-back keeps at least ``1 - high_watermark`` of the CPU tier free or clean (already on
disk) by writing its coldest dirty blocks down in the background, so a put rarely waits; with
``write_through`` every commit is written down at once. Evicting a clean block only drops its
CPU copy; a dirty victim is written down first. A block whose checksum fails on the way down or
up is dropped and counted: a miss, never wrong data.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.checksum import block_checksum
from kvstore.config import DaemonConfig
from kvstore.errors import (
    CapacityError,
    LeaseExpiredError,
    NamespaceMismatchError,
    UnknownNamespaceError,
)
from kvstore.index import IN_CPU, IN_GPU, IN_NVME, BlockIndex, State
from kvstore.keys import KEY_BYTES, Namespace
from kvstore.layout import KVLayout
from kvstore.policy import EvictionPolicy, make_policy
from kvstore.tiers.cpu import HEADER_BYTES, SharedMemoryArena, SlabAllocator

if TYPE_CHECKING:
    from kvstore.tiers.gpu import DevicePool
    from kvstore.tiers.nvme import NvmeTier


@dataclass
class NamespaceRecord:
    """A namespace the daemon knows. ``namespace`` is None for one recovered from disk whose
    client has not opened it yet (only its fingerprint and block size are known)."""

    ns_id: int
    namespace: Namespace | None
    fingerprint: bytes
    block_bytes: int
    priority: int
    blocks: int = 0
    lookup_hits: int = 0
    lookup_misses: int = 0

    @property
    def name(self) -> str:
        return self.namespace.name if self.namespace else f"(recovered {self.fingerprint.hex()})"


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    promotions: int = 0
    demotions: int = 0
    checksum_failures: int = 0
    prefetch_hits: int = 0
    io_errors: int = 0


@dataclass
class _Reservation:
    ns_id: int
    eids: list[int]
    expires_at: float
    gpu: bool = False  # the slots are in the GPU pool (the commit carries device checksums)


@dataclass
class _Lease:
    eids: list[int]
    expires_at: float


@dataclass
class TierSnapshot:
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    counters: TierCounters
    up: bool = True
    extra: dict[str, float] = field(default_factory=dict)


class BlockStore:
    """Owns the namespaces, the block index, the CPU arena, the GPU and NVMe tiers (when
    configured), one eviction policy per tier, the leases and the reservations. Event-loop only.

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
        self._clock = clock
        # The header page comes on top of the capacity, so all of it holds blocks.
        self.arena = SharedMemoryArena(
            config.cpu.capacity_bytes + HEADER_BYTES, prefault=config.cpu.prefault
        )
        from kvstore.daemon.device import DeviceTier, make_device_pool

        try:
            pool = gpu_pool if gpu_pool is not None else make_device_pool(config.gpu)
        except BaseException:
            self.arena.close()
            raise
        self.allocator = SlabAllocator(self.arena.size_bytes, config.cpu.slab_bytes)
        self.index = BlockIndex()
        self.policy: EvictionPolicy = make_policy(config.cpu.policy)
        self.nvme_policy: EvictionPolicy = make_policy(config.nvme.policy)
        self.cpu = TierCounters()
        self.nvme_counters = TierCounters()
        self.redis_counters = TierCounters()
        self.nvme: NvmeTier | None = None  # set by start() when configured
        self._namespaces: dict[int, NamespaceRecord] = {}
        self._by_name: dict[str, NamespaceRecord] = {}
        self._by_fingerprint: dict[bytes, NamespaceRecord] = {}
        self._reservations: dict[int, _Reservation] = {}
        # (until, in the GPU pool, offset, block bytes) of slots of expired reservations.
        self._quarantine: deque[tuple[float, bool, int, int]] = deque()
        self._leases: dict[int, _Lease] = {}
        self._ids = itertools.count(1)
        self.epoch = secrets.randbits(63) | 1  # never 0, which means "not checked"
        self._cpu_used = 0
        self._cpu_clean = 0  # bytes of CPU blocks that also have a disk copy
        self._nvme_blocks = 0
        self._reserved_blocks = 0
        from kvstore.daemon.movement import Mover
        from kvstore.daemon.shared import SharedTier

        self.mover = Mover(self)
        self.shared = SharedTier(self)
        self.device = DeviceTier(self, pool)

    async def start(self) -> None:
        """Open the NVMe tier (recovering what it holds), connect the shared tier, and start
        background movement."""
        await self.device.start()
        await self.mover.start()
        await self.shared.start()

    async def stop(self) -> None:
        """Write dirty blocks down (bounded by ``drain_timeout_s``), close tiers, unlink."""
        await self.device.stop()
        await self.shared.stop()
        await self.mover.stop()
        self.close()

    def close(self) -> None:
        self.device.close()
        self.arena.close()

    # ----------------------------------------------------------------- namespaces
    def open_namespace(self, namespace: Namespace, priority: int = 0) -> NamespaceRecord:
        """Register or join a namespace. A name already registered with another fingerprint is
        refused: two clients that claim to share blocks must compute the same keys."""
        if not 0 <= priority <= 255:
            raise ValueError(f"priority must be in [0, 255], got {priority}")
        block_bytes = namespace.layout.block_bytes
        self.allocator.check_fits(block_bytes)
        fingerprint = namespace.fingerprint
        existing = self._by_name.get(namespace.name)
        if existing is not None:
            if existing.fingerprint != fingerprint:
                assert existing.namespace is not None
                raise NamespaceMismatchError(
                    f"namespace {namespace.name!r} is registered with layout "
                    f"{_describe(existing.namespace.layout)}; this client claims "
                    f"{_describe(namespace.layout)} (hash version {namespace.hash_version})"
                )
            return existing
        recovered = self._by_fingerprint.get(fingerprint)
        if recovered is not None:
            # Blocks of this namespace were found on disk at start-up: bind them to it.
            if recovered.block_bytes != block_bytes:
                raise NamespaceMismatchError(
                    f"blocks on disk for {namespace.name!r} are {recovered.block_bytes} bytes, "
                    f"the layout gives {block_bytes}"
                )
            recovered.namespace = namespace
            recovered.priority = priority
            self._by_name[namespace.name] = recovered
            return recovered
        record = self._new_namespace(namespace, fingerprint, block_bytes, priority)
        self._by_name[namespace.name] = record
        return record

    def _new_namespace(
        self, namespace: Namespace | None, fingerprint: bytes, block_bytes: int, priority: int
    ) -> NamespaceRecord:
        if len(self._namespaces) >= 0xFFFF:
            raise CapacityError("too many namespaces (65535)")
        ns_id = len(self._namespaces) + 1
        record = NamespaceRecord(ns_id, namespace, fingerprint, block_bytes, priority)
        self._namespaces[ns_id] = record
        self._by_fingerprint[fingerprint] = record
        return record

    def recovered_namespace(self, fingerprint: bytes, block_bytes: int) -> NamespaceRecord:
        record = self._by_fingerprint.get(fingerprint)
        if record is None:
            record = self._new_namespace(None, fingerprint, block_bytes, 0)
        return record

    def namespace_record(self, ns_id: int) -> NamespaceRecord:
        """The record of an entry's namespace (recovered ones included)."""
        return self._namespaces[ns_id]

    def check_epoch(self, epoch: int) -> None:
        """Refuse arena offsets to a client that mapped another daemon's arena."""
        if epoch and epoch != self.epoch:
            raise UnknownNamespaceError("the daemon restarted: open the namespace again")

    def namespace(self, ns_id: int) -> NamespaceRecord:
        record = self._namespaces.get(ns_id)
        if record is None or record.namespace is None:
            raise UnknownNamespaceError(f"unknown namespace id {ns_id}: open the namespace first")
        return record

    def block_bytes_of(self, eid: int) -> int:
        return self._namespaces[self.index.ns[eid]].block_bytes

    def fingerprint_of(self, eid: int) -> bytes:
        return self._namespaces[self.index.ns[eid]].fingerprint

    # ----------------------------------------------------------------- reads
    def _committed(self, ns_id: int, key: bytes) -> int | None:
        eid = self.index.get(key)
        if eid is None or self.index.state[eid] != State.COMMITTED:
            return None
        if self.index.ns[eid] != ns_id:
            # Keys are seeded by namespace, so this means a client hashed with another seed.
            # Serving it would hand one namespace's KV to another: treat it as a miss.
            return None
        return eid

    def leading_run(self, ns_id: int, keys: Sequence[bytes]) -> list[int]:
        eids: list[int] = []
        for key in keys:
            eid = self._committed(ns_id, key)
            if eid is None:
                break
            eids.append(eid)
        return eids

    async def lookup(self, ns_id: int, keys: Sequence[bytes]) -> int:
        record = self.namespace(ns_id)
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
        tiers = self.index.tier
        in_gpu = sum(1 for e in run if tiers[e] & IN_GPU)
        in_cpu = sum(1 for e in run if tiers[e] & IN_CPU and not tiers[e] & IN_GPU)
        if self.device.enabled:
            self.device.counters.hits += in_gpu
            self.device.counters.misses += len(keys) - in_gpu
        self.cpu.hits += in_cpu
        self.cpu.misses += len(keys) - in_gpu - in_cpu
        if self.nvme is not None:
            self.nvme_counters.hits += local - in_gpu - in_cpu
            self.nvme_counters.misses += len(keys) - local
        if self.shared.enabled:
            self.redis_counters.hits += shared
            self.redis_counters.misses += len(keys) - found
        return found

    async def acquire(
        self, ns_id: int, keys: Sequence[bytes], gpu: bool = False
    ) -> tuple[int, list[int], list[int], list[bool]]:
        """Lease the leading run of present blocks, bringing the ones the reader cannot reach
        into the CPU tier: (lease id or 0, offsets, checksums, on_gpu).

        ``gpu``: the reader maps the GPU pool, so a block there is served from its pool slot
        (``on_gpu``; its offset is a pool offset and its checksum the device checksum).
        Otherwise every block is served from the CPU arena (xxh3 checksums).
        """
        record = self.namespace(ns_id)
        eids = self.leading_run(ns_id, keys)
        for eid in eids:  # pin the whole run before anything awaits
            self.index.add_lease(eid)
        # From here ``eids`` is always exactly what this call holds leases on: a call cancelled
        # (a client's deadline) or failing in an await gives them back, since no lease id
        # exists yet that the reaper could reclaim.
        try:
            local_run = len(eids)
            tiers = self.index.tier
            gpu = gpu and self.device.enabled
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
            for eid in eids[ready:]:
                self._drop_one_lease(eid)
            eids = eids[:ready]
            if ready == local_run < len(keys) and self.shared.enabled:
                # The local run ended at a missing block: the shared tier may hold the rest.
                fetched = await self.shared.fetch(record, list(keys[ready:]))
                for eid in fetched:  # committed just now, no await since: lease them at once
                    self.index.add_lease(eid)
                eids = eids + fetched
        except BaseException:
            for eid in eids:
                self._drop_one_lease(eid)
            raise
        if not eids:
            return 0, [], [], []
        self.mover.note_read(eids)
        # Committed only: an entry deleted during an await above is an orphan, out of policies.
        self.policy.touch(
            [e for e in eids if tiers[e] & IN_CPU and self.index.state[e] == State.COMMITTED]
        )
        self.device.note_read(eids)
        lease_id = next(self._ids)
        self._leases[lease_id] = _Lease(eids, self._clock() + self.config.lease_ttl_s)
        on_gpu = [bool(gpu and tiers[e] & IN_GPU) for e in eids]
        offsets = [
            self.device.offset[e] if g else self.index.offset[e]
            for e, g in zip(eids, on_gpu, strict=True)
        ]
        checksums = [
            self.device.dsum[e] if g else self.index.checksum[e]
            for e, g in zip(eids, on_gpu, strict=True)
        ]
        return lease_id, offsets, checksums, on_gpu

    def release(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise LeaseExpiredError(f"lease {lease_id} is unknown or already expired")
        for eid in lease.eids:
            self._drop_one_lease(eid)

    def _drop_one_lease(self, eid: int) -> None:
        if self.index.drop_lease(eid) == 0 and self.index.state[eid] == State.ORPHAN:
            self._free_entry(eid)

    def leased_entries(self, lease_id: int) -> list[int]:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseExpiredError(f"lease {lease_id} is unknown or already expired")
        return lease.eids

    def read_block(self, eid: int) -> tuple[bytes, int]:
        """Copy one leased CPU block's bytes out of the arena (the bytes path)."""
        size = self.block_bytes_of(eid)
        offset = self.index.offset[eid]
        return bytes(self.arena.view[offset : offset + size]), self.index.checksum[eid]

    # ----------------------------------------------------------------- writes
    async def reserve(
        self, ns_id: int, keys: Sequence[bytes], priority: int = -1, gpu: bool = False
    ) -> tuple[int, list[int], bool]:
        """Reserve a slot for each key not present: (reservation id or 0, offset or -1 per key,
        whether the offsets are in the GPU pool).

        ``gpu``: the writer maps the GPU pool and would rather write there (a device-to-device
        copy); the slots come from the pool when it can make room for all of them, else from
        the CPU arena. All or nothing: when the CPU tier cannot make room for every new key (the
        rest is leased or being written) nothing is reserved and CapacityError says how many
        slots were missing.
        """
        record = self.namespace(ns_id)
        priority = record.priority if priority < 0 else priority
        if priority > 255:
            raise ValueError(f"priority must be in [0, 255], got {priority}")
        for i, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                raise ValueError(f"key {i} is {len(key)} bytes, not {KEY_BYTES}")
        offsets = [-1] * len(keys)
        if gpu and self.device.enabled:
            reserved = await self._reserve_gpu(record, keys, priority, offsets)
            if reserved is not None:
                return reserved, offsets, True
        slots: list[int] = []
        for _ in range(8):
            todo = self._new_positions(keys)
            if len(slots) >= len(todo):
                break
            # Making room may wait for dirty victims to reach the disk; other calls run
            # meanwhile and may reserve some of these keys, hence the loop.
            slots += await self.mover.alloc_cpu(record.block_bytes, len(todo) - len(slots))
        else:
            for offset in slots:
                self.cpu_unalloc(offset, record.block_bytes)
            raise CapacityError("cpu tier full: the keys to reserve kept changing")
        # No await from here on.
        for offset in slots[len(todo) :]:
            self.cpu_unalloc(offset, record.block_bytes)
        if not todo:
            return 0, offsets, False
        return self._add_reservation(ns_id, keys, todo, slots, priority, offsets), offsets, False

    def _add_reservation(
        self,
        ns_id: int,
        keys: Sequence[bytes],
        todo: list[int],
        slots: list[int],
        priority: int,
        offsets: list[int],
        gpu: bool = False,
    ) -> int:
        """RESERVED entries for ``keys[todo[j]]`` in ``slots[j]`` (arena or, ``gpu``, pool
        slots), noted in ``offsets``; returns the new reservation's id. No await."""
        eids = []
        for i, offset in zip(todo, slots, strict=False):
            if gpu:
                eid = self.index.add(keys[i], ns_id, 0, -1, priority)
                self.device.place(eid, offset)
            else:
                eid = self.index.add(keys[i], ns_id, IN_CPU, offset, priority)
            eids.append(eid)
            offsets[i] = offset
        self._reserved_blocks += len(eids)
        reservation_id = next(self._ids)
        self._reservations[reservation_id] = _Reservation(
            ns_id, eids, self._clock() + self.config.reservation_ttl_s, gpu=gpu
        )
        return reservation_id

    async def _reserve_gpu(
        self, record: NamespaceRecord, keys: Sequence[bytes], priority: int, offsets: list[int]
    ) -> int | None:
        """Reserve pool slots for the new keys (filling ``offsets``): the reservation id, 0 when
        every key is present, or None when the pool cannot take them all (use the CPU tier)."""
        try:
            slots = await self.device.alloc(record.block_bytes, len(self._new_positions(keys)))
        except (CapacityError, ValueError):
            return None
        todo = self._new_positions(keys)  # no await from here on
        if len(slots) < len(todo):
            for offset in slots:
                self.device.unalloc(offset, record.block_bytes)
            return None
        for offset in slots[len(todo) :]:
            self.device.unalloc(offset, record.block_bytes)
        if not todo:
            return 0
        return self._add_reservation(record.ns_id, keys, todo, slots, priority, offsets, gpu=True)

    def _new_positions(self, keys: Sequence[bytes]) -> list[int]:
        todo: list[int] = []
        seen: set[bytes] = set()
        for i, key in enumerate(keys):
            if key not in seen and self.index.get(key) is None:
                todo.append(i)
            seen.add(key)
        return todo

    def commit(
        self,
        reservation_id: int,
        checksums: Sequence[int],
        device_checksums: Sequence[int] = (),
    ) -> int:
        """Make a reservation's blocks visible. A CPU reservation carries the xxh3 of each block
        (``checksums``), a GPU one their device checksums (``device_checksums``)."""
        reservation = self._reservations.get(reservation_id)
        if reservation is None:
            raise LeaseExpiredError(
                f"reservation {reservation_id} is unknown or expired; nothing was stored"
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
        del self._reservations[reservation_id]
        record = self._namespaces[reservation.ns_id]
        eids = reservation.eids
        for eid, checksum in zip(eids, given, strict=True):
            if reservation.gpu:
                self.index.commit(eid, 0)  # the xxh3 is made when a CPU copy is
                self.device.mark(eid, checksum)
            else:
                self.index.commit(eid, checksum)
                self.policy.insert(eid, self.index.priority[eid])
        self._reserved_blocks -= len(eids)
        record.blocks += len(eids)
        if reservation.gpu:
            self.device.policy.touch(eids)
            self.device.note_committed(eids)
        else:
            self.policy.touch(eids)
            self.mover.note_committed(eids)
            self.shared.note_committed(eids)
        return len(eids)

    def note_reserved(self, n: int) -> None:
        """``n`` RESERVED entries were added outside ``reserve`` (a fetch from Redis)."""
        self._reserved_blocks += n

    def discard_reserved(self, eid: int) -> None:
        self._free_entry(eid)

    def commit_fetched(self, eid: int, checksum: int) -> None:
        """Make a block fetched from the shared tier into a RESERVED entry visible."""
        self.index.commit(eid, checksum)
        self.policy.insert(eid, self.index.priority[eid])
        self._reserved_blocks -= 1
        self._namespaces[self.index.ns[eid]].blocks += 1
        self.mover.note_committed([eid])

    def abort(self, reservation_id: int) -> None:
        reservation = self._reservations.pop(reservation_id, None)
        if reservation is None:
            raise LeaseExpiredError(f"reservation {reservation_id} is unknown or expired")
        for eid in reservation.eids:
            self._free_entry(eid)

    async def put_block(self, ns_id: int, key: bytes, data: bytes, priority: int = -1) -> bool:
        """The bytes path: store one block whose bytes arrived over gRPC. True if newly stored."""
        record = self.namespace(ns_id)
        if len(data) != record.block_bytes:
            raise ValueError(
                f"block for key {key.hex()[:16]}… is {len(data)} bytes, "
                f"the namespace's blocks are {record.block_bytes}"
            )
        reservation_id, offsets, _ = await self.reserve(ns_id, [key], priority)
        if not reservation_id:
            return False
        offset = offsets[0]
        self.arena.view[offset : offset + len(data)] = data
        self.commit(reservation_id, [block_checksum(data)])
        return True

    # ----------------------------------------------------------------- slots and removal
    def cpu_alloc(self, block_bytes: int) -> int:
        offset = self.allocator.allocate(block_bytes)
        if offset is None:
            raise AssertionError("cpu allocator out of slots after room was made")
        self._cpu_used += block_bytes
        return offset

    def cpu_unalloc(self, offset: int, block_bytes: int) -> None:
        """Give back a slot from ``cpu_alloc`` that no entry took."""
        self.allocator.free(offset, block_bytes)
        self._cpu_used -= block_bytes

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
        bb = self.block_bytes_of(eid)
        self.allocator.free(self.index.offset[eid], bb)
        self._cpu_used -= bb
        if self.index.tier[eid] & IN_NVME:
            self._cpu_clean -= bb
        self.index.offset[eid] = -1
        self.index.tier[eid] &= ~IN_CPU

    def _free_disk_slot(self, eid: int) -> None:
        assert self.nvme is not None
        self.nvme.free(self.index.disk[eid])
        if self.index.tier[eid] & IN_CPU:
            self._cpu_clean -= self.block_bytes_of(eid)
        self.index.disk[eid] = -1
        self.index.tier[eid] &= ~IN_NVME
        self._nvme_blocks -= 1

    def mark_on_disk(self, eid: int, slot: int) -> None:
        self.index.disk[eid] = slot
        self.index.tier[eid] |= IN_NVME
        self._nvme_blocks += 1
        if self.index.tier[eid] & IN_CPU:
            self._cpu_clean += self.block_bytes_of(eid)
        self.nvme_policy.insert(eid, self.index.priority[eid])

    def mark_in_cpu(self, eid: int, offset: int) -> None:
        self.index.offset[eid] = offset
        self.index.tier[eid] |= IN_CPU
        if self.index.tier[eid] & IN_NVME:
            self._cpu_clean += self.block_bytes_of(eid)
        self.policy.insert(eid, self.index.priority[eid])

    def forget(self, eid: int) -> None:
        """Remove a committed entry from every tier (evicted from the last tier holding it, or
        found corrupt). A leased entry keeps its slots until its last lease goes."""
        if self.index.tier[eid] & IN_CPU:
            self.policy.remove(eid)
        if self.index.tier[eid] & IN_NVME:
            self.nvme_policy.remove(eid)
        if self.index.tier[eid] & IN_GPU:
            self.device.forget_hook(eid)
        self._namespaces[self.index.ns[eid]].blocks -= 1
        if self.index.leases[eid]:
            self.index.orphan(eid)
        else:
            self._free_entry(eid)

    def delete(self, ns_id: int, keys: Sequence[bytes]) -> int:
        self.namespace(ns_id)
        deleted = 0
        for key in keys:
            eid = self._committed(ns_id, key)
            if eid is not None:
                self.forget(eid)
                deleted += 1
        return deleted

    def _quarantine_slots(self, eid: int, until: float) -> None:
        """Take a reserved entry's slots away from it without freeing them (see ``reap``); they
        stay counted as used until ``until``."""
        index, bb = self.index, self.block_bytes_of(eid)
        if index.tier[eid] & IN_CPU:
            self._quarantine.append((until, False, index.offset[eid], bb))
            index.offset[eid] = -1
            index.tier[eid] &= ~IN_CPU
        if index.tier[eid] & IN_GPU:
            self._quarantine.append((until, True, self.device.offset.pop(eid), bb))
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
        self.index.drop(eid)

    def reap(self) -> tuple[int, int]:
        """Reclaim expired reservations and leases: (reservations, leases) reclaimed.

        The slots of an expired reservation are quarantined for one more ``reservation_ttl_s``
        before reuse: its writer may be alive but stalled, and could resume copying into them.
        Were they reused at once, such a late copy could land between the new owner's copy and
        its checksum, and the checksum would vouch for the wrong bytes."""
        now = self._clock()
        while self._quarantine and self._quarantine[0][0] <= now:
            _, gpu, offset, block_bytes = self._quarantine.popleft()
            if gpu:
                self.device.unalloc(offset, block_bytes)
            else:
                self.cpu_unalloc(offset, block_bytes)
        dead_res = [r for r, v in self._reservations.items() if v.expires_at <= now]
        until = now + self.config.reservation_ttl_s
        for rid in dead_res:
            for eid in self._reservations.pop(rid).eids:
                self._quarantine_slots(eid, until)
                self._free_entry(eid)
        dead_leases = [lid for lid, v in self._leases.items() if v.expires_at <= now]
        for lid in dead_leases:
            for eid in self._leases.pop(lid).eids:
                self._drop_one_lease(eid)
        return len(dead_res), len(dead_leases)

    # ----------------------------------------------------------------- stats
    @property
    def active_leases(self) -> int:
        return len(self._leases)

    @property
    def active_reservations(self) -> int:
        return len(self._reservations)

    @property
    def cpu_used_bytes(self) -> int:
        return self._cpu_used

    @property
    def cpu_clean_bytes(self) -> int:
        return self._cpu_clean

    def tier_snapshots(self) -> list[TierSnapshot]:
        cpu_blocks = len(self.policy)
        snaps = []
        if self.device.enabled:
            device = self.device
            pool = device.pool
            assert pool is not None
            snaps.append(
                TierSnapshot(
                    "gpu",
                    device.capacity_bytes(),
                    device.used_bytes,
                    len(device.policy),
                    device.counters,
                    extra={
                        "clean_below_bytes": float(device.clean_bytes()),
                        "device": float(pool.device.index or 0),
                    },
                )
            )
        snaps += [
            TierSnapshot(
                "cpu",
                self.allocator.capacity_bytes,
                self._cpu_used,
                cpu_blocks,
                self.cpu,
                extra={
                    "reserved_blocks": float(self._reserved_blocks),
                    "clean_bytes": float(self._cpu_clean),
                },
            )
        ]
        if self.nvme is not None:
            stats = self.nvme.stats()
            extra = {
                k: float(v)
                for k, v in stats.items()
                if k not in ("capacity_bytes", "used_bytes", "blocks")
                and isinstance(v, int | float)
            }
            extra["prefetch_hits"] = float(self.nvme_counters.prefetch_hits)
            extra["io_errors"] = float(self.nvme_counters.io_errors)
            snaps.append(
                TierSnapshot(
                    "nvme",
                    int(stats["capacity_bytes"]),
                    int(stats["used_bytes"]),
                    self._nvme_blocks,
                    self.nvme_counters,
                    extra=extra,
                )
            )
        if self.shared.enabled:
            stats = self.shared.stats()
            c = self.redis_counters
            c.promotions = self.shared.promotions
            c.demotions = self.shared.demotions
            c.checksum_failures = int(stats.get("checksum_failures", 0))
            c.evictions = int(stats.get("evictions", 0))
            extra = {
                k: float(v)
                for k, v in stats.items()
                if k in ("bytes_written", "bytes_read", "errors", "reconnects", "unavailable")
            }
            extra["skipped_while_down"] = float(self.shared.skipped)
            bound = self.config.redis.max_bytes_per_namespace
            snaps.append(
                TierSnapshot(
                    "redis",
                    bound,
                    int(stats.get("bytes_written", 0)),
                    int(stats.get("puts", 0)),
                    c,
                    up=bool(stats.get("up", False)),
                    extra=extra,
                )
            )
        return snaps

    def namespaces(self) -> list[NamespaceRecord]:
        return [r for r in self._namespaces.values() if r.namespace is not None or r.blocks]


def _describe(layout: KVLayout) -> str:
    return (
        f"{layout.num_layers}x{layout.num_kv_heads}x{layout.head_dim} "
        f"block {layout.block_size} {layout.dtype_name}"
    )
