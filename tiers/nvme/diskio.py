"""Thread-side IO helpers of the NVMe tier: full preadv/pwritev, aligned scratch buffers, the
group-commit flush barrier. (The lz4 helpers live in ``kvstore.tiers.codecs``; they are
re-exported here for older callers.)"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvstore.tiers.codecs import lz4_compress, lz4_decompress
from kvstore.tiers.nvme.ondisk import PAGE, round_up

__all__ = ["FlushBarrier", "ScratchBuffers", "address", "lz4_compress", "lz4_decompress"]


def address(view: memoryview) -> int:
    """Address of a buffer's first byte (read-only buffers too, unlike ctypes.from_buffer)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """``bufs`` without its first ``n`` bytes (after a short preadv/pwritev)."""
    while n and n >= bufs[0].nbytes:
        n -= bufs[0].nbytes
        bufs = bufs[1:]
    if n:
        bufs = [bufs[0][n:], *bufs[1:]]
    return bufs


def pwrite_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    """Write all of ``bufs`` at ``offset``; a short write is continued, an error raised."""
    total = sum(b.nbytes for b in bufs)
    done = 0
    while done < total:
        n = os.pwritev(fd, bufs, offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev made no progress")
        done += n
        if done < total:
            bufs = _advance(bufs, n)


def pread_full(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Bytes read into ``bufs``; fewer than asked only at end of file."""
    total = sum(b.nbytes for b in bufs)
    done = 0
    while done < total:
        n = os.preadv(fd, bufs, offset + done)
        if n == 0:
            break
        done += n
        if done < total:
            bufs = _advance(bufs, n)
    return done


class ScratchBuffers(threading.local):
    """One page-aligned buffer per thread (anonymous mmap, so aligned for O_DIRECT), faulted in
    once and reused by every IO of that thread: first touch of new memory costs 10-50x a copy
    on these machines, so no IO allocates a block-sized buffer."""

    view: memoryview | None = None

    def get(self, nbytes: int) -> memoryview:
        view = self.view
        if view is None or view.nbytes < nbytes:
            size = round_up(max(nbytes, 16 * PAGE), 1 << 16)
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            view = self.view = memoryview(mmap.mmap(-1, size, flags=flags))
        return view


class FlushBarrier:
    """Group commit. ``await barrier()`` returns after an fdatasync that began after the call,
    so every write completed before the call is on stable storage. Callers arriving while a
    flush runs share the next one. Loop-only; the fdatasync runs on its own thread."""

    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self.fd = -1
        self.executor = executor
        self.flushes = 0
        self._running = False
        self._next: asyncio.Future[None] | None = None

    async def barrier(self) -> None:
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        waiters = self._next
        if not self._running:
            self._start()
        # Shielded: one cancelled caller must not cancel the flush the others wait on.
        await asyncio.shield(waiters)

    def _start(self) -> None:
        assert self._next is not None
        waiters, self._next = self._next, None
        self._running = True
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self.executor, os.fdatasync, self.fd)
        fut.add_done_callback(lambda f: self._done(f, waiters))

    def _done(self, fut: asyncio.Future[None], waiters: asyncio.Future[None]) -> None:
        self._running = False
        self.flushes += 1
        exc = fut.exception()
        if exc is not None:
            waiters.set_exception(exc)
            waiters.exception()  # retrieved here; every awaiting caller still gets it raised
        else:
            waiters.set_result(None)
        if self._next is not None:
            self._start()
