"""Presence tables (``kvstore.presence``): lookups a same-host client answers from shared memory.

The promise: a lookup answered from the table is the answer the daemon would give (the leading
keys committed in the namespace), never another namespace's, and a client falls back to the
call wherever the table cannot say (Redis, overflow, a dead daemon, releases to carry).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
import socket
import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
import xxhash
from conftest import SMALL_LAYOUT, random_blocks, same_bytes, tiers, tokens, wait_for
from hypothesis import given, settings
from hypothesis import strategies as st
from test_store import NS, make_store, put

from kvstore import AsyncKVStoreClient, KVStoreClient, Namespace, block_hashes
from kvstore.client import presence_link
from kvstore.errors import CapacityError
from kvstore.presence import (
    MAX_SPARSENESS,
    MIN_CAPACITY,
    WALK_REMOVES,
    WINDOW,
    PresenceTable,
    PresenceView,
)
from kvstore.v1 import kvstore_pb2 as pb


def rand_keys(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def view_of(table: PresenceTable) -> PresenceView:
    fd = table.export()
    try:
        return PresenceView(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- the table alone
def test_a_view_sees_adds_and_removes_made_after_it_mapped() -> None:
    keys = rand_keys(40)
    table = PresenceTable(keys[:10])
    view = view_of(table)
    packed = b"".join(keys)
    assert view.leading(packed) == 10
    for k in keys[10:30]:
        table = table.add(k)
    assert not view.retired  # 30 keys fit the first table
    assert view.leading(packed) == 30
    table.remove(keys[4])
    assert view.leading(packed) == 4  # leading run: stops at the first key not held
    assert view.leading(b"".join(keys[5:30])) == 25
    table = table.add(keys[4])
    assert view.leading(packed) == 30


def test_growing_retires_the_old_table_and_the_new_one_holds_every_key() -> None:
    keys = rand_keys(3 * MIN_CAPACITY)
    table = PresenceTable()
    first = view_of(table)
    for k in keys:
        table = table.add(k)
    assert first.retired  # a reader must ask for the current table
    assert table.capacity > MIN_CAPACITY and not table.retired and not table.overflow
    assert view_of(table).leading(b"".join(keys)) == len(keys)


def test_a_batch_that_fills_a_table_lands_in_the_bigger_one() -> None:
    keys = rand_keys(MIN_CAPACITY)  # past half full midway through the batch
    table = PresenceTable()
    first = view_of(table)
    table = table.add_many(keys)
    assert first.retired and table.count == len(keys) and not table.overflow
    assert view_of(table).leading(b"".join(keys)) == len(keys)


@pytest.mark.parametrize("removed", [60, 20])  # 68 keys: one numpy pass; 28: walked
def test_removing_a_batch_leaves_the_table_as_removing_one_by_one(removed: int) -> None:
    """``remove_many`` (an eviction's batch) against ``remove`` of each key: the same words,
    keys sharing a fingerprint among them (and one that shares it with a key not removed),
    whether the batch is searched in one numpy pass or key by key (``WALK_REMOVES``)."""
    base = rand_keys(200)
    twins = [base[i][:8] + os.urandom(24) for i in (100, 101, 102)]  # fingerprints held
    keys = base + twins[:2]
    places = list(range(1, len(keys) + 1))
    gone = base[:removed] + twins[:2] + [twins[2]] + rand_keys(5)  # some never held
    assert (len(gone) < WALK_REMOVES) == (removed == 20)
    one = PresenceTable().add_many(keys, places, places)
    batch = PresenceTable().add_many(keys, places, places)
    for key in gone:
        one.remove(key)
    batch.remove_many(gone)
    assert batch.count == one.count
    assert bytes(batch._words) == bytes(one._words)
    view = view_of(batch)
    kept = base[removed:100] + base[103:]
    assert [view.leading(k) for k in kept] == [1] * len(kept)


def test_churn_does_not_grow_the_table() -> None:
    table = PresenceTable()
    live = rand_keys(100)
    table = table.add_many(live)
    for _ in range(50):
        batch = rand_keys(200)
        table = table.add_many(batch)
        for k in batch:
            table.remove(k)
    # Sized for the 300 keys live at once at most (a quarter full when built), not for the
    # 10,000 that came and went.
    assert table.capacity <= 2 * MIN_CAPACITY
    assert view_of(table).leading(b"".join(live)) == 100


def test_keys_forged_to_crowd_one_window_set_overflow_and_memory_stays_bounded() -> None:
    # Same low bits: every key has the same home whatever the capacity.
    forged = [(i << 40).to_bytes(8, "little") + os.urandom(24) for i in range(1, 200)]
    table = PresenceTable()
    for k in forged:
        table = table.add(k)
    assert table.overflow
    assert table.capacity <= MAX_SPARSENESS * 2 * len(forged)
    view = view_of(table)
    held = sum(view.leading(k) for k in forged)
    assert WINDOW <= held < len(forged)  # a full window's worth, and never a wrong hit
    assert view.leading(os.urandom(32)) == 0


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 200),
    st.lists(st.tuples(st.booleans(), st.integers(0, 199)), max_size=300),
    st.sampled_from([1, 7, 9, 12]),
)
def test_the_table_holds_exactly_the_keys_added_and_not_removed(first, ops, homes) -> None:
    """Against a set: the first ``first`` keys, then adds and removes, of keys crowded into
    ``homes`` buckets eight apart (up to 29 keys each, ~4 buckets' worth: probes run past
    home buckets, windows fill, removed slots are reused; one home: windows overflow).
    Every live key is found, no other key is, except that a table that could not place a key
    (``overflow``) may lack live ones (its clients then ask the daemon)."""
    pool = [(((i % homes) * 8) | (i << 32)).to_bytes(8, "little") + bytes(24) for i in range(200)]
    table = PresenceTable().add_many(pool[:first])  # a commit's batch
    live = set(range(first))
    for add, i in ops:
        if add and i not in live:
            table = table.add(pool[i])
            live.add(i)
        elif not add and i in live:
            table.remove(pool[i])
            live.discard(i)
    view = view_of(table)
    for i, key in enumerate(pool):
        found = view.leading(key) == 1
        if i not in live:
            assert not found, f"key {i} was never added or was removed"
        elif not table.overflow:
            assert found, f"live key {i} missing"
    if not table.overflow:
        in_order = [pool[i] for i in sorted(live)]
        assert view.leading(b"".join(in_order)) == len(in_order)
    # The walk of a run's first keys finds what the numpy probe finds, slot for slot, on
    # runs that end at a removed or never-added key in any bucket of a window.
    packed = b"".join(pool)
    hit, slot = view._probe(packed)
    run = len(hit) if hit.all() else int(hit.argmin())
    assert view._walk(packed, len(pool)) == slot[:run].tolist()


def test_a_table_is_handed_out_read_only_and_cannot_be_shrunk() -> None:
    table = PresenceTable(rand_keys(5))
    fd = table.export()
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, table.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.pwrite(fd, b"\xff" * 8, 64)
        assert os.fstat(fd).st_mode & 0o777 == 0o600  # another uid cannot reopen it writable
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_SEAL  # never a SIGBUS
    finally:
        os.close(fd)


def test_a_retired_table_frees_its_pages_though_a_client_keeps_its_descriptor() -> None:
    """A client keeping every descriptor it was handed pins a page per retired table, not the
    table: put/delete churn retires tables again and again."""
    table = PresenceTable(rand_keys(20_000))
    fd = table.export()
    try:
        view = PresenceView(fd)
        assert os.fstat(fd).st_blocks * 512 >= 64 << 10
        table.retire()
        assert view.retired
        assert os.fstat(fd).st_blocks * 512 <= 2 * mmap.PAGESIZE
        assert view.leading(os.urandom(32)) == 0
    finally:
        os.close(fd)


def test_a_replacement_table_is_not_left_open_when_a_later_rebuild_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened: list[PresenceTable] = []
    real_open = PresenceTable._open

    def open_twice(self, capacity):
        if len(opened) == 1:
            raise OSError(24, "Too many open files")
        opened.append(self)
        real_open(self, capacity)

    table = PresenceTable()
    monkeypatch.setattr(PresenceTable, "_open", open_twice)
    with pytest.raises(OSError):
        table.add_many(rand_keys(3 * MIN_CAPACITY))  # rebuilt twice on the way: the 2nd fails
    assert table.retired
    assert len(opened) == 1 and opened[0].retired  # the 1st replacement, never returned


class _Session:
    """What ``PresenceLink`` uses of a ``ClientSession``, over a real table."""

    presence_tables = True

    def __init__(self, table: PresenceTable) -> None:
        self.table = table

    def busy(self) -> bool:
        return False

    def quiet(self) -> bool:
        return True

    def presence(self, handle: bytes) -> tuple[int, bool]:
        return self.table.export(), False


def test_a_miss_read_from_a_table_retired_during_the_probe_is_asked_of_the_daemon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A commit may rebuild the table while a client probes it: the old one's freed pages read
    as EMPTY, so its misses are not answers (its hits are)."""
    monkeypatch.setattr(presence_link, "FLUSH_S", float("inf"))
    keys = rand_keys(200)
    table = PresenceTable(keys)
    link = presence_link.PresenceLink()
    session = _Session(table)
    packed = b"".join(keys)
    assert link.lookup(session, b"h", packed, 200) == 200  # type: ignore[arg-type]
    real = PresenceView.leading_in_cpu

    def retired_midway(view, packed):
        table.retire()  # the daemon rebuilt it just now
        return real(view, packed)

    monkeypatch.setattr(PresenceView, "leading_in_cpu", retired_midway)
    assert link.lookup(session, b"h", packed, 200) is None  # a call, not "0 found"


def test_a_table_that_cannot_be_handed_over_is_refused_and_the_session_lives_on() -> None:
    from kvstore.daemon.session import Session, SessionServer

    def out_of_descriptors(principal, handle):
        raise OSError(24, "Too many open files")

    server = SessionServer("unused", None, None, lambda d: None, 4, 0o600)  # type: ignore[arg-type]
    server.presence = out_of_descriptors
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        server._answer(ours, Session("t", None, 0, 0), b'{"op": "presence", "handle": "00"}')  # type: ignore[arg-type]
        reply = theirs.recv(4096)
        assert b'"ok": false' in reply and b"use Lookup" in reply


# ----------------------------------------------------------------------------- the store's table
@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["put", "delete"]), st.integers(0, 11), st.integers(1, 4)),
        max_size=25,
    )
)
def test_the_table_answers_what_the_daemons_lookup_answers(ops) -> None:
    """Puts (with evictions: 8 blocks of room for 15 keys), deletes; after each, the table's
    answer for every prefix equals ``BlockStore.lookup``'s."""

    async def run() -> None:
        store = make_store(capacity_blocks=8)
        try:
            handle = store.open_namespace(NS)
            view = view_of(store.presence(handle))
            all_keys = block_hashes(NS.seed, list(range(15 * 16)))
            for op, start, n in ops:
                ks = all_keys[start : start + n]
                if op == "put":
                    await put(store, handle, ks)
                else:
                    store.delete(handle, ks)
                if view.retired:
                    view = view_of(store.presence(handle))
                for first in range(0, 15, 3):
                    asked = all_keys[first:]
                    want = await store.lookup(handle, asked)
                    assert view.leading(b"".join(asked)) == want
        finally:
            store.close()

    asyncio.run(run())


