"""The daemon's end of local calls (``kvstore.local_calls``): a call that came over a session
connection, run by the very servicer method gRPC runs it with.

The call gets a ``LocalContext`` that presents the session's token as ``kvstore-session``
metadata, so the servicer authenticates it through the same ``Authenticator`` as a gRPC call of
that session (same principal, same handle checks); its deadline is the one the client sent;
``abort`` ends the call with the status and ``kvstore-error`` name a gRPC call would carry.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc

from kvstore import local_calls as wire
from kvstore.daemon.auth import SESSION_METADATA
from kvstore.daemon.service import Undecodable
from kvstore.v1 import kvstore_pb2 as pb

_SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
log = logging.getLogger(__name__)


class LocalAbort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, name: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.name = name


class LocalContext:
    """What the servicer's unary methods use of a ``grpc.aio.ServicerContext``."""

    def __init__(self, token: str, timeout_s: float) -> None:
        self._metadata = ((SESSION_METADATA, token),)
        self._deadline = time.monotonic() + timeout_s
        self._code: grpc.StatusCode | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def code(self) -> grpc.StatusCode | None:
        return self._code

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> None:
        self._code = code
        name = next((v for k, v in trailing_metadata or () if k == "kvstore-error"), "")
        raise LocalAbort(code, details, name)


Observe = Callable[[str, float, "grpc.StatusCode | None"], None]
Answer = Callable[[bytes], None]


class LocalCalls:
    """Runs local calls on ``servicer`` (a ``KVStoreServicer``); ``observe`` (the RPC metrics,
    when the daemon keeps them) times each call like the gRPC interceptor does."""

    def __init__(self, servicer: Any, observe: Observe | None = None) -> None:
        self._observe = observe
        self._methods = []
        for name in wire.METHODS:
            reply_type = getattr(pb, _SERVICE.methods_by_name[name].output_type.name)
            request_type = getattr(pb, _SERVICE.methods_by_name[name].input_type.name)
            self._methods.append((name, getattr(servicer, name), request_type, reply_type))

    def serve(
        self, token: str, frame: bytes, answer: Answer | None = None
    ) -> bytes | Awaitable[bytes]:
        """The reply frame to one request frame of the session ``token``: an error frame at
        once for a frame that does not decode, else a task that runs the servicer method under
        the call's deadline and gives the reply frame. ``answer``, if given, gets the reply
        frame from inside the task as soon as it is made (sent then, not a loop pass later
        by a done callback).

        The method runs in a task of its own, as it does under gRPC, never stepped by hand from
        the socket's callback: servicer and tier code may use what asyncio gives a task
        (``asyncio.timeout``, ``current_task``), and a coroutine stepped outside any task has
        neither (a lookup that reached the Redis tier failed with INTERNAL that way)."""
        try:
            index, call_id, timeout_s, body = wire.decode_request(frame)
        except ValueError as exc:
            return wire.encode_error(
                0, grpc.StatusCode.INVALID_ARGUMENT.value[0], "InvalidRequestError", str(exc)
            )
        name, method, request_type, _ = self._methods[index]
        start = time.perf_counter()
        try:
            request = request_type.FromString(body)
        except Exception as exc:  # as the gRPC decoder: a refusal, never INTERNAL
            request = Undecodable(name, exc)
        context = LocalContext(token, timeout_s)
        # Its own context, as a gRPC call's task has: the servicer sets the caller in a
        # contextvar.
        ctx = contextvars.copy_context()
        return asyncio.get_running_loop().create_task(
            self._finish(name, start, call_id, timeout_s, method(request, context), answer),
            context=ctx,
        )

    async def _finish(
        self,
        name: str,
        start: float,
        call_id: int,
        timeout_s: float,
        call: Coroutine[Any, Any, Any],
        answer: Answer | None,
    ) -> bytes:
        try:
            left = timeout_s - (time.perf_counter() - start)
            async with asyncio.timeout(max(0.0, left)):
                reply = await call
        except BaseException as exc:
            frame = self._reply(name, start, call_id, None, exc)
        else:
            frame = self._reply(name, start, call_id, reply, None)
        if answer is not None:
            answer(frame)
        return frame

    def _reply(
        self, name: str, start: float, call_id: int, reply: Any, error: BaseException | None
    ) -> bytes:
        code = grpc.StatusCode.OK
        try:
            if isinstance(error, TimeoutError):
                code = grpc.StatusCode.DEADLINE_EXCEEDED
                return wire.encode_error(call_id, code.value[0], "", "Deadline Exceeded")
            if isinstance(error, LocalAbort):
                code = error.code
                return wire.encode_error(call_id, code.value[0], error.name, error.details)
            if error is not None:
                raise error
            data = wire.encode_reply(call_id, reply.SerializeToString())
            if len(data) > wire.MAX_REPLY_BYTES:
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
                return wire.encode_error(
                    call_id, code.value[0], "", "reply too large for a local call: use gRPC"
                )
            return data
        except Exception as exc:  # escaped the servicer's own handling: as grpc.aio answers
            log.exception("local call %s failed", name)
            code = grpc.StatusCode.UNKNOWN
            return wire.encode_error(call_id, code.value[0], "", f"Unexpected {type(exc)}: {exc}")
        finally:
            if self._observe is not None:
                self._observe(name, time.perf_counter() - start, code)
