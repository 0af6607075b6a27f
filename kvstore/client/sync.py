"""``KVStoreClient``: the blocking client library serving engines use.

Same-host clients map the daemon's shared-memory arena and copy blocks straight into and out of
its slots: one copy per block (checksummed as it is copied) and, per batch, two calls for a put
(reserve + commit) and one for a get (acquire; its release rides on the next call). Their
control calls go over the session socket when the daemon offers it (``kvstore.local_calls``),
else over gRPC. A
client that cannot map the arena (another host, another user) or is built with
``transport="grpc"`` sends the bytes over streaming RPCs instead; both paths return the same data.

A client holds one namespace (model + layout + tenant) and is not thread-safe: give each thread
its own client (they are cheap; the daemon is shared).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np
import torch

from kvstore.address import default_address
from kvstore.client import paged_io
from kvstore.client._common import (
    Credentials,
    LocalStub,
    MappedArena,
    PendingReleases,
    PoolLink,
    PutCount,
    StreamAssembler,
    byte_rows,
    call_metadata,
    check_keys,
    check_open_reply,
    check_out,
    check_priority,
    check_put,
    check_transport,
    commit_request,
    empty_blocks,
    make_channel,
    open_request,
    open_session,
    put_messages,
    seeds_for,
    translate_error,
)
from kvstore.client.leases import ReadLease, WriteReservation
from kvstore.client.session import ClientSession
from kvstore.errors import (
    KVStoreError,
    UnauthenticatedError,
    UnavailableError,
    UnknownNamespaceError,
)
from kvstore.keys import BlockKey, Namespace, block_hashes, unpack_keys
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

R = TypeVar("R")


class KVStoreClient:
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
        check_transport(transport)
        self.layout = layout
        self.namespace = Namespace(
            model=model,
            layout=layout,
            revision=revision,
            tenant=tenant,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.address = address or default_address()
        self.transport = transport
        self.timeout_s = timeout_s
        self.verify_checksums = verify_checksums
        self._priority = check_priority(priority)
        self._credentials = Credentials.resolve(token, tls_ca, tls_cert, tls_key)
        self._session: ClientSession | None = None
        self._channel = make_channel(
            self.address,
            self._credentials,
            lambda: call_metadata(self._credentials, self._session),
        )
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._rpc = LocalStub(self._stub, lambda: self._session)
        self._releases = PendingReleases()
        self._arena: MappedArena | None = None
        self._pool_link = PoolLink()
        self._handle = b""
        self._stream: Any = None  # the OpenNamespace call whose life is the handle's
        self._chunk_bytes = 1 << 20
        try:
            self._open()
        except BaseException:
            self._channel.close()
            raise

    # ------------------------------------------------------------------ plumbing
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
        check_open_reply(self.namespace, reply)
        self._handle = reply.handle
        self._chunk_bytes = reply.max_chunk_bytes or self._chunk_bytes
        self._pool_link.reset(reply if self.transport != "grpc" else None)
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        if self.transport != "grpc":
            if self._session is not None:
                self._arena = MappedArena(self._session)
            elif self.transport == "shm":
                raise KVStoreError(
                    "cannot map the daemon's arena: shared memory needs the unix socket"
                )

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

    @property
    def uses_shared_memory(self) -> bool:
        return self._arena is not None

    def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()  # the daemon closes the handle and reclaims what it holds

    def close(self) -> None:
        self._close_stream()
        self._pool_link.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._close_session()
        self._channel.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ API
    def hash_tokens(
        self,
        token_ids: Sequence[int] | np.ndarray | torch.Tensor,
        extra_keys: Sequence[bytes] | None = None,
    ) -> list[BlockKey]:
        """One 32-byte key per full block of ``token_ids`` in this client's namespace."""
        return block_hashes(self.namespace.seed, token_ids, self.layout.block_size, extra_keys)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored, in any tier."""
        packed = check_keys(keys)
        if not keys:
            return 0
        reply = self._call(
            self._rpc.Lookup,
            lambda: pb.LookupRequest(
                handle=self._handle, keys=packed, release_leases=self._releases.take(self._handle)
            ),
        )
        return int(reply.found)

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Hint that ``keys`` will be read soon. Returns as soon as the daemon has queued the
        promotion (one small RPC; no data moves in it): the blocks come up in the background,
        into the GPU pool once this client has mapped it (a later ``load`` then copies device
        to device), else into the CPU tier."""
        packed = check_keys(keys)
        if keys:
            # Through _call, so a daemon that restarted is rejoined and still gets the hint.
            self._call(
                self._rpc.Prefetch,
                lambda: pb.PrefetchRequest(
                    handle=self._handle,
                    keys=packed,
                    gpu=self._pool_link.pool is not None,
                    release_leases=self._releases.take(self._handle),
                ),
            )

    def put(self, keys: Sequence[bytes], blocks: torch.Tensor, priority: int | None = None) -> int:
        """Store ``blocks[i]`` under ``keys[i]``; returns how many were newly stored (present keys
        are deduplicated). ``blocks`` is ``[n, *layout.block_shape]`` of the layout's dtype.

        Keys another client is writing at that moment are waited for (bounded by the daemon's
        ``write_wait_s`` and ``timeout_s``), so a ``get`` after ``put`` returns finds them; the
        count returned is a ``PutCount`` whose ``pending`` says how many were still being
        written by another client when that wait ended (0 normally)."""
        packed = check_keys(keys)
        rows = check_put(self.layout, keys, blocks)
        prio = check_priority(priority)
        if not keys:
            return 0
        if self._arena is None:
            return self._put_bytes(keys, rows, prio)
        with self.reserve(keys, priority, _packed=packed) as reservation:
            if not reservation.offsets_new:
                return PutCount(0, reservation.pending)
            reservation.fill_from(rows)
        return PutCount(reservation.committed, reservation.pending)

    def get(self, keys: Sequence[bytes], out: torch.Tensor | None = None) -> torch.Tensor:
        """The leading run of stored blocks, ``[m, *block_shape]`` with ``m <= len(keys)``.

        With ``out`` (``[>= len(keys), *block_shape]``, contiguous, CPU) the blocks are written
        into it and ``out[:m]`` is returned; no memory is allocated.
        """
        packed = check_keys(keys)
        check_out(self.layout, len(keys), out)
        if not keys:
            return out[:0] if out is not None else empty_blocks(self.layout, 0)
        if self._arena is None:
            return self._get_bytes(packed, out)
        lease = self.acquire(keys, _packed=packed)
        try:
            if out is None:
                out = empty_blocks(self.layout, len(lease.offsets))
            m = lease.copy_into(byte_rows(self.layout, out), self.verify_checksums)
        finally:
            lease.release()
        return out[:m]

    def delete(self, keys: Sequence[bytes]) -> int:
        packed = check_keys(keys)
        if not keys:
            return 0
        reply = self._call(
            self._rpc.Delete,
            lambda: pb.DeleteRequest(
                handle=self._handle, keys=packed, release_leases=self._releases.take(self._handle)
            ),
        )
        return int(reply.deleted)

    def stats(self) -> pb.StatsResponse:
        return self._call(self._stub.Stats, pb.StatsRequest)

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
        ids = paged_io.check_paged(self.layout, kv_caches, block_ids, keys)
        check_keys(keys)
        gpu = self._pool_link.device_for(kv_caches)
        stored = 0
        stage: torch.Tensor | None = None
        for ck, cids in paged_io.chunked(keys, ids, self._chunk_blocks):
            if self._arena is None:
                if stage is None:  # one chunk-sized buffer for the whole transfer
                    stage = paged_io.staging(self.layout, len(ids), kv_caches)
                blocks = stage[: len(cids)]
                paged_io.gather_into_views(kv_caches, cids, blocks)  # waits for the kernel
                stored += self.put(ck, blocks, priority)
                continue
            with self.reserve(ck, priority, _device=gpu) as reservation:
                ids_new = [cids[i] for i in reservation.indices]
                sums = None
                if not reservation.on_gpu:
                    paged_io.ensure_pinned(reservation.arena, kv_caches)
                    sums = paged_io.gather_with_checksums(
                        kv_caches, ids_new, reservation.views, reservation.seeds_new
                    )
                if sums is None:
                    paged_io.gather_into_views(kv_caches, ids_new, reservation.views)
                else:
                    reservation.use_checksums(sums)
            stored += reservation.committed
        return stored

    def load(
        self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], keys: Sequence[bytes]
    ) -> int:
        """Fill physical blocks ``block_ids`` from the store; returns n, the number of leading
        blocks loaded (the rest were not cached, or failed their checksum)."""
        ids = paged_io.check_paged(self.layout, kv_caches, block_ids, keys)
        check_keys(keys)
        gpu = self._pool_link.device_for(kv_caches)
        loaded = 0
        stage: torch.Tensor | None = None
        for ck, cids in paged_io.chunked(keys, ids, self._chunk_blocks):
            if self._arena is None:
                if stage is None:  # one chunk-sized buffer for the whole transfer
                    stage = paged_io.staging(self.layout, len(ids), kv_caches)
                got = self.get(ck, out=stage)
                paged_io.scatter_from_views(got, kv_caches, cids[: got.shape[0]])
                n = got.shape[0]
            else:
                with self.acquire(ck, _device=gpu) as lease:
                    # CPU caches: each block verified from its copy as it is made (one pass).
                    intact = paged_io.scatter_with_checksums(
                        lease.views, kv_caches, cids[: len(lease)], lease.checksums, lease.seeds
                    )
                    if intact is None:
                        if lease.any_on_host:
                            paged_io.ensure_pinned(lease.arena, kv_caches)
                        paged_io.scatter_from_views(lease.views, kv_caches, cids[: len(lease)])
                        # Checked after the copy: a slot that changed under us fails here, and
                        # the caller recomputes from that block on.
                        intact = lease.intact()
                    n = intact
            loaded += n
            if n < len(ck):
                break
        return loaded

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
        packed = check_keys(keys) if _packed is None else _packed
        prio = check_priority(priority)
        self._require_arena("reserve")
        reply = self._call(
            self._rpc.Reserve,
            lambda: pb.ReserveRequest(
                handle=self._handle,
                keys=packed,
                priority=prio,
                gpu=_device is not None,
                release_leases=self._releases.take(self._handle),
            ),
        )
        handle = self._handle  # the reservation is this handle's (after any reopen)
        # Fetched after the call: a daemon restart makes the call reopen and remap the arena.
        arena = self._require_arena("reserve")
        pool = self._pool_link.for_device(_device) if reply.gpu else None

        def commit(checksums: list[int]) -> int:
            return int(
                self._call(
                    self._rpc.Commit,
                    lambda: commit_request(
                        reply, checksums, handle, self._releases.take(self._handle)
                    ),
                ).committed
            )

        def abort() -> None:
            req = pb.AbortRequest(reservation_id=reply.reservation_id, handle=handle)
            self._call(self._rpc.Abort, lambda: req)

        if reply.gpu and pool is None:
            abort()
            raise KVStoreError("the daemon reserved GPU pool slots this client cannot reach")
        reservation = WriteReservation(
            arena,
            self.layout,
            reply.reservation_id,
            list(reply.offsets),
            seeds_for(self.namespace, unpack_keys(packed)),
            commit,
            abort,
            pool,
        )
        reservation.pending = reply.pending
        return reservation

    def acquire(
        self,
        keys: Sequence[bytes],
        *,
        _packed: bytes | None = None,
        _device: torch.device | None = None,
    ) -> ReadLease:
        """Lease the leading run of stored blocks: ``lease.views[i]`` reads block i in place
        (verify with ``lease.verify(i)`` after copying); ``release()`` when done."""
        packed = check_keys(keys) if _packed is None else _packed
        self._require_arena("acquire")
        reply = self._call(
            self._rpc.Acquire,
            lambda: pb.AcquireRequest(
                handle=self._handle,
                keys=packed,
                gpu=_device is not None,
                release_leases=self._releases.take(self._handle),
            ),
        )
        handle = self._handle
        arena = self._require_arena("acquire")
        pool = self._pool_link.for_device(_device) if any(reply.on_gpu) else None

        def release() -> None:
            # Not a call of its own: the next call carries it (PendingReleases).
            if reply.lease_id and self._releases.add(handle, reply.lease_id):
                self._release_now()

        return ReadLease(
            arena,
            self.layout,
            list(reply.offsets),
            list(reply.checksums),
            seeds_for(self.namespace, unpack_keys(packed)[: len(reply.offsets)]),
            release,
            list(reply.on_gpu),
            pool,
        )

    def _release_now(self) -> None:
        """Send the pending releases in a Release of their own (an expired lease is no error:
        the daemon dropped it already)."""
        ids = self._releases.take(self._handle)
        if ids:
            request = pb.ReleaseRequest(handle=self._handle, release_leases=ids)
            try:
                self._rpc.Release(request, timeout=self.timeout_s)
            except (grpc.RpcError, UnavailableError):
                pass  # the handle is gone (and its leases with it) or will be reopened

    @property
    def _chunk_blocks(self) -> int:
        """Blocks per call of an offload or load: the bytes path stages a chunk at a time, the
        shared-memory path stages nothing."""
        return paged_io.CHUNK_BLOCKS if self._arena is None else paged_io.ARENA_CHUNK_BLOCKS

    def _require_arena(self, what: str) -> MappedArena:
        if self._arena is None:
            raise KVStoreError(
                f"{what} needs the shared-memory arena; this client uses the bytes path"
            )
        return self._arena

    # ------------------------------------------------------------------ bytes path
    def _put_bytes(self, keys: Sequence[bytes], rows: torch.Tensor, priority: int) -> int:
        rows_np = rows.numpy()
        seeds = seeds_for(self.namespace, keys)
        reply = self._call(
            self._stub.PutBlocks,
            lambda: put_messages(self._handle, keys, seeds, rows_np, priority, self._chunk_bytes),
        )
        return int(reply.stored)

    def _get_bytes(self, packed: bytes, out: torch.Tensor | None) -> torch.Tensor:
        keys = unpack_keys(packed)

        def fetch(request: pb.GetBlocksRequest, timeout: float) -> StreamAssembler:
            got = StreamAssembler(self.layout, keys, seeds_for(self.namespace, keys), out)
            call = self._stub.GetBlocks(request, timeout=timeout)
            for message in call:
                if not got.add(message):
                    call.cancel()  # the run ended: the daemon releases the lease
                    break
            return got

        got = self._call(fetch, lambda: pb.GetBlocksRequest(handle=self._handle, keys=packed))
        return got.result()


class _Timeout(grpc.RpcError):
    """A deadline this client enforces itself (the OpenNamespace stream has none)."""

    def __init__(self, details: str) -> None:
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._details
