"""Each tombstone was its own IO job (a hop from the event loop to a write thread and back),
and write-back frees a slot per block it writes down. Tombstones asked for in one turn of the
loop are now written by one job; each still lands, or fails and is retried, on its own, and is
flushed before its slot takes new bytes.
"""

from __future__ import annotations

import errno

from nvme_blocks import Recorder, header_kind, key, open_tier, reopen_keys, write

import kvstore.tiers.nvme.recordio as recordio
from kvstore.tiers.nvme.ondisk import FILE_NAME, KIND_TOMBSTONE


async def test_tombstones_freed_together_are_one_job_and_each_lands(tmp_path, monkeypatch):
    tier = await open_tier(tmp_path / "nvme")
    try:
        slots = [await write(tier, i) for i in range(10)]
        rec = Recorder(tier, monkeypatch)
        for s in slots[:8]:
            tier.free(s)
        await tier.drain()
        assert len(rec.jobs) == 1
        path = tmp_path / "nvme" / FILE_NAME
        assert [header_kind(path, s) for s in slots[:8]] == [KIND_TOMBSTONE] * 8
    finally:
        await tier.close()
    assert await reopen_keys(tmp_path / "nvme") == [key(8), key(9)]


async def test_a_failed_tombstone_of_a_batch_is_retried_before_its_slot_is_reused(
    tmp_path, monkeypatch
):
    tier = await open_tier(tmp_path / "nvme")
    try:
        slots = [await write(tier, i) for i in range(6)]
        bad = slots[2]
        write_at = recordio.RecordIO.write_at

        def failing(self, offset, data):  # type: ignore[no-untyped-def]
            if offset == bad:
                raise OSError(errno.EIO, "injected")
            return write_at(self, offset, data)

        monkeypatch.setattr(recordio.RecordIO, "write_at", failing)
        for s in slots[:4]:
            tier.free(s)
        await tier.drain()
        path = tmp_path / "nvme" / FILE_NAME
        assert tier.stats()["io_errors"] == 1
        kinds = [header_kind(path, s) for s in slots[:4]]
        assert kinds == [KIND_TOMBSTONE, KIND_TOMBSTONE, 1, KIND_TOMBSTONE]  # 1: still a record
        assert set(tier._tombs.failed) == {bad}
        monkeypatch.setattr(recordio.RecordIO, "write_at", write_at)  # the disk recovers
        reused = [await write(tier, 100 + i) for i in range(4)]
        assert bad in reused and not tier._tombs.failed
    finally:
        await tier.close()
    assert await reopen_keys(tmp_path / "nvme") == sorted(
        [key(4), key(5)] + [key(100 + i) for i in range(4)]
    )
