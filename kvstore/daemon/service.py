"""The gRPC face of the block store: decodes requests, calls ``BlockStore``, encodes replies.

Every error becomes a gRPC status with a message that names the problem; the store's state is
never left half-changed by a bad request (validation happens before any change). The servicer
runs on the daemon's one event loop, like the store it wraps.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvstore import __version__
from kvstore.daemon.store import BlockStore
from kvstore.errors import (
    CapacityError,
    InvalidRequestError,
    KVStoreError,
    LeaseExpiredError,
    NamespaceMismatchError,
    UnknownNamespaceError,
)
from kvstore.keys import HASH_VERSION, KEY_BYTES, Namespace, unpack_keys
from kvstore.layout import KVLayout, dtype_from_name
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_STATUS: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (NamespaceMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (LeaseExpiredError, grpc.StatusCode.FAILED_PRECONDITION),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnknownNamespaceError, grpc.StatusCode.NOT_FOUND),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (OverflowError, grpc.StatusCode.RESOURCE_EXHAUSTED),
]

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


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


def _rpc(method: F) -> F:
    """Turn exceptions into gRPC statuses; an unexpected one is logged and reported INTERNAL."""

    @functools.wraps(method)
    async def wrapper(
        self: KVStoreServicer, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, method.__name__, exc)

    return wrapper  # type: ignore[return-value]


def _keys(packed: bytes, what: str = "keys") -> list[bytes]:
    if len(packed) % KEY_BYTES:
        raise ValueError(f"{what} field is {len(packed)} bytes, not a multiple of {KEY_BYTES}")
    return unpack_keys(packed)  # type: ignore[return-value]


def namespace_from_request(request: pb.OpenNamespaceRequest) -> Namespace:
    if not request.HasField("layout"):
        raise ValueError("OpenNamespace needs a layout")
    lay = request.layout
    layout = KVLayout(
        num_layers=lay.num_layers,
        num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim,
        block_size=lay.block_size,
        dtype=dtype_from_name(lay.dtype),
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


class KVStoreServicer(pb_grpc.KVStoreServicer):
    """Implements ``kvstore.v1.KVStore`` over one ``BlockStore``."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.started_at = time.monotonic()

    @_rpc
    async def OpenNamespace(self, request, context):
        record = self.store.open_namespace(namespace_from_request(request), request.priority)
        arena = self.store.arena
        reply = pb.OpenNamespaceResponse(
            namespace_id=record.ns_id,
            seed=record.namespace.seed if record.namespace else b"",
            block_bytes=record.block_bytes,
            fingerprint=record.fingerprint,
            epoch=self.store.epoch,
            arena=pb.ArenaInfo(path=arena.path, size_bytes=arena.size_bytes, token=arena.token),
        )
        pool = self.store.device.pool
        if pool is not None and pool.ipc_handle:
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
        found = await self.store.lookup(request.namespace_id, _keys(request.keys))
        return pb.LookupResponse(found=found)

    @_rpc
    async def Reserve(self, request, context):
        self.store.check_epoch(request.epoch)
        reservation_id, offsets, gpu = await self.store.reserve(
            request.namespace_id, _keys(request.keys), request.priority, gpu=request.gpu
        )
        return pb.ReserveResponse(
            reservation_id=reservation_id,
            offsets=offsets,
            expires_in_s=self.store.config.reservation_ttl_s,
            gpu=gpu,
        )

    @_rpc
    async def Commit(self, request, context):
        committed = self.store.commit(
            request.reservation_id, list(request.checksums), list(request.device_checksums)
        )
        return pb.CommitResponse(committed=committed)

    @_rpc
    async def Abort(self, request, context):
        self.store.abort(request.reservation_id)
        return pb.AbortResponse()

    @_rpc
    async def Acquire(self, request, context):
        self.store.check_epoch(request.epoch)
        lease_id, offsets, checksums, on_gpu = await self.store.acquire(
            request.namespace_id, _keys(request.keys), gpu=request.gpu
        )
        return pb.AcquireResponse(
            lease_id=lease_id,
            offsets=offsets,
            checksums=checksums,
            expires_in_s=self.store.config.lease_ttl_s,
            on_gpu=on_gpu if any(on_gpu) else [],
        )

    @_rpc
    async def Release(self, request, context):
        self.store.release(request.lease_id)
        return pb.ReleaseResponse()

    @_rpc
    async def PutBlocks(self, request_iterator, context):
        ns_id = 0
        stored = received = 0
        async for message in request_iterator:
            if received == 0:
                ns_id = message.namespace_id
            if len(message.key) != KEY_BYTES:
                raise ValueError(f"block {received}: key is {len(message.key)} bytes, not 32")
            received += 1
            if await self.store.put_block(ns_id, message.key, message.data, message.priority):
                stored += 1
        return pb.PutBlocksResponse(stored=stored, received=received)

    async def GetBlocks(
        self, request: pb.GetBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.BlockData]:
        # A streaming handler cannot use the unary wrapper: it aborts on the first error.
        try:
            keys = _keys(request.keys)
            lease_id, _, _, _ = await self.store.acquire(request.namespace_id, keys)
        except Exception as exc:
            await abort_with(context, "GetBlocks", exc)
        if not lease_id:
            return
        try:
            for key, eid in zip(keys, self.store.leased_entries(lease_id), strict=False):
                data, checksum = self.store.read_block(eid)
                yield pb.BlockData(key=key, data=data, checksum=checksum)
        finally:
            try:
                self.store.release(lease_id)
            except Exception:  # the lease expired while the client was slow: already dropped
                pass

    @_rpc
    async def Prefetch(self, request, context):
        keys = _keys(request.keys)
        self.store.namespace(request.namespace_id)
        if request.gpu and self.store.device.enabled:
            queued = self.store.device.prefetch(request.namespace_id, keys)
        else:
            queued = self.store.mover.prefetch(request.namespace_id, keys)
        return pb.PrefetchResponse(queued=queued)

    @_rpc
    async def Delete(self, request, context):
        deleted = self.store.delete(request.namespace_id, _keys(request.keys))
        return pb.DeleteResponse(deleted=deleted)

    @_rpc
    async def Stats(self, request, context):
        reply = pb.StatsResponse(
            version=__version__,
            uptime_s=time.monotonic() - self.started_at,
            active_leases=self.store.active_leases,
            active_reservations=self.store.active_reservations,
        )
        for tier in self.store.tier_snapshots():
            c = tier.counters
            reply.tiers.add(
                name=tier.name,
                capacity_bytes=tier.capacity_bytes,
                used_bytes=tier.used_bytes,
                blocks=tier.blocks,
                hits=c.hits,
                misses=c.misses,
                evictions=c.evictions,
                promotions=c.promotions,
                demotions=c.demotions,
                checksum_failures=c.checksum_failures,
                up=tier.up,
                extra=tier.extra,
            )
        for ns in self.store.namespaces():
            reply.namespaces.add(
                namespace_id=ns.ns_id,
                name=ns.name,
                blocks=ns.blocks,
                used_bytes=ns.blocks * ns.block_bytes,
                hits=ns.lookup_hits,
                misses=ns.lookup_misses,
                block_bytes=ns.block_bytes,
            )
        return reply
