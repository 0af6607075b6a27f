"""What the NVMe tier's regression tests share: blocks written straight to an ``NvmeTier``
(``key``, ``data_of``, ``write``), its file's headers and records as a restart reads them, every
job and pwrite its IO makes (``Recorder``), and a ``BlockStore`` whose CPU copies only the test
writes down (``write_back_store``, ``commit_blocks``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvstore.tiers.nvme.recordio as recordio
from kvstore import KVLayout, Namespace, block_hashes
from kvstore.checksum import block_checksum
from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig, NvmeTierConfig
from kvstore.daemon.namespaces import Handle
from kvstore.daemon.store import BlockStore
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.nvme.ondisk import PAGE, parse_header

# ----------------------------------------------------------------- the tier alone

NS = bytes(range(16))  # the namespace fingerprint every block is checksummed under
N = 16384  # bytes a block


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def data_of(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, N, dtype=np.uint8).tobytes()


def new_tier(directory: Path) -> NvmeTier:
    return NvmeTier(directory, 16 << 20, slab_bytes=1 << 20)


async def open_tier(directory: Path) -> NvmeTier:
    tier = new_tier(directory)
    await tier.open()
    return tier


async def write(tier: NvmeTier, i: int, durable: bool = False) -> int:
    """Block ``i`` (``key(i)``, ``data_of(i)``) written to a slot of its own: the slot."""
    data = data_of(i)
    slot = tier.allocate(N)
    assert slot is not None
    await tier.write(slot, key(i), NS, data, block_checksum(data, NS, key(i)), durable=durable)
    return slot


def header_kind(path: Path, slot: int) -> int | None:
    """The kind of the header at ``slot`` of the tier's file ``path`` (None: no header)."""
    with open(path, "rb") as f:
        f.seek(slot)
        h = parse_header(f.read(PAGE))
    return None if h is None else h.kind


async def reopen_keys(directory: Path) -> list[bytes]:
    """The keys a restart finds in ``directory``, sorted (its file checked consistent)."""
    tier = new_tier(directory)
    records = await tier.open()
    try:
        assert tier.check().ok
        return sorted(r.key for r in records)
    finally:
        await tier.close()


class Recorder:
    """Every job the tier's write pool runs, and every pwrite its record IO makes."""

    def __init__(self, tier: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> None:
        self.jobs: list[object] = []
        self.writes: list[tuple[int, int]] = []  # (offset, bytes)
        pool = tier._write_pool
        submit = pool.submit

        def counted(fn: Any, *args: Any, **kw: Any) -> Any:
            self.jobs.append(fn)
            return submit(fn, *args, **kw)

        monkeypatch.setattr(pool, "submit", counted)
        pwrite_all = recordio.pwrite_all

        def logged(fd: int, bufs: Any, offset: int) -> Any:
            self.writes.append((offset, sum(memoryview(b).nbytes for b in bufs)))
            return pwrite_all(fd, bufs, offset)

        monkeypatch.setattr(recordio, "pwrite_all", logged)

    def clear(self) -> None:
        self.jobs.clear()
        self.writes.clear()


# ----------------------------------------------------------------- a store above it

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB blocks
BB = LAYOUT.block_bytes


@contextlib.asynccontextmanager
async def write_back_store(directory: Path, **config: Any) -> AsyncIterator[BlockStore]:
    """A started store of 16 blocks of memory and 1 MiB of NVMe in ``directory``, with no
    background write-back (``high_watermark`` 1: the test writes blocks down itself);
    ``config``: more of its ``DaemonConfig`` (``tenants``)."""
    cfg = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        cpu=CpuTierConfig(
            capacity_bytes=16 * BB, slab_bytes=16 * BB, prefault=False, high_watermark=1.0
        ),
        nvme=NvmeTierConfig(path=str(directory), capacity_bytes=1 << 20),
        **config,
    )
    s = BlockStore(cfg)
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


async def commit_blocks(
    s: BlockStore, ns: Namespace, n: int
) -> tuple[Handle, list[bytes], list[int], list[int]]:
    """``n`` blocks committed in ``ns`` (of ``LAYOUT``), each its key's bytes repeated:
    (its handle, the keys, their arena offsets, their index entries)."""
    h = s.open_namespace(ns)
    keys = list(block_hashes(ns.seed, list(range(n * LAYOUT.block_size))))
    rid, offsets, _ = await s.reserve(h, keys)
    sums = []
    for off, k in zip(offsets, keys, strict=True):
        data = k * (BB // len(k))
        s.arena.view[off : off + BB] = data
        sums.append(block_checksum(data, ns.fingerprint, k))
    s.commit(h, rid, sums)
    eids = [s.index.get(h.ns_id, k) for k in keys]
    assert all(e is not None for e in eids)
    return h, keys, list(offsets), [e for e in eids if e is not None]
