"""The CPU tier's memory: ``SharedMemoryArena``, one range of the daemon's address space whose
slabs are each their own unnamed, sealed shared-memory file (``SlabFile``), backed before any slot
in them is handed out; and the arena's layout (``HEADER_BYTES``, ``SLOT_ALIGN``). Which slot of
which slab is free is ``kvstore.tiers.cpu.SlabAllocator``'s; see ``kvstore.tiers.cpu`` for the
tier as a whole. Imports nothing of ours.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import secrets
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)

HEADER_BYTES = 4096
"""Offset 0 holds a 16-byte random token that proves a client mapped the right arena."""
TOKEN_BYTES = 16
_MAP_NORESERVE = 0x4000
SLOT_ALIGN = 4096
"""Slots are page aligned: copies run at full speed and O_DIRECT IO can use them as buffers."""


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


MEMORY_RESERVE_BYTES = 256 << 20
"""Backing a slab is refused (a CapacityError, never the kernel's OOM killer) when it would
leave less memory than this available to the rest of the machine."""


def _check_memory(size: int) -> None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
            else:
                return
    except OSError:
        return
    if available - size < MEMORY_RESERVE_BYTES:
        raise OSError(
            errno.ENOMEM,
            f"{available} bytes of memory available, a slab needs {size} and "
            f"{MEMORY_RESERVE_BYTES} stay free",
        )


class SlabFile:
    """One slab's memory: an unnamed, sealed shared-memory file (``memfd``).

    ``uid`` is never reused within a daemon's life: a client's mapping of an older file of the
    same slab can never alias a newer one (see ``SharedMemoryArena.address``)."""

    __slots__ = ("domain", "fd", "retired", "size", "uid")

    def __init__(self, fd: int, uid: int, domain: int, size: int) -> None:
        self.fd, self.uid, self.domain, self.size = fd, uid, domain, size
        self.retired = False  # its pages punched, its descriptor closed (``_retire``)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
]  # fmt: skip
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FIXED = 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; not in Python 3.11's mmap module
SHMEM_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def shmem_thp_mode(setting: str) -> str:
    """The selected mode of a ``shmem_enabled`` file's text (``"always within_size [advise]
    never deny force"`` -> ``"advise"``); ``"never"`` when none is marked."""
    for word in setting.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "never"


def huge_pages_on_advice() -> bool:
    """Whether the kernel gives shared memory transparent huge pages only where asked
    (``shmem_enabled`` is ``advise``), so that a slab must ask for them. With ``always`` or
    ``within_size`` every slab gets them unasked; with ``never`` or ``deny`` none can."""
    try:
        with open(SHMEM_THP_SETTING, encoding="ascii") as f:
            return shmem_thp_mode(f.read()) == "advise"
    except OSError:
        return False


def populate_huge(fd: int, size: int) -> None:
    """Allocate a new slab file's pages as transparent huge pages where the kernel has them:
    through a mapping advised ``MADV_HUGEPAGE`` (``posix_fallocate`` has no mapping to be
    advised through, so it allocates 4 KiB pages). Huge pages stay with the file, so every
    client maps a slab with one page-table entry per 2 MiB instead of 512: mapping a 48 MiB
    slab took 27 ms with 4 KiB pages and 0.1 ms with huge ones here. Best effort: a kernel
    without ``MADV_POPULATE_WRITE`` (before 5.14), or memory that cannot be had, leaves the
    rest to ``posix_fallocate``, which decides whether the slab is backed."""
    try:  # the mapping too: one that cannot be made (address space, map count) is no refusal
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED) as m:
            m.madvise(mmap.MADV_HUGEPAGE)
            m.madvise(_MADV_POPULATE_WRITE)
    except OSError:
        pass


