"""The worker-side paged KV cache, as a serving engine keeps it.

Physical memory is ``num_blocks`` fixed-size blocks per layer (``kv_caches[l]`` is ``[2,
num_blocks, block_size, num_kv_heads, head_dim]``). A ``BlockAllocator`` owns which blocks are in
use, shared or cached; each live sequence has a ``BlockTable`` mapping its logical blocks to
physical ones. Sequences share blocks after ``fork`` (parallel sampling, beam search) and through
the prefix cache (blocks of identical prefixes, found by ``BlockKey``); a shared block is copied
before it is written (copy-on-write), so no sequence ever sees another's writes.

Life of a sequence::

    cached = cache.add_sequence(seq, prompt)      # reuses cached prefix blocks, allocates the rest
    for layer: cache.write_kv(seq, layer, cached, k, v)   # prefill the uncached tokens
    cache.commit(seq, len(prompt))                # K/V written in every layer: blocks shareable
    cache.append_tokens(seq, [next_token])        # decode: grow, copy-on-write a shared tail
    ...
    cache.free(seq)                               # blocks go back, tail of the chain first

FP8 (``KVLayout.fp8(layout)``, scale format ``block_head_f32``): blocks hold e4m3 values and
one float32 scale per (block, layer, K|V, KV head) in a row after the block's tokens
(``kvstore.kernels.reference``). ``write_kv`` and ``write_tail`` take K/V in any float dtype
and quantize them in the kernel (``write_kv_fp8``), growing a block's scales as tokens arrive;
``sequence_kv`` dequantizes; ``decode_attention`` runs ``paged_attention_fp8``, which
dequantizes as it reads. Copy-on-write, gather and the store move the scales with their block.

Concurrency: not thread-safe. One scheduler thread owns a cache, as in engines; kernels it
launches run on the tensors' device (CUDA: torch's current stream).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kvstore import kernels
from kvstore.errors import CapacityError
from kvstore.kernels import copy_blocks, gather_blocks, reference
from kvstore.keys import KEY_BYTES, BlockKey, block_hashes
from kvstore.layout import KVLayout

SeqId = Hashable

_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class AllocatorStateError(RuntimeError):
    """The allocator's books are out of sync with themselves: a bug, never a caller error."""


