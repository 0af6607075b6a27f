"""The CPU tier's side of the tier contract (``tier_contract``), and making room in it: the
slots a put, a promotion, a fetch from Redis or a copy down from the GPU pool needs, taken from
the coldest blocks it may evict.

``CpuRoom.alloc_cpu`` drops clean victims' CPU copies, writes dirty ones down first (through
the write-back it is handed: ``Mover.flush``, with NVMe) or spills them into the shared tier
(``spill``: Redis, when there is no NVMe tier), and keeps each namespace and tenant within its
``quota_cpu`` and others above their ``guaranteed_cpu``. One caller makes room at a time, so
room made by one is not taken by another. Every state change is a ledger method.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Container, Iterable
from typing import TYPE_CHECKING, Protocol

from kvstore.daemon.room import TierSlots, make_room
from kvstore.daemon.tier_contract import count_in, droppable, leading_in
from kvstore.errors import CapacityError, UnknownNamespaceError
from kvstore.index import IN_CPU, IN_GPU, IN_NVME, IN_REDIS, State

if TYPE_CHECKING:
    from kvstore.daemon.ledger import Ledger
    from kvstore.daemon.namespaces import NamespaceRecord
    from kvstore.daemon.quotas import Usage
    from kvstore.daemon.tierstats import TierCounters, TierSnapshot


class SpillTarget(Protocol):
    """Where the CPU tier's victims go when there is no NVMe tier (the shared Redis tier)."""

    @property
    def enabled(self) -> bool: ...

    @property
    def down(self) -> bool:
        """Configured, and unreachable now."""
        ...

    def must_reach_redis(self, eid: int) -> bool:
        """Whether ``eid`` exists nowhere else yet (it goes last while Redis is down)."""
        ...

    async def move_down(self, eids: list[int]) -> int:
        """Write ``eids`` down before their CPU copies go; how many are there afterwards."""
        ...


class _NoSpill:
    enabled = False
    down = False

    def must_reach_redis(self, eid: int) -> bool:
        return False

    async def move_down(self, eids: list[int]) -> int:
        return 0


async def _no_write_down(eid: int) -> bool:
    return False


async def _nothing_below(eids: list[int]) -> list[int]:
    return []


