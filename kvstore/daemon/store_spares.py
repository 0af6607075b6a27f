"""Spare slots: a put in one call. A client in a run of puts holds arena slots reserved ahead
for it (RESERVED entries with no key, invisible to every lookup); its put copies into them and
``bind`` keys and commits them in one call. Bounded per handle and for the whole tier, quarantined
when they expire (a late copy lands in no other block)."""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Sequence

from kvstore.daemon.namespaces import Handle, NamespaceRecord, Reservation
from kvstore.daemon.store_parts import BindResult
from kvstore.daemon.store_writes import WriteOps
from kvstore.errors import KVStoreError, LeaseExpiredError, UnknownNamespaceError


class SpareOps(WriteOps):
    """Spare slots and Bind (they are reservations: built on the writes)."""

    def spare_bytes(self, record: NamespaceRecord) -> int:
        """The spare slot bytes one handle of ``record`` may hold: ``limits.max_spare_bytes``,
        and at most 1/16 of the room its blocks may take (the CPU tier, its namespace's and
        its tenant's CPU quotas): making spare slots may evict, as a reservation may, so on a
        small tier or under a small quota they are not made at all rather than crowd out the
        blocks they are for."""
        room = self.config.cpu.capacity_bytes
        for books in (record.usage, record.owner):
            quota = books.quota.cpu_bytes if books is not None else 0
            if quota:
                room = min(room, quota)
        return min(self.limits.max_spare_bytes, room // 16)

    @property
    def spare_tier_bytes(self) -> int:
        """The spare slot bytes all handles together may hold, quarantined ones included: 1/8
        of the CPU tier, so that however many clients put at once (or open, put and close), slots
        reserved ahead never crowd out the blocks. First come, first served: a handle refused
        here puts in two calls (Reserve, Commit), as a lone put does."""
        return self.config.cpu.capacity_bytes // 8

    @property
    def spare_evicting_bytes(self) -> int:
        """The spare slot bytes all handles together may hold (as ``spare_tier_bytes`` counts
        them) after a grant that evicts: 1/128 of the CPU tier. A grant past it takes free
        slots only. Slots reserved ahead hold no block, and those made by evicting take the
        coldest blocks before the client's next reads could use them: with up to 1/16 of the
        tier per handle, a full tier held 1-2% fewer blocks than its bytes allow, and in a
        trace replay (``benchmarks/bench_trace.py``) its LRU hit rate was 0.977-0.987x an
        exact LRU's at 5-10% of the trace's blocks (0.996x with this bound). Once the tier is
        full, a put larger than what is left of this bound goes in two calls (Reserve,
        Commit); smaller ones still bind."""
        return self.config.cpu.capacity_bytes // 128

    def spare_fits(self, handle: Handle, wanted: int) -> bool:
        """Whether ``wanted`` spare slots could ever be granted to ``handle``, whatever it and
        the others hold (a put of large blocks asks for more than the bounds allow: checked
        before any grant is tried or scheduled, so such puts pay nothing for asking)."""
        record = handle.record
        nbytes = wanted * record.cpu_bytes
        return (
            0 < wanted <= self.limits.max_keys_per_request
            and not record.cpu_codec
            and nbytes <= self.spare_bytes(record)
            and nbytes <= self.spare_tier_bytes
        )

    async def grant_spare(self, handle: Handle, wanted: int, ahead: int = 0) -> int:
        """Reserve ``wanted`` spare slots for ``handle``'s next puts, all or none, as a
        reservation marked ``spare`` (its id; 0 when none), and note each slot's address in
        ``handle.spare_slots``. None for a namespace whose slots take payloads, past
        ``spare_bytes`` with those it holds, or when the reservation is refused (tier full,
        pinned share, too many reservations). Blocks are evicted for them only within
        ``spare_evicting_bytes``; past it, only free slots are taken. Best effort: it raises
        nothing, since the call that asks has done its own work already.

        ``ahead``: as many more, for the put after the next, in the same reservation while
        that many slots are free (nothing is evicted for them); else ``wanted`` alone."""
        if ahead and self._free_slots(handle) >= wanted + ahead:
            rid = await self._grant_spare(handle, wanted + ahead, may_evict=False)
            if rid:
                return rid
        return await self._grant_spare(handle, wanted) if wanted else 0

    def _free_slots(self, handle: Handle) -> int:
        record = handle.record
        return self.ledger.allocator.free_slots(record.cpu_bytes, record.domain)

    async def _grant_spare(self, handle: Handle, wanted: int, may_evict: bool = True) -> int:
        record = handle.record
        if not self.spare_fits(handle, wanted) or not handle.writable or handle.closed:
            return 0
        # Grants under way count too: they may all wait at once (room being made).
        held = handle.spare_granting_slots
        held += sum(len(r.eids) for r in handle.reservations.values() if r.spare)
        nbytes = wanted * record.cpu_bytes
        if (held + wanted) * record.cpu_bytes > self.spare_bytes(record):
            return 0
        taken = (
            self.spare_reserved_bytes + self.spare_quarantined_bytes + self._spare_granting_bytes
        )
        if taken + nbytes > self.spare_tier_bytes:
            return 0
        may_evict = may_evict and taken + nbytes <= self.spare_evicting_bytes
        if not may_evict and self._free_slots(handle) < wanted:
            # The reservation below would be refused (it takes free slots only): on a full
            # tier most grants end here, and a refused reservation costs ~40 us of the
            # daemon's time, a check ~1 us.
            return 0
        prefix, count = self._spare_prefix, self._spare_count
        placeholders = [prefix + next(count).to_bytes(8, "little") for _ in range(wanted)]
        handle.spare_granting_slots += wanted
        self._spare_granting_bytes += nbytes
        try:
            result = await self.reserve(handle, placeholders, spare=True, may_evict=may_evict)
        except KVStoreError:
            return 0
        finally:
            handle.spare_granting_slots -= wanted
            self._spare_granting_bytes -= nbytes
        rid = result.reservation_id
        reservation = handle.reservations[rid]  # no await since it was made
        reservation.addresses = self.ledger.arena.addresses(result.offsets)
        handle.spare_slots.update(
            (address, (rid, eid))
            for address, eid in zip(reservation.addresses, reservation.eids, strict=True)
        )
        return rid

    def _forget_spare(self, handle: Handle, reservation: Reservation, until: float) -> None:
        """A spare reservation expired (or its handle closed) and its slots are quarantined
        until ``until``: they are no longer spare (a Bind naming them is refused), and count
        toward ``spare_tier_bytes`` until ``reap`` releases them."""
        for address in reservation.addresses:
            handle.spare_slots.pop(address, None)
        nbytes = len(reservation.eids) * handle.record.cpu_bytes
        self.spare_reserved_bytes -= nbytes
        self.spare_quarantined_bytes += nbytes
        heapq.heappush(self._spare_quarantine, (until, nbytes))

    def grant_spare_soon(self, handle: Handle, wanted: int, ahead: int = 0) -> None:
        """``grant_spare`` in the background (one at a time per handle), for a later reply to
        hand out (``take_spare``): the slots are made while the client copies its next put."""
        if wanted + ahead <= 0 or handle.spare_granting or handle.closed:
            return
        handle.spare_granting = True

        async def grant() -> None:
            try:
                rid = await self.grant_spare(handle, wanted, ahead)
                if rid:
                    handle.spare_ready.append(rid)
            finally:
                handle.spare_granting = False

        def start() -> None:  # after the reply went out: a task costs the call nothing then
            if handle.closed:
                handle.spare_granting = False
                return
            task = asyncio.get_running_loop().create_task(grant())
            self._spare_tasks.add(task)
            task.add_done_callback(self._spare_tasks.discard)

        asyncio.get_running_loop().call_soon(start)

    def take_spare(self, handle: Handle) -> tuple[list[int], float]:
        """The addresses of the spare slots granted to ``handle`` and not handed out yet, and
        how long the client may write into them: half the time the soonest to expire has
        left, so a copy never lands in a slot reclaimed meanwhile. ([], 0) when none."""
        now = self._clock()
        addresses: list[int] = []
        left = float("inf")
        for rid in handle.spare_ready:
            reservation = handle.reservations.get(rid)
            if reservation is None or not reservation.spare or reservation.expires_at <= now:
                continue  # expired (or cut short) before it was handed out
            left = min(left, reservation.expires_at - now)
            addresses += reservation.addresses
        handle.spare_ready = []
        return addresses, (left / 2 if addresses else 0.0)

    async def bind(
        self,
        handle: Handle,
        keys: Sequence[bytes],
        slots: Sequence[int],
        checksums: Sequence[int],
        priority: int = -1,
        wait_s: float | None = None,
    ) -> BindResult:
        """A put in one call: commit ``keys[i]`` with the block its writer already copied into
        spare slot ``slots[i]`` (an address this handle was granted), bound to
        ``checksums[i]``. Keys present, repeated, or still being written by another client
        after the wait (as ``reserve``) are not written; their slots stay spare. Refused, with
        nothing changed, when a slot is named twice or is not a spare slot of this handle
        (expired, bound already, never granted: LeaseExpiredError)."""
        self.check_keys(keys, "bind")
        n = len(keys)
        if len(slots) != n or len(checksums) != n:
            raise ValueError(
                f"bind names {n} keys, {len(slots)} slots and {len(checksums)} checksums: it "
                "needs one slot and one checksum per key"
            )
        if len(set(slots)) != n:
            raise ValueError("bind names a spare slot twice: each key needs a slot of its own")
        record = handle.record
        priority = record.priority if priority < 0 else priority
        if priority > 255:
            raise ValueError(f"priority must be in [0, 255], got {priority}")
        spare = handle.spare_slots
        self._check_spare(spare, slots)  # before the keys are spent: a refusal costs none
        self.ledger.quotas.take_keys(record, n, handle.payer)
        wait = self.limits.write_wait_s if wait_s is None else wait_s
        # The writer copied into the slots before it sent this call: none may be reclaimed
        # while it waits for another client's writes (reap would quarantine them).
        hold_until = self._clock() + max(0.0, min(wait, self.limits.write_wait_s)) + 1.0
        for rid in {spare[address][0] for address in slots}:
            reservation = handle.reservations.get(rid)
            if reservation is not None and reservation.expires_at < hold_until:
                reservation.expires_at = hold_until
        pending = await self.ledger.wait_for_writers(record.ns_id, keys, wait)
        if handle.closed:
            raise UnknownNamespaceError("the namespace handle was closed during the call")
        # No await from here on: the slots are checked (again: they may have expired during
        # the wait) and bound together.
        self._check_spare(spare, slots)
        todo = self._new_positions(record.ns_id, keys)
        if len(todo) == n:  # every key new (a put's usual case): no index lists to build
            bound = [spare.pop(address) for address in slots]
            new_keys, sums = keys, checksums
        else:
            bound = [spare.pop(slots[i]) for i in todo]
            new_keys, sums = [keys[i] for i in todo], [checksums[i] for i in todo]
        eids = [eid for _, eid in bound]  # (reservation id, entry)
        self.ledger.key_spare_entries(eids, new_keys, priority)
        for rid in {rid for rid, _ in bound}:
            self._take_spare_entries(handle, rid, {eid for r, eid in bound if r == rid})
        self.ledger.commit_cpu_entries(eids, sums)
        self.mover.note_committed(eids)
        self.shared.note_committed(eids)
        unbound = []
        if len(todo) < n:
            bound_at = set(todo)
            unbound = [slots[i] for i in range(n) if i not in bound_at]
        # Durable: the blocks bound now, and those of the keys found stored already.
        await self._persist_present(record.ns_id, keys)
        return BindResult(len(eids), pending, unbound)

    @staticmethod
    def _check_spare(spare: dict[int, tuple[int, int]], slots: Sequence[int]) -> None:
        missing = sum(1 for address in slots if address not in spare)
        if missing:
            raise LeaseExpiredError(
                f"{missing} of the {len(slots)} slots named are not spare slots of this handle "
                "(expired, bound already, or never granted): nothing was stored"
            )

    def _take_spare_entries(self, handle: Handle, rid: int, gone: set[int]) -> None:
        """Entries ``gone`` of spare reservation ``rid`` were bound: they leave it, and its
        pin (a reservation left empty goes)."""
        reservation = handle.reservations[rid]
        self.spare_reserved_bytes -= len(gone) * handle.record.cpu_bytes
        if len(gone) == len(reservation.eids):  # all of it (the usual case)
            del handle.reservations[rid]
            self.ledger.release_pin(reservation.pin)
            return
        kept = [
            (e, a)
            for e, a in zip(reservation.eids, reservation.addresses, strict=True)
            if e not in gone
        ]
        reservation.eids = [e for e, _ in kept]
        reservation.addresses = [a for _, a in kept]
        if reservation.pin is not None:
            offsets = [self.ledger.index.offset[e] for e in gone]
            nbytes = len(gone) * handle.record.cpu_bytes
            self.ledger.quotas.unpin_part(
                reservation.pin, nbytes, self.ledger.quotas.slabs_of(offsets)
            )
