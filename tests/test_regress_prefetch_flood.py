"""Prefetch was neither bounded nor rate-limited: every Prefetch call spawned a task holding
its whole run, and a run's blocks already queued by an earlier call (but not yet being read)
were queued again. A client repeating one Prefetch of a long disk-only prefix while the disk
was slow piled up tasks and memory without bound, and ``keys_per_s`` did not apply. Now a block
is queued for prefetch once whoever asks again, and prefetch spends keys like lookup does.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvstore import KVLayout, Namespace, block_hashes
from kvstore.checksum import block_checksum
from kvstore.config import (
    CpuTierConfig,
    DaemonConfig,
    GpuTierConfig,
    NvmeTierConfig,
    Quota,
    TenantQuota,
)
from kvstore.daemon.store import BlockStore, Handle
from kvstore.errors import CapacityError
from kvstore.index import IN_CPU, IN_GPU
from kvstore.tiers.cpu import HEADER_BYTES
from kvstore.tiers.gpu import DevicePool

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB blocks
NS = Namespace(model="m", layout=LAYOUT, tenant="t")


async def until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(4000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


async def disk_only_store(tmp_path, n: int, quota: Quota | None = None):  # type: ignore[no-untyped-def]
    cfg = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        cpu=CpuTierConfig(capacity_bytes=2 * n * 4096, slab_bytes=16 * 4096, prefault=False),
        nvme=NvmeTierConfig(
            path=str(tmp_path), capacity_bytes=4 << 20, write_through=True, io_threads=1
        ),
        tenants=(TenantQuota(name="t", tenant=quota),) if quota is not None else (),
    )
    s = BlockStore(cfg)
    await s.start()
    h = s.open_namespace(NS)
    ks = block_hashes(NS.seed, list(range(n * 16)))
    await put(s, h, ks)
    await until(lambda: s.mover.idle, "write-through")
    for k in ks:  # on disk only now
        s.ledger.drop_cpu_copy(s.index.get(h.ns_id, k))
    return s, h, ks


async def put(s: BlockStore, h: Handle, ks: list[bytes]) -> None:
    for i in range(0, len(ks), 16):
        part = ks[i : i + 16]
        rid, offsets, _ = await s.reserve(h, part)
        sums = []
        for off, k in zip(offsets, part, strict=True):
            data = k * (LAYOUT.block_bytes // len(k))
            s.arena.view[off : off + len(data)] = data
            sums.append(block_checksum(data, NS.fingerprint, k))
        s.commit(h, rid, sums)


async def test_repeated_prefetches_of_one_run_queue_each_block_once(tmp_path) -> None:
    s, h, ks = await disk_only_store(tmp_path, 32)
    gate = threading.Event()
    try:
        assert s.nvme is not None
        blocker = s.nvme._read_pool.submit(gate.wait)  # a slow disk: nothing completes
        queued = [s.mover.prefetch(h.ns_id, ks) for _ in range(200)]
        assert queued[0] == 32
        assert sum(queued) == 32, f"{sum(queued)} blocks queued for a run of 32"
        assert len(s.mover._tasks) == 1
        gate.set()
        blocker.result()
        await until(lambda: s.mover.idle, "the prefetch")
        assert all(s.index.tier[s.index.get(h.ns_id, k)] & IN_CPU for k in ks)
        # Done: the run may be queued again (nothing is left out for good).
        for k in ks:
            s.ledger.drop_cpu_copy(s.index.get(h.ns_id, k))
        assert s.mover.prefetch(h.ns_id, ks) == 32
        await until(lambda: s.mover.idle, "the second prefetch")
        s.check()
    finally:
        gate.set()
        await s.stop()


async def test_prefetch_spends_the_tenants_keys_per_second(tmp_path) -> None:
    s, h, ks = await disk_only_store(tmp_path, 8, Quota(keys_per_s=0.001, keys_burst=16))
    try:
        s.mover.prefetch(h.ns_id, ks)  # the put spent 8 keys of the burst, this the rest
        with pytest.raises(CapacityError, match="keys_per_s"):
            s.mover.prefetch(h.ns_id, ks)
        await until(lambda: s.mover.idle, "the prefetch")
        s.check()
    finally:
        await s.stop()


def gpu_store(quota: Quota | None = None) -> BlockStore:
    bb = LAYOUT.block_bytes
    cfg = DaemonConfig(
        gpu=GpuTierConfig(enabled="off", capacity_bytes=64 * bb, slab_bytes=16 * bb),
        cpu=CpuTierConfig(capacity_bytes=64 * bb, slab_bytes=16 * bb, prefault=False),
        tenants=(TenantQuota(name="t", tenant=quota),) if quota is not None else (),
    )
    return BlockStore(cfg, gpu_pool=DevicePool(64 * bb + HEADER_BYTES, "cpu"))


async def test_gpu_prefetches_of_one_run_queue_each_block_once() -> None:
    """The same for prefetches into the GPU pool (a pool on a CPU device here)."""
    s = gpu_store()
    await s.start()
    try:
        h = s.open_namespace(NS)
        ks = block_hashes(NS.seed, list(range(64 * 16)))
        await put(s, h, ks)
        queued = [s.device.prefetch(h.ns_id, ks) for _ in range(100)]  # nothing ran yet
        assert sum(queued) == 64, f"{sum(queued)} blocks queued for a run of 64"
        assert len(s.device._tasks) == 1
        await until(lambda: not s.device._tasks and not s.device._moving, "the prefetch")
        assert all(s.index.tier[s.index.get(h.ns_id, k)] & IN_GPU for k in ks)
        s.check()
    finally:
        await s.stop()


async def test_gpu_prefetch_spends_the_tenants_keys_per_second() -> None:
    s = gpu_store(Quota(keys_per_s=0.001, keys_burst=16))
    await s.start()
    try:
        h = s.open_namespace(NS)
        ks = block_hashes(NS.seed, list(range(8 * 16)))
        await put(s, h, ks)  # 8 keys of the burst
        s.device.prefetch(h.ns_id, ks)  # the other 8
        with pytest.raises(CapacityError, match="keys_per_s"):
            s.device.prefetch(h.ns_id, ks)
        await until(lambda: not s.device._tasks and not s.device._moving, "the prefetch")
        s.check()
    finally:
        await s.stop()
