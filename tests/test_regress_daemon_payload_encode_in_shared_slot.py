"""Regression: the daemon encoded (and read) fp8 payloads of a ``cpu = "fp8"`` namespace
straight into the shared arena slot and took the checksums it commits from that slot. The slot
is shared memory: a write that lands in it meanwhile (a stalled writer's late copy into a slot
reused after its reservation expired, which a ``pin_grace_s`` shortens; any client allowed to
write the tenant's slabs) was then vouched for by the daemon, and every reader accepted another
block's bytes under the key, verified. The daemon now encodes and hashes in private memory and
copies into the slot after, as a client's put does (``kvstore.client.payloads``): a write into
the slot before that copy is overwritten, one after it fails the readers' checks (a miss).

Paths: a bytes-path put (``PutBlocks``: the daemon encodes), the promotion of a lossless NVMe
record into an fp8 namespace (the daemon encodes), and the promotion of an fp8 record (the
payload is read from disk and its checksum taken). The late write is injected at the moment the
daemon works on the slot (a real store, real shared memory, real slab files)."""

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
from kvstore.tiers import codecs
from kvstore.tiers.codecs import block_format_of

MODEL = "fp8-cpu-model"
BB = SMALL_LAYOUT.block_bytes
FMT = block_format_of(SMALL_LAYOUT)
PAYLOAD = codecs.fp8_payload_bytes(FMT)
NS = Namespace(model=MODEL, layout=SMALL_LAYOUT)
KEYS = block_hashes(NS.seed, list(range(4 * 16)))


def config(nvme: Path | None, rule: bool = True, nvme_codec: str = "fp8") -> DaemonConfig:
    return DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        cpu=CpuTierConfig(capacity_bytes=16 * BB, slab_bytes=4 * BB, prefault=False),
        nvme=NvmeTierConfig(path=str(nvme), capacity_bytes=1 << 20, direct_io=False)
        if nvme is not None
        else NvmeTierConfig(),
        codecs=(CodecRule(model=MODEL, cpu="fp8", nvme=nvme_codec),) if rule else (),
    )


def raw(block: torch.Tensor) -> bytes:
    return block.view(torch.uint8).numpy().tobytes()


def forged_payload() -> bytes:
    """A valid fp8 payload of a block that is not the one being stored."""
    out = memoryview(bytearray(PAYLOAD))
    codecs.fp8_encode(memoryview(raw(random_blocks(SMALL_LAYOUT, 1, seed=99)[0])), FMT, out)
    return bytes(out)


async def read_back(store: BlockStore, handle, key: bytes) -> bytes | None:
    """What a reader accepts for ``key``; None: a miss. A paged load (``scatter_fp8_payloads``)
    checks only the payload against its checksum and decodes it in the kernel; the bytes path
    and a plain get check the decoded block against its own checksum too: what passes either
    is returned (both must agree)."""
    lease = await store.acquire(handle, [key])
    if not lease.lease_id:
        return None
    try:
        _, payload, checksum, codec = store.read_leased(handle, lease.lease_id, 0)
        assert codec == codecs.CODEC_FP8 and lease.payload_checksums is not None
        block = store.decode_leased(handle.record, payload)
        paged = block_checksum(payload, NS.fingerprint, key) == lease.payload_checksums[0]
        plain = block is not None and block_checksum(block, NS.fingerprint, key) == checksum
        if not paged and not plain:
            return None
        assert block is not None
        return block
    finally:
        store.release(handle, lease.lease_id)


def strays_into(store: BlockStore, monkeypatch: pytest.MonkeyPatch, slots: list[int]) -> None:
    """Every new CPU slot the store takes is noted in ``slots`` (where a late write will land)."""
    alloc = store.cpu_room.alloc_cpu

    async def noting(*args, **kwargs):
        got = await alloc(*args, **kwargs)
        slots.extend(got)
        return got

    monkeypatch.setattr(store.cpu_room, "alloc_cpu", noting)


async def test_a_late_write_during_a_bytes_path_put_cannot_pass_for_the_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = BlockStore(config(None))
    try:
        handle = store.open_namespace(NS)
        blocks = random_blocks(SMALL_LAYOUT, 1, seed=1)
        block = raw(blocks[0])
        forged = forged_payload()
        slots: list[int] = []
        strays_into(store, monkeypatch, slots)
        encode = codecs.fp8_encode

        def encode_then_a_late_write_lands(data, fmt, out):  # type: ignore[no-untyped-def]
            n = encode(data, fmt, out)
            for offset in slots:  # the put's slot, written by someone else right now
                store.arena.view[offset : offset + PAYLOAD] = forged
            return n

        monkeypatch.setattr(codecs, "fp8_encode", encode_then_a_late_write_lands)
        checksum = block_checksum(block, NS.fingerprint, KEYS[0])
        await store.put_block(handle, KEYS[0], [block], checksum)
        monkeypatch.undo()
        assert slots
        got = await read_back(store, handle, KEYS[0])
        want = raw(fp8_form(blocks)[0])
        assert got is None or got == want, "another block's bytes were served under the key"
        store.check()
    finally:
        store.close()


async def _on_disk(nvme: Path, rule: bool, nvme_codec: str, block: bytes) -> None:
    """A store that writes ``block`` under ``KEYS[0]`` and stops (writing it down)."""
    store = BlockStore(config(nvme, rule, nvme_codec))
    try:
        await store.start()
        handle = store.open_namespace(NS)
        checksum = block_checksum(block, NS.fingerprint, KEYS[0])
        assert await store.put_block(handle, KEYS[0], [block], checksum)
        await store.stop()
    finally:
        store.close()


@pytest.mark.parametrize(
    "written_by",
    [
        "lossless",  # before the rule: the promotion encodes the block (the daemon encodes)
        "fp8",  # under the rule: the promotion reads the payload and takes its checksum
    ],
)
async def test_a_late_write_during_a_promotion_cannot_pass_for_the_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written_by: str
) -> None:
    blocks = random_blocks(SMALL_LAYOUT, 1, seed=2)
    block = raw(blocks[0])
    if written_by == "lossless":
        await _on_disk(tmp_path, False, "none", block)
    else:
        await _on_disk(tmp_path, True, "fp8", block)
    store = BlockStore(config(tmp_path))
    try:
        await store.start()
        handle = store.open_namespace(NS)
        assert store.nvme is not None and store.nvme_counters is not None
        forged = forged_payload()
        slots: list[int] = []
        strays_into(store, monkeypatch, slots)

        def land() -> None:
            for offset in slots:
                store.arena.view[offset : offset + PAYLOAD] = forged

        if written_by == "lossless":
            encode = codecs.fp8_encode

            def encode_then_land(data, fmt, out):  # type: ignore[no-untyped-def]
                n = encode(data, fmt, out)
                land()
                return n

            monkeypatch.setattr(codecs, "fp8_encode", encode_then_land)
        else:
            from kvstore.tiers.nvme import recordio

            checksum_of = recordio.block_checksum

            def land_then_checksum(data, namespace, key):  # type: ignore[no-untyped-def]
                land()
                return checksum_of(data, namespace, key)

            monkeypatch.setattr(recordio, "block_checksum", land_then_checksum)
        got = await read_back(store, handle, KEYS[0])
        monkeypatch.undo()
        assert slots, "the block was not promoted"
        want = raw(fp8_form(blocks)[0])
        assert got is None or got == want, "another block's bytes were served under the key"
        assert got == want  # the late write came before the daemon's copy: overwritten
        store.check()
        await store.stop()
    finally:
        store.close()
