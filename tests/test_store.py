"""The block store in-process: its protocols and invariants, on a real shared-memory arena."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import KVLayout, Namespace, block_hashes
from kvstore.checksum import block_checksum
from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig, NvmeTierConfig
from kvstore.daemon.store import BlockStore, Handle
from kvstore.errors import (
    CapacityError,
    LeaseExpiredError,
    NamespaceMismatchError,
    UnknownNamespaceError,
)
from kvstore.index import IN_NVME
from kvstore.tiers.cpu import HEADER_BYTES, SlabAllocator

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB blocks
NS = Namespace(model="m", layout=LAYOUT)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_store(capacity_blocks: int = 8, policy: str = "lru", clock: Clock | None = None):
    cfg = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),  # these tests are about the CPU tier, on any host
        lease_ttl_s=10,
        reservation_ttl_s=10,
        cpu=CpuTierConfig(
            capacity_bytes=capacity_blocks * LAYOUT.block_bytes,
            slab_bytes=LAYOUT.block_bytes * 2,
            prefault=False,
            policy=policy,
        ),
    )
    return BlockStore(cfg, clock=clock or Clock())


@pytest.fixture
def store():
    s = make_store()
    yield s
    s.close()


def keys(n: int, start: int = 0) -> list[bytes]:
    return block_hashes(NS.seed, list(range(start * 16, (start + n) * 16)))


def checksum(data: bytes, key: bytes, ns: Namespace = NS) -> int:
    return block_checksum(data, ns.fingerprint, key)


async def put(store: BlockStore, handle: Handle, ks: list[bytes], fill: int = 1) -> int:
    rid, offsets, _ = await store.reserve(handle, ks)
    sums = []
    size = handle.record.block_bytes
    for off, k in zip(offsets, ks, strict=True):
        if off >= 0:
            data = bytes([fill]) * size
            store.arena.view[off : off + size] = data
            sums.append(checksum(data, k, handle.record.namespace or NS))
    return store.commit(handle, rid, sums) if rid else 0


async def test_reserved_blocks_are_invisible_until_commit(store: BlockStore) -> None:
    ns = store.open_namespace(NS)
    ks = keys(3)
    rid, offsets, _ = await store.reserve(ns, ks)
    assert all(o >= HEADER_BYTES for o in offsets)
    assert await store.lookup(ns, ks) == 0
    # A second writer of the same keys is told not to write them.
    rid2, offsets2, _ = await store.reserve(ns, ks)
    assert rid2 == 0 and offsets2 == [-1, -1, -1]
    store.commit(ns, rid, [1, 2, 3])
    assert await store.lookup(ns, ks) == 3
    with pytest.raises(LeaseExpiredError):
        store.commit(ns, rid, [1, 2, 3])


async def test_commit_needs_one_checksum_per_block(store: BlockStore) -> None:
    ns = store.open_namespace(NS)
    rid, _, _ = await store.reserve(ns, keys(2))
    with pytest.raises(ValueError, match="2 blocks"):
        store.commit(ns, rid, [1])
    assert store.commit(ns, rid, [1, 2]) == 2  # the bad commit changed nothing


async def test_duplicate_keys_in_one_put_are_written_once(store: BlockStore) -> None:
    ns = store.open_namespace(NS)
    k = keys(1)[0]
    rid, offsets, _ = await store.reserve(ns, [k, k])
    assert offsets[1] == -1 and offsets[0] >= 0
    store.commit(ns, rid, [7])


async def test_lookup_stops_at_the_first_gap(store: BlockStore) -> None:
    ns = store.open_namespace(NS)
    ks = keys(5)
    await put(store, ns, [ks[0], ks[1], ks[3], ks[4]])
    assert await store.lookup(ns, ks) == 2


async def test_lru_eviction_under_pressure(store: BlockStore) -> None:
    ns = store.open_namespace(NS)
    capacity = store.allocator.capacity_bytes // LAYOUT.block_bytes
    old = keys(capacity)
    await put(store, ns, old)
    await put(store, ns, keys(2, start=100))
    assert await store.lookup(ns, old[:2]) == 0  # the two oldest are gone
    assert await store.lookup(ns, old[2:]) == capacity - 2
    assert store.cpu.evictions == 2
    snap = store.tier_snapshots()[0]
    assert snap.used_bytes <= snap.capacity_bytes and snap.blocks == capacity


async def test_leased_blocks_are_never_evicted(store: BlockStore) -> None:
    ns = store.open_namespace(NS)
    capacity = store.allocator.capacity_bytes // LAYOUT.block_bytes
    ks = keys(capacity)
    await put(store, ns, ks)
    lease, offsets, _, _ = await store.acquire(ns, ks)
    assert len(offsets) == capacity
    with pytest.raises(CapacityError, match="leased"):
        await store.reserve(ns, keys(1, start=500))
    store.release(ns, lease)
    assert (await store.reserve(ns, keys(1, start=500))).reservation_id != 0


async def test_a_run_is_leased_whole_or_not_at_all(store: BlockStore) -> None:
    """A read leases its run in one ledger call: a block at its lease limit refuses the read
    with no lease left on the blocks before it (they stay evictable)."""
    ns = store.open_namespace(NS)
    ks = keys(3)
    await put(store, ns, ks)
    eids = [e for k in ks if (e := store.ledger.committed(ns.ns_id, k)) is not None]
    assert len(eids) == 3
    leases = store.ledger.index.leases
    leases[eids[2]] = store.ledger.index.MAX_LEASES
    with pytest.raises(OverflowError, match="read leases"):
        await store.acquire(ns, ks)
    assert [leases[e] for e in eids] == [0, 0, store.ledger.index.MAX_LEASES]
    leases[eids[2]] = 0
    lease, *_ = await store.acquire(ns, ks)
    assert [leases[e] for e in eids] == [1, 1, 1]
    store.release(ns, lease)
    assert [leases[e] for e in eids] == [0, 0, 0]
    store.check()


async def test_delete_while_leased_keeps_the_slot_until_release(store: BlockStore) -> None:
    ns = store.open_namespace(NS)
    ks = keys(2)
    await put(store, ns, ks, fill=9)
    lease, offsets, _, _ = await store.acquire(ns, ks)
    assert store.delete(ns, ks) == 2
    assert await store.lookup(ns, ks) == 0
    # The reader's slots are still intact and held.
    assert store.arena.view[offsets[0]] == 9
    used = store.tier_snapshots()[0].used_bytes
    assert used == 2 * LAYOUT.block_bytes
    store.release(ns, lease)
    assert store.tier_snapshots()[0].used_bytes == 0


async def test_expired_reservations_and_leases_are_reclaimed() -> None:
    clock = Clock()
    s = make_store(clock=clock)
    try:
        ns = s.open_namespace(NS)
        ks = keys(2)
        await s.reserve(ns, ks)  # a client that dies before commit
        await put(s, ns, keys(1, start=50))
        await s.acquire(ns, keys(1, start=50))  # a reader that dies holding a lease
        clock.now = 11.0
        assert s.reap() == (1, 1)
        assert s.active_reservations == 0 and s.active_leases == 0
        snap = s.tier_snapshots()[0]
        assert snap.blocks == 1
        assert snap.used_bytes == 3 * LAYOUT.block_bytes  # two slots quarantined (next test)
        assert s.index.leases[s.index.get(ns.ns_id, keys(1, start=50)[0])] == 0
        clock.now = 22.0
        s.reap()
        assert s.tier_snapshots()[0].used_bytes == LAYOUT.block_bytes
    finally:
        s.close()


async def test_a_late_write_of_an_expired_reservation_cannot_corrupt_a_new_block() -> None:
    clock = Clock()
    s = make_store(capacity_blocks=4, clock=clock)
    try:
        ns = s.open_namespace(NS)
        _, stale, _ = await s.reserve(ns, keys(2))  # writer A stalls past its reservation
        clock.now = 11.0
        s.reap()
        # Writer B stores the same keys; A's slots are not handed out again yet.
        rid, fresh, _ = await s.reserve(ns, keys(2))
        assert not set(stale) & set(fresh)
        data = [bytes([i + 1]) * LAYOUT.block_bytes for i in range(2)]
        for off, d in zip(fresh, data, strict=True):
            s.arena.view[off : off + LAYOUT.block_bytes] = d
        s.commit(ns, rid, [checksum(d, k) for d, k in zip(data, keys(2), strict=True)])
        for off in stale:  # A wakes up and finishes its copy
            s.arena.view[off : off + LAYOUT.block_bytes] = b"\xee" * LAYOUT.block_bytes
        lease, offsets, sums, _ = await s.acquire(ns, keys(2))
        got = [bytes(s.arena.view[o : o + LAYOUT.block_bytes]) for o in offsets]
        assert got == data and sums == [checksum(d, k) for d, k in zip(data, keys(2), strict=True)]
        s.release(ns, lease)
        clock.now = 22.0
        s.reap()  # the quarantine is over: the slots serve again
        assert s.allocator.free_slots(LAYOUT.block_bytes) == 2
    finally:
        s.close()


def test_namespace_mismatch_is_refused(store: BlockStore) -> None:
    store.open_namespace(NS)
    other = Namespace(model="m", layout=dataclasses.replace(LAYOUT, head_dim=32))
    with pytest.raises(NamespaceMismatchError, match="registered with layout"):
        store.open_namespace(other)
    assert store.open_namespace(NS).ns_id == 1  # joining with the same fingerprint is fine


def test_unknown_or_closed_handles_are_refused(store: BlockStore) -> None:
    with pytest.raises(UnknownNamespaceError):
        store.handle(b"\x00" * 16)
    with pytest.raises(UnknownNamespaceError):
        store.handle(b"short")
    handle = store.open_namespace(NS)
    assert store.handle(handle.token) is handle
    store.close_handle(handle)
    with pytest.raises(UnknownNamespaceError):
        store.handle(handle.token)


async def test_a_key_of_another_namespace_is_a_miss(store: BlockStore) -> None:
    a = store.open_namespace(NS)
    b = store.open_namespace(Namespace(model="m", layout=LAYOUT, tenant="t2"))
    ks = keys(2)  # hashed with NS's seed, then (wrongly) presented in tenant t2
    await put(store, a, ks)
    assert await store.lookup(b, ks) == 0
    assert tuple(await store.acquire(b, ks)) == (0, [], [], [])


async def test_a_tenant_cannot_preempt_or_shadow_another_tenants_keys(store: BlockStore) -> None:
    """Keys are indexed per namespace: bob writing garbage under the keys alice will use (her
    namespace's identity is no secret) neither blocks alice's put nor reaches her reads."""
    alice = store.open_namespace(NS)
    bob = store.open_namespace(Namespace(model="m", layout=LAYOUT, tenant="bob"))
    ks = keys(2)
    assert await put(store, bob, ks, fill=0xEE) == 2  # bob first, under alice's future keys
    assert await put(store, alice, ks, fill=0x11) == 2  # not "already present"
    lease, offsets, _, _ = await store.acquire(alice, ks)
    got = [bytes(store.arena.view[o : o + LAYOUT.block_bytes]) for o in offsets]
    assert got == [b"\x11" * LAYOUT.block_bytes] * 2
    store.release(alice, lease)
    store.check()


def test_arena_slab_files_are_unnamed_and_closed_on_close() -> None:
    def slab_fds() -> list[str]:
        out = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/memfd:kvstore-slab"):
                out.append(target)
        return out

    before = len(slab_fds())
    s = make_store()
    assert len(slab_fds()) > before  # the prefaulted slabs' files, reachable by fd only
    s.close()
    assert len(slab_fds()) == before


def test_slab_allocator_mixes_sizes_and_reports_full() -> None:
    alloc = SlabAllocator(HEADER_BYTES + 4 * 16384, slab_bytes=16384)
    small = [alloc.allocate(4096) for _ in range(4)]  # one slab of 4 KiB slots
    big = [alloc.allocate(16384) for _ in range(3)]  # three slabs of one slot
    assert None not in small and None not in big
    assert alloc.allocate(16384) is None and alloc.free_slots(4096) == 0
    assert len(set(small + big)) == 7
    alloc.free(big[0], 16384)
    assert alloc.allocate(16384) == big[0]
    with pytest.raises(ValueError, match="does not fit"):
        alloc.check_fits(32768)


@given(st.lists(st.tuples(st.sampled_from("prgdl"), st.integers(0, 11)), max_size=80))
@settings(max_examples=40, deadline=None)
def test_random_operations_keep_the_books_straight(ops: list[tuple[str, int]]) -> None:
    asyncio.run(_random_operations(ops))


async def _random_operations(ops: list[tuple[str, int]]) -> None:
    s = make_store(capacity_blocks=6)
    try:
        ns = s.open_namespace(NS)
        all_keys = keys(12)
        leases: list[int] = []
        for op, i in ops:
            k = all_keys[i]
            if op == "p":
                try:
                    await put(s, ns, [k])
                except CapacityError:
                    pass
            elif op == "g":
                lease, _, _, _ = await s.acquire(ns, [k])
                if lease:
                    leases.append(lease)
            elif op == "r" and leases:
                s.release(ns, leases.pop(i % len(leases)))
            elif op == "d":
                s.delete(ns, [k])
            elif op == "l":
                await s.lookup(ns, [k])
            s.check()
            snap = s.tier_snapshots()[0]
            assert 0 <= snap.used_bytes <= snap.capacity_bytes
            assert snap.blocks == len(s.policy)
            held = sum(1 for e in range(s.index.capacity) if s.index.state[e] != 0)
            assert snap.used_bytes == held * LAYOUT.block_bytes
        for lease in leases:
            s.release(ns, lease)
        assert all(s.index.leases[e] == 0 for e in range(s.index.capacity))
    finally:
        s.close()


async def test_a_second_block_size_evicts_the_first_once_it_filled_the_tier() -> None:
    """A slab once given to a size was never taken back: after one model filled the tier, a
    model with another block size got CapacityError on every put, for good, with nothing
    leased. Now the coldest slab of the other size is drained (blocks moved or evicted)."""
    big_layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16)  # 8 KiB
    big_ns = Namespace(model="big", layout=big_layout)
    s = make_store(capacity_blocks=16)  # four 16 KiB slabs... of 8 KiB (2 blocks) each
    try:
        small = s.open_namespace(NS)
        big = s.open_namespace(big_ns)
        for i in range(16):  # the small model fills every slab
            assert await put(s, small, keys(1, start=i)) == 1
        s.check()
        bkeys = list(block_hashes(big_ns.seed, list(range(8 * 16))))
        for i in range(8):  # the big model now stores, evicting small blocks, coldest first
            assert await put(s, big, bkeys[i : i + 1]) == 1
            s.check()
        assert await s.lookup(big, bkeys) == 8
        assert await s.lookup(small, keys(16)) == 0  # they were the coldest
        for i in range(16):  # and back: the small model takes slabs from the big one
            assert await put(s, small, keys(1, start=100 + i)) == 1
            s.check()
    finally:
        s.close()


async def test_draining_moves_hot_blocks_instead_of_evicting_them() -> None:
    big_layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16)  # 8 KiB
    big_ns = Namespace(model="big", layout=big_layout)
    s = make_store(capacity_blocks=8)  # four 8 KiB slabs: two small slots each
    try:
        small = s.open_namespace(NS)
        big = s.open_namespace(big_ns)
        for i in range(6):  # slabs 0-2 hold small blocks 0-5, block 0 the coldest
            assert await put(s, small, keys(1, start=i)) == 1
        bkeys = list(block_hashes(big_ns.seed, list(range(2 * 16))))
        assert await put(s, big, bkeys[:1]) == 1  # slab 3
        assert s.delete(small, keys(1, start=3)) == 1  # a free small slot in slab 1
        # The big block needs a slab: the coldest block (small 0) goes, and its neighbour in
        # slab 0 (small 1) moves into the free slot instead of being evicted with it.
        assert await put(s, big, bkeys[1:2]) == 1
        assert await s.lookup(big, bkeys) == 2
        assert await s.lookup(small, keys(1)) == 0
        assert await s.lookup(small, keys(1, start=1)) == 1
        lease, offsets, _, _ = await s.acquire(small, keys(1, start=1))
        got = bytes(s.arena.view[offsets[0] : offsets[0] + LAYOUT.block_bytes])
        assert got == bytes([1]) * LAYOUT.block_bytes  # moved intact
        s.release(small, lease)
        s.check()
    finally:
        s.close()


async def test_a_second_block_size_reaches_a_disk_the_first_one_filled(tmp_path) -> None:
    """On disk too, a slab stayed with its first block size: once one model filled the NVMe
    tier, blocks of another size were never written down again. Now the coldest slab of the
    other size is emptied for them."""
    big_layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16)  # 8 KiB
    big_ns = Namespace(model="big", layout=big_layout)
    s = await disk_store(tmp_path, cpu_bytes=64 * 8192)
    try:
        small = s.open_namespace(NS)
        big = s.open_namespace(big_ns)
        for i in range(0, 40, 4):
            await put(s, small, keys(4, start=i))
        await wait_idle(s)
        on_disk = [e for e in range(s.index.capacity) if s.index.tier[e] & IN_NVME]
        assert on_disk  # the small model's blocks fill the disk
        bkeys = list(block_hashes(big_ns.seed, list(range(4 * 16))))
        await put(s, big, bkeys)
        await wait_idle(s)
        big_eids = [s.index.get(big.ns_id, k) for k in bkeys]
        assert all(e is not None and s.index.tier[e] & IN_NVME for e in big_eids)
        s.check()
    finally:
        await s.stop()


async def disk_store(directory, cpu_bytes: int) -> BlockStore:
    """A started store with a CPU tier of one slab and a 1 MiB write-through NVMe tier."""
    cfg = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        cpu=CpuTierConfig(capacity_bytes=cpu_bytes, slab_bytes=cpu_bytes, prefault=False),
        nvme=NvmeTierConfig(path=str(directory), capacity_bytes=1 << 20, write_through=True),
    )
    s = BlockStore(cfg, clock=Clock())
    await s.start()
    return s


async def wait_idle(s: BlockStore) -> None:
    for _ in range(2000):
        if s.mover.idle:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("movement did not settle")


async def test_a_delete_during_a_promotion_neither_fails_it_nor_leaks(tmp_path) -> None:
    """Under a mixed load, a Delete during a promotion made the promotion fail with INTERNAL
    ("entry N has no key") and leaked the CPU slots it had taken. Promotions now re-check each
    entry after every await."""
    s = await disk_store(tmp_path, cpu_bytes=8 * 4096)
    try:
        h = s.open_namespace(NS)
        ks = keys(4)
        await put(s, h, ks)
        await wait_idle(s)
        for k in ks:  # disk only now
            s.ledger.drop_cpu_copy(s.index.get(h.ns_id, k))
        s.check()
        task = asyncio.create_task(s.acquire(h, ks))
        for _ in range(1000):
            await asyncio.sleep(0)
            if s.mover._promoting:
                break
        assert s.mover._promoting, "the promotion never started"
        assert s.delete(h, ks) == 4  # while the disk reads are in flight
        result = await task  # no exception
        if result.lease_id:
            s.release(h, result.lease_id)
        await wait_idle(s)
        s.check()
        assert s.cpu_used_bytes == 0  # every slot the promotion took came back
        assert await s.lookup(h, ks) == 0
    finally:
        await s.stop()


async def test_seventy_thousand_opens_do_not_exhaust_the_namespace_table() -> None:
    """Namespaces were never freed: 65,535 opens exhausted the table until restart."""
    s = make_store()
    try:
        for i in range(70_000):
            h = s.open_namespace(Namespace(model="m", layout=LAYOUT, tenant=f"t{i}"))
            s.close_handle(h)
        assert len(s.namespaces()) == 0
        h = s.open_namespace(NS)
        assert await put(s, h, keys(1)) == 1
        s.check()
    finally:
        s.close()
