"""Opening the slab file (blocking; the tier runs it on a pool thread): lock it, find what it
holds (``recovery.inspect``) and, for a read-write open, format it if it holds nothing of this
format, bring it to its capacity and preallocate it."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
from dataclasses import dataclass

from kvstore.tiers.nvme import ondisk as fmt
from kvstore.tiers.nvme import recovery
from kvstore.tiers.nvme.diskio import ScratchBuffers
from kvstore.tiers.nvme.ondisk import PAGE, Geometry
from kvstore.tiers.nvme.recordio import RecordIO
from kvstore.tiers.nvme.records import NvmeFormatError

log = logging.getLogger(__name__)


@dataclass
class SlabFile:
    """An open, locked slab file: its record IO, whether it is preallocated, what it holds.
    ``lock_fd`` holds the lock (exclusive read-write, shared read-only); ``io.fd`` may be the
    same descriptor or an O_DIRECT one. ``close`` releases both."""

    path: str
    lock_fd: int
    io: RecordIO
    preallocated: bool
    found: recovery.Found

    def close(self) -> None:
        for fd in {self.io.fd, self.lock_fd}:
            os.close(fd)


def open_slab_file(
    directory: str,
    path: str,
    geo: Geometry,
    *,
    read_only: bool,
    create: bool,
    direct_io: bool,
) -> SlabFile:
    """Raises RuntimeError if another process holds the file, NvmeFormatError if it holds a
    tier of another geometry or a newer format, or (``create`` False) nothing of this format;
    OSError as the system says. On any error every descriptor opened here is closed."""
    if read_only:
        flags, lock = os.O_RDONLY, fcntl.LOCK_SH
    else:
        if create:
            os.makedirs(directory, exist_ok=True)
        flags, lock = os.O_RDWR | (os.O_CREAT if create else 0), fcntl.LOCK_EX
    fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
    io_fd = fd
    try:
        try:
            fcntl.flock(fd, lock | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise RuntimeError(f"{path} is in use by another process") from exc
        found = recovery.inspect(fd, geo, path)
        for _, what in found.damage:
            log.warning("nvme tier %s: %s", path, what)
        if found.format_id == 0 and not create:
            if found.old_version is not None:
                raise NvmeFormatError(
                    f"{path} is of format version {found.old_version}; this kvstore reads "
                    f"version {fmt.FORMAT_VERSION} (a daemon reformats it)"
                )
            raise NvmeFormatError(f"{path} holds no NVMe tier metadata")
        if read_only:
            return SlabFile(path, fd, RecordIO(fd, False, found.format_id), False, found)
        preallocated = _resize(fd, path, geo, found)
        io_fd, direct = _open_io_fd(path, fd) if direct_io else (fd, False)
        io = RecordIO(io_fd, direct, found.format_id)
        if found.format_id == 0:
            found = _format(io, geo)
        return SlabFile(path, fd, io, preallocated, found)
    except BaseException:
        for each in {fd, io_fd}:
            os.close(each)
        raise


def _resize(fd: int, path: str, geo: Geometry, found: recovery.Found) -> bool:
    """Empty a file that holds nothing of this format; bring the file to its capacity (a cut
    file grows back with zeros) and preallocate it: whether that worked."""
    if found.format_id == 0:
        if found.old_version is not None:
            log.warning(
                "nvme tier %s: a file of format version %d (this is version %d), reformatting",
                path,
                found.old_version,
                fmt.FORMAT_VERSION,
            )
        elif found.size:
            log.warning("nvme tier %s: no tier metadata found, formatting", path)
        os.ftruncate(fd, 0)  # drops every old record with the blocks that held it
        found.size = 0
    if found.size != geo.capacity_bytes:
        os.ftruncate(fd, geo.capacity_bytes)
    try:
        os.posix_fallocate(fd, 0, geo.capacity_bytes)
    except OSError as exc:
        # Carry on with what the filesystem gave: a write into a hole it cannot fill fails
        # with NvmeIOError and the tier stays usable. stats() reports preallocated=False.
        log.warning("nvme tier %s: cannot preallocate: %s", path, exc)
        return False
    return True


def _format(io: RecordIO, geo: Geometry) -> recovery.Found:
    """Both metadata copies of an empty tier under a new format id (no header written under an
    earlier format can ever validate), made durable."""
    n = len(geo.slab_sizes)
    found = recovery.Found(
        geo.capacity_bytes,
        secrets.randbits(63) | 1,
        generation=1,
        clean=True,
        slab_map=[0] * n,
        descriptors=[-1] * n,
        meta_ok=[True, True],
    )
    io.format_id = found.format_id
    for copy in (0, 1):
        io.write_at(geo.meta_offset(copy), fmt.pack_meta(geo, found.format_id, 1, 1, True, [0] * n))
    os.fdatasync(io.fd)
    return found


def _open_io_fd(path: str, fd: int) -> tuple[int, bool]:
    """An O_DIRECT descriptor if the filesystem takes a probe read and write with it, else the
    buffered ``fd``."""
    try:
        direct = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        log.info("nvme tier %s: O_DIRECT refused (%s), using buffered IO", path, exc)
        return fd, False
    probe = ScratchBuffers().get(PAGE)[:PAGE]
    try:  # page 0 rewritten with its own bytes: harmless, and proves aligned IO works
        if os.preadv(direct, [probe], 0) != PAGE or os.pwritev(direct, [probe], 0) != PAGE:
            raise OSError(errno.EINVAL, "short O_DIRECT probe")
    except OSError as exc:
        os.close(direct)
        log.info("nvme tier %s: O_DIRECT probe failed (%s), using buffered IO", path, exc)
        return fd, False
    return direct, True
