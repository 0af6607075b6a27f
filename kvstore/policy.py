"""Eviction policies: which block goes when a tier is full. A policy knows nothing of bytes.

A policy tracks entry ids (small ints handed out by the block index) and answers one narrow,
all-or-nothing question: ``evict(n, protected) -> list[int] | None``, the ``n`` ids to evict
next, skipping ids for which ``protected(id)`` is true (leased, being written, of another slot
size), or None when fewer than ``n`` can go. It does not remove them: the caller frees the
blocks and then calls ``remove``.

Every access is reported as a batch in prefix order (``touch([k0, k1, ...])``), which lets the
prefix-aware policy put the tail of a chain ahead of its head in the eviction order.

Policies are looked up by name in ``POLICIES``. Owned by the daemon's event loop; not
thread-safe; every call is O(1) per id except ``evict``, which walks from the cold end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Iterator, Sequence

_NIL = -1


class LinkedQueue:
    """An intrusive doubly linked list of entry ids kept in two int arrays (8 bytes per id).

    Order: the head is the coldest id (evicted first), the tail the hottest. Only this class
    touches ``_prev``/``_next``; an id is in at most one queue of a policy at a time.
    """

    def __init__(self) -> None:
        self._prev = array("i")
        self._next = array("i")
        self._member = bytearray()
        self.head = _NIL
        self.tail = _NIL
        self.size = 0

    def _grow(self, eid: int) -> None:
        if eid >= len(self._prev):
            extra = max(eid + 1 - len(self._prev), len(self._prev), 1024)
            self._prev.extend([_NIL] * extra)
            self._next.extend([_NIL] * extra)
            self._member.extend(bytes(extra))

    def __contains__(self, eid: int) -> bool:
        return eid < len(self._member) and self._member[eid] == 1

    def push_tail(self, eid: int) -> None:
        self._grow(eid)
        if self._member[eid]:
            raise AssertionError(f"entry {eid} is already queued")
        self._member[eid] = 1
        self._prev[eid] = self.tail
        self._next[eid] = _NIL
        if self.tail == _NIL:
            self.head = eid
        else:
            self._next[self.tail] = eid
        self.tail = eid
        self.size += 1

    def push_tail_many(self, eids: Sequence[int]) -> None:
        """``push_tail`` of each id in order (none queued yet, none repeated)."""
        if not eids:
            return
        self._grow(max(eids))
        member, prev, nxt = self._member, self._prev, self._next
        if len(set(eids)) != len(eids) or any(member[e] for e in eids):
            raise AssertionError("an entry is already queued")
        tail = self.tail
        for eid in eids:
            member[eid] = 1
            prev[eid] = tail
            if tail == _NIL:
                self.head = eid
            else:
                nxt[tail] = eid
            tail = eid
        nxt[tail] = _NIL
        self.tail = tail
        self.size += len(eids)

    def unlink(self, eid: int) -> None:
        self.unlink_many((eid,))

    def unlink_many(self, eids: Sequence[int]) -> None:
        """``unlink`` of each id in order (an eviction's batch); one that is not queued
        raises with those before it unlinked."""
        member, prev_of, next_of = self._member, self._prev, self._next
        n = len(member)
        for eid in eids:
            if not (eid < n and member[eid] == 1):
                raise AssertionError(f"entry {eid} is not queued")
            prev, nxt = prev_of[eid], next_of[eid]
            if prev == _NIL:
                self.head = nxt
            else:
                next_of[prev] = nxt
            if nxt == _NIL:
                self.tail = prev
            else:
                prev_of[nxt] = prev
            member[eid] = 0
            self.size -= 1

    def move_to_tail(self, eid: int) -> None:
        if eid != self.tail:
            self.unlink(eid)
            self.push_tail(eid)

    def __iter__(self) -> Iterator[int]:
        """Coldest first."""
        eid = self.head
        while eid != _NIL:
            nxt = self._next[eid]
            yield eid
            eid = nxt


class EvictionPolicy(ABC):
    """Chooses victims among the ids it tracks. See the module docstring for the contract."""

    @abstractmethod
    def insert(self, eid: int, priority: int = 0) -> None: ...

    @abstractmethod
    def remove(self, eid: int) -> None: ...

    def remove_many(self, eids: Sequence[int]) -> None:
        """``remove`` of each id (an eviction's batch); a policy may do it in one pass."""
        for eid in eids:
            self.remove(eid)

    @abstractmethod
    def touch(self, eids: Sequence[int]) -> None: ...

    def insert_touched(self, eids: Sequence[int], priorities: Sequence[int]) -> None:
        """New ids just written, as one batch: ``insert`` of each, then ``touch(eids)``. The
        policies below do it in one pass over the batch."""
        for eid, priority in zip(eids, priorities, strict=True):
            self.insert(eid, priority)
        self.touch(eids)

    @abstractmethod
    def order(self) -> Iterator[int]:
        """Every tracked id, the first to evict first."""

    @abstractmethod
    def __len__(self) -> int: ...

    def evict(self, n: int, protected: Callable[[int], bool]) -> list[int] | None:
        if n <= 0:
            return []
        victims: list[int] = []
        for eid in self.order():
            if not protected(eid):
                victims.append(eid)
                if len(victims) == n:
                    return victims
        return None


class LruPolicy(EvictionPolicy):
    """Least recently used first. A batch is touched in order, so its last key is the hottest."""

    def __init__(self) -> None:
        self._queue = LinkedQueue()

    def insert(self, eid: int, priority: int = 0) -> None:
        self._queue.push_tail(eid)

    def remove(self, eid: int) -> None:
        self._queue.unlink(eid)

    def remove_many(self, eids: Sequence[int]) -> None:
        self._queue.unlink_many(eids)

    def touch(self, eids: Sequence[int]) -> None:
        for eid in eids:
            self._queue.move_to_tail(eid)

    def insert_touched(self, eids: Sequence[int], priorities: Sequence[int]) -> None:
        # Inserting puts each new id at the tail and touching moves each to the tail again:
        # they end at the tail in touch order, which is where one push each puts them.
        self._queue.push_tail_many(self._touch_order(eids))

    def _touch_order(self, eids: Sequence[int]) -> Sequence[int]:
        return eids

    def order(self) -> Iterator[int]:
        return iter(self._queue)

    def __len__(self) -> int:
        return self._queue.size


class PrefixAwareLruPolicy(LruPolicy):
    """LRU in which the blocks extending a prefix go before the prefix itself.

    A batch arrives in prefix order; touching it in reverse makes its first block the hottest, so
    when a chain goes cold its tail is evicted first and the shared head (a system prompt) stays.
    """

    def touch(self, eids: Sequence[int]) -> None:
        for eid in reversed(eids):
            self._queue.move_to_tail(eid)

    def _touch_order(self, eids: Sequence[int]) -> Sequence[int]:
        return eids[::-1]


class PriorityLruPolicy(EvictionPolicy):
    """Lowest priority first, LRU within a priority (a system prompt pinned high goes last).

    Priorities are small non-negative ints; each has its own prefix-aware LRU queue.
    """

    MAX_PRIORITY = 255

    def __init__(self) -> None:
        self._queues: dict[int, LinkedQueue] = {}
        self._priority = bytearray()

    def insert(self, eid: int, priority: int = 0) -> None:
        if not 0 <= priority <= self.MAX_PRIORITY:
            raise ValueError(f"priority must be in [0, {self.MAX_PRIORITY}], got {priority}")
        if eid >= len(self._priority):
            self._priority.extend(bytes(max(eid + 1 - len(self._priority), 1024)))
        self._priority[eid] = priority
        queue = self._queues.get(priority)
        if queue is None:
            queue = self._queues[priority] = LinkedQueue()
        queue.push_tail(eid)

    def remove(self, eid: int) -> None:
        self._queues[self._priority[eid]].unlink(eid)

    def insert_touched(self, eids: Sequence[int], priorities: Sequence[int]) -> None:
        if len(set(priorities)) != 1 or len(priorities) != len(eids):  # several queues
            super().insert_touched(eids, priorities)
            return
        priority = priorities[0]
        if not 0 <= priority <= self.MAX_PRIORITY:
            raise ValueError(f"priority must be in [0, {self.MAX_PRIORITY}], got {priority}")
        top = max(eids)
        if top >= len(self._priority):
            self._priority.extend(bytes(max(top + 1 - len(self._priority), 1024)))
        queue = self._queues.get(priority)
        if queue is None:
            queue = self._queues[priority] = LinkedQueue()
        queue.push_tail_many(eids[::-1])  # as ``touch``: the batch's first id hottest
        for eid in eids:
            self._priority[eid] = priority

    def touch(self, eids: Sequence[int]) -> None:
        for eid in reversed(eids):
            self._queues[self._priority[eid]].move_to_tail(eid)

    def order(self) -> Iterator[int]:
        for priority in sorted(self._queues):
            yield from self._queues[priority]

    def __len__(self) -> int:
        return sum(q.size for q in self._queues.values())


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LruPolicy,
    "prefix": PrefixAwareLruPolicy,
    "priority": PriorityLruPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
