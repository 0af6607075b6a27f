"""Spare slots: a put of small blocks in one call (``Bind``), against a real daemon.

A client in a run of puts holds arena slots the daemon reserved ahead for it; a put copies into
them and binds them to its keys in one call. What users rely on: bytes round-trip exactly;
nobody can bind (or be handed) another client's spare slots; a slot past its time is never
written; a refused or reclaimed slot only sends the put the two-call way, never loses it.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import grpc
import pytest
from conftest import SMALL_LAYOUT, kv_channel, random_blocks, same_bytes, tokens

from kvstore import AsyncKVStoreClient, KVStoreClient, Namespace, block_hashes
from kvstore.checksum import block_checksum
from kvstore.client._common import translate_error
from kvstore.client.spare_slots import SpareSlots
from kvstore.config import (
    CpuTierConfig,
    DaemonConfig,
    GpuTierConfig,
    NvmeTierConfig,
    Quota,
    TenantQuota,
)
from kvstore.daemon.store import BlockStore
from kvstore.errors import (
    CapacityError,
    InvalidRequestError,
    LeaseExpiredError,
    UnknownNamespaceError,
)
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

# Spare slots live min(reservation_ttl_s, pin_grace_s); a long grace keeps a test's slots fresh
# whatever the machine's load (the tests about expiry set a short one).
LONG_GRACE = "[limits]\npin_grace_s = 30.0\n"


def client(daemon, model: str = "spare", **kw) -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model=model, **kw)


def put_in_batches(kv, keys, blocks, batch: int) -> None:
    for i in range(0, len(keys), batch):
        assert kv.put(keys[i : i + batch], blocks[i : i + batch]) == len(keys[i : i + batch])


def raw_bind(kv, request: pb.BindRequest) -> Exception:
    """Send ``request`` as ``kv``'s caller over gRPC; the error it gets, translated."""
    with kv_channel(kv) as ch, pytest.raises(grpc.RpcError) as err:
        pb_grpc.KVStoreStub(ch).Bind(request, timeout=10)
    return translate_error(err.value)


def test_a_run_of_puts_goes_in_one_call_each_and_round_trips_exactly(daemon_factory) -> None:
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 48, seed=3)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(48))
        put_in_batches(kv, keys, blocks, 4)
        # The first put asks for nothing (one put is not a run); the second asks in its
        # commit; every put after that binds.
        assert kv._spare.binds == 10
        assert same_bytes(kv.get(keys), blocks)
        # Present keys are not written again: their slots stay spare for the next put.
        assert kv.put(keys[:4], blocks[:4]) == 0
        more = kv.hash_tokens(tokens(52))[48:]
        assert kv.put(more, blocks[:4]) == 4
        assert kv._spare.binds == 12
        assert same_bytes(kv.get(more), blocks[:4])
    with client(d) as other:  # what another client reads is the same bytes
        assert same_bytes(other.get(keys), blocks)


def test_repeated_keys_in_one_bound_put_store_the_first(daemon_factory) -> None:
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 12, seed=5)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(12))
        put_in_batches(kv, keys[:8], blocks[:8], 4)  # a run: the next put binds
        twice = [keys[8], keys[9], keys[8], keys[10]]
        assert kv.put(twice, blocks[8:12]) == 3
        assert kv._spare.binds == 1
        got = kv.get(keys[8:11])
        assert same_bytes(got[:1], blocks[8:9]) and same_bytes(got[1:2], blocks[9:10])
        assert same_bytes(got[2:3], blocks[11:12])


def test_concurrent_async_puts_never_share_a_spare_slot(daemon_factory) -> None:
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 64, seed=7)

    async def main() -> None:
        async with AsyncKVStoreClient(d.address, layout=SMALL_LAYOUT, model="spare") as kv:
            keys = kv.hash_tokens(tokens(64))
            for i in range(0, 16, 4):  # a run, so spare slots are held
                assert await kv.put(keys[i : i + 4], blocks[i : i + 4]) == 4
            puts = [kv.put(keys[i : i + 4], blocks[i : i + 4]) for i in range(16, 64, 4)]
            assert sum(await asyncio.gather(*puts)) == 48
            assert kv._spare.binds > 0
            assert same_bytes(await kv.get(keys), blocks)

    asyncio.run(main())


