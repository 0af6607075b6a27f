"""A tenant's ``quota_nvme`` was checked against the blocks already on disk only: write-back
writes a batch of blocks at once, each checked "room for one more" before any of them landed,
so a batch took a tenant past its quota by up to the batch (a flaky overshoot in
``test_a_tenant_at_its_nvme_quota_drops_its_own_disk_blocks`` under load). Writes in flight
now count against the quota too.
"""

from __future__ import annotations

import asyncio

from nvme_blocks import BB, LAYOUT, commit_blocks, write_back_store

from kvstore import Namespace
from kvstore.config import Quota, TenantQuota

NS = Namespace(model="m", layout=LAYOUT, tenant="t")


async def test_concurrent_write_backs_never_take_a_tenant_past_quota_nvme(tmp_path) -> None:
    quota = (TenantQuota(name="t", tenant=Quota(nvme_bytes=4 * BB)),)
    async with write_back_store(tmp_path, tenants=quota) as s:
        h, _keys, _offsets, eids = await commit_blocks(s, NS, 8)
        results = await asyncio.gather(*(s.mover.flush(e) for e in eids))  # one batch
        assert h.record.owner.nvme_bytes <= 4 * BB, (
            f"{h.record.owner.nvme_bytes // BB} blocks on disk, quota_nvme 4"
        )
        assert sum(results) == 4  # the others stay in memory (their own disk blocks all busy)
        s.check()
