"""A prefetch kept the entry ids of its run across its awaits, one window after another. A key
deleted meanwhile freed its id, and another tenant's next block took it: the prefetch then
promoted that tenant's block into a CPU slot of the prefetching namespace's memory domain, a
slab file the prefetching tenant's clients map. Now each window re-checks that every entry
still holds the key it was queued for, in that namespace, and a promotion places a block only
in its own namespace's domain.
"""

from __future__ import annotations

import asyncio
import os
import threading

from kvstore import KVLayout, Namespace, block_hashes
from kvstore.checksum import block_checksum
from kvstore.config import (
    AccessRule,
    AuthConfig,
    CpuTierConfig,
    DaemonConfig,
    GpuTierConfig,
    NvmeTierConfig,
)
from kvstore.daemon.store import BlockStore, Handle
from kvstore.index import IN_CPU, IN_NVME

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB blocks
A = Namespace(model="m", layout=LAYOUT, tenant="a")
B = Namespace(model="m", layout=LAYOUT, tenant="b")


def keys(ns: Namespace, n: int, start: int = 0) -> list[bytes]:
    return block_hashes(ns.seed, list(range(start * 16, (start + n) * 16)))


async def put(store: BlockStore, handle: Handle, ks: list[bytes], fill: int) -> None:
    rid, offsets, _ = await store.reserve(handle, ks)
    ns = handle.record.namespace
    assert ns is not None
    sums = []
    for off in offsets:
        data = bytes([fill]) * LAYOUT.block_bytes
        store.arena.view[off : off + len(data)] = data
        sums.append(block_checksum(data, ns.fingerprint, ks[len(sums)]))
    store.commit(handle, rid, sums)


async def until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(4000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_prefetch_never_promotes_another_tenants_block_into_its_memory(
    tmp_path,
) -> None:
    cfg = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        # A tenant policy: each tenant's CPU blocks live in slab files of their own.
        auth=AuthConfig(access=(AccessRule(name="t", uids=(os.getuid(),), tenants=("a", "b")),)),
        cpu=CpuTierConfig(capacity_bytes=64 * 4096, slab_bytes=8 * 4096, prefault=False),
        nvme=NvmeTierConfig(
            path=str(tmp_path), capacity_bytes=1 << 20, write_through=True, io_threads=1
        ),
    )
    s = BlockStore(cfg)
    await s.start()
    gate = threading.Event()
    try:
        ha, hb = s.open_namespace(A), s.open_namespace(B)
        assert ha.record.domain != hb.record.domain
        ka, kb = keys(A, 4), keys(B, 1, start=100)
        await put(s, ha, ka, fill=0xAA)
        await until(lambda: s.mover.idle, "write-through")
        for k in ka:  # on disk only now
            s.ledger.drop_cpu_copy(s.index.get(ha.ns_id, k))
        # A slow disk: the prefetch's first window (io_threads=1: two blocks) waits for the
        # one read thread while the rest of its run changes hands.
        assert s.nvme is not None
        blocker = s.nvme._read_pool.submit(gate.wait)
        assert s.mover.prefetch(ha.ns_id, ka) == 4
        await until(lambda: len(s.mover._promoting) == 2, "the first window")
        # The second window is then a's block 2 and, under block 3's old id, b's block.
        assert s.delete(ha, ka[3:]) == 1  # its entry id is free again
        await put(s, hb, kb, fill=0xBB)  # tenant b's next block takes that id
        b_eids = [s.index.get(hb.ns_id, k) for k in kb]
        await until(lambda: all(s.index.tier[e] & IN_NVME for e in b_eids), "b's write-back")
        for e in b_eids:  # evicted from memory: on disk only
            s.ledger.drop_cpu_copy(e)
        gate.set()
        blocker.result()
        await until(lambda: s.mover.idle, "the prefetch")
        for e in b_eids:
            if s.index.tier[e] & IN_CPU:
                slab = s.allocator.slab_of(s.index.offset[e])
                assert s.allocator.slab_info(slab).domain == hb.record.domain, (
                    "tenant b's block was promoted into tenant a's memory"
                )
        # And a's prefetch promoted nothing of b's: b's blocks stay where eviction left them.
        assert not any(s.index.tier[e] & IN_CPU for e in b_eids)
        s.check()
    finally:
        gate.set()
        await s.stop()
