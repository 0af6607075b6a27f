"""The NVMe tier's scrub (``NvmeTier.check``): every slot of the carved slabs read back and
verified against what the tier holds, on the calling thread."""

from __future__ import annotations

import logging
import os
from collections.abc import Container

from kvstore.tiers.nvme import ondisk as fmt
from kvstore.tiers.nvme.alloc import SlotAllocator
from kvstore.tiers.nvme.ondisk import PAGE
from kvstore.tiers.nvme.recordio import RecordIO
from kvstore.tiers.nvme.records import (
    FREE_AFTER_WRITE,
    LIVE,
    WRITING,
    CheckProblem,
    RecordTable,
)
from kvstore.tiers.nvme.tombstones import Tombstones

log = logging.getLogger(__name__)


def scrub(
    io: RecordIO,
    alloc: SlotAllocator,
    tables: list[RecordTable | None],
    busy: Container[int],
    tomb_failed: Container[int],
    format_id: int,
) -> tuple[int, int, list[CheckProblem]]:
    """(slots checked, records intact, problems): a live slot's header and payload verified
    against its record, a free slot's header against being a record (an orphan, unless its
    tombstone failed and is known). Slots being written, and the ``busy`` ones (a tombstone in
    flight), are skipped."""
    problems: list[CheckProblem] = []
    checked = ok = 0
    buffers: dict[int, memoryview] = {}
    for slab in alloc.carved():
        table = tables[slab]
        assert table is not None
        for i, slot in enumerate(alloc.slots(slab)):
            state = table.state[i]
            if slot in busy or state & ~FREE_AFTER_WRITE == WRITING:
                continue
            checked += 1
            if state == LIVE:
                want = table.ident(i)
                out = buffers.get(want.length)
                if out is None:
                    out = buffers[want.length] = memoryview(bytearray(want.length))
                try:
                    reason, detail = io.read_record(slot, want, out), ""
                except OSError as exc:
                    reason, detail = "io_error", str(exc)
                if reason is None:
                    ok += 1
                else:
                    kind = "torn" if reason == "short" else reason
                    problems.append(CheckProblem(slot, kind, want.key, detail or reason))
                continue
            try:
                h = io.read_header(slot)
            except OSError as exc:
                problems.append(CheckProblem(slot, "io_error", None, str(exc)))
                continue
            fits = h is not None and fmt.header_fits(h, slot, alloc.slot_bytes_at(slot), format_id)
            if h is not None and fits and slot not in tomb_failed:
                problems.append(CheckProblem(slot, "orphan", h.key, f"seq {h.seq}"))
    return checked, ok, problems


def tombstone_orphans(
    io: RecordIO, alloc: SlotAllocator, tombs: Tombstones, problems: list[CheckProblem]
) -> None:
    """Tombstone every orphan of ``problems`` at once (a failure is left to ``tombs``, retried
    before the slot's reuse), then flush."""
    for p in problems:
        if p.kind == "orphan":
            pages = alloc.slot_bytes_at(p.slot) // PAGE
            try:
                io.write_at(p.slot, tombs.page(p.slot, pages))
            except OSError as exc:
                tombs.failed[p.slot] = pages
                log.warning("tombstone of orphan slot %d failed: %s", p.slot, exc)
    os.fdatasync(io.fd)
