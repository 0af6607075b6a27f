"""A handle alone on a single-user daemon may pin (lease, reserve) the whole CPU tier; the
bound of half the tier per handle applied only to pins made once another handle was open. A
lone handle that had pinned everything kept it until its leases and reservations expired
(``lease_ttl_s``, ``reservation_ttl_s``: 30 s by default, and a lease renewed by a new acquire
of the same blocks before the second handle opened lasted longer), and every put of a newcomer
was "cpu tier full" until then.

Now, when a second handle opens, what takes the first past half the tier expires within
``limits.pin_grace_s``: its reservations past half whole, its leases cut at the half (their
leading blocks, a usable prefix, keep their expiry). The first keeps half; a caller opening and
closing handles over and over cannot take more from it. A read of a block whose lease part
expired is LeaseExpiredError (the bytes path) or a failed checksum (shared memory), never the
bytes of whoever reuses the slot.

Store-level tests drive the store's clock; ``test_a_newcomer_gets_room_from_a_daemon_...`` runs
a real daemon and real clients over shared memory.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import SMALL_LAYOUT, random_blocks, same_bytes, tokens

from kvstore import KVLayout, KVStoreClient, Namespace, block_hashes
from kvstore.checksum import block_checksum
from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig
from kvstore.daemon.store import BlockStore, Handle
from kvstore.errors import CapacityError, KVStoreError, LeaseExpiredError

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB blocks
BB = LAYOUT.block_bytes
NS = Namespace(model="m", layout=LAYOUT)
N = 16  # blocks in the CPU tier
GRACE = 2.0  # limits.pin_grace_s's default
TTL = 600.0  # leases and reservations last far longer than the test


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_store(clock: Clock) -> BlockStore:
    return BlockStore(
        DaemonConfig(
            gpu=GpuTierConfig(enabled="off"),
            lease_ttl_s=TTL,
            reservation_ttl_s=TTL,
            cpu=CpuTierConfig(capacity_bytes=N * BB, slab_bytes=4 * BB, prefault=False),
        ),
        clock=clock,
    )


def keys(n: int, start: int = 0) -> list[bytes]:
    return list(block_hashes(NS.seed, list(range(start * 16, (start + n) * 16))))


def content(k: bytes) -> bytes:
    return k * (BB // len(k))


def write(s: BlockStore, offsets: list[int], ks: list[bytes]) -> list[int]:
    """Fill reserved slots as a client does; returns what its commit carries."""
    sums = []
    for off, k in zip(offsets, ks, strict=True):
        s.arena.view[off : off + BB] = content(k)
        sums.append(block_checksum(content(k), NS.fingerprint, k))
    return sums


async def put(s: BlockStore, h: Handle, ks: list[bytes]) -> None:
    rid, offsets, _ = await s.reserve(h, ks)
    s.commit(h, rid, write(s, offsets, ks))


async def test_a_newcomer_gets_room_within_the_grace_and_the_first_keeps_half() -> None:
    clock = Clock()
    s = make_store(clock)
    try:
        greedy = s.open_namespace(NS)
        ks = keys(N)
        for i in range(0, N, 4):
            await put(s, greedy, ks[i : i + 4])
        first = await s.acquire(greedy, ks[:12])  # alone: the whole tier is allowed
        second = await s.acquire(greedy, ks[12:])
        assert len(first.offsets) == 12 and len(second.offsets) == 4
        s.check()

        newcomer = s.open_namespace(NS)
        with pytest.raises(CapacityError, match="this handle pins 0B"):
            await put(s, newcomer, keys(4, start=100))  # everything is leased, for now
        clock.now = GRACE  # the part past half expires
        s.reap()
        s.check()
        await put(s, newcomer, keys(4, start=100))  # refused for TTL seconds before the fix
        s.check()

        # The first handle kept half the tier: the leading 8 blocks of its first lease.
        for i in range(8):
            key, data, _, _ = s.read_leased(greedy, first.lease_id, i)
            assert key == ks[i] and data == content(ks[i])
        for i in range(8, 12):  # the cut part: an error, never the newcomer's bytes
            with pytest.raises(LeaseExpiredError):
                s.read_leased(greedy, first.lease_id, i)
        with pytest.raises(LeaseExpiredError):
            s.release(greedy, second.lease_id)  # wholly past half: expired
        with pytest.raises(CapacityError, match="more than one client may"):
            await s.acquire(greedy, keys(1, start=100))  # and it cannot renew past half
        s.release(greedy, first.lease_id)
        s.check()
    finally:
        s.close()


async def test_reservations_past_half_expire_within_the_grace_and_free_their_slots_soon() -> None:
    clock = Clock()
    s = make_store(clock)
    try:
        greedy = s.open_namespace(NS)
        held = [await s.reserve(greedy, keys(4, start=i)) for i in range(0, N, 4)]  # all of it
        newcomer = s.open_namespace(NS)
        clock.now = GRACE
        assert s.reap() == (2, 0)  # the two reservations past half
        with pytest.raises(CapacityError):
            await put(s, newcomer, keys(8, start=100))  # their slots are quarantined
        clock.now = 2 * GRACE  # for the grace too, not the TTL
        s.reap()
        await put(s, newcomer, keys(8, start=100))
        s.check()
        kept, gone = held[:2], held[2:]
        for i, r in enumerate(kept):  # its first half commits as it would have
            sums = write(s, r.offsets, keys(4, start=4 * i))
            assert s.commit(greedy, r.reservation_id, sums) == 4
        for r in gone:
            with pytest.raises(LeaseExpiredError):
                s.commit(greedy, r.reservation_id, [0] * 4)
        s.check()
    finally:
        s.close()


async def test_opening_and_closing_handles_over_and_over_takes_nothing_below_half() -> None:
    clock = Clock()
    s = make_store(clock)
    try:
        greedy = s.open_namespace(NS)
        ks = keys(N)
        await put(s, greedy, ks)
        lease = await s.acquire(greedy, ks)
        leading = list(greedy.leases[lease.lease_id].eids[:8])
        for _ in range(50):  # a hostile caller churns handles
            s.close_handle(s.open_namespace(NS))
            clock.now += 0.01
        hostile = s.open_namespace(NS)
        clock.now += GRACE
        s.reap()
        s.check()
        # The second half went, the first half stays leased, whatever the churn.
        assert greedy.leases[lease.lease_id].eids == leading
        await put(s, hostile, keys(8, start=100))  # the half no longer leased
        for i in range(8):
            key, data, _, _ = s.read_leased(greedy, lease.lease_id, i)
            assert data == content(key)
        s.check()
    finally:
        s.close()


def test_a_newcomer_gets_room_from_a_daemon_whose_lone_client_leased_everything(
    daemon_factory,
) -> None:
    """Real daemon, shared memory: client A leases the whole tier and sits on it; client B's
    put goes through once the grace has passed; A's copy of its lease is A's bytes for the
    half it kept, and a checksum failure (a miss), never B's bytes, past it."""
    n = 32  # 8 KiB blocks: a 256 KiB tier
    d = daemon_factory(cpu_capacity="256KiB", slab="64KiB", lease_ttl_s=TTL, reservation_ttl_s=TTL)
    a = KVStoreClient(d.address, layout=SMALL_LAYOUT, model="grace")
    with a:
        ka = a.hash_tokens(tokens(n))
        mine = random_blocks(SMALL_LAYOUT, n, seed=1)
        assert a.put(ka, mine) == n
        lease = a.acquire(ka)
        assert len(lease) == n
        b = KVStoreClient(d.address, layout=SMALL_LAYOUT, model="grace")
        with b:
            kb = b.hash_tokens(tokens(4, offset=10_000))
            theirs = random_blocks(SMALL_LAYOUT, 4, seed=2)
            deadline = time.monotonic() + 60  # a hang guard: the grace is 2 s
            while True:
                try:
                    assert b.put(kb, theirs) == 4
                    break
                except KVStoreError as exc:  # refused until the part past half expires
                    assert "cpu tier full" in str(exc) or "pin" in str(exc), exc
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            assert same_bytes(b.get(kb), theirs)
        rows = torch.empty(n, SMALL_LAYOUT.block_bytes, dtype=torch.uint8)
        m = lease.copy_into(rows)
        assert n // 2 <= m < n  # kept its half; past it a slot B reused fails its checksum
        assert same_bytes(rows[:m], mine[:m].contiguous().view(torch.uint8).reshape(m, -1))
        lease.release()
        assert same_bytes(a.get(ka[: n // 2]), mine[: n // 2])
