"""One tenant could fill the namespace table: a namespace that holds a block outlives its
handles, so a tenant opening many namespaces and putting one block in each (or simply opening
many) left ``limits.max_namespaces`` records, and every other tenant's OpenNamespace was refused
("too many namespaces") until those blocks happened to be evicted. With a tenant policy one
tenant may now hold at most a quarter of the table, like its share of open handles.
"""

from __future__ import annotations

import os

from kvstore import KVLayout, Namespace, block_hashes
from kvstore.checksum import block_checksum
from kvstore.config import (
    AccessRule,
    AuthConfig,
    CpuTierConfig,
    DaemonConfig,
    GpuTierConfig,
    LimitsConfig,
)
from kvstore.daemon.store import BlockStore
from kvstore.errors import CapacityError

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB blocks


def make_store() -> BlockStore:
    return BlockStore(
        DaemonConfig(
            gpu=GpuTierConfig(enabled="off"),
            auth=AuthConfig(
                access=(AccessRule(name="t", uids=(os.getuid(),), tenants=("hostile", "victim")),)
            ),
            limits=LimitsConfig(max_namespaces=16),
            cpu=CpuTierConfig(capacity_bytes=64 * 4096, slab_bytes=8 * 4096, prefault=False),
        )
    )


async def test_one_tenant_cannot_fill_the_namespace_table() -> None:
    s = make_store()
    try:
        squatted = 0
        for i in range(16):
            ns = Namespace(model=f"m{i}", layout=LAYOUT, tenant="hostile")
            try:
                h = s.open_namespace(ns)
            except CapacityError as exc:
                assert "max_namespaces" in str(exc)
                break
            key = block_hashes(ns.seed, list(range(16)))[0]
            rid, offsets, _ = await s.reserve(h, [key])
            data = bytes([i]) * LAYOUT.block_bytes
            s.arena.view[offsets[0] : offsets[0] + len(data)] = data
            s.commit(h, rid, [block_checksum(data, ns.fingerprint, key)])
            s.close_handle(h)  # the namespace stays: it holds a block
            squatted += 1
        assert squatted < 16, "one tenant took the whole namespace table"
        # Every other tenant can still open namespaces.
        for i in range(4):
            h = s.open_namespace(Namespace(model=f"v{i}", layout=LAYOUT, tenant="victim"))
            s.close_handle(h)
        s.check()
    finally:
        s.close()


async def test_the_share_counts_namespaces_holding_blocks_when_they_take_one() -> None:
    """Fresh namespaces opened first and filled afterwards are refused at the put past the
    share; namespaces without blocks (a reader of a shared tenant can open those, it cannot
    fill them) never use it up, and go with their handles."""
    s = make_store()
    try:
        handles = [
            s.open_namespace(Namespace(model=f"m{i}", layout=LAYOUT, tenant="hostile"))
            for i in range(8)
        ]
        filled = 0
        for h in handles:
            ns = h.record.namespace
            assert ns is not None
            key = block_hashes(ns.seed, list(range(16)))[0]
            try:
                rid, offsets, _ = await s.reserve(h, [key])
            except CapacityError as exc:
                assert "max_namespaces" in str(exc)
                continue
            data = bytes([filled]) * LAYOUT.block_bytes
            s.arena.view[offsets[0] : offsets[0] + len(data)] = data
            s.commit(h, rid, [block_checksum(data, ns.fingerprint, key)])
            filled += 1
        assert filled == 4  # a quarter of 16
        # Joining a namespace it holds is no new record: never refused.
        again = s.open_namespace(Namespace(model="m0", layout=LAYOUT, tenant="hostile"))
        assert again.record is handles[0].record
        for h in [*handles, again]:
            s.close_handle(h)
        assert len(s.namespaces()) == 4  # the empty ones went with their handles
        for i in range(8):
            s.close_handle(
                s.open_namespace(Namespace(model=f"v{i}", layout=LAYOUT, tenant="victim"))
            )
        s.check()
    finally:
        s.close()