async def test_a_table_that_cannot_be_rebuilt_is_dropped_and_the_commit_stands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rebuild out of memory or descriptors must not fail the commit that caused it (its
    blocks are stored) nor leave a table that misses committed keys: the table is retired (its
    clients call) and made afresh when next asked for."""
    store = make_store(capacity_blocks=2 * MIN_CAPACITY)
    try:
        handle = store.open_namespace(NS)
        view = view_of(store.presence(handle))
        ks = block_hashes(NS.seed, list(range(16 * (MIN_CAPACITY // 2 + 16))))
        assert await put(store, handle, ks[: MIN_CAPACITY // 2 - 8]) == MIN_CAPACITY // 2 - 8
        assert not view.retired

        def no_memory(self, capacity):
            raise OSError(12, "Cannot allocate memory")

        with monkeypatch.context() as m:
            m.setattr(PresenceTable, "_open", no_memory)
            assert await put(store, handle, ks[MIN_CAPACITY // 2 - 8 : MIN_CAPACITY // 2 + 8]) == 16
        assert view.retired and handle.record.presence is None
        assert await store.lookup(handle, ks[: MIN_CAPACITY // 2 + 8]) == MIN_CAPACITY // 2 + 8
        fresh = view_of(store.presence(handle))
        assert fresh.leading(b"".join(ks[: MIN_CAPACITY // 2 + 8])) == MIN_CAPACITY // 2 + 8
    finally:
        store.close()


async def test_a_freed_namespace_retires_its_table_before_its_id_is_reused() -> None:
    store = make_store()
    try:
        first = store.open_namespace(NS)
        view = view_of(store.presence(first))
        ns_id = first.ns_id
        store.close_handle(first)
        assert view.retired  # no handle, no entry: the record is gone, its table retired
        other = store.open_namespace(Namespace(model="other", layout=NS.layout, tenant="b"))
        assert other.ns_id == ns_id  # the id is reused...
        ks = block_hashes(other.record.namespace.seed, list(range(32)))
        await put(store, other, ks)
        assert view.leading(b"".join(ks)) == 0  # ...but the old table never shows its keys
    finally:
        store.close()


# ----------------------------------------------------------------------------- a real daemon
@pytest.fixture(autouse=True)
def _no_sampling_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client sends a lookup to the daemon when none went for ``FLUSH_S``; on a slow machine
    that could fall anywhere in a test, so these tests make it never due unless they say so."""
    monkeypatch.setattr(presence_link, "FLUSH_S", float("inf"))


