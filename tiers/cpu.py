"""The CPU tier's mechanism: a shared-memory arena of fixed-size slots.

The daemon creates one file under ``/dev/shm`` (tmpfs), maps it shared and hands its path to
same-host clients, which map it too and copy blocks straight into and out of slots: a block
crosses memory once. The arena is carved into slabs; each slab holds slots of one size, so
layouts of different block sizes can share one arena without fragmenting it.

This module knows nothing of keys, leases or eviction policy: it hands out and takes back slot
offsets. The daemon's store decides which block lives in which slot and which one goes.
"""

from __future__ import annotations

import contextlib
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


class SharedMemoryArena:
    """Owns one shared-memory file and its mapping for the daemon's lifetime.

    ``path`` is what clients map; ``token`` (16 random bytes at offset 0) lets a client check that
    the file it mapped is this arena and not a stale one of the same name. Pages are allocated and
    mapped up front when ``prefault`` is set, because first touch of new memory costs 10-50x a
    copy on virtual machines.
    """

    def __init__(self, size_bytes: int, prefault: bool = True, directory: str = "/dev/shm") -> None:
        if size_bytes <= HEADER_BYTES:
            raise ValueError(f"arena size {size_bytes} too small (header alone is {HEADER_BYTES})")
        self.size_bytes = _round_up(size_bytes, SLOT_ALIGN)
        remove_stale_arenas(directory)
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.path = os.path.join(directory, f"kvstore-{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.size_bytes)
            if prefault:
                # Allocates (and zeroes) every page now. The daemon's own mapping is not
                # populated: it touches slot bytes only on the bytes path and when moving
                # blocks between tiers, and page tables cost 2 KiB per MiB per process.
                os.posix_fallocate(fd, 0, self.size_bytes)
            self._mmap = mmap.mmap(fd, self.size_bytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self._mmap[:TOKEN_BYTES] = self.token
        self.view = memoryview(self._mmap)
        self._closed = False

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
