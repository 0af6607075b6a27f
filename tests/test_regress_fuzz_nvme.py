"""Guards, found by fuzzing the NVMe tier's open (tests/fuzz/fuzz_nvme_superblock.py): a file
cut short inside its first metadata page is formatted again (it raised struct.error); a record
header that states a length the tier never writes (2**33 bytes, checksum right) loses that
record, not the tier (it raised OverflowError); a header page cut by the file's end does not
come back as a record once the file grows back (it came back at the second open); a metadata
copy whose page count is damaged costs a read of no more than the copy's checksum covers (it
read, and kept a populated buffer of, up to 4 GiB)."""

from __future__ import annotations

import asyncio
import os
import struct
import threading
from pathlib import Path

import xxhash

from kvstore.checksum import block_checksum
from kvstore.tiers.nvme import FILE_NAME, PAGE, NvmeTier, ondisk, recovery

NS = bytes(range(16))
CAPACITY, SLAB = 160 * 1024, 32 * 1024


def tier(directory: Path) -> NvmeTier:
    return NvmeTier(directory, CAPACITY, slab_bytes=SLAB, direct_io=False, io_threads=1)


async def two_records(directory: Path) -> list[int]:
    t = tier(directory)
    await t.open()
    slots = []
    for i in range(2):
        data = bytes([i + 1]) * 4096
        key = i.to_bytes(32, "big")
        slot = t.allocate(4096)
        assert slot is not None
        await t.write(slot, key, NS, data, block_checksum(data, NS, key))
        slots.append(slot)
    await t.close()
    return slots


async def reopen(directory: Path) -> list[int]:
    t = tier(directory)
    records = await t.open()
    report = t.check()
    await t.close()
    assert report.ok, report.problems
    return sorted(r.slot for r in records)


def test_a_file_cut_inside_its_first_page_is_formatted_again(tmp_path: Path) -> None:
    asyncio.run(two_records(tmp_path))
    os.truncate(tmp_path / FILE_NAME, 8)
    assert asyncio.run(reopen(tmp_path)) == []


def test_a_header_stating_an_impossible_length_loses_only_its_record(tmp_path: Path) -> None:
    first, second = asyncio.run(two_records(tmp_path))
    path = tmp_path / FILE_NAME
    with open(path, "r+b") as f:
        f.seek(first)
        page = bytearray(f.read(PAGE))
        struct.pack_into("<Q", page, 88, 1 << 33)  # the length field
        size = ondisk._HEADER.size
        struct.pack_into("<Q", page, size, xxhash.xxh3_64_intdigest(bytes(page[:size])))
        assert ondisk.parse_header(page) is not None  # a header whose checksum holds
        f.seek(first)
        f.write(page)
    assert asyncio.run(reopen(tmp_path)) == [second]


def test_a_header_page_cut_by_the_end_of_the_file_stays_gone(tmp_path: Path) -> None:
    first, second = asyncio.run(two_records(tmp_path))
    os.truncate(tmp_path / FILE_NAME, second + PAGE // 2)  # the header's first half is left
    assert asyncio.run(reopen(tmp_path)) == [first]
    assert asyncio.run(reopen(tmp_path)) == [first]  # grown back: the record did not return


def test_a_damaged_metadata_page_count_is_not_a_read_of_that_size(tmp_path: Path) -> None:
    asyncio.run(two_records(tmp_path))
    path = tmp_path / FILE_NAME
    with open(path, "r+b") as f:
        f.seek(12)  # copy A's page count: 65536 pages, 256 MiB
        f.write(struct.pack("<I", 1 << 16))
    scratch: list[int] = []
    geometry = ondisk.Geometry.plan(CAPACITY, SLAB)

    def inspect() -> None:  # on a thread of its own: its scratch buffer starts empty
        fd = os.open(path, os.O_RDONLY)
        try:
            found = recovery.inspect(fd, geometry, str(path))
        finally:
            os.close(fd)
        assert found.meta_ok == [False, True]  # copy B in force
        view = recovery._scratch.view
        scratch.append(view.nbytes if view is not None else 0)

    thread = threading.Thread(target=inspect)
    thread.start()
    thread.join()
    assert scratch and scratch[0] <= 1 << 20, f"a {scratch} byte read buffer"
    assert asyncio.run(reopen(tmp_path)) != []


def test_a_header_stating_a_sequence_number_past_any_write_is_not_taken(tmp_path: Path) -> None:
    """A checksummed header (here in the free slot after the records) whose sequence number is
    2**64 - 1: open took it as the newest and overflowed writing the metadata (struct.error)."""
    first, second = asyncio.run(two_records(tmp_path))
    path = tmp_path / FILE_NAME
    with open(path, "r+b") as f:
        f.seek(second)
        page = bytearray(f.read(PAGE))
        struct.pack_into("<QQ", page, 16, second + 8192, (1 << 64) - 1)  # slot, seq
        size = ondisk._HEADER.size
        struct.pack_into("<Q", page, size, xxhash.xxh3_64_intdigest(bytes(page[:size])))
        f.seek(second + 8192)
        f.write(page)
    assert asyncio.run(reopen(tmp_path)) == [first, second]
    assert asyncio.run(reopen(tmp_path)) == [first, second]


def test_a_header_stating_a_block_longer_than_its_slot_can_hold_is_not_taken(
    tmp_path: Path,
) -> None:
    """A checksummed header stating a 4 GiB block in an 8 KiB slot (under u32, so it passed):
    open took it, and a caller sized its read buffer by it."""
    first, second = asyncio.run(two_records(tmp_path))
    path = tmp_path / FILE_NAME
    with open(path, "r+b") as f:
        f.seek(first)
        page = bytearray(f.read(PAGE))
        page[11] = 1  # codec lz4: a stored length below the block's is allowed
        struct.pack_into("<Q", page, 88, 0xFF003000)  # the length field
        size = ondisk._HEADER.size
        struct.pack_into("<Q", page, size, xxhash.xxh3_64_intdigest(bytes(page[:size])))
        assert ondisk.parse_header(page) is not None
        f.seek(first)
        f.write(page)
    assert asyncio.run(reopen(tmp_path)) == [second]


def test_a_metadata_slab_map_naming_an_impossible_carving_is_not_taken(tmp_path: Path) -> None:
    """Both metadata copies (checksums right) say slab 4 is carved into slots larger than the
    slab, which has no descriptor: inspect handed that carving on (the fuzz target's
    contract), the slab now counts as not carved."""
    asyncio.run(two_records(tmp_path))
    path = tmp_path / FILE_NAME
    geometry = ondisk.Geometry.plan(CAPACITY, SLAB)
    with open(path, "r+b") as f:
        for copy in (0, 1):
            at = geometry.meta_offset(copy)
            f.seek(at)
            buf = bytearray(f.read(geometry.meta_bytes))
            struct.pack_into("<I", buf, ondisk._META.size + 4 * 4, 1 << 20)  # slab 4's pages
            end = ondisk._META.size + 4 * len(geometry.slab_sizes)
            struct.pack_into("<Q", buf, end, xxhash.xxh3_64_intdigest(bytes(buf[:end])))
            f.seek(at)
            f.write(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        found = recovery.inspect(fd, geometry, str(path))
    finally:
        os.close(fd)
    assert found.slab_map[4] == 0
    assert len(asyncio.run(reopen(tmp_path))) == 2
