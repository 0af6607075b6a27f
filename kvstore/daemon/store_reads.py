"""The store's reads: lookup (with the tiers' hit counts), acquire and release of read
leases, the bytes path's copies out of leased blocks, prefetch. See ``kvstore.daemon.store``
for the read protocol."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.daemon.namespaces import Handle, Lease, NamespaceRecord
from kvstore.daemon.store_parts import AcquireResult, StoreParts, distinct
from kvstore.daemon.tier_contract import KeyRun
from kvstore.errors import CapacityError, LeaseExpiredError, UnknownNamespaceError
from kvstore.index import IN_CPU, IN_GPU, State, gather
from kvstore.tiers.codecs import decode

# lookup's hit counts: tier byte -> 1 where the block is in the GPU tier / in CPU but not GPU.
_IS_GPU = bytes(1 if t & IN_GPU else 0 for t in range(256))
_IS_CPU_ONLY = bytes(1 if t & IN_CPU and not t & IN_GPU else 0 for t in range(256))
MAX_TALLY_KEYS = 1 << 32
"""The most keys one tally of lookups answered from a presence table may count. A client sends
its tally at least once a second while it looks up (``presence_link.FLUSH_S``) and answers
well under 10**9 keys a second, so an honest tally is far below it; a forged one is refused
rather than added (the counts feed uint64 fields of ``Stats``, saturated there)."""


class ReadOps(StoreParts):
    """Lookup, acquire/release, the bytes path's reads, prefetch."""

    def count_table_lookups(
        self, handle: Handle, keys: int, found: int, in_cpu: int | None = None
    ) -> None:
        """Count lookups a client answered from its presence table (``keys`` asked,
        ``found`` leading keys found, ``in_cpu`` of them with a CPU copy in the table) as its
        namespace's hits and misses, when the handle is the namespace's own tenant's, and as
        the tiers' where the split is known (``_count_tier_lookups``). Not charged to
        ``keys_per_s``: they cost the daemon nothing."""
        if keys > MAX_TALLY_KEYS:
            raise ValueError(
                f"table_keys ({keys}) exceeds {MAX_TALLY_KEYS}, more than a client answers "
                "between two calls"
            )
        if not 0 <= found <= keys:
            raise ValueError(f"table_found ({found}) exceeds table_keys ({keys})")
        if in_cpu is not None and not 0 <= in_cpu <= found:
            raise ValueError(f"table_in_cpu ({in_cpu}) exceeds table_found ({found})")
        if not handle.writable:
            # A reader of a shared namespace: what it says it looked up costs it nothing, so
            # it does not get to move the owner's hit rates.
            return
        record = handle.record
        record.lookup_hits += found
        record.lookup_misses += keys - found
        # The table knows a found block's CPU copy (its place) and no other tier: the rest
        # are on NVMe only where there is no GPU tier, and a namespace stored with a codec
        # has no places at all. Elsewhere the daemon's own lookups are the tiers' only count.
        if in_cpu is not None and not self.device.enabled and not record.cpu_codec:
            self._count_tier_lookups(keys, 0, in_cpu, found, 0)

    def note_table_reads(self, handle: Handle, keys: Sequence[bytes]) -> None:
        """Blocks a client read itself from the places of its presence table: read now, for
        the eviction policies (``acquire``'s bookkeeping, less the lease). Keys no longer
        committed are skipped. Not charged to ``keys_per_s`` (the reads cost the daemon
        nothing; this is a dict lookup per key, within ``max_keys_per_request``)."""
        self.check_keys(keys, "table_reads")
        ids = self.ledger.index.ids_of(handle.ns_id)
        state = self.ledger.index.state
        eids = [e for e in map(ids.get, keys) if e is not None and state[e] == State.COMMITTED]
        if not eids:
            return
        tiers = self.ledger.index.tier
        self.mover.note_read(eids)
        self.ledger.policy.touch([e for e in eids if tiers[e] & IN_CPU])
        self.device.note_read(eids)

    async def lookup(self, handle: Handle, keys: Sequence[bytes]) -> int:
        self.check_keys(keys, "lookup")
        distinct(keys, "lookup")  # a repeat would count as found (and as hits) each time
        record = handle.record
        self.ledger.quotas.take_keys(record, len(keys), handle.payer)
        ns_id = record.ns_id
        run = self.ledger.leading_run(ns_id, keys)
        local = len(run)
        shared = 0
        if local < len(keys):
            # One batched call for the rest of the run; 0 when Redis is unreachable.
            shared = await self.shared.contains(record, list(keys[local:]))
        found = local + shared
        # Hits and misses are counted per key asked by lookup, the call engines make before
        # every prefill; a get that follows it asks only for what lookup found. A block is a hit
        # of the highest tier that holds it.
        record.lookup_hits += found
        record.lookup_misses += len(keys) - found
        run_tiers = gather(self.ledger.index.tier, run)  # counted in C, by translation tables
        in_gpu = run_tiers.translate(_IS_GPU).count(1)
        in_cpu = run_tiers.translate(_IS_CPU_ONLY).count(1)
        self._count_tier_lookups(len(keys), in_gpu, in_cpu, local, shared)
        return found

    def _count_tier_lookups(
        self, keys: int, in_gpu: int, in_cpu: int, local: int, shared: int
    ) -> None:
        """Count ``keys`` looked up as the tiers' hits and misses: a block is a hit of the
        highest tier that holds it (``in_gpu``, ``in_cpu`` and not the GPU, the rest of the
        ``local`` run on NVMe, ``shared`` in Redis past it), a miss of every tier above."""
        found = local + shared
        if self.device.enabled:
            self.device.counters.hits += in_gpu
            self.device.counters.misses += keys - in_gpu
        self.ledger.cpu.hits += in_cpu
        self.ledger.cpu.misses += keys - in_gpu - in_cpu
        if self.ledger.nvme is not None:
            self.ledger.nvme_counters.hits += local - in_gpu - in_cpu
            self.ledger.nvme_counters.misses += keys - local
        if self.shared.enabled:
            self.ledger.redis_counters.hits += shared
            self.ledger.redis_counters.misses += keys - found

    async def acquire(
        self,
        handle: Handle,
        keys: Sequence[bytes],
        gpu: bool = False,
        wait_s: float | None = None,
    ) -> AcquireResult:
        """Lease the leading run of present blocks, bringing the ones the reader cannot reach
        into the CPU tier.

        ``gpu``: the reader maps the GPU pool, so a block there is served from its pool slot
        (``on_gpu``; its offset is a pool offset and its checksum the device checksum).
        Otherwise every block is served from the CPU arena. A run that meets a key another
        client is writing waits (at most ``wait_s``, default ``limits.write_wait_s``) for it.
        Keys must be distinct.
        """
        self.check_keys(keys, "acquire")
        distinct(keys, "acquire")
        if len(handle.leases) >= self.limits.max_leases_per_handle:
            raise CapacityError(
                f"this handle holds {len(handle.leases)} leases "
                "(limits.max_leases_per_handle): release some first"
            )
        record = handle.record
        self.ledger.quotas.take_keys(record, len(keys), handle.payer)
        self.ledger.quotas.check_pin(record, "leases", 0, payer=handle.payer)
        ns_id = record.ns_id
        wait = self.limits.write_wait_s if wait_s is None else wait_s
        eids = self.ledger.leading_run(ns_id, keys)
        pending = False
        if len(eids) < len(keys):
            eid = self.ledger.index.get(ns_id, keys[len(eids)])
            if eid is not None and self.ledger.index.state[eid] == State.RESERVED:
                # Read your writes: another client is committing this very block.
                pending = await self.ledger.wait_for_writers(ns_id, [keys[len(eids)]], wait) > 0
                eids = self.ledger.leading_run(ns_id, keys)
        # ``held`` is exactly what this call holds leases on: a call cancelled (a client's
        # deadline) or failing anywhere gives them back, since no lease id exists yet that
        # a release or close could reclaim.
        held: list[int] = []
        try:
            self.ledger.add_leases(eids)  # the whole run, before anything awaits
            held.extend(eids)
            local_run = len(eids)
            tiers = self.ledger.index.tier
            gpu = gpu and self._maps_pool(handle)
            if not gpu:
                gpu_only = [e for e in eids if tiers[e] & IN_GPU and not tiers[e] & IN_CPU]
                if gpu_only:
                    await self.device.move_down(gpu_only, partial=True)  # as many as fit
            await self.cpu_room.move_up([e for e in eids if not (gpu and tiers[e] & IN_GPU)])
            ready = len(eids)
            state = self.ledger.index.state
            for i, eid in enumerate(eids):
                servable = tiers[eid] & IN_CPU or (gpu and tiers[eid] & IN_GPU)
                if state[eid] != State.COMMITTED or not servable:
                    ready = i
                    break
            for eid in held[ready:]:
                self.ledger.drop_lease(eid)
            del held[ready:]
            eids = eids[:ready]
            if ready == local_run < len(keys) and self.shared.enabled and not pending:
                # The local run ended at a missing block: the shared tier may hold the rest.
                fetched = await self.shared.move_up(KeyRun(record, list(keys[ready:])))
                for eid in fetched:  # committed just now, no await since: lease them at once
                    self.ledger.add_lease(eid)
                    held.append(eid)
                eids = eids + fetched
        except BaseException:
            for eid in held:
                self.ledger.drop_lease(eid)
            raise
        if handle.closed:  # the client went away while this call waited
            for eid in held:
                self.ledger.drop_lease(eid)
            raise UnknownNamespaceError("the namespace handle was closed during the call")
        if not eids:
            return AcquireResult(0, [], [], [], pending)
        index = self.ledger.index
        if gpu:
            on_gpu = [bool(tiers[e] & IN_GPU) for e in eids]
            arena_eids = [e for e, g in zip(eids, on_gpu, strict=True) if not g]
        else:
            on_gpu, arena_eids = [False] * len(eids), eids
        in_arena = list(map(index.offset.__getitem__, arena_eids))
        slabs = self.ledger.quotas.slabs_of(in_arena)
        try:
            # One tenant may pin only its share: the rest of the tier stays evictable.
            self.ledger.quotas.check_pin(
                record,
                "leases",
                len(in_arena) * record.cpu_bytes,
                slabs,
                self._bound(handle),
                arena_eids,
                handle.payer,
            )
        except CapacityError:
            for eid in held:
                self.ledger.drop_lease(eid)
            raise
        pin = self.ledger.quotas.pin(
            record,
            "leases",
            len(in_arena) * record.cpu_bytes,
            slabs,
            handle.books,
            arena_eids,
            handle.payer,
        )
        self.mover.note_read(eids)
        # Committed only: an entry deleted during an await above is an orphan, out of policies.
        state = index.state
        self.ledger.policy.touch(
            [e for e in eids if tiers[e] & IN_CPU and state[e] == State.COMMITTED]
        )
        self.device.note_read(eids)
        lease_id = handle.new_id(handle.leases)
        handle.leases[lease_id] = Lease(
            eids, list(keys[: len(eids)]), self._clock() + self.config.lease_ttl_s, pin
        )
        if arena_eids is eids:  # every block from the arena
            offsets = in_arena
            checksums = list(map(index.checksum.__getitem__, eids))
        else:
            pool = self.ledger.gpu_slots
            offsets = [
                pool.offset[e] if g else index.offset[e] for e, g in zip(eids, on_gpu, strict=True)
            ]
            checksums = [
                pool.dsum[e] if g else index.checksum[e] for e, g in zip(eids, on_gpu, strict=True)
            ]
        result = AcquireResult(lease_id, offsets, checksums, on_gpu, pending)
        if record.cpu_codec:  # every block is an arena payload (such a namespace has no pool)
            result.codecs = [record.cpu_codec] * len(eids)
            result.payload_checksums = [self.ledger.payload_sums.get(e, 0) for e in eids]
        return result

    def release(self, handle: Handle, lease_id: int) -> None:
        lease = handle.leases.pop(lease_id, None)
        if lease is None:
            raise LeaseExpiredError(f"lease {lease_id} is unknown to this handle or expired")
        self.ledger.drop_leases(lease.eids)
        self.ledger.release_pin(lease.pin)

    def read_leased(self, handle: Handle, lease_id: int, i: int) -> tuple[bytes, bytes, int, int]:
        """Block ``i`` of a lease, copied out of the arena now (the bytes path): (key, bytes,
        checksum, codec id). Checked at the moment of the copy: the lease is live and its
        entry still holds the key it was leased for, committed, in the CPU tier.
        LeaseExpiredError otherwise, never another block's bytes. A codec (not 0: a payload
        namespace's CPU copy): the bytes are the payload; ``decode_leased`` gives the block
        the checksum is of."""
        lease = handle.leases.get(lease_id)
        if lease is None or i >= len(lease.eids):  # expired (or its block ``i`` was cut)
            raise LeaseExpiredError(f"lease {lease_id} expired while its blocks were streamed")
        eid, key = lease.eids[i], lease.keys[i]
        index = self.ledger.index
        if (
            not index.has_key(eid, handle.ns_id, key)
            or index.state[eid] != State.COMMITTED
            or not index.tier[eid] & IN_CPU
        ):
            raise LeaseExpiredError(f"block {i} of lease {lease_id} no longer holds its key")
        record = handle.record
        offset = index.offset[eid]
        slot = self.ledger.arena.view[offset : offset + record.cpu_bytes]
        return key, bytes(slot), index.checksum[eid], record.cpu_codec

    @staticmethod
    def decode_leased(record: NamespaceRecord, payload: bytes) -> bytes | None:
        """The block a payload copied by ``read_leased`` decodes to (~1 ms for a 2 MiB block,
        so callers run it off the event loop); None when it does not decode (a miss). The
        reader checks it against the decoded form's checksum."""
        block = bytearray(record.block_bytes)
        if not decode(
            record.cpu_codec, memoryview(payload), memoryview(block), memoryview(bytearray(0))
        ):
            return None
        return bytes(block)

    def prefetch(self, handle: Handle, keys: list[bytes], gpu: bool = False) -> int:
        """Start promoting the run of ``keys`` (into the GPU pool with ``gpu``, for a caller
        that maps it; else into the CPU tier); returns how many blocks were queued."""
        self.check_keys(keys, "prefetch")
        if gpu and self._maps_pool(handle):
            return self.device.prefetch(handle.ns_id, keys, handle.payer)
        return self.mover.prefetch(handle.ns_id, keys, handle.payer)
