"""The GPU tier: configuration, and the daemon's tier logic driven in-process.

The tier's logic (slots, write-back to the CPU tier, eviction, promotion, device checksums) does
not depend on where the pool's memory is, so these tests give the store a ``DevicePool`` on a CPU
device: real torch memory, checked with the torch reference of the device checksum. What only
CUDA can show (IPC between processes, the kernels on device memory) is in
``tests/test_gpu_service.py``, which runs where a GPU is.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import KVLayout, Namespace, block_hashes, kernels
from kvstore.checksum import bind_device_checksum, block_checksum, checksum_seed
from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig, NvmeTierConfig, load_config
from kvstore.daemon.device import make_device_pool
from kvstore.daemon.store import BlockStore, Handle
from kvstore.errors import CapacityError, KVStoreError
from kvstore.index import IN_CPU, IN_GPU, IN_NVME
from kvstore.tiers.cpu import HEADER_BYTES
from kvstore.tiers.gpu import DevicePool, cuda_usable

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB blocks
BB = LAYOUT.block_bytes
NS = Namespace(model="m", layout=LAYOUT)


def keys(n: int, start: int = 0) -> list[bytes]:
    return list(block_hashes(NS.seed, list(range(start * 16, (start + n) * 16))))


def block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BB, dtype=np.uint8)


def xxh(data: np.ndarray, key: bytes) -> int:
    """A block's checksum as the store holds it: bound to NS and ``key``."""
    return block_checksum(data, NS.fingerprint, key)


def dsum(slot: torch.Tensor, key: bytes) -> int:
    """A pool slot's device checksum bound to NS and ``key``, as a worker commits it."""
    return bind_device_checksum(kernels.device_checksums([slot])[0], NS.fingerprint, key)


def make_store(
    gpu_blocks: int = 4,
    cpu_blocks: int = 16,
    high_watermark: float = 1.0,
    nvme: NvmeTierConfig | None = None,
) -> BlockStore:
    cfg = DaemonConfig(
        lease_ttl_s=10,
        reservation_ttl_s=10,
        gpu=GpuTierConfig(
            enabled="off",  # the pool is given below, on a CPU device
            capacity_bytes=gpu_blocks * BB,
            slab_bytes=2 * BB,
            high_watermark=high_watermark,
        ),
        cpu=CpuTierConfig(capacity_bytes=cpu_blocks * BB, slab_bytes=2 * BB, prefault=False),
        nvme=nvme or NvmeTierConfig(),
    )
    pool = DevicePool(gpu_blocks * BB + HEADER_BYTES, "cpu")
    return BlockStore(cfg, gpu_pool=pool)


@pytest.fixture
async def store():
    s = make_store()
    await s.start()
    yield s
    await s.stop()


async def put_gpu(s: BlockStore, ns: Handle, ks: list[bytes], seeds: list[int]) -> int:
    """Write blocks as a worker does: into pool slots, then commit their bound device
    checksums."""
    rid, offsets, on_gpu = await s.reserve(ns, ks, gpu=True)
    assert on_gpu
    sums = []
    for off, seed, k in zip(offsets, seeds, ks, strict=True):
        if off < 0:
            continue
        slot = s.device.pool.slot(off, BB)  # type: ignore[union-attr]
        slot.copy_(torch.from_numpy(block(seed)))
        sums.append(dsum(slot, k))
    return s.commit(ns, rid, [], sums) if rid else 0


def read_cpu(s: BlockStore, offset: int) -> np.ndarray:
    return np.frombuffer(s.arena.view[offset : offset + BB], dtype=np.uint8).copy()


