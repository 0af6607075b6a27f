"""What the two client faces share, tested once for both: every test runs against
``KVStoreClient`` and ``AsyncKVStoreClient`` (the same core, ``kvstore.client.core``) with a real
daemon, real shared memory and real tensors."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import SMALL_LAYOUT, random_blocks, same_bytes, tokens

from kvstore import AsyncKVStoreClient, KVStoreClient
from kvstore.client import presence_link
from kvstore.client.local_stub import AsyncLocalStub, LocalStub
from kvstore.errors import KVStoreError, UnavailableError


class Face:
    """One client, either face, with every call made blocking (``done`` resolves what a call of
    the async face, or of its leases and reservations, returns)."""

    def __init__(self, kind: str, address: str, **kwargs: Any) -> None:
        kwargs.setdefault("layout", SMALL_LAYOUT)
        kwargs.setdefault("model", "faces")
        self.kind = kind
        self.loop: asyncio.AbstractEventLoop | None = None
        if kind == "sync":
            self.kv: Any = KVStoreClient(address, **kwargs)
        else:
            self.loop = asyncio.new_event_loop()
            self.kv = self.loop.run_until_complete(AsyncKVStoreClient.connect(address, **kwargs))

    def done(self, value: Any) -> Any:
        if inspect.isawaitable(value):
            assert self.loop is not None
            return self.loop.run_until_complete(value)
        return value

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.kv, name)
        if not callable(attr):
            return attr
        return lambda *args, **kwargs: self.done(attr(*args, **kwargs))

    def close(self) -> None:
        self.done(self.kv.close())
        if self.loop is not None:
            self.loop.close()


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def face(kind: str, daemon) -> Iterator[Face]:
    f = Face(kind, daemon.address)
    yield f
    f.close()


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_blocks_round_trip_and_puts_deduplicate(kind, daemon, transport: str) -> None:
    f = Face(kind, daemon.address, transport=transport)
    try:
        assert f.uses_shared_memory == (transport == "shm")
        keys = f.hash_tokens(tokens(5))
        blocks = random_blocks(SMALL_LAYOUT, 5)
        assert f.put(keys[:3], blocks[:3]) == 3
        assert f.put(keys, blocks) == 2  # present keys are deduplicated
        assert same_bytes(f.get(keys), blocks)
        out = torch.empty_like(blocks)
        got = f.get(keys, out=out)
        assert got.data_ptr() == out.data_ptr() and same_bytes(out, blocks)
        assert f.lookup(keys) == 5
        missing = f.hash_tokens(tokens(7))  # blocks 5 and 6 were never stored
        assert f.lookup(missing) == 5 and f.get(missing).shape[0] == 5
        assert f.delete(keys[2:]) == 3
        assert f.lookup(keys) == 2 and f.get(keys).shape[0] == 2  # deleted means gone
    finally:
        f.close()


def test_bad_arguments_raise_before_anything_moves(face: Face) -> None:
    keys = face.hash_tokens(tokens(2))
    with pytest.raises(ValueError, match="32"):
        face.put([b"short", keys[1]], random_blocks(SMALL_LAYOUT, 2))
    with pytest.raises(ValueError, match="sequence"):
        face.lookup(keys[0])  # one bytes object, not a list of keys
    with pytest.raises(ValueError, match="keys but"):
        face.put(keys, random_blocks(SMALL_LAYOUT, 3))
    with pytest.raises(ValueError, match="priority"):
        face.put(keys, random_blocks(SMALL_LAYOUT, 2), priority=300)
    assert face.lookup(keys) == 0  # none of them stored anything


def test_a_corrupt_slot_is_a_miss(face: Face) -> None:
    keys = face.hash_tokens(tokens(3))
    blocks = random_blocks(SMALL_LAYOUT, 3, seed=4)
    face.put(keys, blocks)
    lease = face.acquire(keys)
    face._arena.slot(lease.offsets[1], SMALL_LAYOUT.block_bytes)[7] ^= 0x10
    face.done(lease.release())
    got = face.get(keys)
    assert got.shape[0] == 1 and same_bytes(got, blocks[:1])


def test_reservations_commit_or_abort(face: Face) -> None:
    keys = face.hash_tokens(tokens(2))
    blocks = random_blocks(SMALL_LAYOUT, 2, seed=6)
    res = face.reserve(keys)
    for j, view in enumerate(res.views):
        view.copy_(blocks[res.indices[j]])
    assert face.lookup(keys) == 0  # nothing visible before commit
    assert face.done(res.commit()) == 2
    assert same_bytes(face.get(keys), blocks)
    with pytest.raises(KVStoreError, match="already committed"):
        face.done(res.commit())
    other = face.hash_tokens(tokens(3))[2:]
    res = face.reserve(other)
    face.done(res.abort())
    assert face.lookup(other) == 0 and face.stats().active_reservations == 0


def test_a_reads_release_rides_on_the_next_call(face: Face, monkeypatch) -> None:
    monkeypatch.setattr(presence_link, "FLUSH_S", 0.0)  # the get leases (not from the table)
    keys = face.hash_tokens(tokens(2))
    face.put(keys, random_blocks(SMALL_LAYOUT, 2))
    face.get(keys)
    assert face.stats().active_leases == 1  # no Release was sent
    face.lookup(keys)
    assert face.stats().active_leases == 0


def test_offload_and_load_round_trip_and_stop_at_a_corrupt_block(face: Face) -> None:
    lay = SMALL_LAYOUT
    shape = (2, 6, lay.block_size, lay.num_kv_heads, lay.head_dim)
    g = torch.Generator().manual_seed(9)
    src = [torch.randn(shape, generator=g).to(lay.dtype) for _ in range(lay.num_layers)]
    dst = [torch.zeros(shape, dtype=lay.dtype) for _ in range(lay.num_layers)]
    keys = face.hash_tokens(tokens(4))
    assert face.offload(src, [0, 1, 2, 3], keys) == 4
    assert face.offload(src, [0, 1, 2, 3], keys) == 0
    assert face.load(dst, [5, 4, 3, 2], keys) == 4
    for i, d in enumerate([5, 4, 3, 2]):
        assert all(torch.equal(a[:, d], b[:, i]) for a, b in zip(dst, src, strict=True))
    lease = face.acquire(keys)
    face._arena.slot(lease.offsets[2], lay.block_bytes)[0] ^= 0x01
    face.done(lease.release())
    assert face.load(dst, [5, 4, 3, 2], keys) == 2


def test_a_restarted_daemon_is_rejoined(kind, daemon_factory) -> None:
    d = daemon_factory()
    f = Face(kind, d.address)
    try:
        keys = f.hash_tokens(tokens(2))
        blocks = random_blocks(SMALL_LAYOUT, 2, seed=2)
        f.put(keys, blocks)
        d.stop()
        d.start()
        deadline = time.monotonic() + 30.0  # gRPC may still back off from the failed connect
        while True:
            try:
                assert f.lookup(keys) == 0  # the new daemon's CPU tier is empty
                break
            except UnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert f.put(keys, blocks) == 2 and same_bytes(f.get(keys), blocks)
    finally:
        f.close()


def test_acquire_with_lookup_and_prefetch_is_one_round_trip(kind, daemon_factory, tmp_path) -> None:
    # A cold CPU tier over NVMe: blocks 0-3 stay in memory, 4-7 are pushed down to disk.
    d = daemon_factory(
        cpu_capacity="256KiB", slab="64KiB", nvme_path=tmp_path / "nvme", nvme_capacity="4MiB"
    )
    f = Face(kind, d.address)
    try:
        keys = f.hash_tokens(tokens(10))  # blocks 8 and 9 are never stored
        blocks = random_blocks(SMALL_LAYOUT, 8, seed=21)
        f.put(keys[4:8], blocks[4:])
        filler = f.hash_tokens(tokens(64, offset=50_000))
        fill = random_blocks(SMALL_LAYOUT, 64, seed=22)
        for i in range(0, 64, 8):
            f.put(filler[i : i + 8], fill[i : i + 8])
        f.put(keys[:4], blocks[:4])
        nvme = f.stats().tiers
        promoted = next(t for t in nvme if t.name == "nvme").promotions
        calls = _count_calls(f)
        lease = f.acquire(keys, lookup=True, prefetch=True)
        assert calls() == 1  # lookup, acquire and prefetch in one call
        assert lease.found == 8  # what lookup answers: every stored block
        assert len(lease) == 4  # the lease takes what is in memory, without waiting for disk
        out = torch.empty_like(blocks[:4])
        for i in range(4):
            out[i].copy_(lease.views[i])
            assert lease.verify(i, out[i])
        f.done(lease.release())
        assert same_bytes(out, blocks[:4])
        # The disk blocks come up in the background; a later get finds all eight in memory.
        deadline = time.monotonic() + 30
        while _promotions(f) < promoted + 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _promotions(f) == promoted + 4
        assert same_bytes(f.get(keys), blocks)
        assert _promotions(f) == promoted + 4  # read from memory: nothing more from disk
        plain = f.acquire(keys[:2])
        assert plain.found is None  # not asked for
        f.done(plain.release())
    finally:
        f.close()


def _promotions(f: Face) -> int:
    return next(t for t in f.stats().tiers if t.name == "nvme").promotions


def _count_calls(f: Face) -> Any:
    """Count the control calls the face's client makes from now on (either path)."""
    made = [0]
    perform = f.kv._perform

    def counting(step: Any) -> Any:
        if type(step).__name__ == "Call":
            made[0] += 1
        return perform(step)

    f.kv._perform = counting
    return lambda: made[0]


class _NoGrpc:
    """A stub whose every method fails: a client given it can only use local calls."""

    def __getattr__(self, name: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"{name} went over gRPC")

        return refuse


def test_control_calls_are_local_calls_on_both_faces(face: Face) -> None:
    kv = face.kv
    assert kv._session is not None and kv._session.calls
    stub = LocalStub if face.kind == "sync" else AsyncLocalStub
    kv._rpc = stub(_NoGrpc(), lambda: kv._session)  # gRPC would fail the test
    keys = face.hash_tokens(tokens(6))
    blocks = random_blocks(SMALL_LAYOUT, 6)
    assert face.put(keys, blocks) == 6
    assert face.lookup(keys) == 6
    assert same_bytes(face.get(keys), blocks)
    face.prefetch(keys)
    assert face.delete(keys[4:]) == 2
    if face.loop is not None:  # calls of concurrent tasks on one client take turns

        async def lookups() -> list[int]:
            return await asyncio.gather(*(kv.lookup(keys[: i + 1]) for i in range(6)))

        many = face.loop.run_until_complete(lookups())
        assert many == [1, 2, 3, 4, 4, 4]
    assert face.lookup(keys) == 4
