"""kvstore.paged: the block allocator's states and order, block tables, prefix reuse,
copy-on-write, and a property test that no sequence ever sees another's writes."""

from __future__ import annotations

import importlib.util
import zlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore import kernels
from kvstore.errors import CapacityError
from kvstore.keys import BlockKey, Namespace
from kvstore.layout import KVLayout
from kvstore.paged import AllocatorStateError, BlockAllocator, PagedKVCache, SeqId

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)
SEED = Namespace("test-model", LAYOUT).seed


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "little"))


# -- BlockAllocator ----------------------------------------------------------------------------


def test_allocate_and_free_track_refcounts_and_states() -> None:
    a = BlockAllocator(4)
    blocks = a.allocate(3)
    assert blocks == [0, 1, 2]
    assert (a.num_free, a.num_cached, a.num_in_use) == (1, 0, 3)
    a.touch([1])
    assert a.refcount(1) == 2
    a.free([1, 0])
    assert (a.refcount(0), a.refcount(1)) == (0, 1)
    assert (a.num_free, a.num_in_use) == (2, 2)
    a.check_invariants()


def test_allocate_is_all_or_nothing() -> None:
    a = BlockAllocator(3)
    a.allocate(2)
    with pytest.raises(CapacityError, match="need 2 blocks, 1 free"):
        a.allocate(2)
    assert a.num_free == 1
    a.check_invariants()


def test_double_free_and_bad_ids_raise_without_changing_state() -> None:
    a = BlockAllocator(3)
    (b,) = a.allocate(1)
    with pytest.raises(ValueError, match="double free"):
        a.free([b, b])
    assert a.refcount(b) == 1
    with pytest.raises(ValueError, match="out of range"):
        a.free([3])
    with pytest.raises(ValueError, match="is free"):
        a.touch([2])
    a.free([b])
    with pytest.raises(ValueError, match="double free"):
        a.free([b])
    a.check_invariants()


def test_cached_block_is_found_by_key_and_revived_by_touch() -> None:
    a = BlockAllocator(3)
    (b,) = a.allocate(1)
    assert a.commit(b, key(1))
    a.free([b])
    assert (a.num_free, a.num_cached, a.num_in_use) == (2, 1, 0)
    assert a.lookup(key(1)) == b
    a.touch([b])
    assert (a.num_cached, a.refcount(b), a.key_of(b)) == (0, 1, key(1))
    assert (a.prefix_queries, a.prefix_hits) == (1, 1)
    a.check_invariants()


def test_free_blocks_are_allocated_before_cached_ones() -> None:
    a = BlockAllocator(3)
    x, y, z = a.allocate(3)
    a.commit(x, key(1))
    a.free([x])  # cached
    a.free([y])  # free, no key: should go first
    assert a.allocate(1) == [y]
    assert a.lookup(key(1)) == x
    a.free([z])
    assert a.allocate(1) == [z]
    assert a.evictions == 0
    assert a.allocate(1) == [x]  # only now is the cached block evicted
    assert a.evictions == 1 and a.lookup(key(1)) is None
    a.check_invariants()


def test_eviction_is_lru_and_takes_the_tail_of_a_chain_first() -> None:
    a = BlockAllocator(6)
    chain = a.allocate(3)
    for i, b in enumerate(chain):
        a.commit(b, key(i))
    other = a.allocate(3)
    for i, b in enumerate(other):
        a.commit(b, key(10 + i))
    a.free(reversed(chain))  # as PagedKVCache.free does
    a.free(reversed(other))
    order = a.allocate(6)
    assert order == [chain[2], chain[1], chain[0], other[2], other[1], other[0]]
    assert a.evictions == 6 and a.num_cached == 0


def test_commit_keeps_one_block_per_key_and_one_key_per_block() -> None:
    a = BlockAllocator(3)
    x, y = a.allocate(2)
    assert a.commit(x, key(1))
    assert a.commit(x, key(1))  # same key again: fine
    assert not a.commit(y, key(1))  # another block holds it
    assert a.key_of(y) is None
    with pytest.raises(ValueError, match="another key"):
        a.commit(x, key(2))
    with pytest.raises(ValueError, match="not in use"):
        a.commit(2, key(3))
    with pytest.raises(ValueError, match="32 bytes"):
        a.commit(y, BlockKey(b"short"))
    a.check_invariants()


