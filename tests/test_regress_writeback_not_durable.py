"""Regression: every block written down to the NVMe tier (write-back, write-through) was
written durably, two fdatasync barriers each, though only durable puts promise to survive a
power loss (docs/operations.md, "Durability modes"). In a trace replay with a CPU and an NVMe
tier that made the daemon spend most of its time on barriers. A write-back is now a plain
write (a process crash loses nothing); a durable put still writes durably."""

from __future__ import annotations

import dataclasses

from test_store import NS, Clock, checksum, disk_store, keys, put, wait_idle

from kvstore.daemon.store import BlockStore


async def test_written_through_blocks_are_not_fdatasynced(tmp_path) -> None:
    s = await disk_store(tmp_path, cpu_bytes=8 * 4096)
    try:
        h = s.open_namespace(NS)
        await put(s, h, keys(4))
        await wait_idle(s)
        stats = s.nvme.stats()
        assert stats["writes"] == 4  # written through to disk
        assert stats["durable_writes"] == 0 and stats["syncs"] == 0
        s.check()
    finally:
        await s.stop()


async def test_a_durable_puts_blocks_are_still_written_durably(tmp_path) -> None:
    plain = await disk_store(tmp_path / "a", cpu_bytes=8 * 4096)
    await plain.stop()
    cfg = dataclasses.replace(
        plain.config,
        nvme=dataclasses.replace(
            plain.config.nvme, path=str(tmp_path / "b"), write_through=False, durable_puts=True
        ),
    )
    s = BlockStore(cfg, clock=Clock())
    await s.start()
    try:
        h = s.open_namespace(NS)
        ks = keys(3)
        rid, offsets, _ = await s.reserve(h, ks)
        sums = []
        for off, k in zip(offsets, ks, strict=True):
            data = bytes([7]) * h.record.block_bytes
            s.arena.view[off : off + len(data)] = data
            sums.append(checksum(data, k))
        assert await s.commit_durably(h, rid, sums) == 3
        stats = s.nvme.stats()
        assert stats["durable_writes"] == 3 and stats["writes"] == 3
        s.check()
    finally:
        await s.stop()
