"""The presence books: each namespace's presence table (``kvstore.presence``), kept in step
with the ledger's transitions.

The ledger (``kvstore.daemon.ledger``) calls these as blocks are committed, moved, evicted and
written: a committed key is added with its CPU copy's *place* (arena address plus one) and
checksum, a copy that moves is located anew, a key forgotten is removed, and the count of keys
being written is published so a client's get that misses asks the daemon while any is. A table
is made when a same-host client first asks for it and kept from then on; one that cannot be
kept (a rebuild out of memory or descriptors) is dropped, its clients call, and it is made
afresh when next asked for. Event-loop only, like the ledger.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import compress
from typing import cast

import numpy as np

from kvstore.daemon.cpu_tier import CpuSlots
from kvstore.daemon.namespaces import NamespaceRecord
from kvstore.index import IN_CPU, BlockIndex, State, gather
from kvstore.presence import PresenceTable, fingerprints

log = logging.getLogger(__name__)


class PresenceBooks:
    """See the module docstring."""

    def __init__(self, index: BlockIndex, cpu_slots: CpuSlots) -> None:
        self.index = index
        self.cpu_slots = cpu_slots

    def table(self, record: NamespaceRecord) -> PresenceTable:
        """The presence table of namespace ``record``, made from its committed keys (and their
        CPU copies' places) when first asked for; kept from then on."""
        if record.presence is None:
            # In C but for the places (~50 ms per million keys, places apart): a namespace
            # recovered from a large NVMe tier is first asked for on the event loop.
            ids = self.index.ids_of(record.ns_id)
            eids = list(ids.values())
            states = np.frombuffer(gather(self.index.state, eids), np.uint8)
            committed = states == State.COMMITTED
            fps = fingerprints(b"".join(ids))[committed]
            places, sums = self.places_of(record, list(compress(eids, committed.tolist())))
            record.presence = PresenceTable.of_fingerprints(
                fps,
                None if places is None else np.array(places, dtype=np.uint64),
                None if sums is None else np.array(sums, dtype=np.uint64),
            )
            record.presence.set_writing(record.writing)
        return cast(PresenceTable, record.presence)

    def places_of(
        self, record: NamespaceRecord, eids: Sequence[int]
    ) -> tuple[list[int] | None, list[int] | None]:
        """(places, checksums) of ``record``'s entries ``eids`` in its presence table: each
        CPU copy's address plus one and that copy's checksum, a place 0 for an entry with no
        CPU copy; (None, None), no places at all, where a client cannot read the copies itself
        (fp8 payloads, which only a lease's decode reads)."""
        if record.cpu_codec:
            return None, None
        index = self.index
        tier, offset, checksum = index.tier, index.offset, index.checksum
        offsets = [offset[e] if tier[e] & IN_CPU else -1 for e in eids]
        places = [a + 1 if a >= 0 else 0 for a in self.cpu_slots.arena.addresses(offsets)]
        return places, [checksum[e] for e in eids]

    def locate(self, record: NamespaceRecord, eid: int) -> None:
        """Tell ``eid``'s table where its CPU copy now is (or that it has none)."""
        if record.presence is not None and self.index.state[eid] == State.COMMITTED:
            places, sums = self.places_of(record, (eid,))
            place, checksum = (places[0], sums[0]) if places and sums else (0, 0)
            record.presence.locate(self.index.key(eid), place, checksum)

    def unlocate(self, record: NamespaceRecord, eid: int) -> None:
        """``eid``'s CPU copy is about to leave its slot: readers of the table ask from now
        on (before the slot can go to another block)."""
        if record.presence is not None and self.index.state[eid] == State.COMMITTED:
            places, _ = self.places_of(record, (eid,))
            if places:
                record.presence.unlocate(self.index.key(eid), places[0])

    def note_writing(self, record: NamespaceRecord, change: int) -> None:
        """``change`` more (or fewer) of ``record``'s keys are being written, as its table
        tells clients: a get that misses while any is asks the daemon, which waits for the
        commit (``PresenceLink.places``)."""
        record.writing += change
        if record.presence is not None:
            record.presence.set_writing(record.writing)

    def add(self, record: NamespaceRecord, eids: Sequence[int]) -> None:
        """Note ``eids`` committed in ``record``'s table, if it has one. Never raises into a
        commit: a table that cannot be kept is retired, so its clients call."""
        table = record.presence
        if table is None:
            return
        try:
            places, sums = self.places_of(record, eids)
            record.presence = table.add_many(map(self.index.key, eids), places, sums)
        except Exception:
            log.exception("presence table of %s dropped", record.name)
            table.retire()
            record.presence = None
