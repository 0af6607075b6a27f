"""A daemon whose NVMe tier held blocks of more namespaces than ``limits.max_namespaces`` (the
operator lowered the limit, and restarted) did not start at all: recovery refused the
namespaces past the limit with "too many namespaces". The limit bounds what clients open; what
the disk already holds is recovered whatever it is, and new namespaces are refused until the
count is under the limit again.
"""

from __future__ import annotations

import pytest

from kvstore import KVLayout, Namespace, block_hashes
from kvstore.checksum import block_checksum
from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig, LimitsConfig, NvmeTierConfig
from kvstore.daemon.store import BlockStore
from kvstore.errors import CapacityError

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB blocks
BB = LAYOUT.block_bytes


def config(directory, max_namespaces: int) -> DaemonConfig:  # type: ignore[no-untyped-def]
    return DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        limits=LimitsConfig(max_namespaces=max_namespaces),
        cpu=CpuTierConfig(capacity_bytes=64 * BB, slab_bytes=8 * BB, prefault=False),
        nvme=NvmeTierConfig(path=str(directory), capacity_bytes=1 << 20, write_through=True),
    )


def namespace(i: int) -> Namespace:
    return Namespace(model=f"m{i}", layout=LAYOUT)


async def test_a_lowered_max_namespaces_still_recovers_every_block(tmp_path) -> None:
    s = BlockStore(config(tmp_path, 16))
    await s.start()
    blocks = {}
    try:
        for i in range(6):
            ns = namespace(i)
            h = s.open_namespace(ns)
            key = block_hashes(ns.seed, list(range(16)))[0]
            rid, offsets, _ = await s.reserve(h, [key])
            data = bytes([i + 1]) * BB
            s.arena.view[offsets[0] : offsets[0] + BB] = data
            s.commit(h, rid, [block_checksum(data, ns.fingerprint, key)])
            s.close_handle(h)
            blocks[i] = (key, data)
    finally:
        await s.stop()  # a graceful stop: every block is on disk

    s = BlockStore(config(tmp_path, 4))
    await s.start()  # CapacityError "too many namespaces" before the fix
    try:
        assert len(s.namespaces()) == 6
        for i, (key, data) in blocks.items():
            h = s.open_namespace(namespace(i))  # binds the recovered record: no new one
            lease, offsets, sums, _ = await s.acquire(h, [key])
            assert bytes(s.arena.view[offsets[0] : offsets[0] + BB]) == data
            assert sums == [block_checksum(data, namespace(i).fingerprint, key)]
            s.release(h, lease)
            s.close_handle(h)
        with pytest.raises(CapacityError, match="max_namespaces"):
            s.open_namespace(namespace(99))  # a new one waits until the count is under 4
        s.check()
    finally:
        await s.stop()
