"""The NVMe tier's on-disk format (version 3): layout, metadata copies, slab descriptors, record
headers.

Integers are little-endian; every region is 4096-aligned; the file is ``capacity_bytes`` long
and preallocated, so the bytes the tier counts are the bytes it holds.

* Two metadata copies (A at offset 0, B right after it), each ``meta_pages`` long: magic,
  version, a random format id, the geometry (capacity, slab size, data start, meta pages), then
  the state: generation, a sequence-number hint, the clean-shutdown flag and, per slab, the slot
  size it is carved into (0: not carved), then xxh3-64 of all of it. Writes alternate between
  the copies and open takes the valid one of the highest generation, so a torn or damaged copy
  leaves the other in force; a read-write open rewrites both.
* The data region, cut into slabs (the last may be shorter). A slab's first page is its
  descriptor: magic, version, format id, capacity, slab size, slab index, the slot size it is
  carved into and a sequence number, then xxh3-64 of those fields. It is written when the slab is
  carved, before any record in it commits, so each slab vouches for its own carving: the slab
  map in the metadata copies is the second source (used for a slab whose descriptor is damaged),
  and the descriptors rebuild the metadata when both copies are lost.
* After the descriptor, the slab is carved into slots of one size,
  ``4096 + round_up(block_bytes, 4096)``: a header page, then the payload.
* A record header (record version 4): magic, version, kind (record or tombstone), codec (the
  id, ``kvstore.tiers.codecs``, of the codec that wrote the payload), slot size in pages, the
  slot's own offset, sequence number, format id, key (32 bytes), namespace fingerprint (16), raw
  length, stored length, the checksum of the block a read yields (``block_checksum``: bound to
  key and namespace; for a lossy codec, of the *decoded* block, taken when it was encoded), the
  checksum of the stored payload (bound the same way), then xxh3-64 of all those fields
  (within the first 512-byte sector, so a torn header page is never half-valid). A header
  counts for a slot only if its checksum, format id, offset and slot size all match
  (``header_fits``): stale headers of an earlier format or carving, or written to the wrong
  place, are never taken for records. Record version 3 headers (no payload checksum; codecs
  none and lz4 only) are still read; records are only ever written as version 4. A slot's
  payload room is sized by its codec's bound (``codecs.plan``): an fp8 record's slot is about
  half a bf16 block's.

Versions 1 and 2 began with a superblock (``old_superblock_version`` recognises it): 1 stored
unbound checksums, 2 had no slab descriptors and one superblock. Neither is read as version 3.

Pure functions and values only: no IO here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import xxhash

from kvstore.tiers import codecs

PAGE = 4096
"""Alignment of every IO and region, and the size of a record header (O_DIRECT needs both)."""
FILE_NAME = "kvstore-nvme.slab"
FORMAT_VERSION = 3
"""2: block checksums bound to key and namespace. 3: two self-describing metadata copies and a
descriptor page per slab."""

RECORD_VERSION = 4
"""4: the codec may be lossy (fp8) and the header carries the payload's own checksum. Record
headers of version 3 are still read."""

KIND_RECORD, KIND_TOMBSTONE = 1, 2
CODEC_NONE, CODEC_LZ4 = codecs.CODEC_NONE, codecs.CODEC_LZ4
NO_STORED_CHECKSUM = -1
"""``Header.stored_checksum`` of a version-3 record, which has none (its block checksum still
verifies every read)."""

_META_MAGIC = b"KVNVMETA"
_SLAB_MAGIC = b"KVNVSLAB"
_RECORD_MAGIC = b"KVNVREC1"
_OLD_SUPER_MAGIC = b"KVNVSUP1"
# magic, version, meta pages, format id, capacity, slab bytes, data start, generation,
# next sequence number, clean, slabs; then u32 slot pages per slab
_META = struct.Struct("<8sIIQQQQQQII")
# magic, version, slot pages, format id, capacity, slab bytes, slab index, sequence number
_SLAB = struct.Struct("<8sIIQQQQQ")
# magic, version, kind, codec, slot pages, slot, seq, format id, key, namespace, length,
# stored length, checksum of the block a read yields, checksum of the stored payload
_HEADER = struct.Struct("<8sHBBIQQQ32s16sQQQQ")
# record version 3: the same without the payload's checksum
_HEADER_V3 = struct.Struct("<8sHBBIQQQ32s16sQQQ")
# versions 1-2: magic, version, ... then xxh3-64 of the 48-byte struct
_OLD_SUPER = struct.Struct("<8sIIQQQQ")
_U64 = struct.Struct("<Q")
HEADER_BYTES = _HEADER.size + _U64.size
"""The checksummed prefix of a header page: all that parse_header reads."""
ZERO_PAGE = bytes(PAGE)


def round_up(n: int, align: int = PAGE) -> int:
    return (n + align - 1) // align * align


def _sum(buf: Any, end: int) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(buf)[:end])


class Header(NamedTuple):
    kind: int
    codec: int
    slot_pages: int
    slot: int
    seq: int
    format_id: int
    key: bytes
    namespace: bytes
    length: int
    stored_length: int
    checksum: int
    stored_checksum: int = NO_STORED_CHECKSUM


def pack_header(h: Header) -> bytearray:
    """A whole header page (the rest zero), ready for one aligned write (record version 4)."""
    page = bytearray(PAGE)
    stored = h.stored_checksum if h.stored_checksum != NO_STORED_CHECKSUM else h.checksum
    _HEADER.pack_into(page, 0, _RECORD_MAGIC, RECORD_VERSION, *h[:-1], stored)
    _U64.pack_into(page, _HEADER.size, _sum(page, _HEADER.size))
    return page


def pack_header_v3(h: Header) -> bytearray:
    """A header page as record version 3 wrote it (tests: old records must stay readable)."""
    page = bytearray(PAGE)
    _HEADER_V3.pack_into(page, 0, _RECORD_MAGIC, 3, *h[:-1])
    _U64.pack_into(page, _HEADER_V3.size, _sum(page, _HEADER_V3.size))
    return page


MAX_SEQ = 1 << 62
"""Sequence numbers and generations the tier can have written are below this (it counts from
1 and adds one per write: centuries away): a header or metadata copy stating more, checksum or
not, is not one it wrote, and taking it would overflow the counters it writes next."""


def parse_header(page: Any) -> Header | None:
    """The header in ``page`` if its magic, version (4, or 3) and checksum hold and its sequence
    number is one the tier can have written (``MAX_SEQ``), else None."""
    h = _parse_header(page)
    return h if h is None or h.seq < MAX_SEQ else None


def _parse_header(page: Any) -> Header | None:
    magic, version = struct.unpack_from("<8sH", page)
    if magic != _RECORD_MAGIC:
        return None
    if version == RECORD_VERSION:
        _, _, *fields = _HEADER.unpack_from(page)
        if _U64.unpack_from(page, _HEADER.size)[0] != _sum(page, _HEADER.size):
            return None
        return Header(*fields)
    if version == 3:
        _, _, *fields = _HEADER_V3.unpack_from(page)
        if _U64.unpack_from(page, _HEADER_V3.size)[0] != _sum(page, _HEADER_V3.size):
            return None
        h = Header(*fields)
        return h if h.codec in (CODEC_NONE, CODEC_LZ4) else None
    return None


MAX_RECORD_LENGTH = (1 << 32) - 1
"""Largest raw length a record may state (the tier keeps lengths as u32): a header stating
more, checksum or not, was never written by the tier."""


def header_fits(h: Header, slot: int, slot_bytes: int, format_id: int) -> bool:
    """Whether ``h`` is a committed record of this format for this very slot: lengths the
    tier can have written too (a raw payload is exactly the block; a slot's payload room is
    its codec's bound, the block itself for a lossless codec and at least a quarter of it for
    fp8, so no block is longer than four times the room)."""
    return (
        h.kind == KIND_RECORD
        and h.format_id == format_id
        and h.slot == slot
        and h.slot_pages * PAGE == slot_bytes
        and h.codec in codecs.NAME_OF
        and 0 < h.stored_length <= min(h.length, slot_bytes - PAGE)
        and h.length <= min(MAX_RECORD_LENGTH, 4 * (slot_bytes - PAGE))
        and (h.codec != CODEC_NONE or h.stored_length == h.length)
    )


@dataclass(frozen=True)
class Geometry:
    """Where the metadata copies and each slab lie in a file of ``capacity_bytes``.
    Deterministic in (capacity, slab size), so a reopen with the same settings finds the same
    layout, and the metadata records both so a changed setting is noticed."""

    capacity_bytes: int
    slab_bytes: int
    meta_pages: int
    data_start: int
    slab_sizes: tuple[int, ...]

    @classmethod
    def plan(cls, capacity_bytes: int, slab_bytes: int) -> Geometry:
        if slab_bytes < 3 * PAGE:
            raise ValueError(f"slab_bytes {slab_bytes} is below three pages")
        slab = round_up(slab_bytes)
        max_slabs = capacity_bytes // slab + 1
        meta_pages = round_up(_META.size + 4 * max_slabs + 8) // PAGE
        data_start = 2 * meta_pages * PAGE
        usable = (capacity_bytes - data_start) // PAGE * PAGE
        if usable < 3 * PAGE:
            raise ValueError(f"capacity {capacity_bytes} leaves no room for a slot")
        slab = min(slab, usable)
        sizes = [slab] * (usable // slab)
        if usable % slab >= 3 * PAGE:
            sizes.append(usable % slab)
        return cls(capacity_bytes, slab, meta_pages, data_start, tuple(sizes))

    def slab_start(self, slab: int) -> int:
        """Offset of the slab's descriptor page; its first slot follows it."""
        return self.data_start + slab * self.slab_bytes

    def slab_of(self, offset: int) -> int:
        return (offset - self.data_start) // self.slab_bytes

    def slot_count(self, slab: int, slot_bytes: int) -> int:
        return (self.slab_sizes[slab] - PAGE) // slot_bytes

    def meta_offset(self, copy: int) -> int:
        return copy * self.meta_pages * PAGE

    @property
    def meta_bytes(self) -> int:
        return self.meta_pages * PAGE


