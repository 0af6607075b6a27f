"""The block index: (namespace, key) -> entry id, with each entry's fields in typed arrays.

One Python object per block would cost 300+ bytes at a million blocks (an object, a boxed
offset and checksum, an LRU node). Here an entry is a dict slot, the key bytes and ~34 bytes of
array fields (``benchmarks/bench_index_memory.py`` measures it; ``benchmarks/README.md`` has
the figures).

Entry life cycle (``state``):

    RESERVED --commit--> COMMITTED --delete/evict--> (freed)
     |                        \\--delete while leased--> ORPHAN --last release--> (freed)
     \\--abort/expire--> (freed)

Only COMMITTED entries are visible to lookups and reads. An ORPHAN has lost its key (a new put
of the same key makes a fresh entry) but keeps its slot until its last read lease is released.

Keys are indexed per namespace: the same 32 bytes in two namespaces are two entries. Keys are
seeded by the namespace, so honest clients never collide; a hostile one that computes another
namespace's keys (its identity is no secret) can then neither shadow nor pre-empt them.

Owned by the daemon's event loop; not thread-safe.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from enum import IntEnum
from operator import itemgetter
from types import MappingProxyType

_NO_IDS: Mapping[bytes, int] = MappingProxyType({})


class State(IntEnum):
    FREE = 0
    RESERVED = 1
    COMMITTED = 2
    ORPHAN = 3


# ``tier`` is a bit set: a committed block may have a copy in the CPU tier, on disk, or both
# (a clean CPU block has both; dropping its CPU copy then costs no write).
IN_CPU = 1
IN_NVME = 2
IN_REDIS = 4  # this host wrote it to the shared tier (Redis is not indexed: other hosts write it)
# In the GPU tier's device pool. Its slot and device checksum live with that tier (few blocks
# are there at once), not in these arrays, so the index stays small at millions of blocks.
IN_GPU = 8
# A copy in a tier below the GPU: a GPU block with one is clean (dropping it costs no copy).
BELOW_GPU = IN_CPU | IN_NVME


class BlockIndex:
    """Maps 32-byte keys to entry ids and holds per-entry fields. See the module docstring."""

    MAX_LEASES = 0xFFFFFFFF

    def __init__(self) -> None:
        self._ids: dict[int, dict[bytes, int]] = {}  # namespace id -> key -> entry id
        self._count = 0
        self._keys: list[bytes | None] = []
        self._free_ids: list[int] = []
        self.state = bytearray()
        self.tier = bytearray()
        self.priority = bytearray()
        self.ns = array("H")
        self.leases = array("I")
        self.offset = array("q")  # CPU arena offset, -1 when not in the CPU tier
        self.disk = array("q")  # NVMe slot, -1 when not on disk
        self.checksum = array("Q")

    def __len__(self) -> int:
        """Number of keyed entries (reserved or committed)."""
        return self._count

    @property
    def capacity(self) -> int:
        return len(self._keys)

    def get(self, ns: int, key: bytes) -> int | None:
        keys = self._ids.get(ns)
        return None if keys is None else keys.get(key)

    def ids_of(self, ns: int) -> Mapping[bytes, int]:
        """Key -> entry id of one namespace's keyed entries (read only; empty when none)."""
        return self._ids.get(ns, _NO_IDS)

    def entries_of(self, ns: int) -> int:
        """Keyed entries (reserved or committed) of one namespace."""
        keys = self._ids.get(ns)
        return 0 if keys is None else len(keys)

    def _unkey(self, eid: int) -> None:
        key = self._keys[eid]
        if key is not None:
            keys = self._ids[self.ns[eid]]
            del keys[key]
            if not keys:
                del self._ids[self.ns[eid]]
            self._keys[eid] = None
            self._count -= 1

    def key(self, eid: int) -> bytes:
        key = self._keys[eid]
        if key is None:
            raise AssertionError(f"entry {eid} has no key (state {State(self.state[eid]).name})")
        return key

    def add(
        self, key: bytes, ns: int, tier: int, offset: int, priority: int, disk: int = -1
    ) -> int:
        """A new RESERVED entry. The key must not be indexed in ``ns`` already."""
        keys = self._ids.setdefault(ns, {})
        if key in keys:
            raise AssertionError("key already indexed")
        if self._free_ids:
            eid = self._free_ids.pop()
            self._keys[eid] = key
            self.state[eid] = State.RESERVED
            self.tier[eid] = tier
            self.priority[eid] = priority
            self.ns[eid] = ns
            self.leases[eid] = 0
            self.offset[eid] = offset
            self.disk[eid] = disk
            self.checksum[eid] = 0
        else:
            eid = len(self._keys)
            self._keys.append(key)
            self.state.append(State.RESERVED)
            self.tier.append(tier)
            self.priority.append(priority)
            self.ns.append(ns)
            self.leases.append(0)
            self.offset.append(offset)
            self.disk.append(disk)
            self.checksum.append(0)
        keys[key] = eid
        self._count += 1
        return eid

    def add_many(
        self, keys: list[bytes], ns: int, tier: int, offsets: list[int], priority: int
    ) -> list[int]:
        """``add`` of each ``keys[j]`` at ``offsets[j]`` (the same tier and priority): their
        entry ids, in order. Neither in ``ns`` already nor repeated, or nothing is added."""
        if len(offsets) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(offsets)} offsets")
        ids = self._ids.setdefault(ns, {})
        if len(set(keys)) != len(keys) or not ids.keys().isdisjoint(keys):
            if not ids:
                del self._ids[ns]
            raise AssertionError("key already indexed")
        eids = self._new_entries(keys, ns, tier, offsets, priority)
        ids.update(zip(keys, eids, strict=True))
        self._count += len(eids)
        return eids

    def add_unkeyed_many(self, ns: int, tier: int, offsets: list[int], priority: int) -> list[int]:
        """RESERVED entries at ``offsets`` with no key yet (a spare slot's, which ``key_many``
        keys when a Bind names its key): their entry ids, in order. They are in no key map and
        not counted by ``len``. Keying them later only inserts into the namespace's key map;
        re-keying a placeholder key instead would leave a deleted slot behind in it each time,
        so the map would outgrow its keys: ~84 bytes a key against ~42 at a million keys."""
        return self._new_entries([None] * len(offsets), ns, tier, offsets, priority)

    def _new_entries(
        self,
        keys: Sequence[bytes | None],
        ns: int,
        tier: int,
        offsets: list[int],
        priority: int,
    ) -> list[int]:
        free, all_keys = self._free_ids, self._keys
        state, tiers, prio, nss = self.state, self.tier, self.priority, self.ns
        leases, offset_of, disk, checksum = self.leases, self.offset, self.disk, self.checksum
        eids = []
        for key, offset in zip(keys, offsets, strict=True):
            if free:
                eid = free.pop()
                all_keys[eid] = key
                state[eid] = State.RESERVED
                tiers[eid] = tier
                prio[eid] = priority
                nss[eid] = ns
                leases[eid] = 0
                offset_of[eid] = offset
                disk[eid] = -1
                checksum[eid] = 0
            else:
                eid = len(all_keys)
                all_keys.append(key)
                state.append(State.RESERVED)
                tiers.append(tier)
                prio.append(priority)
                nss.append(ns)
                leases.append(0)
                offset_of.append(offset)
                disk.append(-1)
                checksum.append(0)
            eids.append(eid)
        return eids

    def commit(self, eid: int, checksum: int) -> None:
        if self.state[eid] != State.RESERVED:
            raise AssertionError(f"commit of entry {eid} in state {State(self.state[eid]).name}")
        self.state[eid] = State.COMMITTED
        self.checksum[eid] = checksum

    def key_many(self, eids: list[int], keys: Sequence[bytes]) -> None:
        """Give each unkeyed RESERVED entry ``eids[j]`` (``add_unkeyed_many``) the key
        ``keys[j]`` of its namespace, one no entry has. All or nothing: AssertionError, with
        nothing keyed, if an entry is keyed or not RESERVED, or a key is indexed, or a key or an
        entry is named twice."""
        if len(eids) != len(keys):
            raise ValueError(f"{len(eids)} entries for {len(keys)} keys")
        if len(set(keys)) != len(keys) or len(set(eids)) != len(eids):
            raise AssertionError("key_many names a key or an entry twice")
        own, ns, state = self._keys, self.ns, self.state
        for eid, key in zip(eids, keys, strict=True):
            if own[eid] is not None or state[eid] != State.RESERVED:
                raise AssertionError(
                    f"key_many of entry {eid} (state {State(state[eid]).name}), which "
                    "is not an unkeyed reservation"
                )
            taken = self._ids.get(ns[eid], _NO_IDS).get(key)
            if taken is not None:
                raise AssertionError(f"key_many of entry {eid} to the key of entry {taken}")
        for eid, key in zip(eids, keys, strict=True):
            self._ids.setdefault(ns[eid], {})[key] = eid
            own[eid] = key
        self._count += len(eids)

    def orphan(self, eid: int) -> None:
        """Drop the key of a leased entry; the entry lives on until its last lease goes."""
        self._unkey(eid)
        self.state[eid] = State.ORPHAN

    def drop(self, eid: int) -> None:
        """Forget an entry entirely and recycle its id."""
        self.drop_many((eid,))

    def drop_many(self, eids: Sequence[int]) -> None:
        """``drop`` of each entry in order (an eviction's batch); a leased one raises with
        those before it dropped."""
        leases, state, free_ids, unkey, free = (
            self.leases,
            self.state,
            self._free_ids,
            self._unkey,
            State.FREE,
        )
        for eid in eids:
            if leases[eid]:
                raise AssertionError(f"drop of entry {eid} with {leases[eid]} leases")
            unkey(eid)
            state[eid] = free
            free_ids.append(eid)

    def is_keyed(self, eid: int) -> bool:
        """Whether entry ``eid`` has a key (a spare slot's entry has none until it is bound)."""
        return self._keys[eid] is not None

    def has_key(self, eid: int, ns: int, key: bytes) -> bool:
        """True if entry ``eid`` is, right now, the entry of ``key`` in namespace ``ns``."""
        return self._keys[eid] == key and self.ns[eid] == ns

    def keyed(self) -> list[int]:
        """Every keyed entry id (reserved or committed), for checkers."""
        return [e for keys in self._ids.values() for e in keys.values()]

    def add_lease(self, eid: int) -> None:
        if self.leases[eid] >= self.MAX_LEASES:
            raise OverflowError(f"entry {eid} has {self.MAX_LEASES} read leases")
        self.leases[eid] += 1

    def drop_lease(self, eid: int) -> int:
        if self.leases[eid] == 0:
            raise AssertionError(f"lease count of entry {eid} would go negative")
        self.leases[eid] -= 1
        return self.leases[eid]


def gather(field: bytearray, eids: list[int]) -> bytes:
    """``field[eid]`` of each entry, in order, gathered in C (``itemgetter`` of n > 1 indices
    gives a tuple: ~2.4x faster than ``bytes(map(field.__getitem__, eids))`` at 128)."""
    if len(eids) > 1:
        return bytes(itemgetter(*eids)(field))
    return bytes([field[eids[0]]]) if eids else b""
