"""Clearing a namespace (``kv.clear()``, a Delete of ``all_blocks``): what an engine's "flush
the cache" asks. Every block of the namespace goes, and nothing of another namespace."""

from __future__ import annotations

import grpc
import pytest
from conftest import SMALL_LAYOUT, random_blocks, tokens
from test_store import NS, keys, make_store, put

from kvstore import KVStoreClient, Namespace
from kvstore.daemon import store_writes
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


def client(daemon, **kw) -> KVStoreClient:
    kw.setdefault("model", "clear-model")
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, **kw)


def test_clear_deletes_every_block_of_the_namespace_and_no_other(daemon) -> None:
    with client(daemon) as kv, client(daemon, model="other") as other:
        mine, theirs = kv.hash_tokens(tokens(10)), other.hash_tokens(tokens(3, offset=50))
        kv.put(mine, random_blocks(SMALL_LAYOUT, 10))
        other.put(theirs, random_blocks(SMALL_LAYOUT, 3, seed=2))
        lease = kv.acquire(mine[:2])  # a reader's blocks go when its read ends
        assert kv.clear() == 10
        assert kv.lookup(mine) == 0 and kv.get(mine).shape[0] == 0
        assert other.lookup(theirs) == 3
        lease.release()
        assert kv.clear() == 0
        kv.put(mine[:4], random_blocks(SMALL_LAYOUT, 4))  # the namespace serves on
        assert kv.lookup(mine) == 4
        # A Delete naming keys and all_blocks at once is refused, and changes nothing.
        stub = pb_grpc.KVStoreStub(kv._channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Delete(pb.DeleteRequest(handle=kv._handle, keys=mine[0], all_blocks=True))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no keys" in err.value.details()
        assert kv.lookup(mine) == 4


async def test_a_large_namespace_is_cleared_in_bounded_steps(monkeypatch) -> None:
    monkeypatch.setattr(store_writes, "CLEAR_STEP", 3)
    store = make_store(capacity_blocks=16)
    try:
        handle = store.open_namespace(NS)
        other = store.open_namespace(Namespace(model="other", layout=NS.layout))
        await put(store, handle, keys(7))
        await put(store, other, keys(2, start=40))
        steps = [store.delete_all(handle) for _ in range(4)]
        assert steps == [(3, True), (3, True), (1, False), (0, False)]
        store.check()
        assert await store.lookup(handle, keys(7)) == 0
        assert await store.lookup(other, keys(2, start=40)) == 2
    finally:
        store.close()