def client(daemon, **kw) -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="presence", **kw)


@contextlib.contextmanager
def no_calls(kv) -> Iterator[None]:
    """Within it, every local call and gRPC call of ``kv`` fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the lookup made a call")

    rpc = kv._rpc
    kv._session.call = refuse
    kv._session.acall = refuse
    kv._rpc = None
    try:
        yield
    finally:
        del kv._session.call, kv._session.acall  # the class's methods again
        kv._rpc = rpc


def test_lookups_are_answered_from_the_table_and_follow_puts_deletes_and_evictions(
    daemon_factory,
) -> None:
    daemon = daemon_factory(cpu_capacity="2MiB", slab="1MiB")
    per_mib = (1 << 20) // SMALL_LAYOUT.block_bytes
    with client(daemon) as kv, client(daemon) as writer:
        keys = kv.hash_tokens(tokens(6))
        blocks = random_blocks(SMALL_LAYOUT, 6)
        assert writer.put(keys, blocks) == 6
        assert kv.lookup(keys) == 6  # maps the table
        with no_calls(kv):
            assert kv.lookup(keys) == 6
            assert kv.lookup(keys[:2] + kv.hash_tokens(tokens(1, offset=900))) == 2
            assert writer.delete(keys[3:]) == 3
            assert kv.lookup(keys) == 3  # deleted means gone, at once
            # Evicted means gone: fill the tier with other blocks until the first ones go.
            more = writer.hash_tokens(tokens(4 * per_mib, offset=1000))
            for i in range(0, len(more), 16):
                writer.put(more[i : i + 16], random_blocks(SMALL_LAYOUT, len(more[i : i + 16])))
            assert kv.lookup(keys) == 0
        assert kv._presence.answered >= 4


def test_the_table_is_the_callers_namespace_only(daemon) -> None:
    with client(daemon) as kv, client(daemon, tenant="other") as other:
        keys = kv.hash_tokens(tokens(4))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 4))
        assert kv.lookup(keys) == 4
        assert other.lookup(keys) == 0  # its own table: none of these keys
        # Another session (another principal's session) presenting kv's handle gets nothing.
        assert other._session is not None
        with pytest.raises(Exception, match="unknown namespace handle"):
            other._session.presence(kv._handle)
        # The session socket keeps serving after the refusal.
        assert other.lookup(keys) == 0 and kv.lookup(keys) == 4


def test_a_bad_presence_request_is_refused_and_the_session_serves_on(daemon) -> None:
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(2))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 2))
        sock = kv._session._sock
        for bad in (b'{"op": "presence"}', b'{"op": "presence", "handle": "zz"}'):
            sock.send(bad)
            reply = sock.recv(4096)
            assert b'"ok": false' in reply
        assert kv.lookup(keys) == 2


def test_a_due_lookup_carries_the_tally_and_pending_releases(daemon, monkeypatch) -> None:
    """Lookups answered from the table leave a get's releases waiting (as any client's do
    until its next call), for at most ``FLUSH_S``: then a lookup goes to the daemon and
    carries them, and the tally, which the daemon counts as the namespace's hits."""
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(3))
        blocks = random_blocks(SMALL_LAYOUT, 3)
        kv.put(keys, blocks)
        assert kv.lookup(keys) == 3
        answered = kv._presence.answered
        lease = kv.acquire(keys)  # a get may read from the table's places, with no lease
        lease.release()  # waits for the next call
        before = kv.stats().namespaces[0].hits
        for _ in range(5):
            assert kv.lookup(keys) == 3
        assert kv._presence.answered == answered + 5
        assert kv._releases.waiting(kv._handle)
        monkeypatch.setattr(presence_link, "FLUSH_S", 0.0)
        assert kv.lookup(keys) == 3  # due: a call, carrying the tally and the release
        assert kv._presence.answered == answered + 5
        assert not kv._releases.waiting(kv._handle)
        ns = kv.stats().namespaces[0]
        # The six table lookups counted (the first was answered before the get), and the call's.
        assert ns.hits == before + 6 * 3 + 3
        assert kv.delete(keys) == 3  # nothing leased: deleted at once
        assert kv.lookup(keys) == 0