async def settle(s: BlockStore, timeout_s: float = 20.0) -> None:
    """Let background copies (cleaner, prefetch, copies in flight) finish."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        d = s.device
        if not (d._tasks or d._copies or d._moving or d._eager or d._wake.is_set()):
            return
    raise AssertionError("background copies did not settle")


# ----------------------------------------------------------------- configuration
def test_auto_is_off_without_cuda_and_on_refuses_to_start() -> None:
    if cuda_usable() is None:
        pytest.skip("this host has CUDA: the tier is on here")
    assert make_device_pool(GpuTierConfig(enabled="auto")) is None
    assert make_device_pool(GpuTierConfig(enabled="off")) is None
    with pytest.raises(RuntimeError, match="the gpu tier is on but"):
        make_device_pool(GpuTierConfig(enabled="on"))


def test_gpu_config_from_toml_and_env(tmp_path) -> None:
    assert load_config(env={}).gpu.enabled == "auto"
    path = tmp_path / "k.toml"
    path.write_text('[gpu]\nenabled = false\ncapacity = "1GiB"\ndevice = 1\n')
    cfg = load_config(path, env={})
    assert (cfg.gpu.enabled, cfg.gpu.capacity_bytes, cfg.gpu.device) == ("off", 1 << 30, 1)
    assert load_config(env={"KVSTORE_GPU": "ON"}).gpu.enabled == "on"
    with pytest.raises(ValueError, match="gpu enabled 'maybe' unknown"):
        load_config(env={"KVSTORE_GPU": "maybe"})
    path.write_text("[gpu]\nhigh_watermark = 0\n")
    with pytest.raises(ValueError, match="gpu high_watermark"):
        load_config(path, env={})


async def test_store_without_cuda_has_no_gpu_tier() -> None:
    if cuda_usable() is None:
        pytest.skip("this host has CUDA and CuPy: the tier is on here")
    s = BlockStore(DaemonConfig(cpu=CpuTierConfig(capacity_bytes=8 * BB, prefault=False)))
    try:
        assert not s.device.enabled
        assert [t.name for t in s.tier_snapshots()] == ["cpu"]
        ns = s.open_namespace(NS)
        _, _, on_gpu = await s.reserve(ns, keys(1), gpu=True)  # asked, but there is none
        assert not on_gpu
    finally:
        s.close()


# ----------------------------------------------------------------- writes and reads
async def test_gpu_put_is_read_from_the_pool_and_from_the_cpu_tier(store: BlockStore) -> None:
    ns = store.open_namespace(NS)
    ks = keys(3)
    assert await put_gpu(store, ns, ks, [1, 2, 3]) == 3
    assert await store.lookup(ns, ks) == 3
    assert store.device.counters.hits == 3

    lease, offsets, sums, on_gpu = await store.acquire(ns, ks, gpu=True)
    assert on_gpu == [True] * 3
    pool = store.device.pool
    assert pool is not None
    for i, off in enumerate(offsets):
        slot = pool.slot(off, BB)
        assert np.array_equal(slot.numpy(), block(i + 1))
        assert dsum(slot, ks[i]) == sums[i]
    store.release(ns, lease)

    # A reader without the pool gets CPU copies, made on demand, with their xxh3.
    lease, offsets, sums, on_gpu = await store.acquire(ns, ks, gpu=False)
    assert on_gpu == [False] * 3
    for i, off in enumerate(offsets):
        assert np.array_equal(read_cpu(store, off), block(i + 1))
        assert sums[i] == xxh(block(i + 1), ks[i])
    store.release(ns, lease)
    for k in ks:  # both copies stay: the GPU one is clean now
        eid = store.index.get(ns.ns_id, k)
        assert eid is not None and store.index.tier[eid] & (IN_GPU | IN_CPU) == IN_GPU | IN_CPU
    assert store.device.counters.demotions == 3
    await settle(store)
    store.check()


async def test_the_checker_sees_the_pool_books_disagree_with_the_index(store: BlockStore) -> None:
    """The ledger keeps the pool's books (slot owners, device checksums, the GPU policy); the
    whole-state checker compares them with the index, and a broken one is named."""
    ns = store.open_namespace(NS)
    assert await put_gpu(store, ns, keys(2), [1, 2]) == 2
    await settle(store)
    store.check()
    books, policy = store.ledger.gpu_slots, store.ledger.gpu_policy
    eid = next(iter(books.dsum))
    policy.remove(eid)
    with pytest.raises(AssertionError, match="gpu policy"):
        store.check()
    policy.insert(eid, 0)
    store.check()
    books.used_bytes += BB
    with pytest.raises(AssertionError, match="gpu used"):
        store.check()
    books.used_bytes -= BB
    store.ledger.index.tier[eid] &= ~IN_GPU
    with pytest.raises(AssertionError, match="pool slot without its GPU bit"):
        store.check()
    store.ledger.index.tier[eid] |= IN_GPU
    store.check()


async def test_duplicate_gpu_put_is_deduplicated(store: BlockStore) -> None:
    ns = store.open_namespace(NS)
    assert await put_gpu(store, ns, keys(2), [1, 2]) == 2
    rid, offsets, _ = await store.reserve(ns, keys(2), gpu=True)
    assert rid == 0 and offsets == [-1, -1]
    await settle(store)
    store.check()


async def test_commit_of_a_gpu_reservation_needs_device_checksums(store: BlockStore) -> None:
    ns = store.open_namespace(NS)
    rid, _, on_gpu = await store.reserve(ns, keys(2), gpu=True)
    assert on_gpu
    with pytest.raises(ValueError, match="device checksums"):
        store.commit(ns, rid, [1, 2])  # xxh3 checksums where device checksums belong
    with pytest.raises(ValueError, match="device checksums"):
        store.commit(ns, rid, [], [1])
    assert store.commit(ns, rid, [], [1, 2]) == 2  # the bad commits changed nothing
    await settle(store)
    store.check()


async def test_corrupt_gpu_block_is_a_miss_never_wrong_data(store: BlockStore) -> None:
    ns = store.open_namespace(NS)
    ks = keys(3)
    await put_gpu(store, ns, ks, [1, 2, 3])
    eid = store.index.get(ns.ns_id, ks[1])
    assert eid is not None
    slot = store.device.pool.slot(store.ledger.gpu_slots.offset[eid], BB)  # type: ignore[union-attr]
    slot[100] ^= 0xFF  # a worker scribbled on a committed block
    lease, offsets, _, _ = await store.acquire(ns, ks, gpu=False)
    assert len(offsets) == 1  # the run ends at the corrupt block
    assert np.array_equal(read_cpu(store, offsets[0]), block(1))
    store.release(ns, lease)
    assert store.device.counters.checksum_failures == 1
    assert store.index.get(ns.ns_id, ks[1]) is None  # gone, not served
    assert await store.lookup(ns, ks) == 1
    await settle(store)
    store.check()


async def test_abandoned_gpu_reservation_gives_its_slots_back() -> None:
    s = make_store()
    await s.start()
    try:
        ns = s.open_namespace(NS)
        rid, _, on_gpu = await s.reserve(ns, keys(4), gpu=True)
        assert on_gpu and s.ledger.gpu_slots.used_bytes == 4 * BB
        s.abort(ns, rid)
        assert s.ledger.gpu_slots.used_bytes == 0
        s.check()
        await s.reserve(ns, keys(4), gpu=True)  # a writer that stalls past its reservation
        s._clock = lambda: 1e9
        assert s.reap() == (1, 0)
        assert len(s.index) == 0
        # Quarantined for one more TTL: a late copy of that writer must not hit a new block.
        assert s.ledger.gpu_slots.used_bytes == 4 * BB
        _, _, on_gpu = await s.reserve(ns, keys(1, start=9), gpu=True)
        assert not on_gpu  # the pool had no slot to give; the CPU tier took it
        s._clock = lambda: 1e9 + 11
        s.reap()
        assert s.ledger.gpu_slots.used_bytes == 0
        await settle(s)
        s.check()
    finally:
        await s.stop()


async def test_delete_frees_the_gpu_slot(store: BlockStore) -> None:
    ns = store.open_namespace(NS)
    await put_gpu(store, ns, keys(2), [1, 2])
    assert store.delete(ns, keys(2)) == 2
    assert store.ledger.gpu_slots.used_bytes == 0 and len(store.ledger.gpu_policy) == 0
    assert await store.lookup(ns, keys(2)) == 0
    await settle(store)
    store.check()


# ----------------------------------------------------------------- eviction and write-back
async def test_full_pool_writes_back_then_evicts_and_nothing_is_lost() -> None:
    s = make_store(gpu_blocks=4, cpu_blocks=16)
    await s.start()
    try:
        ns = s.open_namespace(NS)
        ks = keys(10)
        for i in range(10):  # 10 blocks through a 4-block pool
            assert await put_gpu(s, ns, [ks[i]], [i]) == 1
            assert s.ledger.gpu_slots.used_bytes <= 4 * BB
        assert s.device.counters.evictions >= 6
        assert await s.lookup(ns, ks) == 10
        lease, offsets, sums, _ = await s.acquire(ns, ks, gpu=False)
        for i, off in enumerate(offsets):
            assert np.array_equal(read_cpu(s, off), block(i)), i
            assert sums[i] == xxh(block(i), ks[i])
        s.release(ns, lease)
        hot = [s.index.get(ns.ns_id, k) for k in ks[6:]]
        assert all(e is not None and s.index.tier[e] & IN_GPU for e in hot)  # LRU kept these
        await settle(s)
        s.check()
    finally:
        await s.stop()


async def test_leased_gpu_blocks_are_not_evicted_and_a_full_pool_falls_back_to_cpu() -> None:
    s = make_store(gpu_blocks=2)
    await s.start()
    try:
        ns = s.open_namespace(NS)
        await put_gpu(s, ns, keys(2), [1, 2])
        lease, _, _, on_gpu = await s.acquire(ns, keys(2), gpu=True)
        assert on_gpu == [True, True]
        with pytest.raises(CapacityError):
            await s.device.alloc(BB, 1)
        _, offsets, gpu = await s.reserve(ns, keys(1, start=5), gpu=True)
        assert not gpu and offsets[0] >= 0  # the CPU tier took it
        s.release(ns, lease)
        await settle(s)
        s.check()
    finally:
        await s.stop()


async def test_background_write_back_keeps_the_pool_clean() -> None:
    s = make_store(gpu_blocks=4, high_watermark=0.5)
    await s.start()
    try:
        ns = s.open_namespace(NS)
        await put_gpu(s, ns, keys(4), [1, 2, 3, 4])
        await settle(s)
        # At most half the pool may be dirty: the coldest blocks were copied down.
        assert s.device.clean_bytes() >= 2 * BB
        clean = [s.index.get(ns.ns_id, k) for k in keys(2)]
        assert all(e is not None and s.index.tier[e] & IN_CPU for e in clean)
        snap = {t.name: t for t in s.tier_snapshots()}
        assert snap["gpu"].blocks == 4 and snap["gpu"].extra["clean_below_bytes"] >= 2 * BB
        s.check()
    finally:
        await s.stop()


async def test_gpu_blocks_reach_the_disk_with_nvme_write_through(tmp_path) -> None:
    nvme = NvmeTierConfig(
        path=str(tmp_path), capacity_bytes=64 * BB, write_through=True, direct_io=False
    )
    s = make_store(nvme=nvme)
    await s.start()
    try:
        ns = s.open_namespace(NS)
        await put_gpu(s, ns, keys(3), [1, 2, 3])
        for _ in range(2000):  # up to 20 s on a loaded machine; usually a few ms
            eids = [s.index.get(ns.ns_id, k) for k in keys(3)]
            if all(e is not None and s.index.tier[e] & IN_NVME for e in eids):
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("GPU blocks were not written through to the disk")
        await settle(s)
        s.check()
    finally:
        await s.stop()
    # A restarted daemon (no GPU tier this time) finds them on disk, bit-exact.
    s2 = BlockStore(
        DaemonConfig(
            gpu=GpuTierConfig(enabled="off"),
            cpu=CpuTierConfig(capacity_bytes=16 * BB, slab_bytes=2 * BB, prefault=False),
            nvme=nvme,
        )
    )
    await s2.start()
    try:
        ns = s2.open_namespace(NS)
        lease, offsets, _, _ = await s2.acquire(ns, keys(3))
        assert [np.array_equal(read_cpu(s2, o), block(i + 1)) for i, o in enumerate(offsets)] == [
            True
        ] * 3
        s2.release(ns, lease)
        s2.check()
    finally:
        await s2.stop()


# ----------------------------------------------------------------- promotion
async def test_prefetch_promotes_into_the_pool(store: BlockStore) -> None:
    ns = store.open_namespace(NS)
    ks = keys(3)
    rid, offsets, on_gpu = await store.reserve(ns, ks)  # a CPU put
    assert not on_gpu
    for i, off in enumerate(offsets):
        store.arena.view[off : off + BB] = block(10 + i).tobytes()
    store.commit(ns, rid, [xxh(block(10 + i), ks[i]) for i in range(3)])
    assert store.device.prefetch(ns.ns_id, ks) == 3
    await settle(store)
    assert store.device.counters.promotions == 3
    lease, offsets, sums, served_on_gpu = await store.acquire(ns, ks, gpu=True)
    assert served_on_gpu == [True] * 3
    pool = store.device.pool
    assert pool is not None
    for i, off in enumerate(offsets):
        slot = pool.slot(off, BB)
        assert np.array_equal(slot.numpy(), block(10 + i))
        assert dsum(slot, ks[i]) == sums[i]
    store.release(ns, lease)
    await settle(store)
    store.check()


async def test_prefetch_drops_a_corrupt_cpu_block(store: BlockStore) -> None:
    ns = store.open_namespace(NS)
    ks = keys(3)
    rid, offsets, _ = await store.reserve(ns, ks)
    for i, off in enumerate(offsets):
        store.arena.view[off : off + BB] = block(i).tobytes()
    store.commit(ns, rid, [xxh(block(i), ks[i]) for i in range(3)])
    store.arena.view[offsets[0] + 7] ^= 1  # scribbled after commit
    store.device.prefetch(ns.ns_id, ks)
    await settle(store)
    assert store.index.get(ns.ns_id, ks[0]) is None  # corrupt: dropped, not promoted
    assert store.cpu.checksum_failures == 1
    assert store.device.counters.promotions == 2
    assert await store.lookup(ns, ks) == 0  # the prefix is broken at its first block
    store.check()


# ----------------------------------------------------------------- invariants under random use
OPS = st.lists(
    st.tuples(
        st.sampled_from(["put_gpu", "put_cpu", "read_gpu", "read_cpu", "delete", "prefetch"]),
        st.integers(0, 7),
    ),
    max_size=40,
)


@settings(max_examples=40, deadline=None)
@given(ops=OPS)
def test_random_use_keeps_the_tiers_consistent_and_bytes_exact(ops) -> None:
    async def run() -> None:
        s = make_store(gpu_blocks=3, cpu_blocks=5, high_watermark=0.7)
        await s.start()
        try:
            ns = s.open_namespace(NS)
            stored: dict[int, int] = {}  # block -> seed of its bytes
            for op, i in ops:
                k = keys(1, start=i)
                if op == "put_gpu":
                    await put_gpu(s, ns, k, [i])
                elif op == "put_cpu":
                    rid, offsets, _ = await s.reserve(ns, k)
                    if rid:
                        s.arena.view[offsets[0] : offsets[0] + BB] = block(i).tobytes()
                        s.commit(ns, rid, [xxh(block(i), k[0])])
                elif op in ("read_gpu", "read_cpu"):
                    lease, offsets, sums, on_gpu = await s.acquire(ns, k, gpu=op == "read_gpu")
                    if lease:
                        if on_gpu[0]:
                            got = s.device.pool.slot(offsets[0], BB).numpy()  # type: ignore[union-attr]
                        else:
                            got = read_cpu(s, offsets[0])
                            assert sums[0] == xxh(got, k[0])
                        assert np.array_equal(got, block(i))
                        s.release(ns, lease)
                elif op == "delete":
                    s.delete(ns, k)
                else:
                    s.device.prefetch(ns.ns_id, k)
                await settle(s)
                s.check()
                # Invariants: slots and policy agree with the index; every stored block is whole.
                d = s.ledger.gpu_slots
                assert d.used_bytes == len(d.offset) * BB <= 3 * BB
                assert set(d.dsum) <= set(d.offset)
                assert len(s.ledger.gpu_policy) == len(d.dsum)
                for eid in d.offset:
                    assert s.index.tier[eid] & IN_GPU
                assert s.cpu_used_bytes == len(s.policy) * BB <= 5 * BB
                for j in range(8):
                    found = s.index.get(ns.ns_id, keys(1, start=j)[0])
                    if found is not None:
                        assert s.index.tier[found] & (IN_GPU | IN_CPU)
                        stored[j] = j
                    else:
                        stored.pop(j, None)
            for j in stored:
                # Reading one block may legitimately evict another (the CPU tier is the last
                # one here): what the contract promises is the bytes of whatever is served.
                lease, offsets, _, _ = await s.acquire(ns, keys(1, start=j))
                if lease:
                    assert np.array_equal(read_cpu(s, offsets[0]), block(j))
                    s.release(ns, lease)
            await settle(s)
            s.check()
        finally:
            await s.stop()

    asyncio.run(run())


def test_serve_with_the_gpu_tier_on_and_no_cuda_exits_with_the_reason(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    cmd = [sys.executable, "-m", "kvstore", "serve", "--address", f"unix:{tmp_path}/kv.sock"]
    proc = subprocess.Popen(
        [*cmd, "--cpu-capacity", "8MiB", "--gpu", "on"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "the gpu tier is on but torch sees no CUDA device" in stderr
    # Its arena has no name anywhere: nothing under /dev/shm is left behind.
    assert not list(Path("/dev/shm").glob(f"kvstore-{proc.pid}-*"))


# ----------------------------------------------------------------- the client's side of a lease
def test_a_lease_mixing_pool_and_arena_slots_verifies_each_kind() -> None:
    """A worker's lease may name pool slots (device checksums) and arena slots (xxh3) in one
    run; ``intact`` checks each with its own checksum and ends the run at the first bad one."""
    from kvstore.client._common import MappedArena
    from kvstore.client.leases import ReadLease, WriteReservation
    from kvstore.tiers.cpu import SharedMemoryArena, SlabAllocator

    arena = SharedMemoryArena(HEADER_BYTES + 4 * BB)
    alloc = SlabAllocator(arena.size_bytes, 4 * BB, back=arena.back)
    arena.slab_bytes = alloc.slab_bytes
    pool = DevicePool(HEADER_BYTES + 4 * BB, "cpu")  # stands in for the mapped pool

    class LocalSession:  # hands over slab descriptors as the daemon's session socket does
        def slab(self, uid: int) -> tuple[int, int, bool]:
            return arena.export(uid, writable=True), 4 * BB, True

    mapped = MappedArena(LocalSession())  # type: ignore[arg-type]
    try:
        offs = [HEADER_BYTES + i * BB for i in range(4)]
        assert [alloc.allocate(BB) for _ in range(4)] == offs  # backs the arena's one slab
        addr = arena.address
        ks = keys(4)  # block i is stored under ks[i]
        seeds = [checksum_seed(NS.fingerprint, k) for k in ks]
        # Write two blocks into the pool the way a worker's reservation does.
        res = WriteReservation(
            mapped,
            LAYOUT,
            1,
            offs[:2],
            seeds[:2],
            lambda c: len(c),
            lambda: None,
            pool,  # type: ignore[arg-type]
        )
        res.fill_from(torch.from_numpy(np.stack([block(0), block(1)])))
        device_sums = res.checksums()
        slots = [pool.slot(o, BB) for o in offs[:2]]
        assert device_sums == [dsum(slot, k) for slot, k in zip(slots, ks[:2], strict=True)]
        for i in (2, 3):
            arena.view[offs[i] : offs[i] + BB] = block(i).tobytes()
        lease = ReadLease(
            mapped,
            LAYOUT,
            [offs[0], addr(offs[2]), offs[1], addr(offs[3])],
            [device_sums[0], xxh(block(2), ks[2]), device_sums[1], xxh(block(3), ks[3])],
            [seeds[0], seeds[2], seeds[1], seeds[3]],
            lambda: None,
            [True, False, True, False],
            pool,  # type: ignore[arg-type]
        )
        assert lease.intact() == 4 and lease.any_on_host
        views = lease.views
        assert np.array_equal(views[1].view(torch.uint8).reshape(-1).numpy(), block(2))
        assert np.array_equal(views[2].view(torch.uint8).reshape(-1).numpy(), block(1))
        pool.slot(offs[1], BB)[5] ^= 1  # the third block of the run (a pool slot) changed
        assert lease.intact() == 2
        arena.view[offs[2] + 9] ^= 1  # and now the second (an arena slot)
        assert lease.intact() == 1
        with pytest.raises(KVStoreError, match="GPU pool slots"):
            lease.copy_into(torch.empty(4, BB, dtype=torch.uint8))
    finally:
        mapped.close()
        arena.close()


# ----------------------------------------------------------------- regressions found in review
async def test_a_key_asked_twice_balances_its_leases(store: BlockStore) -> None:
    ns = store.open_namespace(NS)
    k = keys(1)
    await put_gpu(store, ns, k, [1])
    eid = store.index.get(ns.ns_id, k[0])
    assert eid is not None
    # The store now refuses a key asked twice by acquire (a prefix chain never repeats a key;
    # a lease names distinct entries): the call fails before it pins anything.
    with pytest.raises(ValueError, match="a key is repeated"):
        await store.acquire(ns, [k[0], k[0]], gpu=False)
    assert not store.device._moving and store.active_leases == 0
    assert store.index.leases[eid] == 0
    k5 = keys(1, start=5)
    rid, offs, _ = await store.reserve(ns, k5)
    store.arena.view[offs[0] : offs[0] + BB] = block(5).tobytes()
    store.commit(ns, rid, [xxh(block(5), k5[0])])
    e2 = store.index.get(ns.ns_id, k5[0])
    assert e2 is not None
    store.device.prefetch(ns.ns_id, [k5[0]] * 2)
    await settle(store)
    assert store.index.leases[e2] == 0 and store.index.tier[e2] & IN_GPU
    store.check()


async def test_a_cancelled_read_gives_its_leases_back(store: BlockStore) -> None:
    ns = store.open_namespace(NS)
    ks = keys(2)
    await put_gpu(store, ns, ks, [1, 2])
    eids = [store.index.get(ns.ns_id, k) for k in ks]
    copy_down = store.device._copy_down
    started, go = threading.Event(), threading.Event()

    def held(*args):  # a PCIe copy still running when the client gives up
        started.set()
        go.wait(10)
        return copy_down(*args)

    store.device._copy_down = held  # type: ignore[method-assign]
    task = asyncio.create_task(store.acquire(ns, ks, gpu=False))  # a CPU reader
    assert await asyncio.to_thread(started.wait, 10)
    task.cancel()  # the client's deadline: grpc cancels the handler mid-copy
    await asyncio.sleep(0)
    go.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await settle(store)
    assert [store.index.leases[e] for e in eids if e is not None] == [0, 0]
    store.check()
    slots = await store.device.alloc(BB, 4)
    assert len(slots) == 4  # nothing stays pinned
    for slot in slots:  # handed out and never placed: given back before the books are checked
        store.ledger.gpu_unalloc(slot, BB)
    await settle(store)
    store.check()


async def test_the_disk_making_room_keeps_blocks_that_are_in_the_pool(tmp_path) -> None:
    nvme = NvmeTierConfig(path=str(tmp_path), capacity_bytes=24 * BB, direct_io=False)
    s = make_store(gpu_blocks=4, cpu_blocks=2, nvme=nvme)
    await s.start()
    try:
        ns = s.open_namespace(NS)
        ka = keys(1)
        await put_gpu(s, ns, ka, [1])
        a = s.index.get(ns.ns_id, ka[0])
        assert a is not None
        await s.device.move_down([a])
        await s.mover.flush(a)
        for i in range(40):  # CPU-only blocks go down until the disk evicts
            k = keys(1, start=10 + i)
            rid, offs, _ = await s.reserve(ns, k)
            s.arena.view[offs[0] : offs[0] + BB] = block(10 + i).tobytes()
            s.commit(ns, rid, [xxh(block(10 + i), k[0])])
            e = s.index.get(ns.ns_id, k[0])
            assert e is not None
            await s.mover.flush(e)
            if s.nvme_counters.evictions:
                break
        assert s.nvme_counters.evictions
        assert s.index.get(ns.ns_id, ka[0]) is not None and s.index.tier[a] & IN_GPU  # in the pool
        await settle(s)
        s.check()
    finally:
        await s.stop()


async def test_write_back_does_not_churn_when_the_cpu_tier_is_small() -> None:
    s = make_store(gpu_blocks=8, cpu_blocks=2, high_watermark=0.5)  # wants 4 clean, CPU holds 2
    await s.start()
    try:
        ns = s.open_namespace(NS)
        await put_gpu(s, ns, keys(8), list(range(8)))
        await asyncio.sleep(0.3)
        assert s.device.counters.demotions <= 2 and s.cpu.evictions == 0
        assert not s.device._cleaner.done()  # type: ignore[union-attr]
        await settle(s)
        s.check()
    finally:
        await s.stop()


async def test_a_reader_of_many_gpu_blocks_gets_the_whole_run_while_write_back_runs() -> None:
    s = make_store(gpu_blocks=64, cpu_blocks=128, high_watermark=0.5)
    await s.start()
    try:
        ns = s.open_namespace(NS)
        ks = keys(64)
        await put_gpu(s, ns, ks, list(range(64)))  # wakes the cleaner: the pool is all dirty
        copy_down = s.device._copy_down

        def slow(*args):
            time.sleep(0.05)
            return copy_down(*args)

        s.device._copy_down = slow  # type: ignore[method-assign]
        lease, offsets, _, _ = await s.acquire(ns, ks, gpu=False)
        assert len(offsets) == 64
        for i, off in enumerate(offsets):
            assert np.array_equal(read_cpu(s, off), block(i))
        s.release(ns, lease)
        await settle(s)
        s.check()
    finally:
        await s.stop()


async def test_the_pool_takes_a_second_block_size_after_the_first_filled_it() -> None:
    """The GPU pool shares its slabs between block sizes like the CPU tier: once one size
    filled it, another size drains the coldest slab (its blocks copied down first) instead of
    falling back to the CPU tier for good."""
    big = KVLayout(num_layers=2, num_kv_heads=1, head_dim=64, block_size=16)  # 2 x BB
    big_ns = Namespace(model="big", layout=big)
    s = make_store(gpu_blocks=4, cpu_blocks=16)  # two pool slabs of two small slots
    await s.start()
    try:
        small = s.open_namespace(NS)
        for i in range(4):
            assert await put_gpu(s, small, keys(1, start=i), [i]) == 1
        await settle(s)
        bh = s.open_namespace(big_ns)
        bkeys = list(block_hashes(big_ns.seed, list(range(16))))
        reserved = await s.reserve(bh, bkeys, gpu=True)
        assert reserved.gpu  # a pool slot, from a drained slab
        slot = s.device.pool.slot(reserved.offsets[0], big.block_bytes)  # type: ignore[union-attr]
        data = np.random.default_rng(7).integers(0, 256, big.block_bytes, dtype=np.uint8)
        slot.copy_(torch.from_numpy(data))
        raw = kernels.device_checksums([slot])[0]
        s.commit(
            bh,
            reserved.reservation_id,
            [],
            [bind_device_checksum(raw, big_ns.fingerprint, bkeys[0])],
        )
        await settle(s)
        # The small blocks of the drained slab were copied down, not lost.
        for i in range(4):
            lease, offsets, _, _ = await s.acquire(small, keys(1, start=i))
            assert lease and np.array_equal(read_cpu(s, offsets[0]), block(i))
            s.release(small, lease)
        await settle(s)
        s.check()
    finally:
        await s.stop()


async def test_a_block_deleted_while_its_copy_down_waits_for_room_leaks_no_cpu_slot() -> None:
    """Review finding: the copy down took its CPU slots, then (deleted meanwhile, the entry an
    orphan with no key) failed on the key its checksum is bound to, and the slots never went
    back: an internal error for the reader and CPU bytes lost for good."""
    s = make_store(gpu_blocks=4, cpu_blocks=16)
    await s.start()
    try:
        ns = s.open_namespace(NS)
        ks = keys(1)
        assert await put_gpu(s, ns, ks, [1]) == 1
        await settle(s)
        eid = s.index.get(ns.ns_id, ks[0])
        assert eid is not None
        used_before = s.ledger.cpu_slots.used_bytes
        room = s.device.cpu_room

        async def room_then_delete(*args, **kwargs):  # another call runs while room is made
            slots = await room(*args, **kwargs)
            s.delete(ns, ks)
            return slots

        s.device.cpu_room = room_then_delete
        assert await s.device.move_down([eid]) == 0
        s.device.cpu_room = room
        await settle(s)
        assert s.ledger.cpu_slots.used_bytes == used_before
        assert s.index.get(ns.ns_id, ks[0]) is None
        s.check()
    finally:
        await s.stop()


async def test_a_block_deleted_while_its_promotion_waits_for_room_leaks_no_pool_slot() -> None:
    """Review finding, the same going up: the pool slots made for a block deleted meanwhile
    were never given back."""
    s = make_store(gpu_blocks=4, cpu_blocks=16)
    await s.start()
    try:
        ns = s.open_namespace(NS)
        ks = keys(1)
        rid, offsets, _ = await s.reserve(ns, ks)
        s.arena.view[offsets[0] : offsets[0] + BB] = block(7).tobytes()
        s.commit(ns, rid, [xxh(block(7), ks[0])])
        eid = s.index.get(ns.ns_id, ks[0])
        assert eid is not None
        alloc = s.device.alloc

        async def alloc_then_delete(*args, **kwargs):
            slots = await alloc(*args, **kwargs)
            s.delete(ns, ks)
            return slots

        s.device.alloc = alloc_then_delete  # type: ignore[method-assign]
        assert await s.device.move_up([eid]) == []
        s.device.alloc = alloc  # type: ignore[method-assign]
        await settle(s)
        assert s.ledger.gpu_slots.used_bytes == 0
        s.check()
    finally:
        await s.stop()
