"""Open-time reading of the slab file (blocking, thread side): what the file holds
(``inspect``) and which record headers its carved slabs hold (``scan_headers``).

Sources of truth, in order: a slab's own descriptor says how it is carved; where a descriptor is
damaged, the newest valid metadata copy's slab map says it; when both metadata copies are
damaged, the descriptors rebuild them (format id included). Only headers that fit their slot
(``ondisk.header_fits``) are taken, so a stale or wrong carving loses records, never misreads
them. Nothing here writes.
"""

from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass, field

from kvstore.tiers.nvme import ondisk as fmt
from kvstore.tiers.nvme.diskio import ScratchBuffers, pread_full
from kvstore.tiers.nvme.ondisk import FORMAT_VERSION, HEADER_BYTES, PAGE, Geometry, describe_size
from kvstore.tiers.nvme.records import NvmeFormatError

log = logging.getLogger(__name__)
_scratch = ScratchBuffers()


@dataclass
class Found:
    """What ``inspect`` found in a file laid out for a geometry. ``format_id`` 0: nothing of
    this format to recover (the file is empty, blank, or of an older format: ``old_version``)."""

    size: int
    format_id: int = 0
    old_version: int | None = None
    generation: int = 0
    next_seq: int = 1
    clean: bool = False
    slab_map: list[int] = field(default_factory=list)
    """Slot bytes per slab (0: not carved), each from its descriptor or else from the metadata."""
    descriptors: list[int] = field(default_factory=list)
    """Slot bytes each slab's valid descriptor on disk says; -1 where none is valid."""
    meta_ok: list[bool] = field(default_factory=lambda: [False, False])
    """Whether metadata copy A, B is valid and current (the newest generation)."""
    damage: list[tuple[int, str]] = field(default_factory=list)
    """(offset, what) of every piece of damaged metadata: for the log and for ``check``."""


def _read(fd: int, n: int, offset: int) -> memoryview:
    buf = _scratch.get(n)[:n]
    got = pread_full(fd, [buf], offset)
    return buf[:got]


def _read_meta(fd: int, offset: int) -> fmt.Meta | None:
    page = _read(fd, PAGE, offset)
    if page.nbytes < PAGE:
        return None
    # Its header is not checksummed until the whole copy is read: a damaged page count
    # (up to 4 GiB) must not become a read (and a buffer) of that size. What its checksum
    # needs, as its slab count says, and never past the file's end.
    n = min(fmt.meta_length(page), fmt.meta_checked_bytes(page), os.fstat(fd).st_size - offset)
    return fmt.parse_meta(bytes(_read(fd, n, offset))) if n > 0 else None


def _mismatch(path: str, file_cap: int, file_slab: int, geo: Geometry) -> NvmeFormatError:
    return NvmeFormatError(
        f"{path} holds a tier of {describe_size(file_cap)} in {describe_size(file_slab)} slabs, "
        f"not the {describe_size(geo.capacity_bytes)} in {describe_size(geo.slab_bytes)} slabs "
        f"configured: configure the file's size to use it, or delete the file to start an empty "
        f"tier of the new size"
    )


MAX_META_SCAN = 1 << 28
"""Bytes searched for metadata copy B when copy A is damaged and B is not where either copy A's
header or the configured geometry puts it (a copy is at most ~64 MiB: a 1 TiB tier of 64 KiB
slabs; the first slab descriptor follows the two copies)."""


def _find_copy_b(fd: int, page0: bytes, geo: Geometry, size: int) -> tuple[fmt.Meta | None, bool]:
    """(metadata copy B, whether the file may hold records) of a file whose copy A is
    damaged. B starts where A ends: where A's header says if it still reads, else where the
    configured geometry puts it, else at the first page past A that starts like a copy (A's
    own pages after its first never do: they hold page counts and zeros). The search also
    notes any page that starts like a slab descriptor or a record: a tier that has stored
    blocks, which must never be taken for a blank file. Damaged metadata alone is no such
    sign (a first format cut short, an empty tier): that file is formatted again."""
    candidates = [n for n in (fmt.meta_length(page0), geo.meta_bytes) if n]
    for offset in dict.fromkeys(candidates):
        meta = _read_meta(fd, offset)
        if meta is not None:
            return meta, True
    ours = False
    chunk = 1 << 20
    for start in range(PAGE, min(size, MAX_META_SCAN), chunk):
        buf = bytes(_read(fd, min(chunk, size - start), start))
        for at in range(0, len(buf) - PAGE + 1, PAGE):
            head = buf[at : at + 8]
            if fmt.starts_meta(head):
                meta = _read_meta(fd, start + at)
                if meta is not None:
                    return meta, True
            ours = ours or fmt.starts_slab_or_record(head)
    return None, ours


