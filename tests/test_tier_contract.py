"""The tier contract (``kvstore.daemon.tier_contract``), kept by each of the daemon's four tiers:
the GPU pool (on a CPU device standing in for it), the CPU tier (a real shared-memory arena),
NVMe (a real slab file) and Redis (a real ``redis-server``).

For each tier, in pairs: start/stop; move_up/move_down land blocks whose bytes are exactly what
was put, and report what landed; holds/drop (a block's only copy is never dropped, nor a leased
one); counters/snapshot.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore import KVLayout, Namespace, block_hashes
from kvstore.checksum import block_checksum
from kvstore.config import (
    CpuTierConfig,
    DaemonConfig,
    GpuTierConfig,
    NvmeTierConfig,
    RedisTierConfig,
)
from kvstore.daemon.store import BlockStore, Handle
from kvstore.daemon.tier_contract import KeyRun, Tier
from kvstore.index import IN_CPU, IN_GPU, IN_NVME
from kvstore.tiers.cpu import HEADER_BYTES
from kvstore.tiers.gpu import DevicePool

LAYOUT = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16)
BB = LAYOUT.block_bytes
NS = Namespace(model="contract", layout=LAYOUT)


def keys(n: int, start: int = 0) -> list[bytes]:
    return list(block_hashes(NS.seed, list(range(start * 16, (start + n) * 16))))


def block(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, BB, dtype=np.uint8).tobytes()


def make_store(
    tmp_path: Path, *, gpu: bool = False, nvme: bool = False, redis_url: str = "", secret: str = ""
) -> BlockStore:
    cfg = DaemonConfig(
        lease_ttl_s=30,
        reservation_ttl_s=30,
        gpu=GpuTierConfig(enabled="off", capacity_bytes=8 * BB, slab_bytes=2 * BB),
        cpu=CpuTierConfig(capacity_bytes=16 * BB, slab_bytes=2 * BB, prefault=False),
        nvme=NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=32 * BB, direct_io=False)
        if nvme
        else NvmeTierConfig(),
        redis=RedisTierConfig(url=redis_url, mac_key_file=secret, write_through=False)
        if redis_url
        else RedisTierConfig(),
    )
    pool = DevicePool(8 * BB + HEADER_BYTES, "cpu") if gpu else None
    return BlockStore(cfg, gpu_pool=pool)


async def put(store: BlockStore, handle: Handle, ks: list[bytes], seeds: list[int]) -> list[int]:
    """Write CPU blocks as a client does; returns their entry ids."""
    rid, offsets, _ = await store.reserve(handle, ks)
    sums = []
    for off, k, seed in zip(offsets, ks, seeds, strict=True):
        store.arena.view[off : off + BB] = block(seed)
        sums.append(block_checksum(block(seed), NS.fingerprint, k))
    assert store.commit(handle, rid, sums) == len(ks)
    eids = [store.ledger.committed(handle.ns_id, k) for k in ks]
    assert None not in eids
    return eids  # type: ignore[return-value]


def cpu_bytes(store: BlockStore, eid: int) -> bytes:
    off = store.ledger.index.offset[eid]
    return bytes(store.arena.view[off : off + BB])


async def settle(store: BlockStore) -> None:
    """Background copies (write-back, write-through) done."""
    for _ in range(2000):
        d = store.device
        if store.mover.idle and not (d._tasks or d._copies or d._moving or d._eager):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("background copies did not settle")


@pytest.fixture
async def started(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[BlockStore]:
    store = make_store(tmp_path, **request.param)
    await store.start()
    yield store
    await store.stop()


# ----------------------------------------------------------------- the shape
def test_every_tier_keeps_the_contract(tmp_path: Path) -> None:
    """All four are ``Tier`` at run time, under the names Stats uses, with the contract's
    methods callable as the contract calls them (positionally)."""
    store = make_store(tmp_path, gpu=True)
    try:
        assert [t.name for t in store.tiers] == ["gpu", "cpu", "nvme", "redis"]
        for tier in store.tiers:
            assert isinstance(tier, Tier), tier.name
            for method in ("move_up", "move_down", "start", "stop"):
                assert inspect.iscoroutinefunction(getattr(tier, method)), (tier.name, method)
            for method in ("holds", "drop", "snapshot"):
                assert not inspect.iscoroutinefunction(getattr(tier, method)), (tier.name, method)
            up = inspect.signature(tier.move_up).parameters
            assert len([p for p in up.values() if p.default is inspect.Parameter.empty]) == 1
    finally:
        store.close()


def test_the_contract_check_can_fail() -> None:
    class NotATier:
        name = "x"

        async def start(self) -> None: ...

    assert not isinstance(NotATier(), Tier)


# ----------------------------------------------------------------- GPU <-> CPU
@pytest.mark.parametrize("started", [{"gpu": True}], indirect=True)
async def test_gpu_tier_moves_up_and_down_with_exact_bytes(started: BlockStore) -> None:
    store, gpu = started, started.device
    handle = store.open_namespace(NS)
    ks = keys(3)
    eids = await put(store, handle, ks, [1, 2, 3])
    assert gpu.enabled and not any(gpu.holds(e) for e in eids)

    assert await gpu.move_up(eids) == eids  # the leading run, all of it
    assert all(gpu.holds(e) for e in eids)
    assert gpu.counters.promotions == 3
    pool = store.ledger.gpu_slots
    for e, seed in zip(eids, [1, 2, 3], strict=True):
        slot = gpu.pool.slot(pool.offset[e], BB)  # type: ignore[union-attr]
        assert slot.numpy().tobytes() == block(seed)
    assert await gpu.move_up(eids) == eids  # idempotent: nothing copied twice
    assert gpu.counters.promotions == 3

    # Drop needs a copy below: each has its CPU copy, so the two go, and stay readable.
    assert gpu.drop(eids[:2]) == 2
    assert not gpu.holds(eids[0]) and gpu.holds(eids[2])
    assert cpu_bytes(store, eids[0]) == block(1)

    # Down: a GPU-only block gets its CPU copy back, exact.
    store.cpu_room.drop([eids[2]])  # its CPU copy goes: the GPU holds the only one
    assert store.ledger.index.tier[eids[2]] & (IN_CPU | IN_GPU) == IN_GPU
    assert gpu.drop([eids[2]]) == 0  # the only copy is never dropped
    assert await gpu.move_down([eids[2], eids[2]]) == 1
    assert cpu_bytes(store, eids[2]) == block(3)
    assert gpu.counters.demotions == 1

    snap = gpu.snapshot()
    assert snap is not None and snap.name == "gpu"
    assert (snap.blocks, snap.used_bytes, snap.capacity_bytes) == (1, BB, 8 * BB)
    store.check()


async def test_an_absent_gpu_tier_is_disabled_and_shows_no_snapshot(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    await store.start()
    try:
        assert not store.device.enabled and store.device.snapshot() is None
        assert [s.name for s in store.tier_snapshots()] == ["cpu"]
    finally:
        await store.stop()


# ----------------------------------------------------------------- CPU <-> NVMe
@pytest.mark.parametrize("started", [{"nvme": True}], indirect=True)
async def test_cpu_and_nvme_tiers_move_blocks_across_their_edge(started: BlockStore) -> None:
    store, cpu, nvme = started, started.cpu_room, started.mover
    handle = store.open_namespace(NS)
    ks = keys(4)
    eids = await put(store, handle, ks, [5, 6, 7, 8])
    await settle(store)
    assert nvme.enabled and cpu.enabled

    # Down, through either end of the edge: the CPU tier's (it hands them to the write-back)
    # or the NVMe tier's own. Both report what is on disk afterwards.
    assert await cpu.move_down(eids[:2]) == 2
    assert await nvme.move_down(eids) == 4
    assert all(nvme.holds(e) for e in eids)
    # Each block counts once, however often it is named.
    assert await nvme.move_down([eids[0], eids[0]]) == 1
    assert await cpu.move_down([eids[1], eids[1]]) == 1

    # The CPU copies go (each has its disk copy); up again, the bytes are exact.
    assert cpu.drop(eids) == 4
    assert not any(cpu.holds(e) for e in eids)
    assert await cpu.move_up(eids[:2]) == eids[:2]
    assert await nvme.move_up(eids) == eids
    for e, seed in zip(eids, [5, 6, 7, 8], strict=True):
        assert cpu_bytes(store, e) == block(seed)
    assert nvme.counters.promotions == 4

    # A leased block keeps its copies; a block's only copy is never dropped.
    lease_id, *_ = await store.acquire(handle, ks[:1])
    assert cpu.drop(eids[:1]) == 0 and nvme.drop(eids[:1]) == 0
    store.release(handle, lease_id)
    assert nvme.drop(eids[1:2]) == 1  # dirty again: the CPU copy is its only one
    assert cpu.drop(eids[1:2]) == 0
    assert store.ledger.index.tier[eids[1]] & (IN_CPU | IN_NVME) == IN_CPU

    snaps = {s.name: s for s in store.tier_snapshots()}
    assert snaps["cpu"] == cpu.snapshot() and snaps["cpu"].blocks == 4
    assert snaps["nvme"].blocks == 3
    store.check()


async def test_a_cpu_tier_with_nothing_below_moves_nothing_down(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    await store.start()
    try:
        handle = store.open_namespace(NS)
        eids = await put(store, handle, keys(2), [1, 2])
        assert await store.cpu_room.move_down(eids) == 0
        assert not store.mover.enabled and await store.mover.move_down(eids) == 0
        assert await store.cpu_room.move_up(eids) == eids  # already up
        assert store.cpu_room.drop(eids) == 0  # the only copies
        store.check()
    finally:
        await store.stop()


# ----------------------------------------------------------------- CPU <-> Redis
async def test_the_shared_tier_moves_blocks_by_key_up_and_by_entry_down(
    tmp_path: Path, redis_server: Any, redis_mac_key_file: Path
) -> None:
    store = make_store(tmp_path, redis_url=redis_server.url, secret=str(redis_mac_key_file))
    await store.start()
    try:
        shared = store.shared
        assert shared.enabled
        handle = store.open_namespace(NS)
        ks = keys(3)
        eids = await put(store, handle, ks, [11, 12, 13])
        assert not any(shared.holds(e) for e in eids)  # no write-through here

        # Down: through the shared tier, or through the CPU tier, whose edge below is Redis
        # when there is no NVMe tier.
        assert await shared.move_down(eids[:1]) == 1
        assert await store.cpu_room.move_down(eids) == 3
        assert all(shared.holds(e) for e in eids)
        assert await shared.move_down([eids[0], eids[0]]) == 1
        assert shared.drop(eids) == 0  # every host's values: this host drops none

        # The blocks leave this host; up again by key, they become local entries, exact.
        assert store.delete(handle, ks) == 3
        assert store.ledger.committed(handle.ns_id, ks[0]) is None
        up = await shared.move_up(KeyRun(handle.record, ks + keys(1, start=9)))
        assert len(up) == 3  # the fourth key was never stored: the run ends there
        for e, seed in zip(up, [11, 12, 13], strict=True):
            assert store.ledger.index.tier[e] & IN_CPU and cpu_bytes(store, e) == block(seed)
        assert shared.counters.promotions == 3

        snap = shared.snapshot()
        assert snap is not None and snap.name == "redis" and snap.up
        assert snap.blocks == 3 and snap.used_bytes >= 3 * BB
        assert all(shared.holds(e) for e in up)  # fetched from there: known to be there
        store.check()
    finally:
        await store.stop()


async def test_an_unconfigured_shared_tier_starts_disabled(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    await store.start()
    try:
        handle = store.open_namespace(NS)
        assert not store.shared.enabled and store.shared.snapshot() is None
        assert await store.shared.move_up(KeyRun(handle.record, keys(2))) == []
    finally:
        await store.stop()
