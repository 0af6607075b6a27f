"""The GPU pool is mapped only by callers of every tenant (it is one undivided allocation), yet
any caller could ask Reserve and Acquire for pool slots (``gpu=True``). A tenant's client that
cannot even map the pool could then take pool slots with reservations it never commits (each
held a reservation TTL and a quarantine), lease every block in the pool, which no pinned
share bounds, and prefetch its blocks into the pool: the GPU workers' blocks were pushed out
of the pool. Such a caller now gets CPU slots, CPU copies and CPU prefetches, as a client
without the pool does.
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from kvstore import KVLayout, Namespace, block_hashes, kernels
from kvstore.checksum import bind_device_checksum, block_checksum
from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig
from kvstore.daemon.auth import Principal
from kvstore.daemon.store import BlockStore
from kvstore.index import IN_GPU
from kvstore.tiers.cpu import HEADER_BYTES
from kvstore.tiers.gpu import DevicePool

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB blocks
BB = LAYOUT.block_bytes
NS = Namespace(model="m", layout=LAYOUT, tenant="t")
TENANT_USER = Principal("uid 1000", frozenset({"t"}), frozenset({"t"}))
EVERY_TENANT = Principal("owner", operator=True)


def make_store() -> BlockStore:
    cfg = DaemonConfig(
        gpu=GpuTierConfig(enabled="off", capacity_bytes=8 * BB, slab_bytes=2 * BB),
        cpu=CpuTierConfig(capacity_bytes=16 * BB, slab_bytes=2 * BB, prefault=False),
    )
    return BlockStore(cfg, gpu_pool=DevicePool(8 * BB + HEADER_BYTES, "cpu"))


async def test_a_caller_that_cannot_map_the_pool_gets_no_pool_slots() -> None:
    s = make_store()
    await s.start()
    try:
        worker = s.open_namespace(NS)
        worker.principal = EVERY_TENANT
        user = s.open_namespace(NS)
        user.principal = TENANT_USER
        ks = list(block_hashes(NS.seed, list(range(4 * 16))))
        # A worker that maps the pool writes two blocks there.
        rid, offsets, on_gpu = await s.reserve(worker, ks[:2], gpu=True)
        assert on_gpu
        sums = []
        assert s.device.pool is not None
        for i, off in enumerate(offsets):
            slot = s.device.pool.slot(off, BB)
            slot.copy_(torch.full((BB,), i + 1, dtype=torch.uint8))
            dsum = kernels.device_checksums([slot])[0]
            sums.append(bind_device_checksum(dsum, NS.fingerprint, ks[i]))
        s.commit(worker, rid, [], sums)
        # The tenant's client asks for pool slots and pool copies: it gets the CPU tier's.
        rid, offsets, on_gpu = await s.reserve(user, ks[2:], gpu=True)
        assert not on_gpu, "pool slots for a caller that cannot map the pool"
        for i, off in enumerate(offsets):
            data = bytes([9 + i]) * BB
            s.arena.view[off : off + BB] = data
            offsets[i] = block_checksum(data, NS.fingerprint, ks[2 + i])
        s.commit(user, rid, offsets)
        lease, offsets, sums, served_on_gpu = await s.acquire(user, ks, gpu=True)
        assert served_on_gpu == [False] * 4, "pool leases for a caller that cannot map it"
        for i, (off, checksum) in enumerate(zip(offsets, sums, strict=True)):
            data = np.frombuffer(s.arena.view[off : off + BB], dtype=np.uint8)
            assert block_checksum(data, NS.fingerprint, ks[i]) == checksum
        s.release(user, lease)
        # The worker still reads from the pool.
        lease, _, _, served_on_gpu = await s.acquire(worker, ks[:2], gpu=True)
        assert served_on_gpu == [True, True]
        s.release(worker, lease)
        s.check()
    finally:
        await s.stop()


async def test_a_caller_that_cannot_map_the_pool_prefetches_into_the_cpu_tier() -> None:
    s = make_store()
    await s.start()
    try:
        user = s.open_namespace(NS)
        user.principal = TENANT_USER
        ks = list(block_hashes(NS.seed, list(range(2 * 16))))
        rid, offsets, _ = await s.reserve(user, ks)
        sums = []
        for i, off in enumerate(offsets):
            data = bytes([i + 1]) * BB
            s.arena.view[off : off + BB] = data
            sums.append(block_checksum(data, NS.fingerprint, ks[i]))
        s.commit(user, rid, sums)
        s.prefetch(user, ks, gpu=True)
        for _ in range(200):
            if not s.device._tasks and not s.device._moving:
                break
            await asyncio.sleep(0.01)
        assert not any(s.index.tier[s.index.get(user.ns_id, k)] & IN_GPU for k in ks), (
            "a caller that cannot map the pool moved its blocks into it"
        )
        worker = s.open_namespace(NS)
        worker.principal = EVERY_TENANT
        assert s.prefetch(worker, ks, gpu=True) == 2  # a worker's prefetch still does
        s.check()
    finally:
        await s.stop()
