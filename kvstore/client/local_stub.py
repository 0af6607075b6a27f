"""The control calls of ``KVStoreStub`` as local calls (``kvstore.local_calls``) over the session
socket, with the stub's signature, for the blocking face (``LocalStub``) and the asyncio face
(``AsyncLocalStub``): ``Lookup``, ``Reserve``, ``Commit``, ``Abort``, ``Acquire``, ``Release``,
``Prefetch``, ``Delete``, ``Bind``.

A request too large for one datagram goes over gRPC, and so does every call once the session has
failed (the daemon stopped or restarted): gRPC then answers as it would have (UNAVAILABLE, or
NOT_FOUND for the old handle, and the client reopens), so a broken session changes nothing a
caller sees. An error reply becomes a ``LocalCallError``, which reads like a gRPC error, so the
faces translate both the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from kvstore import local_calls
from kvstore.client.session import ClientSession, SessionBroken
from kvstore.v1 import kvstore_pb2 as pb

_SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
_REPLY_TYPES = {
    name: getattr(pb, _SERVICE.methods_by_name[name].output_type.name)
    for name in local_calls.METHODS
}
_STATUS_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}
_LIMIT = local_calls.MAX_REQUEST_BYTES - local_calls.REQUEST.size


class LocalCallError(grpc.RpcError):
    """A local call's error reply, read like a gRPC error (``translate_error``)."""

    def __init__(self, status: int, body: memoryview | bytes) -> None:
        name, message = local_calls.decode_error(memoryview(body))
        super().__init__(message)
        self._code = _STATUS_BY_NUMBER.get(status, grpc.StatusCode.UNKNOWN)
        self._details = message
        self._name = name

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("kvstore-error", self._name),) if self._name else ()


class _LocalStubBase:
    """What both faces share: one method per local call, bound to the stub's gRPC method for
    the fallback; a face turns ``(index, reply type, gRPC method)`` into its call (``_bind``)."""

    def __init__(self, stub: Any, session: Callable[[], ClientSession | None]) -> None:
        self._stub = stub
        self._session = session
        for name in local_calls.METHODS:
            index = local_calls.METHOD_INDEX[name]
            setattr(self, name, self._bind(index, _REPLY_TYPES[name], getattr(stub, name)))

    def _bind(self, index: int, reply_type: Any, grpc_method: Any) -> Callable[..., Any]:
        raise NotImplementedError

    def _local(self, request: Any) -> tuple[ClientSession, bytes] | None:
        """The session and the serialized request when this call may go local, else None."""
        session = self._session()
        if session is None or not session.calls:
            return None
        body = request.SerializeToString()
        return (session, body) if len(body) <= _LIMIT else None

    def goes_local(self, request: Any) -> bool:
        """Whether ``request`` would go as a local call (over the session, in order)."""
        return self._local(request) is not None

    def __getattr__(self, name: str) -> Callable[..., Any]:  # for type checkers: set above
        raise AttributeError(name)


def _parse(reply_type: Any, status: int, reply: memoryview | bytes) -> Any:
    if status != local_calls.STATUS_OK:
        raise LocalCallError(status, reply)
    return reply_type.FromString(reply)


class PostedCall:
    """A local call sent by ``LocalStub.post``; ``result()`` waits for its reply and parses it
    (a ``LocalCallError`` for an error reply)."""

    def __init__(self, session: ClientSession, call_id: int, reply_type: Any) -> None:
        self._session = session
        self._call_id = call_id
        self._reply_type = reply_type

    def result(self) -> Any:
        status, reply = self._session.settle(self._call_id)
        return _parse(self._reply_type, status, reply)


class LocalStub(_LocalStubBase):
    """Blocking: each method waits for its reply on the session socket; ``post`` sends one
    without waiting."""

    def post(self, name: str, request: Any, timeout: float) -> PostedCall | None:
        """Send call ``name`` and return before its reply (``ClientSession.post``); None when
        it cannot go as a local call (the caller makes it the ordinary way)."""
        local = self._local(request)
        if local is None:
            return None
        session, body = local
        try:
            call_id = session.post(local_calls.METHOD_INDEX[name], body, timeout)
        except SessionBroken:
            session.calls = False  # this session is over: gRPC from now on
            return None
        return PostedCall(session, call_id, _REPLY_TYPES[name])

    def _bind(self, index: int, reply_type: Any, grpc_method: Any) -> Callable[..., Any]:
        def call(request: Any, timeout: float) -> Any:
            local = self._local(request)
            if local is not None:
                session, body = local
                try:
                    status, reply = session.call(index, body, timeout)
                except SessionBroken:
                    session.calls = False  # this session is over: gRPC from now on
                else:
                    return _parse(reply_type, status, reply)
            return grpc_method(request, timeout=timeout)

        return call


class AsyncLocalStub(_LocalStubBase):
    """Asyncio: each method awaits its reply on the event loop (``ClientSession.acall``), so a
    local call never blocks the loop; the fallback is the ``grpc.aio`` stub."""

    def _bind(self, index: int, reply_type: Any, grpc_method: Any) -> Callable[..., Any]:
        async def call(request: Any, timeout: float) -> Any:
            local = self._local(request)
            if local is not None:
                session, body = local
                try:
                    status, reply = await session.acall(index, body, timeout)
                except SessionBroken:
                    session.calls = False  # this session is over: gRPC from now on
                else:
                    return _parse(reply_type, status, reply)
            return await grpc_method(request, timeout=timeout)

        return call
