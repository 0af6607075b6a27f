"""The CPU tier's mechanism: a shared-memory arena of fixed-size slots.

The daemon creates one file under ``/dev/shm`` (tmpfs), maps it shared and hands its path to
same-host clients, which map it too and copy blocks straight into and out of slots: a block
crosses memory once. The arena is carved into slabs; each slab holds slots of one size, so
layouts of different block sizes can share one arena without fragmenting it.

This module knows nothing of keys, leases or eviction policy: it hands out and takes back slot
offsets. The daemon's store decides which block lives in which slot and which one goes.

Backing (never SIGBUS). A page of a tmpfs file that tmpfs cannot back kills whoever touches it
first with SIGBUS: a client, then the daemon. So no slot is handed out in memory that is not
backed: with ``prefault`` the arena allocates every page at start-up (and refuses to start,
naming the directory and the sizes, when the directory cannot hold it); without, a range
must be backed (``SharedMemoryArena.reserve_backing``) before any slot in it is handed out.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
from dataclasses import dataclass, field

HEADER_BYTES = 4096
"""Offset 0 holds a 16-byte random token that proves a client mapped the right arena."""
TOKEN_BYTES = 16
SLOT_ALIGN = 4096
"""Slots are page aligned: copies run at full speed and O_DIRECT IO can use them as buffers."""


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def remove_stale_arenas(directory: str = "/dev/shm") -> int:
    """Unlink arenas left by daemons of this user that died without cleaning up (kill -9):
    their name carries the pid, and a pid that no longer runs cannot be using it."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "kvstore" or not parts[1].isdigit():
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed += 1
        except OSError:
            continue
    return removed


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer can still allocate in ``directory``'s filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class SharedMemoryArena:
    """Owns one shared-memory file, its descriptor and its mapping for the daemon's lifetime.

    ``path`` is what clients map; ``token`` (16 random bytes at offset 0) lets a client check that
    the file it mapped is this arena and not a stale one of the same name.

    Invariant: every page anyone touches is backed by the filesystem, so no touch can SIGBUS.
    With ``prefault`` every page is allocated up front (first touch of new memory costs 10-50x a
    copy on virtual machines); construction fails with ``OSError(ENOSPC)`` naming the directory
    and the sizes when ``directory`` cannot hold the whole arena. Without, only the header page
    is allocated here, and ``reserve_backing`` must be called for a range before any byte of it
    is handed out (``SlabAllocator`` does, per slab).
    """

    def __init__(self, size_bytes: int, prefault: bool = True, directory: str = "/dev/shm") -> None:
        if size_bytes <= HEADER_BYTES:
            raise ValueError(f"arena size {size_bytes} too small (header alone is {HEADER_BYTES})")
        self.size_bytes = _round_up(size_bytes, SLOT_ALIGN)
        self.directory = directory
        self.prefault = prefault
        remove_stale_arenas(directory)
        needed = self.size_bytes if prefault else HEADER_BYTES
        free = free_bytes(directory)
        if free < needed:
            raise OSError(errno.ENOSPC, self._no_room(needed, free))
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.path = os.path.join(directory, f"kvstore-{os.getpid()}-{secrets.token_hex(6)}")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(self._fd, self.size_bytes)
            # Allocates the pages now (tmpfs still zeroes each at its first touch). The daemon's
            # own mapping is not populated: it touches slot bytes only on the bytes path and
            # when moving blocks between tiers, and page tables cost 2 KiB per MiB per process.
            self._fallocate(0, needed)
            self._mmap = mmap.mmap(self._fd, self.size_bytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self._fd)
            os.unlink(self.path)
            raise
        self._mmap[:TOKEN_BYTES] = self.token  # the header page is backed: no SIGBUS
        self.view = memoryview(self._mmap)
        self._closed = False

    def _no_room(self, needed: int, free: int) -> str:
        return (
            f"{self.directory} has {free} bytes free, the cpu arena needs {needed} more "
            f"(arena of {self.size_bytes} bytes): free space in {self.directory}, enlarge it "
            "(mount -o remount,size=...) or lower the cpu tier's capacity"
        )

    def _fallocate(self, offset: int, nbytes: int) -> None:
        try:
            os.posix_fallocate(self._fd, offset, nbytes)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise OSError(errno.ENOSPC, self._no_room(nbytes, free_bytes(self.directory))) from e

    def reserve_backing(self, offset: int, nbytes: int) -> None:
        """Allocate the filesystem pages of ``[offset, offset + nbytes)`` so that touching them
        can never SIGBUS. Raises ``OSError(ENOSPC)`` naming the directory, the bytes free and
        needed when the filesystem is full (tmpfs undoes a failed fallocate: nothing leaks).
        A no-op for a prefaulted arena. Blocks: about 0.5 ms per MiB on the reference VM (8 ms
        for a 16 MiB slab); owned by the daemon's event loop like the allocator that calls it."""
        if not 0 <= offset <= offset + nbytes <= self.size_bytes:
            raise ValueError(f"range [{offset}, {offset + nbytes}) outside the arena")
        if not self.prefault and nbytes:
            self._fallocate(offset, nbytes)

    @property
    def buffer(self) -> mmap.mmap:
        """The whole mapping, for wrapping as one tensor (the GPU tier copies through it)."""
        return self._mmap

    def close(self) -> None:
        """Unmap and unlink. Clients that still map the file keep their pages until they unmap."""
        if self._closed:
            return
        self._closed = True
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:
            # A torch/numpy view still exports the buffer; the mapping goes when it is collected.
            pass
        os.close(self._fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclass
class _SizeClass:
    slot_bytes: int
    free: list[int] = field(default_factory=list)
    slabs: int = 0
    used: int = 0


class SlabAllocator:
    """Hands out slot offsets inside ``[HEADER_BYTES, arena_bytes)``.

    The usable region is cut into ``slab_bytes`` slabs. A size class (slot size rounded up to a
    page) takes a whole free slab when it runs out of slots and carves it into slots; a slab stays
    with its class once taken. ``allocate`` returns None when the class has no free slot and no
    slab is free: the caller then evicts a block of the same class and frees its slot.

    Owned by the daemon's event loop; not thread-safe.
    """

    def __init__(self, arena_bytes: int, slab_bytes: int) -> None:
        usable = (arena_bytes - HEADER_BYTES) // SLOT_ALIGN * SLOT_ALIGN
        if usable <= 0:
            raise ValueError(f"arena of {arena_bytes} bytes has no room for a slab")
        self.slab_bytes = min(_round_up(slab_bytes, SLOT_ALIGN), usable)
        # Slab i starts at HEADER_BYTES + i * slab_bytes; the last one may be shorter.
        self._slab_sizes = [self.slab_bytes] * (usable // self.slab_bytes)
        if usable % self.slab_bytes:
            self._slab_sizes.append(usable % self.slab_bytes)
        self._capacity = usable
        self._next_slab = 0
        self._classes: dict[int, _SizeClass] = {}

    @property
    def num_slabs(self) -> int:
        return len(self._slab_sizes)

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @staticmethod
    def slot_bytes_for(block_bytes: int) -> int:
        return _round_up(block_bytes, SLOT_ALIGN)

    def check_fits(self, block_bytes: int) -> None:
        """Raise ValueError unless a block of this size fits in one slab."""
        if self.slot_bytes_for(block_bytes) > self.slab_bytes:
            raise ValueError(
                f"a {block_bytes}-byte block does not fit a {self.slab_bytes}-byte slab; "
                "raise the cpu slab size (and capacity)"
            )

    def slots_per_slab(self, block_bytes: int) -> int:
        return self.slab_bytes // self.slot_bytes_for(block_bytes)

    def _class(self, block_bytes: int) -> _SizeClass:
        slot = self.slot_bytes_for(block_bytes)
        cls = self._classes.get(slot)
        if cls is None:
            cls = self._classes[slot] = _SizeClass(slot)
        return cls

    def allocate(self, block_bytes: int) -> int | None:
        cls = self._class(block_bytes)
        while not cls.free:
            if self._next_slab >= self.num_slabs:
                return None
            base = HEADER_BYTES + self._next_slab * self.slab_bytes
            count = self._slab_sizes[self._next_slab] // cls.slot_bytes
            self._next_slab += 1
            cls.slabs += 1
            # Reverse so slots are handed out in address order.
            cls.free.extend(base + i * cls.slot_bytes for i in range(count - 1, -1, -1))
        cls.used += 1
        return cls.free.pop()

    def free(self, offset: int, block_bytes: int) -> None:
        cls = self._classes.get(self.slot_bytes_for(block_bytes))
        if cls is None or cls.used <= 0:
            raise AssertionError(f"free of slot {offset} in a class with no slot in use")
        cls.used -= 1
        cls.free.append(offset)

    def free_slots(self, block_bytes: int) -> int:
        """Slots a class could still hand out without eviction (its own plus unassigned slabs)."""
        cls = self._class(block_bytes)
        unassigned = self.num_slabs - self._next_slab
        if unassigned == 0:
            return len(cls.free)
        # Every unassigned slab is full-size but perhaps the last: O(1), not a scan.
        last = self._slab_sizes[-1]
        return (
            len(cls.free)
            + (unassigned - 1) * (self.slab_bytes // cls.slot_bytes)
            + last // cls.slot_bytes
        )
