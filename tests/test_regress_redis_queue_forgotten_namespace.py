"""Redis write-through queues (entry, namespace id, key) for every commit. A namespace whose
blocks were deleted (or evicted) and whose last handle closed before its turn came is
forgotten, and the put loop looked its record up to size the batch: KeyError, the loop task
died, and from then on no block of any namespace reached Redis (the other hosts stopped seeing
this host's puts, with nothing in the log but a task exception). The loop now skips entries
that no longer hold their key before looking anything up.
"""

from __future__ import annotations

import asyncio

from kvstore import KVLayout, Namespace, block_hashes
from kvstore.checksum import block_checksum
from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig, RedisTierConfig
from kvstore.daemon.store import BlockStore, Handle

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB blocks
BB = LAYOUT.block_bytes


async def put(s: BlockStore, h: Handle, ns: Namespace, key: bytes) -> None:
    rid, offsets, _ = await s.reserve(h, [key])
    data = key * (BB // len(key))
    s.arena.view[offsets[0] : offsets[0] + BB] = data
    s.commit(h, rid, [block_checksum(data, ns.fingerprint, key)])


async def test_a_forgotten_namespace_in_the_queue_does_not_stop_write_through(
    redis_server, redis_mac_key_file
) -> None:
    cfg = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        cpu=CpuTierConfig(capacity_bytes=16 * BB, slab_bytes=4 * BB, prefault=False),
        redis=RedisTierConfig(
            url=redis_server.url,
            write_through=True,
            timeout_s=5.0,
            mac_key_file=str(redis_mac_key_file),
        ),
    )
    s = BlockStore(cfg)
    await s.start()
    try:
        gone = Namespace(model="gone", layout=LAYOUT)
        h = s.open_namespace(gone)
        key = block_hashes(gone.seed, list(range(16)))[0]
        await put(s, h, gone, key)  # queued for Redis
        s.delete(h, [key])
        s.close_handle(h)  # the namespace is forgotten before the put loop's turn
        assert s.names.get(h.ns_id) is None
        await asyncio.sleep(0.1)  # the put loop's turn
        kept = Namespace(model="kept", layout=LAYOUT)
        h2 = s.open_namespace(kept)
        key2 = block_hashes(kept.seed, list(range(16)))[0]
        await put(s, h2, kept, key2)
        for _ in range(400):
            if await s.shared.contains(h2.record, [key2]):
                break
            await asyncio.sleep(0.01)
        assert await s.shared.contains(h2.record, [key2]) == 1, "write-through stopped"
        assert s.shared._putter is not None and not s.shared._putter.done()
        s.check()
    finally:
        await s.stop()
