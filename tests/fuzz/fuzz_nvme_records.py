"""Fuzz target: NVMe tier records (``kvstore.tiers.nvme``): a record's header page
(``ondisk.parse_header``, ``header_fits``) and its read (``RecordIO.read_record``: payload
checksum, lz4 or fp8 decoding, block checksum), on a real file.

An input picks one of the records of ``_nvme.PRISTINE`` and patches its slot (header page and
payload) up to four times: per patch a flags byte, an offset into the slot (u16) and the bytes
(u16-length-prefixed); the flags ask for the header's payload checksum and its own checksum to
be made right afterwards, so the decoders meet payloads that pass every checksum.

Contract: ``parse_header`` gives None or the header ``pack_header`` writes for those fields,
byte for byte. ``read_record`` of the record the tier committed, and of the record the header
now states when it fits the slot (what recovery would take), gives None, with ``out`` holding
bytes whose checksum is the record's, or a reason ("short", "torn", "mismatch", "corrupt");
nothing raises."""

from __future__ import annotations

import logging
import os

import _harness
import atheris

with atheris.instrument_imports(include=["kvstore"]):
    from kvstore.checksum import block_checksum
    from kvstore.tiers.nvme import FILE_NAME
    from kvstore.tiers.nvme import ondisk as fmt
    from kvstore.tiers.nvme.ondisk import PAGE
    from kvstore.tiers.nvme.recordio import RecordIO
    from kvstore.tiers.nvme.records import Ident

import _nvme
from _nvme import GEO, PRISTINE, RECORDS

FORMAT_ID = fmt.parse_meta(PRISTINE[: GEO.meta_bytes]).format_id  # type: ignore[union-attr]
FIX_HEADER, FIX_STORED = 1, 2
REASONS = {"short", "torn", "mismatch", "corrupt"}
logging.disable(logging.CRITICAL)  # damage is logged as warnings: expected here
_dir = _nvme.scratch_dir("nvme-records")
_path = os.path.join(_dir, FILE_NAME)
_committed = []
for _slot, _i, _data in RECORDS:
    _h = fmt.parse_header(PRISTINE[_slot : _slot + PAGE])
    assert _h is not None
    _ident = Ident(_h.key, _h.namespace, _h.length, _h.stored_length, _h.codec, _h.checksum, _h.seq)
    _committed.append((_slot, _ident, _data))


def read(io: RecordIO, slot: int, want: Ident) -> None:
    out = memoryview(bytearray(want.length))
    why = io.read_record(slot, want, out)
    if why is None:
        assert block_checksum(out, want.namespace, want.key) == want.checksum
    else:
        assert why in REASONS, why


def TestOneInput(data: bytes) -> None:
    cut = _harness.Cut(data)
    slot, committed, _ = _committed[cut.u8() % len(_committed)]
    slot_bytes = _slot_bytes(slot)
    file = bytearray(PRISTINE)
    for _ in range(4):
        if not cut.left:
            break
        flags, offset = cut.u8(), cut.u16() % slot_bytes
        piece = cut.chunk(slot_bytes)
        file[slot + offset : slot + offset + len(piece)] = piece[: slot_bytes - offset]
        if flags & FIX_STORED:
            _nvme.fix_stored(file, slot)
        if flags & FIX_HEADER:
            _nvme.fix_header(file, slot)
    page = bytes(file[slot : slot + PAGE])
    h = fmt.parse_header(page)
    if h is not None:
        if int.from_bytes(page[8:10], "little") == fmt.RECORD_VERSION:
            packed = fmt.pack_header(h)
        else:
            packed = fmt.pack_header_v3(h)
        assert packed[: fmt.HEADER_BYTES] == page[: fmt.HEADER_BYTES] or (
            # version 3 headers are shorter: what follows their checksum is not read
            packed[: fmt._HEADER_V3.size + 8] == page[: fmt._HEADER_V3.size + 8]
        ), "a header that parses but is not what pack_header writes"
    with open(_path, "wb") as f:
        f.write(file)
    fd = os.open(_path, os.O_RDONLY)
    try:
        io = RecordIO(fd, False, FORMAT_ID)
        read(io, slot, committed)
        if h is not None and fmt.header_fits(h, slot, slot_bytes, FORMAT_ID):
            stated = Ident(
                h.key, h.namespace, h.length, h.stored_length, h.codec, h.checksum, h.seq
            )
            if stated.length <= 1 << 24:  # the tier's blocks are far smaller; bounds memory
                read(io, slot, stated)
    finally:
        os.close(fd)


def _slot_bytes(slot: int) -> int:
    h = fmt.parse_header(PRISTINE[slot : slot + PAGE])
    assert h is not None
    return h.slot_pages * PAGE


if __name__ == "__main__":
    _harness.main(TestOneInput)