def _populate_write(addr: int, size: int) -> int:
    """Fault ``[addr, addr + size)`` of a mapping in writable; 0, or the errno. Through ctypes,
    which releases the GIL for the call."""
    if _libc.madvise(addr, size, _MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno() or errno.EINVAL


ZERO_CHUNK_BYTES = 16 << 20
"""Pages one ``madvise`` of the zeroing thread clears (~5 ms): a retired slab or ``close`` stops
it within one chunk. Between chunks the thread takes the GIL for a few microseconds; fewer,
larger chunks keep it from holding the GIL when preempted (it runs at nice 19) more often."""


class ZeroAhead:
    """Clears the pages of new slab files on a background thread, ahead of the clients.

    ``posix_fallocate`` of a shared-memory file allocates its pages but leaves them unwritten:
    the kernel clears each page at its first fault, in whichever process faults it first. Left
    to the clients, the first to map a slab pays it: ~0.4 ms per MiB here on top of ~0.05-0.08
    ms of page tables, 5-6x a memcpy of the MiB. This thread faults every page of each
    new file once (``MADV_POPULATE_WRITE`` through a mapping of its own, unmapped after),
    in the order slabs were backed, which is the order the allocator hands them out (lowest
    first), so a client's first write into a slab builds page tables only.

    Costs: no memory beyond what ``posix_fallocate`` already allocated (the pages exist; they
    are only cleared), none of it left in the daemon's RSS (a chunk is mapped while it is
    faulted in, then unmapped: at most 16 MiB at a time), and about 0.3 ms of one core per MiB
    of tier, in the background: a 1 GiB tier is ready ~0.3 s after start, a 64 GiB one ~20 s
    (a client that outruns it clears its pages itself, as before). The thread calls the kernel
    through ctypes, which releases the GIL, so the daemon's event loop runs meanwhile, and it
    runs at nice 19, behind the daemon's other threads. Populating never changes a page's
    bytes: a page already written (a client that got there first) keeps them. Best effort: a
    kernel without ``MADV_POPULATE_WRITE`` (before 5.14: EINVAL before any call of it
    succeeded) turns it off (``supported``); a chunk that cannot be mapped or populated (an
    EINVAL once a call succeeded included) ends that file's pass, and so does an unexpected
    error, logged once as a warning naming the file. The thread then goes on with the next
    file: it ends only with ``stop`` (should it end otherwise, it logs an error, releases
    ``wait``, and the next ``add`` starts another).
    """

    def __init__(self) -> None:
        self._queue: collections.deque[SlabFile] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = False
        self._stopped = False
        self.supported = True
        self._populated = False  # a populate succeeded: this kernel knows MADV_POPULATE_WRITE
        self.cleared_bytes = 0
        """Bytes of slab this thread faulted in (each file's once)."""

    def add(self, f: SlabFile) -> None:
        """Queue a new file (event loop). Starts the thread on first use."""
        with self._cv:
            if self._stopped or not self.supported:
                return
            self._queue.append(f)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvstore-zero-ahead", daemon=True
                )
                self._thread.start()
            self._cv.notify()

    def retire(self, f: SlabFile) -> None:
        """Mark ``f`` retired before its descriptor is closed: the thread never maps it after,
        and stops clearing it within one chunk if it is at it."""
        with self._cv:
            f.retired = True

    def wait(self, timeout_s: float) -> bool:
        """Block until every queued file is done (for tests and benchmarks); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._queue.clear()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        # Behind the daemon's own threads: the clearing waits while the loop has work (start-up,
        # calls), rather than taking a core from it.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            self._serve()
        except BaseException:  # logged here, in full: the thread ends all the same
            log.error(
                "slab clearing thread ended; new slabs are left to the clients", exc_info=True
            )
        finally:
            with self._cv:
                self._busy = False
                if not self._stopped:  # not ``stop``: forget what it left, the next add restarts
                    self._queue.clear()
                    self._thread = None
                self._cv.notify_all()

    def _serve(self) -> None:
        """Clear queued files until ``stop``. An unexpected error ends that file's pass only."""
        while True:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
                while not self._queue and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                f = self._queue.popleft()
                if f.retired:
                    continue
                try:
                    fd = os.dup(f.fd)  # under the lock: ``retire`` closes f.fd only after it
                except OSError as e:  # out of descriptors: the clients clear this one
                    self._failed(f, e)
                    continue
                self._busy = True
            try:
                self._clear(f, fd)
            except Exception as e:
                self._failed(f, e)
            finally:
                with contextlib.suppress(OSError):
                    os.close(fd)

    @staticmethod
    def _failed(f: SlabFile, e: BaseException) -> None:
        log.warning(
            "clearing slab file %d (%d bytes) ahead failed, its pages are left to the clients: %r",
            f.uid,
            f.size,
            e,
            exc_info=e,
        )

    def _clear(self, f: SlabFile, fd: int) -> None:
        """Fault ``f``'s pages in one chunk at a time, each through a mapping of its own (at most
        one chunk of it mapped at once, in this process)."""
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        for start in range(0, f.size, ZERO_CHUNK_BYTES):
            if self._stopped or f.retired:
                return
            n = min(ZERO_CHUNK_BYTES, f.size - start)
            addr = _libc.mmap(None, n, prot, mmap.MAP_SHARED, fd, start)
            if addr in (None, _MAP_FAILED):
                return  # no address space now: the clients clear these pages, as before
            try:
                err = _populate_write(addr, n)
            finally:
                _libc.munmap(addr, n)
            if not err:
                self._populated = True
            if f.retired:
                # Retired during the fill: its pages were freed, maybe before this fill ended,
                # which then allocated some again. ``retire`` marks the file before freeing, so
                # freeing this chunk once more here leaves none behind.
                _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, start, n)
                return
            if err:
                if err == errno.EINVAL and not self._populated:
                    self.supported = False  # no MADV_POPULATE_WRITE in this kernel
                return  # after a success, EINVAL is this file's (a chunk gone): its pass ends
            self.cleared_bytes += n


