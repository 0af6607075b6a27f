"""Regression: a read of a promotion whose caller gave up (an Acquire past its deadline, a
client gone) kept running in the NVMe tier's IO thread, writing the record into its CPU slot,
but the promotion gave the slot back to the pool at once. The next block put there was then
overwritten by the stale read: its readers failed their checksum (a miss, counted) and the
block was lost. Any reader could do it to the blocks of a tenant it may read (a shared one
too): acquire blocks that are on disk with a short deadline, again and again. A cancelled
promotion now gives its slots back only once its reads have ended.

Real store, real shared memory, real slab file; the read is held in its IO thread (an event)
so that the order is the one that lost the block."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from conftest import SMALL_LAYOUT, random_blocks

from kvstore.checksum import block_checksum
from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig, NvmeTierConfig
from kvstore.daemon.store import BlockStore
from kvstore.keys import Namespace, block_hashes

BB = SMALL_LAYOUT.block_bytes
SLOTS = 8
NS = Namespace(model="late-read", layout=SMALL_LAYOUT)
KEYS = block_hashes(NS.seed, list(range((1 + SLOTS) * 16)))


def config(nvme: Path) -> DaemonConfig:
    return DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        cpu=CpuTierConfig(capacity_bytes=SLOTS * BB, slab_bytes=4 * BB, prefault=False),
        nvme=NvmeTierConfig(path=str(nvme), capacity_bytes=1 << 20, direct_io=False),
    )


def raw(i: int) -> bytes:
    return random_blocks(SMALL_LAYOUT, 1, seed=100 + i)[0].view(torch.uint8).numpy().tobytes()


async def put(store: BlockStore, handle, keys: list[bytes], first: int) -> None:
    """A client's put: copy into the reserved slots, checksums of what it copied."""
    reserved = await store.reserve(handle, keys)
    sums = []
    for j, offset in enumerate(reserved.offsets):
        block = raw(first + j)
        store.arena.view[offset : offset + BB] = block
        sums.append(block_checksum(block, NS.fingerprint, keys[j]))
    store.commit(handle, reserved.reservation_id, sums)


async def intact(store: BlockStore, handle, key: bytes, i: int) -> bool:
    lease = await store.acquire(handle, [key])
    if not lease.lease_id:
        return False
    try:
        _, data, checksum, _ = store.read_leased(handle, lease.lease_id, 0)
        return data == raw(i) and block_checksum(data, NS.fingerprint, key) == checksum
    finally:
        store.release(handle, lease.lease_id)


async def checked(store: BlockStore) -> None:
    """``store.check()`` once the mover is idle: the blocks put here are written down in the
    background, and a write in flight pins its block (a lease the check would not find held)."""
    for _ in range(3000):  # hang guard
        if store.mover.idle:
            break
        await asyncio.sleep(0.01)
    assert store.mover.idle
    store.check()


async def written_down(nvme: Path) -> None:
    """Block 0 stored and written down to NVMe by a daemon that then stops: the next store
    finds it on disk only."""
    first = BlockStore(config(nvme))
    try:
        await first.start()
        handle = first.open_namespace(NS)
        await put(first, handle, KEYS[:1], 0)
        await first.stop()
    finally:
        first.close()


async def test_a_cancelled_promotion_does_not_write_into_a_slot_given_to_another_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await written_down(tmp_path)

    store = BlockStore(config(tmp_path))
    try:
        await store.start()
        handle = store.open_namespace(NS)
        assert store.nvme is not None and store.cpu_used_bytes == 0
        io = store.nvme._io
        read_record = io.read_record
        started, go, ended = threading.Event(), threading.Event(), threading.Event()

        def held_read(*args):  # type: ignore[no-untyped-def]
            started.set()
            go.wait(30)
            try:
                return read_record(*args)
            finally:
                ended.set()

        monkeypatch.setattr(io, "read_record", held_read)
        loop = asyncio.get_running_loop()
        reader = asyncio.create_task(store.acquire(handle, KEYS[:1]))
        assert await loop.run_in_executor(None, started.wait, 30)
        reader.cancel()  # the caller's deadline: it gives up while the read runs
        with pytest.raises(asyncio.CancelledError):
            await reader
        # Another client fills every free slot with blocks of its own.
        free = (SLOTS * BB - store.cpu_used_bytes) // BB
        fresh = KEYS[1 : 1 + free]
        await put(store, handle, fresh, 1)
        go.set()  # the stale read ends now
        assert await loop.run_in_executor(None, ended.wait, 30)
        monkeypatch.undo()
        for _ in range(3000):  # its end reaches the loop, which ends the promotion (hang guard)
            if not store.mover._promoting:
                break
            await asyncio.sleep(0.01)
        assert not store.mover._promoting
        for i, key in enumerate(fresh):
            assert await intact(store, handle, key, 1 + i), f"block {i} was overwritten"
        assert await intact(store, handle, KEYS[0], 0)  # the read installed the block it read
        await checked(store)
        await store.stop()
    finally:
        store.close()


async def test_a_retry_after_a_cancelled_promotion_waits_for_its_read_and_gets_the_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cancelled promotion unregistered itself at once while its read ran on: every retry of
    # an impatient reader (a short deadline, again and again) started another read into more
    # slots, and the abandoned reads and the slots they held grew with each retry. The
    # promotion now ends when its read does: a retry waits for that read, which installs the
    # block, and no second read starts.
    await written_down(tmp_path)

    store = BlockStore(config(tmp_path))
    try:
        await store.start()
        handle = store.open_namespace(NS)
        assert store.nvme is not None and store.cpu_used_bytes == 0
        io = store.nvme._io
        read_record = io.read_record
        reads, go = [], threading.Event()
        started = threading.Event()

        def held_read(*args):  # type: ignore[no-untyped-def]
            reads.append(args)
            started.set()
            go.wait(30)
            return read_record(*args)

        monkeypatch.setattr(io, "read_record", held_read)
        loop = asyncio.get_running_loop()
        impatient = asyncio.create_task(store.acquire(handle, KEYS[:1]))
        assert await loop.run_in_executor(None, started.wait, 30)
        impatient.cancel()
        with pytest.raises(asyncio.CancelledError):
            await impatient
        retry = asyncio.create_task(store.acquire(handle, KEYS[:1]))
        for _ in range(20):  # the retry runs up to its wait (or, before the fix, a new read)
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)
        go.set()
        lease = await asyncio.wait_for(retry, 30)
        assert len(reads) == 1, "the retry started a second read"
        assert lease.lease_id and len(lease.offsets) == 1
        _, data, checksum, _ = store.read_leased(handle, lease.lease_id, 0)
        assert data == raw(0) and block_checksum(data, NS.fingerprint, KEYS[0]) == checksum
        store.release(handle, lease.lease_id)
        monkeypatch.undo()
        await checked(store)
        await store.stop()
    finally:
        store.close()
