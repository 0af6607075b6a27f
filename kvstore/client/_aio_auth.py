"""Metadata on every call of an asyncio channel (``_common.make_aio_channel``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc


def _details(d: Any, metadata: Sequence[tuple[str, str]]) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(
        d.method, d.timeout, [*(d.metadata or ()), *metadata], d.credentials, d.wait_for_ready
    )


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, metadata: Callable[[], Sequence[tuple[str, str]]]) -> None:
        self.metadata = metadata

    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(_details(client_call_details, self.metadata()), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, metadata: Callable[[], Sequence[tuple[str, str]]]) -> None:
        self.metadata = metadata

    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(_details(client_call_details, self.metadata()), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, metadata: Callable[[], Sequence[tuple[str, str]]]) -> None:
        self.metadata = metadata

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(_details(client_call_details, self.metadata()), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, metadata: Callable[[], Sequence[tuple[str, str]]]) -> None:
        self.metadata = metadata

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(_details(client_call_details, self.metadata()), request_iterator)


def aio_interceptors(
    metadata: Callable[[], Sequence[tuple[str, str]]],
) -> list[grpc.aio.ClientInterceptor]:
    return [
        _UnaryUnary(metadata),
        _UnaryStream(metadata),
        _StreamUnary(metadata),
        _StreamStream(metadata),
    ]