def test_table_lookups_count_as_hits_of_the_tier_that_holds_each_block(
    daemon_factory, tmp_path, monkeypatch
) -> None:
    """The tiers' hit counts include the lookups a client answered from its table, split as
    the daemon would: blocks with a CPU copy are CPU hits, blocks only on disk NVMe hits.
    (They were counted only from the daemon's own lookups, one a second: a burst of requests
    answered from the table left the tiers at 0% while the namespace read 95%.)"""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    d = daemon_factory(cpu_capacity="256KiB", slab="64KiB", nvme_path=nvme, nvme_capacity="4MiB")
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(16))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 16, seed=1))
        filler = kv.hash_tokens(tokens(64, offset=50_000))
        blocks = random_blocks(SMALL_LAYOUT, 64, seed=2)
        for i in range(0, 64, 8):  # evicts the first keys from the CPU tier to disk
            kv.put(filler[i : i + 8], blocks[i : i + 8])
        wanted = keys + filler[-4:]  # a run with blocks on disk and blocks in memory
        wait_for(lambda: kv.lookup(wanted) == len(wanted), what="every block stored")

        def counts() -> tuple[int, int, int, int]:
            t = tiers(kv)
            return t["cpu"].hits, t["cpu"].misses, t["nvme"].hits, t["nvme"].misses

        monkeypatch.setattr(presence_link, "FLUSH_S", 0.0)  # every lookup calls
        assert kv.lookup(wanted) == len(wanted)  # carries the tally of those answered so far
        before = counts()
        assert kv.lookup(wanted) == len(wanted)
        split = tuple(a - b for a, b in zip(counts(), before, strict=True))
        assert split[0] > 0 and split[2] > 0  # some blocks in memory, some only on disk
        assert split[0] + split[2] == len(wanted) and split[1] == split[2]

        monkeypatch.setattr(presence_link, "FLUSH_S", 3600.0)
        answered = kv._presence.answered
        before = counts()
        for _ in range(3):
            assert kv.lookup(wanted) == len(wanted)
        assert kv._presence.answered == answered + 3  # answered from the table
        monkeypatch.setattr(presence_link, "FLUSH_S", 0.0)
        assert kv.lookup(wanted) == len(wanted)  # a call, carrying the tally
        assert tuple(a - b for a, b in zip(counts(), before, strict=True)) == tuple(
            4 * n for n in split
        )


def test_a_tally_claiming_more_cpu_hits_than_hits_is_refused(daemon) -> None:
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(2))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 2))
        bad = pb.LookupRequest(
            handle=kv._handle, keys=b"".join(keys), table_keys=4, table_found=2, table_in_cpu=3
        )
        with pytest.raises(grpc.RpcError) as err:
            kv._rpc.Lookup(bad, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "table_in_cpu (3) exceeds table_found (2)" in (err.value.details() or "")
        assert kv.lookup(keys) == 2


def test_a_forged_tally_is_refused_before_it_counts_and_stats_keeps_working(daemon) -> None:
    """A tally past the bound, or riding on a request refused for its keys, counts nothing.
    (A tally of 2**64 - 1 keys, sent twice, pushed the namespace's counts past uint64, and
    every later Stats that listed the namespace failed, the operator's included.)"""
    huge = (1 << 64) - 1
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(2))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 2))
        before = kv.stats().namespaces[0]
        for _ in range(2):
            forged = pb.LookupRequest(handle=kv._handle, table_keys=huge, table_found=huge)
            with pytest.raises(grpc.RpcError) as err:
                kv._rpc.Lookup(forged, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "table_keys" in (err.value.details() or "")
        bad_keys = pb.LookupRequest(
            handle=kv._handle, keys=b"x" * 33, table_keys=10, table_found=10
        )
        with pytest.raises(grpc.RpcError) as err:
            kv._rpc.Lookup(bad_keys, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        after = kv.stats().namespaces[0]
        assert (after.hits, after.misses) == (before.hits, before.misses)
        assert kv.lookup(keys) == 2
    with KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="another") as other:
        assert any(n.name.startswith("presence") for n in other.stats().namespaces)


def test_a_restarted_daemon_is_asked_not_the_dead_ones_table(daemon_factory) -> None:
    import signal

    daemon = daemon_factory()
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(4))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 4))
        assert kv.lookup(keys) == 4
        daemon.stop(signal.SIGKILL)  # no chance to retire its tables
        daemon.start()
        assert kv.lookup(keys) == 0  # the table still says 4: it is not asked
        kv.put(keys[:2], random_blocks(SMALL_LAYOUT, 2))
        assert kv.lookup(keys) == 2
        answered = kv._presence.answered
        assert kv.lookup(keys) == 2 and kv._presence.answered == answered + 1


def test_with_a_redis_tier_a_miss_is_asked_of_the_daemon(daemon_factory, redis_server) -> None:
    daemon = daemon_factory(redis_url=redis_server.url)
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(3))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 3))
        assert kv.lookup(keys) == 3
        answered = kv._presence.answered
        assert kv.lookup(keys) == 3  # a full hit is the table's
        assert kv._presence.answered == answered + 1
        missing = keys + kv.hash_tokens(tokens(1, offset=500))
        assert kv.lookup(missing) == 3  # a miss may be in Redis: asked
        assert kv._presence.answered == answered + 1


def test_without_tables_every_lookup_is_a_call(daemon, monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_PRESENCE_TABLES", "0")
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(2))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 2))
        assert kv.lookup(keys) == 2 and kv.lookup(keys) == 2
        assert kv._presence.answered == 0


async def test_the_async_client_answers_from_the_table_too(daemon) -> None:
    async with AsyncKVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="presence") as kv:
        keys = kv.hash_tokens(tokens(5))
        await kv.put(keys, random_blocks(SMALL_LAYOUT, 5))
        assert await kv.lookup(keys) == 5
        with no_calls(kv):
            assert await kv.lookup(keys) == 5
            assert await kv.lookup(keys[:1] + kv.hash_tokens(tokens(1, offset=70))) == 1
    # Closing sent the tally: the daemon counted the table's lookups.
    async with AsyncKVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="presence") as kv:
        (ns,) = [n for n in (await kv.stats()).namespaces if n.name.startswith("presence")]
        assert ns.hits == 5 + 5 + 1 and ns.misses == 1