def test_a_bind_of_slots_that_are_not_the_callers_spare_slots_is_refused(daemon_factory) -> None:
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 16, seed=9)
    with client(d) as owner, client(d) as thief:
        keys = owner.hash_tokens(tokens(16))
        put_in_batches(owner, keys[:8], blocks[:8], 4)  # the owner now holds spare slots
        held = [address for address, _, _ in owner._spare._slots]
        assert len(held) >= 4
        stolen = thief.hash_tokens(tokens(24))[16:20]
        # Another client of the same namespace naming them: refused, nothing stored.
        request = pb.BindRequest(
            handle=thief._handle, keys=b"".join(stolen), slots=held[:4], checksums=[1] * 4
        )
        assert isinstance(raw_bind(thief, request), LeaseExpiredError)
        # Slots of committed blocks, and addresses in no slab: refused the same way.
        lease = owner.acquire(keys[:4])
        lease_offsets = list(lease.offsets)
        lease.release()
        for slots in (lease_offsets, [-1, 0, 1 << 62, 7]):
            request = pb.BindRequest(
                handle=owner._handle, keys=b"".join(stolen), slots=slots, checksums=[1] * 4
            )
            assert isinstance(raw_bind(owner, request), LeaseExpiredError)
        # Malformed: a slot named twice, or counts that do not match.
        for slots, sums in (([held[0]] * 4, [1] * 4), (held[:3], [1] * 4), (held[:4], [1])):
            request = pb.BindRequest(
                handle=owner._handle, keys=b"".join(stolen), slots=slots, checksums=sums
            )
            assert isinstance(raw_bind(owner, request), InvalidRequestError)
        assert thief.lookup(stolen) == 0 and owner.lookup(stolen) == 0
        # The owner's slots are still its own: its next put binds them, bytes intact.
        binds = owner._spare.binds
        put_in_batches(owner, keys[8:], blocks[8:], 4)
        assert owner._spare.binds > binds
        assert same_bytes(owner.get(keys), blocks)
        assert same_bytes(thief.get(keys), blocks)


def test_spare_slots_past_their_time_are_never_written_and_puts_still_land(
    daemon_factory,
) -> None:
    # Spare slots live 0.4 s here (pin_grace_s), so a client may write them for 0.2 s.
    d = daemon_factory(reaper_interval_s=0.05, extra="[limits]\npin_grace_s = 0.4\n")
    blocks = random_blocks(SMALL_LAYOUT, 24, seed=11)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(24))
        put_in_batches(kv, keys[:8], blocks[:8], 4)
        assert kv._spare._slots
        time.sleep(0.6)  # past the client's window and the daemon's lifetime of the slots
        assert kv._spare.take(4, kv._handle) is None  # stale: dropped here, never written
        binds = kv._spare.binds
        assert kv.put(keys[8:12], blocks[8:12]) == 4  # through a reservation
        assert kv._spare.binds == binds
        # A client whose clock says fresh but whose slots the daemon reclaimed (a stall
        # between the check and the copy): the daemon refuses the bind, the put still lands.
        put_in_batches(kv, keys[12:16], blocks[12:16], 4)  # a run again: spare slots held
        time.sleep(0.6)
        kv._spare._slots = [(a, time.monotonic() + 60, h) for a, _, h in kv._spare._slots]
        assert len(kv._spare._slots) >= 4
        binds = kv._spare.binds
        assert kv.put(keys[16:20], blocks[16:20]) == 4
        assert kv._spare.binds == binds
        assert same_bytes(kv.get(keys[:20]), blocks[:20])
        # The slots a late copy wrote into were quarantined, not reused: nothing else broke.
        put_in_batches(kv, keys[20:], blocks[20:], 4)
        assert same_bytes(kv.get(keys), blocks)