class CpuRoom:
    """The CPU tier of the tier contract (``tier_contract.Tier``): its slots and bytes are the
    ledger's ``cpu_slots`` (opened and closed with it), and what it moves crosses the edge
    below it. See the module docstring. ``write_down`` (an entry's write to the tier below,
    True once it is there), ``writing`` (the entries being written down now) and ``bring_up``
    (promotion of blocks only on disk) come from the NVMe tier (``Mover``); ``spill`` from the
    shared tier. Event-loop only."""

    def __init__(self, ledger: Ledger) -> None:
        self.name = "cpu"
        self.ledger = ledger
        self.spill: SpillTarget = _NoSpill()
        self.write_down: Callable[[int], Awaitable[bool]] = _no_write_down
        self.writing: Container[int] = frozenset()
        self.bring_up: Callable[[list[int]], Awaitable[list[int]]] = _nothing_below
        self._room = asyncio.Lock()
        allocator = ledger.allocator
        names, ns_of = ledger.names, ledger.index.ns

        def class_of(eid: int) -> tuple[int, int]:
            record = names[ns_of[eid]]
            return allocator.slot_bytes_for(record.cpu_bytes), record.domain

        self._slots = TierSlots(
            name="cpu",
            allocator=allocator,
            take_slots=ledger.cpu_alloc_many,
            give_back=ledger.cpu_unalloc,
            slot_of=lambda eid: ledger.index.offset[eid],
            owner_of=ledger.cpu_owner,
            class_of=class_of,
            relocate=ledger.relocate_cpu,
        )

    async def alloc_cpu(
        self,
        block_bytes: int,
        n: int,
        partial: bool = False,
        keep_gpu_copies: bool = False,
        domain: int = 0,
        record: NamespaceRecord | None = None,
        held_bytes: int = 0,
        keep: Container[int] = frozenset(),
        may_evict: bool = True,
    ) -> list[int]:
        """Allocate ``n`` CPU slots, making room as needed: drop clean victims' CPU copies,
        write dirty ones down first (or drop them when there is no tier below).

        ``keep``: entries this call must not evict, as if leased (the blocks a put found
        stored: evicting them to make room for its missing ones would make them missing too).
        Not ``may_evict``: only free slots are taken, and nothing is evicted (CapacityError when
        too few are free, or the slots would take the namespace or tenant past a quota).

        ``record``: the namespace the slots are for. Past its namespace's or its tenant's
        ``quota_cpu`` (counting ``held_bytes`` it already got for the same call), that
        namespace's or tenant's own coldest blocks go first; when they cannot, CapacityError
        names the quota (``partial``: fewer slots). Another tenant's blocks are victims only
        while that tenant stays at or above its ``guaranteed_cpu``.

        One caller makes room at a time, so room made by one caller is not taken by another.
        All or nothing (CapacityError when not enough blocks can go: leased or being written),
        unless ``partial``, which returns as many slots as could be had. ``keep_gpu_copies``
        (the GPU tier's write-back): a CPU copy that is the only copy below a GPU block is not
        a victim, since dropping it would make that GPU block dirty again (churn, no room won).
        """
        ledger, index = self.ledger, self.ledger.index
        keep_gpu = keep_gpu_copies and ledger.nvme is None

        flushing = self.writing

        def protected(eid: int) -> bool:
            # A block being written down is still a fine victim: ``_evict_cpu`` awaits its
            # write (flush() joins the one in flight) and then drops only its CPU copy. Any
            # other lease (a reader, a promotion) protects it.
            leases = index.leases[eid] - (1 if eid in flushing else 0)
            return leases > 0 or (keep_gpu and bool(index.tier[eid] & IN_GPU)) or eid in keep

        shared = self.spill

        def spare_unshared(eid: int) -> bool:
            # While Redis is down, blocks that exist nowhere else yet go last: they are what
            # the other hosts would lose.
            return protected(eid) or shared.must_reach_redis(eid)

        quotas = ledger.quotas
        requester = record.owner if record is not None else None
        guard = quotas.guard(requester, "cpu", self.owner_books, ledger.cpu_bytes_of)
        busy = "leased or being written"
        if guard is not None:
            busy += ", or within another tenant's guaranteed_cpu share"

        def evict(victims: list[int]) -> Awaitable[None]:
            return self._evict_cpu(victims, requester)

        def room(spare: Callable[[int], bool], all_or_nothing: bool) -> Awaitable[list[int]]:
            return make_room(
                self._slots,
                block_bytes,
                n,
                partial=partial and not all_or_nothing,
                policy=ledger.policy,
                protected=spare,
                evict=evict,
                busy=busy,
                domain=domain,
                budget=guard,
            )

        async with self._room:
            if not may_evict:
                return await self._free_only(block_bytes, n, domain, record, held_bytes, room)
            if record is not None:
                n = await self._quota_room(record, block_bytes, n, held_bytes, partial, protected)
                if not n:
                    return []
            if shared.enabled and shared.down:
                try:
                    return await room(spare_unshared, all_or_nothing=True)
                except CapacityError:
                    pass  # then they go too (counted in dropped_while_down)
            return await room(protected, all_or_nothing=False)

    async def _free_only(
        self,
        block_bytes: int,
        n: int,
        domain: int,
        record: NamespaceRecord | None,
        held_bytes: int,
        room: Callable[[Callable[[int], bool], bool], Awaitable[list[int]]],
    ) -> list[int]:
        """``alloc_cpu`` that evicts nothing: ``n`` free slots, all or nothing. The caller
        holds the room lock."""

        def nothing_goes(eid: int) -> bool:
            return True

        if record is not None:
            await self._quota_room(record, block_bytes, n, held_bytes, False, nothing_goes)
        free = self.ledger.allocator.free_slots(block_bytes, domain)
        if free < n:  # refused here: make_room would walk every block for a victim
            raise CapacityError(
                f"cpu tier full: {n} free slots of {block_bytes} bytes asked for without "
                f"evicting, {free} free"
            )
        return await room(nothing_goes, True)

    def owner_books(self, eid: int) -> Usage:
        return self.ledger.names[self.ledger.index.ns[eid]].owner  # type: ignore[no-any-return]

    async def _quota_room(
        self,
        record: NamespaceRecord,
        block_bytes: int,
        n: int,
        held_bytes: int,
        partial: bool,
        protected: Callable[[int], bool],
    ) -> int:
        """Bring ``record``'s namespace and tenant within their ``quota_cpu`` for ``n`` more
        blocks by evicting their own coldest blocks; returns how many of the ``n`` may be
        allocated (``n``, or fewer when ``partial``; CapacityError otherwise)."""
        ledger, quotas = self.ledger, self.ledger.quotas
        if record.owner is None:
            # Forgotten while this call waited for the room: its last handle closed, and it
            # holds no block. Nothing is allocated for it (a reserve of that handle says so).
            if partial:
                return 0
            raise UnknownNamespaceError("the namespace handle was closed during the call")
        for books, where in ((record.usage, "namespace"), (record.owner, "tenant")):
            for _ in range(4):  # victims may change while dirty ones are written down
                need = block_bytes * n + held_bytes
                excess = quotas.over(books, "cpu", need)
                if not excess:
                    break
                victims, _ = self.own_coldest(
                    ledger.policy.order(),
                    record,
                    where,
                    excess,
                    lambda eid: not protected(eid),
                    ledger.cpu_bytes_of,
                )
                if not victims:
                    break
                await self._evict_cpu(victims, record.owner)  # its own: no guarantee spares them
            excess = quotas.over(books, "cpu", block_bytes * n + held_bytes)
            if excess:
                if not partial:
                    raise quotas.quota_error(books, where, "cpu", block_bytes * n)
                n = max(0, n - -(-excess // block_bytes))
        return n

    async def _evict_cpu(self, victims: list[int], requester: Usage | None = None) -> None:
        """Drop victims' CPU copies, writing dirty ones down first (or dropping them when
        there is no tier below). A victim whose tenant would now fall below its guaranteed
        share (it changed while the writes ran) stays, unless it is ``requester``'s own."""
        ledger, index = self.ledger, self.ledger.index
        quotas = ledger.quotas
        # The blocks the writes below are for. A victim not committed yet (a slab drain names
        # every slot's entry: a spare slot a Bind may commit while the writes run) or one whose
        # entry holds another block by then got no write: it is left for the next round, never
        # dropped as if its write had failed.
        # With no tier below, nothing is written down and nothing waits: the victims are as
        # the caller picked them, and the checks below need no snapshot of their keys.
        was: dict[int, bytes] | None = None
        if ledger.nvme is not None or self.spill.enabled:
            was = {v: index.key(v) for v in victims if index.state[v] == State.COMMITTED}
            dirty = [v for v in was if not index.tier[v] & IN_NVME]
            if dirty:
                await self.move_down(dirty)
        # Forgotten as one batch, unless a tenant's guaranteed share is checked per victim
        # (each one evicted lowers its tenant's books before the next is checked).
        gone: list[int] = []
        batch = not quotas.guaranteed_cpu
        for v in victims:
            if (
                index.state[v] != State.COMMITTED
                or (was is not None and (v not in was or not index.has_key(v, index.ns[v], was[v])))
                or index.leases[v]
                or v in self.writing
                or not index.tier[v] & IN_CPU
                or (
                    quotas.guaranteed_cpu
                    and quotas.spared(requester, "cpu", self.owner_books(v), ledger.cpu_bytes_of(v))
                )
            ):
                continue  # changed while the writes ran; the next round picks again
            if index.tier[v] & (IN_NVME | IN_GPU):
                ledger.drop_cpu_copy(v)  # still stored on disk or in the GPU pool
            elif batch:
                gone.append(v)
            else:
                ledger.forget(v)  # nothing else holds it (no tier, or a failed write)
            ledger.cpu.evictions += 1
        ledger.forget_many(gone)

    # ----------------------------------------------------------------- the tier contract
    @property
    def enabled(self) -> bool:
        return True  # every daemon has a CPU tier

    async def start(self) -> None:
        """Nothing to open: the arena is the ledger's, mapped when it is made."""

    async def stop(self) -> None:
        """Nothing of its own in flight: the drain of dirty blocks to disk is the NVMe tier's
        ``stop``, and the arena is unmapped with the ledger."""

    async def move_up(self, eids: list[int]) -> list[int]:
        """Bring blocks only on disk into the CPU tier (``bring_up``: the NVMe tier's
        promotion); returns the leading run of ``eids`` in the CPU tier afterwards."""
        index = self.ledger.index
        if any(not index.tier[e] & IN_CPU for e in eids):
            await self.bring_up(eids)
        return leading_in(index, eids, IN_CPU)

    async def move_down(self, eids: list[int]) -> int:
        """Write CPU blocks to the tier below, keeping their CPU copies: to disk with an NVMe
        tier, else to the shared tier; returns how many of ``eids`` have a copy below after."""
        ledger, index = self.ledger, self.ledger.index
        if ledger.nvme is not None:
            await asyncio.gather(*(self.write_down(e) for e in dict.fromkeys(eids)))
            below = IN_NVME
        elif self.spill.enabled:
            await self.spill.move_down(eids)  # the CPU tier is the last local one
            below = IN_REDIS
        else:
            return 0
        return count_in(index, eids, below)

    def holds(self, eid: int) -> bool:
        return bool(self.ledger.index.tier[eid] & IN_CPU)

    def drop(self, eids: list[int]) -> int:
        """Drop the CPU copies of ``eids`` that have a disk or GPU copy and are neither leased
        nor being written down; returns how many went."""
        gone = droppable(self.ledger.index, eids, IN_CPU, IN_NVME | IN_GPU, self.writing)
        for e in gone:
            self.ledger.drop_cpu_copy(e)
        return len(gone)

    @property
    def counters(self) -> TierCounters:
        return self.ledger.cpu

    def snapshot(self) -> TierSnapshot:
        ledger = self.ledger
        return ledger.cpu_slots.snapshot(len(ledger.policy), ledger.reserved_blocks)

    # ----------------------------------------------------------------- victims
    def own_coldest(
        self,
        order: Iterable[int],
        record: NamespaceRecord,
        where: str,
        excess: int,
        evictable: Callable[[int], bool],
        bytes_of: Callable[[int], int] | None = None,
    ) -> tuple[list[int], int]:
        """The coldest evictable blocks of ``record``'s namespace (``where == "namespace"``) or
        tenant, in ``order`` (a policy's, coldest first), until they free ``excess`` bytes;
        with the bytes they free."""
        ledger, index = self.ledger, self.ledger.index
        bytes_of = bytes_of or ledger.block_bytes_of
        victims, freed = [], 0
        for eid in order:
            if freed >= excess:
                break
            if where == "namespace":
                mine = index.ns[eid] == record.ns_id
            else:
                mine = ledger.names[index.ns[eid]].owner is record.owner
            if mine and evictable(eid):
                victims.append(eid)
                freed += bytes_of(eid)
        return victims, freed
