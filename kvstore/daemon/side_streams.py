"""The streams of the services that ride beside the store's own on its gRPC server (health's
``Watch``, reflection's ``ServerReflectionInfo``): authenticated like the store's calls, and
few.

They are not the store's API, but a call holds one of the server's ``maximum_concurrent_rpcs``
slots for as long as it lasts, and these two never end on their own. Unchecked, a caller with
no credentials could hold every slot with them (16 connections of 512 ``Watch`` streams reach
the default 8192) and lock every tenant out. So a stream of another service needs a principal,
as any store call does, and at most ``MAX_STREAMS`` of them are open at once, at most
``MAX_STREAMS_PER_PRINCIPAL`` per principal: the rest of the slots stay the store's. Unary
calls (health's ``Check``, what probes use) pass untouched: they end at once.
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvstore.daemon.auth import Principal
from kvstore.errors import UnauthenticatedError

MAX_STREAMS = 16
MAX_STREAMS_PER_PRINCIPAL = 4


class SideStreamGuard(grpc.aio.ServerInterceptor):
    """Authenticates and bounds the streaming calls of every service but ``service``.

    ``authenticate``: the call's principal from its context (raises UnauthenticatedError); set
    once the daemon has made its authenticator, before the server starts."""

    def __init__(self, service: str) -> None:
        self._prefix = f"/{service}/"
        self.authenticate: Callable[[Any], Principal] | None = None
        self._open: collections.Counter[str] = collections.Counter()
        self._guarded: dict[str, tuple[Any, Any]] = {}

    @property
    def open_streams(self) -> int:
        return sum(self._open.values())

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        path = handler_call_details.method
        if handler is None or path.startswith(self._prefix):
            return handler
        if handler.unary_stream is None and handler.stream_stream is None:
            return handler
        cached = self._guarded.get(path)
        if cached is not None and cached[0] is handler:
            return cached[1]
        field_name = "unary_stream" if handler.unary_stream is not None else "stream_stream"
        guarded = handler._replace(**{field_name: self._guard(getattr(handler, field_name))})
        self._guarded[path] = (handler, guarded)
        return guarded

    async def _admit(self, context: grpc.aio.ServicerContext) -> str:
        """The principal's name, counted as holding one more stream; aborts the call when it
        has no principal or the bounds are reached."""
        if self.authenticate is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon is starting")
        assert self.authenticate is not None
        try:
            name = self.authenticate(context).name
        except UnauthenticatedError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        if self.open_streams >= MAX_STREAMS or self._open[name] >= MAX_STREAMS_PER_PRINCIPAL:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many health or reflection streams open ({self.open_streams}, "
                f"{self._open[name]} of {name}; at most {MAX_STREAMS}, "
                f"{MAX_STREAMS_PER_PRINCIPAL} per caller): use health's Check",
            )
        self._open[name] += 1
        return name

    def _release(self, name: str) -> None:
        self._open[name] -= 1
        if self._open[name] <= 0:
            del self._open[name]

    def _guard(self, behavior: Any) -> Any:
        if inspect.isasyncgenfunction(behavior):

            async def guarded_gen(
                request: Any, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                name = await self._admit(context)
                try:
                    async for item in behavior(request, context):
                        yield item
                finally:
                    self._release(name)

            return guarded_gen

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            name = await self._admit(context)
            try:
                return await behavior(request, context)
            finally:
                self._release(name)

        return guarded
