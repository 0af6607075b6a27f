"""On a single-user daemon (no tenant policy, no [tenants]) every client shares one tenant,
whose pinned share was the whole CPU tier: one client that leased every block (a get of a long
prefix, then idle, holds its lease until its next call or the lease TTL) or reserved the whole
tier stopped every other client's puts with "cpu tier full". Each handle may now pin at most
half the tier there while another handle is open (unless ``limits.max_pinned_share`` is
set), so the rest stays evictable.
"""

from __future__ import annotations

from kvstore import KVLayout, Namespace, block_hashes
from kvstore.checksum import block_checksum
from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig, LimitsConfig
from kvstore.daemon.store import BlockStore, Handle
from kvstore.errors import CapacityError

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB blocks
BB = LAYOUT.block_bytes
NS = Namespace(model="m", layout=LAYOUT)
N = 16  # blocks in the CPU tier


def make_store(limits: LimitsConfig | None = None) -> BlockStore:
    return BlockStore(
        DaemonConfig(
            gpu=GpuTierConfig(enabled="off"),
            limits=limits or LimitsConfig(),
            cpu=CpuTierConfig(capacity_bytes=N * BB, slab_bytes=4 * BB, prefault=False),
        )
    )


def keys(n: int, start: int = 0) -> list[bytes]:
    return list(block_hashes(NS.seed, list(range(start * 16, (start + n) * 16))))


async def put(s: BlockStore, h: Handle, ks: list[bytes]) -> None:
    rid, offsets, _ = await s.reserve(h, ks)
    sums = []
    for off, k in zip(offsets, ks, strict=True):
        data = k * (BB // len(k))
        s.arena.view[off : off + BB] = data
        sums.append(block_checksum(data, NS.fingerprint, k))
    s.commit(h, rid, sums)


async def test_one_client_leasing_the_whole_tier_cannot_stop_anothers_puts() -> None:
    s = make_store()
    try:
        greedy, other = s.open_namespace(NS), s.open_namespace(NS)
        ks = keys(N)
        for i in range(0, N, 4):
            await put(s, greedy, ks[i : i + 4])
        held = []
        for i in range(0, N, 4):  # lease the whole tier, a part at a time
            try:
                held.append(await s.acquire(greedy, ks[i : i + 4]))
            except CapacityError as exc:
                assert "more than one client may" in str(exc)
                break
        await put(s, other, keys(4, start=100))  # refused before the fix
        assert len(held) == N // 2 // 4  # half the tier
        for r in held:
            s.release(greedy, r.lease_id)
        s.check()
    finally:
        s.close()


async def test_one_client_reserving_the_whole_tier_cannot_stop_anothers_puts() -> None:
    s = make_store()
    try:
        greedy, other = s.open_namespace(NS), s.open_namespace(NS)
        reserved = 0
        for i in range(0, N, 4):  # reserve the whole tier, a part at a time, and sit on it
            try:
                reserved += len((await s.reserve(greedy, keys(4, start=i))).offsets)
            except CapacityError as exc:
                assert "more than one client may" in str(exc)
                break
        await put(s, other, keys(4, start=100))  # refused before the fix
        assert reserved == N // 2
        s.check()
    finally:
        s.close()


async def test_an_explicit_max_pinned_share_replaces_the_per_client_bound() -> None:
    s = make_store(LimitsConfig(max_pinned_share=1.0))
    try:
        h = s.open_namespace(NS)
        ks = keys(N)
        await put(s, h, ks)
        result = await s.acquire(h, ks)  # the operator allowed it
        assert len(result.offsets) == N
        s.release(h, result.lease_id)
        s.check()
    finally:
        s.close()
