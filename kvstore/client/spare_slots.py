"""Spare slots: arena slots the daemon reserved ahead for a client's next puts.

A put through a reservation is two calls: ``Reserve`` names the slots, ``Commit`` binds the
checksums of what was copied into them. For small blocks those two calls cost more than the
copy. A client that keeps putting asks, in each commit, for the slots its next put will need
(``spare_wanted``); that put copies its blocks into them and sends one call, ``Bind``, which
gives each slot its key and commits it, and asks for the next ones again.

Why this is safe:
- the daemon holds spare slots as reservations of this handle, of entries with no key until
  a Bind gives them theirs: no reader can see them, and a Bind naming a slot that is not this
  handle's spare slot is refused with nothing stored;
- the daemon reclaims unbound ones soon (``BlockStore.spare_ttl_s``) and tells how long the
  client may still write into them (``spare_fresh_s``, half that, counted from when the
  request was sent); a slot past it is dropped here unwritten. Slots reclaimed, and those of a
  handle that closed (its client may still copy into them before its next call tells it),
  are quarantined as any expired reservation's;
- a put takes its slots out of this pool under a lock: puts of several threads or tasks never
  share a slot; and only slots granted to the handle it presents (a Bind names that handle, so
  the daemon checks them against its own grants, never a reopened handle's);
- a copy that stalls past the window (the process descheduled mid-copy) lands, at worst, in a
  slot quarantined for as long again after it expired, and past that, in another block, which
  then fails its checksum: a miss, never wrong bytes.

A put that does not wait asks for a second put's worth more (``spare_ahead``), granted from
free slots only: the put after it copies into slots it holds before it reads this put's reply.

A client asks only while it keeps putting (its previous put less than ``STREAMING_S`` ago): a
single put asks for nothing, and the slots a run of puts leaves unused expire within
``pin_grace_s`` (then stay quarantined as long again).
"""

from __future__ import annotations

import threading
import time

STREAMING_S = 1.0
"""A put this soon after the previous one asks for spare slots for the next."""


class SpareSlots:
    """The spare slots this client holds: each with the handle it was granted to and the time
    it may be written until. Slots of another handle than the one a put presents (granted
    before a reopen: the daemon restarted, or the handle's stream dropped and the daemon
    quarantined them) are never handed out."""

    def __init__(self) -> None:
        self._slots: list[tuple[int, float, bytes]] = []  # (address, until: monotonic, handle)
        self._last_put = -float("inf")
        self._lock = threading.Lock()
        self.binds = 0  # puts that went in one call (Bind)
        self.clears = 0  # times every slot was forgotten (``clear``)

    def take(self, n: int, handle: bytes) -> list[tuple[int, float, bytes]] | None:
        """``n`` slots of ``handle`` still fresh for a put to copy into (its own, from now on);
        None when fewer are held (then none are taken). Others are dropped."""
        now = time.monotonic()
        with self._lock:
            fresh = [s for s in self._slots if s[1] > now and s[2] == handle]
            if len(fresh) < n:
                self._slots = fresh
                return None
            self._slots = fresh[n:]
            return fresh[:n]

    def wanted(self, n: int, handle: bytes, ahead: bool = False) -> tuple[int, int]:
        """How many spare slots to ask for beside a put of ``n`` new blocks: enough for a next
        put like it, while puts keep coming; else none. And with ``ahead`` (a put that does not
        wait), as many more for the put after it, which the daemon grants from free slots
        only: that put then copies its blocks before it reads this one's reply, while the
        daemon binds this one."""
        now = time.monotonic()
        with self._lock:
            streaming = now - self._last_put < STREAMING_S
            self._last_put = now
            if not streaming:
                return 0, 0
            held = sum(1 for s in self._slots if s[1] > now and s[2] == handle)
        wanted = max(0, n - held)
        return wanted, (max(0, 2 * n - held - wanted) if ahead else 0)

    def give(self, addresses: list[int], fresh_s: float, sent_at: float, handle: bytes) -> None:
        """Slots a reply to ``handle``'s call granted, writable for ``fresh_s`` from
        ``sent_at`` (when its request was sent: the daemon's clock started no earlier)."""
        if addresses and fresh_s > 0:
            until = sent_at + fresh_s
            with self._lock:
                self._slots.extend((a, until, handle) for a in addresses)

    def give_back(self, slots: list[tuple[int, float, bytes]]) -> None:
        """Slots a Bind named but did not bind: still spare, and as fresh as they were."""
        if slots:
            with self._lock:
                self._slots.extend(slots)

    def settle_bind(
        self,
        taken: list[tuple[int, float, bytes]],
        spare: list[int],
        fresh_s: float,
        sent_at: float,
        handle: bytes,
    ) -> None:
        """Take a Bind's reply: ``spare`` names the slots of ``taken`` it did not bind (keys
        already stored: still spare, as fresh as they were), then those newly granted."""
        if spare:
            mine = {slot[0]: slot for slot in taken}
            self.give_back([mine[a] for a in spare if a in mine])
            self.give([a for a in spare if a not in mine], fresh_s, sent_at, handle)
        self.binds += 1

    def clear(self) -> None:
        """Forget every slot (the daemon refused one, or restarted)."""
        with self._lock:
            self._slots = []
            self.clears += 1


def stale(slots: list[tuple[int, float, bytes]]) -> bool:
    """Whether any of ``slots`` (taken by a put) is past the time it may be written until."""
    now = time.monotonic()
    return any(until <= now for _, until, _ in slots)
