"""Spare slots in a full CPU tier: slots reserved ahead hold no block, so a grant evicts blocks
for them only while all spare slots together stay within ``spare_evicting_bytes`` (1/128 of the
tier); past it a grant takes free slots only, and is refused, evicting nothing, when too few
are free."""

from __future__ import annotations

import asyncio
import time

from conftest import SMALL_LAYOUT

from kvstore import Namespace, block_hashes
from kvstore.checksum import block_checksum
from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig
from kvstore.daemon.store import BlockStore, Handle
from kvstore.keys import BlockKey

BLOCK = SMALL_LAYOUT.block_bytes
NS = Namespace(model="m", layout=SMALL_LAYOUT)
SLOTS = 256  # spare slots made by evicting: 2 blocks' worth


def full_store() -> tuple[BlockStore, Handle, list[BlockKey]]:
    config = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        cpu=CpuTierConfig(capacity_bytes=SLOTS * BLOCK, slab_bytes=4 * BLOCK, prefault=False),
    )
    s = BlockStore(config, clock=time.monotonic)
    h = s.open_namespace(NS)
    keys = block_hashes(NS.seed, list(range(16 * SLOTS)))

    async def fill() -> None:
        rid, offsets, _ = await s.reserve(h, keys)
        data = bytes(BLOCK)
        for off in offsets:
            s.arena.view[off : off + BLOCK] = data
        assert s.commit(h, rid, [block_checksum(data, NS.fingerprint, k) for k in keys])

    asyncio.run(fill())
    assert len(s.ledger.policy) == SLOTS
    return s, h, keys


def test_a_full_tier_evicts_for_spare_slots_only_within_the_bound() -> None:
    s, h, keys = full_store()
    try:
        assert s.spare_evicting_bytes == 2 * BLOCK
        per_handle = s.spare_bytes(h.record) // BLOCK
        assert per_handle > 3  # the handle's own bound is not what refuses below
        assert asyncio.run(s.grant_spare(h, 2))  # within the bound: the 2 coldest go
        assert len(s.ledger.policy) == SLOTS - 2
        assert [s.ledger.committed(h.ns_id, k) is None for k in keys[:3]] == [True, True, False]
        s.check()
        assert not asyncio.run(s.grant_spare(h, 1))  # past it, and nothing is free
        assert len(s.ledger.policy) == SLOTS - 2
        assert s.spare_reserved_bytes == 2 * BLOCK
        s.check()
        # Free slots are granted past the bound: they cost no block.
        assert s.delete(h, keys[10:13]) == 3
        assert asyncio.run(s.grant_spare(h, 3))
        assert len(s.ledger.policy) == SLOTS - 5
        assert s.spare_reserved_bytes == 5 * BLOCK
        s.check()
    finally:
        s.close()


def test_a_grant_past_the_bound_takes_free_slots_or_none() -> None:
    s, h, keys = full_store()
    try:
        assert s.delete(h, keys[:2]) == 2  # 2 free slots
        assert not asyncio.run(s.grant_spare(h, 3))  # 3 > the bound, and only 2 free
        assert len(s.ledger.policy) == SLOTS - 2 and s.spare_reserved_bytes == 0
        assert not h.reservations
        s.check()
        assert asyncio.run(s.grant_spare(h, 2))  # within the bound
        assert len(s.ledger.policy) == SLOTS - 2  # the free slots, nothing evicted
        s.check()
    finally:
        s.close()


def test_slots_ahead_come_from_free_slots_only() -> None:
    """``ahead`` (a put that does not wait asks for a second put's worth): granted with the
    others while that many slots are free; in a full tier, never by evicting: the slots for
    the next put alone are granted then, as without it."""
    s, h, keys = full_store()
    try:
        # Full: the 1 wanted evicts (within the bound), the 1 ahead is not made.
        rid = asyncio.run(s.grant_spare(h, 1, ahead=1))
        assert rid and len(h.reservations[rid].eids) == 1
        assert len(s.ledger.policy) == SLOTS - 1
        # Ahead alone, with nothing free: none, and nothing evicted.
        assert not asyncio.run(s.grant_spare(h, 0, ahead=1))
        assert len(s.ledger.policy) == SLOTS - 1
        s.check()
        assert s.delete(h, keys[10:13]) == 3  # 3 free slots: all of them, nothing evicted
        rid = asyncio.run(s.grant_spare(h, 1, ahead=2))
        assert rid and len(h.reservations[rid].eids) == 3
        assert len(s.ledger.policy) == SLOTS - 4
        s.check()
    finally:
        s.close()
