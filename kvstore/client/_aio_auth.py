"""Metadata on every call of an asyncio channel (``channels.make_aio_channel``).

grpc.aio files an interceptor under the first call kind it implements, so each kind needs its
own class; they share everything but the one method."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc

Metadata = Callable[[], Sequence[tuple[str, str]]]


class _AddsMetadata:
    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata

    def details(self, d: Any) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(
            d.method, d.timeout, [*(d.metadata or ()), *self.metadata()], d.credentials,
            d.wait_for_ready,
        )  # fmt: skip


class _UnaryUnary(_AddsMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self.details(client_call_details), request)


class _UnaryStream(_AddsMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self.details(client_call_details), request)


class _StreamUnary(_AddsMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self.details(client_call_details), request_iterator)


class _StreamStream(_AddsMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self.details(client_call_details), request_iterator)


def aio_interceptors(metadata: Metadata) -> list[grpc.aio.ClientInterceptor]:
    return [_UnaryUnary(metadata), _UnaryStream(metadata), _StreamUnary(metadata),
            _StreamStream(metadata)]  # fmt: skip
