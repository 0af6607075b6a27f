"""The FAST'25 trace at storage level, and the caches a replay of it is measured against.

* ``load_trace``: the requests of a Mooncake FAST'25 trace (``synthetic_trace.jsonl.gz``; one
  JSON object a line with ``hash_ids``, one id per 512-token prefix block) as ``Chain``s of
  block keys.
* Block keys are chained: ``key[i] = blake2b(key[i-1] || hash_id[i], 32 bytes)``, from a fixed
  seed, so a block's key names its id together with every id before it (the trace remaps ids;
  equal ids at the same position of two requests mean a shared prefix).
* ``block_content``: the bytes of a block, derived from its key alone (a fixed random pad
  XOR the key repeated), so every byte a store returns can be checked against its key.
* ``simulate``: an exact simulation of a block cache over the same request order with the
  replay's semantics, per request: find the leading run of stored blocks (the hits), read
  them (a touch), then put the rest (a put of a block already stored further on is a use of
  it, as a write is in a textbook LRU; with ``put_touches=False`` it is left where it is, as
  kvstore's put deduplicates it without a touch). Eviction order ``lru`` (least
  recently used first; a batch touched in prefix order, so its last block is the hottest),
  ``prefix`` (kvstore's prefix-aware LRU: each batch touched in reverse, so a chain's head is
  the hottest of its batch) or unbounded (``capacity_blocks=None``: nothing is ever evicted).

Nothing here talks to a store; ``bench_trace.py`` does.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KEY_BYTES = 32
TRACE_NAME = "synthetic_trace.jsonl.gz"
_ROOT_SEED = b"kvstore-bench-trace/v1"
ORDERS = ("lru", "prefix")


def default_trace_path() -> Path:
    """``../shared/data/synthetic_trace.jsonl.gz`` next to the repository this file is in (a
    clone anywhere works as long as ``shared/`` sits beside it)."""
    repo = Path(__file__).resolve().parent.parent
    return repo.parent / "shared" / "data" / TRACE_NAME


@dataclass(frozen=True)
class Chain:
    """One request: the keys of its prefix blocks, in prefix order."""

    keys: tuple[bytes, ...]
    timestamp_ms: int


def chain_keys(hash_ids: Sequence[int], memo: dict[tuple[bytes, int], bytes]) -> tuple[bytes, ...]:
    """The chained keys of one request (``memo`` maps (parent key, id) to key across calls)."""
    keys = []
    parent = _ROOT_SEED
    for hid in hash_ids:
        key = memo.get((parent, hid))
        if key is None:
            h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
            h.update(int(hid).to_bytes(8, "little"))
            key = memo[(parent, hid)] = h.digest()
        keys.append(key)
        parent = key
    return tuple(keys)


def load_trace(path: Path, limit: int | None = None) -> list[Chain]:
    """The first ``limit`` requests (all with None) of the trace at ``path``, in trace order;
    requests without blocks are left out."""
    memo: dict[tuple[bytes, int], bytes] = {}
    chains = []
    with gzip.open(path, "rt") as f:
        for line in f:
            if not line.strip():
                continue
            req = json.loads(line)
            ids = req["hash_ids"]
            if ids:
                chains.append(Chain(chain_keys(ids, memo), int(req.get("timestamp", 0))))
            if limit is not None and len(chains) >= limit:
                break
    return chains


def distinct_blocks(chains: Sequence[Chain]) -> int:
    return len({k for c in chains for k in c.keys})


# --------------------------------------------------------------------------- block bytes
class BlockContent:
    """The bytes of a block as a function of its key: ``pad XOR (key repeated)``, where ``pad``
    is ``block_bytes`` fixed pseudo-random bytes. Distinct keys give distinct blocks."""

    def __init__(self, block_bytes: int) -> None:
        if block_bytes % KEY_BYTES:
            raise ValueError(f"block size must be a multiple of {KEY_BYTES} bytes")
        self.block_bytes = block_bytes
        rng = np.random.default_rng(20250225)
        self._pad = rng.integers(0, 256, block_bytes, dtype=np.uint8).reshape(-1, KEY_BYTES)

    def fill(self, keys: Sequence[bytes], out: np.ndarray) -> None:
        """Write the blocks of ``keys`` into ``out[:len(keys)]`` (uint8 rows of block bytes)."""
        n = len(keys)
        k = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(n, 1, KEY_BYTES)
        rows = out[:n].reshape(n, -1, KEY_BYTES)
        np.bitwise_xor(self._pad[None, :, :], k, out=rows)


# --------------------------------------------------------------------------- simulation
@dataclass(frozen=True)
class SimResult:
    order: str  # "lru", "prefix" or "unbounded"
    capacity_blocks: int | None
    hits: int  # blocks found in the leading run of their request
    blocks: int  # blocks asked for
    held_at_end: int
    per_request_hits: tuple[int, ...]
    per_request_blocks: tuple[int, ...]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0

    def half_hit_rates(self) -> tuple[float, float]:
        """Hit rates of the first and the second half of the requests."""
        return _halves(self.per_request_hits, self.per_request_blocks)


def _halves(hits: Sequence[int], blocks: Sequence[int]) -> tuple[float, float]:
    mid = len(hits) // 2
    out = []
    for lo, hi in ((0, mid), (mid, len(hits))):
        b = sum(blocks[lo:hi])
        out.append(sum(hits[lo:hi]) / b if b else 0.0)
    return out[0], out[1]


def simulate(
    chains: Sequence[Chain],
    capacity_blocks: int | None,
    order: str = "lru",
    put_touches: bool = True,
) -> SimResult:
    """Replay ``chains`` through an exact block cache of ``capacity_blocks`` blocks (None:
    unbounded) evicting in ``order``; see the module docstring for the semantics.

    ``put_touches``: a put of a block already stored (further along than the leading run)
    counts as a use of it, as a write does in a textbook LRU; False leaves it where it is in
    the order (kvstore's put deduplicates such blocks without touching them), so the room
    made for the new blocks may evict it."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if capacity_blocks is not None and capacity_blocks <= 0:
        raise ValueError(f"capacity must be positive, got {capacity_blocks}")
    cache: OrderedDict[bytes, None] = OrderedDict()  # first: evicted first
    reverse = order == "prefix"
    per_hits = []
    per_blocks = []
    for chain in chains:
        keys = chain.keys
        m = leading_run(keys, cache)
        # The read: one batch touched in prefix order (or in reverse).
        for k in reversed(keys[:m]) if reverse else keys[:m]:
            cache.move_to_end(k)
        # The put of the rest, one batch; room is made before the new blocks go in.
        if put_touches:
            for k in reversed(keys[m:]) if reverse else keys[m:]:
                if k in cache:
                    cache.move_to_end(k)
        new = [k for k in keys[m:] if k not in cache]
        if capacity_blocks is not None:
            if len(new) > capacity_blocks:
                raise ValueError(
                    f"a request puts {len(new)} blocks into a cache of {capacity_blocks}"
                )
            over = len(cache) + len(new) - capacity_blocks
            for _ in range(max(over, 0)):
                cache.popitem(last=False)
        for k in reversed(new) if reverse else new:
            cache[k] = None
        per_hits.append(m)
        per_blocks.append(len(keys))
    name = order if capacity_blocks is not None else "unbounded"
    return sim_result(name, capacity_blocks, per_hits, per_blocks, len(cache))


def leading_run(keys: Sequence[bytes], held: Container[bytes]) -> int:
    """How many of ``keys``, from the first, ``held`` holds: a request's hits."""
    m = 0
    for k in keys:
        if k not in held:
            break
        m += 1
    return m


def sim_result(
    order: str,
    capacity_blocks: int | None,
    per_hits: Sequence[int],
    per_blocks: Sequence[int],
    held_at_end: int,
) -> SimResult:
    """A simulation's result from its hits and blocks asked, request by request."""
    return SimResult(
        order,
        capacity_blocks,
        sum(per_hits),
        sum(per_blocks),
        held_at_end,
        tuple(per_hits),
        tuple(per_blocks),
    )


def half_hit_rates(hits: Sequence[int], chains: Sequence[Chain]) -> tuple[float, float]:
    """Hit rates of the first and second half of a replay, from its per-request hits."""
    return _halves(hits, [len(c.keys) for c in chains])