async def test_an_async_lookup_never_blocks_the_loop_behind_another_tasks_call(daemon) -> None:
    """Asking for a table is a blocking request the daemon answers after the call in flight;
    while an asyncio call of the session waits (here on another client's write), a lookup
    calls instead of asking, and the loop runs on."""
    async with (
        AsyncKVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="presence") as kv,
        AsyncKVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="presence") as writer,
    ):
        keys = kv.hash_tokens(tokens(3))
        await kv.put(keys[:2], random_blocks(SMALL_LAYOUT, 2))
        reservation = await writer.reserve(keys[2:3])  # keys[2] is being written
        getter = asyncio.create_task(kv.get(keys))  # its acquire waits for that writer
        while not kv._session.busy():
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ticks = 0

        async def beat() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        beating = asyncio.create_task(beat())
        assert await kv.lookup(keys[:2]) == 2  # a call, waiting its turn on the loop
        beating.cancel()
        assert kv._presence.answered == 0
        assert ticks >= 1  # the loop ran while the lookup waited
        await reservation.abort()
        await getter
        assert loop.time() - t0 < 30
        assert await kv.lookup(keys[:2]) == 2 and kv._presence.answered == 1


def test_a_raw_session_cannot_get_a_table_without_a_handle(daemon) -> None:
    from kvstore.address import session_socket_path

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(session_socket_path(str(daemon.socket_path)))
    try:
        assert b'"ok": true' in sock.recv(4096)
        sock.send(b'{"op": "presence", "handle": "' + os.urandom(16).hex().encode() + b'"}')
        reply, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        assert b'"ok": false' in reply and not fds
    finally:
        sock.close()


# ----------------------------------------------------------------------------- gets from places
def test_places_follow_the_daemons_moves_and_survive_rebuilds() -> None:
    """A slot's place (address + 1) and checksum are what the daemon last said: set with the
    key, moved by ``locate``, cleared by ``unlocate`` of that very place only, gone with the
    key, and carried into every bigger table."""
    keys = rand_keys(1500)  # past the first tables' load: several rebuilds
    table = PresenceTable().add_many(keys[:10], list(range(1, 11)), list(range(100, 110)))
    view = view_of(table)
    packed = b"".join(keys[:10])
    places, sums, _ = view.places(packed)
    assert places == list(range(10)) and sums == list(range(100, 110))
    table.unlocate(keys[3], 999)  # not its place: kept
    assert len(view.places(packed)[0]) == 10
    table.unlocate(keys[3], 4)
    assert len(view.places(packed)[0]) == 3  # the leading run of keys with a place
    assert view.places(packed)[2] == 10  # the keys held, with a place or not
    assert view.leading(packed) == 10  # still committed (on another tier)
    table.locate(keys[3], 78, 7)
    places, sums, _ = view.places(packed)
    assert places[3] == 77 and sums[3] == 7
    table.remove(keys[5])
    assert len(view.places(packed)[0]) == 5
    assert view.places(packed)[2] == 5  # the run ends at a key the table does not hold
    for i, k in enumerate(keys[10:700]):
        table = table.add(k, 1000 + i, i)
    rest = keys[700:]
    table = table.add_many(rest, [5000 + i for i in range(len(rest))], list(range(len(rest))))
    assert view.retired
    view = view_of(table)
    places, sums, _ = view.places(b"".join(keys[6:]))
    assert len(places) == len(keys) - 6
    assert places[:4] == [6, 7, 8, 9] and sums[:4] == [106, 107, 108, 109]
    assert places[4:694] == list(range(999, 1689))
    assert places[694:] == list(range(4999, 4999 + len(rest)))
    assert view.places(keys[3] + keys[4])[0] == [77, 4]


def test_a_run_walked_key_by_key_reads_places_as_one_probed_with_numpy() -> None:
    """A run that ends at its first key is walked (``WALK_KEYS``), a longer one probed with
    numpy: both give the place and checksum of each key held, stop at the first key without
    a place, and count the keys held with a place or not."""
    keys = rand_keys(3)
    table = PresenceTable().add_many(keys[:2], [11, 12], [101, 102])
    view = view_of(table)
    assert view.places(keys[0]) == ([10], [101], 1)
    assert view.places(keys[2]) == ([], [], 0)  # not held
    assert view.places(keys[0] + keys[1]) == ([10, 11], [101, 102], 2)
    table.unlocate(keys[1], 12)
    assert view.places(keys[1]) == ([], [], 1)  # held, with no place
    assert view.places(keys[0] + keys[1] + keys[2]) == ([10], [101], 2)
    assert view.leading_in_cpu(keys[0]) == (1, 1) and view.leading_in_cpu(keys[1]) == (1, 0)
    assert view.leading_in_cpu(keys[0] + keys[1] + keys[2]) == (2, 1)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "delete", "lease", "release"]),
            st.integers(0, 11),
            st.integers(1, 4),
        ),
        max_size=20,
    )
)
def test_the_tables_places_are_where_the_daemon_keeps_each_block(ops) -> None:
    """Through puts, evictions, deletes (of leased blocks too) and releases, every place the
    table gives is the address and checksum of that key's CPU copy that an ``acquire`` would
    hand out, and the store's books hold."""

    async def run() -> None:
        store = make_store(capacity_blocks=8)
        try:
            handle = store.open_namespace(NS)
            all_keys = block_hashes(NS.seed, list(range(15 * 16)))
            leases: list[int] = []
            for op, start, n in ops:
                ks = all_keys[start : start + n]
                if op == "put":
                    try:
                        await put(store, handle, ks, fill=start + 1)
                    except CapacityError as exc:  # the tier is all leased: refused, none kept
                        assert "max_pinned" in str(exc) or "leased" in str(exc), exc
                elif op == "delete":
                    store.delete(handle, ks)
                elif op == "lease":
                    try:
                        result = await store.acquire(handle, ks)
                    except CapacityError as exc:  # past the tenant's pinned share: refused
                        assert "max_pinned" in str(exc), exc
                    else:
                        if result.lease_id:
                            leases.append(result.lease_id)
                elif leases:
                    store.release(handle, leases.pop(0))
                store.check()
                view = view_of(store.presence(handle))
                for key in all_keys:
                    places, sums, _ = view.places(key)
                    eid = store.ledger.committed(handle.ns_id, key)
                    if eid is None:
                        assert len(places) == 0
                        continue
                    (address,) = store.arena.addresses([store.index.offset[eid]])
                    assert places == [address]
                    assert sums == [store.index.checksum[eid]]
                view.close()
        finally:
            store.close()

    asyncio.run(run())