class BlockAllocator:
    """Owns the physical block ids ``0 .. num_blocks-1`` of one cache: their reference counts,
    the free queue and the prefix cache (key -> resident block).

    A block is in exactly one state:

    * in use: ``refcount > 0``; not in the free queue; may carry a key (committed, immutable).
    * cached: ``refcount == 0``, carries a key, in the free queue. ``lookup(key)`` finds it and
      ``touch`` takes it back into use; allocating it evicts it (drops the key).
    * free: ``refcount == 0``, no key, in the free queue.

    Invariants, checked by ``check_invariants`` and asserted where they are maintained (a broken
    one raises AllocatorStateError, it is never patched over): refcounts are never negative; a
    block is in the free queue exactly when its refcount is zero; a zero-reference block is free
    or cached, never both; ``key -> block`` and ``block -> key`` agree, one block per key.

    Free queue order (only this class touches its links): the head is allocated next. Free
    blocks sit before cached ones, since reusing them costs no prefix; cached blocks follow in
    the order their last reference was dropped, least recently used first. Callers free a
    sequence's blocks in reverse, so the tail of a chain becomes evictable before its prefix
    (a prefix is worth more: every longer prefix needs it).

    Allocation, free and touch are O(1) per block: the queue is an intrusive doubly linked list
    kept in two arrays, with a sentinel at index ``num_blocks``.
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._keys: list[BlockKey | None] = [None] * num_blocks
        self._by_key: dict[BlockKey, int] = {}
        sentinel = num_blocks
        # The queue starts as 0, 1, ..., num_blocks-1. next[sentinel] is the head, prev[sentinel]
        # the tail; -1 marks a block that is not in the queue.
        self._next = [*range(1, num_blocks + 1), 0]
        self._prev = [sentinel, *range(num_blocks)]
        self._queued = num_blocks
        self._queued_cached = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.evictions = 0

    # -- queue links (private: nothing else may touch them) ------------------------------------

    def _unlink(self, b: int) -> None:
        p, n = self._prev[b], self._next[b]
        if p < 0 or n < 0:
            raise AllocatorStateError(f"block {b} is not in the free queue but has refcount 0")
        self._next[p] = n
        self._prev[n] = p
        self._prev[b] = self._next[b] = -1
        self._queued -= 1

    def _push(self, b: int, front: bool) -> None:
        if self._prev[b] >= 0 or self._next[b] >= 0:
            raise AllocatorStateError(f"block {b} is already in the free queue")
        s = self.num_blocks
        p, n = (s, self._next[s]) if front else (self._prev[s], s)
        self._prev[b], self._next[b] = p, n
        self._next[p] = b
        self._prev[n] = b
        self._queued += 1

    def _check_id(self, b: int) -> None:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.num_blocks:
            raise ValueError(f"block id {b!r} out of range [0, {self.num_blocks})")

    # -- state ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks with no reference and no key."""
        return self._queued - self._queued_cached

    @property
    def num_cached(self) -> int:
        """Blocks with no reference that keep a key (reusable until evicted)."""
        return self._queued_cached

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self._queued

    @property
    def num_allocatable(self) -> int:
        """Free plus cached: what ``allocate`` can hand out, evicting cached blocks if needed."""
        return self._queued

    def refcount(self, b: int) -> int:
        self._check_id(b)
        return self._refs[b]

    def key_of(self, b: int) -> BlockKey | None:
        self._check_id(b)
        return self._keys[b]

    # -- operations ----------------------------------------------------------------------------

    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` blocks from the head of the free queue, refcount 1 each; all or nothing.

        A cached block taken here is evicted: its key is dropped from the prefix cache.
        Raises CapacityError, changing nothing, when fewer than ``n`` are free or cached.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self._queued:
            raise CapacityError(f"need {n} blocks, {self._queued} free or cached")
        out: list[int] = []
        for _ in range(n):
            b = self._next[self.num_blocks]
            if self._refs[b] != 0:
                raise AllocatorStateError(
                    f"block {b} at the queue head has refcount {self._refs[b]}"
                )
            self._unlink(b)
            key = self._keys[b]
            if key is not None:
                if self._by_key.pop(key, None) != b:
                    raise AllocatorStateError(f"cached block {b} missing from the key index")
                self._keys[b] = None
                self._queued_cached -= 1
                self.evictions += 1
            self._refs[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference per listed block (all or nothing). Blocks reaching zero join the
        queue: keyed ones at the tail (cached, evictable last), keyless ones at the head.
        Pass a sequence's blocks in reverse so the tail of its chain is evicted first."""
        blocks = list(blocks)
        for b, count in Counter(blocks).items():
            self._check_id(b)
            if self._refs[b] < count:
                raise ValueError(
                    f"block {b} has {self._refs[b]} references, {count} released (double free?)"
                )
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                keyed = self._keys[b] is not None
                self._push(b, front=not keyed)
                self._queued_cached += keyed

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference on each block; a cached block leaves the queue (a reuse).
        Only in-use or cached blocks can be shared: a free block holds no meaningful data."""
        blocks = list(blocks)
        for b in blocks:
            self._check_id(b)
            if self._refs[b] == 0 and self._keys[b] is None:
                raise ValueError(f"block {b} is free; only in-use or cached blocks can be shared")
        for b in blocks:
            if self._refs[b] == 0:
                self._unlink(b)
                self._queued_cached -= 1
            self._refs[b] += 1

    def lookup(self, key: BlockKey) -> int | None:
        """The resident block (in use or cached) holding ``key``'s content, if any."""
        self.prefix_queries += 1
        b = self._by_key.get(key)
        if b is not None:
            self.prefix_hits += 1
        return b

    def commit(self, b: int, key: BlockKey) -> bool:
        """Register in-use block ``b`` as holding ``key``'s content, making it findable by lookup.

        Committed blocks are immutable: a block keeps its first key. Returns False (and leaves
        ``b`` keyless) when another block already holds ``key``: one block per key.
        """
        self._check_id(b)
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes")
        if self._refs[b] == 0:
            raise ValueError(f"block {b} is not in use; only in-use blocks can be committed")
        current = self._keys[b]
        if current is not None:
            if current != key:
                raise ValueError(f"block {b} is already committed under another key")
            return True
        if key in self._by_key:
            return False
        self._keys[b] = key
        self._by_key[key] = b
        return True

    def check_invariants(self) -> None:
        """Walk every structure and raise AllocatorStateError on the first inconsistency."""
        s = self.num_blocks
        seen: set[int] = set()
        b, prev = self._next[s], s
        while b != s:
            if b in seen or not 0 <= b < s:
                raise AllocatorStateError(f"free queue revisits or leaves range at block {b}")
            if self._prev[b] != prev:
                raise AllocatorStateError(f"free queue link prev[{b}] != {prev}")
            seen.add(b)
            prev, b = b, self._next[b]
        if self._prev[s] != prev:
            raise AllocatorStateError("free queue tail link is out of sync")
        if len(seen) != self._queued:
            raise AllocatorStateError(
                f"free queue holds {len(seen)} blocks, counter {self._queued}"
            )
        cached = 0
        for b in range(s):
            ref, key = self._refs[b], self._keys[b]
            if ref < 0:
                raise AllocatorStateError(f"block {b} has negative refcount {ref}")
            if (ref == 0) != (b in seen):
                raise AllocatorStateError(f"block {b}: refcount {ref} but in queue = {b in seen}")
            if b not in seen and (self._prev[b] != -1 or self._next[b] != -1):
                raise AllocatorStateError(f"in-use block {b} keeps free-queue links")
            if key is not None and self._by_key.get(key) != b:
                raise AllocatorStateError(f"block {b}'s key does not map back to it")
            cached += ref == 0 and key is not None
        if cached != self._queued_cached:
            raise AllocatorStateError(f"{cached} cached blocks, counter {self._queued_cached}")
        for key, b in self._by_key.items():
            if not 0 <= b < s or self._keys[b] != key:
                raise AllocatorStateError(f"key index maps to block {b}, which holds another key")


@dataclass
class BlockTable:
    """One sequence's logical -> physical block map, owned by PagedKVCache.

    ``block_ids[i]`` holds tokens ``[i * block_size, (i + 1) * block_size)``; there are exactly
    ``ceil(num_tokens / block_size)`` entries. ``keys[i]`` is the key of full block i when known
    (the chain stops at the first block whose tokens are unknown); ``keys_derived`` says the
    cache derived them from its seed, so it may extend the chain as tokens arrive. The first
    ``num_committed`` blocks are committed (registered under their keys, or reused from the
    prefix cache): their content is final. ``token_ids`` is None once tokens of unknown identity
    were appended.
    """

    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    token_ids: list[int] | None = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)
    keys_derived: bool = False
    num_committed: int = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def copy(self) -> BlockTable:
        return BlockTable(
            self.block_size,
            list(self.block_ids),
            self.num_tokens,
            None if self.token_ids is None else list(self.token_ids),
            list(self.keys),
            self.keys_derived,
            self.num_committed,
        )


@dataclass(frozen=True)
class TailSlots:
    """Where the last token of each of ``n`` sequences goes (``PagedKVCache.tail_slots``):
    flat slots ``block * block_size + row``, and the blocks and rows themselves."""

    slots: torch.Tensor
    blocks: torch.Tensor
    rows: torch.Tensor
    n: int


@dataclass(frozen=True)
class PagedCacheStats:
    """A snapshot of a PagedKVCache: block states and counters since creation."""

    num_blocks: int
    num_free: int
    num_cached: int
    num_in_use: int
    num_sequences: int
    prefix_queries: int
    prefix_hits: int
    evictions: int
    cow_copies: int


def _raw(t: torch.Tensor) -> torch.Tensor:
    # Same bytes as an integer type: index_copy_ works for every dtype (float8 too), bit-exact.
    return t.view(_RAW[t.element_size()])


class PagedKVCache:
    """Owns one worker's paged KV memory: ``kv_caches`` (one ``[2, num_blocks, block_size,
    num_kv_heads, head_dim]`` tensor per layer, zero-initialised), the BlockAllocator over its
    blocks, and the BlockTable of every live sequence.

    Invariants (``check_invariants``): the allocator's own; every block's refcount equals the
    number of block-table entries naming it; each table has ``ceil(num_tokens / block_size)``
    blocks; committed blocks carry the key their table expects. Writes only ever land in blocks
    referenced by one table and not committed: shared blocks are copied first.

    With ``seed`` (a namespace seed, ``Namespace.seed``) keys are derived from token ids with the
    store's hash chain, so full blocks become reusable by later sequences with the same prefix;
    without it only keys passed to ``add_sequence`` are used.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: str | torch.device = "cpu",
        *,
        seed: bytes | None = None,
    ) -> None:
        if seed is not None and len(seed) != KEY_BYTES:
            raise ValueError(f"seed must be {KEY_BYTES} bytes, got {len(seed)}")
        self.allocator = BlockAllocator(num_blocks)
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.block_size = layout.block_size
        self.seed = seed
        shape = (2, num_blocks, layout.block_rows, layout.num_kv_heads, layout.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=layout.dtype, device=self.device)
            for _ in range(layout.num_layers)
        ]
        self._tables: dict[SeqId, BlockTable] = {}
        self.cow_copies = 0

    # -- sequences -----------------------------------------------------------------------------

    def add_sequence(
        self, seq_id: SeqId, token_ids: Sequence[int], keys: Sequence[BlockKey] | None = None
    ) -> int:
        """Give a new sequence blocks for ``token_ids``; returns how many leading tokens already
        have their K/V in the cache (reused prefix blocks), so prefill can start there.

        ``keys`` are the keys of the prompt's full blocks (or of a prefix of them); by default
        they are derived from ``seed`` when the cache has one. Reuse stops at the first key not
        resident, and leaves at least the last token to compute (the engine needs its logits).
        All or nothing: raises CapacityError, changing nothing, when blocks run short.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already exists")
        tokens = _token_list(token_ids)
        bs = self.block_size
        derived = keys is None and self.seed is not None
        if keys is None:
            keys = block_hashes(self.seed, tokens, bs) if self.seed is not None else []
        keys = list(keys)
        if len(keys) > len(tokens) // bs:
            raise ValueError(f"{len(keys)} keys for {len(tokens) // bs} full blocks of tokens")
        for i, k in enumerate(keys):
            if not isinstance(k, bytes) or len(k) != KEY_BYTES:
                raise ValueError(f"keys[{i}] must be {KEY_BYTES} bytes")
        hits: list[int] = []
        for key in keys[: max(len(tokens) - 1, 0) // bs]:
            b = self.allocator.lookup(key)
            if b is None:
                break
            hits.append(b)
        table = BlockTable(bs, token_ids=tokens, keys=keys, keys_derived=derived)
        needed = table.blocks_for(len(tokens)) - len(hits)
        revived = sum(1 for b in hits if self.allocator.refcount(b) == 0)
        if needed > self.allocator.num_allocatable - revived:
            raise CapacityError(
                f"sequence {seq_id!r} needs {needed} new blocks, "
                f"{self.allocator.num_allocatable - revived} free or cached"
            )
        self.allocator.touch(hits)
        table.block_ids = hits + self.allocator.allocate(needed)
        table.num_tokens = len(tokens)
        table.num_committed = len(hits)
        self._tables[seq_id] = table
        return len(hits) * bs

    def append_tokens(self, seq_id: SeqId, tokens: int | Sequence[int]) -> None:
        """Grow a sequence by ``tokens`` (a count, or the token ids, which keep its blocks
        hashable for prefix reuse). Allocates blocks as needed and copies a shared last block
        before it receives new tokens. All or nothing, like add_sequence."""
        table = self._table(seq_id)
        if isinstance(tokens, bool):
            raise ValueError("tokens must be a count or a sequence of token ids, got a bool")
        if isinstance(tokens, int):
            if tokens < 0:
                raise ValueError(f"cannot append {tokens} tokens")
            n, new_ids = tokens, None
        else:
            new_ids = _token_list(tokens)
            n = len(new_ids)
        if n == 0:
            return
        bs = self.block_size
        old_blocks = len(table.block_ids)
        needed = table.blocks_for(table.num_tokens + n) - old_blocks
        cow = table.num_tokens % bs != 0 and self.allocator.refcount(table.block_ids[-1]) > 1
        if needed + cow > self.allocator.num_allocatable:
            raise CapacityError(
                f"sequence {seq_id!r} needs {needed + cow} blocks, "
                f"{self.allocator.num_allocatable} free or cached"
            )
        if cow:
            self._copy_on_write(table, old_blocks - 1)
        table.block_ids += self.allocator.allocate(needed)
        table.num_tokens += n
        if new_ids is None or table.token_ids is None:
            table.token_ids = None
        else:
            table.token_ids += new_ids
            self._extend_keys(table)

    def fork(self, parent: SeqId, child: SeqId, *, share: bool = True) -> None:
        """Start ``child`` as a copy of ``parent`` sharing every block (refcount + 1 each).
        Whichever of them next writes a shared block copies it first.

        ``share=False`` gives the child private copies of every block instead (what an engine
        without copy-on-write does; kept to measure against). All or nothing: CapacityError."""
        if child in self._tables:
            raise ValueError(f"sequence {child!r} already exists")
        table = self._table(parent).copy()
        if share:
            self.allocator.touch(table.block_ids)
        else:
            if len(table.block_ids) > self.allocator.num_allocatable:
                raise CapacityError(
                    f"copying {parent!r} needs {len(table.block_ids)} blocks, "
                    f"{self.allocator.num_allocatable} free or cached"
                )
            copies = self.allocator.allocate(len(table.block_ids))
            copy_blocks(self.kv_caches, table.block_ids, copies)
            table.block_ids = copies  # keyless copies: only the originals are findable
        self._tables[child] = table

    def free(self, seq_id: SeqId) -> None:
        """Release a sequence's blocks, last block first so chain tails are evicted first."""
        table = self._table(seq_id)
        self.allocator.free(reversed(table.block_ids))
        del self._tables[seq_id]

    def commit(self, seq_id: SeqId, num_computed_tokens: int) -> int:
        """Declare tokens ``[0, num_computed_tokens)`` written in every layer; their full blocks
        that have keys become findable by later sequences. Returns the committed block count.

        Until then a block's content is not final, so no other sequence may reuse it.
        """
        table = self._table(seq_id)
        if not 0 <= num_computed_tokens <= table.num_tokens:
            raise ValueError(
                f"num_computed_tokens {num_computed_tokens} outside [0, {table.num_tokens}]"
            )
        full = min(num_computed_tokens // self.block_size, len(table.keys))
        for i in range(table.num_committed, full):
            # A lost race (another block already holds the key) leaves ours keyless: harmless.
            self.allocator.commit(table.block_ids[i], table.keys[i])
        table.num_committed = max(table.num_committed, full)
        return table.num_committed

    # -- K/V access ----------------------------------------------------------------------------

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> torch.Tensor:
        """Physical slot (``block * block_size + offset``) of tokens ``[start, end)``, int64 on
        the cache's device: where an attention layer writes those tokens' K and V."""
        table = self._table(seq_id)
        if not 0 <= start <= end <= table.num_tokens:
            raise ValueError(f"token range [{start}, {end}) outside [0, {table.num_tokens}]")
        pos = torch.arange(start, end, dtype=torch.int64)
        blocks = torch.tensor(table.block_ids, dtype=torch.int64)
        bs = self.block_size
        return (blocks[pos // bs] * bs + pos % bs).to(self.device)

    def write_kv(
        self, seq_id: SeqId, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write K and V (each ``[n, num_kv_heads, head_dim]``) of tokens ``[start, start + n)``
        into ``layer``. Shared blocks in the range are copied first (copy-on-write); writing a
        committed block raises ValueError, since committed content is immutable. An FP8 cache
        takes K/V in fp16, bf16 or fp32 and quantizes them; other caches take their dtype."""
        table = self._table(seq_id)
        lay = self.layout
        if not 0 <= layer < lay.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {lay.num_layers})")
        self._check_kv(k, v)
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k has {k.shape[0]} tokens, v {v.shape[0]}")
        end = start + k.shape[0]
        if not 0 <= start <= end <= table.num_tokens:
            raise ValueError(f"token range [{start}, {end}) outside [0, {table.num_tokens}]")
        if end == start:
            return
        bs = self.block_size
        touched = range(start // bs, (end - 1) // bs + 1)
        for i in touched:
            # Committed by this sequence or by one it shares the block with: content is final.
            if i < table.num_committed or self.allocator.key_of(table.block_ids[i]) is not None:
                raise ValueError(
                    f"tokens [{start}, {end}) fall in committed block {i} of {seq_id!r}; "
                    "committed blocks are immutable"
                )
        shared = [i for i in touched if self.allocator.refcount(table.block_ids[i]) > 1]
        if len(shared) > self.allocator.num_allocatable:
            raise CapacityError(f"copy-on-write of {len(shared)} blocks, not enough free blocks")
        for i in shared:
            self._copy_on_write(table, i)
        if lay.scaled:
            # Each touched block gets its rows of the range; a range ending before the
            # sequence does keeps the block's later tokens (valid rows).
            blocks = list(touched)
            lo = [max(start, i * bs) - i * bs for i in blocks]
            hi = [min(end, (i + 1) * bs) - i * bs for i in blocks]
            valid = [min(table.num_tokens, (i + 1) * bs) - i * bs for i in blocks]
            ids = [table.block_ids[i] for i in blocks]
            kernels.write_kv_fp8(
                self.kv_caches[layer], k.to(self.device), v.to(self.device), ids, lo, hi, valid
            )
            return
        slots = self.slot_mapping(seq_id, start, end)
        cache = _raw(self.kv_caches[layer]).view(2, -1, lay.num_kv_heads, lay.head_dim)
        cache[0].index_copy_(0, slots, _raw(k).to(self.device))
        cache[1].index_copy_(0, slots, _raw(v).to(self.device))

    def tail_slots(self, seq_ids: Sequence[SeqId]) -> TailSlots:
        """Where each sequence's last token goes, for ``write_tail`` in every layer of a decode
        step. Each last block must be private and uncommitted (``append_tokens`` copied it if
        it was shared), so the writes need no copy-on-write and no check per layer."""
        bs = self.block_size
        blocks, rows = [], []
        for s in seq_ids:
            t = self._table(s)
            if t.num_tokens == 0:
                raise ValueError(f"sequence {s!r} has no tokens")
            b = t.block_ids[-1]
            if self.allocator.refcount(b) != 1 or self.allocator.key_of(b) is not None:
                raise ValueError(f"last block of {s!r} is shared or committed; append first")
            blocks.append(b)
            rows.append((t.num_tokens - 1) % bs)
        if len(set(blocks)) != len(blocks):
            raise ValueError("two sequences end in the same block")
        bt = torch.tensor(blocks, dtype=torch.int64)
        rt = torch.tensor(rows, dtype=torch.int64)
        return TailSlots(
            (bt * bs + rt).to(self.device), bt.to(self.device), rt.to(self.device), len(blocks)
        )

    def write_tail(self, slots: TailSlots, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V (``[len(seq_ids), H, D]``) of the last token of the sequences that
        ``tail_slots`` planned, in ``layer``: one indexed copy, or one FP8 kernel launch."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.layout.num_layers})")
        self._check_kv(k, v)
        if k.shape[0] != slots.n or v.shape[0] != slots.n:
            raise ValueError(f"k/v have {k.shape[0]}/{v.shape[0]} tokens, {slots.n} sequences")
        if slots.n == 0:
            return
        lay = self.layout
        if lay.scaled:
            end = slots.rows + 1
            kernels.write_kv_fp8(
                self.kv_caches[layer], k, v, slots.blocks, slots.rows, end, end, check=False
            )
            return
        cache = _raw(self.kv_caches[layer]).view(2, -1, lay.num_kv_heads, lay.head_dim)
        cache[0].index_copy_(0, slots.slots, _raw(k))
        cache[1].index_copy_(0, slots.slots, _raw(v))

    def decode_attention(
        self,
        query: torch.Tensor,
        layer: int,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Decode attention of ``query`` ``[S, Hq, D]`` over ``layer`` (``paged_attention``, or
        ``paged_attention_fp8`` for an FP8 cache, which dequantizes as it reads)."""
        attend = kernels.paged_attention_fp8 if self.layout.scaled else kernels.paged_attention
        return attend(query, self.kv_caches[layer], block_tables, seq_lens, scale)

    def sequence_kv(
        self, seq_id: SeqId, layer: int, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a sequence's tokens in ``layer``, each ``[num_tokens, H, D]`` (a copy), in
        the cache's dtype, or cast to ``dtype``. An FP8 cache's are dequantized (float32 unless
        ``dtype`` says otherwise)."""
        table = self._table(seq_id)
        lay = self.layout
        if not 0 <= layer < lay.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {lay.num_layers})")
        if lay.scaled:
            ids = torch.tensor(table.block_ids, dtype=torch.int64)
            kv = reference.fp8_dequantize_blocks(self.kv_caches[layer], ids)
            kv = kv.reshape(2, -1, lay.num_kv_heads, lay.head_dim)[:, : table.num_tokens]
            out = kv if dtype is None else kv.to(dtype)
            return out[0], out[1]
        slots = self.slot_mapping(seq_id, 0, table.num_tokens)
        cache = _raw(self.kv_caches[layer]).view(2, -1, lay.num_kv_heads, lay.head_dim)
        k, v = cache[0].index_select(0, slots), cache[1].index_select(0, slots)
        k, v = k.view(lay.dtype), v.view(lay.dtype)
        return (k, v) if dtype is None else (k.to(dtype), v.to(dtype))

    def gather_sequence_blocks(self, seq_id: SeqId) -> torch.Tensor:
        """A sequence's blocks in store layout, ``[num_blocks, *layout.block_shape]`` (a copy)."""
        ids = self._table(seq_id).block_ids
        out = torch.empty(
            (len(ids), *self.layout.block_shape), dtype=self.layout.dtype, device=self.device
        )
        gather_blocks(self.kv_caches, ids, out)
        return out

    def block_table_tensor(self, seq_ids: Sequence[SeqId]) -> torch.Tensor:
        """``[len(seq_ids), max_blocks]`` int32 on the cache's device, for paged_attention.
        Rows are padded with block 0, which the kernels never read past a sequence's length."""
        tables = [self._table(s) for s in seq_ids]
        width = max((len(t.block_ids) for t in tables), default=0)
        rows = [t.block_ids + [0] * (width - len(t.block_ids)) for t in tables]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width).to(self.device)

    def seq_lens_tensor(self, seq_ids: Sequence[SeqId]) -> torch.Tensor:
        """``[len(seq_ids)]`` int32 token counts on the cache's device, for paged_attention."""
        lens = [self._table(s).num_tokens for s in seq_ids]
        return torch.tensor(lens, dtype=torch.int32).to(self.device)

    # -- introspection -------------------------------------------------------------------------

    def block_ids(self, seq_id: SeqId) -> list[int]:
        return list(self._table(seq_id).block_ids)

    def num_tokens(self, seq_id: SeqId) -> int:
        return self._table(seq_id).num_tokens

    def keys(self, seq_id: SeqId) -> list[BlockKey]:
        """Keys of the sequence's full blocks known so far (for offloading them to the store)."""
        return list(self._table(seq_id).keys)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def stats(self) -> PagedCacheStats:
        a = self.allocator
        return PagedCacheStats(
            num_blocks=self.num_blocks,
            num_free=a.num_free,
            num_cached=a.num_cached,
            num_in_use=a.num_in_use,
            num_sequences=len(self._tables),
            prefix_queries=a.prefix_queries,
            prefix_hits=a.prefix_hits,
            evictions=a.evictions,
            cow_copies=self.cow_copies,
        )

    def check_invariants(self) -> None:
        """The allocator's invariants, plus the tables' agreement with its refcounts and keys."""
        self.allocator.check_invariants()
        refs: Counter[int] = Counter()
        for seq_id, t in self._tables.items():
            if len(t.block_ids) != t.blocks_for(t.num_tokens):
                raise AllocatorStateError(
                    f"{seq_id!r}: {len(t.block_ids)} blocks for {t.num_tokens} tokens"
                )
            if t.num_committed > len(t.keys):
                raise AllocatorStateError(f"{seq_id!r}: more committed blocks than keys")
            for i in range(t.num_committed):
                key = self.allocator.key_of(t.block_ids[i])
                if key is not None and key != t.keys[i]:
                    raise AllocatorStateError(f"{seq_id!r}: block {i} holds another key")
            refs.update(t.block_ids)
        for b in range(self.num_blocks):
            if self.allocator.refcount(b) != refs[b]:
                raise AllocatorStateError(
                    f"block {b}: refcount {self.allocator.refcount(b)}, {refs[b]} table entries"
                )

    # -- internals -----------------------------------------------------------------------------

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        lay = self.layout
        want = (lay.num_kv_heads, lay.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != want:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be [n, {want[0]}, {want[1]}], got {got}")
            if lay.scaled:
                if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                    raise ValueError(f"{name} has dtype {t.dtype}; an FP8 cache quantizes floats")
            elif t.dtype != lay.dtype:
                raise ValueError(f"{name} has dtype {t.dtype}, cache {lay.dtype}")

    def _table(self, seq_id: SeqId) -> BlockTable:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence {seq_id!r}") from None

    def _copy_on_write(self, table: BlockTable, index: int) -> None:
        """Point ``table``'s block ``index`` at a private copy of it. Caller checked capacity."""
        old = table.block_ids[index]
        (new,) = self.allocator.allocate(1)
        copy_blocks(self.kv_caches, [old], [new])
        self.allocator.free([old])
        table.block_ids[index] = new
        self.cow_copies += 1

    def _extend_keys(self, table: BlockTable) -> None:
        """Derive keys of newly full blocks from the token ids, continuing the chain.

        Keys given by the caller may hash extra inputs (a LoRA id, an image) this cache cannot
        reproduce, so only a chain the cache derived itself from its seed is continued."""
        if not table.keys_derived or self.seed is None or table.token_ids is None:
            return
        bs = self.block_size
        full = table.num_tokens // bs
        have = len(table.keys)
        if full > have:
            prev = table.keys[-1] if table.keys else self.seed
            table.keys += block_hashes(prev, table.token_ids[have * bs : full * bs], bs)


def _token_list(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        return [int(t) for t in token_ids.tolist()]
    if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
        raise ValueError("token_ids must be a sequence of ints")
    out = []
    for i, t in enumerate(token_ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"token_ids[{i}] must be an int, got {type(t).__name__}")
        out.append(t)
    return out
