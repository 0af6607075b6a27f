"""Block events (``watch_blocks``), as a router's feed meets them: a real daemon process, real
puts, evictions, deletes and disk copies; the picture built from the events must be the
daemon's, block for block."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
from conftest import SMALL_LAYOUT, random_blocks, tokens, wait_for

from kvstore import KVLayout, KVStoreClient
from kvstore.client.block_watch import BlockEventReader, BlockEvents
from kvstore.daemon.block_events import BlockEventFeed
from kvstore.errors import CapacityError
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16)
"""512-byte blocks: thousands of them fit a small CPU tier."""


def client(daemon, layout: KVLayout = SMALL_LAYOUT, **kw) -> KVStoreClient:
    kw.setdefault("model", "events-model")
    return KVStoreClient(daemon.address, layout=layout, **kw)


class Picture:
    """What a subscriber believes: key -> tiers, built from a watch on its own thread."""

    def __init__(self, kv: KVStoreClient) -> None:
        self.watch = kv.watch_blocks()
        self.blocks: dict[bytes, frozenset[str]] = {}
        self.batches: list[BlockEvents] = []
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for events in self.watch:
                with self.lock:
                    self.batches.append(events)
                    if events.reset:
                        self.blocks.clear()
                    for key, tiers in events.blocks:
                        if tiers:
                            self.blocks[key] = tiers
                        else:
                            self.blocks.pop(key, None)
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def now(self) -> dict[bytes, frozenset[str]]:
        with self.lock:
            return dict(self.blocks)

    def close(self) -> None:
        self.watch.close()
        self.thread.join(timeout=10)


def snapshot(kv: KVStoreClient) -> dict[bytes, frozenset[str]]:
    """The daemon's own picture: the first (snapshot) message of a fresh watch."""
    with kv.watch_blocks() as watch:
        first = next(iter(watch))
    assert first.reset
    return {key: tiers for key, tiers in first.blocks if tiers}


def test_a_watch_opens_with_a_snapshot_then_follows_commits_and_deletes(daemon) -> None:
    blocks = random_blocks(SMALL_LAYOUT, 12, seed=3)
    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(12))
        kv.put(keys[:4], blocks[:4])
        picture = Picture(kv)
        try:
            wait_for(lambda: picture.batches, what="the first snapshot")
            assert picture.batches[0].reset and picture.batches[0].resets == 0
            assert picture.now() == dict.fromkeys(keys[:4], frozenset({"cpu"}))
            kv.put(keys[4:], blocks[4:])
            wait_for(lambda: len(picture.now()) == 12, what="the puts' events")
            assert kv.delete(keys[2:5]) == 3
            gone = set(keys[2:5])
            wait_for(lambda: not gone & picture.now().keys(), what="the deletes' events")
            assert picture.now() == {k: frozenset({"cpu"}) for k in keys if k not in gone}
            assert picture.now() == snapshot(kv)
            assert picture.error is None
        finally:
            picture.close()


def test_evictions_are_told_and_the_picture_is_the_daemons(daemon_factory) -> None:
    # 1 MiB of CPU tier holds 128 blocks of 8 KiB: 400 puts evict most of them.
    daemon = daemon_factory(cpu_capacity="1MiB")
    with client(daemon) as kv:
        picture = Picture(kv)
        try:
            wait_for(lambda: picture.batches, what="the first snapshot")
            keys = kv.hash_tokens(tokens(400))
            for i in range(0, 400, 20):
                kv.put(keys[i : i + 20], random_blocks(SMALL_LAYOUT, 20, seed=i))
            held = {k for k in keys if kv.lookup([k]) == 1}
            assert 0 < len(held) < 400  # eviction happened
            wait_for(lambda: picture.now().keys() == held, what="the picture to settle")
            assert picture.now() == snapshot(kv)
            removed = {k for e in picture.batches for k, tiers in e.blocks if not tiers}
            assert removed == set(keys) - held  # every eviction was told as a removal
        finally:
            picture.close()


def test_a_move_to_disk_is_a_store_there_and_a_removal_from_memory(
    daemon_factory, tmp_path: Path
) -> None:
    daemon = daemon_factory(
        cpu_capacity="1MiB", nvme_path=tmp_path / "nvme", nvme_capacity="8MiB", write_through=True
    )
    with client(daemon) as kv:
        picture = Picture(kv)
        try:
            keys = kv.hash_tokens(tokens(300))
            for i in range(0, 300, 20):
                kv.put(keys[i : i + 20], random_blocks(SMALL_LAYOUT, 20, seed=i))
            # Written through in the background: wait until every block is on disk.
            wait_for(
                lambda: all("nvme" in t for t in snapshot(kv).values()),
                what="the writes through to disk",
            )
            wait_for(
                lambda: picture.now() == snapshot(kv) and len(picture.now()) == 300,
                what="the picture to match the daemon's",
            )
            tiers = set(picture.now().values())
            # Every block is on disk; the older ones left memory.
            assert tiers == {frozenset({"nvme"}), frozenset({"cpu", "nvme"})}
            on_disk_only = [k for k, t in picture.now().items() if t == {"nvme"}]
            told = [t for e in picture.batches for k, t in e.blocks if k == on_disk_only[0]]
            # Events are states: steps taken within one interval (in memory, on disk too,
            # evicted from memory) may be told as the last alone, never out of order.
            assert told[-1] == {"nvme"}
        finally:
            picture.close()


