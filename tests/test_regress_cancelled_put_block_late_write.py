"""Regression: a bytes-path put (``PutBlocks``) into a ``cpu = "fp8"`` namespace encodes the
block off the event loop; when its caller gave up meanwhile (its deadline, a closed stream) the
reservation was aborted and its slot freed at once, but the encoding thread still copied the
payload into the slot afterwards. The next block put there was overwritten: its readers failed
their checksum and it was lost (a miss). The thread now encodes into private memory only, and
the payload is copied into the slot on the loop once the reservation is known to be live.

Real store, real shared memory; the encoding thread is held (an event) so that the order is
the one that lost the block."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from conftest import SMALL_LAYOUT, random_blocks

from kvstore.checksum import block_checksum
from kvstore.config import CodecRule, CpuTierConfig, DaemonConfig, GpuTierConfig, LimitsConfig
from kvstore.daemon.store import BlockStore
from kvstore.errors import LeaseExpiredError
from kvstore.keys import Namespace, block_hashes
from kvstore.tiers import codecs

BB = SMALL_LAYOUT.block_bytes
PAYLOAD = codecs.fp8_payload_bytes(codecs.block_format_of(SMALL_LAYOUT))
FP8 = Namespace(model="fp8-late", layout=SMALL_LAYOUT)
OTHER = Namespace(model="fp8-late-neighbour", layout=SMALL_LAYOUT)
SLOTS = 8


def raw(i: int) -> bytes:
    return random_blocks(SMALL_LAYOUT, 1, seed=200 + i)[0].view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("gives_up", ["cancelled", "handle closed", "closed, then cancelled"])
async def test_an_abandoned_bytes_path_put_does_not_write_into_a_reused_slot(
    monkeypatch: pytest.MonkeyPatch, gives_up: str
) -> None:
    cfg = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        # Payload slots of both namespaces: the fp8 put's freed slot is the neighbour's next.
        cpu=CpuTierConfig(capacity_bytes=SLOTS * BB, slab_bytes=4 * BB, prefault=False),
        codecs=(CodecRule(model=FP8.model, cpu="fp8"), CodecRule(model=OTHER.model, cpu="fp8")),
        limits=LimitsConfig(max_pinned_share=1.0),  # the neighbour may reserve every slot
    )
    store = BlockStore(cfg)
    try:
        writer = store.open_namespace(FP8)
        neighbour = store.open_namespace(OTHER)
        started, go, ended = threading.Event(), threading.Event(), threading.Event()
        encode = codecs.fp8_encode

        def held_encode(data, fmt, out):  # type: ignore[no-untyped-def]
            if threading.current_thread() is threading.main_thread():
                return encode(data, fmt, out)
            started.set()
            go.wait(30)
            try:
                return encode(data, fmt, out)
            finally:
                ended.set()

        monkeypatch.setattr(codecs, "fp8_encode", held_encode)
        key = block_hashes(FP8.seed, list(range(16)))[0]
        block = raw(0)
        put = asyncio.create_task(
            store.put_block(writer, key, [block], block_checksum(block, FP8.fingerprint, key))
        )
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, started.wait, 30)
        if gives_up == "cancelled":
            put.cancel()  # its deadline
            with pytest.raises(asyncio.CancelledError):
                await put
        elif gives_up == "handle closed":
            store.close_handle(writer)  # its client went away: the reservation is reclaimed
        else:
            # Both: the put ends with its cancellation, not with an error of aborting a
            # reservation that is gone already (which took its place).
            store.close_handle(writer)
            put.cancel()
            with pytest.raises(asyncio.CancelledError):
                await put
        # The neighbour fills every free payload slot (the writer's among them), encoding
        # on the loop's thread (not held).
        free = store.allocator.free_slots(PAYLOAD)
        keys = block_hashes(OTHER.seed, list(range(16 * free)))
        reserved = await store.reserve(neighbour, keys)
        assert reserved.reservation_id and -1 not in reserved.offsets
        fmt = codecs.block_format_of(SMALL_LAYOUT)
        sums, psums = [], []
        for i, (offset, k) in enumerate(zip(reserved.offsets, keys, strict=True)):
            slot = store.arena.view[offset : offset + PAYLOAD]
            d, p = codecs.encode_payload(raw(1 + i), fmt, slot, OTHER.fingerprint, k)
            sums.append(d)
            psums.append(p)
        assert store.commit(
            neighbour, reserved.reservation_id, sums, (), codecs.CODEC_FP8, PAYLOAD, psums
        ) == len(keys)
        go.set()  # the abandoned encoding ends now
        assert await loop.run_in_executor(None, ended.wait, 30)
        if gives_up == "handle closed":
            with pytest.raises(LeaseExpiredError):
                await put  # nothing stored
        await asyncio.sleep(0)  # its end reaches the loop
        lease = await store.acquire(neighbour, keys)
        try:
            assert lease.payload_checksums is not None and len(lease.offsets) == len(keys)
            for i, k in enumerate(keys):
                _, payload, _, _ = store.read_leased(neighbour, lease.lease_id, i)
                own = block_checksum(payload, OTHER.fingerprint, k)
                assert own == lease.payload_checksums[i], f"neighbour block {i} was overwritten"
        finally:
            store.release(neighbour, lease.lease_id)
        store.check()
    finally:
        store.close()