def test_gets_read_blocks_from_the_table_with_no_call(daemon) -> None:
    with client(daemon) as kv, client(daemon) as writer:
        keys = kv.hash_tokens(tokens(6))
        blocks = random_blocks(SMALL_LAYOUT, 6, seed=3)
        assert writer.put(keys, blocks) == 6
        assert same_bytes(kv.get(keys), blocks)  # maps the table and the slabs
        served = kv._presence.served
        with no_calls(kv):
            assert same_bytes(kv.get(keys), blocks)
            out = torch.zeros_like(blocks)
            got = kv.get(keys[2:5], out=out[:3])
            assert same_bytes(got, blocks[2:5]) and same_bytes(out[:3], blocks[2:5])
            assert writer.delete(keys[4:]) == 2
            assert same_bytes(kv.get(keys[:4]), blocks[:4])
        assert kv._presence.served == served + 3
        assert same_bytes(kv.get(keys), blocks[:4])  # deleted means gone: a call, a miss


def test_a_place_whose_bytes_changed_is_never_served(daemon) -> None:
    """The table says where a block was; the copy is what is checked. A slot scribbled on
    (reused, rewritten) is a miss from that block on, never its bytes."""
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(4))
        blocks = random_blocks(SMALL_LAYOUT, 4, seed=5)
        kv.put(keys, blocks)
        assert same_bytes(kv.get(keys), blocks)
        view = kv._presence._view
        assert view is not None
        places, _, _ = view.places(b"".join(keys))
        slot = kv._arena.slot(int(places[2]), SMALL_LAYOUT.block_bytes)
        slot[100] ^= 0xFF
        served = kv._presence.served
        got = kv.get(keys)
        assert same_bytes(got, blocks[:2])
        assert kv._presence.served == served + 1  # the table's two, then the call's miss
        assert same_bytes(kv.get(keys[1:]), blocks[1:2])  # and so again, from that block on


def test_a_block_evicted_to_disk_is_read_through_a_call_then_from_its_new_place(
    daemon_factory, tmp_path
) -> None:
    daemon = daemon_factory(
        cpu_capacity="1MiB", slab="512KiB", nvme_path=tmp_path / "nvme", nvme_capacity="8MiB"
    )
    per_mib = (1 << 20) // SMALL_LAYOUT.block_bytes
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(4))
        blocks = random_blocks(SMALL_LAYOUT, 4, seed=7)
        kv.put(keys, blocks)
        assert same_bytes(kv.get(keys), blocks)
        more = kv.hash_tokens(tokens(2 * per_mib, offset=5000))
        for i in range(0, len(more), 16):
            kv.put(more[i : i + 16], random_blocks(SMALL_LAYOUT, len(more[i : i + 16]), seed=i))
        assert kv.lookup(keys) == 4  # still stored, on disk
        view = kv._presence._view
        assert view is not None
        assert len(view.places(b"".join(keys))[0]) == 0  # no CPU copy: no place
        served = kv._presence.served
        assert same_bytes(kv.get(keys), blocks)  # a call: promoted into the CPU tier
        assert kv._presence.served == served
        with no_calls(kv):
            assert same_bytes(kv.get(keys), blocks)  # from the new places
        assert kv._presence.served == served + 1


def older_and_newer(kv) -> tuple[list[bytes], list[bytes]]:
    """Two runs of 4 blocks, put in that order."""
    old = kv.hash_tokens(tokens(4))
    new = kv.hash_tokens(tokens(4, offset=1000))
    kv.put(old, random_blocks(SMALL_LAYOUT, 4, seed=1))
    kv.put(new, random_blocks(SMALL_LAYOUT, 4, seed=2))
    return old, new


def test_blocks_read_from_the_table_count_as_read_for_eviction(daemon_factory, monkeypatch) -> None:
    """The keys a client read itself ride on its next acquire: the LRU policy keeps them
    over blocks written after them but not read since."""
    daemon = daemon_factory(cpu_capacity="1MiB", slab="512KiB")
    with client(daemon) as kv:
        old, new = older_and_newer(kv)
        served = kv._presence.served
        for _ in range(3):
            assert kv.get(old).shape[0] == 4
        assert kv._presence.served == served + 3
        monkeypatch.setattr(presence_link, "FLUSH_S", 0.0)
        assert kv.get(kv.hash_tokens(tokens(1, offset=9000))).shape[0] == 0  # carries them
        monkeypatch.setattr(presence_link, "FLUSH_S", float("inf"))
        offset = 20000
        while kv.lookup(new) == 4:
            kv.put(kv.hash_tokens(tokens(1, offset=offset)), random_blocks(SMALL_LAYOUT, 1))
            offset += 16
        assert kv.lookup(old) == 4


async def test_the_async_client_reads_from_the_table_too(daemon) -> None:
    async with AsyncKVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="presence") as kv:
        keys = kv.hash_tokens(tokens(5))
        blocks = random_blocks(SMALL_LAYOUT, 5, seed=9)
        await kv.put(keys, blocks)
        assert same_bytes(await kv.get(keys), blocks)
        with no_calls(kv):
            assert same_bytes(await kv.get(keys), blocks)
        assert kv._presence.served >= 2


