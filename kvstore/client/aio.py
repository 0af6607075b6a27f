"""``AsyncKVStoreClient``: the asyncio flavour of ``KVStoreClient``, same methods as coroutines.

The logic is the client core's (``kvstore.client.core``), shared with ``KVStoreClient``; this
face awaits its steps. Copies of large batches, and the kernels of offload and load, run in a
worker thread (with the caller's CUDA stream current) so they do not stall the caller's event
loop; small copies run inline (a thread hop costs more than copying a few blocks). Control
calls are local calls over the session socket when the daemon offers them, like the blocking
face's, their replies awaited on the loop (``AsyncLocalStub``), else gRPC. One
client per task that issues calls concurrently is the simplest contract; concurrent calls on
one client are safe for reads and writes of distinct keys.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import torch

from kvstore.address import default_address
from kvstore.client import paged_io
from kvstore.client._common import (
    call_metadata,
    make_aio_channel,
    open_request,
    open_session,
    translate_error,
)
from kvstore.client.block_watch import AsyncBlockWatch
from kvstore.client.core import ClientCore
from kvstore.client.leases import AsyncReadLease, AsyncWriteReservation
from kvstore.client.local_stub import AsyncLocalStub
from kvstore.client.steps import Blocking, Call, Fetch, Op, Post, Settle
from kvstore.errors import (
    KVStoreError,
    UnauthenticatedError,
    UnavailableError,
    UnknownNamespaceError,
)
from kvstore.layout import KVLayout
from kvstore.local_calls import METHOD_INDEX
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

R = TypeVar("R")

INLINE_COPY_BYTES = 8 << 20
"""Batches up to this size are copied on the event loop; larger ones in a worker thread."""


class AsyncKVStoreClient(ClientCore):
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
        super().__init__(
            address or default_address(),
            layout=layout,
            model=model,
            revision=revision,
            tenant=tenant,
            tp_rank=tp_rank,
            tp_size=tp_size,
            priority=priority,
            transport=transport,
            timeout_s=timeout_s,
            verify_checksums=verify_checksums,
            token=token,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._rpc: Any = None  # the control calls: local calls, else the stub's

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
            self._rpc = AsyncLocalStub(self._stub, lambda: self._session)
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
        self._opened(reply)

    # ------------------------------------------------------------------ performing steps
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

    async def _fetch(self, request: pb.GetBlocksRequest, timeout: float, step: Fetch) -> None:
        call = self._stub.GetBlocks(request, timeout=timeout)
        async for message in call:
            if not step.consume(message):
                call.cancel()  # the run ended: the daemon releases the lease
                break

    async def _perform(self, step: Any) -> Any:
        posted = self._posted.current
        if isinstance(step, Call | Fetch) and posted is not None and not posted.token.done():
            # Served after the put in flight, whichever way this call goes (over the session
            # it would wait its turn anyway; over gRPC the daemon would not order them).
            await asyncio.wait([posted.token])
        if isinstance(step, Call):
            if self._stub is None:
                raise KVStoreError("client is not open: use `await client.open()` or `async with`")
            where = self._rpc if step.method in METHOD_INDEX else self._stub
            return await self._call(getattr(where, step.method), step.build)
        if isinstance(step, Fetch):
            return await self._call(
                lambda req, timeout: self._fetch(req, timeout, step), step.build
            )
        if isinstance(step, Post):
            if self._rpc is None:
                raise KVStoreError("client is not open: use `await client.open()` or `async with`")
            request = step.build()  # once: it takes the releases it carries
            task = asyncio.ensure_future(
                self._call(getattr(self._rpc, step.method), lambda: request)
            )
            if self._rpc.goes_local(request):
                # One turn of the loop: the task takes the session's turn and sends, so every
                # later call of this client is served after it.
                await asyncio.sleep(0)
            else:  # gRPC calls may overtake each other: this one is made now
                await asyncio.wait([task])
            return task
        if isinstance(step, Settle):
            # Shielded: a caller cancelled while it waits leaves the put's call running,
            # for the next settle.
            return await asyncio.shield(step.token)
        if isinstance(step, Blocking):
            if not step.thread and step.nbytes <= INLINE_COPY_BYTES:
                return step.fn()
            # A worker thread's current stream is the default one: run on the caller's.
            return await asyncio.to_thread(paged_io.on_stream, step.stream, step.fn)
        raise AssertionError(f"unknown step {step!r}")

    async def _run(self, op: Op[R]) -> R:
        """Await the steps of a core operation until it returns; a step's error is raised
        inside the operation, where its cleanup runs."""
        try:
            step = next(op)
            while True:
                try:
                    result = await self._perform(step)
                except BaseException as exc:
                    step = op.throw(exc)
                else:
                    step = op.send(result)
        except StopIteration as stop:
            return stop.value

    def _new_reservation(self, *args: Any) -> AsyncWriteReservation:
        return AsyncWriteReservation(*args, run=self._run)  # type: ignore[misc]  # args: 8

    def _new_lease(self, *args: Any) -> AsyncReadLease:
        return AsyncReadLease(*args, run=self._run)  # type: ignore[misc]  # args: 8

    async def close(self) -> None:
        with contextlib.suppress(KVStoreError, OSError):
            await self._run(self._settle_at_close())  # a put that did not wait: served first
        tally = self._tally_call()
        if tally is not None:
            session, method, request, timeout_s = tally
            with contextlib.suppress(KVStoreError, OSError):
                await session.acall(method, request, timeout_s)
        self._close_local()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> AsyncKVStoreClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ API
    async def lookup(self, keys: Sequence[bytes]) -> int:
        return await self._run(self._lookup(keys))

    async def prefetch(self, keys: Sequence[bytes]) -> None:
        """Hint that ``keys`` will be read soon; returns once the daemon has queued it."""
        await self._run(self._prefetch(keys))

    async def put(
        self,
        keys: Sequence[bytes],
        blocks: torch.Tensor,
        priority: int | None = None,
        *,
        wait: bool = True,
    ) -> int:
        """As ``KVStoreClient.put`` (``wait=False``: the call that commits runs on in a task)."""
        return await self._run(self._put(keys, blocks, priority, wait))

    async def flush(self) -> int:
        """As ``KVStoreClient.flush``."""
        return await self._run(self._flush())

    async def get(self, keys: Sequence[bytes], out: torch.Tensor | None = None) -> torch.Tensor:
        return await self._run(self._get(keys, out))

    async def delete(self, keys: Sequence[bytes]) -> int:
        return await self._run(self._delete(keys))

    async def clear(self) -> int:
        """``KVStoreClient.clear``."""
        return await self._run(self._clear())

    async def stats(self) -> pb.StatsResponse:
        return await self._run(self._stats())

    def watch_blocks(self) -> AsyncBlockWatch:
        """``KVStoreClient.watch_blocks`` for asyncio: ``async for events in watch``."""
        if self._stub is None:
            raise KVStoreError("client is not open: use `await client.open()` or `async with`")
        return AsyncBlockWatch(self._stub.WatchBlocks(pb.WatchBlocksRequest(handle=self._handle)))

    # ------------------------------------------------------------------ paged caches
    async def offload(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        keys: Sequence[bytes],
        priority: int | None = None,
    ) -> int:
        """As ``KVStoreClient.offload``; the gathers run in a worker thread."""
        return await self._run(self._offload(kv_caches, block_ids, keys, priority))

    async def load(
        self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], keys: Sequence[bytes]
    ) -> int:
        """As ``KVStoreClient.load``; the scatters run in a worker thread."""
        return await self._run(self._load(kv_caches, block_ids, keys))

    # ------------------------------------------------------------------ zero-copy API
    async def reserve(
        self,
        keys: Sequence[bytes],
        priority: int | None = None,
        *,
        _packed: bytes | None = None,
        _device: torch.device | None = None,
    ) -> AsyncWriteReservation:
        return await self._run(self._reserve(keys, priority, _packed, _device))

    async def acquire(
        self,
        keys: Sequence[bytes],
        *,
        lookup: bool = False,
        prefetch: bool = False,
        _packed: bytes | None = None,
        _device: torch.device | None = None,
    ) -> AsyncReadLease:
        """As ``KVStoreClient.acquire`` (with its one-round-trip ``lookup`` and ``prefetch``)."""
        return await self._run(self._acquire(keys, _packed, _device, lookup, prefetch))
