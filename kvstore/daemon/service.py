"""The gRPC face of the block store: decodes requests, calls ``BlockStore``, encodes replies.

Every error becomes a gRPC status with a message that names the problem; the store's state is
never left half-changed by a bad request (validation happens before any change). A request that
does not even decode gets INVALID_ARGUMENT, with one rate-limited log line instead of a
traceback per request. The servicer runs on the daemon's one event loop, like the store.

Handles: ``OpenNamespace`` answers with a handle and keeps its stream open; when the stream
ends (the client closed it, or died and its connection closed) the store closes the handle,
aborting its reservations and releasing its leases at once. Every other call presents the
handle, and the store checks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from kvstore.daemon.auth import OWNER, Authenticator, Principal, caller_key
from kvstore.daemon.store import BlockStore, Handle
from kvstore.errors import (
    CapacityError,
    InvalidRequestError,
    KVStoreError,
    LeaseExpiredError,
    NamespaceMismatchError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
    UnknownNamespaceError,
)
from kvstore.index import IN_CPU, IN_GPU
from kvstore.keys import HASH_VERSION, KEY_BYTES, Namespace, unpack_keys
from kvstore.layout import SCALE_NONE, KVLayout, dtype_from_name
from kvstore.presence import PresenceTable
from kvstore.ratelog import RateLimitedLog
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.version import __version__

log = logging.getLogger(__name__)

_STATUS: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (NamespaceMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (LeaseExpiredError, grpc.StatusCode.FAILED_PRECONDITION),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnknownNamespaceError, grpc.StatusCode.NOT_FOUND),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (OverflowError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
]

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
MIN_CHUNK_BYTES = 4096  # PutBlocks: a block may take ceil(block / this) + 1 messages at most

# The authenticated caller of the RPC running in this task (each RPC runs in its own task).
_caller: contextvars.ContextVar[Principal] = contextvars.ContextVar("kvstore_caller")


_bad_requests = RateLimitedLog(log)


class Undecodable:
    """Stands for a request whose bytes did not decode; the handler refuses it."""

    def __init__(self, method: str, error: Exception) -> None:
        self.method = method
        self.error = error


_U64_MAX = (1 << 64) - 1


def _u64(n: int) -> int:
    """``n`` for a uint64 field, saturated."""
    return min(n, _U64_MAX)


def _decoder(method: str, message_type: Any) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except Exception as exc:  # DecodeError, or worse: never an INTERNAL for bad bytes
            return Undecodable(method, exc)

    return decode


def _status_for(exc: BaseException) -> grpc.StatusCode:
    for exc_type, code in _STATUS:
        if isinstance(exc, exc_type):
            return code
    return grpc.StatusCode.INTERNAL


def _error_name(exc: BaseException) -> str:
    if isinstance(exc, KVStoreError):
        return type(exc).__name__
    if isinstance(exc, ValueError):
        return InvalidRequestError.__name__
    return "InternalError"


async def abort_with(context: grpc.aio.ServicerContext, where: str, exc: BaseException) -> None:
    """Abort the call with the status for ``exc``; the error's class travels as a trailer."""
    code = _status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error in %s", where)
    await context.abort(
        code, f"{where}: {exc}", trailing_metadata=(("kvstore-error", _error_name(exc)),)
    )


def _check_decoded(request: Any, where: str) -> None:
    if isinstance(request, Undecodable):
        _bad_requests.warning("undecodable", f"{where}: undecodable request ({request.error})")
        raise ValueError(f"the request does not decode as {where}'s message: {request.error}")


def _rpc(method: F) -> F:
    """Turn exceptions into gRPC statuses; an unexpected one is logged and reported INTERNAL."""

    @functools.wraps(method)
    async def wrapper(
        self: KVStoreServicer, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            # Who calls, before anything else: an unauthenticated call touches nothing.
            _caller.set(self.auth.principal(context))
            _check_decoded(request, method.__name__)
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, method.__name__, exc)

    return wrapper  # type: ignore[return-value]


