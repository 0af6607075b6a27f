"""A small NVMe tier file for the NVMe fuzz targets, and the fix-ups that let a patched file's
checksums hold (a fuzzer cannot compute xxh3; a disk that damages a page and its checksum
alike, or a file written by someone else, can).

``PRISTINE`` is a real tier's file, written by ``NvmeTier`` itself at import (deterministic:
fixed keys, blocks and format id): two metadata copies, slabs carved for two slot sizes, live
records of codecs none and lz4, and a freed one (its tombstone)."""

from __future__ import annotations

import asyncio
import os
import tempfile

import atheris

with atheris.instrument_imports(include=["kvstore"]):
    from kvstore.checksum import block_checksum
    from kvstore.tiers.nvme import FILE_NAME, NvmeTier
    from kvstore.tiers.nvme import ondisk as fmt
    from kvstore.tiers.nvme.ondisk import PAGE, Geometry

CAPACITY = 160 * 1024
SLAB = 32 * 1024
GEO = Geometry.plan(CAPACITY, SLAB)
NS = bytes(range(16))
SIZES = (4096, 4096, 4096, 12288, 4096)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def block(i: int, n: int) -> bytes:
    """Block ``i``: half compressible (lz4 stores it smaller), half not."""
    pattern = bytes((i * 7 + j * j) % 256 for j in range(256))
    return (bytes([i]) * (n // 2) + pattern * (n // 512 + 1))[:n]


def scratch_dir(name: str) -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return tempfile.mkdtemp(prefix=f"fuzz-{name}-", dir=base)


def new_tier(directory: str) -> NvmeTier:
    return NvmeTier(
        directory, CAPACITY, slab_bytes=SLAB, direct_io=False, io_threads=1, codec="lz4"
    )


async def _write_pristine(directory: str) -> list[tuple[int, int, bytes]]:
    tier = new_tier(directory)
    await tier.open()
    written = []
    for i, n in enumerate(SIZES):
        data = block(i, n)
        slot = tier.allocate(tier.payload_bytes_for(n))
        assert slot is not None
        codec = "none" if i == 1 else None
        await tier.write(slot, key(i), NS, data, block_checksum(data, NS, key(i)), codec=codec)
        written.append((slot, i, data))
    tier.free(written[2][0])  # a tombstone
    await tier.close()
    return [w for j, w in enumerate(written) if j != 2]


def _pristine() -> tuple[bytes, list[tuple[int, int, bytes]]]:
    directory = scratch_dir("nvme-pristine")
    loop = asyncio.new_event_loop()
    try:
        records = loop.run_until_complete(_write_pristine(directory))
    finally:
        loop.close()
    path = os.path.join(directory, FILE_NAME)
    with open(path, "rb") as f:
        data = f.read()
    os.unlink(path)
    os.rmdir(directory)
    # The format id is random: made fixed, so inputs mean the same file in every run.
    return fix_format_id(bytearray(data), 0x0123456789ABCDEF), records


def fix_format_id(data: bytearray, format_id: int) -> bytes:
    for copy in (0, 1):
        at = GEO.meta_offset(copy)
        fmt._U64.pack_into(data, at + 16, format_id)
        fix_meta(data, at)
    for slab in range(len(GEO.slab_sizes)):
        at = GEO.slab_start(slab)
        if fmt.starts_slab_or_record(data[at : at + 8]):
            fmt._U64.pack_into(data, at + 16, format_id)
            fix_descriptor(data, at)
    for at in range(GEO.data_start, len(data), PAGE):
        if data[at : at + 8] == fmt._RECORD_MAGIC:
            fmt._U64.pack_into(data, at + 32, format_id)
            fix_header(data, at)
    return bytes(data)


def fix_meta(data: bytearray, at: int) -> None:
    """Make the metadata copy at ``at`` checksum right, whatever its slab count says."""
    if at + fmt._META.size > len(data):
        return
    n = fmt._META.unpack_from(data, at)[-1]
    end = fmt._META.size + 4 * n
    if at + end + 8 <= len(data) and end + 8 <= 1 << 20:
        fmt._U64.pack_into(data, at + end, fmt._sum(data[at:], end))


def fix_descriptor(data: bytearray, at: int) -> None:
    if at + PAGE <= len(data):
        fmt._U64.pack_into(data, at + fmt._SLAB.size, fmt._sum(data[at:], fmt._SLAB.size))


def fix_header(data: bytearray, at: int) -> None:
    """Make the record header at ``at`` checksum right (version 3 or 4, as it says)."""
    if at + PAGE > len(data):
        return
    version = int.from_bytes(data[at + 8 : at + 10], "little")
    size = fmt._HEADER_V3.size if version == 3 else fmt._HEADER.size
    fmt._U64.pack_into(data, at + size, fmt._sum(data[at:], size))


def fix_stored(data: bytearray, at: int) -> None:
    """Make a version-4 header's payload checksum that of the payload it states (its stored
    length from ``at + PAGE``), then its own checksum."""
    if at + PAGE > len(data):
        return
    h = fmt._HEADER.unpack_from(data, at)
    key_, ns, stored = h[8], h[9], h[11]
    payload = bytes(data[at + PAGE : at + PAGE + stored])
    fmt._U64.pack_into(data, at + fmt._HEADER.size - 8, block_checksum(payload, ns, key_))
    fix_header(data, at)


PRISTINE, RECORDS = _pristine()
