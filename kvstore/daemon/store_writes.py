"""The store's writes: reserve and commit (two-phase, durable where asked), abort, the bytes
path's put, delete. See ``kvstore.daemon.store`` for the write protocol."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from kvstore.checksum import block_checksum
from kvstore.daemon.namespaces import Handle, Reservation
from kvstore.daemon.store_parts import ReserveResult, StoreParts
from kvstore.errors import CapacityError, LeaseExpiredError, UnavailableError, UnknownNamespaceError
from kvstore.index import IN_CPU, IN_NVME, State
from kvstore.tiers.codecs import block_format_of, encode_payload

CLEAR_STEP = 65536
"""Blocks one Delete of a whole namespace deletes at most (~0.2 s of the event loop)."""


class WriteOps(StoreParts):
    """Reserve, commit, abort, put_block, delete."""

    async def reserve(
        self,
        handle: Handle,
        keys: Sequence[bytes],
        priority: int = -1,
        gpu: bool = False,
        wait_s: float | None = None,
        spare: bool = False,
        may_evict: bool = True,
    ) -> ReserveResult:
        """Reserve a slot for each key not present: offsets (-1 where a key is present, being
        written, or repeats an earlier key of the call), whether they are in the GPU pool.

        ``gpu``: the writer maps the GPU pool and would rather write there (a device-to-device
        copy); the slots come from the pool when it can make room for all of them, else from
        the CPU arena. All or nothing: when the CPU tier cannot make room for every new key (the
        rest is leased, being written, or the call's own keys found stored, which are never
        evicted for its new ones) nothing is reserved and CapacityError says how many slots
        were missing. Keys another client is writing are waited for (at most ``wait_s``,
        default ``limits.write_wait_s``), so that a put returning means the block is readable;
        those still being written then are counted in ``pending``. Not ``may_evict``: the CPU
        slots are free ones, and nothing is evicted for them (CapacityError when too few).
        """
        self.check_keys(keys, "reserve")
        record = handle.record
        priority = record.priority if priority < 0 else priority
        if priority > 255:
            raise ValueError(f"priority must be in [0, 255], got {priority}")
        if len(handle.reservations) >= self.limits.max_reservations_per_handle:
            raise CapacityError(
                f"this handle holds {len(handle.reservations)} reservations "
                "(limits.max_reservations_per_handle): commit or abort some first"
            )
        if not spare:  # spare slots' keys are stand-ins: their Bind spends the keys
            self.ledger.quotas.take_keys(record, len(keys), handle.payer)
        self.ledger.quotas.check_pin(record, "reservations", 0)
        if not record.entries and record.namespace is not None:
            # Its first block: past its tenant's share of namespaces holding blocks, refused.
            self.ledger.names.check_share(record.namespace.tenant, handle.principal, record)
        wait = self.limits.write_wait_s if wait_s is None else wait_s
        pending = 0 if spare else await self.ledger.wait_for_writers(record.ns_id, keys, wait)
        if not spare:
            await self._persist_present(record.ns_id, keys)
        if handle.closed:
            raise UnknownNamespaceError("the namespace handle was closed during the call")
        offsets = [-1] * len(keys)
        if gpu and self._maps_pool(handle):
            reserved = await self._reserve_gpu(handle, keys, priority, offsets)
            if reserved is not None:
                return ReserveResult(reserved, offsets, True, pending)
        bb = record.cpu_bytes
        slots: list[int] = []
        try:
            for _ in range(8):
                todo = self._new_positions(record.ns_id, keys)
                if len(slots) >= len(todo):
                    break
                # Refused before any room is made for it: past its pinned share.
                self.ledger.quotas.check_pin(
                    record, "reservations", len(todo) * bb, [], self._bound(handle)
                )
                # Making room may wait for dirty victims to reach the disk; other calls run
                # meanwhile and may reserve some of these keys, hence the loop. The call's
                # keys found stored are no victims: evicting one would only add it to the
                # keys to reserve (a chain whose first block went and whose rest is the
                # coldest in the tier was evicted whole, one round at a time, then refused).
                slots += await self.cpu_room.alloc_cpu(
                    bb,
                    len(todo) - len(slots),
                    domain=record.domain,
                    record=record,
                    held_bytes=len(slots) * bb,
                    keep=() if spare else self._stored(record.ns_id, keys),
                    may_evict=may_evict,
                )
            else:
                raise CapacityError("cpu tier full: the keys to reserve kept changing")
            if handle.closed:
                raise UnknownNamespaceError("the namespace handle was closed during the call")
        except BaseException:
            for offset in slots:
                self.ledger.cpu_unalloc(offset, bb)
            raise
        # No await from here on.
        for offset in slots[len(todo) :]:
            self.ledger.cpu_unalloc(offset, bb)
        del slots[len(todo) :]
        if not todo:
            return ReserveResult(0, offsets, False, pending)
        try:
            # Now the slabs are known: with memory domains a pin counts whole slabs.
            slabs = self.ledger.quotas.slabs_of(slots)
            self.ledger.quotas.check_pin(
                record, "reservations", len(todo) * bb, slabs, self._bound(handle)
            )
        except CapacityError:
            for offset in slots:
                self.ledger.cpu_unalloc(offset, bb)
            raise
        rid = self._add_reservation(handle, keys, todo, slots, priority, offsets, spare=spare)
        if spare:
            reservation = handle.reservations[rid]
            reservation.spare = True
            reservation.expires_at = self._clock() + self.spare_ttl_s
            # Quarantined as briefly once expired (``reap``): its writer stopped writing half
            # its life before, and a client that leaves slots unused under load must not
            # leave them pinned for a whole reservation_ttl_s.
            reservation.shortened = True
            self.spare_reserved_bytes += len(reservation.eids) * bb
        return ReserveResult(rid, offsets, False, pending, record.cpu_codec)

    def _add_reservation(
        self,
        handle: Handle,
        keys: Sequence[bytes],
        todo: list[int],
        slots: list[int],
        priority: int,
        offsets: list[int],
        gpu: bool = False,
        spare: bool = False,
    ) -> int:
        """RESERVED entries for ``keys[todo[j]]`` in ``slots[j]`` (arena or, ``gpu``, pool
        slots), noted in ``offsets``; returns the new reservation's id. ``spare``: the keys
        are stand-ins and the entries get none until a Bind names theirs. No await."""
        ns_id = handle.ns_id
        if gpu:
            eids = []
            for i, offset in zip(todo, slots, strict=False):
                eid = self.ledger.add_entry(keys[i], ns_id, 0, -1, priority)
                self.ledger.place_in_gpu(eid, offset)
                eids.append(eid)
        else:
            eids = (
                self.ledger.add_unkeyed_cpu_entries(ns_id, slots[: len(todo)], priority)
                if spare
                else self.ledger.add_cpu_entries(
                    [keys[i] for i in todo], ns_id, slots[: len(todo)], priority
                )
            )
        for i, offset in zip(todo, slots, strict=False):
            offsets[i] = offset
        reservation_id = handle.new_id(handle.reservations)
        arena_slots = [] if gpu else list(slots[: len(eids)])
        pin = self.ledger.quotas.pin(
            handle.record,
            "reservations",
            len(arena_slots) * handle.record.cpu_bytes,
            self.ledger.quotas.slabs_of(arena_slots),
            handle.books,
        )
        handle.reservations[reservation_id] = Reservation(
            eids, self._clock() + self.config.reservation_ttl_s, gpu=gpu, pin=pin
        )
        return reservation_id

    async def _reserve_gpu(
        self, handle: Handle, keys: Sequence[bytes], priority: int, offsets: list[int]
    ) -> int | None:
        """Reserve pool slots for the new keys (filling ``offsets``): the reservation id, 0 when
        every key is present, or None when the pool cannot take them all (use the CPU tier)."""
        bb = handle.record.block_bytes
        try:
            slots = await self.device.alloc(bb, len(self._new_positions(handle.ns_id, keys)))
        except (CapacityError, ValueError):
            return None
        todo = self._new_positions(handle.ns_id, keys)  # no await from here on
        if len(slots) < len(todo) or handle.closed:
            for offset in slots:
                self.ledger.gpu_unalloc(offset, bb)
            if handle.closed:
                raise UnknownNamespaceError("the namespace handle was closed during the call")
            return None
        for offset in slots[len(todo) :]:
            self.ledger.gpu_unalloc(offset, bb)
        if not todo:
            return 0
        return self._add_reservation(handle, keys, todo, slots, priority, offsets, gpu=True)

    def _stored(self, ns_id: int, keys: Sequence[bytes]) -> set[int]:
        """The entries of ``keys`` that are indexed (stored or being written)."""
        ids = self.ledger.index.ids_of(ns_id)
        return {e for e in map(ids.get, keys) if e is not None}

    def _new_positions(self, ns_id: int, keys: Sequence[bytes]) -> list[int]:
        """Positions of the keys to write: not indexed, first occurrence in the call."""
        ids = self.ledger.index.ids_of(ns_id)
        if len(set(keys)) == len(keys):  # no repeats (the common case): one test a key
            return [i for i, key in enumerate(keys) if key not in ids]
        todo: list[int] = []
        seen: set[bytes] = set()
        for i, key in enumerate(keys):
            if key not in seen and key not in ids:
                todo.append(i)
            seen.add(key)
        return todo

    def commit(
        self,
        handle: Handle,
        reservation_id: int,
        checksums: Sequence[int],
        device_checksums: Sequence[int] = (),
        codec: int = 0,
        payload_bytes: int = 0,
        payload_checksums: Sequence[int] = (),
    ) -> int:
        """Make a reservation's blocks visible. A CPU reservation carries each block's bound
        checksum (``checksums``), a GPU one their bound device checksums. A reservation of a
        ``cpu = "fp8"`` namespace names the codec and payload length its slots were given and
        each payload's checksum beside its decoded form's (``checksums``); a commit that does
        not match the namespace and reservation is refused (ValueError) and changes nothing."""
        reservation = handle.reservations.get(reservation_id)
        if reservation is None or reservation.spare:  # a spare one's id is never handed out
            raise LeaseExpiredError(
                f"reservation {reservation_id} is unknown to this handle or expired; nothing "
                "was stored"
            )
        record = handle.record
        want_codec = 0 if reservation.gpu else record.cpu_codec
        want_bytes = record.cpu_payload_bytes if want_codec else 0
        want_sums = len(reservation.eids) if want_codec else 0
        if (codec, payload_bytes, len(payload_checksums)) != (want_codec, want_bytes, want_sums):
            raise ValueError(
                f"commit names codec {codec}, {payload_bytes}-byte payloads and "
                f"{len(payload_checksums)} payload checksums; this reservation's slots take "
                + (
                    f"fp8 payloads (codec {want_codec}) of {want_bytes} bytes, one checksum each "
                    f"({want_sums})"
                    if want_codec
                    else "whole blocks (codec 0, no payload length or payload checksums)"
                )
                + ": nothing was stored"
            )
        given, other, kind = (
            (device_checksums, checksums, "device checksums")
            if reservation.gpu
            else (checksums, device_checksums, "checksums")
        )
        if len(given) != len(reservation.eids) or other:
            raise ValueError(
                f"commit carries {len(checksums)} checksums and {len(device_checksums)} device "
                f"checksums for {len(reservation.eids)} blocks of a "
                f"{'gpu' if reservation.gpu else 'cpu'} reservation: it needs one of the {kind} "
                "per block and none of the other"
            )
        del handle.reservations[reservation_id]
        self.ledger.release_pin(reservation.pin)
        eids = reservation.eids
        for eid, payload_sum in zip(eids, payload_checksums, strict=False):
            self.ledger.set_payload_sum(eid, payload_sum)
        if reservation.gpu:
            for eid, checksum in zip(eids, given, strict=True):
                self.ledger.commit_entry(eid, 0)
                # The host checksum is made with a CPU copy.
                self.ledger.complete_gpu_copy(eid, checksum)
            self.ledger.touch_gpu(eids)
            self.device.note_committed(eids)
        else:
            self.ledger.commit_cpu_entries(eids, given)
            self.mover.note_committed(eids)
            self.shared.note_committed(eids)
        return len(eids)

    async def commit_durably(
        self,
        handle: Handle,
        reservation_id: int,
        checksums: Sequence[int],
        device_checksums: Sequence[int] = (),
        codec: int = 0,
        payload_bytes: int = 0,
        payload_checksums: Sequence[int] = (),
    ) -> int:
        """``commit``, acknowledged as ``nvme.durable_puts`` asks: with it, only once every
        block of the reservation is on disk and fdatasync'd (UnavailableError otherwise: the
        blocks are then readable but not durable, and the caller may retry the put)."""
        durable = self.config.nvme.durable_puts and self.ledger.nvme is not None
        reservation = handle.reservations.get(reservation_id) if durable else None
        if reservation is not None and reservation.spare:  # its entries have no key yet:
            reservation = None  # ``commit`` refuses the id, as it never was handed out
        eids = list(reservation.eids) if reservation is not None else []
        keys = [self.ledger.index.key(e) for e in eids]
        committed = self.commit(
            handle,
            reservation_id,
            checksums,
            device_checksums,
            codec,
            payload_bytes,
            payload_checksums,
        )
        if durable and eids:
            await self.persist(handle.ns_id, eids, keys)
        return committed

    async def _persist_present(self, ns_id: int, keys: Sequence[bytes]) -> None:
        """With ``nvme.durable_puts``, write to disk durably the blocks of ``keys`` that are
        committed but not on disk, or join their writes in flight (UnavailableError if one
        cannot be made durable). A put is acknowledged only once all its blocks are durable,
        those it found stored already included: a put that failed to persist, retried, found
        its blocks in memory and was acknowledged with none of them on disk; and a put racing
        another writer's durable put of a key was acknowledged before that write ended."""
        if not self.config.nvme.durable_puts or self.ledger.nvme is None:
            return
        ids, state, tier = (
            self.ledger.index.ids_of(ns_id),
            self.ledger.index.state,
            self.ledger.index.tier,
        )
        eids, found = [], []
        for key in keys:
            eid = ids.get(key)
            if eid is not None and state[eid] == State.COMMITTED and not tier[eid] & IN_NVME:
                eids.append(eid)
                found.append(key)
        if eids:
            await self.persist(ns_id, eids, found)

    async def persist(self, ns_id: int, eids: list[int], keys: list[bytes]) -> None:
        """Write committed blocks to disk durably now (waiting for writes in flight); blocks
        deleted before it starts need nothing. UnavailableError if one could not be made
        durable, or is gone by the end without its write having succeeded: the daemon cannot
        tell a client's delete from an eviction (a failed write-back evicts), and a put is
        acknowledged only with its blocks on disk."""
        live = [
            (e, k)
            for e, k in zip(eids, keys, strict=True)
            if self.ledger.index.has_key(e, ns_id, k)
        ]
        gpu_only = [e for e, _ in live if not self.ledger.index.tier[e] & (IN_CPU | IN_NVME)]
        if gpu_only:
            await self.device.move_down(gpu_only)
        results = await asyncio.gather(*(self.mover.flush(e, durable=True) for e, _ in live))
        lost = [
            k
            for (e, k), ok in zip(live, results, strict=True)
            if not ok
            and not (self.ledger.index.has_key(e, ns_id, k) and self.ledger.index.tier[e] & IN_NVME)
        ]
        if lost:
            raise UnavailableError(
                f"{len(lost)} of {len(eids)} blocks could not be made durable (the NVMe tier is "
                "full of leased blocks, or failing: see kvstore stat); those still stored are "
                "in memory, and a retry of the put writes them down"
            )

    def abort(self, handle: Handle, reservation_id: int) -> None:
        reservation = handle.reservations.get(reservation_id)
        if reservation is None or reservation.spare:  # a spare one's id is never handed out
            raise LeaseExpiredError(
                f"reservation {reservation_id} is unknown to this handle or expired"
            )
        del handle.reservations[reservation_id]
        for eid in reservation.eids:
            self.ledger.free_entry(eid)
        self.ledger.release_pin(reservation.pin)

    async def put_block(
        self,
        handle: Handle,
        key: bytes,
        chunks: Sequence[bytes],
        checksum: int,
        priority: int = -1,
    ) -> bool:
        """The bytes path: store one block whose bytes arrived over gRPC in ``chunks``. The
        client's checksum (bound to namespace and key) is verified against what was copied
        into the slot before the block is committed. True if newly stored."""
        record = handle.record
        size = sum(len(c) for c in chunks)
        if size != record.block_bytes:
            raise ValueError(
                f"block for key {key.hex()[:16]}… is {size} bytes, "
                f"the namespace's blocks are {record.block_bytes}"
            )
        if record.cpu_codec:
            return await self._put_block_encoded(handle, key, b"".join(chunks), checksum, priority)
        reserved = await self.reserve(handle, [key], priority)
        if not reserved.reservation_id:
            return False
        offset = reserved.offsets[0]
        view = self.ledger.arena.view
        for chunk in chunks:
            view[offset : offset + len(chunk)] = chunk
            offset += len(chunk)
        data = view[reserved.offsets[0] : reserved.offsets[0] + size]
        if block_checksum(data, record.fingerprint, key) != checksum:
            self.abort(handle, reserved.reservation_id)
            raise ValueError(
                f"block for key {key.hex()[:16]}… does not match its checksum: not stored"
            )
        await self.commit_durably(handle, reserved.reservation_id, [checksum])
        return True

    async def _put_block_encoded(
        self, handle: Handle, key: bytes, block: bytes, checksum: int, priority: int
    ) -> bool:
        """``put_block`` into a ``cpu = "fp8"`` namespace: the block is verified, then encoded
        here (off the loop) into its payload slot, and committed with the checksums of the
        payload and of its decoded form, as a client's arena put would."""
        record = handle.record
        fingerprint = record.fingerprint
        if await asyncio.to_thread(block_checksum, block, fingerprint, key) != checksum:
            raise ValueError(
                f"block for key {key.hex()[:16]}… does not match its checksum: not stored"
            )
        reserved = await self.reserve(handle, [key], priority)
        if not reserved.reservation_id:
            return False
        offset = reserved.offsets[0]
        slot = self.ledger.arena.view[offset : offset + record.cpu_bytes]
        fmt = block_format_of(record.namespace.layout) if record.namespace else None
        # Encoded and hashed in private memory: the checksums vouch for this block whatever
        # writes into the shared slot, and the thread never touches the slot, so a put given
        # up meanwhile (its slot freed, maybe reused) cannot write into another block.
        private = memoryview(bytearray(record.cpu_bytes))
        try:
            assert fmt is not None  # a namespace with an fp8 cpu codec has a known format
            sums = await asyncio.to_thread(encode_payload, block, fmt, private, fingerprint, key)
        except BaseException:
            # Aborted unless it is gone already (reaped, its handle closed): an abort of it
            # would raise in place of what ended the encode.
            if reserved.reservation_id in handle.reservations:
                self.abort(handle, reserved.reservation_id)
            raise
        if reserved.reservation_id in handle.reservations:  # still live: no await until commit
            slot[:] = private
        await self.commit_durably(
            handle,
            reserved.reservation_id,
            [sums[0]],
            codec=record.cpu_codec,
            payload_bytes=record.cpu_payload_bytes,
            payload_checksums=[sums[1]],
        )
        return True

    def delete(self, handle: Handle, keys: Sequence[bytes]) -> int:
        self.check_keys(keys, "delete")
        deleted = 0
        for key in dict.fromkeys(keys):  # a repeated key is deleted once
            eid = self.ledger.committed(handle.ns_id, key)
            if eid is not None:
                self.ledger.forget(eid)
                deleted += 1
        return deleted

    def delete_all(self, handle: Handle) -> tuple[int, bool]:
        """Delete up to ``CLEAR_STEP`` committed blocks of ``handle``'s namespace (a leased
        one goes when its reads end): (deleted, whether blocks may be left). Bounded, so the
        one event loop is never held for a whole namespace of millions."""
        ledger = self.ledger
        state, ids = ledger.index.state, ledger.index.ids_of(handle.ns_id)
        committed = (e for e in ids.values() if state[e] == State.COMMITTED)
        eids = list(itertools.islice(committed, CLEAR_STEP))
        for eid in eids:
            ledger.forget(eid)
        return len(eids), len(eids) == CLEAR_STEP
