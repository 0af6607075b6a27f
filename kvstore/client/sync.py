"""``KVStoreClient``: the blocking client library serving engines use.

Same-host clients map the daemon's shared-memory arena and copy blocks straight into and out of
its slots: one copy per block (checksummed as it is copied) and, per batch, two calls for a put
(reserve + commit) and one for a get (acquire; its release rides on the next call). Their
control calls go over the session socket when the daemon offers it (``kvstore.local_calls``),
else over gRPC. A client that cannot map the arena (another host, another user) or is built with
``transport="grpc"`` sends the bytes over streaming RPCs instead; both paths return the same data.

The logic is the client core's (``kvstore.client.core``); this face performs its steps with
blocking calls. A client holds one namespace (model + layout + tenant) and is not thread-safe:
give each thread its own client (they are cheap; the daemon is shared).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import grpc
import torch

from kvstore.address import default_address
from kvstore.client._common import (
    call_metadata,
    make_channel,
    open_request,
    open_session,
    translate_error,
)
from kvstore.client.block_watch import BlockWatch
from kvstore.client.core import ClientCore
from kvstore.client.leases import ReadLease, WriteReservation
from kvstore.client.local_stub import LocalStub
from kvstore.client.steps import Blocking, Call, Fetch, Op, Post, Settle
from kvstore.errors import KVStoreError, UnauthenticatedError, UnknownNamespaceError
from kvstore.layout import KVLayout
from kvstore.local_calls import METHOD_INDEX
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

R = TypeVar("R")


class KVStoreClient(ClientCore):
    """Blocking client of one namespace. See the module docstring.

    ``address``: ``unix:/path.sock`` or ``host:port``; default ``$KVSTORE_ADDRESS`` or the
    daemon's default socket. ``transport``: ``"auto"`` (shared memory when the arena can be
    mapped, else bytes), ``"shm"`` (shared memory or fail) or ``"grpc"`` (always bytes).
    ``verify_checksums``: check every block read against its checksum (a mismatch is a miss).
    """

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
        self._channel = make_channel(
            self.address,
            self._credentials,
            lambda: call_metadata(self._credentials, self._session),
        )
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._rpc = LocalStub(self._stub, lambda: self._session)
        try:
            self._open()
        except BaseException:
            self._channel.close()
            raise

    # ------------------------------------------------------------------ performing steps
    def _open(self) -> None:
        """Open the namespace: the daemon answers with a handle on a stream that stays open for
        as long as this client uses it (no deadline on the stream; ``timeout_s`` bounds only
        the wait for its first message)."""
        self._close_stream()
        self._close_session()
        self._session = open_session(self.address, self.timeout_s)
        call = self._stub.OpenNamespace(
            open_request(self.namespace, self._priority), wait_for_ready=True
        )
        timer = threading.Timer(self.timeout_s, call.cancel)
        timer.start()
        try:
            reply = next(call)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED and not timer.is_alive():
                raise translate_error(
                    _Timeout(f"no answer to OpenNamespace within {self.timeout_s}s")
                ) from None
            raise translate_error(err) from None
        except StopIteration:
            raise KVStoreError("the daemon closed the namespace stream at once") from None
        finally:
            timer.cancel()
        self._stream = call
        self._opened(reply)

    def _call(self, method: Callable[..., R], build: Callable[[], Any]) -> R:
        """Call ``method(build())``; if the daemon restarted and forgot our namespace, open it
        again and retry once. gRPC errors become kvstore exceptions."""
        for attempt in range(2):
            try:
                return method(build(), timeout=self.timeout_s)
            except grpc.RpcError as err:
                exc = translate_error(err)
                if isinstance(exc, UnknownNamespaceError | UnauthenticatedError) and attempt == 0:
                    self._open()
                    continue
                raise exc from None
        raise AssertionError("unreachable")

    def _fetch(self, request: pb.GetBlocksRequest, timeout: float, step: Fetch) -> None:
        call = self._stub.GetBlocks(request, timeout=timeout)
        for message in call:
            if not step.consume(message):
                call.cancel()  # the run ended: the daemon releases the lease
                break

    def _perform(self, step: Any) -> Any:
        if isinstance(step, Call | Fetch) and self._session is not None:
            # Served after a posted call, whichever way this one goes (the daemon orders the
            # session's calls, but not a gRPC call beside them).
            self._session.read_posted()
        if isinstance(step, Call):
            # The control calls as local calls when the session offers them (LocalStub).
            where = self._rpc if step.method in METHOD_INDEX else self._stub
            return self._call(getattr(where, step.method), step.build)
        if isinstance(step, Fetch):
            return self._call(lambda req, timeout: self._fetch(req, timeout, step), step.build)
        if isinstance(step, Blocking):
            return step.fn()  # on the caller's thread, so on its current CUDA stream
        if isinstance(step, Post):
            request = step.build()  # once: it takes the releases it carries
            posted = self._rpc.post(step.method, request, self.timeout_s)
            if posted is not None:
                return posted
            # Not as a local call: made now, its reply (or error) kept for the Settle.
            return _Made(partial(self._call, getattr(self._rpc, step.method), lambda: request))
        if isinstance(step, Settle):
            try:
                return step.token.result()
            except grpc.RpcError as err:
                raise translate_error(err) from None
        raise AssertionError(f"unknown step {step!r}")

    def _run(self, op: Op[R]) -> R:
        """Perform the steps of a core operation until it returns; a step's error is raised
        inside the operation, where its cleanup runs."""
        try:
            step = next(op)
            while True:
                try:
                    result = self._perform(step)
                except BaseException as exc:
                    step = op.throw(exc)
                else:
                    step = op.send(result)
        except StopIteration as stop:
            return stop.value

    def _new_reservation(self, *args: Any) -> WriteReservation:
        return WriteReservation(*args, run=self._run)  # type: ignore[misc]  # args: 8, run: 9th

    def _new_lease(self, *args: Any) -> ReadLease:
        return ReadLease(*args, run=self._run)  # type: ignore[misc]  # args: 8, run: 9th

    def close(self) -> None:
        with contextlib.suppress(KVStoreError, OSError):
            self._run(self._settle_at_close())  # a put that did not wait: served first
        tally = self._tally_call()
        if tally is not None:
            session, method, request, timeout_s = tally
            with contextlib.suppress(KVStoreError, OSError):
                session.call(method, request, timeout_s)
        self._close_local()
        self._channel.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ API
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored, in any tier."""
        return self._run(self._lookup(keys))

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Hint that ``keys`` will be read soon. Returns as soon as the daemon has queued the
        promotion (one small call; no data moves in it): the blocks come up in the background,
        into the GPU pool once this client has mapped it (a later ``load`` then copies device
        to device), else into the CPU tier."""
        self._run(self._prefetch(keys))

    def put(
        self,
        keys: Sequence[bytes],
        blocks: torch.Tensor,
        priority: int | None = None,
        *,
        wait: bool = True,
    ) -> int:
        """Store ``blocks[i]`` under ``keys[i]``; returns how many were newly stored (present keys
        are deduplicated). ``blocks`` is ``[n, *layout.block_shape]`` of the layout's dtype.

        Keys another client is writing at that moment are waited for (bounded by the daemon's
        ``write_wait_s`` and ``timeout_s``), so a ``get`` after ``put`` returns finds them; the
        count returned is a ``PutCount`` whose ``pending`` says how many were still being
        written by another client when that wait ended (0 normally).

        ``wait=False``: return once the blocks are copied out of ``blocks`` and the call that
        commits them is sent, with 0; ``flush()`` returns how many were stored and raises what
        went wrong. This client reads its own writes at once; others once it flushes, or soon
        after (``kvstore.client.posted_puts``)."""
        return self._run(self._put(keys, blocks, priority, wait))

    def flush(self) -> int:
        """Wait until the daemon has served every put made with ``wait=False``; how many blocks
        they newly stored since the last flush (``dropped``: how many were not). Raises the
        first error one of them met."""
        return self._run(self._flush())

    def get(self, keys: Sequence[bytes], out: torch.Tensor | None = None) -> torch.Tensor:
        """The leading run of stored blocks, ``[m, *block_shape]`` with ``m <= len(keys)``.

        With ``out`` (``[>= len(keys), *block_shape]``, contiguous, CPU) the blocks are written
        into it and ``out[:m]`` is returned; no memory is allocated.
        """
        return self._run(self._get(keys, out))

    def delete(self, keys: Sequence[bytes]) -> int:
        return self._run(self._delete(keys))

    def clear(self) -> int:
        """Delete every block of this namespace (every client's: the namespace is shared by
        all who open it); returns how many. Blocks being read go when their reads end; copies
        in the shared Redis tier stay until they expire."""
        return self._run(self._clear())

    def stats(self) -> pb.StatsResponse:
        return self._run(self._stats())

    def watch_blocks(self) -> BlockWatch:
        """Which tiers hold each block of this namespace, as that changes: an iterator of
        ``BlockEvents``, the first a snapshot of the whole namespace (and so is any later one
        with ``reset``: the watch fell behind). It blocks between events; ``close()`` it from
        any thread. It ends when this client closes; a daemon restart ends it with
        ``UnknownNamespaceError`` (watch again from a new client)."""
        return BlockWatch(self._stub.WatchBlocks(pb.WatchBlocksRequest(handle=self._handle)))

    # ------------------------------------------------------------------ paged caches
    def offload(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        keys: Sequence[bytes],
        priority: int | None = None,
    ) -> int:
        """Store physical blocks ``block_ids`` of an engine's paged cache (``kv_caches``: one
        ``[2, num_blocks, block_size, H, D]`` tensor per layer) under ``keys``, gathering them
        straight into shared memory, or, for CUDA caches on the daemon's GPU, into its GPU pool
        (device to device). Returns how many blocks were newly stored."""
        return self._run(self._offload(kv_caches, block_ids, keys, priority))

    def load(
        self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], keys: Sequence[bytes]
    ) -> int:
        """Fill physical blocks ``block_ids`` from the store; returns n, the number of leading
        blocks loaded (the rest were not cached, or failed their checksum)."""
        return self._run(self._load(kv_caches, block_ids, keys))

    # ------------------------------------------------------------------ zero-copy API
    def reserve(
        self,
        keys: Sequence[bytes],
        priority: int | None = None,
        *,
        _packed: bytes | None = None,
        _device: torch.device | None = None,
    ) -> WriteReservation:
        """Reserve slots for the keys not yet stored. Write each ``reservation.views[j]`` (a
        ``[*block_shape]`` tensor over shared memory, for ``keys[reservation.indices[j]]``),
        then ``commit()``; or use it as a context manager (commit on success, abort on error).
        Blocks become visible to readers only at commit."""
        return self._run(self._reserve(keys, priority, _packed, _device))

    def acquire(
        self,
        keys: Sequence[bytes],
        *,
        lookup: bool = False,
        prefetch: bool = False,
        _packed: bytes | None = None,
        _device: torch.device | None = None,
    ) -> ReadLease:
        """Lease the leading run of stored blocks: ``lease.views[i]`` reads block i in place
        (verify with ``lease.verify(i)`` after copying); ``release()`` when done.

        A caller that would also ``lookup`` and ``prefetch`` the same keys gets all three in
        this one round trip: ``lookup=True`` sets ``lease.found`` to what ``lookup(keys)``
        answers (it may exceed ``len(lease)``: blocks in Redis), ``prefetch=True`` queues the
        keys after the leased run as ``prefetch(keys[len(lease):])`` would."""
        return self._run(self._acquire(keys, _packed, _device, lookup, prefetch))


class _Made:
    """A posted call that was made at once (no local call to post it as): its outcome."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._reply: Any = None
        self._error: KVStoreError | None = None
        try:
            self._reply = call()
        except KVStoreError as exc:
            self._error = exc

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._reply


class _Timeout(grpc.RpcError):
    """A deadline this client enforces itself (the OpenNamespace stream has none)."""

    def __init__(self, details: str) -> None:
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._details
