"""Unkeyed reservations in the block index (``add_unkeyed_many`` / ``key_many``): a spare slot's
entry that gets its key only when a Bind names it, without the deleted slot that re-keying a
placeholder leaves in the namespace's key map (which then outgrows its keys)."""

from __future__ import annotations

import os
import sys

import pytest

from kvstore.index import BlockIndex, State


def keys(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def test_unkeyed_entries_are_invisible_until_keyed() -> None:
    index = BlockIndex()
    eids = index.add_unkeyed_many(3, 1, [4096, 8192], 7)
    assert len(index) == 0 and index.entries_of(3) == 0 and not index.ids_of(3)
    assert [index.state[e] for e in eids] == [State.RESERVED] * 2
    assert [index.offset[e] for e in eids] == [4096, 8192] and index.priority[eids[0]] == 7
    with pytest.raises(AssertionError, match="has no key"):
        index.key(eids[0])
    ks = keys(2)
    index.key_many(eids, ks)
    assert len(index) == 2 and dict(index.ids_of(3)) == dict(zip(ks, eids, strict=True))
    assert index.key(eids[1]) == ks[1] and index.has_key(eids[0], 3, ks[0])
    index.commit(eids[0], 99)
    assert index.get(3, ks[0]) == eids[0] and index.checksum[eids[0]] == 99


def test_key_many_refuses_and_keys_nothing() -> None:
    index = BlockIndex()
    present = keys(1)
    keyed = index.add_many(present, 3, 1, [4096], 0)
    spare = index.add_unkeyed_many(3, 1, [8192, 12288], 0)
    fresh = keys(2)
    for eids, ks, why in (
        (spare, [fresh[0], present[0]], "to the key of entry"),  # indexed already
        (spare, [fresh[0], fresh[0]], "twice"),
        ([spare[0], spare[0]], fresh, "twice"),
        ([spare[0], keyed[0]], fresh, "not an unkeyed reservation"),
    ):
        with pytest.raises(AssertionError, match=why):
            index.key_many(eids, ks)
        assert len(index) == 1 and index.ids_of(3).keys() == set(present)
        assert all(not index.has_key(e, 3, k) for e in spare for k in fresh)
    index.drop(spare[0])  # an unkeyed entry goes like any other, its id recycled
    assert index.state[spare[0]] == State.FREE and len(index) == 1
    again = index.add_unkeyed_many(3, 1, [16384], 0)
    assert again == [spare[0]]
    index.key_many(again + spare[1:], fresh)
    assert len(index) == 3


def test_keying_spare_entries_keeps_the_key_map_as_small_as_adding_keys() -> None:
    """250,000 keys put through spare entries, 128 a call: the key map is the size it has when
    the keys are added directly (re-keying placeholder keys, as spare entries once were, made
    it twice that: a deleted slot left behind per key)."""
    n, batch = 250_000, 128
    ks = keys(n)
    direct, spared = BlockIndex(), BlockIndex()
    for i in range(0, n, batch):
        part = ks[i : i + batch]
        offsets = [4096] * len(part)
        direct.add_many(part, 1, 1, offsets, 0)
        spared.key_many(spared.add_unkeyed_many(1, 1, offsets, 0), part)
    size = sys.getsizeof
    assert dict(spared.ids_of(1)) == dict(direct.ids_of(1))
    assert size(spared.ids_of(1)) == size(direct.ids_of(1))
