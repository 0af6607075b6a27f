"""Fuzz target: opening an NVMe tier file (``kvstore.tiers.nvme``): the metadata copies and slab
descriptors (``ondisk.parse_meta``/``parse_slab_descriptor``, ``recovery.inspect``), then the
whole open (``NvmeTier.open``: carving, header scan, repairs), a read of every record, ``check``
and a second open.

An input is up to eight patches to a real tier's file (``_nvme.PRISTINE``): per patch, a flags
byte, an offset (u32, taken modulo the file's size) and the bytes (u16-length-prefixed) written
there; the flags ask for the checksums of the metadata copies, of the descriptor or of the
record header the patch lands in to be made right afterwards, or for the file to be cut at the
offset (a truncated file).

Contract: ``inspect`` returns what the file holds or raises NvmeFormatError (and the open
does exactly when it does); nothing else escapes. A file that opens yields records that are each
read back verified or as a miss, never another block's bytes (each read is checked against the
key and namespace its header names); a second open of the repaired file finds the same
records; ``check`` after a read-write open reports at most payloads that do not verify
("corrupt", "torn": damage that only a read can see)."""

from __future__ import annotations

import asyncio
import logging
import os

import _harness
import atheris

with atheris.instrument_imports(include=["kvstore"]):
    from kvstore.tiers.nvme import FILE_NAME, NvmeFormatError, recovery
    from kvstore.tiers.nvme import ondisk as fmt
    from kvstore.tiers.nvme.ondisk import PAGE

import _nvme
from _nvme import GEO, PRISTINE

FIX_META_A, FIX_META_B, FIX_DESCRIPTOR, FIX_HEADER, FIX_STORED, TRUNCATE = 1, 2, 4, 8, 16, 32
logging.disable(logging.CRITICAL)  # damage is logged as warnings: expected here
_dir = _nvme.scratch_dir("nvme-superblock")
_path = os.path.join(_dir, FILE_NAME)
_loop = asyncio.new_event_loop()


def patched(data: bytes) -> bytearray:
    cut = _harness.Cut(data)
    file = bytearray(PRISTINE)
    for _ in range(8):
        if not cut.left:
            break
        flags, offset = cut.u8(), cut.u32() % len(file)
        piece = cut.chunk(2 * PAGE)
        file[offset : offset + len(piece)] = piece[: len(file) - offset]
        page = offset // PAGE * PAGE
        if flags & FIX_META_A:
            _nvme.fix_meta(file, GEO.meta_offset(0))
        if flags & FIX_META_B:
            _nvme.fix_meta(file, GEO.meta_offset(1))
        if flags & FIX_DESCRIPTOR and page >= GEO.data_start:
            _nvme.fix_descriptor(file, GEO.slab_start(GEO.slab_of(page)))
        if flags & FIX_STORED:
            _nvme.fix_stored(file, page)
        if flags & FIX_HEADER:
            _nvme.fix_header(file, page)
        if flags & TRUNCATE:
            del file[offset:]
            break
    return file


def check_found(found: recovery.Found) -> None:
    if found.format_id == 0:
        return
    n = len(GEO.slab_sizes)
    assert len(found.slab_map) == len(found.descriptors) == n, found
    for slab, slot_bytes in enumerate(found.slab_map):
        assert slot_bytes == 0 or PAGE < slot_bytes <= GEO.slab_sizes[slab] - PAGE, (
            f"slab {slab} carved into {slot_bytes}-byte slots"
        )
        assert slot_bytes % PAGE == 0


async def open_and_read() -> list[tuple[int, bytes, bytes, int, int, int, int]] | None:
    tier = _nvme.new_tier(_dir)
    try:
        records = await tier.open()
    except NvmeFormatError:
        return None
    try:
        slots = [r.slot for r in records]
        assert len(set(slots)) == len(slots), "two records in one slot"
        for r in records:
            assert GEO.data_start < r.slot < GEO.capacity_bytes
            out = bytearray(r.length)
            got = await tier.read_into_checked(r.slot, r.key, r.namespace, r.checksum, out)
            assert got is None or got == r.checksum
        report = tier.check()
        kinds = {p.kind for p in report.problems}
        assert kinds <= {"corrupt", "torn"}, report.problems
    finally:
        await tier.close()
    return sorted(
        (r.slot, r.key, r.namespace, r.length, r.stored_length, r.checksum, r.seq) for r in records
    )


def TestOneInput(data: bytes) -> None:
    file = patched(data)
    with open(_path, "wb") as f:
        f.write(file)
    fmt.parse_meta(bytes(file[: GEO.meta_bytes]))
    fd = os.open(_path, os.O_RDONLY)
    try:
        try:
            found = recovery.inspect(fd, GEO, _path)
        except NvmeFormatError as exc:
            refused = str(exc)
        else:
            refused = ""
            check_found(found)
    finally:
        os.close(fd)
    first = _loop.run_until_complete(open_and_read())
    assert (first is None) == bool(refused), f"inspect said {refused!r}, open disagreed"
    if first is not None:
        again = _loop.run_until_complete(open_and_read())
        assert again == first, "a second open found other records"


if __name__ == "__main__":
    _harness.main(TestOneInput)
