"""``MetadataWriter``: the open slab file's metadata copies and slab descriptors, kept in step
with the tier's slot allocator."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from kvstore.tiers.nvme import ondisk as fmt
from kvstore.tiers.nvme.alloc import SlotAllocator
from kvstore.tiers.nvme.diskio import FlushBarrier
from kvstore.tiers.nvme.ondisk import Geometry
from kvstore.tiers.nvme.records import SeqCounter

WritePage = Callable[[int, bytes | bytearray], Awaitable[None]]
"""Writes whole pages at a file offset on the tier's write pool (``NvmeTier._write_page``)."""


class MetadataWriter:
    """What the open tier writes of its own metadata: the two metadata copies (geometry, format
    id, the next sequence number, the clean mark, the slab map) and each slab's descriptor.

    Owns the metadata lock, the generation on disk and which copy holds it, the allocator
    version the metadata on disk reflects, and the carving each slab's descriptor on disk says.
    A new generation goes into the copy that does not hold the current one, so a torn write
    leaves the current copy in force. Loop-only; made by ``NvmeTier.open`` from what it found
    in the file. Its pages are written by ``write_page``; the caller's barriers make them
    durable, except in ``repair``, which takes its own.
    """

    def __init__(
        self,
        geometry: Geometry,
        format_id: int,
        generation: int,
        descriptors: list[int],
        seq: SeqCounter,
        write_page: WritePage,
        flush: FlushBarrier,
    ) -> None:
        self.geometry = geometry
        self.format_id = format_id
        self.lock = asyncio.Lock()
        self._gen = generation
        self._copy = 0  # the copy (0: A, 1: B) that holds generation _gen
        self._version = -1  # the allocator version the metadata on disk reflects
        self._descriptors = list(descriptors)  # slot bytes each slab's descriptor on disk says
        self._seq = seq
        self._write_page = write_page
        self._flush = flush

    async def persist_carving(self, alloc: SlotAllocator, slab: int) -> None:
        """Make the slab's descriptor, and the metadata's slab map, say how the slab is carved
        now (before a record in it commits; the caller's barrier makes it durable)."""
        slot_bytes = alloc.slab_slot_bytes[slab]
        if self._descriptors[slab] == slot_bytes and self._version >= alloc.version:
            return
        async with self.lock:
            slot_bytes = alloc.slab_slot_bytes[slab]
            if self._descriptors[slab] != slot_bytes:
                await self._write_descriptor(slab, slot_bytes)
            if self._version < alloc.version:
                await self._write_locked(alloc, clean=False)

    async def write(self, alloc: SlotAllocator, *, clean: bool) -> None:
        """The next generation of the metadata (``clean``: the mark of a clean shutdown)."""
        async with self.lock:
            await self._write_locked(alloc, clean=clean)

    async def repair(self, alloc: SlotAllocator, meta_ok: list[bool]) -> None:
        """After recovery: rewrite every damaged descriptor of a carved slab, then both
        metadata copies, a damaged (or older) one first (``meta_ok``: whether copy A, B is valid
        and current), each behind a barrier, so that at every moment one valid copy is on disk.
        """
        async with self.lock:
            for slab in alloc.carved():
                slot_bytes = alloc.slab_slot_bytes[slab]
                if self._descriptors[slab] != slot_bytes:
                    await self._write_descriptor(slab, slot_bytes)
            # The first write goes to the copy that does not hold the current generation.
            self._copy = 0 if meta_ok[0] else 1
            for _ in range(2):
                await self._write_locked(alloc, clean=False)
                await self._flush.barrier()

    async def _write_descriptor(self, slab: int, slot_bytes: int) -> None:
        page = fmt.pack_slab_descriptor(
            self.geometry, self.format_id, slab, slot_bytes, self._seq.take()
        )
        await self._write_page(self.geometry.slab_start(slab), page)
        self._descriptors[slab] = slot_bytes

    async def _write_locked(self, alloc: SlotAllocator, *, clean: bool) -> None:
        """The next generation of the metadata, into the copy that does not hold the current
        one, so a torn write leaves the current copy in force."""
        version = alloc.version
        gen, copy = self._gen + 1, 1 - self._copy
        page = fmt.pack_meta(
            self.geometry, self.format_id, gen, self._seq.next, clean, alloc.slab_slot_bytes
        )
        await self._write_page(self.geometry.meta_offset(copy), page)
        self._gen, self._copy = gen, copy
        self._version = max(self._version, version)