def describe_size(n: int) -> str:
    """``n`` bytes for a message: exact, and in the unit an operator types (``4GiB``)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n} bytes ({n / (1 << shift):.6g}{unit})"
    return f"{n} bytes"


# ---------------------------------------------------------------------------- metadata copies
@dataclass(frozen=True)
class Meta:
    """One metadata copy: the file's identity and geometry, and the tier's state."""

    version: int
    format_id: int
    capacity_bytes: int
    slab_bytes: int
    meta_pages: int
    data_start: int
    generation: int
    next_seq: int
    clean: bool
    slab_slot_bytes: list[int]

    def geometry_matches(self, geo: Geometry) -> bool:
        return (self.capacity_bytes, self.slab_bytes, self.meta_pages, self.data_start) == (
            geo.capacity_bytes,
            geo.slab_bytes,
            geo.meta_pages,
            geo.data_start,
        )


def pack_meta(
    geo: Geometry, format_id: int, generation: int, next_seq: int, clean: bool, slab_map: list[int]
) -> bytearray:
    n = len(geo.slab_sizes)
    buf = bytearray(geo.meta_bytes)
    _META.pack_into(
        buf,
        0,
        _META_MAGIC,
        FORMAT_VERSION,
        geo.meta_pages,
        format_id,
        geo.capacity_bytes,
        geo.slab_bytes,
        geo.data_start,
        generation,
        next_seq,
        int(clean),
        n,
    )
    struct.pack_into(f"<{n}I", buf, _META.size, *(sb // PAGE for sb in slab_map))
    end = _META.size + 4 * n
    _U64.pack_into(buf, end, _sum(buf, end))
    return buf


def meta_length(page: Any) -> int:
    """Bytes to read for the whole metadata copy that starts in ``page`` (0: not one, or
    ``page`` is too short to say: a file cut short in its first page)."""
    if len(page) < _META.size:
        return 0
    magic, _, meta_pages, *_ = _META.unpack_from(page)
    return meta_pages * PAGE if magic == _META_MAGIC and 0 < meta_pages < 1 << 20 else 0


def meta_checked_bytes(page: Any) -> int:
    """Bytes a metadata copy that starts in ``page`` needs read for its checksum to be
    verified, as its own slab count says (0: ``page`` is too short to say)."""
    if len(page) < _META.size:
        return 0
    return round_up(_META.size + 4 * _META.unpack_from(page)[-1] + 8)


def starts_meta(page: Any) -> bool:
    """Whether ``page`` starts like a metadata copy (its magic), valid or not."""
    return bytes(page[: len(_META_MAGIC)]) == _META_MAGIC


def starts_slab_or_record(page: Any) -> bool:
    """Whether ``page`` starts like a slab descriptor or a record header, valid or not: a
    page only a tier that has stored blocks writes (a metadata copy alone proves no record)."""
    return bytes(page[: len(_SLAB_MAGIC)]) in (_SLAB_MAGIC, _RECORD_MAGIC)


def parse_meta(buf: Any) -> Meta | None:
    """The metadata copy in ``buf`` if its magic and checksum hold and its counters are below
    ``MAX_SEQ`` (any version, any geometry: the caller compares), else None."""
    if len(buf) < _META.size:
        return None
    magic, version, pages, fid, cap, slab, start, gen, seq, clean, n = _META.unpack_from(buf)
    end = _META.size + 4 * n
    if magic != _META_MAGIC or end + 8 > len(buf):
        return None
    if _U64.unpack_from(buf, end)[0] != _sum(buf, end):
        return None
    if gen >= MAX_SEQ or seq >= MAX_SEQ:
        return None  # counters the tier never wrote (see MAX_SEQ)
    slot_pages = struct.unpack_from(f"<{n}I", buf, _META.size)
    return Meta(
        version, fid, cap, slab, pages, start, gen, seq, bool(clean), [p * PAGE for p in slot_pages]
    )


def old_superblock_version(page: Any) -> int | None:
    """The version of a superblock of format version 1 or 2 (its checksum holds), else None."""
    if len(page) < PAGE or _OLD_SUPER.unpack_from(page)[0] != _OLD_SUPER_MAGIC:
        return None
    if _U64.unpack_from(page, _OLD_SUPER.size)[0] != _sum(page, _OLD_SUPER.size):
        return None
    return int(_OLD_SUPER.unpack_from(page)[1])


# ---------------------------------------------------------------------------- slab descriptors
class SlabDescriptor(NamedTuple):
    version: int
    slot_bytes: int
    format_id: int
    capacity_bytes: int
    slab_bytes: int
    slab: int
    seq: int


def pack_slab_descriptor(
    geo: Geometry, format_id: int, slab: int, slot_bytes: int, seq: int
) -> bytearray:
    page = bytearray(PAGE)
    fields = (slot_bytes // PAGE, format_id, geo.capacity_bytes, geo.slab_bytes, slab, seq)
    _SLAB.pack_into(page, 0, _SLAB_MAGIC, FORMAT_VERSION, *fields)
    _U64.pack_into(page, _SLAB.size, _sum(page, _SLAB.size))
    return page


def parse_slab_descriptor(page: Any) -> SlabDescriptor | None:
    """The descriptor in ``page`` if its magic and checksum hold, else None."""
    magic, version, pages, fid, cap, slab_bytes, slab, seq = _SLAB.unpack_from(page)
    if magic != _SLAB_MAGIC or _U64.unpack_from(page, _SLAB.size)[0] != _sum(page, _SLAB.size):
        return None
    return SlabDescriptor(version, pages * PAGE, fid, cap, slab_bytes, slab, seq)


def descriptor_fits(d: SlabDescriptor, geo: Geometry, slab: int, format_id: int) -> bool:
    """Whether ``d`` is this format's descriptor of this very slab of this geometry."""
    return (
        d.version == FORMAT_VERSION
        and d.format_id == format_id
        and d.slab == slab
        and (d.capacity_bytes, d.slab_bytes) == (geo.capacity_bytes, geo.slab_bytes)
        and (d.slot_bytes == 0 or PAGE < d.slot_bytes <= geo.slab_sizes[slab] - PAGE)
    )
