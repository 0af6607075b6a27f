"""The contract every daemon tier keeps: the GPU pool (``device.DeviceTier``), the CPU tier
(``cpu_room.CpuRoom``), NVMe (``movement.Mover``) and the shared Redis tier
(``shared.SharedTier``).

*Up* is toward the engine, *down* away from it. The CPU tier is the hub: every block a client
reads or writes through shared memory passes through it. So each other tier moves blocks across
its own edge with the CPU tier (the GPU tier between the pool and the CPU tier, the NVMe and
Redis tiers between the CPU tier and themselves), and the CPU tier moves them across the edge
below it, through the tier it is handed. A tier copies bytes and reports what landed to the
ledger, which records it (the only writer of block state); it never receives the store and
never imports another tier: what it needs of one is passed in.

The primitives, in pairs:

``start`` / ``stop``
    ``start`` opens what the tier needs (the slab file, the Redis connection, the copy stream)
    and starts its background work; a tier that is not configured starts as a no-op and stays
    disabled (``enabled`` False). ``stop`` ends the background work and waits for the copies
    in flight; what must outlive the daemon goes down first (dirty GPU blocks to the CPU tier,
    dirty CPU blocks to disk, within ``drain_timeout``).

``move_up`` / ``move_down``
    ``move_up`` copies blocks one level up and returns the leading run of them now there: the
    run stops at the first block that did not land (corrupt, gone meanwhile, no room).
    ``move_down`` copies blocks one level down, keeping the copy above, and returns how many of
    them (each block once, however often it is named) have the copy below afterwards. Both are
    idempotent: a block already there counts, a block on its way is waited for, never copied
    twice. Every copy is verified against the block's checksum, bound to its key and namespace;
    one that fails is a miss, counted, never data. Blocks are named by entry id, except going up
    from a tier this host does not index (Redis, shared by every host): those are named by key
    (``KeyRun``) and become entries as they land.

``holds`` / ``drop``
    ``holds`` says whether the tier has a copy of an entry. ``drop`` removes the tier's copies
    of entries that are stored elsewhere too and not in use (leased, or moving), and returns
    how many went; a block's only copy is never dropped (that is eviction, which forgets the
    block). The shared tier drops nothing: its values are every host's, and go by TTL or by
    Redis's own eviction.

``counters`` / ``snapshot``
    ``counters`` are the tier's running totals (hits, misses, promotions, demotions, evictions,
    checksum failures); ``snapshot`` is its occupancy now (capacity, used bytes, blocks) with
    those counters, what Stats, the metrics and the CLI show; None while the tier is off.

Every primitive runs on the daemon's one event loop; a transition is made whole between two
awaits, so no tier takes a lock.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from kvstore.index import State

if TYPE_CHECKING:
    from kvstore.daemon.namespaces import NamespaceRecord
    from kvstore.daemon.tierstats import TierCounters, TierSnapshot
    from kvstore.index import BlockIndex

Blocks = TypeVar("Blocks", contravariant=True)


@dataclass(frozen=True, slots=True)
class KeyRun:
    """Blocks named by key: a run of ``keys`` of ``record``'s namespace, in prefix order."""

    record: NamespaceRecord
    keys: list[bytes]


@runtime_checkable
class Tier(Protocol[Blocks]):
    """See the module docstring. ``Blocks``: how ``move_up`` names its blocks (entry ids, or a
    ``KeyRun`` for a tier this host does not index)."""

    name: str

    @property
    def enabled(self) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def move_up(self, blocks: Blocks, /) -> list[int]: ...

    async def move_down(self, eids: list[int], /) -> int: ...

    def holds(self, eid: int, /) -> bool: ...

    def drop(self, eids: list[int], /) -> int: ...

    @property
    def counters(self) -> TierCounters: ...

    def snapshot(self) -> TierSnapshot | None: ...


# What the tiers' primitives report, read from the index the same way by every tier (``bit``:
# the tier's ``IN_*`` bit of ``index.tier``).
def leading_in(index: BlockIndex, eids: Sequence[int], bit: int) -> list[int]:
    """The leading run of ``eids`` committed with a copy in the tier of ``bit`` (``move_up``)."""
    state, tier = index.state, index.tier
    for i, e in enumerate(eids):
        if state[e] != State.COMMITTED or not tier[e] & bit:
            return list(eids[:i])
    return list(eids)


def count_in(index: BlockIndex, eids: Sequence[int], bit: int) -> int:
    """How many of ``eids``, each once, are committed with a copy in the tier of ``bit``
    (``move_down``)."""
    state, tier = index.state, index.tier
    return sum(1 for e in dict.fromkeys(eids) if state[e] == State.COMMITTED and tier[e] & bit)


def droppable(
    index: BlockIndex, eids: Sequence[int], bit: int, elsewhere: int, busy: Container[int]
) -> list[int]:
    """The entries of ``eids``, each once, whose copy in the tier of ``bit`` may go (``drop``):
    committed, with a copy in a tier of ``elsewhere`` too, unleased, and not in ``busy`` (the
    tier's copies in flight)."""
    state, tier, leases = index.state, index.tier, index.leases
    return [
        e
        for e in dict.fromkeys(eids)
        if state[e] == State.COMMITTED
        and tier[e] & bit
        and tier[e] & elsewhere
        and not leases[e]
        and e not in busy
    ]
