"""The prefetcher every promoting tier shares: a prefix's blocks brought up ahead of the read
that wants them, in prefix order.

A prefetch is a hint (``Prefetch``, ``acquire(prefetch=True)``): it queues the leading run of
the keys asked, each block once however often a client asks for its run, and a task promotes
them window by window, head first, so the head of the prefix is ready first. Each queued block
is checked again, against the key it was queued for, when its window comes (an entry deleted
meanwhile may hold another namespace's block by then), and the task stops at the first window
that does not all come up: past a block that could not, the prefix is of no use.

The NVMe tier promotes disk-only blocks into the CPU tier (``Mover``); the GPU tier promotes
CPU blocks into the pool (``DeviceTier``). They say which blocks they want, how large a window
is, and how to promote one; the queueing and the order are here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from kvstore.index import State

if TYPE_CHECKING:
    from kvstore.daemon.ledger import Ledger


class Prefetcher:
    """See the module docstring. ``wanted(eid)``: the tier would promote this block now (not
    there already, not on its way); ``promote(eids)``: promote a window, True when every block
    of it came up; ``spawn``: runs a task the tier stops with itself. Event-loop only."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        window: int,
        wanted: Callable[[int], bool],
        promote: Callable[[list[int]], Awaitable[bool]],
        spawn: Callable[[Coroutine[Any, Any, None]], Any],
    ) -> None:
        self.ledger = ledger
        self.window = max(1, window)
        self.wanted = wanted
        self.promote = promote
        self.spawn = spawn
        # Blocks queued and not reached yet, with the (namespace, key) they were queued for.
        self.queued: dict[int, tuple[int, bytes]] = {}

    def queue(self, ns_id: int, keys: Sequence[bytes]) -> int:
        """Queue the leading run of ``keys``; returns how many blocks were queued (those an
        earlier prefetch queued and has not reached are not queued again)."""
        index = self.ledger.index
        run = self.ledger.leading_run(ns_id, keys)
        queued = self.queued
        todo = [
            (e, index.key(e))
            for e in dict.fromkeys(run)  # a key asked twice is one block
            if self.wanted(e) and queued.get(e) != (ns_id, index.key(e))
        ]
        if todo:
            for e, key in todo:
                queued[e] = (ns_id, key)
            self.spawn(self._run(ns_id, todo))
        return len(todo)

    def _unqueue(self, ns_id: int, part: list[tuple[int, bytes]]) -> None:
        for e, key in part:
            if self.queued.get(e) == (ns_id, key):
                del self.queued[e]

    async def _run(self, ns_id: int, run: list[tuple[int, bytes]]) -> None:
        i = 0
        try:
            for i in range(0, len(run), self.window):
                part = run[i : i + self.window]
                self._unqueue(ns_id, part)
                index = self.ledger.index
                batch = [
                    e
                    for e, key in part
                    if index.has_key(e, ns_id, key)
                    and index.state[e] == State.COMMITTED
                    and self.wanted(e)
                ]
                if batch and not await self.promote(batch):
                    return
        finally:
            self._unqueue(ns_id, run[i:])  # the windows not reached (a miss, a cancel)
