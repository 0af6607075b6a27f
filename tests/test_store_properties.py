"""The whole block store under random use: a stateful property test (hypothesis).

Several namespaces of two block sizes share small CPU and NVMe tiers (real shared memory, a real
slab file); the machine puts, gets, looks up, prefetches, deletes, lets clients die (their
handles close), lets leases and reservations expire, and restarts the store on the same disk.
After every step it checks only what the contract promises:

- every byte served is the byte stored under that key in that namespace (each block's content
  is a function of its namespace and key, so any other content is wrong data, whoever wrote it);
- the store's own books match reality (``BlockStore.check``);
- nothing leaks: with every client gone and the reaper run, no lease or reservation is left and
  the CPU bytes in use are exactly those of the blocks held.

Eviction may remove any unleased block and a full tier may refuse a put: those are misses and
CapacityErrors, both legal, and never asserted against.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import tempfile
import time
from dataclasses import dataclass

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore import KVLayout, Namespace, block_hashes
from kvstore.checksum import block_checksum
from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig, NvmeTierConfig
from kvstore.daemon.store import BlockStore, Handle
from kvstore.errors import CapacityError, LeaseExpiredError

SMALL = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB
LARGE = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16)  # 8 KiB
NAMESPACES = [
    Namespace(model="a", layout=SMALL, tenant="t1"),
    Namespace(model="a", layout=SMALL, tenant="t2"),
    Namespace(model="b", layout=LARGE, tenant="t1"),
]
KEYS_PER_NS = 10


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def content(ns: Namespace, key: bytes) -> bytes:
    """The only bytes that may ever be served under ``key`` in ``ns``."""
    seed = int.from_bytes(hashlib.sha256(ns.fingerprint + key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, ns.layout.block_bytes, np.uint8).tobytes()


def keys_of(ns: Namespace) -> list[bytes]:
    return list(block_hashes(ns.seed, list(range(KEYS_PER_NS * 16))))


@dataclass
class Lease:
    ns: int
    lease_id: int
    handle: Handle
    keys: list[bytes]
    offsets: list[int]


class Store(BlockStore):
    """The store, allowed spare slots on tiers this small (its policy makes none below 16
    blocks' room), some made by evicting: the mechanism is what is under test here, the
    tier-wide bounds included (less than three handles' worth)."""

    def spare_bytes(self, record):  # type: ignore[no-untyped-def]
        return 4 * LARGE.block_bytes

    @property
    def spare_tier_bytes(self) -> int:
        return 6 * LARGE.block_bytes

    @property
    def spare_evicting_bytes(self) -> int:
        # Grants that evict to make their slots too (1/128 of a tier this small is none).
        return 2 * LARGE.block_bytes


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = tempfile.mkdtemp(prefix="kvprop-")
        self.clock = Clock()
        self.config = DaemonConfig(
            gpu=GpuTierConfig(enabled="off"),
            lease_ttl_s=10,
            reservation_ttl_s=10,
            cpu=CpuTierConfig(
                capacity_bytes=12 * SMALL.block_bytes,
                slab_bytes=4 * LARGE.block_bytes,
                prefault=False,
                high_watermark=0.7,
            ),
            nvme=NvmeTierConfig(path=self.dir, capacity_bytes=4 << 20, io_threads=2),
        )
        self.store = self._start()
        self.handles: list[Handle | None] = [None] * len(NAMESPACES)
        self.leases: list[Lease] = []
        self.reserved: list[tuple[int, Handle, int]] = []  # (ns, handle, reservation id)
        self.spares: list[tuple[int, Handle, list[int]]] = []  # (ns, handle, spare offsets)
        self.keys = [keys_of(ns) for ns in NAMESPACES]

    # ------------------------------------------------------------------ plumbing
    def _start(self) -> BlockStore:
        store = Store(self.config, clock=self.clock)
        self.loop.run_until_complete(store.start())
        return store

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def call(self, fn, *args):  # type: ignore[no-untyped-def]
        """A synchronous store method, called on the loop as the daemon does (it may start
        background IO, such as the NVMe tier's tombstones)."""

        async def on_loop():  # type: ignore[no-untyped-def]
            return fn(*args)

        return self.run(on_loop())

    def settle(self) -> None:
        """Let background IO (write-back, promotions, prefetches) finish."""

        async def wait() -> None:
            mover = self.store.mover
            deadline = time.monotonic() + 20
            while not mover.idle:
                if time.monotonic() > deadline:
                    raise AssertionError("background IO did not settle")
                await asyncio.sleep(0.002)

        self.run(wait())

    def handle(self, ns: int) -> Handle:
        if self.handles[ns] is None:
            self.handles[ns] = self.store.open_namespace(NAMESPACES[ns])
        handle = self.handles[ns]
        assert handle is not None
        return handle

    def forget_client(self, ns: int) -> None:
        self.handles[ns] = None
        self.leases = [lease for lease in self.leases if lease.ns != ns]
        self.reserved = [r for r in self.reserved if r[0] != ns]
        self.spares = [r for r in self.spares if r[0] != ns]

    def verify(self, ns: int, keys: list[bytes], offsets: list[int]) -> None:
        namespace = NAMESPACES[ns]
        size = namespace.layout.block_bytes
        for key, offset in zip(keys, offsets, strict=False):
            got = bytes(self.store.arena.view[offset : offset + size])
            assert got == content(namespace, key), "served bytes not stored under this key"

    # ------------------------------------------------------------------ rules
    @rule(ns=st.integers(0, 2), start=st.integers(0, KEYS_PER_NS - 1), n=st.integers(1, 4))
    def put(self, ns: int, start: int, n: int) -> None:
        handle, namespace = self.handle(ns), NAMESPACES[ns]
        keys = self.keys[ns][start : start + n]
        try:
            rid, offsets, _ = self.run(self.store.reserve(handle, keys, wait_s=0.0))
        except CapacityError:
            return
        sums = []
        for key, offset in zip(keys, offsets, strict=True):
            if offset >= 0:
                data = content(namespace, key)
                self.store.arena.view[offset : offset + len(data)] = data
                sums.append(block_checksum(data, namespace.fingerprint, key))
        if rid:
            self.call(self.store.commit, handle, rid, sums)

    @rule(ns=st.integers(0, 2), start=st.integers(0, KEYS_PER_NS - 1), n=st.integers(1, 3))
    def reserve_and_hold(self, ns: int, start: int, n: int) -> None:
        """A writer that reserves and then stalls (it may die or expire later)."""
        handle = self.handle(ns)
        try:
            result = self.run(
                self.store.reserve(handle, self.keys[ns][start : start + n], wait_s=0.0)
            )
        except CapacityError:
            return
        if result.reservation_id:
            self.reserved.append((ns, handle, result.reservation_id))

    @rule(ns=st.integers(0, 2), n=st.integers(1, 4))
    def grant_spare(self, ns: int, n: int) -> None:
        """A writer in a run of puts asks for spare slots (granted all or none)."""
        handle = self.handle(ns)
        rid = self.run(self.store.grant_spare(handle, n))
        if rid:
            handle.spare_ready.append(rid)
            addresses, fresh_s = self.store.take_spare(handle)
            assert len(addresses) == n and fresh_s > 0
            self.spares.append((ns, handle, addresses))

    @precondition(lambda self: self.spares)
    @rule(i=st.integers(0, 100), start=st.integers(0, KEYS_PER_NS - 1), n=st.integers(1, 4))
    def bind(self, i: int, start: int, n: int) -> None:
        """A put in one call: blocks copied into spare slots, then bound to their keys."""
        ns, handle, addresses = self.spares.pop(i % len(self.spares))
        namespace = NAMESPACES[ns]
        keys = self.keys[ns][start : start + n][: len(addresses)]
        slots, rest = addresses[: len(keys)], addresses[len(keys) :]
        sums = []
        for key, address in zip(keys, slots, strict=True):
            offset = self.store.index.offset[handle.spare_slots[address][1]]
            data = content(namespace, key)
            self.store.arena.view[offset : offset + len(data)] = data
            sums.append(block_checksum(data, namespace.fingerprint, key))
        result = self.run(self.store.bind(handle, keys, slots, sums, wait_s=0.0))
        assert result.committed + len(result.unbound) == len(keys)
        if rest + result.unbound:
            self.spares.append((ns, handle, rest + result.unbound))

    @precondition(lambda self: self.spares)
    @rule(i=st.integers(0, 100), ns=st.integers(0, 2), start=st.integers(0, KEYS_PER_NS - 1))
    def bind_what_is_not_ones_own(self, i: int, ns: int, start: int) -> None:
        """A bind naming another handle's spare slot is refused, and changes nothing: that
        handle's slots stay spare (a later bind of them succeeds)."""
        _, owner, addresses = self.spares[i % len(self.spares)]
        handle = self.handle(ns)
        if handle is owner:
            return
        key = self.keys[ns][start]
        try:
            self.run(self.store.bind(handle, [key], addresses[:1], [0], wait_s=0.0))
        except LeaseExpiredError:
            pass
        else:
            raise AssertionError("a bind of another handle's spare slot was accepted")

    @rule(ns=st.integers(0, 2), start=st.integers(0, KEYS_PER_NS - 1), n=st.integers(1, 4))
    def get(self, ns: int, start: int, n: int) -> None:
        handle = self.handle(ns)
        keys = self.keys[ns][start : start + n]
        try:
            result = self.run(self.store.acquire(handle, keys, wait_s=0.0))
        except CapacityError:
            return  # no room to promote into: legal under pressure
        if result.lease_id:
            self.verify(ns, keys, result.offsets)
            self.call(self.store.release, handle, result.lease_id)

    @rule(ns=st.integers(0, 2), start=st.integers(0, KEYS_PER_NS - 1), n=st.integers(1, 3))
    def acquire_and_hold(self, ns: int, start: int, n: int) -> None:
        handle = self.handle(ns)
        keys = self.keys[ns][start : start + n]
        try:
            result = self.run(self.store.acquire(handle, keys, wait_s=0.0))
        except CapacityError:
            return
        if result.lease_id:
            self.leases.append(Lease(ns, result.lease_id, handle, keys, result.offsets))

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 100))
    def release(self, i: int) -> None:
        lease = self.leases.pop(i % len(self.leases))
        self.verify(lease.ns, lease.keys, lease.offsets)  # a held lease still reads its bytes
        self.call(self.store.release, lease.handle, lease.lease_id)

    @rule(ns=st.integers(0, 2), start=st.integers(0, KEYS_PER_NS - 1), n=st.integers(1, 4))
    def lookup(self, ns: int, start: int, n: int) -> None:
        found = self.run(self.store.lookup(self.handle(ns), self.keys[ns][start : start + n]))
        assert 0 <= found <= n

    @rule(ns=st.integers(0, 2), start=st.integers(0, KEYS_PER_NS - 1), n=st.integers(1, 4))
    def prefetch(self, ns: int, start: int, n: int) -> None:
        keys = self.keys[ns][start : start + n]
        ns_id = self.handle(ns).ns_id

        async def hint() -> None:  # called on the loop, as the service does
            self.store.mover.prefetch(ns_id, keys + keys)  # repeats, as a client may

        self.run(hint())

    @rule(ns=st.integers(0, 2), start=st.integers(0, KEYS_PER_NS - 1), n=st.integers(1, 3))
    def delete(self, ns: int, start: int, n: int) -> None:
        self.call(self.store.delete, self.handle(ns), self.keys[ns][start : start + n])

    @rule(ns=st.integers(0, 2))
    def client_dies(self, ns: int) -> None:
        handle = self.handles[ns]
        if handle is not None:
            self.call(self.store.close_handle, handle)
            self.forget_client(ns)

    @rule()
    def time_passes(self) -> None:
        """Leases and reservations expire; the reaper reclaims them."""
        self.clock.now += 11
        self.call(self.store.reap)
        self.leases.clear()
        self.reserved.clear()
        self.spares.clear()

    @rule()
    def restart(self) -> None:
        self.run(self.store.stop())
        self.store = self._start()
        self.handles = [None] * len(NAMESPACES)
        self.leases.clear()
        self.reserved.clear()
        self.spares.clear()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def books_match_reality(self) -> None:
        self.settle()
        self.store.check()
        snap = self.store.tier_snapshots()[0]
        assert 0 <= snap.used_bytes <= snap.capacity_bytes

    def teardown(self) -> None:
        try:
            for ns in range(len(NAMESPACES)):
                self.client_dies(ns)
            self.clock.now += 100  # past every quarantine
            self.call(self.store.reap)
            self.settle()
            self.store.check()
            assert self.store.active_leases == 0 and self.store.active_reservations == 0
            held = sum(r.blocks * r.block_bytes for r in self.store.namespaces())
            cpu_bytes = sum(
                self.store.block_bytes_of(e)
                for e in range(self.store.index.capacity)
                if self.store.index.state[e] and self.store.index.tier[e] & 1
            )
            assert self.store.cpu_used_bytes == cpu_bytes <= held
            self.run(self.store.stop())
        finally:
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, derandomize=True
)
TestStoreUnderRandomUse = StoreMachine.TestCase
