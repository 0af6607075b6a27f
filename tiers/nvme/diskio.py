"""Thread-side IO helpers of the NVMe tier: full preadv/pwritev, aligned scratch buffers, the
lz4 block codec between caller buffers, and the group-commit flush barrier."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvstore.tiers.nvme.ondisk import PAGE, round_up


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


def _load_lz4() -> tuple[Callable[..., int], Callable[..., int]] | None:
    """LZ4_compress_default and LZ4_decompress_safe from the lz4 package's own extension: they
    work between caller buffers (no per-call allocation of a block-sized result, whose page
    faults cost more than the codec here) and ctypes releases the GIL around them."""
    try:
        import lz4.block._block as ext

        lib = ctypes.CDLL(ext.__file__)
        fns = (lib.LZ4_compress_default, lib.LZ4_decompress_safe)
    except (ImportError, OSError, AttributeError):
        return None
    for fn in fns:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fns


_LZ4 = _load_lz4()


def lz4_compress(src: memoryview, dst: memoryview) -> int:
    """Compress into ``dst`` (lz4 block format); 0 when the result does not fit."""
    if _LZ4 is not None:
        return max(0, _LZ4[0](address(src), address(dst), src.nbytes, dst.nbytes))
    import lz4.block

    out = lz4.block.compress(src, store_size=False)
    if len(out) > dst.nbytes:
        return 0
    dst[: len(out)] = out
    return len(out)


def lz4_decompress(src: memoryview, dst: memoryview) -> bool:
    """Fill all of ``dst`` from ``src``; False for corrupt input or a wrong length."""
    if _LZ4 is not None:
        return bool(_LZ4[1](address(src), address(dst), src.nbytes, dst.nbytes) == dst.nbytes)
    import lz4.block

    try:
        out = lz4.block.decompress(src, uncompressed_size=dst.nbytes)
    except Exception:  # lz4.block.LZ4BlockError and friends: corrupt input is a miss
        return False
    if len(out) != dst.nbytes:
        return False
    dst[:] = out
    return True


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