@pytest.mark.parametrize("corrupt", ["negative ref", "lost from queue", "stale key", "counter"])
def test_check_invariants_catches_corruption(corrupt: str) -> None:
    a = BlockAllocator(4)
    x, y = a.allocate(2)
    a.commit(x, key(1))
    a.free([x])
    if corrupt == "negative ref":
        a._refs[y] = -1
    elif corrupt == "lost from queue":
        a._refs[x] = 1  # says in use, but the queue still links it
    elif corrupt == "stale key":
        a._keys[y] = key(9)
    else:
        a._queued_cached = 0
    with pytest.raises(AllocatorStateError):
        a.check_invariants()


# -- PagedKVCache ------------------------------------------------------------------------------


def kv_for(
    tokens: list[int], start: int, end: int, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of tokens[start:end] as a function of each token's whole prefix, as a model's are:
    two sequences with the same prefix produce the same K/V, so reused blocks must match."""
    rows = []
    for p in range(start, end):
        h = zlib.crc32(bytes(tokens[: p + 1])) % 65536
        rows.append(float(h) + 0.25 * torch.arange(LAYOUT.num_kv_heads * LAYOUT.head_dim))
    base = torch.stack(rows) if rows else torch.empty(0, LAYOUT.num_kv_heads * LAYOUT.head_dim)
    k = (base + 65536 * layer).reshape(-1, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return k, -k


def write_all(cache: PagedKVCache, seq: SeqId, tokens: list[int], start: int) -> None:
    for layer in range(LAYOUT.num_layers):
        k, v = kv_for(tokens, start, len(tokens), layer)
        cache.write_kv(seq, layer, start, k, v)


def visible_kv(cache: PagedKVCache, seq: SeqId) -> torch.Tensor:
    """A sequence's K/V gathered through its block table: [layers, 2, tokens, H, D]."""
    blocks = cache.gather_sequence_blocks(seq)  # [nblk, L, 2, bs, H, D]
    n = cache.num_tokens(seq)
    per_token = blocks.permute(1, 2, 0, 3, 4, 5).reshape(LAYOUT.num_layers, 2, -1, 2, 4)
    return per_token[:, :, :n]


def expected_kv(tokens: list[int]) -> torch.Tensor:
    layers = [torch.stack(kv_for(tokens, 0, len(tokens), lay)) for lay in range(LAYOUT.num_layers)]
    return torch.stack(layers)


def test_add_sequence_allocates_ceil_blocks_and_maps_slots() -> None:
    cache = PagedKVCache(LAYOUT, 8)
    assert cache.add_sequence("a", list(range(10))) == 0
    blocks = cache.block_ids("a")
    assert len(blocks) == 3
    slots = cache.slot_mapping("a", 3, 6)
    assert slots.tolist() == [blocks[0] * 4 + 3, blocks[1] * 4, blocks[1] * 4 + 1]
    assert cache.stats().num_in_use == 3
    with pytest.raises(ValueError, match="already exists"):
        cache.add_sequence("a", [1])
    with pytest.raises(ValueError, match="outside"):
        cache.slot_mapping("a", 5, 11)
    cache.check_invariants()


def test_write_then_read_back_through_the_block_table() -> None:
    cache = PagedKVCache(LAYOUT, 8)
    tokens = [3, 1, 4, 1, 5, 9, 2]
    cache.add_sequence(1, tokens)
    write_all(cache, 1, tokens, 0)
    assert torch.equal(visible_kv(cache, 1), expected_kv(tokens))
    k, v = cache.sequence_kv(1, 1)
    assert torch.equal(k, kv_for(tokens, 0, 7, 1)[0]) and torch.equal(v, -k)


def test_prefix_blocks_are_reused_only_after_commit() -> None:
    cache = PagedKVCache(LAYOUT, 16, seed=SEED)
    prompt = list(range(13))  # 3 full blocks + 1 token
    assert cache.add_sequence("a", prompt) == 0
    write_all(cache, "a", prompt, 0)
    assert cache.add_sequence("early", prompt) == 0  # not committed yet: no reuse
    cache.free("early")
    assert cache.commit("a", len(prompt)) == 3
    cached = cache.add_sequence("b", [*prompt[:12], 99, 100])
    assert cached == 12
    assert cache.block_ids("b")[:3] == cache.block_ids("a")[:3]
    write_all(cache, "b", [*prompt[:12], 99, 100], cached)
    assert torch.equal(visible_kv(cache, "b"), expected_kv([*prompt[:12], 99, 100]))
    cache.check_invariants()


def test_prefix_reuse_leaves_the_last_token_to_compute() -> None:
    cache = PagedKVCache(LAYOUT, 16, seed=SEED)
    prompt = list(range(8))  # exactly two full blocks
    cache.add_sequence("a", prompt)
    write_all(cache, "a", prompt, 0)
    cache.commit("a", 8)
    assert cache.add_sequence("b", prompt) == 4  # the engine needs the last token's logits


def test_freed_prefix_stays_cached_until_evicted_tail_first() -> None:
    cache = PagedKVCache(LAYOUT, 4, seed=SEED)
    prompt = list(range(12))
    cache.add_sequence("a", [*prompt, 0])  # 4 blocks, 3 full
    write_all(cache, "a", [*prompt, 0], 0)
    cache.commit("a", 13)
    chain = cache.block_ids("a")
    cache.free("a")
    s = cache.stats()
    assert (s.num_free, s.num_cached, s.num_in_use) == (1, 3, 0)
    cache.add_sequence("x", [7] * 8)  # needs 2 blocks: the free one, then the chain's tail
    assert cache.block_ids("x") == [chain[3], chain[2]]
    assert cache.stats().evictions == 1
    cache.free("x")
    assert cache.add_sequence("b", [*prompt[:8], 5]) == 8  # blocks 0 and 1 survived
    assert cache.block_ids("b")[:2] == chain[:2]
    cache.check_invariants()


def test_fork_shares_blocks_and_append_copies_the_shared_tail() -> None:
    cache = PagedKVCache(LAYOUT, 8)
    tokens = [1, 2, 3, 4, 5, 6]  # one full block + a partial one
    cache.add_sequence("p", tokens)
    write_all(cache, "p", tokens, 0)
    cache.fork("p", "c")
    assert cache.block_ids("c") == cache.block_ids("p")
    assert [cache.allocator.refcount(b) for b in cache.block_ids("p")] == [2, 2]
    cache.append_tokens("c", [7])
    p_blocks, c_blocks = cache.block_ids("p"), cache.block_ids("c")
    assert c_blocks[0] == p_blocks[0] and c_blocks[1] != p_blocks[1]
    assert cache.stats().cow_copies == 1
    child = [*tokens, 7]
    write_all(cache, "c", child, 6)
    cache.append_tokens("p", [8])  # parent's tail is no longer shared: no copy
    assert cache.stats().cow_copies == 1
    write_all(cache, "p", [*tokens, 8], 6)
    assert torch.equal(visible_kv(cache, "c"), expected_kv(child))
    assert torch.equal(visible_kv(cache, "p"), expected_kv([*tokens, 8]))
    cache.check_invariants()


def test_fork_without_sharing_copies_every_block() -> None:
    cache = PagedKVCache(LAYOUT, 5, seed=SEED)
    tokens = [1, 2, 3, 4, 5, 6]
    cache.add_sequence("p", tokens)
    write_all(cache, "p", tokens, 0)
    cache.commit("p", 6)
    cache.fork("p", "c", share=False)
    p_blocks, c_blocks = cache.block_ids("p"), cache.block_ids("c")
    assert not set(p_blocks) & set(c_blocks)
    assert [cache.allocator.refcount(b) for b in p_blocks + c_blocks] == [1, 1, 1, 1]
    assert torch.equal(visible_kv(cache, "c"), visible_kv(cache, "p"))
    assert cache.allocator.key_of(c_blocks[0]) is None  # only the original is findable
    cache.append_tokens("c", [7])  # its tail is private: nothing to copy
    assert cache.stats().cow_copies == 0
    with pytest.raises(CapacityError):  # 1 block free, 2 needed: nothing changes
        cache.fork("c", "d", share=False)
    assert "d" not in cache and cache.stats().num_free == 1
    cache.check_invariants()


def test_write_into_a_shared_block_copies_it_first() -> None:
    cache = PagedKVCache(LAYOUT, 8)
    tokens = [1, 2, 3]
    cache.add_sequence("p", tokens)
    write_all(cache, "p", tokens, 0)
    cache.fork("p", "c")
    k = torch.full((1, 2, 4), 7.0)
    cache.write_kv("c", 0, 2, k, -k)
    assert cache.block_ids("c") != cache.block_ids("p")
    assert torch.equal(visible_kv(cache, "p"), expected_kv(tokens))
    assert torch.equal(visible_kv(cache, "c")[0, 0, 2], k[0])
    assert torch.equal(visible_kv(cache, "c")[:, :, :2], expected_kv(tokens)[:, :, :2])


def test_committed_blocks_are_immutable() -> None:
    cache = PagedKVCache(LAYOUT, 8, seed=SEED)
    tokens = list(range(6))
    cache.add_sequence("a", tokens)
    write_all(cache, "a", tokens, 0)
    cache.commit("a", 6)
    k = torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="committed"):
        cache.write_kv("a", 0, 3, k, k)
    cache.write_kv("a", 0, 5, k, k)  # the partial block is not committed


