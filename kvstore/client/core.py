"""The client's logic, written once for the blocking and the asyncio face (sans-I/O).

``ClientCore`` holds a client's state (namespace, handle, session, mapped arena and GPU pool,
pending releases) and every operation as a generator: it validates the arguments, builds the
requests, reads the replies, copies through the arena and the kernels, and *yields* each step
that the face must perform, receiving its result back: the steps are ``kvstore.client.steps``.

``KVStoreClient`` (``sync.py``) performs the steps with blocking calls, ``AsyncKVStoreClient``
(``aio.py``) awaits them; each public method of a face is one line that runs the core's
generator, so the two cannot drift apart. An error a step raises is thrown into the generator
at that step, so its ``try``/``finally`` (abort a reservation, drop a pool mapping) run the
same way on both faces.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch

from kvstore.client import paged_io, payloads, place_reads
from kvstore.client._common import (
    Credentials,
    MappedArena,
    PendingReleases,
    PoolLink,
    PutCount,
    StreamAssembler,
    byte_rows,
    check_distinct,
    check_keys,
    check_open_reply,
    check_out,
    check_priority,
    check_put,
    check_transport,
    commit_request,
    empty_blocks,
    put_messages,
    seeds_for,
)
from kvstore.client.leases import _LeaseState, _ReservationState
from kvstore.client.posted_puts import PostedPut, PostedPuts, SettlesPuts
from kvstore.client.presence_link import PresenceLink
from kvstore.client.session import ClientSession
from kvstore.client.spare_slots import SpareSlots, stale
from kvstore.client.steps import Blocking, Call, Fetch, Op, Post
from kvstore.errors import KVStoreError, LeaseExpiredError, UnknownNamespaceError
from kvstore.keys import KEY_BYTES, BlockKey, Namespace, block_hashes, unpack_keys
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb

R = TypeVar("R")


class ClientCore(SettlesPuts):
    """What one client of one namespace knows and does; see the module docstring. Not
    thread-safe (one client per thread or task that issues calls concurrently)."""

    def __init__(
        self,
        address: str,
        *,
        layout: KVLayout,
        model: str,
        revision: str,
        tenant: str,
        tp_rank: int,
        tp_size: int,
        priority: int,
        transport: str,
        timeout_s: float,
        verify_checksums: bool,
        token: str | None,
        tls_ca: str | None,
        tls_cert: str | None,
        tls_key: str | None,
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
        self.address = address
        self.transport = transport
        self.timeout_s = timeout_s
        self.verify_checksums = verify_checksums
        self._priority = check_priority(priority)
        self._credentials = Credentials.resolve(token, tls_ca, tls_cert, tls_key)
        self._session: ClientSession | None = None
        self._arena: MappedArena | None = None
        self._pool_link = PoolLink()
        self._presence = PresenceLink()
        self._spare = SpareSlots()
        self._posted = PostedPuts()
        self._handle = b""
        self._stream: Any = None  # the OpenNamespace call whose life is the handle's
        self._chunk_bytes = 1 << 20
        self._releases = PendingReleases()

    # ------------------------------------------------------------------ state
    def _opened(self, reply: pb.OpenNamespaceResponse) -> None:
        """Take a new handle (first open, or a reopen after the daemon restarted)."""
        check_open_reply(self.namespace, reply)
        self._handle = reply.handle
        self._chunk_bytes = reply.max_chunk_bytes or self._chunk_bytes
        self._pool_link.reset(reply if self.transport != "grpc" else None)
        self._presence.reset()
        self._spare.clear()  # another handle's (another daemon's) slots
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

    def _take_releases(self) -> list[int]:
        return self._releases.take(self._handle)

    @property
    def uses_shared_memory(self) -> bool:
        return self._arena is not None

    def _require_arena(self, what: str) -> MappedArena:
        if self._arena is None:
            raise KVStoreError(
                f"{what} needs the shared-memory arena; this client uses the bytes path"
            )
        return self._arena

    @property
    def _chunk_blocks(self) -> int:
        """Blocks per call of an offload or load: the bytes path stages a chunk at a time, the
        shared-memory path stages nothing."""
        return paged_io.CHUNK_BLOCKS if self._arena is None else paged_io.ARENA_CHUNK_BLOCKS

    def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()  # the daemon closes the handle and reclaims what it holds

    def _tally_call(self) -> tuple[ClientSession, int, bytes, float] | None:
        """The presence table's tally for the faces to send at close (``tally_call``)."""
        return self._presence.tally_call(self._session, self._handle, self.timeout_s)

    def _close_local(self) -> None:
        """Close what is not the channel: the handle's stream, the pool, the arena, the
        session (the handle's leases, pending releases included, go with it)."""
        self._close_stream()
        self._pool_link.close()
        self._presence.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._close_session()

    def hash_tokens(
        self,
        token_ids: Sequence[int] | np.ndarray | torch.Tensor,
        extra_keys: Sequence[bytes] | None = None,
    ) -> list[BlockKey]:
        """One 32-byte key per full block of ``token_ids`` in this client's namespace."""
        return block_hashes(self.namespace.seed, token_ids, self.layout.block_size, extra_keys)

    # ------------------------------------------------------------------ operations
    def _lookup(self, keys: Sequence[bytes]) -> Op[int]:
        packed = check_keys(keys)
        if not keys:
            return 0
        check_distinct(keys, "lookup")  # as the daemon, also when the table answers
        if self._posted.touches(packed):  # read your own writes
            yield from self._settle()
        session = self._session
        if session is not None:
            # Releases waiting meanwhile ride on the next call, as after any get: at the
            # latest the lookup the table sends to the daemon after ``FLUSH_S``.
            found = self._presence.lookup(session, self._handle, packed, len(keys))
            if found is not None:  # answered from the namespace's presence table: no call
                return found

        # Taken once: a retry after a reopen carries the same tally.
        tally = self._presence.take_tally()

        def build() -> pb.LookupRequest:
            return pb.LookupRequest(
                handle=self._handle,
                keys=packed,
                release_leases=self._take_releases(),
                table_keys=tally.keys,
                table_found=tally.found,
                table_in_cpu=tally.in_cpu,
            )

        reply = yield Call("Lookup", build)
        return int(reply.found)

    def _prefetch(self, keys: Sequence[bytes]) -> Op[None]:
        packed = check_keys(keys)
        if keys:
            # A call like any other: a daemon that restarted is rejoined and still gets it.
            yield Call(
                "Prefetch",
                lambda: pb.PrefetchRequest(
                    handle=self._handle,
                    keys=packed,
                    gpu=self._pool_link.pool is not None,
                    release_leases=self._take_releases(),
                ),
            )

    def _delete(self, keys: Sequence[bytes]) -> Op[int]:
        packed = check_keys(keys)
        if not keys:
            return 0
        reply = yield Call(
            "Delete",
            lambda: pb.DeleteRequest(
                handle=self._handle, keys=packed, release_leases=self._take_releases()
            ),
        )
        return int(reply.deleted)

    def _clear(self) -> Op[int]:
        deleted, more = 0, True
        while more:  # the daemon deletes a bounded number per call
            reply = yield Call("Delete", self._clear_request)
            deleted, more = deleted + int(reply.deleted), reply.more
        return deleted

    def _clear_request(self) -> pb.DeleteRequest:
        return pb.DeleteRequest(
            handle=self._handle, all_blocks=True, release_leases=self._take_releases()
        )

    def _stats(self) -> Op[pb.StatsResponse]:
        return (yield Call("Stats", pb.StatsRequest))

    def _put(
        self, keys: Sequence[bytes], blocks: torch.Tensor, priority: int | None, wait: bool = True
    ) -> Op[int]:
        packed = check_keys(keys)
        rows = check_put(self.layout, keys, blocks)
        prio = check_priority(priority)
        if not keys or self._arena is None:
            yield from self._settle()  # the put before, if it did not wait
            if not keys:
                return 0
            stored = yield from self._put_bytes(keys, rows, prio)
            if wait:
                return stored
            self._posted.stored += stored  # made at once: flush says it
            return PutCount(0)
        # Spare slots first (one call), for the next put too while puts keep coming. Slots
        # held already are written before the reply to the put in flight is read: this copy
        # overlaps the daemon's work on that put.
        taken = self._spare.take(len(keys), self._handle)
        if taken is None:
            yield from self._settle()  # the put before, if it did not wait: for its slots
            taken = self._spare.take(len(keys), self._handle)
        if taken is not None:
            count = yield from self._bind(self._handle, keys, packed, rows, prio, taken, wait)
            if count is not None:
                return count
        yield from self._settle()
        wanted = self._spare.wanted(len(keys), self._handle, ahead=not wait)
        for attempt in range(2):
            reservation = yield from self._reserve(keys, priority, packed, None)
            reservation.posted = not wait
            reserved_on = self._handle
            if not reservation.offsets_new:
                return self._put_count(0, reservation.pending, wait)
            try:
                nbytes = len(reservation.offsets_new) * self.layout.block_bytes
                yield Blocking(partial(reservation.fill_from, rows), nbytes)
            except BaseException as exc:
                yield from reservation._abort_op()
                restarted = not attempt and self._restarted_since(reserved_on)
                if isinstance(exc, KVStoreError) and restarted:
                    continue  # the slab could not be mapped: the daemon restarted
                raise
            reservation.spare_wanted = wanted
            try:
                committed = yield from reservation._commit_op(None)
            except UnknownNamespaceError:
                if attempt or not self._restarted_since(reserved_on):
                    raise
                continue
            return self._put_count(committed, reservation.pending, wait)
        raise AssertionError("unreachable")

    def _put_count(self, stored: int, pending: int, wait: bool) -> PutCount:
        """A put's count; a put that did not wait keeps ``pending`` (the keys its Reserve
        waited for) for ``flush``, as a posted Bind's reply's, and says 0."""
        if wait:
            return PutCount(stored, pending)
        self._posted.pending += pending
        return PutCount(0)

    def _restarted_since(self, handle: bytes) -> bool:
        """Whether the client reopened its namespace since it held ``handle``: the daemon
        forgot that handle (a restart), and every reservation made on it went with it. A put
        or offload, which still holds its blocks, then writes them again on the new handle
        rather than fail a call the caller made once, as every single call is retried."""
        return self._handle != handle

    def _bind(
        self,
        handle: bytes,
        keys: Sequence[bytes],
        packed: bytes,
        rows: torch.Tensor,
        priority: int,
        taken: list[tuple[int, float, bytes]],
        wait: bool,
    ) -> Op[PutCount | None]:
        """A put in one call: copy the blocks into spare slots ``taken`` (granted to
        ``handle``), read the reply to the put in flight, then ``Bind`` them, naming that
        handle. None when the daemon no longer holds them as that handle's spare slots, or
        the handle is gone (nothing was stored: the caller puts through a reservation, on the
        handle it has then)."""
        arena = self._require_arena("put")
        addresses = [address for address, _, _ in taken]
        seeds = seeds_for(self.namespace, keys)
        nbytes = len(keys) * self.layout.block_bytes
        sums = yield Blocking(lambda: arena.copy_in(rows, addresses, seeds), nbytes)
        clears = self._spare.clears
        yield from self._settle()
        # Checked again after the put before was read (its Bind may have waited for another
        # writer): a slot past its window, reclaimed slots, or a restart, and this put goes
        # through a reservation.
        if self._spare.clears != clears or self._handle != handle or stale(taken):
            return None
        wanted = self._spare.wanted(len(keys), handle, ahead=not wait)
        sent_at = time.monotonic()
        table_reads = self._presence.take_reads()

        def build() -> pb.BindRequest:
            return pb.BindRequest(
                handle=handle,  # the slots' own, even on a retry after a reopen
                keys=packed,
                slots=addresses,
                checksums=sums,
                priority=priority,
                spare_wanted=wanted[0],
                spare_ahead=wanted[1],
                table_reads=table_reads,
                release_leases=self._take_releases(),
            )

        if not wait:
            token = yield Post("Bind", build)
            yield from self._in_flight(
                PostedPut(token, "Bind", packed, handle, sent_at, len(keys), taken)
            )
            return PutCount(0)
        try:
            reply = yield Call("Bind", build)
        except (LeaseExpiredError, UnknownNamespaceError):
            self._spare.clear()  # reclaimed, or the handle gone (a restart): ask anew
            return None
        self._spare.settle_bind(taken, list(reply.spare), reply.spare_fresh_s, sent_at, handle)
        return PutCount(int(reply.committed), int(reply.pending))

    def _get(self, keys: Sequence[bytes], out: torch.Tensor | None) -> Op[torch.Tensor]:
        packed = check_keys(keys)
        check_out(self.layout, len(keys), out)
        if not keys:
            return out[:0] if out is not None else empty_blocks(self.layout, 0)
        check_distinct(keys, "acquire")  # as the daemon's Acquire, also when the table serves
        if self._posted.before_read(packed):  # read your own writes
            yield from self._settle()
        if self._arena is None:
            return (yield from self._get_bytes(packed, out))
        dest = rows = None
        done = 0
        session = self._session
        placed = None
        for _ in range(2):
            if session is not None:
                placed = self._presence.places(session, self._handle, packed, len(keys))
            if (placed is not None and placed.whole) or self._posted.current is None:
                break
            yield from self._settle()  # a put in flight may be what the table waits for
        limit = len(keys)  # the keys the daemon may still serve
        if placed is not None:  # the leading blocks have places: read them with no call
            n = len(placed.addresses)
            if not n:  # and the daemon has none of them either
                return out[:0] if out is not None else empty_blocks(self.layout, 0)
            if placed.whole:
                limit = n
            dest = empty_blocks(self.layout, limit) if out is None else out
            rows = byte_rows(self.layout, dest)
            arena = self._require_arena("get")
            read = partial(
                place_reads.read_places, arena, self.namespace, placed.addresses, placed.sums
            )
            leading = packed[: n * KEY_BYTES]
            done = yield Blocking(partial(read, leading, rows), n * self.layout.block_bytes)
            self._presence.note_read(packed[: done * KEY_BYTES])
            if done == limit:
                return dest[:done]
        # The rest through a lease: all of it, or from the first block whose copy did not
        # verify (moved or evicted since the table said where it was).
        rest = packed[done * KEY_BYTES : limit * KEY_BYTES]
        lease = yield from self._acquire(keys[done:limit], rest, None)
        try:
            if dest is None:
                dest = empty_blocks(self.layout, len(lease)) if out is None else out
                rows = byte_rows(self.layout, dest)
            assert rows is not None
            nbytes = len(lease) * self.layout.block_bytes
            m = yield Blocking(lambda: lease.copy_into(rows[done:], self.verify_checksums), nbytes)
        finally:
            yield from lease._release_op()  # no call: the next one carries it
        return dest[: done + m]

    def _offload(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        keys: Sequence[bytes],
        priority: int | None,
    ) -> Op[int]:
        ids = paged_io.check_paged(self.layout, kv_caches, block_ids, keys)
        check_keys(keys)
        gpu = self._pool_link.device_for(kv_caches)
        stream = paged_io.caller_stream(kv_caches)
        stored = 0
        stage: torch.Tensor | None = None
        for ck, cids in paged_io.chunked(keys, ids, self._chunk_blocks):
            if self._arena is None:
                if stage is None:  # one chunk-sized buffer for the whole transfer
                    stage = paged_io.staging(self.layout, len(ids), kv_caches)
                blocks = stage[: len(cids)]
                yield Blocking(
                    partial(paged_io.gather_into_views, kv_caches, cids, blocks),
                    thread=True,
                    stream=stream,
                )  # waits for the kernel
                stored += yield from self._put(ck, blocks, priority)
                continue
            stored += yield from self._offload_chunk(kv_caches, ck, cids, priority, gpu, stream)
        return stored

    def _offload_chunk(
        self,
        kv_caches: Sequence[torch.Tensor],
        ck: Sequence[bytes],
        cids: Sequence[int],
        priority: int | None,
        gpu: torch.device | None,
        stream: Any,
    ) -> Op[int]:
        """One chunk of an offload through a reservation in the arena (or the GPU pool);
        written again once on a new handle if the daemon restarted before its Commit."""
        for attempt in range(2):
            reservation = yield from self._reserve(ck, priority, None, gpu)
            reserved_on = self._handle
            try:
                ids_new = [cids[i] for i in reservation.indices]
                checksums = None
                if reservation.codec:  # payload slots: the gather kernel quantizes
                    paged_io.ensure_pinned(reservation.arena, kv_caches)
                    checksums = yield Blocking(
                        partial(reservation.gather_payloads, list(kv_caches), ids_new),
                        thread=True,
                        stream=stream,
                    )
                elif not reservation.on_gpu:
                    paged_io.ensure_pinned(reservation.arena, kv_caches)
                    views, seeds = reservation.views, reservation.seeds_new
                    checksums = yield Blocking(
                        partial(paged_io.gather_with_checksums, kv_caches, ids_new, views, seeds),
                        thread=True,
                    )
                if checksums is None:
                    views = reservation.views
                    yield Blocking(
                        partial(paged_io.gather_into_views, kv_caches, ids_new, views),
                        thread=True,
                        stream=stream,
                    )
                    # Device checksums launch a kernel and wait for it: off the loop too.
                    checksums = yield Blocking(reservation.checksums, thread=True, stream=stream)
            except BaseException:
                yield from reservation._abort_op()
                raise
            try:
                return int((yield from reservation._commit_op(checksums)))
            except UnknownNamespaceError:
                if attempt or not self._restarted_since(reserved_on):
                    raise
        raise AssertionError("unreachable")

    def _load(
        self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], keys: Sequence[bytes]
    ) -> Op[int]:
        ids = paged_io.check_paged(self.layout, kv_caches, block_ids, keys)
        if self._posted.before_read(check_keys(keys)):  # read your own writes
            yield from self._settle()
        check_distinct(keys, "acquire")  # as the daemon's Acquire, also when the table serves
        gpu = self._pool_link.device_for(kv_caches)
        stream = paged_io.caller_stream(kv_caches)
        loaded = 0
        stage: torch.Tensor | None = None
        for ck, cids in paged_io.chunked(keys, ids, self._chunk_blocks):
            if self._arena is None:
                if stage is None:  # one chunk-sized buffer for the whole transfer
                    stage = paged_io.staging(self.layout, len(ids), kv_caches)
                got = yield from self._get(ck, stage)
                yield Blocking(
                    partial(paged_io.scatter_from_views, got, kv_caches, cids[: got.shape[0]]),
                    thread=True,
                    stream=stream,
                )
                n = got.shape[0]
            else:
                n, whole = 0, False
                if gpu is None and kv_caches[0].device.type == "cpu":
                    n, whole = yield from self._load_from_places(ck, kv_caches, cids)
                if n < len(ck) and not whole:  # the rest through a lease (see presence_link)
                    lease = yield from self._acquire(ck[n:], None, gpu)
                    try:
                        ids_leased = cids[n : n + len(lease)]
                        n += yield from self._scatter(lease, kv_caches, ids_leased, stream)
                    finally:
                        yield from lease._release_op()
            loaded += n
            if n < len(ck):
                break
        return loaded

    def _load_from_places(
        self, keys: Sequence[bytes], kv_caches: Sequence[torch.Tensor], ids: list[int]
    ) -> Op[tuple[int, bool]]:
        """Load CPU caches from the places the presence table gives, with no call: how many
        leading blocks arrived intact (0: call for them), and whether the daemon would serve
        no more of ``keys`` than those (no call for the rest either)."""
        session = self._session
        if session is None:
            return 0, False
        packed = b"".join(keys)
        placed = self._presence.places(session, self._handle, packed, len(keys))
        if placed is None:
            return 0, False
        n = 0
        if placed.addresses:
            arena = self._require_arena("load")
            scatter = partial(
                place_reads.scatter_places, arena, self.layout, self.namespace, *placed[:2]
            )
            run = len(placed.addresses)
            leading = packed[: run * KEY_BYTES]
            n = yield Blocking(partial(scatter, leading, kv_caches, ids[:run]), thread=True)
            self._presence.note_read(packed[: n * KEY_BYTES])
        return int(n), placed.whole and n == len(placed.addresses)

    def _scatter(
        self,
        lease: _LeaseState,
        kv_caches: Sequence[torch.Tensor],
        ids: list[int],
        stream: Any,
    ) -> Op[int]:
        """Copy a lease into physical blocks ``ids``; how many leading blocks are intact."""
        if lease.codecs:  # payload slots: the scatter kernel dequantizes
            paged_io.ensure_pinned(lease.arena, kv_caches)
            return int(
                (
                    yield Blocking(
                        partial(
                            payloads.scatter_from_slots,
                            lease.arena,
                            lease.offsets,
                            lease.payload_checksums,
                            lease.seeds,
                            lease.payload_bytes,
                            kv_caches,
                            ids,
                        ),
                        thread=True,
                        stream=stream,
                    )
                )
            )
        views = lease.views
        # CPU caches: each block verified right after its copy, while in cache (one pass).
        intact = yield Blocking(
            lambda: paged_io.scatter_with_checksums(
                views, kv_caches, ids, lease.checksums, lease.seeds
            ),
            thread=True,
        )
        if intact is None:
            if lease.any_on_host:
                paged_io.ensure_pinned(lease.arena, kv_caches)
            yield Blocking(
                lambda: paged_io.scatter_from_views(views, kv_caches, ids),
                thread=True,
                stream=stream,
            )
            # Checked after the copy: a slot that changed under us fails here, and the caller
            # recomputes from that block on.
            intact = yield Blocking(lease.intact, thread=True, stream=stream)
        return int(intact)

    # ------------------------------------------------------------------ zero-copy API
    def _new_reservation(self, *args: Any) -> _ReservationState:
        """The face's reservation class (``WriteReservation`` or ``AsyncWriteReservation``)."""
        raise NotImplementedError

    def _new_lease(self, *args: Any) -> _LeaseState:
        """The face's lease class (``ReadLease`` or ``AsyncReadLease``)."""
        raise NotImplementedError

    def _reserve(
        self,
        keys: Sequence[bytes],
        priority: int | None,
        packed: bytes | None,
        device: torch.device | None,
    ) -> Op[Any]:
        packed = check_keys(keys) if packed is None else packed
        prio = check_priority(priority)
        self._require_arena("reserve")
        table_reads = self._presence.take_reads()  # read before this put evicts anything
        reply = yield Call(
            "Reserve",
            lambda: pb.ReserveRequest(
                handle=self._handle,
                keys=packed,
                priority=prio,
                gpu=device is not None,
                table_reads=table_reads,
                release_leases=self._take_releases(),
            ),
        )
        handle = self._handle  # the reservation is this handle's (after any reopen)
        # Fetched after the call: a daemon restart makes the call reopen and remap the arena.
        arena = self._require_arena("reserve")
        pool = self._pool_link.for_device(device) if reply.gpu else None

        def commit(checksums: list[int]) -> Op[int]:
            payload_sums = reservation.payload_sums or []
            sent_at = time.monotonic()

            def build() -> pb.CommitRequest:
                return commit_request(
                    reply,
                    checksums,
                    handle,
                    self._take_releases(),
                    payload_sums,
                    reservation.spare_wanted,
                )

            if reservation.posted:  # a put that does not wait (``posted_puts``)
                token = yield Post("Commit", build)
                posted = PostedPut(token, "Commit", packed, handle, sent_at, len(checksums))
                yield from self._in_flight(posted)
                return 0
            reply_c = yield Call("Commit", build)
            self._spare.give(list(reply_c.spare), reply_c.spare_fresh_s, sent_at, handle)
            return int(reply_c.committed)

        def abort() -> Op[None]:
            req = pb.AbortRequest(reservation_id=reply.reservation_id, handle=handle)
            try:
                yield Call("Abort", lambda: req)
            except UnknownNamespaceError:
                pass  # the daemon forgot the handle (a restart): the reservation went with it

        if reply.gpu and pool is None:
            yield from abort()
            raise KVStoreError("the daemon reserved GPU pool slots this client cannot reach")
        reservation = self._new_reservation(
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
        reservation.codec, reservation.payload_bytes = reply.codec, reply.payload_bytes
        return reservation

    def _acquire(
        self,
        keys: Sequence[bytes],
        packed: bytes | None,
        device: torch.device | None,
        lookup: bool = False,
        prefetch: bool = False,
    ) -> Op[Any]:
        packed = check_keys(keys) if packed is None else packed
        self._require_arena("acquire")
        table_reads = self._presence.take_reads()  # taken once: a retry carries them too
        reply = yield Call(
            "Acquire",
            lambda: pb.AcquireRequest(
                handle=self._handle,
                keys=packed,
                gpu=device is not None,
                lookup=lookup,
                prefetch=prefetch,
                table_reads=table_reads,
                release_leases=self._take_releases(),
            ),
        )
        handle = self._handle
        arena = self._require_arena("acquire")
        pool = self._pool_link.for_device(device) if any(reply.on_gpu) else None

        def release() -> Op[None]:
            # Not a call of its own: the next call carries it (PendingReleases), unless that
            # makes too many waiting.
            if reply.lease_id and self._releases.add(handle, reply.lease_id):
                ids = self._releases.take(handle)
                request = pb.ReleaseRequest(handle=handle, release_leases=ids)
                try:
                    yield Call("Release", lambda: request)
                except KVStoreError:
                    pass  # the handle is gone, and its leases with it

        lease = self._new_lease(
            arena,
            self.layout,
            list(reply.offsets),
            list(reply.checksums),
            seeds_for(self.namespace, unpack_keys(packed)[: len(reply.offsets)]),
            release,
            list(reply.on_gpu),
            pool,
        )
        if lookup:
            lease.found = int(reply.found)
        lease.codecs = list(reply.codecs)
        lease.payload_checksums = list(reply.payload_checksums)
        lease.payload_bytes = reply.payload_bytes
        return lease

    # ------------------------------------------------------------------ bytes path
    def _put_bytes(self, keys: Sequence[bytes], rows: torch.Tensor, priority: int) -> Op[int]:
        rows_np = rows.numpy()
        seeds = seeds_for(self.namespace, keys)

        def messages() -> Iterator[pb.PutBlocksRequest]:
            return put_messages(self._handle, keys, seeds, rows_np, priority, self._chunk_bytes)

        reply = yield Call("PutBlocks", messages)
        return int(reply.stored)

    def _get_bytes(self, packed: bytes, out: torch.Tensor | None) -> Op[torch.Tensor]:
        keys = unpack_keys(packed)
        seeds = seeds_for(self.namespace, keys)
        got: list[StreamAssembler] = []

        def consume(message: pb.BlockData) -> bool:
            return got[-1].add(message)

        def build() -> pb.GetBlocksRequest:
            # A new assembler per attempt: a retry after a reopen starts from the first block.
            got.append(StreamAssembler(self.layout, keys, seeds, out))
            return pb.GetBlocksRequest(handle=self._handle, keys=packed)

        yield Fetch(build, consume)
        return got[-1].result()
