"""Regression: a put into a full CPU tier was refused ("cpu tier full: the keys to reserve kept
changing") when the put's first block had been evicted and the rest of its chain was still
stored and the coldest in the tier. Each round of making room for the missing blocks evicted
the put's own stored ones, which then needed slots too; after 8 rounds the put was refused.
With fewer of its blocks stored it was not refused, but it evicted and rewrote its whole chain
and as many other blocks. A put into a full tier of blocks nobody leases is never refused: the
blocks it finds stored stay (not written again) and only the missing ones are written, taking
the slots of the coldest other blocks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest
import torch
from conftest import SMALL_LAYOUT, random_blocks, same_bytes, tokens

from kvstore import KVStoreClient, Namespace, block_hashes
from kvstore.checksum import block_checksum
from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig
from kvstore.daemon.store import BlockStore, Handle

BLOCK = SMALL_LAYOUT.block_bytes  # 8 KiB
NO_SPARE = '[limits]\nmax_spare = "0"\n'
LONG_GRACE = "[limits]\npin_grace_s = 30.0\n"  # spare slots stay fresh however loaded the host


def client(daemon) -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="chain")


def present(kv: KVStoreClient, keys: Sequence[bytes]) -> list[bool]:
    return [kv.lookup([k]) == 1 for k in keys]


def test_a_put_whose_stored_chain_is_the_coldest_writes_only_its_missing_block(
    daemon_factory,
) -> None:
    # 16 slots, no spare slots: the repro of the trace replay.
    d = daemon_factory(cpu_capacity=f"{16 * BLOCK}", slab=f"{4 * BLOCK}", extra=NO_SPARE)
    first = random_blocks(SMALL_LAYOUT, 10, seed=1)
    second = random_blocks(SMALL_LAYOUT, 10, seed=2)  # other bytes: a rewrite would show
    others = random_blocks(SMALL_LAYOUT, 7, seed=3)
    with client(d) as kv:
        chain = kv.hash_tokens(tokens(10))
        other = kv.hash_tokens(tokens(7, offset=100_000))
        assert kv.put(chain, first) == 10
        assert kv.put(other[:6], others[:6]) == 6  # the tier is full
        assert kv.put(other[6:], others[6:]) == 1  # evicts chain[0], the coldest
        assert kv.put(chain, second) == 1  # was: CapacityError after 8 rounds
        # The stored blocks were not written again; the missing one took the coldest other
        # block's slot, and nothing else moved.
        assert same_bytes(kv.get(chain), torch.cat([second[:1], first[1:]]))
        assert present(kv, other) == [False] + [True] * 6
        assert kv.stats().tiers[0].blocks == 16


def test_with_spare_slots_a_put_whose_stored_chain_is_the_coldest_writes_only_what_is_missing(
    daemon_factory,
) -> None:
    # 256 slots; once the tier is full, spare slots are made by evicting for at most 2 blocks
    # (1/128 of the tier).
    d = daemon_factory(cpu_capacity=f"{256 * BLOCK}", slab=f"{4 * BLOCK}", extra=LONG_GRACE)
    first = random_blocks(SMALL_LAYOUT, 10, seed=4)
    second = random_blocks(SMALL_LAYOUT, 10, seed=5)
    others = random_blocks(SMALL_LAYOUT, 247, seed=6)
    with client(d) as kv:
        chain = kv.hash_tokens(tokens(10))
        other = kv.hash_tokens(tokens(247, offset=100_000))
        assert kv.put(chain, first) == 10  # a first put asks for no spare slots
        assert kv.put(other[:246], others[:246]) == 246  # the tier is full; too many to ask
        kv._spare._last_put = time.monotonic()  # a run of puts, however slow the host
        # Evicts chain[0]; its commit asks for a spare slot: one is granted in its reply and
        # one more in the background, made by evicting chain[1] and chain[2].
        assert kv.put(other[246:], others[246:]) == 1
        deadline = time.monotonic() + 30
        while kv.stats().active_reservations < 2:
            assert time.monotonic() < deadline, "the spare slots were not granted"
            time.sleep(0.01)
        # Too many blocks for its one spare slot: a reservation, which evicted the whole
        # stored chain, one round at a time, and wrote it again.
        assert kv.put(chain, second) == 3
        assert same_bytes(kv.get(chain), torch.cat([second[:3], first[3:]]))
        assert present(kv, other) == [False] * 3 + [True] * 244


# ----------------------------------------------------------------- in the store, checked

NS = Namespace(model="m", layout=SMALL_LAYOUT)


def make_store(slots: int, policy: str) -> BlockStore:
    config = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        cpu=CpuTierConfig(
            capacity_bytes=slots * BLOCK, slab_bytes=4 * BLOCK, prefault=False, policy=policy
        ),
    )
    return BlockStore(config, clock=time.monotonic)


async def put(store: BlockStore, handle: Handle, keys: Sequence[bytes], fill: int) -> int:
    rid, offsets, _ = await store.reserve(handle, keys)
    sums = []
    for off, k in zip(offsets, keys, strict=True):
        if off >= 0:
            data = bytes([fill]) * BLOCK
            store.arena.view[off : off + BLOCK] = data
            sums.append(block_checksum(data, NS.fingerprint, k))
    return store.commit(handle, rid, sums) if rid else 0


def read(store: BlockStore, handle: Handle, key: bytes) -> int:
    """The fill byte of ``key``'s stored block."""
    eid = store.ledger.committed(handle.ns_id, key)
    assert eid is not None
    return store.arena.view[store.ledger.index.offset[eid]]