def inspect(fd: int, geo: Geometry, path: str) -> Found:
    """Read the metadata copies and slab descriptors. Raises NvmeFormatError for a file of
    another geometry or of a newer format (never reformat those: the caller's setting is wrong,
    or the software is older than the file)."""
    size = os.fstat(fd).st_size
    found = Found(size)
    if size == 0:
        return found
    page0 = bytes(_read(fd, PAGE, 0))
    meta_a = _read_meta(fd, 0)
    ours = True  # a valid copy A says so
    if meta_a is not None:
        meta_b = _read_meta(fd, meta_a.meta_pages * PAGE)  # copy B starts where A ends
    else:
        meta_b, ours = _find_copy_b(fd, page0, geo, size)
    metas = [m for m in (meta_a, meta_b) if m is not None]
    best = max(metas, key=lambda m: m.generation) if metas else None
    if best is not None:
        if best.version != FORMAT_VERSION:
            raise NvmeFormatError(
                f"{path} is of format version {best.version}; this kvstore reads version "
                f"{FORMAT_VERSION}"
            )
        if not best.geometry_matches(geo):
            raise _mismatch(path, best.capacity_bytes, best.slab_bytes, geo)
    elif (version := fmt.old_superblock_version(page0)) is not None:
        found.old_version = version
        return found
    descriptors: list[fmt.SlabDescriptor | None] = []
    for slab in range(len(geo.slab_sizes)):
        start = geo.slab_start(slab)
        page = _read(fd, PAGE, start) if start + PAGE <= size else memoryview(b"")
        descriptors.append(fmt.parse_slab_descriptor(page) if page.nbytes == PAGE else None)
    if best is None:
        mine = [d for d in descriptors if d is not None and d.version == FORMAT_VERSION]
        for d in mine:
            if (d.capacity_bytes, d.slab_bytes) != (geo.capacity_bytes, geo.slab_bytes):
                raise _mismatch(path, d.capacity_bytes, d.slab_bytes, geo)
        if not mine and ours:
            # Slabs or records that nothing at the configured geometry vouches for: a tier of
            # another capacity or slab size whose metadata is damaged, or one whose every copy
            # and descriptor is. Never reformatted: a typo must not wipe a tier.
            raise NvmeFormatError(
                f"{path} holds a tier whose metadata cannot be read and no slab descriptor of "
                f"the configured {describe_size(geo.capacity_bytes)} in "
                f"{describe_size(geo.slab_bytes)} slabs: not reformatted. Configure the size "
                f"the file was made with, or delete the file to start an empty tier"
            )
        if not mine:
            return found  # nothing of this format: a blank or foreign file
        votes = collections.Counter(d.format_id for d in mine)
        found.format_id = votes.most_common(1)[0][0]
        found.damage.append((0, "both metadata copies damaged: rebuilt from the slab descriptors"))
    else:
        found.format_id, found.generation = best.format_id, best.generation
        found.next_seq, found.clean = best.next_seq, best.clean
        for copy, m in enumerate((meta_a, meta_b)):
            found.meta_ok[copy] = m is not None and (m.format_id, m.generation) == (
                best.format_id,
                best.generation,
            )
            if m is None:
                found.damage.append((geo.meta_offset(copy), f"metadata copy {'AB'[copy]} damaged"))
    for slab, desc in enumerate(descriptors):
        fallback = 0
        if best is not None and slab < len(best.slab_slot_bytes):
            fallback = best.slab_slot_bytes[slab]
            # A carving no slab of this geometry can have (checksum or not): not one.
            if fallback and not PAGE < fallback <= geo.slab_sizes[slab] - PAGE:
                found.damage.append((geo.slab_start(slab), f"slab {slab}: impossible carving"))
                fallback = 0
        if desc is not None and fmt.descriptor_fits(desc, geo, slab, found.format_id):
            found.descriptors.append(desc.slot_bytes)
            found.slab_map.append(desc.slot_bytes)
            continue
        found.descriptors.append(-1)
        found.slab_map.append(fallback)
        if fallback:
            what = f"slab {slab}: descriptor damaged, carving taken from the metadata copy"
            found.damage.append((geo.slab_start(slab), what))
    if size < geo.capacity_bytes:
        what = f"file truncated to {describe_size(size)}: records past its end are lost"
        found.damage.append((size, what))
    return found


def scan_headers(fd: int, slots: list[int]) -> bytearray:
    """The HEADER_BYTES prefix of each slot's header page, concatenated (zeros where the page
    could not be read: no valid header)."""
    scratch = _scratch.get(PAGE)
    page, n = scratch[:PAGE], HEADER_BYTES
    out = bytearray(len(slots) * n)
    for j, slot in enumerate(slots):
        try:
            if pread_full(fd, [page], slot) == PAGE:
                out[j * n : (j + 1) * n] = scratch[:n]
        except OSError as exc:  # an unreadable header loses its record, not the tier
            log.warning("header of slot %d unreadable at recovery: %s", slot, exc)
    return out
