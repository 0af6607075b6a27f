"""The daemon's end of local calls (``kvstore.local_calls``): a call that came over a session
connection, run by the very servicer method gRPC runs it with.

The call gets a ``LocalContext`` that presents the session's token as ``kvstore-session``
metadata, so the servicer authenticates it through the same ``Authenticator`` as a gRPC call of
that session (same principal, same handle checks); its deadline is the one the client sent;
``abort`` ends the call with the status and ``kvstore-error`` name a gRPC call would carry.

A peer's frame is decoded by ``decode_call`` (pure: bytes in, a ``DecodedCall`` or
``kvstore.local_calls.FrameError`` out, nothing else): a frame that is not a call is answered
with ``INVALID_ARGUMENT`` at once; a call whose message does not decode goes to its servicer
method as ``Undecodable``, which refuses it as gRPC does (after the caller is authenticated,
logged at most once per 10 s). Every request frame gets a reply frame, whatever its bytes.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, NamedTuple

import grpc

from kvstore import local_calls as wire
from kvstore.daemon.auth import SESSION_METADATA
from kvstore.daemon.service import Undecodable
from kvstore.daemon.shared import SharedTier
from kvstore.local_calls import FrameError
from kvstore.v1 import kvstore_pb2 as pb

_SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
log = logging.getLogger(__name__)
_REQUEST_TYPES = tuple(
    getattr(pb, _SERVICE.methods_by_name[name].input_type.name) for name in wire.METHODS
)


class DecodedCall(NamedTuple):
    name: str  # the method's name (``kvstore.local_calls.METHODS``)
    call_id: int
    timeout_s: float
    request: Any  # its request message


def decode_call(frame: bytes | memoryview) -> DecodedCall:
    """The call a request frame carries; ``FrameError`` (with the call id where the header
    gave one) for bytes that are not a call, or whose message does not decode as the method's
    request (its ``__cause__`` is the decoder's error). Raises nothing else, whatever the
    bytes."""
    index, call_id, timeout_s, body = wire.decode_request(frame)
    name = wire.METHODS[index]
    try:
        request = _REQUEST_TYPES[index].FromString(body)
    except Exception as exc:  # DecodeError, or worse (a nesting past upb's depth): refused
        raise FrameError(
            f"the request does not decode as {name}'s message: {exc}", call_id
        ) from exc
    return DecodedCall(name, call_id, timeout_s, request)


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


_NEVER_WAIT = frozenset(("Release", "Abort", "Delete", "Prefetch"))
"""Local calls whose servicer method awaits nothing that can wait, on any path."""


class _Rest:
    """Awaits the rest of a coroutine that was stepped by hand until it first waited on
    ``waits_on``: what the coroutine yields goes to the task that awaits this, and what the
    task sends or throws (a result, a cancellation) goes back into the coroutine."""

    def __init__(self, coro: Coroutine[Any, Any, Any], waits_on: Any) -> None:
        self._coro = coro
        self._waits_on = waits_on

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, waits_on = self._coro, self._waits_on
        while True:
            try:
                sent = yield waits_on
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # a cancellation, the deadline's included
                try:
                    waits_on = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    waits_on = coro.send(sent)
                except StopIteration as done:
                    return done.value


Observe = Callable[[str, float, "grpc.StatusCode | None"], None]
Answer = Callable[[bytes], None]


class LocalCalls:
    """Runs local calls on ``servicer`` (a ``KVStoreServicer``); ``observe`` (the RPC metrics,
    when the daemon keeps them) times each call like the gRPC interceptor does."""

    def __init__(self, servicer: Any, observe: Observe | None = None) -> None:
        self._observe = observe
        # The store's Redis tier (``SharedTier``), which decides what may be stepped inline;
        # None for a servicer without a ``BlockStore``: then every call runs in a task.
        shared = getattr(getattr(servicer, "store", None), "shared", None)
        self._shared = shared if isinstance(shared, SharedTier) else None
        self._methods = []
        for name in wire.METHODS:
            reply_type = getattr(pb, _SERVICE.methods_by_name[name].output_type.name)
            request_type = getattr(pb, _SERVICE.methods_by_name[name].input_type.name)
            self._methods.append((name, getattr(servicer, name), request_type, reply_type))

    def serve(
        self, token: str, frame: bytes, answer: Answer | None = None
    ) -> bytes | Awaitable[bytes]:
        """The reply frame to one request frame of the session ``token``: the reply frame at
        once when the call finished without waiting (or did not decode), else a task that
        finishes it under the call's deadline and gives the reply frame. ``answer``, if given,
        gets the reply frame from inside that task as soon as it is made (sent then, not a loop
        pass later by a done callback).

        A call is first stepped right here, in the socket's callback, when ``_steps_inline``
        says nothing it can reach before its first wait needs a task: most calls (a lookup, a
        release, a commit) never wait, and are answered with no task, no timer and no extra
        loop pass. One that does wait is handed, as it stands, to a task of its own (as under
        gRPC), which runs the rest under the deadline. Code that needs a task before it
        first waits (``asyncio.timeout``, ``current_task``: redis-py does) is never stepped
        here: a lookup that reached the Redis tier failed with INTERNAL when it was."""
        try:
            name, call_id, timeout_s, request = decode_call(frame)
        except FrameError as exc:
            if not isinstance(exc.__cause__, Exception):  # not a call at all
                return wire.encode_error(
                    exc.call_id, wire.STATUS_INVALID, "InvalidRequestError", str(exc)
                )
            # A call whose message does not decode: refused by its method, as gRPC does.
            index, call_id, timeout_s, _ = wire.decode_request(frame)
            name = wire.METHODS[index]
            request = Undecodable(name, exc.__cause__)
        method = self._methods[wire.METHOD_INDEX[name]][1]
        start = time.perf_counter()
        context = LocalContext(token, timeout_s)
        # Its own context, as a gRPC call's task has: the servicer sets the caller in a
        # contextvar.
        ctx = contextvars.copy_context()
        coro = method(request, context)
        rest: Awaitable[Any] = coro
        if self._steps_inline(name):
            try:
                waits_on = ctx.run(coro.send, None)
            except StopIteration as done:
                return self._reply(name, start, call_id, done.value, None)
            except Exception as exc:
                return self._reply(name, start, call_id, None, exc)
            rest = _Rest(coro, waits_on)
        return asyncio.get_running_loop().create_task(
            self._finish(name, start, call_id, timeout_s, rest, answer), context=ctx
        )

    def _steps_inline(self, name: str) -> bool:
        """Whether call ``name`` may be stepped outside a task (see ``serve``). Without a
        Redis tier nothing a call reaches needs one (the daemon's own waits are futures,
        events and executor jobs); with one, only the calls that never wait at all."""
        shared = self._shared
        return shared is not None and (name in _NEVER_WAIT or not shared.enabled)

    async def _finish(
        self,
        name: str,
        start: float,
        call_id: int,
        timeout_s: float,
        call: Awaitable[Any],
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
