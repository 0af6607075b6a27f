"""Exact simulations of frequency-aware eviction policies over a replayed trace, beside LRU.

The policies LMCache and vLLM offer or were built on: 2Q (Johnson and Shasha, VLDB'94),
ARC (Megiddo and Modha, FAST'03), S3-FIFO (Yang et al., SOSP'23), and a plain LFU (the naive
frequency policy, ties broken by recency). Each is a block cache of a fixed number of blocks
with the replay's semantics (``_trace_sim.simulate``): a request reads the leading run of its
blocks that the cache holds (each a use), then puts the blocks after it that the cache lacks
(room made first); a stored block further along is left alone (kvstore's put deduplicates it
without a use). Ghost entries (ARC's B1/B2, 2Q's A1out, S3-FIFO's ghost queue) hold keys only
and are never hits.

Written from the papers' descriptions, block for block, to compare hit rates; not the store's
code.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence

from _trace_sim import Chain, SimResult, leading_run, sim_result


class _Cache:
    def __contains__(self, key: bytes) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def use(self, key: bytes) -> None:
        """A held block was read."""
        raise NotImplementedError

    def insert(self, key: bytes) -> None:
        """A block the cache lacks is put (the cache makes room for it itself)."""
        raise NotImplementedError


class TwoQ(_Cache):
    """Full 2Q: new blocks enter a FIFO ``A1in`` (a quarter of the blocks); evicted from it,
    their keys go to a ghost FIFO ``A1out`` (half the capacity); a block put again while its
    key is there goes to the LRU ``Am``. A read of a block in ``A1in`` does not move it."""

    def __init__(self, capacity: int, kin: float = 0.25, kout: float = 0.5) -> None:
        self.capacity = capacity
        self.kin = max(1, int(capacity * kin))
        self.kout = max(1, int(capacity * kout))
        self.a1in: OrderedDict[bytes, None] = OrderedDict()
        self.a1out: OrderedDict[bytes, None] = OrderedDict()
        self.am: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.am or key in self.a1in

    def __len__(self) -> int:
        return len(self.am) + len(self.a1in)

    def use(self, key: bytes) -> None:
        if key in self.am:
            self.am.move_to_end(key)

    def _reclaim(self) -> None:
        if len(self.a1in) > self.kin or not self.am:
            old, _ = self.a1in.popitem(last=False)
            self.a1out[old] = None
            if len(self.a1out) > self.kout:
                self.a1out.popitem(last=False)
        else:
            self.am.popitem(last=False)

    def insert(self, key: bytes) -> None:
        if len(self) >= self.capacity:
            self._reclaim()
        if key in self.a1out:
            del self.a1out[key]
            self.am[key] = None
        else:
            self.a1in[key] = None


class Arc(_Cache):
    """ARC: ``T1`` (seen once recently) and ``T2`` (seen at least twice) share the capacity,
    their split ``p`` adapted by hits in the ghost lists ``B1`` and ``B2``."""

    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.p = 0.0
        self.t1: OrderedDict[bytes, None] = OrderedDict()
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def use(self, key: bytes) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            del self.t2[key]
        self.t2[key] = None

    def _replace(self, in_b2: bool) -> None:
        if self.t1 and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p)):
            old, _ = self.t1.popitem(last=False)
            self.b1[old] = None
        else:
            old, _ = self.t2.popitem(last=False)
            self.b2[old] = None

    def insert(self, key: bytes) -> None:
        c = self.c
        if key in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1.0))
            self._replace(False)
            del self.b1[key]
            self.t2[key] = None
            return
        if key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            self._replace(True)
            del self.b2[key]
            self.t2[key] = None
            return
        l1 = len(self.t1) + len(self.b1)
        if l1 == c:
            if len(self.t1) < c:
                self.b1.popitem(last=False)
                self._replace(False)
            else:
                self.t1.popitem(last=False)
        elif l1 < c:
            total = l1 + len(self.t2) + len(self.b2)
            if total >= c:
                if total == 2 * c:
                    self.b2.popitem(last=False)
                self._replace(False)
        self.t1[key] = None


class S3Fifo(_Cache):
    """S3-FIFO: new blocks enter a small FIFO (a tenth of the blocks); leaving it, a block read
    since it came in moves to the main FIFO, any other leaves its key in a ghost FIFO (as many
    keys as the main FIFO holds blocks), and a block put again while its key is there enters
    the main FIFO. The main FIFO reinserts a block read since its last pass (its count, at most
    3, lowered by one) instead of evicting it."""

    def __init__(self, capacity: int, small: float = 0.1) -> None:
        self.capacity = capacity
        self.small_cap = max(1, int(capacity * small))
        self.small: OrderedDict[bytes, None] = OrderedDict()
        self.main: OrderedDict[bytes, None] = OrderedDict()
        self.ghost: OrderedDict[bytes, None] = OrderedDict()
        self.freq: dict[bytes, int] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self.freq

    def __len__(self) -> int:
        return len(self.freq)

    def use(self, key: bytes) -> None:
        self.freq[key] = min(self.freq[key] + 1, 3)

    def _evict_small(self) -> None:
        old, _ = self.small.popitem(last=False)
        if self.freq[old] > 0:
            self.freq[old] = 0
            self.main[old] = None
            if len(self.main) > self.capacity - self.small_cap:
                self._evict_main()
        else:
            del self.freq[old]
            self.ghost[old] = None
            if len(self.ghost) > self.capacity - self.small_cap:
                self.ghost.popitem(last=False)

    def _evict_main(self) -> None:
        while True:
            old, _ = self.main.popitem(last=False)
            if self.freq[old] > 0:
                self.freq[old] -= 1
                self.main[old] = None
            else:
                del self.freq[old]
                return

    def insert(self, key: bytes) -> None:
        while len(self.freq) >= self.capacity:
            if len(self.small) >= self.small_cap or not self.main:
                self._evict_small()
            else:
                self._evict_main()
        self.freq[key] = 0
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None


class Lfu(_Cache):
    """Plain LFU: evict the block read the fewest times, the least recently used among
    those (a heap with lazy deletion)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.count: dict[bytes, tuple[int, int]] = {}  # key -> (reads, last use tick)
        self.heap: list[tuple[int, int, bytes]] = []
        self.tick = itertools.count()

    def __contains__(self, key: bytes) -> bool:
        return key in self.count

    def __len__(self) -> int:
        return len(self.count)

    def use(self, key: bytes) -> None:
        reads = self.count[key][0] + 1
        entry = (reads, next(self.tick))
        self.count[key] = entry
        heapq.heappush(self.heap, (*entry, key))

    def insert(self, key: bytes) -> None:
        while len(self.count) >= self.capacity:
            reads, tick, old = heapq.heappop(self.heap)
            if self.count.get(old) == (reads, tick):
                del self.count[old]
        entry = (0, next(self.tick))
        self.count[key] = entry
        heapq.heappush(self.heap, (*entry, key))


POLICIES: dict[str, Callable[[int], _Cache]] = {
    "2q": TwoQ,
    "arc": Arc,
    "s3fifo": S3Fifo,
    "lfu": Lfu,
}
"""Name -> cache of that many blocks."""


def simulate_policy(chains: Sequence[Chain], capacity_blocks: int, policy: str) -> SimResult:
    """Replay ``chains`` through ``POLICIES[policy]`` of ``capacity_blocks`` blocks."""
    cache = POLICIES[policy](capacity_blocks)
    per_hits, per_blocks = [], []
    for chain in chains:
        keys = chain.keys
        m = leading_run(keys, cache)
        for k in keys[:m]:
            cache.use(k)
        for k in keys[m:]:
            if k not in cache:
                cache.insert(k)
        if len(cache) > capacity_blocks:
            raise AssertionError(f"{policy} holds {len(cache)} of {capacity_blocks} blocks")
        per_hits.append(m)
        per_blocks.append(len(keys))
    return sim_result(policy, capacity_blocks, per_hits, per_blocks, len(cache))
