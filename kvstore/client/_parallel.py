"""Copies of large batches on two cores: this thread and one helper take blocks in turn.

A block's copy and its checksum (``copy_hashing_source`` / ``copy_hashing_copy``) run in numpy
and xxhash with the GIL released, so a second thread adds a core's worth of copying; memory
bandwidth, not one core, then bounds a batch of large blocks. The blocks are handed out one at
a time from a shared counter, never split in fixed halves: when the other core is busy (another
process), the helper is simply late and this thread copies the rest, waiting at the end for at
most the one block the helper holds (never spinning, unlike an OpenMP pool).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

SPLIT_MIN_BYTES = 4 << 20
"""A batch at least this large (and of two blocks or more) is split between two threads; a
smaller one costs less than handing work to a thread (~20-50 us)."""

_lock = threading.Lock()
_helper: ThreadPoolExecutor | None = None


def _forget_helper() -> None:
    # A forked child has no helper thread (only its parent's object): make a new one there.
    global _helper
    _helper = None


os.register_at_fork(after_in_child=_forget_helper)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_SPLIT = _cores() >= 2 and os.environ.get("KVSTORE_COPY_THREADS") != "1"
"""Whether to split at all (``KVSTORE_COPY_THREADS=1``: copy on the calling thread only)."""


def _pool() -> ThreadPoolExecutor:
    global _helper
    with _lock:
        if _helper is None:
            _helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-copy")
        return _helper


def each_block(n: int, batch_bytes: int, work: Callable[[int], object]) -> None:
    """Run ``work(i)`` for every ``i`` in ``range(n)``, on this thread and, for a large batch,
    one helper thread as well (each takes the next block). Returns when every block is done;
    an exception of ``work`` is raised here (the other thread stops taking blocks)."""
    if not _SPLIT or n < 2 or batch_bytes < SPLIT_MIN_BYTES:
        for i in range(n):
            work(i)
        return
    take = itertools.count().__next__  # atomic: one C call under the GIL
    failed = False

    def drain() -> None:
        nonlocal failed
        try:
            while not failed:
                i = take()
                if i >= n:
                    return
                work(i)
        except BaseException:
            failed = True
            raise

    helper: Future[None] = _pool().submit(drain)
    try:
        drain()
    finally:
        # Never return while the helper still writes into the caller's buffers.
        error = helper.exception()
    if error is not None:
        raise error