def _keys(packed: bytes, max_keys: int, what: str = "keys") -> list[bytes]:
    if len(packed) % KEY_BYTES:
        raise ValueError(f"{what} field is {len(packed)} bytes, not a multiple of {KEY_BYTES}")
    if len(packed) // KEY_BYTES > max_keys:
        raise ValueError(
            f"{len(packed) // KEY_BYTES} keys, more than limits.max_keys_per_request ({max_keys})"
        )
    return unpack_keys(packed)  # type: ignore[return-value]


def namespace_from_request(request: pb.OpenNamespaceRequest, max_name_bytes: int) -> Namespace:
    if not request.HasField("layout"):
        raise ValueError("OpenNamespace needs a layout")
    for what in ("model", "revision", "tenant"):
        size = len(getattr(request, what).encode("utf-8"))
        if size > max_name_bytes:
            raise ValueError(
                f"{what} is {size} bytes, more than limits.max_name_bytes ({max_name_bytes})"
            )
    lay = request.layout
    if len(lay.dtype) > 64 or len(lay.scale_format) > 64:
        raise ValueError("layout dtype or scale format name is too long")
    layout = KVLayout(
        num_layers=lay.num_layers,
        num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim,
        block_size=lay.block_size,
        dtype=dtype_from_name(lay.dtype),
        scale_format=lay.scale_format or SCALE_NONE,  # "": a client from before scale formats
    )
    return Namespace(
        model=request.model,
        layout=layout,
        revision=request.revision,
        tenant=request.tenant,
        tp_rank=lay.tp_rank,
        tp_size=lay.tp_size or 1,
        hash_version=lay.hash_version or HASH_VERSION,  # 0: unset, the current version
    )


def remaining_s(context: grpc.aio.ServicerContext) -> float:
    """Seconds left before the call's deadline (a long time when it has none)."""
    left = context.time_remaining()
    return 3600.0 if left is None else max(0.0, left - 0.05)


WATCH_INTERVAL_S = 0.01
"""Changes of a watched namespace go out at most this often (a router's picture lags by that)."""

WATCH_BATCH_BLOCKS = 4096
"""Blocks per WatchBlocks message (~136 KiB): a snapshot of a large namespace goes in parts."""


