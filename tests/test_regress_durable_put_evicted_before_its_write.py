"""A durable put was acknowledged with its blocks on no tier. A CPU slab drain names every
slot's entry, a spare slot's too (not committed yet); its write-back of that entry did nothing
(not committed), a Bind committed the entry meanwhile, and the eviction then dropped it as if
its write had failed: "nothing else holds it". The put's durable write found the entry gone,
took it for deleted by a client, and the put was acknowledged. Found by the soak with faults
(``benchmarks/soak.py --faults``: acknowledged ledger blocks missing once Redis, which still
held them, restarted). Now an eviction leaves a victim that was not committed when its writes
began (or holds another block by their end) for the next round, and a durable put whose block
is gone without having reached the disk is refused (UNAVAILABLE), never acknowledged.

Real in-process store: real arena, real NVMe file; the interleaving is the event loop's own
order of steps (no timing).
"""

from __future__ import annotations

import asyncio

from test_store import NS, Clock, checksum, keys

from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig, NvmeTierConfig
from kvstore.daemon.store import BlockStore
from kvstore.errors import UnavailableError
from kvstore.index import IN_NVME, State


async def test_a_block_committed_while_its_eviction_runs_is_written_not_dropped(tmp_path) -> None:
    cfg = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        cpu=CpuTierConfig(capacity_bytes=8 * 4096, slab_bytes=8 * 4096, prefault=False),
        nvme=NvmeTierConfig(path=str(tmp_path), capacity_bytes=1 << 20, durable_puts=True),
    )
    s = BlockStore(cfg, clock=Clock())
    await s.start()
    try:
        h = s.open_namespace(NS)
        (key,) = keys(1)
        rid, offsets, _ = await s.reserve(h, [key])
        eid = s.index.ids_of(h.ns_id)[key]
        assert s.index.state[eid] == State.RESERVED
        data = b"\x07" * h.record.block_bytes
        s.arena.view[offsets[0] : offsets[0] + len(data)] = data
        evicting = asyncio.create_task(s.cpu_room._evict_cpu([eid]))  # as a slab drain names it
        await asyncio.sleep(0)  # the eviction starts its write-backs (if any)
        await asyncio.sleep(0)  # ... which find the entry uncommitted and do nothing
        s.commit(h, rid, [checksum(data, key)])  # the Bind's commit, before the eviction resumes
        persisting = asyncio.create_task(s.persist(h.ns_id, [eid], [key]))  # the Bind's write
        await evicting
        try:
            await persisting  # before the fix: returned, the block gone from every tier
        except UnavailableError:
            raise AssertionError("the block was evicted before its durable write") from None
        got = s.index.ids_of(h.ns_id).get(key)
        assert got is not None and s.index.state[got] == State.COMMITTED
        assert s.index.tier[got] & IN_NVME  # durable, as the acknowledgement says
    finally:
        await s.stop()
        s.close()
