"""Eviction policies: one contract every policy passes, plus what makes each one itself."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.policy import (
    POLICIES,
    EvictionPolicy,
    LinkedQueue,
    LruPolicy,
    PrefixAwareLruPolicy,
    PriorityLruPolicy,
    make_policy,
)


def never(_: int) -> bool:
    return False


@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest) -> EvictionPolicy:
    return make_policy(request.param)


class TestContract:
    """What the store relies on from any policy."""

    def test_evict_is_all_or_nothing(self, policy: EvictionPolicy) -> None:
        for eid in range(5):
            policy.insert(eid)
        assert policy.evict(6, never) is None
        assert policy.evict(0, never) == []
        victims = policy.evict(5, never)
        assert victims is not None and sorted(victims) == list(range(5))

    def test_protected_ids_are_never_chosen(self, policy: EvictionPolicy) -> None:
        for eid in range(10):
            policy.insert(eid)
        leased = {0, 1, 2, 7}
        victims = policy.evict(6, lambda e: e in leased)
        assert victims is not None and not set(victims) & leased
        assert policy.evict(7, lambda e: e in leased) is None

    def test_evict_does_not_remove(self, policy: EvictionPolicy) -> None:
        for eid in range(3):
            policy.insert(eid)
        policy.evict(2, never)
        assert len(policy) == 3

    def test_removed_ids_are_gone(self, policy: EvictionPolicy) -> None:
        for eid in range(4):
            policy.insert(eid)
        policy.remove(0)
        policy.remove(3)
        assert sorted(policy.order()) == [1, 2]
        with pytest.raises(AssertionError):
            policy.remove(0)

    def test_a_batch_removed_at_once_is_gone_and_the_rest_keeps_its_order(
        self, policy: EvictionPolicy
    ) -> None:
        for eid in range(6):
            policy.insert(eid)
        policy.touch([1])
        kept = [e for e in policy.order() if e not in (0, 3, 5)]
        policy.remove_many([0, 5, 3])  # an eviction's batch, head and tail among it
        assert list(policy.order()) == kept and len(policy) == 3
        with pytest.raises(AssertionError):
            policy.remove_many([2, 3])  # 3 is gone: a broken invariant, not a no-op

    def test_double_insert_is_a_broken_invariant(self, policy: EvictionPolicy) -> None:
        policy.insert(1)
        with pytest.raises(AssertionError):
            policy.insert(1)

    def test_cold_before_hot(self, policy: EvictionPolicy) -> None:
        for eid in range(4):
            policy.insert(eid)
        policy.touch([0])
        assert policy.evict(1, never) == [1]

    @given(st.lists(st.tuples(st.sampled_from("itr"), st.integers(0, 30)), max_size=200))
    @settings(max_examples=60, deadline=None)
    def test_order_matches_a_model(self, ops: list[tuple[str, int]]) -> None:
        for name in POLICIES:
            p = make_policy(name)
            present: set[int] = set()
            for op, eid in ops:
                if op == "i" and eid not in present:
                    p.insert(eid)
                    present.add(eid)
                elif op == "r" and eid in present:
                    p.remove(eid)
                    present.discard(eid)
                elif op == "t" and eid in present:
                    p.touch([eid])
            order = list(p.order())
            assert sorted(order) == sorted(present) and len(order) == len(present) == len(p)


def test_lru_batch_touch_keeps_the_batch_order() -> None:
    p = LruPolicy()
    for eid in range(4):
        p.insert(eid)
    p.touch([3, 2])  # 2 touched last: hottest
    assert list(p.order()) == [0, 1, 3, 2]


def test_prefix_aware_evicts_the_tail_of_a_chain_first() -> None:
    p = PrefixAwareLruPolicy()
    chain = [10, 11, 12, 13]  # prefix order: 10 is the system prompt's block
    for eid in chain:
        p.insert(eid)
    p.touch(chain)
    assert p.evict(2, never) == [13, 12]
    plain = LruPolicy()
    for eid in chain:
        plain.insert(eid)
    plain.touch(chain)
    assert plain.evict(2, never) == [10, 11]  # plain LRU would drop the shared head first


def test_priority_goes_lowest_first_then_lru() -> None:
    p = PriorityLruPolicy()
    p.insert(1, priority=5)  # a pinned system prompt
    p.insert(2, priority=0)
    p.insert(3, priority=0)
    p.touch([1])
    p.touch([2])
    assert p.evict(2, never) == [3, 2]
    assert p.evict(3, never) == [3, 2, 1]
    with pytest.raises(ValueError, match="priority"):
        p.insert(9, priority=300)


def test_unknown_policy_name() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo")


def test_linked_queue_orders_and_grows() -> None:
    q = LinkedQueue()
    for eid in (5000, 3, 70):
        q.push_tail(eid)
    q.move_to_tail(5000)
    assert list(q) == [3, 70, 5000]
    q.unlink(70)
    assert list(q) == [3, 5000] and q.size == 2 and 70 not in q


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(POLICIES)),
    before=st.lists(st.integers(0, 40), unique=True, max_size=12),
    batch=st.lists(st.integers(41, 3000), unique=True, min_size=1, max_size=40),
    priority=st.integers(0, 3),
    touched=st.lists(st.integers(0, 40), max_size=6),
)
def test_inserting_a_batch_as_touched_is_insert_then_touch(
    name: str, before: list[int], batch: list[int], priority: int, touched: list[int]
) -> None:
    """A commit inserts its batch in one pass (``insert_touched``): the eviction order is the
    one ``insert`` of each id and then ``touch`` of the batch gives, whatever was queued."""
    one, many = make_policy(name), make_policy(name)
    for p in (one, many):
        for i, eid in enumerate(before):
            p.insert(eid, i % 3)
        p.touch([e for e in touched if e in before])
    for eid in batch:
        one.insert(eid, priority)
    one.touch(batch)
    many.insert_touched(batch, [priority] * len(batch))
    assert list(many.order()) == list(one.order()) and len(many) == len(one)
    mixed = make_policy(name)  # several priorities in one batch: the same, one id at a time
    mixed.insert_touched(batch, [i % 2 for i in range(len(batch))])
    assert sorted(mixed.order()) == sorted(batch)


def test_a_batch_with_a_queued_id_changes_nothing() -> None:
    q = LinkedQueue()
    q.push_tail(5)
    with pytest.raises(AssertionError):
        q.push_tail_many([7, 5])
    with pytest.raises(AssertionError):
        q.push_tail_many([7, 7])
    assert list(q) == [5] and q.size == 1
    q.push_tail_many([9, 2000])
    assert list(q) == [5, 9, 2000] and q.tail == 2000