class KVStoreServicer(pb_grpc.KVStoreServicer):
    """Implements ``kvstore.v1.KVStore`` over one ``BlockStore``."""

    def __init__(self, store: BlockStore, auth: Authenticator | None = None) -> None:
        self.store = store
        self.auth: Any = auth if auth is not None else _Everyone()
        self.limits = store.config.limits
        self.started_at = time.monotonic()
        self._closing = asyncio.Event()
        self._handles_of: dict[str, int] = {}  # open handles per caller (``caller_key``)

    def close_streams(self) -> None:
        """End every OpenNamespace stream (the daemon is stopping): clients see their handle
        end now rather than after the stop's grace period."""
        self._closing.set()

    def presence_of(self, principal: Principal, token: bytes) -> tuple[PresenceTable, bool]:
        """For the session socket: the presence table of the namespace handle ``token`` names,
        if ``principal`` opened it (as ``_handle``), and whether a lookup may still find a key
        it lacks (in the Redis tier)."""
        handle = self.store.handle(token)
        if handle.principal is not None and handle.principal != principal:
            raise UnknownNamespaceError("unknown namespace handle")
        return self.store.presence(handle), self.store.shared.enabled

    def _handle(self, token: bytes, write: bool = False, release: Sequence[int] = ()) -> Handle:
        """The handle ``token`` names, if the caller is the one that opened it (anything else
        is NOT_FOUND, like a handle that never existed); ``write``: the call stores or deletes,
        which a reader of a shared namespace may not. ``release``: lease ids the request
        carries (``release_leases``), released first, whatever the call does then."""
        handle = self.store.handle(token)
        if handle.principal is not None and handle.principal != _caller.get(OWNER):
            raise UnknownNamespaceError(
                "unknown namespace handle (closed, or the daemon restarted): open the namespace "
                "again"
            )
        if release:
            if len(release) > self.limits.max_leases_per_handle:
                raise ValueError(
                    f"{len(release)} leases to release, more than limits.max_leases_per_handle"
                )
            for lease_id in release:
                with contextlib.suppress(LeaseExpiredError):  # expired: already dropped
                    self.store.release(handle, lease_id)
        if write and not handle.writable:
            raise PermissionDeniedError(
                f"namespace {handle.record.name!r} is shared with this caller read-only"
            )
        return handle

    def _keys(self, packed: bytes) -> list[bytes]:
        return _keys(packed, self.limits.max_keys_per_request)

    async def OpenNamespace(
        self, request: pb.OpenNamespaceRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.OpenNamespaceResponse]:
        try:
            principal = self.auth.principal(context)
            _check_decoded(request, "OpenNamespace")
            namespace = namespace_from_request(request, self.limits.max_name_bytes)
            if not principal.may_read(namespace.tenant):
                # The same answer whether or not the tenant or namespace exists.
                raise PermissionDeniedError(
                    f"{principal.name} may not use tenant {namespace.tenant!r}"
                )
            # One caller (a tenant with a policy; a uid, token or certificate without one)
            # may hold at most a quarter of all handles, so it cannot lock the others out of
            # opening namespaces; without a policy too (a runaway process of root's).
            who = caller_key(principal)
            held = self._handles_of.get(who, 0)
            if held >= max(1, self.limits.max_handles // 4):
                raise CapacityError(
                    f"{who} holds {held} open namespace handles, a quarter of "
                    f"limits.max_handles ({self.limits.max_handles}): close some first"
                )
            handle = self.store.open_namespace(namespace, request.priority, principal)
            self._handles_of[who] = held + 1
            handle.principal = principal
            handle.writable = principal.may_write(namespace.tenant)
        except Exception as exc:
            await abort_with(context, "OpenNamespace", exc)
            return
        try:
            yield self._open_reply(handle, principal)
            # The handle lives as long as this stream: wait for the client to close it (or
            # its connection to drop), then reclaim what it still holds.
            await self._closing.wait()
        finally:
            self.store.close_handle(handle)
            left = self._handles_of.pop(who, 1) - 1
            if left:
                self._handles_of[who] = left

    def _open_reply(self, handle: Handle, principal: Principal) -> pb.OpenNamespaceResponse:
        record = handle.record
        arena = self.store.arena
        reply = pb.OpenNamespaceResponse(
            handle=handle.token,
            seed=record.namespace.seed if record.namespace else b"",
            block_bytes=record.block_bytes,
            fingerprint=record.fingerprint,
            arena=pb.ArenaInfo(size_bytes=arena.size_bytes, token=arena.token),
            max_keys_per_request=self.limits.max_keys_per_request,
            max_chunk_bytes=self.limits.chunk_bytes,
        )
        pool = self.store.device.pool
        # The GPU pool is one undivided allocation: only a caller of every tenant may map it.
        if pool is not None and pool.ipc_handle and principal.all_tenants:
            reply.gpu.CopyFrom(
                pb.DevicePoolInfo(
                    device_uuid=pool.uuid,
                    ipc_handle=pool.ipc_handle,
                    size_bytes=pool.size_bytes,
                    token=pool.token,
                )
            )
        return reply

    @_rpc
    async def Lookup(self, request, context):
        handle = self._handle(request.handle, release=request.release_leases)
        keys = self._keys(request.keys)  # a request refused is refused before it counts
        if request.table_keys:
            in_cpu = request.table_in_cpu if request.HasField("table_in_cpu") else None
            self.store.count_table_lookups(handle, request.table_keys, request.table_found, in_cpu)
        found = await self.store.lookup(handle, keys)
        return pb.LookupResponse(found=found)

    def _note_table_reads(self, handle: Handle, table_reads: bytes) -> None:
        """The blocks a client read from its presence table's places since its last call that
        carried them (``AcquireRequest.table_reads``): read now, before this call evicts."""
        if table_reads:
            # A hint: past the request bound it is cut, not refused (the call is the client's).
            limit = self.limits.max_keys_per_request
            reads = _keys(table_reads[: limit * KEY_BYTES], limit, "table_reads")
            self.store.note_table_reads(handle, reads)

    @_rpc
    async def Reserve(self, request, context):
        handle = self._handle(request.handle, write=True, release=request.release_leases)
        self._note_table_reads(handle, request.table_reads)
        result = await self.store.reserve(
            handle,
            self._keys(request.keys),
            request.priority,
            gpu=request.gpu,
            wait_s=remaining_s(context),
        )
        offsets = result.offsets if result.gpu else self.store.arena.addresses(result.offsets)
        return pb.ReserveResponse(
            reservation_id=result.reservation_id,
            offsets=offsets,
            expires_in_s=self.store.config.reservation_ttl_s,
            gpu=result.gpu,
            pending=result.pending,
            codec=result.codec,
            payload_bytes=handle.record.cpu_payload_bytes if result.codec else 0,
        )

    @_rpc
    async def Commit(self, request, context):
        handle = self._handle(request.handle, release=request.release_leases)
        committed = await self.store.commit_durably(
            handle,
            request.reservation_id,
            list(request.checksums),
            list(request.device_checksums),
            request.codec,
            request.payload_bytes,
            list(request.payload_checksums),
        )
        reply = pb.CommitResponse(committed=committed)
        if request.spare_wanted or request.spare_ahead:
            await self._grant_spare(reply, handle, request.spare_wanted, request.spare_ahead)
        return reply

    async def _grant_spare(
        self, reply: pb.CommitResponse | pb.BindResponse, handle: Handle, wanted: int, ahead: int
    ) -> None:
        """Hand out spare slots for the client's next put: those granted in the background
        since its last call, or, when there are none (a run of puts begins), some granted now;
        then grant the ones for the put after that in the background (and ``ahead`` more,
        from free slots: ``BlockStore.grant_spare``)."""
        store = self.store
        if not store.spare_fits(handle, wanted + ahead):
            ahead = 0
            if not store.spare_fits(handle, wanted):  # past a bound whatever it holds
                return
        addresses, fresh_s = store.take_spare(handle)
        if not addresses:
            rid = await store.grant_spare(handle, wanted, ahead)
            if rid:
                handle.spare_ready.append(rid)
                addresses, fresh_s = store.take_spare(handle)
        if addresses:
            reply.spare.extend(addresses)
            reply.spare_fresh_s = fresh_s
        store.grant_spare_soon(handle, wanted, ahead)

    @_rpc
    async def Bind(self, request, context):
        handle = self._handle(request.handle, write=True, release=request.release_leases)
        keys = self._keys(request.keys)
        self._note_table_reads(handle, request.table_reads)
        result = await self.store.bind(
            handle,
            keys,
            list(request.slots),
            list(request.checksums),
            request.priority,
            wait_s=remaining_s(context),
        )
        reply = pb.BindResponse(committed=result.committed, pending=result.pending)
        reply.spare.extend(result.unbound)
        if request.spare_wanted or request.spare_ahead:
            await self._grant_spare(reply, handle, request.spare_wanted, request.spare_ahead)
        return reply

    @_rpc
    async def Abort(self, request, context):
        self.store.abort(self._handle(request.handle), request.reservation_id)
        return pb.AbortResponse()

    @_rpc
    async def Acquire(self, request, context):
        handle = self._handle(request.handle, release=request.release_leases)
        keys = self._keys(request.keys)
        self._note_table_reads(handle, request.table_reads)
        found = await self.store.lookup(handle, keys) if request.lookup else 0
        lease_keys = keys
        if request.prefetch:
            # The lease takes what is in memory now; the run past it (on disk) is promoted in
            # the background, not waited for: a later acquire finds it in memory.
            lease_keys = keys[: self._in_memory(handle, keys)]
        result = await self.store.acquire(
            handle, lease_keys, gpu=request.gpu, wait_s=remaining_s(context)
        )
        if request.prefetch and len(result.offsets) < len(keys):
            self._prefetch(handle, keys[len(result.offsets) :], request.gpu)
        offsets = self.store.arena.addresses(result.offsets, result.on_gpu)
        return pb.AcquireResponse(
            lease_id=result.lease_id,
            offsets=offsets,
            checksums=result.checksums,
            expires_in_s=self.store.config.lease_ttl_s,
            on_gpu=result.on_gpu if any(result.on_gpu) else [],
            pending=result.pending,
            found=found,
            codecs=result.codecs or [],
            payload_checksums=result.payload_checksums or [],
            payload_bytes=handle.record.cpu_payload_bytes if result.codecs else 0,
        )

    @_rpc
    async def Release(self, request, context):
        handle = self._handle(request.handle, release=request.release_leases)
        if request.lease_id:
            self.store.release(handle, request.lease_id)
        return pb.ReleaseResponse()

    @_rpc
    async def PutBlocks(self, request_iterator, context):
        handle: Handle | None = None
        stored = received = 0
        chunk_limit = self.limits.chunk_bytes
        key = b""
        chunks: list[bytes] = []
        have = checksum = 0
        priority = -1
        block_bytes = max_chunks = 0
        async for message in request_iterator:
            _check_decoded(message, "PutBlocks")
            if handle is None:
                handle = self._handle(message.handle, write=True)
                block_bytes = handle.record.block_bytes
                # Every message must carry bytes, and a block at most this many: else a
                # stream of empty (or 1-byte) messages costs the daemon without bound.
                max_chunks = -(-block_bytes // min(MIN_CHUNK_BYTES, chunk_limit)) + 1
            if not message.data:
                raise ValueError(f"block {received}: a message without data (an empty chunk)")
            if len(chunks) >= max_chunks:
                raise ValueError(
                    f"block {received} took more than {max_chunks} messages: send it in chunks "
                    f"of at least {min(MIN_CHUNK_BYTES, chunk_limit)} bytes (at most "
                    "limits.chunk_bytes)"
                )
            if len(message.data) > chunk_limit:
                raise ValueError(
                    f"a data field of {len(message.data)} bytes, more than limits.chunk "
                    f"({chunk_limit})"
                )
            if message.key:
                if chunks:
                    raise ValueError(f"block {received}: a new key before the block was whole")
                if len(message.key) != KEY_BYTES:
                    raise ValueError(
                        f"block {received}: key is {len(message.key)} bytes, not {KEY_BYTES}"
                    )
                key, checksum, priority = message.key, message.checksum, message.priority
            elif not key:
                raise ValueError(f"block {received}: data before a key")
            chunks.append(message.data)
            have += len(message.data)
            if have > block_bytes:
                raise ValueError(
                    f"block {received} is longer than the namespace's {block_bytes} bytes"
                )
            if have == block_bytes:
                received += 1
                if await self.store.put_block(handle, key, chunks, checksum, priority):
                    stored += 1
                key, chunks, have = b"", [], 0
        if chunks:
            raise ValueError(f"block {received} ended after {have} of {block_bytes} bytes")
        return pb.PutBlocksResponse(stored=stored, received=received)

    async def GetBlocks(
        self, request: pb.GetBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.BlockData]:
        # A streaming handler cannot use the unary wrapper: it aborts on the first error.
        try:
            _caller.set(self.auth.principal(context))
            _check_decoded(request, "GetBlocks")
            handle = self._handle(request.handle)
            keys = self._keys(request.keys)
            result = await self.store.acquire(handle, keys, wait_s=remaining_s(context))
        except Exception as exc:
            await abort_with(context, "GetBlocks", exc)
            return
        lease_id = result.lease_id
        if not lease_id:
            return
        chunk = self.limits.chunk_bytes
        try:
            for i in range(len(result.offsets)):
                try:
                    # Checked and copied at once: the lease is live and the entry still
                    # holds this key; else the stream ends here (a miss, never other bytes).
                    key, data, checksum, codec = self.store.read_leased(handle, lease_id, i)
                except LeaseExpiredError:
                    return
                if codec:
                    # A payload (copied above, so a reused slot cannot reach it): decoded off
                    # the loop, which other clients' calls share. One that does not decode
                    # ends the stream: a miss.
                    loop = asyncio.get_running_loop()
                    block = await loop.run_in_executor(
                        None, self.store.decode_leased, handle.record, data
                    )
                    if block is None:
                        self.store.cpu.checksum_failures += 1
                        return
                    data = block
                view = memoryview(data)
                yield pb.BlockData(key=key, data=view[:chunk].tobytes(), checksum=checksum)
                for start in range(chunk, len(data), chunk):
                    yield pb.BlockData(data=view[start : start + chunk].tobytes())
        finally:
            try:
                self.store.release(handle, lease_id)
            except LeaseExpiredError:  # expired while the client was slow: already dropped
                pass

    async def WatchBlocks(
        self, request: pb.WatchBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.BlockEventBatch]:
        try:
            principal = self.auth.principal(context)
            _caller.set(principal)
            _check_decoded(request, "WatchBlocks")
            handle = self._handle(request.handle)
            watcher = self.store.watch_blocks(handle, caller_key(principal))
        except Exception as exc:
            await abort_with(context, "WatchBlocks", exc)
            return
        step = WATCH_BATCH_BLOCKS
        try:
            while True:
                closing = asyncio.ensure_future(self._closing.wait())
                waiting = asyncio.ensure_future(watcher.wait())
                try:
                    await asyncio.wait((closing, waiting), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    closing.cancel()
                    waiting.cancel()
                if watcher.closed or self._closing.is_set():
                    return  # the handle closed (or the daemon stops): the watch ends with it
                if not watcher.stale:
                    # Let changes gather: one message per interval, not one per commit (each
                    # costs the daemon a send and the watcher a wake-up).
                    await asyncio.sleep(WATCH_INTERVAL_S)
                    if watcher.closed:
                        return
                reset, items = self.store.watched_batch(watcher)
                # A snapshot goes out whole before any later change (those queue meanwhile),
                # its tiers read one part at a time: between parts (each ``yield`` waits for
                # the send) the loop serves everyone else, however large the namespace. A slow
                # reader holds this loop at ``yield``, and its queue overflows into a reset
                # rather than growing.
                for start in range(0, max(1, len(items)), step):
                    part = items[start : start + step]
                    if reset:
                        part = self.store.snapshot_part(watcher, part)
                    yield pb.BlockEventBatch(
                        reset=reset and start == 0,
                        snapshot_end=reset and start + step >= len(items),
                        keys=b"".join(key for key, _ in part),
                        tiers=bytes(tiers for _, tiers in part),
                        resets=watcher.resets,
                    )
                    if watcher.closed:
                        return
        finally:
            self.store.unwatch_blocks(watcher)

    @_rpc
    async def Prefetch(self, request, context):
        handle = self._handle(request.handle, release=request.release_leases)
        return pb.PrefetchResponse(
            queued=self._prefetch(handle, self._keys(request.keys), request.gpu)
        )

    def _in_memory(self, handle: Handle, keys: list[bytes]) -> int:
        """How many leading keys are stored in memory (the CPU tier or the GPU pool)."""
        tiers = self.store.index.tier
        run = self.store.leading_run(handle.ns_id, keys)
        return next((i for i, e in enumerate(run) if not tiers[e] & (IN_CPU | IN_GPU)), len(run))

    def _prefetch(self, handle: Handle, keys: list[bytes], gpu: bool) -> int:
        # Through the store: it bounds and rate-limits prefetch, and sends it into the GPU
        # pool only for callers that map the pool.
        return self.store.prefetch(handle, keys, gpu=gpu)

    @_rpc
    async def Delete(self, request, context):
        handle = self._handle(request.handle, write=True, release=request.release_leases)
        if request.all_blocks:
            if request.keys:
                raise ValueError("a Delete of all_blocks names no keys")
            deleted, more = self.store.delete_all(handle)
            return pb.DeleteResponse(deleted=deleted, more=more)
        return pb.DeleteResponse(deleted=self.store.delete(handle, self._keys(request.keys)))

    @_rpc
    async def Stats(self, request, context):
        reply = pb.StatsResponse(
            version=__version__,
            uptime_s=time.monotonic() - self.started_at,
            active_leases=self.store.active_leases,
            active_reservations=self.store.active_reservations,
            open_handles=self.store.open_handles,
        )
        for tier in self.store.tier_snapshots():
            c = tier.counters
            reply.tiers.add(
                name=tier.name,
                capacity_bytes=tier.capacity_bytes,
                used_bytes=tier.used_bytes,
                blocks=tier.blocks,
                # Lookup counts include what clients tallied: bounded per call, but a
                # client's word, so one past uint64 saturates rather than fail every Stats.
                hits=_u64(c.hits),
                misses=_u64(c.misses),
                evictions=c.evictions,
                promotions=c.promotions,
                demotions=c.demotions,
                checksum_failures=c.checksum_failures,
                up=tier.up,
                extra=tier.extra,
                logical_bytes=tier.logical_bytes,
                stored_bytes=tier.stored_bytes,
            )
        # The most used namespaces first, at most max_stats_namespaces of them (names are
        # bounded too), so the reply stays small whatever clients open.
        # A caller sees only its own tenants' namespaces, unless it is an operator.
        caller = _caller.get(OWNER)
        records = sorted(
            (
                r
                for r in self.store.namespaces()
                if caller.operator or (r.namespace is not None and _owns(caller, r.namespace))
            ),
            key=lambda r: -r.blocks * r.block_bytes,
        )
        limit = self.limits.max_stats_namespaces
        below = self.store.namespace_tier_bytes()
        for ns in records[:limit]:
            entry = reply.namespaces.add(
                name=ns.name,
                blocks=ns.blocks,
                used_bytes=ns.blocks * ns.block_bytes,
                hits=_u64(ns.lookup_hits),
                misses=_u64(ns.lookup_misses),
                block_bytes=ns.block_bytes,
            )
            for name, blocks, logical, stored, codec in below.get(ns.fingerprint, ()):
                entry.tiers.add(
                    tier=name,
                    blocks=blocks,
                    logical_bytes=logical,
                    stored_bytes=stored,
                    codec=codec,
                )
        reply.namespaces_omitted = max(0, len(records) - limit)
        quotas = self.store.quotas
        for books in quotas.tenants():
            if caller.operator or caller.own is None or books.name in caller.own:
                q = books.quota
                reply.tenants.add(
                    name=books.name,
                    cpu_bytes=books.cpu_bytes,
                    nvme_bytes=books.nvme_bytes,
                    pinned_bytes=books.pinned_bytes,
                    leases=books.leases,
                    reservations=books.reservations,
                    quota_cpu_bytes=q.cpu_bytes,
                    quota_nvme_bytes=q.nvme_bytes,
                    guaranteed_cpu_bytes=books.guaranteed_cpu_bytes,
                    guaranteed_nvme_bytes=books.guaranteed_nvme_bytes,
                    max_pinned_bytes=quotas.pinned_cap(books),
                    keys_per_s=q.keys_per_s,
                    refused_keys=books.refused_keys,
                )
        if not caller.operator:
            _hide_global_counters(reply)
        return reply


def _owns(caller: Principal, namespace: Namespace) -> bool:
    return caller.own is None or namespace.tenant in caller.own


def _hide_global_counters(reply: pb.StatsResponse) -> None:
    """What a caller without operator rights may not see: the tiers' counters (blocks, hits,
    evictions: every tenant's activity together) and the daemon's leases, reservations and
    handles. The tiers' names, capacities and health stay; its own namespaces and tenants'
    books (above) carry its own occupancy and hits."""
    tiers = [(t.name, t.capacity_bytes, t.up) for t in reply.tiers]
    del reply.tiers[:]
    for name, capacity, up in tiers:
        reply.tiers.add(name=name, capacity_bytes=capacity, up=up)
    reply.active_leases = reply.active_reservations = reply.open_handles = 0


class _Everyone:
    """The authenticator of a servicer built without one (tests of the service alone)."""

    def principal(self, context: Any) -> Principal:
        return OWNER


def add_to_server(servicer: KVStoreServicer, server: grpc.aio.Server) -> None:
    """Register the service like the generated ``add_KVStoreServicer_to_server``, but with
    request decoders that turn undecodable bytes into a refusal (INVALID_ARGUMENT) instead of
    gRPC's INTERNAL and a logged traceback."""
    service = pb.DESCRIPTOR.services_by_name["KVStore"]
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for method in service.methods:
        request_type = getattr(pb, method.input_type.name)
        reply_type = getattr(pb, method.output_type.name)
        make = kinds[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=_decoder(method.name, request_type),
            response_serializer=reply_type.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