def test_a_watch_sees_only_its_own_namespace(daemon) -> None:
    with client(daemon) as kv, client(daemon, model="another-model") as other:
        picture = Picture(kv)
        try:
            mine = kv.hash_tokens(tokens(3))
            theirs = other.hash_tokens(tokens(5, offset=100))
            other.put(theirs, random_blocks(SMALL_LAYOUT, 5))
            kv.put(mine, random_blocks(SMALL_LAYOUT, 3))
            wait_for(lambda: len(picture.now()) == 3, what="the puts' events")
            other.put(other.hash_tokens(tokens(2, offset=200)), random_blocks(SMALL_LAYOUT, 2))
            kv.delete(mine[2:])
            wait_for(lambda: len(picture.now()) == 2, what="the delete's event")
            assert set(picture.now()) == set(mine[:2])
            assert not {k for e in picture.batches for k, _ in e.blocks} & set(theirs)
        finally:
            picture.close()


def test_a_large_snapshot_arrives_in_parts_as_one_reset(daemon_factory) -> None:
    daemon = daemon_factory(cpu_capacity="64MiB")  # 5,000 blocks in their smallest slots
    with client(daemon, TINY) as kv:
        keys = kv.hash_tokens(tokens(5000))
        for i in range(0, 5000, 500):
            kv.put(keys[i : i + 500], random_blocks(TINY, 500, seed=i))
        # The raw stream: the snapshot spans two messages (4,096 blocks each at most).
        stub = pb_grpc.KVStoreStub(kv._channel)
        call = stub.WatchBlocks(pb.WatchBlocksRequest(handle=kv._handle), timeout=60)
        first, second = next(call), next(call)
        call.cancel()
        assert first.reset and not first.snapshot_end and len(first.tiers) == 4096
        assert not second.reset and second.snapshot_end and len(second.tiers) == 904
        assert kv.lookup(keys) == 5000 and snapshot(kv).keys() == set(keys)


def test_the_watch_ends_with_its_client_and_a_bad_handle_is_refused(daemon) -> None:
    kv = client(daemon)
    watch = kv.watch_blocks()
    events = iter(watch)
    assert next(events).reset
    kv.close()
    assert list(events) == []  # the handle closed: the stream ended, no error
    with client(daemon) as kv2:
        stub = pb_grpc.KVStoreStub(kv2._channel)
        with pytest.raises(grpc.RpcError) as err:
            next(stub.WatchBlocks(pb.WatchBlocksRequest(handle=b"\x01" * 16)))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "handle" in err.value.details()
        keys = kv2.hash_tokens(tokens(2))
        assert kv2.put(keys, random_blocks(SMALL_LAYOUT, 2)) == 2  # still serving


def test_one_caller_holds_at_most_a_quarter_of_the_watches(daemon) -> None:
    with client(daemon) as kv:
        watches = [kv.watch_blocks() for _ in range(64)]
        try:
            for watch in watches:
                assert next(iter(watch)).reset
            with pytest.raises(CapacityError, match="quarter"):
                next(iter(kv.watch_blocks()))
            watches.pop().close()
            wait_for(lambda: _watch_opens(kv), what="a watch to be had again")
        finally:
            for watch in watches:
                watch.close()


def _watch_opens(kv: KVStoreClient) -> bool:
    try:
        with kv.watch_blocks() as watch:
            return next(iter(watch)).reset
    except CapacityError:
        return False


# ----------------------------------------------------------------------- the parts, in process
def test_a_watcher_that_falls_behind_is_reset_to_a_snapshot() -> None:
    feed = BlockEventFeed(limit=4)
    owner = object()
    watcher = feed.watch(7, owner, "uid:1")
    state = {b"a" * 32: 1}
    reset, blocks = watcher.take(lambda ns: list(state.items()))
    assert reset and blocks == [(b"a" * 32, 1)]
    feed.note(7, b"b" * 32, 1)
    feed.note(7, b"b" * 32, 3)  # changed twice: told once, with its latest tiers
    feed.note(8, b"c" * 32, 1)  # another namespace
    assert watcher.take(lambda ns: []) == (False, [(b"b" * 32, 3)])
    for i in range(5):  # one more than its queue holds
        feed.note(7, bytes([i]) * 32, 1)
    state = {b"z" * 32: 2}
    reset, blocks = watcher.take(lambda ns: list(state.items()))
    assert reset and blocks == [(b"z" * 32, 2)] and watcher.resets == 1
    feed.close_owner(owner)
    assert watcher.closed and not feed.watched


def test_the_reader_refuses_a_batch_whose_keys_and_tiers_disagree() -> None:
    reader = BlockEventReader()
    with pytest.raises(ValueError, match="key bytes"):
        reader.feed(pb.BlockEventBatch(keys=b"k" * 33, tiers=b"\x01"))
    events = reader.feed(pb.BlockEventBatch(keys=b"k" * 32, tiers=b"\x03"))
    assert events == BlockEvents(False, [(b"k" * 32, frozenset({"cpu", "nvme"}))], 0)


async def test_a_snapshot_read_in_parts_skips_blocks_gone_or_replaced_meanwhile() -> None:
    """A snapshot's tiers are read a part at a time (the daemon serves others in between): a
    block deleted before its part is read is left out, even when its entry already holds
    another key, and its removal comes after the snapshot."""
    from test_store import NS, keys, make_store, put

    store = make_store(capacity_blocks=16)
    try:
        handle = store.open_namespace(NS)
        ks = keys(4)
        await put(store, handle, ks)
        watcher = store.watch_blocks(handle, "uid:1")
        reset, items = store.watched_batch(watcher)
        assert reset and [k for k, _ in items] == ks
        assert store.delete(handle, ks[:1]) == 1
        await put(store, handle, keys(1, start=9))  # may take the deleted block's entry
        part = store.snapshot_part(watcher, items)
        assert [k for k, _ in part] == ks[1:]
        reset, changes = store.watched_batch(watcher)
        assert not reset and (ks[0], 0) in changes and (keys(1, start=9)[0], 1) in changes
        store.unwatch_blocks(watcher)
        store.check()
    finally:
        store.close()
