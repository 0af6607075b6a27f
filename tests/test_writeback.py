"""The write-back picker the GPU and NVMe paths share (``kvstore.daemon.writeback``): what a
tier writes down next. A tier's own tests (test_gpu_tier.py, test_nvme_service.py) show the
picks reach the disk or the CPU tier; these pin down the rule itself."""

from __future__ import annotations

from collections import deque

import pytest

from kvstore.daemon.writeback import bytes_to_clean, pick_writeback

MiB = 1 << 20


def test_bytes_to_clean_is_what_keeps_the_watermark() -> None:
    # 100 MiB at a 0.8 watermark keeps 20 MiB free or clean.
    assert bytes_to_clean(100 * MiB, 5 * MiB, 0.8) == pytest.approx(15 * MiB)
    assert bytes_to_clean(100 * MiB, 20 * MiB, 0.8) == pytest.approx(0, abs=1)
    assert bytes_to_clean(100 * MiB, 30 * MiB, 0.8) < 0


def test_the_eager_queue_goes_first_each_block_once_while_it_still_needs_the_write() -> None:
    eager = deque([3, 1, 3, 7, 2])
    done = {7}  # written another way meanwhile
    batch = pick_writeback(eager=eager, needs_write=lambda e: e not in done, limit=10)
    assert batch == [3, 1, 2]
    assert not eager


def test_a_batch_stops_at_its_limit_and_leaves_the_rest_queued() -> None:
    eager = deque(range(10))
    assert pick_writeback(eager=eager, needs_write=lambda e: True, limit=4) == [0, 1, 2, 3]
    assert list(eager) == [4, 5, 6, 7, 8, 9]


def test_write_through_picks_nothing_but_the_queue() -> None:
    asked = []
    batch = pick_writeback(
        eager=deque(),
        needs_write=lambda e: True,
        limit=8,
        eager_only=True,
        wanted=lambda: asked.append(1) or 10 * MiB,
        coldest=lambda: [1, 2, 3],
        bytes_of=lambda e: MiB,
    )
    assert batch == [] and asked == []


def test_past_the_watermark_the_coldest_dirty_blocks_go_until_enough_is_clean() -> None:
    dirty = {5, 6, 8, 9}
    batch = pick_writeback(
        eager=deque(),
        needs_write=dirty.__contains__,
        limit=8,
        wanted=lambda: 3 * MiB,
        coldest=lambda: [4, 5, 6, 7, 8, 9],  # coldest first; 4 and 7 are clean
        bytes_of=lambda e: 2 * MiB if e == 5 else MiB,
    )
    assert batch == [5, 6]  # 2 MiB + 1 MiB


def test_under_the_watermark_nothing_is_scanned() -> None:
    def coldest() -> list[int]:
        raise AssertionError("scanned a tier under its watermark")

    batch = pick_writeback(
        eager=deque(), needs_write=lambda e: True, limit=8, wanted=lambda: 0.0, coldest=coldest
    )
    assert batch == []


def test_the_scan_waits_for_the_eager_queue() -> None:
    batch = pick_writeback(
        eager=deque([42]),
        needs_write=lambda e: True,
        limit=8,
        wanted=lambda: 100 * MiB,
        coldest=lambda: [1, 2],
        bytes_of=lambda e: MiB,
    )
    assert batch == [42]
