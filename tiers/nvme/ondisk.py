"""The NVMe tier's on-disk format (version 2): layout, record headers, superblock and state.

Integers are little-endian; every region is 4096-aligned; the file is exactly
``capacity_bytes`` long and preallocated, so the bytes the tier counts are the bytes it holds.

* Page 0, the superblock, written once when the file is formatted: magic, version, state size,
  a random format id, capacity, slab size, data start, then xxh3-64 of those fields.
* Two copies (A, B) of the state: clean-shutdown flag, generation, a sequence-number hint and,
  per slab, the slot size it was carved into (0: not carved), then xxh3-64 of all of it. Writes
  alternate between the copies and open takes the valid one of the highest generation, so a
  torn state write leaves the previous state in force.
* The data region, cut into slabs (the last may be shorter). A slab is carved into slots of one
  size, ``4096 + round_up(block_bytes, 4096)``: a header page, then the payload.
* A record header: magic, version, kind (record or tombstone), codec, slot size in pages, the
  slot's own offset, sequence number, format id, key (32 bytes), namespace fingerprint (16), raw
  length, stored length, the block's checksum (``kvstore.checksum.block_checksum``: bound to key
  and namespace; version 1 stored an unbound xxh3-64), then xxh3-64 of all those fields (within the
  first 512-byte sector, so a torn header page is never half-valid). A header counts for a slot
  only if its checksum, format id, offset and slot size all match (``header_fits``): stale
  headers of an earlier format, or written to the wrong place, are never taken for records.

Pure functions and values only: no IO here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import xxhash

PAGE = 4096
"""Alignment of every IO and region, and the size of a record header (O_DIRECT needs both)."""
FILE_NAME = "kvstore-nvme.slab"
FORMAT_VERSION = 2
"""2: block checksums bound to key and namespace. A file of another version is recognised by its
superblock (``superblock_version``) and never read as this one."""

KIND_RECORD, KIND_TOMBSTONE = 1, 2
CODEC_NONE, CODEC_LZ4 = 0, 1
CODECS = {None: CODEC_NONE, "lz4": CODEC_LZ4}

_SUPER_MAGIC = b"KVNVSUP1"
_STATE_MAGIC = b"KVNVSTA1"
_RECORD_MAGIC = b"KVNVREC1"
# magic, version, state pages, format id, capacity, slab bytes, data start
_SUPER = struct.Struct("<8sIIQQQQ")
# magic, clean, slabs, format id, generation, next sequence number; then u32 slot pages per slab
_STATE = struct.Struct("<8sIIQQQ")
# magic, version, kind, codec, slot pages, slot, seq, format id, key, namespace, length,
# stored length, checksum of the raw bytes
_HEADER = struct.Struct("<8sHBBIQQQ32s16sQQQ")
_U64 = struct.Struct("<Q")
HEADER_BYTES = _HEADER.size + _U64.size
"""The checksummed prefix of a header page: all that parse_header reads."""
ZERO_PAGE = bytes(PAGE)


def round_up(n: int, align: int = PAGE) -> int:
    return (n + align - 1) // align * align


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


def pack_header(h: Header) -> bytearray:
    """A whole header page (the rest zero), ready for one aligned write."""
    page = bytearray(PAGE)
    _HEADER.pack_into(page, 0, _RECORD_MAGIC, FORMAT_VERSION, *h)
    _U64.pack_into(page, _HEADER.size, xxhash.xxh3_64_intdigest(memoryview(page)[: _HEADER.size]))
    return page


def parse_header(page: Any) -> Header | None:
    """The header in ``page`` if its magic, version and checksum hold, else None."""
    magic, version, *fields = _HEADER.unpack_from(page)
    if magic != _RECORD_MAGIC or version != FORMAT_VERSION:
        return None
    if _U64.unpack_from(page, _HEADER.size)[0] != xxhash.xxh3_64_intdigest(page[: _HEADER.size]):
        return None
    return Header(*fields)


def header_fits(h: Header, slot: int, slot_bytes: int, format_id: int) -> bool:
    """Whether ``h`` is a committed record of this format for this very slot."""
    return (
        h.kind == KIND_RECORD
        and h.format_id == format_id
        and h.slot == slot
        and h.slot_pages * PAGE == slot_bytes
        and h.codec in CODECS.values()
        and 0 < h.length <= slot_bytes - PAGE
        and 0 < h.stored_length <= h.length
    )


@dataclass(frozen=True)
class Geometry:
    """Where the superblock, the two state copies and each slab lie in a file of
    ``capacity_bytes``. Deterministic in (capacity, slab size), so a reopen with the same
    settings finds the same layout and a changed setting is noticed."""

    capacity_bytes: int
    slab_bytes: int
    state_pages: int
    data_start: int
    slab_sizes: tuple[int, ...]

    @classmethod
    def plan(cls, capacity_bytes: int, slab_bytes: int) -> Geometry:
        if slab_bytes < 2 * PAGE:
            raise ValueError(f"slab_bytes {slab_bytes} is below two pages")
        slab = round_up(slab_bytes)
        max_slabs = capacity_bytes // slab + 1
        state_pages = round_up(_STATE.size + 4 * max_slabs + 8) // PAGE
        data_start = PAGE * (1 + 2 * state_pages)
        usable = (capacity_bytes - data_start) // PAGE * PAGE
        if usable < 2 * PAGE:
            raise ValueError(f"capacity {capacity_bytes} leaves no room for a slot")
        slab = min(slab, usable)
        sizes = [slab] * (usable // slab)
        if usable % slab >= 2 * PAGE:
            sizes.append(usable % slab)
        return cls(capacity_bytes, slab, state_pages, data_start, tuple(sizes))

    def slab_start(self, slab: int) -> int:
        return self.data_start + slab * self.slab_bytes

    def slab_of(self, offset: int) -> int:
        return (offset - self.data_start) // self.slab_bytes

    def state_offset(self, copy: int) -> int:
        return PAGE * (1 + copy * self.state_pages)


def pack_superblock(geo: Geometry, format_id: int) -> bytearray:
    page = bytearray(PAGE)
    fields = (geo.state_pages, format_id, geo.capacity_bytes, geo.slab_bytes, geo.data_start)
    _SUPER.pack_into(page, 0, _SUPER_MAGIC, FORMAT_VERSION, *fields)
    _U64.pack_into(page, _SUPER.size, xxhash.xxh3_64_intdigest(page[: _SUPER.size]))
    return page


def superblock_version(page: bytes) -> int | None:
    """The format version of a superblock of any version (its checksum holds), else None."""
    if len(page) < PAGE or _SUPER.unpack_from(page)[0] != _SUPER_MAGIC:
        return None
    if _U64.unpack_from(page, _SUPER.size)[0] != xxhash.xxh3_64_intdigest(page[: _SUPER.size]):
        return None
    return int(_SUPER.unpack_from(page)[1])


def parse_superblock(page: bytes, geo: Geometry) -> int:
    """The format id if ``page`` is a valid superblock of exactly this geometry, else 0."""
    if len(page) < PAGE:
        return 0
    magic, version, state_pages, format_id, capacity, slab, start = _SUPER.unpack_from(page)
    if _U64.unpack_from(page, _SUPER.size)[0] != xxhash.xxh3_64_intdigest(page[: _SUPER.size]):
        return 0
    ours = (_SUPER_MAGIC, FORMAT_VERSION, geo.state_pages, geo.capacity_bytes)
    if (magic, version, state_pages, capacity) != ours:
        return 0
    if (slab, start) != (geo.slab_bytes, geo.data_start):
        return 0
    return int(format_id)


@dataclass(frozen=True)
class State:
    generation: int
    next_seq: int
    clean: bool
    slab_slot_bytes: list[int]


def pack_state(geo: Geometry, format_id: int, state: State) -> bytearray:
    n = len(geo.slab_sizes)
    buf = bytearray(geo.state_pages * PAGE)
    head = (_STATE_MAGIC, int(state.clean), n, format_id, state.generation, state.next_seq)
    _STATE.pack_into(buf, 0, *head)
    struct.pack_into(f"<{n}I", buf, _STATE.size, *(sb // PAGE for sb in state.slab_slot_bytes))
    end = _STATE.size + 4 * n
    _U64.pack_into(buf, end, xxhash.xxh3_64_intdigest(memoryview(buf)[:end]))
    return buf


def parse_state(buf: Any, geo: Geometry, format_id: int) -> State | None:
    n = len(geo.slab_sizes)
    magic, clean, slabs, fid, gen, next_seq = _STATE.unpack_from(buf)
    if (magic, slabs, fid) != (_STATE_MAGIC, n, format_id):
        return None
    end = _STATE.size + 4 * n
    if _U64.unpack_from(buf, end)[0] != xxhash.xxh3_64_intdigest(buf[:end]):
        return None
    pages = struct.unpack_from(f"<{n}I", buf, _STATE.size)
    return State(gen, next_seq, bool(clean), [p * PAGE for p in pages])
