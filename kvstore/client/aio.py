"""``AsyncKVStoreClient``: the asyncio flavour of ``KVStoreClient``, same methods as coroutines.

Copies of large batches run in a worker thread so they do not stall the caller's event loop;
small ones run inline (a thread hop costs more than copying a few blocks). One client per task
that issues calls concurrently is the simplest contract; concurrent calls on one client are safe
for reads and writes of distinct keys.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np
import torch

from kvstore.address import default_address
from kvstore.client import paged_io
from kvstore.client._common import (
    Credentials,
    MappedArena,
    PendingReleases,
    PoolLink,
    PutCount,
    StreamAssembler,
    byte_rows,
    call_metadata,
    check_keys,
    check_open_reply,
    check_out,
    check_priority,
    check_put,
    check_transport,
    commit_request,
    empty_blocks,
    make_aio_channel,
    open_request,
    open_session,
    put_messages,
    seeds_for,
    translate_error,
)
from kvstore.client.leases import AsyncReadLease, AsyncWriteReservation
from kvstore.client.session import ClientSession
from kvstore.errors import (
    KVStoreError,
    UnauthenticatedError,
    UnavailableError,
    UnknownNamespaceError,
)
from kvstore.keys import BlockKey, Namespace, block_hashes, unpack_keys
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

R = TypeVar("R")

INLINE_COPY_BYTES = 8 << 20
"""Batches up to this size are copied on the event loop; larger ones in a worker thread."""


class AsyncKVStoreClient:
    """Asyncio client of one namespace. Create with ``await AsyncKVStoreClient.connect(...)`` or
    ``async with AsyncKVStoreClient(...) as kv``; arguments as for ``KVStoreClient``."""

    def __init__(
        self,
        address: str | None = None,
        *,
        layout: KVLayout,
        model: str,
        revision: str = "",
        tenant: str = "",
        tp_rank: int = 0,
        tp_size: int = 1,
        priority: int = 0,
        transport: str = "auto",
        timeout_s: float = 30.0,
        verify_checksums: bool = True,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        check_transport(transport)
        self.layout = layout
        self.namespace = Namespace(
            model=model,
            layout=layout,
            revision=revision,
            tenant=tenant,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.address = address or default_address()
        self.transport = transport
        self.timeout_s = timeout_s
        self.verify_checksums = verify_checksums
        self._priority = check_priority(priority)
        self._credentials = Credentials.resolve(token, tls_ca, tls_cert, tls_key)
        self._session: ClientSession | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._arena: MappedArena | None = None
        self._pool_link = PoolLink()
        self._handle = b""
        self._stream: Any = None  # the OpenNamespace call whose life is the handle's
        self._chunk_bytes = 1 << 20
        self._releases = PendingReleases()

    @classmethod
    async def connect(cls, address: str | None = None, **kwargs: Any) -> AsyncKVStoreClient:
        client = cls(address, **kwargs)
        await client.open()
        return client

    async def open(self) -> None:
        if self._channel is None:
            self._channel = make_aio_channel(
                self.address,
                self._credentials,
                lambda: call_metadata(self._credentials, self._session),
            )
            self._stub = pb_grpc.KVStoreStub(self._channel)
        self._close_stream()
        self._close_session()
        # Blocking, but short: a connect and one datagram on a local socket (or a wait for a
        # daemon that is starting, bounded by timeout_s).
        self._session = open_session(self.address, self.timeout_s)
        # The handle lives as long as this stream: no deadline on it; ``timeout_s`` bounds only
        # the wait for its first message.
        call = self._stub.OpenNamespace(
            open_request(self.namespace, self._priority), wait_for_ready=True
        )
        try:
            reply = await asyncio.wait_for(call.read(), self.timeout_s)
        except TimeoutError:
            call.cancel()
            raise UnavailableError(
                f"kvstore daemon unreachable: no answer to OpenNamespace within {self.timeout_s}s"
            ) from None
        except grpc.RpcError as err:
            raise translate_error(err) from None
        if reply is grpc.aio.EOF:
            raise KVStoreError("the daemon closed the namespace stream at once")
        self._stream = call
        check_open_reply(self.namespace, reply)
        self._handle = reply.handle
        self._chunk_bytes = reply.max_chunk_bytes or self._chunk_bytes
        self._pool_link.reset(reply if self.transport != "grpc" else None)
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        if self.transport != "grpc":
            if self._session is not None:
                self._arena = MappedArena(self._session)
            elif self.transport == "shm":
                raise KVStoreError(
                    "cannot map the daemon's arena: shared memory needs the unix socket"
                )

    async def _call(self, method: Callable[..., Awaitable[R]], build: Callable[[], Any]) -> R:
        if self._stub is None:
            raise KVStoreError("client is not open: use `await client.open()` or `async with`")
        for attempt in range(2):
            try:
                return await method(build(), timeout=self.timeout_s)
            except grpc.RpcError as err:
                exc = translate_error(err)
                if isinstance(exc, UnknownNamespaceError | UnauthenticatedError) and attempt == 0:
                    await self.open()
                    continue
                raise exc from None
        raise AssertionError("unreachable")

    @property
    def uses_shared_memory(self) -> bool:
        return self._arena is not None

    def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()  # the daemon closes the handle and reclaims what it holds

    async def close(self) -> None:
        self._close_stream()  # releases the handle's leases, pending ones included
        self._pool_link.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._close_session()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> AsyncKVStoreClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _copy(self, nbytes: int, fn: Callable[[], R]) -> R:
        if nbytes <= INLINE_COPY_BYTES:
            return fn()
        return await asyncio.to_thread(fn)

    # ------------------------------------------------------------------ API
    def hash_tokens(
        self,
        token_ids: Sequence[int] | np.ndarray | torch.Tensor,
        extra_keys: Sequence[bytes] | None = None,
    ) -> list[BlockKey]:
        return block_hashes(self.namespace.seed, token_ids, self.layout.block_size, extra_keys)

    async def lookup(self, keys: Sequence[bytes]) -> int:
        packed = check_keys(keys)
        if not keys:
            return 0
        reply = await self._call(
            self._stub.Lookup,
            lambda: pb.LookupRequest(
                handle=self._handle, keys=packed, release_leases=self._releases.take(self._handle)
            ),
        )
        return int(reply.found)

    async def prefetch(self, keys: Sequence[bytes]) -> None:
        """Hint that ``keys`` will be read soon; returns once the daemon has queued it."""
        packed = check_keys(keys)
        if keys:
            await self._call(
                self._stub.Prefetch,
                lambda: pb.PrefetchRequest(
                    handle=self._handle,
                    keys=packed,
                    gpu=self._pool_link.pool is not None,
                    release_leases=self._releases.take(self._handle),
                ),
            )

    async def put(
        self, keys: Sequence[bytes], blocks: torch.Tensor, priority: int | None = None
    ) -> int:
        packed = check_keys(keys)
        rows = check_put(self.layout, keys, blocks)
        prio = check_priority(priority)
        if not keys:
            return 0
        if self._arena is None:
            return await self._put_bytes(keys, rows, prio)
        reservation = await self.reserve(keys, priority, _packed=packed)
        if not reservation.offsets_new:
            return PutCount(0, reservation.pending)
        try:
            await self._copy(
                len(reservation.offsets_new) * self.layout.block_bytes,
                lambda: reservation.fill_from(rows),
            )
        except BaseException:
            await reservation.abort()
            raise
        return PutCount(await reservation.commit(), reservation.pending)

    async def get(self, keys: Sequence[bytes], out: torch.Tensor | None = None) -> torch.Tensor:
        packed = check_keys(keys)
        check_out(self.layout, len(keys), out)
        if not keys:
            return out[:0] if out is not None else empty_blocks(self.layout, 0)
        if self._arena is None:
            return await self._get_bytes(packed, out)
        lease = await self.acquire(keys, _packed=packed)
        try:
            dest = empty_blocks(self.layout, len(lease)) if out is None else out
            rows = byte_rows(self.layout, dest)
            m = await self._copy(
                len(lease) * self.layout.block_bytes,
                lambda: lease.copy_into(rows, self.verify_checksums),
            )
        finally:
            await lease.release()  # no call: the next one carries it
        return dest[:m]

    async def delete(self, keys: Sequence[bytes]) -> int:
        packed = check_keys(keys)
        if not keys:
            return 0
        reply = await self._call(
            self._stub.Delete,
            lambda: pb.DeleteRequest(
                handle=self._handle, keys=packed, release_leases=self._releases.take(self._handle)
            ),
        )
        return int(reply.deleted)

    async def stats(self) -> pb.StatsResponse:
        return await self._call(self._stub.Stats, pb.StatsRequest)

    # ------------------------------------------------------------------ paged caches
    async def offload(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        keys: Sequence[bytes],
        priority: int | None = None,
    ) -> int:
        """As ``KVStoreClient.offload``; the gathers run in a worker thread."""
        ids = paged_io.check_paged(self.layout, kv_caches, block_ids, keys)
        check_keys(keys)
        gpu = self._pool_link.device_for(kv_caches)
        stream = paged_io.caller_stream(kv_caches)
        on_stream = paged_io.on_stream
        stored = 0
        stage: torch.Tensor | None = None
        for ck, cids in paged_io.chunked(keys, ids, self._chunk_blocks):
            if self._arena is None:
                if stage is None:  # one chunk-sized buffer for the whole transfer
                    stage = paged_io.staging(self.layout, len(ids), kv_caches)
                blocks = stage[: len(cids)]
                await asyncio.to_thread(
                    on_stream, stream, paged_io.gather_into_views, kv_caches, cids, blocks
                )
                stored += await self.put(ck, blocks, priority)
                continue
            reservation = await self.reserve(ck, priority, _device=gpu)
            try:
                ids_new = [cids[i] for i in reservation.indices]
                checksums = None
                if not reservation.on_gpu:
                    paged_io.ensure_pinned(reservation.arena, kv_caches)
                    checksums = await asyncio.to_thread(
                        paged_io.gather_with_checksums,
                        kv_caches,
                        ids_new,
                        reservation.views,
                        reservation.seeds_new,
                    )
                if checksums is None:
                    await asyncio.to_thread(
                        on_stream,
                        stream,
                        paged_io.gather_into_views,
                        kv_caches,
                        ids_new,
                        reservation.views,
                    )
                    # Device checksums launch a kernel and wait for it: off the loop too.
                    checksums = await asyncio.to_thread(on_stream, stream, reservation.checksums)
            except BaseException:
                await reservation.abort()
                raise
            stored += await reservation.commit(checksums)
        return stored

    async def load(
        self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], keys: Sequence[bytes]
    ) -> int:
        """As ``KVStoreClient.load``; the scatters run in a worker thread."""
        ids = paged_io.check_paged(self.layout, kv_caches, block_ids, keys)
        check_keys(keys)
        gpu = self._pool_link.device_for(kv_caches)
        stream = paged_io.caller_stream(kv_caches)
        on_stream = paged_io.on_stream
        loaded = 0
        stage: torch.Tensor | None = None
        for ck, cids in paged_io.chunked(keys, ids, self._chunk_blocks):
            if self._arena is None:
                if stage is None:  # one chunk-sized buffer for the whole transfer
                    stage = paged_io.staging(self.layout, len(ids), kv_caches)
                got = await self.get(ck, out=stage)
                await asyncio.to_thread(
                    on_stream,
                    stream,
                    paged_io.scatter_from_views,
                    got,
                    kv_caches,
                    cids[: got.shape[0]],
                )
                n = got.shape[0]
            else:
                lease = await self.acquire(ck, _device=gpu)
                try:
                    # CPU caches: each block verified from its copy as it is made (one pass).
                    got_n = await asyncio.to_thread(
                        paged_io.scatter_with_checksums,
                        lease.views,
                        kv_caches,
                        cids[: len(lease)],
                        lease.checksums,
                        lease.seeds,
                    )
                    if got_n is None:
                        if lease.any_on_host:
                            paged_io.ensure_pinned(lease.arena, kv_caches)
                        await asyncio.to_thread(
                            on_stream,
                            stream,
                            paged_io.scatter_from_views,
                            lease.views,
                            kv_caches,
                            cids[: len(lease)],
                        )
                        got_n = await asyncio.to_thread(on_stream, stream, lease.intact)
                    n = got_n
                finally:
                    await lease.release()
            loaded += n
            if n < len(ck):
                break
        return loaded

    # ------------------------------------------------------------------ zero-copy API
    async def reserve(
        self,
        keys: Sequence[bytes],
        priority: int | None = None,
        *,
        _packed: bytes | None = None,
        _device: torch.device | None = None,
    ) -> AsyncWriteReservation:
        packed = check_keys(keys) if _packed is None else _packed
        prio = check_priority(priority)
        self._require_arena("reserve")
        reply = await self._call(
            self._stub.Reserve,
            lambda: pb.ReserveRequest(
                handle=self._handle,
                keys=packed,
                priority=prio,
                gpu=_device is not None,
                release_leases=self._releases.take(self._handle),
            ),
        )
        handle = self._handle  # the reservation is this handle's (after any reopen)
        # Fetched after the call: a daemon restart makes the call reopen and remap the arena.
        arena = self._require_arena("reserve")
        pool = self._pool_link.for_device(_device) if reply.gpu else None

        async def commit(checksums: list[int]) -> int:
            def build() -> pb.CommitRequest:
                return commit_request(reply, checksums, handle, self._releases.take(self._handle))

            return int((await self._call(self._stub.Commit, build)).committed)

        async def abort() -> None:
            req = pb.AbortRequest(reservation_id=reply.reservation_id, handle=handle)
            await self._call(self._stub.Abort, lambda: req)

        if reply.gpu and pool is None:
            await abort()
            raise KVStoreError("the daemon reserved GPU pool slots this client cannot reach")
        reservation = AsyncWriteReservation(
            arena,
            self.layout,
            reply.reservation_id,
            list(reply.offsets),
            seeds_for(self.namespace, unpack_keys(packed)),
            commit,
            abort,
            pool,
        )
        reservation.pending = reply.pending
        return reservation

    async def acquire(
        self,
        keys: Sequence[bytes],
        *,
        _packed: bytes | None = None,
        _device: torch.device | None = None,
    ) -> AsyncReadLease:
        packed = check_keys(keys) if _packed is None else _packed
        self._require_arena("acquire")
        reply = await self._call(
            self._stub.Acquire,
            lambda: pb.AcquireRequest(
                handle=self._handle,
                keys=packed,
                gpu=_device is not None,
                release_leases=self._releases.take(self._handle),
            ),
        )
        handle = self._handle
        arena = self._require_arena("acquire")
        pool = self._pool_link.for_device(_device) if any(reply.on_gpu) else None

        async def release() -> None:
            # Not a call of its own: the next call carries it (PendingReleases).
            if reply.lease_id and self._releases.add(handle, reply.lease_id):
                ids = self._releases.take(handle)
                request = pb.ReleaseRequest(handle=handle, release_leases=ids)
                try:
                    await self._stub.Release(request, timeout=self.timeout_s)
                except grpc.RpcError:
                    pass  # the handle closed: the daemon already dropped its leases

        return AsyncReadLease(
            arena,
            self.layout,
            list(reply.offsets),
            list(reply.checksums),
            seeds_for(self.namespace, unpack_keys(packed)[: len(reply.offsets)]),
            release,
            list(reply.on_gpu),
            pool,
        )

    @property
    def _chunk_blocks(self) -> int:
        """Blocks per call of an offload or load: the bytes path stages a chunk at a time, the
        shared-memory path stages nothing."""
        return paged_io.CHUNK_BLOCKS if self._arena is None else paged_io.ARENA_CHUNK_BLOCKS

    def _require_arena(self, what: str) -> MappedArena:
        if self._arena is None:
            raise KVStoreError(
                f"{what} needs the shared-memory arena; this client uses the bytes path"
            )
        return self._arena

    # ------------------------------------------------------------------ bytes path
    async def _put_bytes(self, keys: Sequence[bytes], rows: torch.Tensor, priority: int) -> int:
        rows_np = rows.numpy()
        seeds = seeds_for(self.namespace, keys)

        def messages() -> Iterator[pb.PutBlocksRequest]:
            return put_messages(self._handle, keys, seeds, rows_np, priority, self._chunk_bytes)

        reply = await self._call(self._stub.PutBlocks, messages)
        return int(reply.stored)

    async def _get_bytes(self, packed: bytes, out: torch.Tensor | None) -> torch.Tensor:
        keys = unpack_keys(packed)

        async def fetch(request: pb.GetBlocksRequest, timeout: float) -> StreamAssembler:
            got = StreamAssembler(self.layout, keys, seeds_for(self.namespace, keys), out)
            call = self._stub.GetBlocks(request, timeout=timeout)
            async for message in call:
                if not got.add(message):
                    call.cancel()  # the run ended: the daemon releases the lease
                    break
            return got

        got = await self._call(fetch, lambda: pb.GetBlocksRequest(handle=self._handle, keys=packed))
        return got.result()
