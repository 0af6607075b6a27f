"""Puts that do not wait for their reply: ``put(keys, blocks, wait=False)``.

A put copies its blocks into the arena and then waits for the daemon to key and commit them
(``Bind``, or ``Commit`` after a ``Reserve``): a round trip plus the daemon's work, several
times the copy for small blocks. An engine that offloads as it computes needs only to know
that the bytes left its buffer. A put with ``wait=False`` returns once they are in shared
memory and the call that commits them is sent; the client reads that call's reply later:

- at its next put: once that put has copied its blocks into spare slots it holds already
  (the copy overlaps the daemon's work on this one), or first, when it needs the slots this
  reply grants; at ``flush()`` or ``close()``;
- before a ``get``, ``lookup`` or ``load`` of this client that names one of the keys, so a
  client always reads its own writes. Any call it makes is served after the put's, in order.

Other clients see the blocks once the daemon has served that call (``flush()`` waits for it).
What the reply says is kept here until ``flush()`` hands it over: how many blocks were newly
stored, how many were dropped (their spare slots reclaimed before the call came, or the daemon
restarted: as if evicted at once), and the first error, which ``flush()`` raises.

One put is in flight at a time: the next settles it first (and a put another asyncio task
sent meanwhile, before it becomes the one in flight; a put cancelled while it waits for that
reply was sent, so it is queued behind it for ``flush``). Not thread-safe, as the client.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

from kvstore.client._common import PutCount
from kvstore.client.session import SessionBroken
from kvstore.client.spare_slots import SpareSlots
from kvstore.client.steps import Op, Settle
from kvstore.errors import KVStoreError, LeaseExpiredError, UnknownNamespaceError
from kvstore.keys import unpack_keys

log = logging.getLogger(__name__)


@dataclass
class PostedPut:
    """A put whose committing call (``method``) was sent and not yet answered."""

    token: Any  # the face's handle on the call in flight (``core.Settle`` takes it)
    method: str  # "Bind" or "Commit"
    packed: bytes  # its keys, packed
    handle: bytes  # the namespace handle the call named
    sent_at: float  # monotonic: when its request was built (spare slots are fresh from it)
    blocks: int  # blocks it sent to be committed
    taken: list[tuple[int, float, bytes]] = field(default_factory=list)  # Bind: its slots

    @functools.cached_property
    def keys(self) -> frozenset[bytes]:
        return frozenset(unpack_keys(self.packed))

    def touches(self, packed: bytes) -> bool:
        """Whether any of the packed keys ``packed`` is one of this put's."""
        return not self.keys.isdisjoint(unpack_keys(packed))


class PostedPuts:
    """The put in flight, if any, and what the settled ones said since the last ``flush``."""

    def __init__(self) -> None:
        self.current: PostedPut | None = None
        # Puts sent while another was in flight whose sender stopped waiting to settle it
        # (cancelled): each is the one in flight in turn, in the order sent.
        self.queued: list[PostedPut] = []
        self.stored = 0  # blocks newly stored
        self.pending = 0  # keys another client was still writing when a Bind stopped waiting
        self.dropped = 0  # blocks not stored: slots reclaimed, or the daemon restarted
        self.error: KVStoreError | None = None  # the first error a settled put met

    def touches(self, packed: bytes) -> bool:
        """Whether a put in flight names one of the packed keys ``packed``."""
        current = self.current
        return current is not None and current.touches(packed)

    def before_read(self, packed: bytes) -> bool:
        """Whether a read of the packed keys ``packed`` must settle the put in flight first:
        it names one of them (read your own writes), or it is a ``Commit``, whose reserved
        keys make the presence table send every read that misses to the daemon meanwhile
        (``writing``): waiting for its reply costs less than that call."""
        current = self.current
        return current is not None and (current.method == "Commit" or current.touches(packed))

    def record(self, posted: PostedPut, reply: Any, spare: SpareSlots) -> None:
        """Take ``posted``'s outcome: its reply, or the ``KVStoreError`` it met; the spare
        slots it named or was granted go back to ``spare``. The next put queued, if any, is
        the one in flight then."""
        self.current = self.queued.pop(0) if self.queued else None
        if isinstance(reply, UnknownNamespaceError | SessionBroken):  # the daemon restarted
            spare.clear()
            self.dropped += posted.blocks
        elif isinstance(reply, LeaseExpiredError):
            spare.clear()  # reclaimed: ask anew
            if posted.method == "Bind":  # a waiting put would put through Reserve instead
                self.dropped += posted.blocks
            else:
                self.failed(reply, posted.blocks)  # as a waiting put's commit raises
        elif isinstance(reply, KVStoreError):
            self.failed(reply, posted.blocks)
        else:
            fresh_s, sent_at, handle = reply.spare_fresh_s, posted.sent_at, posted.handle
            if posted.method == "Bind":
                self.pending += int(reply.pending)
                spare.settle_bind(posted.taken, list(reply.spare), fresh_s, sent_at, handle)
            else:
                spare.give(list(reply.spare), fresh_s, sent_at, handle)
            self.stored += int(reply.committed)

    def failed(self, exc: KVStoreError, blocks: int) -> None:
        self.dropped += blocks
        if self.error is None:
            self.error = exc

    def drain(self) -> tuple[int, int, int]:
        """(stored, pending, dropped) since the last drain; the first error met meanwhile is
        raised (once: the counts go with it)."""
        stored, pending, dropped, error = self.stored, self.pending, self.dropped, self.error
        self.stored = self.pending = self.dropped = 0
        self.error = None
        if error is not None:
            raise error
        return stored, pending, dropped


class SettlesPuts:
    """The client's steps that read the reply to the put in flight (``ClientCore``'s)."""

    _posted: PostedPuts
    _spare: SpareSlots

    def _settle(self) -> Op[None]:
        """Read the reply to the put that did not wait, if one is in flight, and keep what it
        says for ``flush`` (``kvstore.client.posted_puts``)."""
        posted = self._posted.current
        if posted is None:
            return
        try:
            reply = yield Settle(posted.token)
        except KVStoreError as exc:
            reply = exc
        if self._posted.current is posted:  # else another task settled it (asyncio)
            self._posted.record(posted, reply, self._spare)

    def _in_flight(self, posted: PostedPut) -> Op[None]:
        """``posted`` is the put in flight now. Another task's put sent just before it
        (asyncio: concurrent calls on one client) is settled first, in the order sent: one
        put's reply is never dropped for another's."""
        try:
            while self._posted.current is not None:
                yield from self._settle()
        except BaseException:  # cancelled: this put was sent, and its reply is read in turn
            if self._posted.current is None:
                self._posted.current = posted
            else:
                self._posted.queued.append(posted)
            raise
        self._posted.current = posted

    def _settle_at_close(self) -> Op[None]:
        """``close``: the put in flight is served first; an error of a put made with
        ``wait=False`` that no ``flush`` reported is logged, as ``close`` raises nothing."""
        yield from self._settle_queued()
        error, self._posted.error = self._posted.error, None
        if error is not None:
            log.warning("a put made with wait=False failed, and no flush reported it: %s", error)

    def _settle_queued(self) -> Op[None]:
        """Settle the put in flight and those queued behind it (not puts sent later)."""
        for _ in range(1 + len(self._posted.queued)):
            yield from self._settle()

    def _flush(self) -> Op[PutCount]:
        yield from self._settle_queued()
        stored, pending, dropped = self._posted.drain()
        return PutCount(stored, pending, dropped)
