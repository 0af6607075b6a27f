"""``Tombstones``: how the NVMe tier invalidates, on disk, the records it has freed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kvstore.keys import FINGERPRINT_BYTES, KEY_BYTES
from kvstore.tiers.nvme import ondisk as fmt
from kvstore.tiers.nvme.diskio import FlushBarrier
from kvstore.tiers.nvme.meta import WritePage
from kvstore.tiers.nvme.ondisk import CODEC_NONE, KIND_TOMBSTONE, Geometry, Header
from kvstore.tiers.nvme.records import SeqCounter

log = logging.getLogger(__name__)

WritePages = Callable[[list[tuple[int, bytearray]]], Awaitable[list[OSError | None]]]
"""Writes header pages at their offsets in one IO job: per page, None or its error."""


class Tombstones:
    """The tombstones of one open slab file. A tombstone is a header page of kind tombstone (a
    fresh sequence number) written over a freed record's header, so recovery does not bring the
    record back and an old header never describes a slot's next bytes (the tier's free rule).

    Owns the tombstones in flight (one task per slot; a slot freed again while its tombstone is
    in flight chains the next behind it), the free slots whose tombstone failed (their old
    header may still be valid: retried before the slot's next payload, and at close), and, per
    slab uncarved while tombstones of its old carving were in flight or had failed, those slots,
    settled before any payload of the slab's next carving is written. Loop-only; every
    tombstone is written by ``write_page`` and then flushed (``flush``); the tasks are handed to
    ``track`` (the tier's ``drain`` waits for them) and a failure counts in ``counters``.
    """

    def __init__(
        self,
        geometry: Geometry,
        format_id: int,
        seq: SeqCounter,
        write_page: WritePage,
        flush: FlushBarrier,
        track: Callable[[asyncio.Future[Any]], None],
        counters: dict[str, int],
        write_pages: WritePages | None = None,
    ) -> None:
        self.geometry = geometry
        self.format_id = format_id
        self.in_flight: dict[int, asyncio.Task[None]] = {}
        # Free slots whose header may still be valid (a tombstone failed), with the slot size
        # in pages of the carving they belong to.
        self.failed: dict[int, int] = {}
        # Slabs uncarved while tombstones of their old carving were in flight or had failed:
        # those slots, settled before any payload of the new carving is written.
        self._unsettled: dict[int, set[int]] = {}
        self._seq = seq
        self._write_page = write_page
        self._flush = flush
        self._track = track
        self._counters = counters
        # Tombstone pages asked for in one turn of the loop (an eviction frees many slots at
        # once) go to ``write_pages`` as one IO job: each still lands, or fails, on its own.
        self._write_pages = write_pages
        self._pending: list[tuple[int, bytearray, asyncio.Future[None]]] = []

    def start(self, slot: int, pages: int) -> None:
        """Tombstone ``slot``, ``pages`` long in its carving, in the background."""
        task = asyncio.ensure_future(self._tombstone(slot, pages, self.in_flight.get(slot)))
        self.in_flight[slot] = task
        self._track(task)

    def uncarving(self, slab: int) -> None:
        """``slab`` is being uncarved: its old carving's tombstones in flight or failed are to
        be settled (``settle_slab``) before the next carving writes a byte of it. A late
        tombstone must never land in the new carving's bytes, and an old header must never
        survive to describe them."""
        geo = self.geometry
        old = {s for s in (*self.in_flight, *self.failed) if geo.slab_of(s) == slab}
        if old:
            self._unsettled.setdefault(slab, set()).update(old)

    async def settle_slab(self, slab: int) -> None:
        """Before the first payload of a new carving: every tombstone of the slab's previous
        carving has landed (retried here if it failed; an OSError fails the caller's write and
        the next write retries). See ``uncarving``."""
        old = self._unsettled.get(slab)
        while old:
            slot = next(iter(old))
            await self.settle(slot)
            old.discard(slot)
        self._unsettled.pop(slab, None)

    async def settle(self, slot: int) -> None:
        """Make sure no valid old header is left in ``slot`` before new bytes go into it."""
        task = self.in_flight.get(slot)
        if task is not None:
            await asyncio.shield(task)
        pages = self.failed.get(slot)
        if pages is not None:
            await self.write(slot, pages)

    async def retry_failed(self) -> None:
        """Write every failed tombstone again (at close); one that fails again is logged."""
        for slot, pages in sorted(self.failed.items()):
            try:
                await self.write(slot, pages)
            except OSError as exc:
                log.warning("tombstone of slot %d failed at close: %s", slot, exc)

    async def _tombstone(self, slot: int, pages: int, previous: asyncio.Task[None] | None) -> None:
        if previous is not None:
            await asyncio.shield(previous)
        try:
            await self.write(slot, pages)
        except OSError as exc:
            self._counters["io_errors"] += 1
            log.warning("tombstone of slot %d failed; retried before reuse: %s", slot, exc)
        finally:
            if self.in_flight.get(slot) is asyncio.current_task():
                del self.in_flight[slot]

    async def write(self, slot: int, pages: int) -> None:
        """Write and flush one tombstone; until the flush returns the slot counts as failed."""
        self.failed[slot] = pages  # until the flush below returns
        page = self.page(slot, pages)
        await self._put_page(slot, page)
        await self._flush.barrier()
        self.failed.pop(slot, None)

    async def _put_page(self, slot: int, page: bytearray) -> None:
        """Write one tombstone page, in the same IO job as the others asked for in this turn
        of the loop."""
        if self._write_pages is None:
            await self._write_page(slot, page)
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._submit)
        self._pending.append((slot, page, done))
        await done

    def _submit(self) -> None:
        batch, self._pending = self._pending, []
        self._track(asyncio.ensure_future(self._write_batch(batch)))

    async def _write_batch(self, batch: list[tuple[int, bytearray, asyncio.Future[None]]]) -> None:
        assert self._write_pages is not None
        try:
            errors = await self._write_pages([(slot, page) for slot, page, _ in batch])
        except BaseException as exc:  # the job itself failed: so did every page of it
            for _, _, done in batch:
                if not done.done():
                    done.set_exception(exc if isinstance(exc, Exception) else OSError(str(exc)))
            if not isinstance(exc, Exception):
                raise
            return
        for (_, _, done), error in zip(batch, errors, strict=True):
            if done.done():  # its writer was cancelled
                continue
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

    def page(self, slot: int, pages: int) -> bytearray:
        """A tombstone header page for ``slot`` (it takes a sequence number)."""
        tomb = (KIND_TOMBSTONE, CODEC_NONE, pages, slot, self._seq.take(), self.format_id)
        return fmt.pack_header(Header(*tomb, bytes(KEY_BYTES), bytes(FINGERPRINT_BYTES), 0, 0, 0))
