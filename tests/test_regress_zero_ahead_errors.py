"""The daemon's slab-clearing thread (``ZeroAhead``) through errors, on real slab files.

An unexpected error while clearing one file ends that file's pass, is logged once, and the
thread goes on with the next file; an EINVAL from ``MADV_POPULATE_WRITE`` turns the clearing
off only where the kernel never took the call.
"""

from __future__ import annotations

import errno
import logging

import pytest

from kvstore.tiers import cpu_arena
from kvstore.tiers.cpu import HEADER_BYTES, SharedMemoryArena, SlabAllocator

MiB = 1 << 20
SLAB = 4 * MiB
CHUNK = 1 * MiB  # four chunks a slab file: a failure can land mid-file


def _arena_of_two_slabs() -> tuple[SharedMemoryArena, SlabAllocator]:
    arena = SharedMemoryArena(HEADER_BYTES + 2 * SLAB, huge_pages=False)
    alloc = SlabAllocator(arena.size_bytes, SLAB, back=arena.back, prefault=True)
    arena.slab_bytes = alloc.slab_bytes
    return arena, alloc


def _thread_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name == cpu_arena.__name__ and r.levelno >= logging.WARNING
    ]


def test_an_unexpected_error_ends_one_files_pass_and_the_thread_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first file's second chunk raises (as a ctypes call can, with an ArgumentError):
    one warning names that file and the error, its last two chunks are never tried, the
    second file is cleared whole, ``wait`` returns, and a slab file made afterwards is
    cleared too (the thread lives on). Before, the thread died with the error, ``wait``
    timed out and no slab was cleared again."""
    monkeypatch.setattr(cpu_arena, "ZERO_CHUNK_BYTES", CHUNK)
    fill = cpu_arena._populate_write
    calls: list[int] = []

    def second_call_raises(addr: int, size: int) -> int:
        calls.append(size)
        if len(calls) == 2:
            raise RuntimeError("injected fault in the fill")
        return fill(addr, size)

    monkeypatch.setattr(cpu_arena, "_populate_write", second_call_raises)
    caplog.set_level(logging.WARNING, logger=cpu_arena.__name__)
    arena, alloc = _arena_of_two_slabs()
    try:
        first_uid = arena._files[HEADER_BYTES].uid
        assert arena.zero_ahead.wait(30)
        assert arena.zero_ahead.supported
        assert len(calls) == 2 + SLAB // CHUNK  # the failed file's pass ended at the error
        assert arena.zero_ahead.cleared_bytes == CHUNK + SLAB
        (record,) = _thread_warnings(caplog)
        assert record.levelno == logging.WARNING
        message = record.getMessage()
        assert f"slab file {first_uid}" in message
        assert "injected fault in the fill" in message
        thread = arena.zero_ahead._thread
        assert thread is not None and thread.is_alive()

        arena.back(HEADER_BYTES, SLAB, 1)  # slab 0 passes to another domain: a new file
        assert arena.zero_ahead.wait(30)
        assert arena.zero_ahead.cleared_bytes == CHUNK + 2 * SLAB
        assert len(_thread_warnings(caplog)) == 1
        alloc.check()
    finally:
        arena.close()


def test_an_einval_after_a_fill_succeeded_ends_one_files_pass(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The kernel knows ``MADV_POPULATE_WRITE`` once a call of it succeeded: an EINVAL after
    that (a chunk gone from under the fill) ends that file's pass and leaves the clearing on,
    so the next file is cleared whole. Before, any EINVAL turned it off for good."""
    monkeypatch.setattr(cpu_arena, "ZERO_CHUNK_BYTES", CHUNK)
    fill = cpu_arena._populate_write
    calls: list[int] = []

    def second_call_einval(addr: int, size: int) -> int:
        calls.append(size)
        if len(calls) == 2:
            return errno.EINVAL
        return fill(addr, size)

    monkeypatch.setattr(cpu_arena, "_populate_write", second_call_einval)
    caplog.set_level(logging.WARNING, logger=cpu_arena.__name__)
    arena, alloc = _arena_of_two_slabs()
    try:
        assert arena.zero_ahead.wait(30)
        assert arena.zero_ahead.supported
        assert len(calls) == 2 + SLAB // CHUNK
        assert arena.zero_ahead.cleared_bytes == CHUNK + SLAB
        assert not _thread_warnings(caplog)  # an expected end of a pass, not an error

        arena.back(HEADER_BYTES, SLAB, 1)  # a file made after it is cleared as well
        assert arena.zero_ahead.wait(30)
        assert arena.zero_ahead.cleared_bytes == CHUNK + 2 * SLAB
        alloc.check()
    finally:
        arena.close()


def test_a_thread_ended_by_what_no_pass_catches_releases_waiters_and_is_restarted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Should the thread end anyway (a ``SystemExit`` out of a pass, which ends a thread
    silently), it says so, ``wait`` does not hang on the files it left, and the next new
    slab file starts another thread, which clears it."""
    real_clear = cpu_arena.ZeroAhead._clear
    ended: list[int] = []

    def first_pass_exits(self: cpu_arena.ZeroAhead, f: cpu_arena.SlabFile, fd: int) -> None:
        if not ended:
            ended.append(f.uid)
            raise SystemExit
        real_clear(self, f, fd)

    monkeypatch.setattr(cpu_arena.ZeroAhead, "_clear", first_pass_exits)
    caplog.set_level(logging.WARNING, logger=cpu_arena.__name__)
    arena, alloc = _arena_of_two_slabs()
    try:
        assert arena.zero_ahead.wait(30)
        assert ended
        assert arena.zero_ahead.cleared_bytes <= SLAB  # the second file: maybe, if not yet queued
        (record,) = _thread_warnings(caplog)
        assert record.levelno == logging.ERROR

        before = arena.zero_ahead.cleared_bytes
        arena.back(HEADER_BYTES, SLAB, 1)  # a new file: a new thread clears it
        assert arena.zero_ahead.wait(30)
        assert arena.zero_ahead.cleared_bytes == before + SLAB
        thread = arena.zero_ahead._thread
        assert thread is not None and thread.is_alive()
        alloc.check()
    finally:
        arena.close()