def test_capacity_errors_change_nothing() -> None:
    cache = PagedKVCache(LAYOUT, 3)
    cache.add_sequence("a", list(range(6)))
    before = cache.stats()
    with pytest.raises(CapacityError):
        cache.add_sequence("b", list(range(9)))
    with pytest.raises(CapacityError):
        cache.append_tokens("a", 7)
    assert cache.stats() == before and "b" not in cache and cache.num_tokens("a") == 6
    cache.check_invariants()


def test_bad_sequence_calls_raise_value_error() -> None:
    cache = PagedKVCache(LAYOUT, 4)
    cache.add_sequence("a", [1, 2])
    k = torch.zeros(1, 2, 4)
    cases = [
        (lambda: cache.free("nope"), "unknown sequence"),
        (lambda: cache.fork("a", "a"), "already exists"),
        (lambda: cache.append_tokens("a", -1), "cannot append"),
        (lambda: cache.write_kv("a", 2, 0, k, k), "layer 2"),
        (lambda: cache.write_kv("a", 0, 2, k, k), "outside"),
        (lambda: cache.write_kv("a", 0, 0, k.half(), k.half()), "dtype"),
        (lambda: cache.write_kv("a", 0, 0, k[:, :1], k[:, :1]), "must be"),
        (lambda: cache.commit("a", 3), "outside"),
        (lambda: cache.add_sequence("b", [1.5]), "must be an int"),  # type: ignore[list-item]
        (lambda: cache.add_sequence("b", [1] * 4, keys=[key(1), key(2)]), "2 keys for 1"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    cache.check_invariants()


def test_decode_keys_continue_the_chain_the_store_computes() -> None:
    from kvstore.keys import block_hashes

    cache = PagedKVCache(LAYOUT, 8, seed=SEED)
    tokens = list(range(6))
    cache.add_sequence("a", tokens)
    cache.append_tokens("a", [6, 7, 8])
    assert cache.keys("a") == block_hashes(SEED, [*tokens, 6, 7, 8], 4)
    cache.append_tokens("a", 3)  # unknown tokens end the chain
    assert len(cache.keys("a")) == 2


def test_paged_attention_over_the_cache_equals_dense_attention() -> None:
    cache = PagedKVCache(LAYOUT, 16)
    gen = torch.Generator().manual_seed(0)
    lens = {"a": 9, "b": 1, "c": 16}
    for seq, n in lens.items():
        cache.add_sequence(seq, list(range(n)))
        for layer in range(2):
            kv = torch.randn(2, n, 2, 4, generator=gen)
            cache.write_kv(seq, layer, 0, kv[0], kv[1])
    seqs = list(lens)
    query = torch.randn(3, 4, 4, generator=gen)  # 4 query heads over 2 KV heads
    out = kernels.paged_attention(
        query, cache.kv_caches[1], cache.block_table_tensor(seqs), cache.seq_lens_tensor(seqs), 0.5
    )
    for i, seq in enumerate(seqs):
        k, v = cache.sequence_kv(seq, 1)
        q = query[i][None, :, None]
        want = F.scaled_dot_product_attention(
            q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=0.5, enable_gqa=True
        )
        torch.testing.assert_close(out[i], want[0, :, 0])


# -- property test: random allocate / fork / append / write / free -----------------------------


class PagedCacheMachine(RuleBasedStateMachine):
    """Drives a small cache (12 blocks of 4 tokens) with random sequences over a two-token
    vocabulary, so prefixes collide often. After every step: the invariants hold, and every
    sequence sees exactly its own K/V through its block table."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCache(LAYOUT, 12, seed=SEED)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _counts(self) -> tuple[int, int, int]:
        s = self.cache.stats()
        return (s.num_free, s.num_cached, s.num_in_use)

    @rule(prompt=st.lists(st.integers(0, 1), min_size=0, max_size=14))
    def add(self, prompt: list[int]) -> None:
        seq, before = self._new_id(), self._counts()
        try:
            cached = self.cache.add_sequence(seq, prompt)
        except CapacityError:
            assert self._counts() == before and seq not in self.cache
            return
        self.tokens[seq] = list(prompt)
        write_all(self.cache, seq, prompt, cached)
        self.cache.commit(seq, len(prompt))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        self.cache.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 1), min_size=1, max_size=6))
    def append(self, data: st.DataObject, new: list[int]) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self._counts()
        try:
            self.cache.append_tokens(seq, new)
        except CapacityError:
            assert self._counts() == before
            return
        start = len(self.tokens[seq])
        self.tokens[seq] += new
        write_all(self.cache, seq, self.tokens[seq], start)
        self.cache.commit(seq, len(self.tokens[seq]))

    @precondition(lambda self: any(len(t) % 4 for t in self.tokens.values()))
    @rule(data=st.data(), junk=st.floats(-1e6, -1.0, width=32))
    def overwrite_partial_tail(self, data: st.DataObject, junk: float) -> None:
        """Write foreign values into a sequence's uncommitted tail (copy-on-write if shared),
        check nobody else sees them, then restore the true values."""
        seq = data.draw(st.sampled_from(sorted(s for s, t in self.tokens.items() if len(t) % 4)))
        tokens = self.tokens[seq]
        start = len(tokens) - len(tokens) % 4
        k = torch.full((len(tokens) - start, 2, 4), junk)
        try:
            self.cache.write_kv(seq, 0, start, k, k)
        except CapacityError:
            return
        assert bool((visible_kv(self.cache, seq)[0, 0, start:] == junk).all())
        self._check_contents(skip=seq)
        write_all(self.cache, seq, tokens, start)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.free(seq)
        del self.tokens[seq]

    def _check_contents(self, skip: int | None = None) -> None:
        for seq, tokens in self.tokens.items():
            if seq != skip:
                assert torch.equal(visible_kv(self.cache, seq), expected_kv(tokens)), seq

    @invariant()
    def consistent(self) -> None:
        self.cache.check_invariants()
        s = self.cache.stats()
        assert s.num_free + s.num_cached + s.num_in_use == s.num_blocks
        self._check_contents()


PagedCacheMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_paged_cache_state_machine = PagedCacheMachine.TestCase


# -- CUDA --------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and CuPy")
def test_cuda_cache_fork_copy_on_write() -> None:
    layout = KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16
    )
    cache = PagedKVCache(layout, 8, device="cuda")
    kv = torch.randn(2, 20, 2, 64, device="cuda").bfloat16()
    cache.add_sequence("p", list(range(20)))
    for layer in range(2):
        cache.write_kv("p", layer, 0, kv[0], kv[1])
    cache.fork("p", "c")
    cache.append_tokens("c", [1])  # copies the shared partial block on the GPU
    new = torch.randn(2, 1, 2, 64, device="cuda").bfloat16()
    cache.write_kv("c", 0, 20, new[0], new[1])
    k_p, _ = cache.sequence_kv("p", 0)
    k_c, _ = cache.sequence_kv("c", 0)
    assert (
        torch.equal(k_p, kv[0]) and torch.equal(k_c[:20], kv[0]) and torch.equal(k_c[20], new[0, 0])
    )
    cache.check_invariants()