def test_a_client_that_stops_putting_holds_no_spare_slots(daemon_factory) -> None:
    d = daemon_factory(reaper_interval_s=0.05, extra="[limits]\npin_grace_s = 1.0\n")
    blocks = random_blocks(SMALL_LAYOUT, 12, seed=13)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(12))
        put_in_batches(kv, keys, blocks, 4)
        assert kv.stats().active_reservations > 0  # its spare slots (and the next ones)
        deadline = time.monotonic() + 10
        while kv.stats().active_reservations and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kv.stats().active_reservations == 0
        assert same_bytes(kv.get(keys), blocks)


def test_a_daemon_restart_between_puts_forgets_the_old_spare_slots(daemon_factory) -> None:
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 16, seed=15)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(16))
        put_in_batches(kv, keys[:8], blocks[:8], 4)
        assert kv._spare._slots
        d.stop()
        d.start()
        assert kv.put(keys[8:12], blocks[8:12]) == 4  # reopens; no stale slot is used
        put_in_batches(kv, keys[12:], blocks[12:], 4)
        assert same_bytes(kv.get(keys[8:]), blocks[8:])


def test_a_client_without_local_calls_binds_over_grpc(daemon_factory, monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_LOCAL_CALLS", "0")
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 16, seed=21)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(16))
        put_in_batches(kv, keys, blocks, 4)
        assert kv._spare.binds == 2
        assert same_bytes(kv.get(keys), blocks)


def test_no_spare_slots_are_made_past_the_limit(daemon_factory) -> None:
    d = daemon_factory(extra='[limits]\npin_grace_s = 30.0\nmax_spare = "0"\n')
    blocks = random_blocks(SMALL_LAYOUT, 16, seed=17)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(16))
        put_in_batches(kv, keys, blocks, 4)
        assert kv._spare.binds == 0 and not kv._spare._slots
        assert same_bytes(kv.get(keys), blocks)


def test_a_dropped_stream_never_lets_a_put_overwrite_another_clients_blocks(
    daemon_factory,
) -> None:
    """Review finding: when a handle closed (its stream dropped), its spare slots were freed at
    once and handed to another writer, while the client, which copies into spare slots before
    its next call tells it the handle is gone, still held them: its next put overwrote the other
    client's committed blocks (a miss for them, never their bytes). They are quarantined now."""
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 12, seed=19)
    with client(d) as a, client(d) as b:
        ka = a.hash_tokens(tokens(12))
        put_in_batches(a, ka[:8], blocks[:8], 4)
        held = [address for address, _, _ in a._spare._slots]
        assert len(held) >= 4
        a._stream.cancel()  # the daemon closes a's handle; a does not know yet
        deadline = time.monotonic() + 10
        while b.stats().open_handles > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert b.stats().open_handles == 1
        kb = b.hash_tokens(tokens(200))[40:]
        theirs = random_blocks(SMALL_LAYOUT, 160, seed=20)
        assert b.put(kb, theirs) == 160
        lease = b.acquire(kb)
        assert not set(held) & set(lease.offsets)  # none of a's spare slots was reused
        lease.release()
        assert a.put(ka[8:], blocks[8:]) == 4  # binds on its old handle: refused, then lands
        assert same_bytes(a.get(ka), blocks)
        assert same_bytes(b.get(kb), theirs)


# ----------------------------------------------------------------- the store's side

NS = Namespace(model="m", layout=SMALL_LAYOUT, tenant="t")


def store(tenant: Quota | None = None, clock=time.monotonic) -> BlockStore:
    config = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        cpu=CpuTierConfig(capacity_bytes=1024 * SMALL_LAYOUT.block_bytes, prefault=False),
        tenants=(TenantQuota("t", tenant=tenant),) if tenant is not None else (),
    )
    return BlockStore(config, clock=clock)


def spare_of(s: BlockStore, handle, n: int) -> list[int]:
    async def grant() -> int:
        return await s.grant_spare(handle, n)

    rid = asyncio.run(grant())
    assert rid
    handle.spare_ready.append(rid)
    addresses, fresh_s = s.take_spare(handle)
    assert len(addresses) == n and fresh_s > 0
    return addresses