@pytest.mark.parametrize("policy", ["lru", "priority", "prefix"])
@pytest.mark.parametrize("missing", [1, 2, 5])
def test_the_store_writes_only_the_missing_blocks_of_a_chain_it_holds_the_coldest_of(
    policy: str, missing: int
) -> None:
    s = make_store(16, policy)
    try:
        h = s.open_namespace(NS)
        chain = block_hashes(NS.seed, tokens(10))
        other = block_hashes(NS.seed, tokens(6 + missing, offset=100_000))

        async def scenario() -> None:
            assert await put(s, h, chain, fill=1) == 10
            for key in other:  # one at a time: the tier fills, then evicts
                assert await put(s, h, [key], fill=2) == 1
                s.check()
            gone = [s.ledger.committed(h.ns_id, k) is None for k in chain]
            assert sum(gone) == missing  # the coldest of the chain went first
            stored_other = [k for k in other if s.ledger.committed(h.ns_id, k) is not None]
            assert await put(s, h, chain, fill=3) == missing
            s.check()
            assert [read(s, h, k) for k in chain] == [3 if g else 1 for g in gone]
            # As many other blocks went as were written, and no more.
            after = [k for k in other if s.ledger.committed(h.ns_id, k) is not None]
            assert set(after) <= set(stored_other)
            assert len(stored_other) - len(after) == missing
            assert len(s.ledger.policy) == 16

        asyncio.run(scenario())
    finally:
        s.close()


def test_the_store_with_a_spare_grant_writes_only_the_missing_blocks() -> None:
    s = make_store(256, "lru")  # spare slots made by evicting: 2 (1/128 of the tier)
    try:
        h = s.open_namespace(NS)
        chain = block_hashes(NS.seed, tokens(10))
        other = block_hashes(NS.seed, tokens(247, offset=100_000))

        async def scenario() -> None:
            assert await put(s, h, chain, fill=1) == 10
            assert await put(s, h, other, fill=2) == 247  # evicts chain[0]
            assert await s.grant_spare(h, 2)  # evicts chain[1], chain[2]
            s.check()
            assert [s.ledger.committed(h.ns_id, k) is None for k in chain[:4]] == [
                True,
                True,
                True,
                False,
            ]
            assert await put(s, h, chain, fill=3) == 3
            s.check()
            assert [read(s, h, k) for k in chain] == [3, 3, 3] + [1] * 7
            stored = [s.ledger.committed(h.ns_id, k) is not None for k in other]
            assert stored == [False] * 3 + [True] * 244

        asyncio.run(scenario())
    finally:
        s.close()
