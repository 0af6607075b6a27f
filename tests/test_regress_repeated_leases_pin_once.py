"""Pins were counted per lease, not per block: a lease of a block already leased counted its
bytes again. Leasing one 4 KiB block 32 times exhausted a 128 KiB pinned share, and from then
on every other lease and reservation of that tenant was RESOURCE_EXHAUSTED. Through a shared
tenant (``[shared.NAME]``) that is one tenant's reader denying the shared namespace to every
other reader and to its writers, with a single handle; and a hot prefix many requests read at
once could be refused although it pins only its own blocks. A block now counts once in each
books however many leases name it.
"""

from __future__ import annotations

import os

from kvstore import KVLayout, Namespace, block_hashes
from kvstore.checksum import block_checksum
from kvstore.config import AccessRule, AuthConfig, CpuTierConfig, DaemonConfig, GpuTierConfig
from kvstore.daemon.store import BlockStore

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB blocks
BB = LAYOUT.block_bytes
PROMPTS = Namespace(model="m", layout=LAYOUT, tenant="prompts")


async def test_leasing_one_block_many_times_pins_it_once() -> None:
    s = BlockStore(
        DaemonConfig(
            gpu=GpuTierConfig(enabled="off"),
            auth=AuthConfig(
                access=(AccessRule(name="t", uids=(os.getuid(),), tenants=("prompts",)),)
            ),
            cpu=CpuTierConfig(capacity_bytes=64 * BB, slab_bytes=8 * BB, prefault=False),
        )
    )
    try:
        writer, reader, other = (s.open_namespace(PROMPTS) for _ in range(3))
        keys = list(block_hashes(PROMPTS.seed, list(range(2 * 16))))
        rid, offsets, _ = await s.reserve(writer, keys[:1])
        data = b"\x01" * BB
        s.arena.view[offsets[0] : offsets[0] + BB] = data
        s.commit(writer, rid, [block_checksum(data, PROMPTS.fingerprint, keys[0])])
        books = writer.record.owner
        share = s.quotas.pinned_cap(books)  # 32 blocks: half the tier
        leases = [await s.acquire(reader, keys[:1]) for _ in range(2 * share // BB)]
        assert all(r.lease_id for r in leases)  # refused from the 32nd on before the fix
        assert books.pinned_bytes == BB  # one block pinned, however often it is leased
        other_lease = await s.acquire(other, keys[:1])  # another reader still reads
        assert other_lease.lease_id
        more = await s.reserve(writer, keys[1:])  # and the writer still writes
        assert more.reservation_id
        s.check()
        for r in leases:
            s.release(reader, r.lease_id)
        assert books.pinned_bytes == BB + BB  # the other reader's lease, the reservation
        s.release(other, other_lease.lease_id)
        s.abort(writer, more.reservation_id)
        assert books.pinned_bytes == 0 and s.quotas.total_pinned == 0
        s.check()
    finally:
        s.close()
