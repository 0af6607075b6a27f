"""A same-host client's view of its namespace's presence table (``kvstore.presence``): lookups
answered from shared memory, with no call, wherever the answer is the one the daemon would give.

The table comes over the session socket on the first lookup after a handle is opened, and again
when the daemon retires it (it grew, or was rebuilt). A lookup goes to the daemon instead when:

- the client has no table (the bytes path, an old daemon, ``KVSTORE_PRESENCE_TABLES=0``);
- the session connection has something to read: the daemon closed it (stopped, restarted), so
  the call finds out and reopens, and a table frozen by a dead daemon is never trusted;
- an asyncio call of the session is in flight (asking for a table would block the event loop
  behind it), or the lookup is larger than a local call may be (the daemon's bounds decide);
- a key is not in the table and the daemon may still find it: in the Redis tier, or because
  the table could not hold every key (``overflow``);
- no lookup went to the daemon for ``FLUSH_S``: at most one a second is the daemon's, and it
  carries the tally of those the client answered (and the releases of leases the client is
  done with: while a client keeps looking up, a get's blocks stay pinned a second at most;
  one that goes idle keeps them until its next call or their lease ends, as before), so
  the namespace's hit counts include them within about a second; a client that looks up
  less often than that always calls. The tally also says how many of the keys found had a
  CPU copy (a place), which is how the daemon splits them between its CPU and NVMe tiers.

A ``get`` reads its leading blocks itself, with no call, where the table gives each a place
(its block's CPU copy, ``PresenceView.places``) and every copy verifies against the checksum
bound to its key. Where the run ends at a key the table does not hold, and the table is the
whole answer (as for a lookup's miss, and no key of the namespace being written: the daemon's
Acquire would wait for that commit), the get makes no call at all; otherwise (a key held
without a place, a copy that does not verify) it calls, for the keys from the first one the
table could not serve. The same conditions as a lookup's hold, with their own clock: the keys
read since the last call that carried them ride on the next ``Acquire``, ``Reserve`` or
``Bind`` (``table_reads``, before that call evicts anything), at least one a second and at
most ``MAX_TABLE_READS`` keys later, so the daemon's eviction policy sees them as read.
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple

from kvstore import local_calls
from kvstore.client.session import ClientSession
from kvstore.errors import KVStoreError
from kvstore.keys import unpack_keys
from kvstore.presence import PresenceView
from kvstore.v1 import kvstore_pb2 as pb

LOOKUP_METHOD = local_calls.METHOD_INDEX["Lookup"]

MAX_KEYS_BYTES = local_calls.MAX_REQUEST_BYTES - local_calls.REQUEST.size - 64
"""Larger lookups go to the daemon, as they would over a local call (~2000 keys)."""
FLUSH_S = 1.0
"""A lookup (a get) goes to the daemon when none did for this long (seconds)."""
MAX_TABLE_READS = 1024
"""Keys read from the table that one Acquire carries (each once): a get calls rather than
leave more waiting."""


class Tally(NamedTuple):
    """Lookups answered from the table: keys asked, leading keys found, and of those, the keys
    whose block had a CPU copy (``LookupRequest.table_keys``, ``table_found``,
    ``table_in_cpu``)."""

    keys: int
    found: int
    in_cpu: int


class Placed(NamedTuple):
    """Where a get finds its leading blocks in the arena (``PresenceLink.places``)."""

    addresses: list[int]
    sums: list[int]  # each block's checksum, bound to its key
    whole: bool  # the daemon would serve no more of the keys asked


class PresenceLink:
    """The table of one client's current handle, and the lookups it answered; see the module
    docstring. Not thread-safe (as ``ClientCore``)."""

    def __init__(self) -> None:
        self._view: PresenceView | None = None
        self._refused = False  # the daemon keeps no table for this handle: do not ask again
        self._ask_on_miss = True
        self._keys = 0
        self._found = 0
        self._in_cpu = 0
        self._called = 0.0  # monotonic time of the last lookup sent to the daemon
        self._read_called = 0.0  # the same, of the last acquire
        self._reads: dict[bytes, None] = {}  # keys of the blocks read from the table
        self.answered = 0
        """Lookups answered from the table over the client's life (for benchmarks and tests)."""
        self.served = 0
        """Gets served from the table's places over the client's life (the same)."""

    def reset(self) -> None:
        """A new handle (an open or reopen): its namespace's table is asked for afresh."""
        self.close()
        self._refused = False
        self._reads.clear()  # another daemon's (or namespace's) blocks

    def close(self) -> None:
        if self._view is not None:
            self._view.close()
            self._view = None

    def _view_for(
        self, session: ClientSession, handle: bytes, packed: bytes, since: float
    ) -> PresenceView | None:
        """The table to answer from now, or None: call (module docstring). ``since``: the
        monotonic time of the last call of the kind asked for."""
        if not session.presence_tables or self._refused or session.busy():
            return None
        if len(packed) > MAX_KEYS_BYTES:
            return None  # the daemon's bounds decide (``limits.max_keys_per_request``)
        if time.monotonic() - since > FLUSH_S:
            return None  # this one is the daemon's: it carries the tally and samples the tiers
        view = self._view
        if view is None or view.retired:
            view = self._map(session, handle)
            if view is None:
                return None
        if not session.quiet():
            return None
        return view

    def lookup(
        self, session: ClientSession, handle: bytes, packed: bytes, count: int
    ) -> int | None:
        """Leading keys of ``packed`` (``count`` 32-byte keys) committed, or None: call."""
        view = self._view_for(session, handle, packed, self._called)
        if view is None:
            return None
        found, in_cpu = view.leading_in_cpu(packed)
        if found < count and (self._ask_on_miss or view.overflow or view.retired):
            # Retired during the probe (rebuilt by a commit): its freed pages read as EMPTY,
            # so a miss may be wrong; a hit never is.
            return None
        self._keys += count
        self._found += found
        self._in_cpu += in_cpu
        self.answered += 1
        return found

    def places(
        self, session: ClientSession, handle: bytes, packed: bytes, count: int
    ) -> Placed | None:
        """The places of the blocks of the leading keys of ``packed`` (``count`` 32-byte
        keys), for a get to copy and verify itself; None: call for them all.

        ``whole`` when the daemon would serve no more than these: every key has a place, or
        the run ends at a key the table does not hold and the table is the whole answer (no
        ``overflow``, nothing only the daemon can find: ``ask_on_miss``, and no key being
        written, whose commit the daemon's Acquire would wait for). A get then needs no
        call at all, the misses included. A run that ends at a key the table holds without a
        place (an NVMe-only block) is not whole: the rest goes to the daemon."""
        if len(self._reads) + count > MAX_TABLE_READS:
            return None  # this one carries them
        view = self._view_for(session, handle, packed, self._read_called)
        if view is None:
            return None
        # Before the probe: a commit during it adds its key, then counts it written, so a key
        # being written when the probe began is seen either in the table or here.
        writing = view.writing
        addresses, sums, held = view.places(packed)
        n = len(addresses)
        # After the probe: retired during it, its freed pages read as EMPTY, so a miss may be
        # wrong (and a key being written is one the daemon would wait for: ``writing``).
        whole = n == count or (
            held == n and not (self._ask_on_miss or writing or view.overflow or view.retired)
        )
        if not n and not whole:
            return None
        return Placed(addresses, sums, whole)

    def note_read(self, packed: bytes) -> None:
        """A get read the blocks of these keys (packed) from their places."""
        if packed:
            self._reads.update(dict.fromkeys(unpack_keys(packed)))
            self.served += 1

    def take_reads(self) -> bytes:
        """The keys read from the table since the last acquire (packed, each once); the
        caller's acquire carries them now."""
        self._read_called = time.monotonic()
        reads = b"".join(self._reads)
        self._reads.clear()
        return reads

    def take_tally(self) -> Tally:
        """The lookups answered since the last call that carried them; the caller sends them
        now."""
        self._called = time.monotonic()
        tally = Tally(self._keys, self._found, self._in_cpu)
        self._keys = self._found = self._in_cpu = 0
        return tally

    def tally_call(
        self, session: ClientSession | None, handle: bytes, timeout_s: float
    ) -> tuple[ClientSession, int, bytes, float] | None:
        """(session, method, request, timeout) of a local ``Lookup`` of no keys carrying the
        tally of lookups answered from the table, for a client to send before its handle
        closes (best effort: a failed one is not retried), so the daemon counts them. None
        when there is nothing to count or no local call to send it with."""
        tally = self.take_tally()
        if not tally.keys or session is None or not session.calls or not handle:
            return None
        request = pb.LookupRequest(
            handle=handle,
            table_keys=tally.keys,
            table_found=tally.found,
            table_in_cpu=tally.in_cpu,
        )
        return session, LOOKUP_METHOD, request.SerializeToString(), min(timeout_s, 1.0)

    def _map(self, session: ClientSession, handle: bytes) -> PresenceView | None:
        self.close()
        try:
            fd, self._ask_on_miss = session.presence(handle)
        except KVStoreError:  # an old daemon, a closed handle, a broken session: calls say
            self._refused = True
            return None
        try:
            self._view = PresenceView(fd)
        except (OSError, ValueError):
            self._refused = True
            return None
        finally:
            os.close(fd)
        return self._view