def test_a_closed_handles_spare_slots_are_quarantined_not_handed_to_another_writer() -> None:
    s = store()
    try:
        h1 = s.open_namespace(NS)
        held = spare_of(s, h1, 4)
        s.close_handle(h1)  # its client may still copy into them before it learns
        h2 = s.open_namespace(NS)
        keys = block_hashes(NS.seed, list(range(16 * 64)))

        async def reserve() -> list[int]:
            return (await s.reserve(h2, keys)).offsets

        assert not set(held) & set(s.arena.addresses(asyncio.run(reserve())))
        s.check()
    finally:
        s.close()


def test_grants_under_way_count_toward_the_spare_limit(monkeypatch) -> None:
    """Review finding: the limit was checked before the grant's wait (room being made), so
    grants waiting at once each passed it and together held more than the limit."""
    s = store()
    try:
        h = s.open_namespace(NS)
        cap = s.spare_bytes(h.record) // h.record.cpu_bytes
        real = s.cpu_room.alloc_cpu

        async def alloc_after_a_wait(*args, **kwargs):  # room made with a wait, as under load
            await asyncio.sleep(0)
            return await real(*args, **kwargs)

        monkeypatch.setattr(s.cpu_room, "alloc_cpu", alloc_after_a_wait)

        async def both() -> list[int]:
            return list(await asyncio.gather(*(s.grant_spare(h, cap // 2 + 1) for _ in "ab")))

        assert sorted(bool(rid) for rid in asyncio.run(both())) == [False, True]
        assert sum(len(r.eids) for r in h.reservations.values() if r.spare) <= cap
        s.check()
    finally:
        s.close()


def test_a_refused_bind_spends_none_of_the_keys_per_second() -> None:
    """Review finding: a bind refused for its slots had already spent its keys, so the put's
    fallback through a reservation paid twice and could be refused under a tight rate."""
    s = store(Quota(keys_per_s=0.001, keys_burst=8))
    try:
        h = s.open_namespace(NS)
        held = spare_of(s, h, 4)
        keys = block_hashes(NS.seed, list(range(16 * 8)))
        data = bytes(SMALL_LAYOUT.block_bytes)
        sums = [block_checksum(data, NS.fingerprint, k) for k in keys[:4]]

        async def bind(slots: list[int]):
            return await s.bind(h, keys[:4], slots, sums)

        with pytest.raises(LeaseExpiredError):
            asyncio.run(bind([held[0] + 1, *held[1:]]))  # one address not a spare slot

        async def reserve():
            return await s.reserve(h, keys)  # the whole burst: 8 keys

        assert asyncio.run(reserve()).reservation_id
        with pytest.raises(CapacityError, match="keys_per_s"):
            asyncio.run(bind(held))  # the rate does bind, when the slots are right
        s.check()
    finally:
        s.close()


# ----------------------------------------------------------------- the client's pool


def test_threads_taking_spare_slots_never_get_the_same_one() -> None:
    pool = SpareSlots()
    pool.give(list(range(3000)), fresh_s=60.0, sent_at=time.monotonic(), handle=b"h")
    taken: list[list[int]] = [[] for _ in range(8)]

    def take(i: int) -> None:
        while (got := pool.take(3, b"h")) is not None:
            taken[i] += [address for address, _, _ in got]

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [a for part in taken for a in part]
    assert sorted(every) == list(range(3000))


def test_a_stale_slot_is_never_handed_out_and_a_lone_put_asks_for_none() -> None:
    pool = SpareSlots()
    now = time.monotonic()
    pool.give([1, 2], fresh_s=0.5, sent_at=now - 1.0, handle=b"h")  # its window has passed
    pool.give([3, 4], fresh_s=60.0, sent_at=now, handle=b"h")
    assert pool.take(3, b"h") is None
    assert [a for a, _, _ in pool.take(2, b"h") or []] == [3, 4]
    assert pool.wanted(4, b"h") == (0, 0)  # the first put of a run
    assert pool.wanted(4, b"h") == (4, 0)  # the next, right after: a run
    assert pool.wanted(4, b"h", ahead=True) == (4, 4)  # one that does not wait: two puts' worth
    pool.give([5, 6, 7, 8, 9, 10], fresh_s=60.0, sent_at=time.monotonic(), handle=b"h")
    assert pool.wanted(4, b"h", ahead=True) == (0, 2)  # 6 held: 2 more make two puts' worth


def test_slots_of_another_handle_are_never_handed_out() -> None:
    """Review finding: slots granted before a reopen (a reply that came back after it, or a
    retried Bind) were handed to puts of the new handle, whose daemon had not granted them."""
    pool = SpareSlots()
    now = time.monotonic()
    pool.give([1, 2, 3, 4], fresh_s=60.0, sent_at=now, handle=b"old")
    assert pool.take(2, b"new") is None
    pool.give([5, 6], fresh_s=60.0, sent_at=now, handle=b"new")
    assert [a for a, _, _ in pool.take(2, b"new") or []] == [5, 6]
    assert pool.take(1, b"old") is None  # dropped when the new handle's put looked


def test_all_handles_together_hold_at_most_an_eighth_of_the_tier_in_spare_slots() -> None:
    """Many writers in runs of puts at once each stay within their own bound (1/16 of the
    tier): together they must not reserve a large share of it ahead of their blocks."""
    now = [1000.0]
    s = store(clock=lambda: now[0])
    try:
        handles = [s.open_namespace(NS) for _ in range(4)]
        per_handle = s.spare_bytes(handles[0].record) // handles[0].record.cpu_bytes
        assert per_handle * handles[0].record.cpu_bytes * 2 == s.spare_tier_bytes
        granted = []
        for h in handles:
            rid = asyncio.run(s.grant_spare(h, per_handle))
            granted.append(bool(rid))
        assert granted == [True, True, False, False]
        assert s.spare_reserved_bytes == s.spare_tier_bytes
        s.check()
        # Slots bound to keys are spare no more: room for another handle's.
        h = handles[0]
        rid = next(r for r, v in h.reservations.items() if v.spare)
        h.spare_ready.append(rid)
        addresses, _ = s.take_spare(h)
        keys = block_hashes(NS.seed, list(range(16 * per_handle)))
        data = bytes(SMALL_LAYOUT.block_bytes)
        sums = [block_checksum(data, NS.fingerprint, k) for k in keys]
        assert asyncio.run(s.bind(h, keys, addresses, sums)).committed == per_handle
        s.check()
        assert asyncio.run(s.grant_spare(handles[2], per_handle))
        # A closed handle's slots are quarantined, and count until they are released.
        s.close_handle(handles[1])
        s.check()
        assert not asyncio.run(s.grant_spare(handles[3], per_handle))
        assert s.spare_reserved_bytes + s.spare_quarantined_bytes == s.spare_tier_bytes
        now[0] += 2 * s.spare_ttl_s  # past the closed handle's quarantine
        s.reap()  # and handles[2]'s slots expired: quarantined in turn
        assert s.spare_reserved_bytes == 0 and s.spare_quarantined_bytes == per_handle * (
            handles[0].record.cpu_bytes
        )
        assert asyncio.run(s.grant_spare(handles[3], per_handle))
        s.check()
        for _ in range(2):  # handles[3]'s expire, then are released
            now[0] += 2 * s.spare_ttl_s
            s.reap()
        assert s.spare_reserved_bytes == s.spare_quarantined_bytes == 0
        s.check()
        assert asyncio.run(s.grant_spare(handles[0], per_handle))
    finally:
        s.close()


def test_a_put_too_large_for_spare_slots_is_never_granted_any() -> None:
    """A put asking for more than the bounds allow (large blocks) is told no before any grant
    is tried or scheduled: no reservation, nothing pinned, nothing left to expire."""
    s = store()
    try:
        h = s.open_namespace(NS)
        fits = s.spare_bytes(h.record) // h.record.cpu_bytes
        assert s.spare_fits(h, fits) and not s.spare_fits(h, fits + 1)
        assert not s.spare_fits(h, 0)
        assert asyncio.run(s.grant_spare(h, fits + 1)) == 0
        assert not h.reservations and s.spare_reserved_bytes == 0
        s.check()
    finally:
        s.close()


def test_writers_that_open_put_and_close_never_hold_more_than_the_bound_in_spare_slots() -> None:
    """Review finding: a closed handle's spare slots stayed quarantined (pinned) for up to two
    lifetimes but left the count at once, so short-lived writers (open, put, close) could fill
    the whole tier with slots reserved ahead."""
    now = [1000.0]
    s = store(clock=lambda: now[0])
    try:
        granted = 0
        for _ in range(40):
            h = s.open_namespace(NS)
            n = s.spare_bytes(h.record) // h.record.cpu_bytes
            granted += bool(asyncio.run(s.grant_spare(h, n)))
            s.close_handle(h)
            s.check()  # reserved and quarantined spare slots within spare_tier_bytes
        assert granted == 2
        now[0] += 2 * s.spare_ttl_s
        s.reap()
        h = s.open_namespace(NS)
        assert asyncio.run(s.grant_spare(h, 4))  # released with their slots
        s.check()
    finally:
        s.close()


def test_a_reserve_whose_handle_closes_while_it_waits_for_room_is_refused_cleanly() -> None:
    """Review finding: a reserve waiting for the room lock while its handle (the namespace's
    last) closed went on with the forgotten namespace's books, and failed with an
    AttributeError (INTERNAL, and an unretrieved task error for a background grant)."""

    async def run() -> None:
        s = store()
        try:
            h = s.open_namespace(NS)
            keys = block_hashes(NS.seed, list(range(16 * 4)))
            await s.cpu_room._room.acquire()  # room being made for another call
            reserve = asyncio.create_task(s.reserve(h, keys))
            grant = asyncio.create_task(s.grant_spare(h, 4))
            await asyncio.sleep(0.01)
            s.close_handle(h)  # the client went away meanwhile
            s.cpu_room._room.release()
            with pytest.raises(UnknownNamespaceError):
                await reserve
            assert await grant == 0
            assert s.spare_reserved_bytes == s._spare_granting_bytes == 0
            s.check()
        finally:
            s.close()

    asyncio.run(run())


def test_puts_through_spare_slots_leave_the_key_map_no_bigger_than_direct_puts() -> None:
    """Memory finding: spare entries were keyed by placeholders and re-keyed by their Bind,
    which left a deleted slot in the namespace's key map per block, so the map (the daemon's
    largest per-block structure) grew to about twice the size of one holding the same keys.
    Spare entries now get their key once, at their Bind."""
    s = store()
    try:
        h = s.open_namespace(NS)
        keys = block_hashes(NS.seed, list(range(16 * 1000)))
        data = bytes(SMALL_LAYOUT.block_bytes)
        for i in range(0, 1000, 8):
            part = keys[i : i + 8]
            held = spare_of(s, h, len(part))
            sums = [block_checksum(data, NS.fingerprint, k) for k in part]

            async def bind(part=part, held=held, sums=sums):
                return await s.bind(h, part, held, sums)

            assert asyncio.run(bind()).committed == len(part)
        ids = s.ledger.index.ids_of(h.ns_id)
        assert len(ids) == 1000
        assert sys.getsizeof(ids) == sys.getsizeof(dict(zip(keys, range(1000), strict=True)))
        s.check()
    finally:
        s.close()


def test_a_durable_commit_naming_a_spare_reservation_is_refused_cleanly(tmp_path) -> None:
    """Review finding: with durable puts, a commit naming a spare reservation's id (never
    handed out, but a peer may send any id) read the keys of its entries, which have none
    until their Bind: an internal error instead of the refusal every other commit gets."""
    config = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        cpu=CpuTierConfig(capacity_bytes=64 * SMALL_LAYOUT.block_bytes, prefault=False),
        nvme=NvmeTierConfig(
            path=str(tmp_path), capacity_bytes=64 * SMALL_LAYOUT.block_bytes, durable_puts=True
        ),
    )
    s = BlockStore(config)

    async def run() -> None:
        await s.start()
        try:
            h = s.open_namespace(NS)
            rid = await s.grant_spare(h, 4)
            assert rid and h.reservations[rid].spare
            with pytest.raises(LeaseExpiredError, match="unknown to this handle"):
                await s.commit_durably(h, rid, [0] * 4)
            assert h.reservations[rid].spare  # still the handle's, untouched
            s.check()
        finally:
            await s.stop()

    asyncio.run(run())
