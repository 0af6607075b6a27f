"""A tenant's ``quota_nvme`` was checked against the blocks already on disk only: write-back
writes a batch of blocks at once, each checked "room for one more" before any of them landed,
so a batch took a tenant past its quota by up to the batch (a flaky overshoot in
``test_a_tenant_at_its_nvme_quota_drops_its_own_disk_blocks`` under load). Writes in flight
now count against the quota too.
"""

from __future__ import annotations

import asyncio

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
from kvstore.daemon.store import BlockStore

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB blocks
BB = LAYOUT.block_bytes
NS = Namespace(model="m", layout=LAYOUT, tenant="t")


async def test_concurrent_write_backs_never_take_a_tenant_past_quota_nvme(tmp_path) -> None:
    cfg = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        # high_watermark 1: no background write-back; the test writes the blocks down itself.
        cpu=CpuTierConfig(
            capacity_bytes=16 * BB, slab_bytes=16 * BB, prefault=False, high_watermark=1.0
        ),
        nvme=NvmeTierConfig(path=str(tmp_path), capacity_bytes=1 << 20),
        tenants=(TenantQuota(name="t", tenant=Quota(nvme_bytes=4 * BB)),),
    )
    s = BlockStore(cfg)
    await s.start()
    try:
        h = s.open_namespace(NS)
        keys = list(block_hashes(NS.seed, list(range(8 * 16))))
        rid, offsets, _ = await s.reserve(h, keys)
        sums = []
        for off, k in zip(offsets, keys, strict=True):
            data = k * (BB // len(k))
            s.arena.view[off : off + BB] = data
            sums.append(block_checksum(data, NS.fingerprint, k))
        s.commit(h, rid, sums)
        eids = [s.index.get(h.ns_id, k) for k in keys]
        assert all(e is not None for e in eids)
        results = await asyncio.gather(*(s.mover.flush(e) for e in eids))  # one batch
        assert h.record.owner.nvme_bytes <= 4 * BB, (
            f"{h.record.owner.nvme_bytes // BB} blocks on disk, quota_nvme 4"
        )
        assert sum(results) == 4  # the others stay in memory (their own disk blocks all busy)
        s.check()
    finally:
        await s.stop()