class SharedMemoryArena:
    """The CPU tier's memory: one contiguous range of the daemon's address space whose slabs
    are each backed by their own unnamed shared-memory file.

    Why per-slab files (and not one file under ``/dev/shm``): a client is handed, as a file
    descriptor over the unix socket (``kvstore.daemon.session``), exactly the slabs of the
    memory domains (tenants) it may use, read-only where it may only read. A name under
    ``/dev/shm`` could be opened by anyone with the permissions; an unnamed file is reachable
    only through a descriptor. A slab that passes to another domain gets a new file (and a new
    ``uid``) and its old file's pages are freed (punched), so a client that still maps it sees
    zeros, never the new domain's blocks. Files are sealed against shrinking and growing: a
    client holding a writable descriptor cannot truncate a slab under the daemon (which would
    SIGBUS it).

    The daemon keeps one mapping of the whole range (``view``, ``buffer``): offsets are the
    same as they were with one file, slab files are mapped over their slab's range
    (``MAP_FIXED``) as they are made. Never SIGBUS: a slab's pages are allocated
    (``posix_fallocate``) before any slot in it is handed out, and a failure is an OSError
    naming the sizes, which the allocator turns into "this slab cannot be used".
    When slabs are backed (all at start-up, or as first assigned) is the allocator's
    ``prefault``. ``huge_pages`` (default: where the kernel's ``shmem_enabled`` is
    ``advise``) allocates a slab's pages as huge pages first (``populate_huge``). Every new
    slab file's pages are then cleared in the background (``zero_ahead``, a ``ZeroAhead``),
    so that a client mapping it builds page tables only.
    """

    def __init__(self, size_bytes: int, huge_pages: bool | None = None) -> None:
        if size_bytes <= HEADER_BYTES:
            raise ValueError(f"arena size {size_bytes} too small (header alone is {HEADER_BYTES})")
        self.size_bytes = round_up(size_bytes, SLOT_ALIGN)
        self.token = secrets.token_bytes(TOKEN_BYTES)
        # Private anonymous memory reserves the address range (untouched, it costs nothing);
        # each slab's file replaces its part of it.
        self._mmap = mmap.mmap(
            -1, self.size_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        )
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        self._mmap[:TOKEN_BYTES] = self.token
        self.view = memoryview(self._mmap)
        self._files: dict[int, SlabFile] = {}  # slab base offset -> its file
        self._by_uid: dict[int, tuple[int, SlabFile]] = {}  # uid -> (base, file)
        self._next_uid = 1
        self.slab_bytes = 0  # set by the allocator's owner (``CpuSlots``)
        self.huge_pages = huge_pages_on_advice() if huge_pages is None else huge_pages
        self.zero_ahead = ZeroAhead()
        self._closed = False

    def back(self, base: int, size: int, domain: int) -> None:
        """Make ``[base, base + size)`` (one slab) hold backed memory of ``domain``: a no-op if
        its file already is; else a new file (allocated, sealed, mapped over the range), and
        the old file's pages freed. Raises OSError naming the sizes when memory cannot back it
        (the old file is then gone too: the slab holds no block)."""
        if not 0 <= base <= base + size <= self.size_bytes:
            raise ValueError(f"range [{base}, {base + size}) outside the arena")
        old = self._files.get(base)
        if old is not None and old.domain == domain:
            return
        if old is not None:
            self._retire(base, old)
        fd = os.memfd_create(f"kvstore-slab-{base}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            # Owner-only (a memfd is made 0777): a client of another uid handed a read-only
            # descriptor could otherwise reopen it read-write through /proc/self/fd.
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            try:
                _check_memory(size)
                if self.huge_pages:
                    populate_huge(fd, size)
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                code = e.errno or errno.ENOMEM
                raise OSError(
                    code,
                    f"cannot back a {size}-byte slab of the cpu arena ({e.strerror or e}): "
                    "the machine is out of memory for shared memory; lower the cpu tier's "
                    "capacity",
                ) from e
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            addr = _libc.mmap(
                self._base + base,
                size,
                mmap.PROT_READ | mmap.PROT_WRITE,
                mmap.MAP_SHARED | _MAP_FIXED,
                fd,
                0,
            )
            if addr in (None, _MAP_FAILED):
                err = ctypes.get_errno()
                raise OSError(err, f"mapping a slab of the cpu arena failed: {os.strerror(err)}")
        except BaseException:
            os.close(fd)
            raise
        f = SlabFile(fd, self._next_uid, domain, size)
        self._next_uid += 1
        self._files[base] = f
        self._by_uid[f.uid] = (base, f)
        self.zero_ahead.add(f)

    def _retire(self, base: int, f: SlabFile) -> None:
        """Free a file's pages (clients still mapping it read zeros, never a SIGBUS: its size
        is sealed) and forget it. The daemon's range keeps the file mapped until the next one
        replaces it."""
        self.zero_ahead.retire(f)
        _libc.fallocate(f.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, f.size)
        os.close(f.fd)
        del self._files[base]
        del self._by_uid[f.uid]

    def backs(self, base: int, domain: int) -> bool:
        """Whether the slab at ``base`` already holds backed memory of ``domain``."""
        f = self._files.get(base)
        return f is not None and f.domain == domain

    def address(self, offset: int) -> int:
        """The address a client is given for arena ``offset``: the slab file's uid in the high
        32 bits, the offset inside the slab in the low 32. A client maps files by uid, so an
        address can never reach memory other than the file it names."""
        base = HEADER_BYTES + (offset - HEADER_BYTES) // self.slab_bytes * self.slab_bytes
        f = self._files[base]
        return (f.uid << 32) | (offset - base)

    def addresses(self, offsets: Sequence[int], on_gpu: Sequence[bool] | None = None) -> list[int]:
        """``address`` of each offset, in one pass (a batch's replies name every slot); an
        offset below 0, or one ``on_gpu`` marks (a GPU pool slot), is passed on as it is."""
        header, slab, files = HEADER_BYTES, self.slab_bytes, self._files
        out = []
        for i, offset in enumerate(offsets):
            if offset < 0 or (on_gpu is not None and on_gpu[i]):
                out.append(offset)
                continue
            base = header + (offset - header) // slab * slab
            out.append((files[base].uid << 32) | (offset - base))
        return out

    def file(self, uid: int) -> tuple[int, SlabFile] | None:
        """(base offset, file) of a live slab file, None if ``uid`` was retired or never was."""
        return self._by_uid.get(uid)

    def export(self, uid: int, writable: bool) -> int:
        """A new descriptor of slab file ``uid`` (the caller sends and closes it): read-write,
        or read-only (reopened through ``/proc/self/fd``, so it cannot be mapped writable)."""
        found = self._by_uid.get(uid)
        if found is None:
            raise KeyError(uid)
        fd = found[1].fd
        if writable:
            return os.dup(fd)
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)

    @property
    def buffer(self) -> mmap.mmap:
        """The whole mapping, for wrapping as one tensor (the GPU tier copies through it)."""
        return self._mmap

    def close(self) -> None:
        """Unmap and close every slab file. Clients that still map a file keep its pages until
        they unmap."""
        if self._closed:
            return
        self._closed = True
        self.zero_ahead.stop()
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:
            # A torch/numpy view still exports the buffer; the mapping goes when it is collected.
            pass
        for f in self._files.values():
            os.close(f.fd)
        self._files.clear()
        self._by_uid.clear()
