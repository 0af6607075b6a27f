"""Guard: ``limits.pin_grace_s`` (a lone handle's pins past half the CPU tier expire soon
after a second handle opens) is a single-user daemon's fairness between its own clients. Where
tenants are kept apart (``[tenants.NAME]`` tables or a tenant policy) each tenant's pinned
share is its own bound, and a handle of another tenant opening, or opening and closing over
and over, never shortens what a tenant leased within its ``max_pinned``: its leases keep their
expiry, and its blocks stay readable through them."""

from __future__ import annotations

import torch
from conftest import random_blocks

from kvstore import KVLayout, Namespace, block_hashes
from kvstore.checksum import block_checksum
from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig, Quota, TenantQuota
from kvstore.daemon.store import BlockStore

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB blocks
BB = LAYOUT.block_bytes
N = 16
TTL = 600.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_another_tenants_handles_never_shorten_a_tenants_leases() -> None:
    clock = Clock()
    store = BlockStore(
        DaemonConfig(
            gpu=GpuTierConfig(enabled="off"),
            lease_ttl_s=TTL,
            reservation_ttl_s=TTL,
            cpu=CpuTierConfig(capacity_bytes=N * BB, slab_bytes=4 * BB, prefault=False),
            # "big" may pin three quarters of the tier: more than a lone handle's half.
            tenants=(TenantQuota("big", tenant=Quota(pinned_bytes=12 * BB)), TenantQuota("other")),
        ),
        clock=clock,
    )
    try:
        big_ns = Namespace(model="m", layout=LAYOUT, tenant="big")
        big = store.open_namespace(big_ns)
        keys = block_hashes(big_ns.seed, list(range(12 * 16)))
        reserved = await store.reserve(big, keys)
        sums = []
        for i, (offset, key) in enumerate(zip(reserved.offsets, keys, strict=True)):
            block = random_blocks(LAYOUT, 1, seed=i)[0].view(torch.uint8).numpy().tobytes()
            store.arena.view[offset : offset + BB] = block
            sums.append(block_checksum(block, big_ns.fingerprint, key))
        store.commit(big, reserved.reservation_id, sums)
        lease = await store.acquire(big, keys)
        assert len(lease.offsets) == 12
        other_ns = Namespace(model="m", layout=LAYOUT, tenant="other")
        for _ in range(5):  # another tenant's handles come and go
            store.close_handle(store.open_namespace(other_ns))
        newcomer = store.open_namespace(other_ns)
        clock.now += 100.0  # far past any grace, well within the lease
        store.reap()
        assert store.active_leases == 1
        for i in range(12):
            key, data, checksum, _ = store.read_leased(big, lease.lease_id, i)
            assert block_checksum(data, big_ns.fingerprint, key) == checksum
        store.release(big, lease.lease_id)
        store.close_handle(newcomer)
        store.check()
    finally:
        store.close()
