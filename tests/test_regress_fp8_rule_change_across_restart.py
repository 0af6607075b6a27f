"""Guard: a namespace's ``[[codecs]]`` rule may change between runs of the daemon while its
blocks sit on NVMe. Whatever the rule now says, a read returns the block's fp8 form (what was
stored) or a miss, never other bytes, and never a payload where a block is expected: records
written from ``cpu = "fp8"`` payloads are read back by a daemon without the rule (lossless CPU
tier, lossless NVMe default) and by one whose NVMe codec is now ``fp8+lz4``. Real store, real
shared memory, real slab file. A rule that no longer chooses a lossy codec for any tier makes
the namespace lossless again: its fp8 records are then misses, dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import SMALL_LAYOUT, random_blocks
from test_nvme_service import fp8_form

from kvstore.checksum import block_checksum
from kvstore.config import CodecRule, CpuTierConfig, DaemonConfig, GpuTierConfig, NvmeTierConfig
from kvstore.daemon.store import BlockStore
from kvstore.keys import Namespace, block_hashes

MODEL = "rule-change"
BB = SMALL_LAYOUT.block_bytes
NS = Namespace(model=MODEL, layout=SMALL_LAYOUT)
N = 4
KEYS = block_hashes(NS.seed, list(range(N * 16)))


def config(nvme: Path, cpu: str, nvme_codec: str) -> DaemonConfig:
    rule = (CodecRule(model=MODEL, cpu=cpu, nvme=nvme_codec),) if cpu or nvme_codec else ()
    return DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        cpu=CpuTierConfig(capacity_bytes=16 * BB, slab_bytes=4 * BB, prefault=False),
        nvme=NvmeTierConfig(path=str(nvme), capacity_bytes=1 << 20, direct_io=False),
        codecs=rule,
    )


async def read(store: BlockStore, handle, key: bytes) -> bytes | None:
    """What a bytes-path reader accepts (decoded where the CPU copy is a payload)."""
    lease = await store.acquire(handle, [key])
    if not lease.lease_id:
        return None
    try:
        _, data, checksum, codec = store.read_leased(handle, lease.lease_id, 0)
        if codec:
            block = store.decode_leased(handle.record, data)
            if block is None:
                return None
            data = block
        return data if block_checksum(data, NS.fingerprint, key) == checksum else None
    finally:
        store.release(handle, lease.lease_id)


async def written_down(nvme: Path, cpu: str, nvme_codec: str, blocks: torch.Tensor) -> list[bytes]:
    """A store under that rule puts ``blocks`` under ``KEYS`` over the bytes path and stops
    (writing them down); returns each block's fp8 form, what a reader must get back."""
    before = BlockStore(config(nvme, cpu, nvme_codec))
    try:
        await before.start()
        handle = before.open_namespace(NS)
        assert bool(handle.record.cpu_codec) == (cpu == "fp8")
        for i, key in enumerate(KEYS):
            block = blocks[i].view(torch.uint8).numpy().tobytes()
            checksum = block_checksum(block, NS.fingerprint, key)
            assert await before.put_block(handle, key, [block], checksum)
        await before.stop()
    finally:
        before.close()
    return [fp8_form(blocks)[i].view(torch.uint8).numpy().tobytes() for i in range(N)]


@pytest.mark.parametrize("then", [("fp8", "fp8+lz4"), ("", "fp8")])
async def test_fp8_records_read_under_a_changed_rule_are_their_fp8_form(
    tmp_path: Path, then: tuple[str, str]
) -> None:
    want = await written_down(tmp_path, "fp8", "fp8", random_blocks(SMALL_LAYOUT, N, seed=3))
    after = BlockStore(config(tmp_path, *then))
    try:
        await after.start()
        handle = after.open_namespace(NS)
        assert bool(handle.record.cpu_codec) == (then[0] == "fp8")
        for i, key in enumerate(KEYS):
            assert await read(after, handle, key) == want[i], i
        assert after.nvme_counters.checksum_failures == 0
        after.check()
        await after.stop()
    finally:
        after.close()


async def test_fp8_records_of_a_namespace_made_lossless_are_misses_and_dropped(
    tmp_path: Path,
) -> None:
    """A namespace whose rule no longer chooses a lossy codec anywhere reads exactly its
    committed bytes or a miss: the fp8 records an earlier rule wrote down are not its bytes.
    (They were served, decoded, to a namespace its operator had made lossless again.) They
    are dropped, so a put stores each block exactly again."""
    blocks = random_blocks(SMALL_LAYOUT, N, seed=3)
    await written_down(tmp_path, "fp8", "fp8", blocks)
    after = BlockStore(config(tmp_path, "", ""))
    try:
        await after.start()
        handle = after.open_namespace(NS)
        assert not after.ledger.accepts_lossy(handle.record)
        for key in KEYS:
            assert await read(after, handle, key) is None
        assert after.nvme_counters.lossy_refused == N
        assert after.nvme_counters.checksum_failures == 0  # not damage: a choice
        assert await after.lookup(handle, KEYS) == 0  # dropped
        exact = [blocks[i].view(torch.uint8).numpy().tobytes() for i in range(N)]
        for key, block in zip(KEYS, exact, strict=True):
            checksum = block_checksum(block, NS.fingerprint, key)
            assert await after.put_block(handle, key, [block], checksum)
            assert await read(after, handle, key) == block
        after.check()
        await after.stop()
    finally:
        after.close()


async def test_a_lossless_record_promoted_into_an_fp8_namespace_is_found_again_after_eviction(
    tmp_path: Path,
) -> None:
    """Regression: the first promotion of a lossless record (written before the namespace's
    ``cpu = "fp8"`` rule) gave its entry the checksum of the fp8 form, while its disk copy
    stayed the lossless record; once the CPU copy was evicted (a clean block: only the CPU
    copy goes), the next promotion asked the disk for a record of that checksum, found a
    mismatch, and dropped the block as corrupt."""
    want = await written_down(tmp_path, "", "", random_blocks(SMALL_LAYOUT, N, seed=4))
    after = BlockStore(config(tmp_path, "fp8", "fp8"))
    try:
        await after.start()
        handle = after.open_namespace(NS)
        for round_ in range(3):
            for i, key in enumerate(KEYS):
                assert await read(after, handle, key) == want[i], (round_, i)
            for key in KEYS:  # evicted: clean blocks, so only their CPU copies go
                eid = after.index.get(handle.ns_id, key)
                assert eid is not None
                after.ledger.drop_cpu_copy(eid)
            after.check()
        assert after.nvme_counters.checksum_failures == 0
        await after.stop()
    finally:
        after.close()
