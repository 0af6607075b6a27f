"""The block index gives the C heap's free pages back as it grows (``kvstore.index``'s module
docstring): when its capacity first passes ``TRIM_FROM`` and then each time it has grown by
``TRIM_GROWTH``, through ``add`` and ``add_many`` alike, and never while entries only churn."""

from __future__ import annotations

import itertools
import os

import pytest

import kvstore.index as index_module
from kvstore.index import TRIM_FROM, TRIM_GROWTH, BlockIndex


def test_the_heap_is_trimmed_at_each_step_of_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    at: list[int] = []
    index = BlockIndex()
    monkeypatch.setattr(index_module, "trim_heap", lambda: at.append(index.capacity))
    n = 0
    while n < 3 * TRIM_FROM:
        if n % 1024:  # one key at a time, now and then
            index.add(os.urandom(32), 1, 1, n * 4096, 0)
            n += 1
        else:
            index.add_many([os.urandom(32) for _ in range(128)], 1, 1, [-1] * 128, 0)
            n += 128
    assert at, "never trimmed"
    assert TRIM_FROM < at[0] <= TRIM_FROM + 128
    for before, after in itertools.pairwise(at):
        assert int(before * TRIM_GROWTH) < after <= int(before * TRIM_GROWTH) + 128
    assert index.capacity < int(at[-1] * TRIM_GROWTH) + 128
    # Churn reuses entry ids: the capacity does not grow, nothing is trimmed.
    trims = len(at)
    eids = index.keyed()[:5000]
    for eid in eids:
        index.drop(eid)
    for _ in eids:
        index.add(os.urandom(32), 1, 1, 0, 0)
    assert len(at) == trims and index.capacity == n
    monkeypatch.undo()
    index_module.trim_heap()  # the real call: glibc's malloc_trim, or a no-op without it
