"""PutBlocks (the bytes path's client stream) accepted any number of messages without data: a
block's key followed by empty (or 1-byte) data messages kept the stream, a list entry per
message and the daemon's time for as long as the client sent them, and was refused only at the
end, if ever. Now a message without data is INVALID_ARGUMENT at once, and a block may take at
most ceil(block / 4 KiB) + 1 messages; the daemon keeps serving, and the client library's
chunks are unaffected.

Real daemon, raw gRPC stream with the client's credentials.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from conftest import SMALL_LAYOUT, kv_channel, random_blocks, same_bytes, tokens

from kvstore import KVStoreClient
from kvstore.checksum import seeded_checksum
from kvstore.client._common import seeds_for
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

BB = SMALL_LAYOUT.block_bytes


def test_empty_and_tiny_chunks_are_refused_and_the_daemon_serves_on(daemon) -> None:
    with KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="m") as kv:
        key = kv.hash_tokens(tokens(1))[0]
        row = random_blocks(SMALL_LAYOUT, 1, seed=4).contiguous().view(-1).view(torch.uint8)
        data = row.numpy().tobytes()
        checksum = seeded_checksum(row.numpy(), seeds_for(kv.namespace, [key])[0])
        sent = [0]

        def empty_flood():  # a key, then empty messages "forever"
            yield pb.PutBlocksRequest(handle=kv._handle, key=key, data=data[:1], checksum=checksum)
            for _ in range(200_000):
                sent[0] += 1
                yield pb.PutBlocksRequest()

        def one_byte_chunks():  # a whole block, one byte a message
            yield pb.PutBlocksRequest(handle=kv._handle, key=key, data=data[:1], checksum=checksum)
            for i in range(1, BB):
                yield pb.PutBlocksRequest(data=data[i : i + 1])

        with kv_channel(kv) as ch:
            stub = pb_grpc.KVStoreStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.PutBlocks(empty_flood(), timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "empty chunk" in (err.value.details() or ""), err.value.details()
            assert sent[0] < 200_000  # refused at once, not after the whole stream
            with pytest.raises(grpc.RpcError) as err:
                stub.PutBlocks(one_byte_chunks(), timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "messages" in (err.value.details() or ""), err.value.details()
        assert kv.lookup([key]) == 0  # nothing was stored by either stream
        # The daemon serves on; the client's own chunks (limits.chunk_bytes) pass.
        blocks = random_blocks(SMALL_LAYOUT, 4, seed=5)
        keys = kv.hash_tokens(tokens(4, offset=100))
        assert kv.put(keys, blocks) == 4
        assert same_bytes(kv.get(keys), blocks)
    assert daemon.alive()
