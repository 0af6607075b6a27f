"""The block index's batch insert: the same entries as one ``add`` each."""

from __future__ import annotations

import pytest

from kvstore.index import IN_CPU, BlockIndex, State


def _fields(index: BlockIndex, eid: int) -> tuple[object, ...]:
    return (
        index.key(eid),
        index.state[eid],
        index.tier[eid],
        index.priority[eid],
        index.ns[eid],
        index.leases[eid],
        index.offset[eid],
        index.disk[eid],
        index.checksum[eid],
    )


def test_a_batch_add_makes_the_entries_one_add_each_would() -> None:
    one, many = BlockIndex(), BlockIndex()
    for index in (one, many):  # recycled ids first, then new ones
        for i in range(3):
            index.add(bytes([i]) * 32, 1, IN_CPU, 4096 * i, 0)
        index.commit(1, 77)
        index.drop(1)
        index.drop(0)
    keys = [bytes([10 + i]) * 32 for i in range(4)]
    offsets = [8192 * (i + 1) for i in range(4)]
    singles = [one.add(k, 2, IN_CPU, o, 9) for k, o in zip(keys, offsets, strict=True)]
    batch = many.add_many(keys, 2, IN_CPU, offsets, 9)
    assert batch == singles and len(many) == len(one) == 5
    for eid in batch:
        assert _fields(many, eid) == _fields(one, eid)
        assert many.state[eid] == State.RESERVED and many.checksum[eid] == 0
    assert [many.get(2, k) for k in keys] == batch


def test_a_batch_with_an_indexed_or_repeated_key_adds_nothing() -> None:
    index = BlockIndex()
    index.add(b"a" * 32, 1, IN_CPU, 0, 0)
    for keys in ([b"b" * 32, b"a" * 32], [b"c" * 32, b"c" * 32]):
        with pytest.raises(AssertionError):
            index.add_many(keys, 1, IN_CPU, [4096, 8192], 0)
    with pytest.raises(AssertionError):
        index.add_many([b"d" * 32, b"d" * 32], 5, IN_CPU, [4096, 8192], 0)
    assert len(index) == 1 and index.get(1, b"b" * 32) is None and index.entries_of(5) == 0
    assert index.ids_of(5) == {}


def test_a_batch_drop_forgets_each_entry_and_stops_at_a_leased_one() -> None:
    index = BlockIndex()
    eids = [index.add(bytes([i]) * 32, 1, IN_CPU, 4096 * i, 0) for i in range(4)]
    index.add_lease(eids[2])
    with pytest.raises(AssertionError, match="leases"):
        index.drop_many([eids[0], eids[1], eids[2], eids[3]])  # a reader holds entry 2
    assert [index.get(1, bytes([i]) * 32) for i in range(4)] == [None, None, eids[2], eids[3]]
    assert index.state[eids[0]] == index.state[eids[1]] == State.FREE and len(index) == 2
    # The dropped ids are recycled, as one drop each would leave them.
    assert sorted(index.add_many([b"x" * 32, b"y" * 32], 1, IN_CPU, [0, 4096], 0)) == eids[:2]
