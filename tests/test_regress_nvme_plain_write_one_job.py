"""A plain (``durable=False``) NVMe write cost three hops between the event loop and the IO
threads (payload, then header, each a ``run_in_executor``), and the write-back above it a
fourth (``asyncio.to_thread`` of the checksum the tier verifies again): most of the daemon's
CPU per block written down. A plain write is now one job (verify, payload, header, in that
order); a durable one keeps its barriers between payload and header. Torn and failed writes
keep their rules: a header that may have landed is tombstoned, a block that no longer matches
its checksum writes nothing, and write-back still refuses a scribbled CPU copy.
"""

from __future__ import annotations

import asyncio
import errno

import pytest
from nvme_blocks import (
    LAYOUT,
    NS,
    N,
    Recorder,
    commit_blocks,
    data_of,
    header_kind,
    key,
    open_tier,
    reopen_keys,
    write,
    write_back_store,
)

import kvstore.tiers.nvme.recordio as recordio
from kvstore import Namespace
from kvstore.checksum import block_checksum
from kvstore.index import IN_NVME
from kvstore.tiers.nvme import NvmeIOError, NvmeTier
from kvstore.tiers.nvme.ondisk import FILE_NAME, KIND_TOMBSTONE, PAGE


async def read_ok(tier: NvmeTier, slot: int, i: int) -> bool:
    data = data_of(i)
    out = bytearray(N)
    ok = await tier.read_into(slot, key(i), NS, block_checksum(data, NS, key(i)), out)
    return ok and bytes(out) == data


async def test_a_plain_write_is_one_job_payload_then_header(tmp_path, monkeypatch) -> None:
    tier = await open_tier(tmp_path / "nvme")
    try:
        await write(tier, 0, durable=False)  # carves the slab
        rec = Recorder(tier, monkeypatch)
        slot = await write(tier, 1, durable=False)
        assert len(rec.jobs) == 1
        assert rec.writes == [(slot + PAGE, N), (slot, PAGE)]  # the header last
        rec.clear()
        slot2 = await write(tier, 2, durable=True)  # payload, barrier, header, barrier
        assert len(rec.jobs) == 2
        assert rec.writes == [(slot2 + PAGE, N), (slot2, PAGE)]
        assert tier.stats()["flushes"] >= 2
        assert await read_ok(tier, slot, 1) and await read_ok(tier, slot2, 2)
    finally:
        await tier.close()
    assert await reopen_keys(tmp_path / "nvme") == [key(0), key(1), key(2)]


async def test_a_plain_write_whose_header_write_fails_tombstones_its_slot(
    tmp_path, monkeypatch
) -> None:
    tier = await open_tier(tmp_path / "nvme")
    try:
        await write(tier, 0, durable=False)
        write_at = recordio.RecordIO.write_at
        failed: list[int] = []

        def fail_once(self, offset, data):  # type: ignore[no-untyped-def]
            if not failed:
                failed.append(offset)
                write_at(self, offset, data)  # it landed, and still reported an error
                raise OSError(errno.EIO, "injected")
            return write_at(self, offset, data)

        monkeypatch.setattr(recordio.RecordIO, "write_at", fail_once)
        slot = tier.allocate(N)
        assert slot is not None
        data = data_of(1)
        with pytest.raises(NvmeIOError):
            await tier.write(
                slot, key(1), NS, data, block_checksum(data, NS, key(1)), durable=False
            )
        assert failed == [slot]
        await tier.drain()
        assert tier.stats()["blocks"] == 1 and tier.stats()["reserved_slots"] == 0
        # The header that landed is gone.
        assert header_kind(tmp_path / "nvme" / FILE_NAME, slot) == KIND_TOMBSTONE
    finally:
        await tier.close()
    assert await reopen_keys(tmp_path / "nvme") == [key(0)]


async def test_a_plain_write_of_a_block_off_its_checksum_writes_nothing(
    tmp_path, monkeypatch
) -> None:
    tier = await open_tier(tmp_path / "nvme")
    try:
        await write(tier, 0, durable=False)
        rec = Recorder(tier, monkeypatch)
        slot = tier.allocate(N)
        assert slot is not None
        data = data_of(1)
        with pytest.raises(ValueError, match="does not match its checksum"):
            await tier.write(
                slot, key(1), NS, data, block_checksum(data, NS, key(1)) ^ 1, durable=False
            )
        await tier.drain()
        assert rec.writes == []  # no payload, no header, no tombstone
        assert tier.stats()["blocks"] == 1 and tier.stats()["reserved_slots"] == 0
        assert tier.allocate(N) is not None  # the slot went back
    finally:
        await tier.close()


NSP = Namespace(model="m", layout=LAYOUT)


async def test_write_back_refuses_a_cpu_copy_scribbled_on(tmp_path) -> None:
    """The tier's own verification is now write-back's only one for a raw block: a CPU copy
    changed after it committed is still never written down, and the block is forgotten."""
    async with write_back_store(tmp_path) as s:
        h, keys, offsets, eids = await commit_blocks(s, NSP, 4)
        s.arena.view[offsets[2] + 100] ^= 0xFF  # a client scribbles on a committed slot
        failures = s.ledger.cpu.checksum_failures
        results = await asyncio.gather(*(s.mover.flush(e) for e in eids))
        assert results == [True, True, False, True]
        assert s.ledger.cpu.checksum_failures == failures + 1
        assert s.index.get(h.ns_id, keys[2]) is None  # forgotten, not served
        assert [bool(s.index.tier[e] & IN_NVME) for e in (eids[0], eids[1], eids[3])] == [True] * 3
        assert s.ledger.nvme is not None
        await s.ledger.nvme.drain()
        st = s.ledger.nvme.stats()
        assert st["blocks"] == 3 and st["reserved_slots"] == 0
        s.check()
