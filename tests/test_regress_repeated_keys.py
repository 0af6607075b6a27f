"""Regression: a read whose keys repeat one is refused on every read path, with one answer.

``Lookup`` of one key repeated 16,384 times answered found=16384 and counted 16,384 hits, and a
client's lookup (or get) answered from its presence table did the same with no call, while
``Acquire`` refused repeated keys (INVALID_ARGUMENT) and the docs say reads refuse them. Now
Lookup (gRPC and local call), the client's lookup and get from the table or through a call,
refuse them all with INVALID_ARGUMENT (``InvalidRequestError``) naming the repeat, and count
nothing. Prefetch, a hint, still takes them (each key is promoted once).
"""

from __future__ import annotations

import grpc
import pytest
from conftest import SMALL_LAYOUT, kv_channel, random_blocks, tokens

from kvstore import KVStoreClient
from kvstore import local_calls as wire
from kvstore.errors import InvalidRequestError
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

REPEATS = 16384  # limits.max_keys_per_request's default


def stored_client(address: str, **kw) -> tuple[KVStoreClient, list[bytes]]:
    kv = KVStoreClient(address, layout=SMALL_LAYOUT, model="repeat", timeout_s=10, **kw)
    keys = kv.hash_tokens(tokens(4))
    assert kv.put(keys, random_blocks(SMALL_LAYOUT, 4)) == 4
    return kv, keys


def lookup_hits(stub: pb_grpc.KVStoreStub) -> int:
    stats = stub.Stats(pb.StatsRequest(), timeout=10)
    return sum(ns.hits for ns in stats.namespaces)


def test_lookup_rpc_refuses_a_repeated_key_and_counts_nothing(daemon) -> None:
    """One key repeated 16,384 times over gRPC: INVALID_ARGUMENT naming the repeat (before the
    fix: found=16384, all counted as hits); distinct keys are still answered."""
    kv, keys = stored_client(daemon.address)
    with kv, kv_channel(kv) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        before = lookup_hits(stub)
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(pb.LookupRequest(handle=kv._handle, keys=keys[0] * REPEATS), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "repeated" in (err.value.details() or ""), err.value.details()
        assert lookup_hits(stub) == before
        reply = stub.Lookup(pb.LookupRequest(handle=kv._handle, keys=b"".join(keys)), timeout=10)
        assert reply.found == 4


def test_lookup_local_call_refuses_a_repeated_key(daemon) -> None:
    """The same over the session socket's local call: INVALID_ARGUMENT, the same message."""
    kv, keys = stored_client(daemon.address)
    with kv:
        session = kv._session
        assert session is not None and session.calls
        request = pb.LookupRequest(handle=kv._handle, keys=keys[1] * 3).SerializeToString()
        status, body = session.call(wire.METHOD_INDEX["Lookup"], request, 10.0)
        assert status == wire.STATUS_INVALID, (status, bytes(body))
        name, message = wire.decode_error(body)
        assert "lookup: a key is repeated" in message, (name, message)


@pytest.mark.parametrize("tables", ["1", "0"])
def test_client_lookup_and_get_refuse_a_repeated_key_from_the_table_or_a_call(
    daemon, monkeypatch, tables
) -> None:
    """kv.lookup, kv.get and kv.get(out=...) of keys that repeat one raise InvalidRequestError
    naming the repeat, whether the presence table would answer (before the fix it answered
    found=3 with no call) or a call goes to the daemon; nothing is counted."""
    monkeypatch.setenv("KVSTORE_PRESENCE_TABLES", tables)
    kv, keys = stored_client(daemon.address)
    with kv, kv_channel(kv) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        assert kv.lookup(keys) == 4
        answered = kv._presence.answered
        if tables == "1":
            assert kv.lookup(keys[:2]) == 2 and kv._presence.answered > answered  # the table
        before = lookup_hits(stub)
        repeated = [keys[0], keys[1], keys[0]]
        with pytest.raises(InvalidRequestError, match="lookup: a key is repeated"):
            kv.lookup(repeated)
        with pytest.raises(InvalidRequestError, match="acquire: a key is repeated"):
            kv.get(repeated)
        with pytest.raises(InvalidRequestError, match="acquire: a key is repeated"):
            kv.get([keys[2], keys[2]])
        assert lookup_hits(stub) == before
        tally = kv._presence.take_tally()  # what the next call would report: none of them
        assert (tally.keys, tally.found) == ((2, 2) if tables == "1" else (0, 0)), tally


def test_lookup_over_grpc_transport_refuses_a_repeated_key(daemon) -> None:
    """A client on the bytes path (``transport="grpc"``): the same error."""
    kv, keys = stored_client(daemon.address, transport="grpc")
    with kv:
        with pytest.raises(InvalidRequestError, match="lookup: a key is repeated"):
            kv.lookup([keys[3]] * 5)
        with pytest.raises(InvalidRequestError, match="acquire: a key is repeated"):
            kv.get([keys[3]] * 5)
        assert kv.lookup(keys) == 4


def test_prefetch_of_repeated_keys_is_still_taken(daemon) -> None:
    """Prefetch is a hint, not a read: repeats are taken (each key promoted once)."""
    kv, keys = stored_client(daemon.address)
    with kv, kv_channel(kv) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        stub.Prefetch(pb.PrefetchRequest(handle=kv._handle, keys=keys[0] * 3), timeout=10)
        kv.prefetch([keys[0], keys[0]])
        assert kv.lookup(keys) == 4