def test_a_paged_load_reads_cpu_caches_from_the_table_and_checks_every_copy(daemon) -> None:
    layout = SMALL_LAYOUT
    shape = (2, 12, layout.block_size, layout.num_kv_heads, layout.head_dim)
    g = torch.Generator().manual_seed(11)
    src = [torch.randn(shape, generator=g).to(layout.dtype) for _ in range(layout.num_layers)]

    def fresh() -> list[torch.Tensor]:
        return [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)]

    def same(a: list[torch.Tensor], b: list[torch.Tensor], src_ids, dst_ids) -> bool:
        return all(
            torch.equal(x[:, s], y[:, d])
            for x, y in zip(a, b, strict=True)
            for s, d in zip(src_ids, dst_ids, strict=True)
        )

    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(6))
        assert kv.offload(src, list(range(6)), keys) == 6
        dst = fresh()
        assert kv.load(dst, list(range(6)), keys) == 6  # maps the table
        served = kv._presence.served
        dst = fresh()
        with no_calls(kv):
            assert kv.load(dst, [11, 10, 9, 8, 7, 6], keys) == 6
        assert kv._presence.served == served + 1
        assert same(src, dst, range(6), [11, 10, 9, 8, 7, 6])
        view = kv._presence._view
        assert view is not None
        places, _, _ = view.places(b"".join(keys))
        kv._arena.slot(int(places[4]), layout.block_bytes)[7] ^= 0x10
        dst = fresh()
        assert kv.load(dst, list(range(6)), keys) == 4  # block 4 fails its check, then a call
        assert same(src, dst, range(4), range(4))


async def test_a_leased_block_deleted_then_released_frees_its_slot() -> None:
    """A block deleted while leased is an orphan (its key gone with the delete) until its
    last lease goes; freeing its slot then must not look its key up for the table."""
    store = make_store(capacity_blocks=8)
    try:
        handle = store.open_namespace(NS)
        store.presence(handle)
        ks = block_hashes(NS.seed, list(range(2 * 16)))
        assert await put(store, handle, ks) == 2
        lease = await store.acquire(handle, ks)
        assert store.delete(handle, ks) == 2
        store.release(handle, lease.lease_id)
        store.check()
        assert store.cpu_slots.used_bytes == 0
    finally:
        store.close()


async def test_a_deleted_key_has_no_place_though_another_key_shares_its_fingerprint() -> None:
    """Two keys that share their first 8 bytes hold two slots of one fingerprint; deleting
    one must leave no place a reader of it could still copy (its slot is intact while a lease
    holds it), whichever slot the delete marks gone."""
    store = make_store(capacity_blocks=8)
    try:
        handle = store.open_namespace(NS)
        view = view_of(store.presence(handle))
        prefix = os.urandom(8)
        a, b = prefix + os.urandom(24), prefix + os.urandom(24)
        assert await put(store, handle, [a], fill=1) == 1
        assert await put(store, handle, [b], fill=2) == 1
        lease = await store.acquire(handle, [b])
        assert store.delete(handle, [b]) == 1
        assert len(view.places(b)[0]) == 0
        store.release(handle, lease.lease_id)
        store.check()
    finally:
        store.close()


def test_a_paged_load_counts_only_blocks_whose_copy_verified(monkeypatch) -> None:
    """What lands in the caches is what was checked: a copy that differs from its slot (a
    slot rewritten during the copy, then put back) is not counted, though the slot verifies."""
    from kvstore.client import paged_io

    layout = SMALL_LAYOUT
    blocks = random_blocks(layout, 4, seed=13)
    shape = (2, 8, layout.block_size, layout.num_kv_heads, layout.head_dim)
    caches = [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)]
    seeds = [1000 + i for i in range(4)]
    sums = [
        xxhash.xxh3_64_intdigest(blocks[i].contiguous().view(torch.uint8).numpy(), seed=seeds[i])
        for i in range(4)
    ]
    real = np.copyto
    copies = [0]

    def torn(dst, src, *args, **kwargs):
        real(dst, src, *args, **kwargs)
        copies[0] += 1
        if copies[0] == 1:
            dst.flat[0] ^= 1  # the first copy made is not what its slot holds now

    monkeypatch.setattr(np, "copyto", torn)
    loaded = paged_io.scatter_with_checksums(list(blocks), caches, [0, 1, 2, 3], sums, seeds)
    monkeypatch.undo()
    assert loaded is not None
    for i in range(loaded):
        got = torch.stack([c[:, i] for c in caches])
        assert same_bytes(got, blocks[i])


def test_keys_sharing_a_fingerprint_merged_by_a_rebuild_set_overflow() -> None:
    """A rebuilt table keeps one slot per fingerprint: removing one of two keys that share it
    would make the other a miss the daemon calls a hit, so misses go to the daemon."""
    prefix = os.urandom(8)
    a, b = prefix + os.urandom(24), prefix + os.urandom(24)
    assert not PresenceTable([os.urandom(32), a]).overflow
    table = PresenceTable([a, b])
    assert table.overflow


def test_a_table_built_whole_is_at_most_half_full_and_finds_every_key() -> None:
    """Memory finding: tables were built and rebuilt a quarter full, so a table built from a
    namespace's keys, or grown past half full, took four times its keys' slots, not two (at
    a million keys 101 bytes a key instead of 50)."""
    keys = block_hashes(NS.seed, list(range(16 * 1500)))
    table = PresenceTable(keys)
    try:
        assert table.capacity == 4096  # 1,500 keys: half full at most, not a quarter
        assert not table.overflow and table.count == 1500
        view = view_of(table)
        assert view.leading(b"".join(keys)) == 1500
        view.close()
        more = block_hashes(NS.seed, list(range(16 * 1500, 16 * 2100)))
        grown = table.add_many(more)  # past half full: rebuilt twice as big, not four times
        assert grown is not table and grown.count == 2100 and grown.capacity == 8192
        table = grown
        view = view_of(table)
        assert view.leading(b"".join(keys + more)) == 2100
        view.close()
    finally:
        table.retire()


def test_a_get_whose_run_ends_at_a_key_nobody_holds_makes_no_call(daemon) -> None:
    """Where the table is the whole answer (no Redis tier, no overflow, nothing being
    written), a get's misses need no call either: the leading blocks come from their places
    and the rest is what the daemon would answer, nothing. (Every get with a miss used to
    call, ~40% of a replayed request's time.)"""
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(6))
        blocks = random_blocks(SMALL_LAYOUT, 4, seed=13)
        assert kv.put(keys[:4], blocks) == 4
        assert same_bytes(kv.get(keys[:4]), blocks)  # maps the table and the slabs
        with no_calls(kv):
            got = kv.get(keys)
            assert same_bytes(got, blocks)
            # Sized for the blocks found, not the keys asked (a few hits of a long chain
            # held a buffer for the whole chain).
            assert got.untyped_storage().nbytes() == 4 * SMALL_LAYOUT.block_bytes
            assert kv.get(keys[4:]).shape[0] == 0
            out = torch.zeros_like(random_blocks(SMALL_LAYOUT, 6))
            assert same_bytes(kv.get(keys, out=out), blocks)
            assert kv.get(keys[4:], out=out[:2]).shape[0] == 0
        assert kv.delete(keys[2:3]) == 1
        with no_calls(kv):
            assert same_bytes(kv.get(keys), blocks[:2])  # deleted means gone


