"""The daemon's block store: namespaces, the index, the CPU tier, leases and reservations.

``BlockStore`` is the one owner of the index. Every method is called on the daemon's event loop
and none blocks for long: the bytes of same-host clients never pass through here (they copy into
and out of the shared arena themselves), and the bytes path copies at most one block per call.

Write protocol (two-phase): ``reserve`` allocates slots and creates RESERVED entries, invisible
to readers; the client copies into the slots; ``commit`` makes them visible with their checksums.
A reservation that is not committed within ``reservation_ttl_s`` is reclaimed by ``reap``.

Read protocol: ``acquire`` takes a read lease on the leading run of committed blocks (a leased
block is never evicted or reused); the client copies out and verifies checksums; ``release``
drops the lease. Leases expire after ``lease_ttl_s`` so a dead client leaks nothing; a client
that copies after its lease expired detects any reuse of the slot through the checksum.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.checksum import block_checksum
from kvstore.config import DaemonConfig
from kvstore.errors import (
    CapacityError,
    LeaseExpiredError,
    NamespaceMismatchError,
    UnknownNamespaceError,
)
from kvstore.index import BlockIndex, State
from kvstore.keys import KEY_BYTES, Namespace
from kvstore.layout import KVLayout
from kvstore.policy import EvictionPolicy, make_policy
from kvstore.tiers.cpu import HEADER_BYTES, SharedMemoryArena, SlabAllocator

TIER_CPU = 1


@dataclass
class NamespaceRecord:
    ns_id: int
    namespace: Namespace
    seed: bytes
    fingerprint: bytes
    block_bytes: int
    priority: int
    blocks: int = 0
    lookup_hits: int = 0
    lookup_misses: int = 0


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    promotions: int = 0
    demotions: int = 0
    checksum_failures: int = 0


@dataclass
class _Reservation:
    ns_id: int
    eids: list[int]
    expires_at: float


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
    """Owns the namespaces, the block index, the CPU arena and its eviction policy, the leases
    and the reservations. See the module docstring for the protocols. Event-loop only."""

    def __init__(self, config: DaemonConfig, clock=time.monotonic) -> None:
        self.config = config
        self._clock = clock
        # The header page comes on top of the capacity, so all of it holds blocks.
        self.arena = SharedMemoryArena(
            config.cpu.capacity_bytes + HEADER_BYTES, prefault=config.cpu.prefault
        )
        self.allocator = SlabAllocator(self.arena.size_bytes, config.cpu.slab_bytes)
        self.index = BlockIndex()
        self.policy: EvictionPolicy = make_policy(config.cpu.policy)
        self.cpu = TierCounters()
        self._namespaces: dict[int, NamespaceRecord] = {}
        self._by_name: dict[str, NamespaceRecord] = {}
        self._reservations: dict[int, _Reservation] = {}
        self._leases: dict[int, _Lease] = {}
        self._ids = itertools.count(1)
        self._used_bytes = 0
        self._reserved_blocks = 0

    def close(self) -> None:
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
                raise NamespaceMismatchError(
                    f"namespace {namespace.name!r} is registered with layout "
                    f"{_describe(existing.namespace.layout)}; this client claims "
                    f"{_describe(namespace.layout)} (hash version {namespace.hash_version})"
                )
            return existing
        if len(self._namespaces) >= 0xFFFF:
            raise CapacityError("too many namespaces (65535)")
        ns_id = len(self._namespaces) + 1
        record = NamespaceRecord(
            ns_id, namespace, namespace.seed, fingerprint, block_bytes, priority
        )
        self._namespaces[ns_id] = record
        self._by_name[namespace.name] = record
        return record

    def namespace(self, ns_id: int) -> NamespaceRecord:
        record = self._namespaces.get(ns_id)
        if record is None:
            raise UnknownNamespaceError(f"unknown namespace id {ns_id}: open the namespace first")
        return record

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

    def _leading_run(self, ns_id: int, keys: Sequence[bytes]) -> list[int]:
        eids: list[int] = []
        for key in keys:
            eid = self._committed(ns_id, key)
            if eid is None:
                break
            eids.append(eid)
        return eids

    def lookup(self, ns_id: int, keys: Sequence[bytes]) -> int:
        record = self.namespace(ns_id)
        found = len(self._leading_run(ns_id, keys))
        # Hits and misses are counted per key asked by lookup, the call engines make before
        # every prefill; a get that follows it asks only for what lookup found.
        record.lookup_hits += found
        record.lookup_misses += len(keys) - found
        self.cpu.hits += found
        self.cpu.misses += len(keys) - found
        return found

    def acquire(self, ns_id: int, keys: Sequence[bytes]) -> tuple[int, list[int], list[int]]:
        """Lease the leading run of present blocks: (lease id or 0, offsets, checksums)."""
        self.namespace(ns_id)
        eids = self._leading_run(ns_id, keys)
        if not eids:
            return 0, [], []
        for eid in eids:
            self.index.add_lease(eid)
        self.policy.touch(eids)
        lease_id = next(self._ids)
        self._leases[lease_id] = _Lease(eids, self._clock() + self.config.lease_ttl_s)
        offsets = [self.index.offset[e] for e in eids]
        checksums = [self.index.checksum[e] for e in eids]
        return lease_id, offsets, checksums

    def release(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise LeaseExpiredError(f"lease {lease_id} is unknown or already expired")
        self._drop_lease(lease)

    def _drop_lease(self, lease: _Lease) -> None:
        for eid in lease.eids:
            if self.index.drop_lease(eid) == 0 and self.index.state[eid] == State.ORPHAN:
                self._free_entry(eid)

    def leased_entries(self, lease_id: int) -> list[int]:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseExpiredError(f"lease {lease_id} is unknown or already expired")
        return lease.eids

    def read_block(self, eid: int) -> tuple[bytes, int]:
        """Copy one leased block's bytes out of the arena (the bytes path)."""
        size = self._namespaces[self.index.ns[eid]].block_bytes
        offset = self.index.offset[eid]
        return bytes(self.arena.view[offset : offset + size]), self.index.checksum[eid]

    # ----------------------------------------------------------------- writes
    def reserve(
        self, ns_id: int, keys: Sequence[bytes], priority: int = -1
    ) -> tuple[int, list[int]]:
        """Reserve a slot for each key not present: (reservation id or 0, offset or -1 per key).

        All or nothing: when the tier cannot make room for every new key (the rest is leased or
        being written) nothing is reserved and CapacityError says how many slots were missing.
        """
        record = self.namespace(ns_id)
        priority = record.priority if priority < 0 else priority
        if priority > 255:
            raise ValueError(f"priority must be in [0, 255], got {priority}")
        todo: list[int] = []
        seen: set[bytes] = set()
        for i, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                raise ValueError(f"key {i} is {len(key)} bytes, not {KEY_BYTES}")
            if key not in seen and self.index.get(key) is None:
                todo.append(i)
            seen.add(key)
        offsets = [-1] * len(keys)
        if not todo:
            return 0, offsets
        self._make_room(record.block_bytes, len(todo))
        eids = []
        for i in todo:
            offset = self.allocator.allocate(record.block_bytes)
            if offset is None:
                raise AssertionError("allocator out of slots after _make_room succeeded")
            eids.append(self.index.add(keys[i], ns_id, TIER_CPU, offset, priority))
            offsets[i] = offset
        self._used_bytes += record.block_bytes * len(eids)
        self._reserved_blocks += len(eids)
        reservation_id = next(self._ids)
        self._reservations[reservation_id] = _Reservation(
            ns_id, eids, self._clock() + self.config.reservation_ttl_s
        )
        return reservation_id, offsets

    def _make_room(self, block_bytes: int, needed: int) -> None:
        short = needed - self.allocator.free_slots(block_bytes)
        if short <= 0:
            return
        slot = self.allocator.slot_bytes_for(block_bytes)
        index = self.index
        size_of = self._namespaces

        def protected(eid: int) -> bool:
            return bool(index.leases[eid]) or (
                self.allocator.slot_bytes_for(size_of[index.ns[eid]].block_bytes) != slot
            )

        victims = self.policy.evict(short, protected)
        if victims is None:
            raise CapacityError(
                f"cpu tier full: {needed} slots of {block_bytes} bytes needed, "
                f"{needed - short} free and fewer than {short} evictable "
                "(the rest are leased or being written)"
            )
        for eid in victims:
            self.policy.remove(eid)
            self._free_entry(eid)
        self.cpu.evictions += len(victims)

    def commit(self, reservation_id: int, checksums: Sequence[int]) -> int:
        reservation = self._reservations.get(reservation_id)
        if reservation is None:
            raise LeaseExpiredError(
                f"reservation {reservation_id} is unknown or expired; nothing was stored"
            )
        if len(checksums) != len(reservation.eids):
            raise ValueError(
                f"commit carries {len(checksums)} checksums for {len(reservation.eids)} blocks"
            )
        del self._reservations[reservation_id]
        record = self._namespaces[reservation.ns_id]
        for eid, checksum in zip(reservation.eids, checksums, strict=True):
            self.index.commit(eid, checksum)
            self.policy.insert(eid, self.index.priority[eid])
        self.policy.touch(reservation.eids)
        self._reserved_blocks -= len(reservation.eids)
        record.blocks += len(reservation.eids)
        return len(reservation.eids)

    def abort(self, reservation_id: int) -> None:
        reservation = self._reservations.pop(reservation_id, None)
        if reservation is None:
            raise LeaseExpiredError(f"reservation {reservation_id} is unknown or expired")
        self._reclaim(reservation)

    def _reclaim(self, reservation: _Reservation) -> None:
        for eid in reservation.eids:
            self._free_entry(eid)

    def put_block(self, ns_id: int, key: bytes, data: bytes, priority: int = -1) -> bool:
        """The bytes path: store one block whose bytes arrived over gRPC. True if newly stored."""
        record = self.namespace(ns_id)
        if len(data) != record.block_bytes:
            raise ValueError(
                f"block for key {key.hex()[:16]}… is {len(data)} bytes, "
                f"the namespace's blocks are {record.block_bytes}"
            )
        reservation_id, offsets = self.reserve(ns_id, [key], priority)
        if not reservation_id:
            return False
        offset = offsets[0]
        self.arena.view[offset : offset + len(data)] = data
        self.commit(reservation_id, [block_checksum(data)])
        return True

    # ----------------------------------------------------------------- removal
    def delete(self, ns_id: int, keys: Sequence[bytes]) -> int:
        record = self.namespace(ns_id)
        deleted = 0
        for key in keys:
            eid = self._committed(ns_id, key)
            if eid is None:
                continue
            self.policy.remove(eid)
            record.blocks -= 1
            if self.index.leases[eid]:
                self.index.orphan(eid)  # freed when the last reader releases
            else:
                self._free_entry(eid, count=False)
            deleted += 1
        return deleted

    def _free_entry(self, eid: int, count: bool = True) -> None:
        """Return an entry's slot to the allocator and forget it. Does not touch the policy."""
        state = self.index.state[eid]
        record = self._namespaces[self.index.ns[eid]]
        self.allocator.free(self.index.offset[eid], record.block_bytes)
        self._used_bytes -= record.block_bytes
        if state == State.RESERVED:
            self._reserved_blocks -= 1
        elif state == State.COMMITTED and count:
            record.blocks -= 1
        self.index.drop(eid)

    def reap(self) -> tuple[int, int]:
        """Reclaim expired reservations and leases: (reservations, leases) reclaimed."""
        now = self._clock()
        dead_res = [r for r, v in self._reservations.items() if v.expires_at <= now]
        for rid in dead_res:
            self._reclaim(self._reservations.pop(rid))
        dead_leases = [lid for lid, v in self._leases.items() if v.expires_at <= now]
        for lid in dead_leases:
            self._drop_lease(self._leases.pop(lid))
        return len(dead_res), len(dead_leases)

    # ----------------------------------------------------------------- stats
    @property
    def active_leases(self) -> int:
        return len(self._leases)

    @property
    def active_reservations(self) -> int:
        return len(self._reservations)

    def tier_snapshots(self) -> list[TierSnapshot]:
        committed = len(self.index) - self._reserved_blocks
        return [
            TierSnapshot(
                "cpu",
                self.allocator.capacity_bytes,
                self._used_bytes,
                committed,
                self.cpu,
                extra={"reserved_blocks": float(self._reserved_blocks)},
            )
        ]

    def namespaces(self) -> list[NamespaceRecord]:
        return list(self._namespaces.values())


def _describe(layout: KVLayout) -> str:
    return (
        f"{layout.num_layers}x{layout.num_kv_heads}x{layout.head_dim} "
        f"block {layout.block_size} {layout.dtype_name}"
    )
