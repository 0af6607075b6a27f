"""Watching which tiers hold a namespace's blocks (``KVStoreClient.watch_blocks``).

The daemon's WatchBlocks stream sends states, not deltas: each block it names comes with the
tiers holding it now (none: gone, evicted from the last tier or deleted). It opens with a
snapshot of the whole namespace, and a watcher that fell behind gets a fresh snapshot in place
of the changes it lost; a snapshot may span several messages. ``BlockEventReader`` assembles
them, so a caller sees each snapshot as one ``BlockEvents`` with ``reset`` set.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from kvstore.client._common import translate_error
from kvstore.keys import KEY_BYTES
from kvstore.v1 import kvstore_pb2 as pb

# The tier bits of the protocol (``BlockEventBatch.tiers``), top tier first.
TIER_BITS = (("gpu", 8), ("cpu", 1), ("nvme", 2), ("redis", 4))

_NAMES: list[frozenset[str]] = [
    frozenset(name for name, bit in TIER_BITS if bits & bit) for bits in range(256)
]


@dataclass(frozen=True)
class BlockEvents:
    """What changed in the watched namespace.

    ``reset``: forget every block you knew of it; ``blocks`` is then its whole content.
    ``blocks``: (key, tiers holding it now), oldest change first; tiers are names among
    ``gpu``, ``cpu``, ``nvme``, ``redis`` (``redis``: this host wrote it there), empty when the
    block is gone. ``resets``: times this watch fell behind and was reset."""

    reset: bool
    blocks: list[tuple[bytes, frozenset[str]]]
    resets: int


class BlockEventReader:
    """Turns the stream's messages into ``BlockEvents``, a snapshot in parts into one."""

    def __init__(self) -> None:
        self._snapshot: list[tuple[bytes, frozenset[str]]] | None = None

    def feed(self, batch: pb.BlockEventBatch) -> BlockEvents | None:
        keys, tiers = batch.keys, batch.tiers
        if len(keys) != KEY_BYTES * len(tiers):
            raise ValueError(
                f"a block event batch of {len(keys)} key bytes for {len(tiers)} tier bytes"
            )
        blocks = [
            (keys[i * KEY_BYTES : (i + 1) * KEY_BYTES], _NAMES[t]) for i, t in enumerate(tiers)
        ]
        if batch.reset:
            self._snapshot = []
        if self._snapshot is not None:
            self._snapshot.extend(blocks)
            if not batch.snapshot_end:
                return None
            blocks, self._snapshot = self._snapshot, None
            return BlockEvents(True, blocks, batch.resets)
        return BlockEvents(False, blocks, batch.resets)


class BlockWatch:
    """A blocking iterator of ``BlockEvents`` over one WatchBlocks call; ``close`` ends it
    (from any thread). It ends by itself when the namespace handle closes; errors are raised
    as kvstore exceptions."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._reader = BlockEventReader()

    def __iter__(self) -> Iterator[BlockEvents]:
        try:
            for batch in self._call:
                events = self._reader.feed(batch)
                if events is not None:
                    yield events
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED:
                return  # closed
            raise translate_error(err) from None

    def close(self) -> None:
        self._call.cancel()

    def __enter__(self) -> BlockWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncBlockWatch:
    """``BlockWatch`` for asyncio: ``async for events in watch``."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._reader = BlockEventReader()

    async def __aiter__(self) -> AsyncIterator[BlockEvents]:
        try:
            async for batch in self._call:
                events = self._reader.feed(batch)
                if events is not None:
                    yield events
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED:
                return
            raise translate_error(err) from None

    def close(self) -> None:
        self._call.cancel()

    async def __aenter__(self) -> AsyncBlockWatch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