def test_a_get_meeting_a_key_being_written_asks_the_daemon_which_waits_for_it(daemon) -> None:
    """Read your writes holds on the table path too: a key another client has reserved and
    not committed is not in the table, and a get that misses there while any key is being
    written calls, so the daemon waits for the commit as it always did."""
    with client(daemon) as kv, client(daemon) as writer:
        keys = kv.hash_tokens(tokens(3))
        blocks = random_blocks(SMALL_LAYOUT, 3, seed=17)
        assert writer.put(keys[:2], blocks[:2]) == 2
        assert same_bytes(kv.get(keys[:2]), blocks[:2])  # maps the table and the slabs
        reservation = writer.reserve(keys)
        assert reservation.indices == [2]
        reservation.views[0].copy_(blocks[2])
        view = kv._presence._view
        assert view is not None and view.writing
        timer = threading.Timer(0.3, reservation.commit)
        timer.start()
        try:
            assert same_bytes(kv.get(keys), blocks)  # waited for the commit
        finally:
            timer.join()
        assert not view.writing
        with no_calls(kv):
            assert same_bytes(kv.get(keys), blocks)


def test_the_tables_writing_count_follows_reserves_commits_aborts_and_binds(daemon) -> None:
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(8))
        blocks = random_blocks(SMALL_LAYOUT, 8, seed=19)
        kv.put(keys[:1], blocks[:1])
        assert kv.lookup(keys[:1]) == 1  # maps the table
        view = kv._presence._view
        assert view is not None and not view.writing
        reservation = kv.reserve(keys[1:3])
        assert view.writing
        reservation.abort()
        assert not view.writing
        with kv.reserve(keys[1:3]) as reservation:
            for v, b in zip(reservation.views, blocks[1:3], strict=True):
                v.copy_(b)
            assert view.writing
        assert not view.writing
        for i in range(3, 8):  # a run of puts: the later ones bind spare slots
            kv.put(keys[i : i + 1], blocks[i : i + 1])
            assert not kv._presence._view.writing
        assert kv._spare.binds >= 1
        assert same_bytes(kv.get(keys), blocks)


def test_a_put_carries_the_reads_made_from_the_table_before_it_evicts(
    daemon_factory, monkeypatch
) -> None:
    """Blocks read with no call count as read before the next put makes room: the LRU
    policy evicts the blocks written after them and never read, not them. (Carried only by
    an Acquire, at most a second later, they went first: the trace replay's LRU hit rate
    fell from 0.996x to 0.98x its simulation once gets with misses stopped calling.)"""
    monkeypatch.setattr(presence_link, "FLUSH_S", float("inf"))
    daemon = daemon_factory(cpu_capacity="1MiB", slab="512KiB")
    with client(daemon) as kv:
        old, new = older_and_newer(kv)
        assert kv.get(old).shape[0] == 4  # maps the table and slabs (may call)
        served = kv._presence.served
        with no_calls(kv):
            for _ in range(2):
                assert kv.get(old).shape[0] == 4
        assert kv._presence.served == served + 2
        offset = 20000
        while kv.lookup(new) == 4:
            kv.put(kv.hash_tokens(tokens(1, offset=offset)), random_blocks(SMALL_LAYOUT, 1))
            offset += 16
        assert kv.lookup(old) == 4


def test_a_paged_load_whose_run_ends_at_a_missing_key_makes_no_call(daemon) -> None:
    layout = SMALL_LAYOUT
    shape = (2, 8, layout.block_size, layout.num_kv_heads, layout.head_dim)
    g = torch.Generator().manual_seed(23)
    src = [torch.randn(shape, generator=g).to(layout.dtype) for _ in range(layout.num_layers)]
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(5))
        assert kv.offload(src, [0, 1, 2], keys[:3]) == 3
        dst = [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)]
        assert kv.load(dst, [0, 1, 2], keys[:3]) == 3  # maps the table
        dst = [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)]
        with no_calls(kv):
            assert kv.load(dst, [7, 6, 5, 4, 3], keys) == 3
            assert kv.load(dst, [1, 2], keys[3:]) == 0
        assert all(
            torch.equal(x[:, s], y[:, d])
            for x, y in zip(src, dst, strict=True)
            for s, d in zip([0, 1, 2], [7, 6, 5], strict=True)
        )


def test_a_commit_during_the_probe_never_makes_a_miss_of_a_key_being_written() -> None:
    """The table's ``writing`` count is read before the probe: a commit landing during the
    probe adds its key, then counts it written, so a key being written when the get began is
    seen in the table or in the count, and the get calls (the daemon's Acquire waits for the
    commit and returns it). Read after the probe, both could miss it: the get returned one
    block with no call where the daemon gives two."""
    a, k = b"\x11" * 32, b"\x22" * 32
    table = PresenceTable().add(a, place=4097, checksum=123)
    table.set_writing(1)  # k reserved by another client
    view = view_of(table)

    class CommitDuringTheProbe:
        def __getattr__(self, name):
            return getattr(view, name)

        def places(self, packed):
            found = view.places(packed)  # k not committed yet
            table.add(k, place=8193, checksum=456)  # the daemon's commit: added, then ...
            table.set_writing(0)  # ... no longer being written
            return found

    link = presence_link.PresenceLink()
    link._ask_on_miss = False  # no Redis tier
    link._view_for = lambda *args: CommitDuringTheProbe()
    placed = link.places(None, b"h", a + k, 2)
    assert placed is not None and len(placed.addresses) == 1
    assert not placed.whole  # the rest is asked of the daemon
