"""Block events: which tiers hold each block of a namespace, told to the clients that watch it.

A KV-aware router (llm-d, Dynamo) learns where prefixes live from block events. The ledger,
the one writer of block state, tells this feed each time a committed block's set of tiers
changes (a commit, a copy landed in a tier, a copy dropped, an eviction from the last tier, a
delete): ``note`` records the block's new tier bits (``kvstore.index.IN_*``; 0 = gone) for
every watcher of its namespace. Events are states, not deltas: a block that changes twice
before its watcher reads is told once, with its latest tiers, so a watcher that applies them in
order ends with the daemon's picture.

Bounds: each watcher queues at most ``limit`` distinct blocks. One that falls behind (a slow
reader: gRPC flow control stops its stream) loses its queue and is told so: its next batch is
a *reset*, a fresh snapshot of the namespace, never a picture with holes. A watch starts with
such a snapshot too. Event-loop only, like the ledger.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from kvstore.errors import CapacityError

WATCH_QUEUE_BLOCKS = 65536
"""Blocks a watcher may have queued before it is reset (each costs a dict slot: ~100 bytes)."""

MAX_WATCHERS = 256
"""Watches open at once, every client together (each may hold a queue of the size above)."""


class Watcher:
    """One client's watch of one namespace. ``batch`` hands out what changed since the last
    batch; ``wait`` waits until there is something."""

    __slots__ = ("_wake", "changes", "closed", "limit", "ns_id", "owner", "resets", "stale", "who")

    def __init__(self, ns_id: int, owner: object, who: str, limit: int) -> None:
        self.ns_id = ns_id
        self.owner = owner  # the namespace handle it watches through: it ends with it
        self.who = who  # the caller (``auth.caller_key``), for the per-caller bound
        self.limit = limit
        self.changes: dict[bytes, int] = {}  # key -> its tier bits now, oldest change first
        self.stale = True  # the next batch must be a snapshot (it starts with one)
        self.resets = 0  # times it fell behind (the first snapshot is not one)
        self.closed = False
        self._wake = asyncio.Event()
        self._wake.set()

    def note(self, key: bytes, tiers: int) -> None:
        if self.stale:
            return  # a snapshot comes next: it will carry this
        changes = self.changes
        changes.pop(key, None)  # to the end: the order of the last changes is kept
        changes[key] = tiers
        if len(changes) > self.limit:
            changes.clear()
            self.stale = True
            self.resets += 1
        self._wake.set()

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    async def wait(self) -> None:
        await self._wake.wait()

    def take(
        self, snapshot: Callable[[int], list[tuple[bytes, int]]]
    ) -> tuple[bool, list[tuple[bytes, int]]]:
        """(reset, changes): a snapshot of the namespace (``snapshot(ns_id)``) if the watcher
        is stale, else the changes queued since the last call, oldest first."""
        self._wake.clear()
        if self.stale:
            self.stale = False
            self.changes.clear()
            return True, snapshot(self.ns_id)
        changes, self.changes = self.changes, {}
        return False, list(changes.items())


class BlockEventFeed:
    """The watchers of each namespace; the ledger's ``note`` calls reach them."""

    def __init__(self, limit: int = WATCH_QUEUE_BLOCKS, max_watchers: int = MAX_WATCHERS) -> None:
        self.limit = limit
        self.max_watchers = max_watchers
        self.watched: dict[int, list[Watcher]] = {}
        """Namespace id -> its watchers; empty when nobody watches (the ledger then skips the
        events at the cost of one dict truth test)."""
        self._count = 0
        self._of_caller: dict[str, int] = {}

    def watch(self, ns_id: int, owner: object, who: str) -> Watcher:
        """A new watch of namespace ``ns_id`` through handle ``owner`` by caller ``who``. One
        caller may hold at most a quarter of the daemon's watches, so it cannot lock the others
        out."""
        if self._count >= self.max_watchers:
            raise CapacityError(
                f"{self._count} block watches are open, the most this daemon keeps "
                f"({self.max_watchers}): close one first"
            )
        held = self._of_caller.get(who, 0)
        if held >= max(1, self.max_watchers // 4):
            raise CapacityError(
                f"{who} holds {held} block watches, a quarter of the {self.max_watchers} this "
                "daemon keeps: close some first"
            )
        watcher = Watcher(ns_id, owner, who, self.limit)
        self.watched.setdefault(ns_id, []).append(watcher)
        self._count += 1
        self._of_caller[who] = held + 1
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        watcher.close()
        watchers = self.watched.get(watcher.ns_id)
        if watchers is None or watcher not in watchers:
            return
        watchers.remove(watcher)
        self._count -= 1
        left = self._of_caller.pop(watcher.who, 1) - 1
        if left:
            self._of_caller[watcher.who] = left
        if not watchers:
            del self.watched[watcher.ns_id]

    def note(self, ns_id: int, key: bytes, tiers: int) -> None:
        for watcher in self.watched.get(ns_id, ()):
            watcher.note(key, tiers)

    def note_many(self, ns_id: int, items: Iterable[tuple[bytes, int]]) -> None:
        watchers = self.watched.get(ns_id)
        if not watchers:
            return
        items = list(items)
        for watcher in watchers:
            for key, tiers in items:
                watcher.note(key, tiers)

    def close_owner(self, owner: object) -> None:
        """The handle ``owner`` closed: the watches made through it end."""
        for watchers in list(self.watched.values()):
            for watcher in [w for w in watchers if w.owner is owner]:
                self.unwatch(watcher)

    def close(self) -> None:
        for watchers in list(self.watched.values()):
            for watcher in list(watchers):
                self.unwatch(watcher)
