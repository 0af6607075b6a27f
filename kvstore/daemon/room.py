"""Making room in a tier: the victim-picking loop every tier with slots shares.

A tier asks for ``n`` slots of one size. While its allocator has too few free, the tier's
eviction policy names the coldest unprotected block, of any size:

- a block of the same slot size is evicted (with the next coldest of that size, up to what is
  missing): its slot is then free for the caller;
- a block of another size lives in a slab of another size class, and freeing its one slot does
  not help the caller. The slab holding it is drained instead (memcached's slab mover, policy
  driven): its free slots stop being handed out, each of its blocks is moved to a free slot of
  its own class elsewhere when there is one (``relocate``, CPU tier) or evicted, and the empty
  slab goes back to the pool, where the caller's class takes it. A slab holding a block that
  cannot go (leased, being written, quarantined) is left alone and the next coldest block's
  slab is tried.

So any block size can evict any unleased block of any other size, in policy order, at the cost
of one slab's worth of blocks (moved where possible). What "protected" means, what evicting
does, and whether blocks can move differ per tier (``cpu_room.CpuRoom.alloc_cpu``,
``device.DeviceTier.alloc``); the loop, the partial mode and the error do not. The caller holds
its tier's room lock.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvstore.errors import CapacityError
from kvstore.policy import EvictionPolicy
from kvstore.tiers.cpu import SlabAllocator


@dataclass
class TierSlots:
    """What ``make_room`` needs of one tier: its allocator and how to read and change it."""

    name: str
    allocator: SlabAllocator
    # (block bytes, n, domain): up to n slots as one batch, fewer when no more can be had
    # (a slab could not be backed).
    take_slots: Callable[[int, int, int], list[int]]
    give_back: Callable[[int, int], None]  # (offset, block bytes): undo a take_slots slot
    slot_of: Callable[[int], int]  # an entry's slot offset in this tier
    owner_of: Callable[[int], int | None]  # the entry in a slot (None: quarantined, unknown)
    # An entry's (slot size, memory domain) in this tier (a domain is a tenant's slabs; 0
    # where the tier is not divided): what the victim loop asks of every block it walks past.
    class_of: Callable[[int], tuple[int, int]]
    # Move an entry to another slot of its class (not in ``avoid_slab``); False if it cannot.
    relocate: Callable[[int, int], bool] | None = None


async def make_room(
    tier: TierSlots,
    block_bytes: int,
    n: int,
    *,
    partial: bool,
    policy: EvictionPolicy,
    protected: Callable[[int], bool],
    evict: Callable[[list[int]], Awaitable[None]],
    busy: str,
    domain: int = 0,
    budget: Callable[[], Callable[[int], bool]] | None = None,
) -> list[int]:
    """``n`` slots of ``block_bytes`` in memory ``domain`` (offsets), evicting as needed; a
    block of another domain is like one of another size (its slab is drained). All or nothing:
    CapacityError when not enough blocks can go (``busy`` says why the rest cannot), unless
    ``partial``, which returns as many slots as could be had.

    ``budget`` (tenants' guaranteed shares): makes, for each round, a check that is True for
    a victim that may go together with those it granted before (a block it refuses is spared
    like a protected one; a slab is drained only if every block in it is granted)."""
    allocator = tier.allocator
    slot_size = allocator.slot_bytes_for(block_bytes)
    class_of, wanted = tier.class_of, (slot_size, domain)
    slots: list[int] = []
    stuck: set[int] = set()  # slabs that could not be drained this call
    try:
        while True:
            # Each slot taken is one free slot fewer, so ``free_slots`` is asked once a run.
            while len(slots) < n and (free := allocator.free_slots(block_bytes, domain)):
                want = min(free, n - len(slots))
                got = tier.take_slots(block_bytes, want, domain)
                slots += got
                if len(got) < want:  # a slab could not be backed: fewer free slots now
                    break
            if len(slots) >= n:
                return slots
            short = n - len(slots)
            victims: list[int] = []
            other: int | None = None
            take = budget() if budget is not None else None
            for eid in policy.order():  # coldest first
                if protected(eid):
                    continue
                if class_of(eid) == wanted:
                    if take is not None and not take(eid):
                        continue
                    victims.append(eid)
                    if len(victims) == short:
                        break
                elif not victims and allocator.slab_of(tier.slot_of(eid)) not in stuck:
                    other = eid
                    break
                elif victims:
                    break  # the next coldest is of another size: evict what we have first
            if victims:
                await evict(victims)  # may leave some in place; the next round picks again
                continue
            if other is not None:
                slab = allocator.slab_of(tier.slot_of(other))
                if not await _drain(tier, slab, other, protected, evict, budget):
                    stuck.add(slab)
                continue
            if partial:
                return slots
            free = len(slots)
            reason = f" ({allocator.backing_error})" if allocator.backing_error else ""
            raise CapacityError(
                f"{tier.name} tier full{reason}: {n} slots of {block_bytes} bytes needed, "
                f"{free} free and no more evictable (the rest are {busy})"
            )
    except BaseException:
        for offset in slots:
            tier.give_back(offset, block_bytes)
        raise


async def _drain(
    tier: TierSlots,
    slab: int,
    victim: int,
    protected: Callable[[int], bool],
    evict: Callable[[list[int]], Awaitable[None]],
    budget: Callable[[], Callable[[int], bool]] | None = None,
) -> bool:
    """Empty one slab of another size class so it returns to the pool: the policy's
    ``victim`` is evicted, its neighbours moved where their class has room, else evicted.
    False if some block in it cannot go now (the slab is then left as it was)."""
    allocator = tier.allocator
    owners = [tier.owner_of(offset) for offset in allocator.used_offsets(slab)]
    if any(e is None or protected(e) for e in owners):
        return False
    if budget is not None:
        take = budget()
        if not all(take(e) for e in owners if e is not None):
            return False
    allocator.begin_drain(slab)
    try:
        rest = [e for e in owners if e is not None and (e == victim or not _moved(tier, e, slab))]
        if rest:
            await evict(rest)
    finally:
        if allocator.slab_info(slab).slot_bytes:  # still assigned: something stayed
            allocator.end_drain(slab)
    return not allocator.slab_info(slab).slot_bytes


def _moved(tier: TierSlots, eid: int, slab: int) -> bool:
    return tier.relocate is not None and tier.relocate(eid, slab)
