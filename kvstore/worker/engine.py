"""The scheduler of the reference worker: requests, continuous batching, the store calls.

See the package docstring for what a step does; ``Worker`` is the class to read.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.client.sync import KVStoreClient
from kvstore.keys import Namespace, block_hashes
from kvstore.layout import KVLayout
from kvstore.models import layout_for
from kvstore.paged import PagedKVCache
from kvstore.worker.beam import BeamResult, beam_search
from kvstore.worker.model import LlamaWeights, forward
from kvstore.worker.store import Offloader, StoreFailure, StoreHealth, clone_client


@dataclass(frozen=True)
class Result:
    """What one finished request reports.

    ``cached_tokens = resident_tokens + store_tokens``: prompt tokens whose K/V were not computed
    (reused resident blocks, blocks loaded from the store). ``ttft_s`` runs from ``submit`` to
    the first generated token; ``latency_s`` to the last. ``finish_reason``: ``"length"`` or
    ``"eos"`` (the EOS token is included in ``tokens``, as transformers includes it)."""

    request_id: int
    tokens: list[int]
    prompt_tokens: int
    ttft_s: float
    latency_s: float
    cached_tokens: int
    resident_tokens: int
    store_tokens: int
    finish_reason: str


@dataclass
class WorkerStats:
    """Totals since the worker was created. ``busy_s`` counts time inside ``step``."""

    requests: int = 0
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    resident_tokens: int = 0
    store_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    busy_s: float = 0.0
    store_errors: int = 0
    offloaded_blocks: int = 0
    offload_errors: int = 0
    peak_running: int = 0  # most sequences decoding at once (what the cache admitted)

    @property
    def cached_tokens(self) -> int:
        return self.resident_tokens + self.store_tokens

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of busy time."""
        return self.generated_tokens / self.busy_s if self.busy_s > 0 else 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        """Prompt tokens served (computed or reused) per second of busy time."""
        return self.prompt_tokens / self.busy_s if self.busy_s > 0 else 0.0


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    submitted: float
    generated: list[int] = field(default_factory=list)
    first_token: float = 0.0
    resident_tokens: int = 0
    store_tokens: int = 0
    # Leading full blocks already handed to the store (offloaded, or known present there).
    offloaded_blocks: int = 0
    # Blocks this request may still allocate before it finishes (for admission control).
    growth_blocks: int = 0


class Worker:
    """A serving engine for one Llama-architecture model. See the package docstring.

    Owns: the model's weights (``LlamaWeights``, read-only views of the transformers model), one
    ``PagedKVCache`` of ``num_blocks`` blocks (``self.cache``; FP8 with
    ``kv_cache_dtype=torch.float8_e4m3fn``, whose layout a ``client`` must then share), the
    request queues, and, with a ``client``, a background offload thread with its own client
    (``offload_client_factory``, default: a client of the same address and namespace as
    ``client``). ``client`` stays the
    caller's: the worker uses it from the scheduler thread and never closes it.

    Threading contract: ``submit`` may be called from any thread. Everything else (``step``,
    ``run_until_done``, ``flush``, ``close``) and the cache belong to one scheduler thread. The
    offload thread only reads blocks the scheduler pinned for it, so while offloads are in
    flight the cache holds references that no block table accounts for; ``flush()`` drains them
    (``cache.check_invariants()`` holds after it).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        num_blocks: int,
        client: KVStoreClient | None = None,
        max_batch: int = 8,
        block_size: int = 16,
        max_prefill_tokens: int = 2048,
        eos_token_ids: Iterable[int] | None = None,
        model_id: str | None = None,
        store_retry_s: float = 5.0,
        offload_client_factory: Callable[[], KVStoreClient] | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        if max_batch < 1 or max_prefill_tokens < 1:
            raise ValueError("max_batch and max_prefill_tokens must be positive")
        self.weights = model if isinstance(model, LlamaWeights) else LlamaWeights.from_hf(model)
        w = self.weights
        self.tokenizer = tokenizer
        self.layout: KVLayout = layout_for(w.config, w.dtype, block_size)
        if kv_cache_dtype == torch.float8_e4m3fn:
            # FP8 KV: e4m3 blocks with per-(block, layer, K|V, head) scales (kvstore.paged).
            self.layout = KVLayout.fp8(self.layout)
        elif kv_cache_dtype not in (None, w.dtype):
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype}: the cache holds the model's dtype "
                f"({w.dtype}) or float8_e4m3fn"
            )
        if client is not None:
            if client.layout != self.layout:
                raise ValueError(f"client layout {client.layout} != model layout {self.layout}")
            seed = client.namespace.seed
        else:
            name = model_id or getattr(w.config, "name_or_path", "") or "kvstore.worker"
            seed = Namespace(model=name, layout=self.layout).seed
        # Seeded with the store namespace's seed: resident keys and store keys are the same keys.
        self.cache = PagedKVCache(self.layout, num_blocks, w.device, seed=seed)
        self.client = client
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(
            eos_token_ids if eos_token_ids is not None else _default_eos(w.config, tokenizer)
        )
        self.max_positions = int(getattr(w.config, "max_position_embeddings", 1 << 30))
        self.stats = WorkerStats()
        self._health = StoreHealth("lookup/load", store_retry_s)
        self._offloader: Offloader | None = None
        if client is not None:
            factory = offload_client_factory or clone_client(client)
            self._offloader = Offloader(factory, self.cache.kv_caches, store_retry_s)
        self._ids = itertools.count()
        self._inbox: deque[_Request] = deque()  # append/popleft are atomic: submit's only link
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._results: dict[int, Result] = {}
        self._pinned = 0

    # -- API -----------------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int] | str, max_new_tokens: int) -> int:
        """Queue a request (token ids, or text when the worker has a tokenizer); returns its id.
        Raises ValueError for a request that could never be served (empty, too long for the
        model or for the whole cache)."""
        now = time.monotonic()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a worker built with a tokenizer")
            ids = [int(t) for t in self.tokenizer(prompt)["input_ids"]]
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        total = len(ids) + max_new_tokens
        if total > self.max_positions:
            raise ValueError(f"{total} tokens exceed the model's {self.max_positions} positions")
        if self._blocks_for(total - 1) > self.cache.num_blocks:
            raise ValueError(f"{total} tokens need more than the cache's {self.cache.num_blocks}")
        rid = next(self._ids)
        self._inbox.append(_Request(rid, ids, max_new_tokens, now))
        return rid

    def run_until_done(self, *, wait_offload: bool = True) -> dict[int, Result]:
        """Step until every submitted request has finished; returns the results finished since
        the last call, by request id. With ``wait_offload`` it also waits until the store holds
        everything offloaded (what a second worker reading the store needs)."""
        while self._inbox or self._waiting or self._running:
            steps = self.stats.steps
            self.step()
            if self.stats.steps == steps and not self._inbox:
                # Nothing ran and nothing can: submit() only accepts requests that fit an
                # empty cache, so this is a bookkeeping bug, never a wait worth spinning on.
                raise RuntimeError(f"{len(self._waiting)} requests cannot be admitted")
        if wait_offload:
            self.flush()
        results, self._results = self._results, {}
        return results

    def step(self) -> list[Result]:
        """One scheduler iteration: admit prefills, decode one token for every running sequence.
        Returns the requests that finished in it."""
        start = time.monotonic()
        self._unpin(self._offloader.finished() if self._offloader else [])
        self._intake()
        admitted = self._admit()
        if not admitted and not self._running:
            return []
        decoding = self._running
        self.stats.peak_running = max(self.stats.peak_running, len(admitted) + len(decoding))
        prefills = [(r.rid, r.resident_tokens + r.store_tokens, r.prompt) for r in admitted]
        decodes = [(r.rid, r.generated[-1]) for r in decoding]
        with torch.no_grad():
            logits = forward(self.weights, self.cache, prefills, decodes)
        next_tokens = logits.argmax(dim=-1).tolist()
        now = time.monotonic()
        finished: list[Result] = []
        still: list[_Request] = []
        for r, token in zip([*admitted, *decoding], next_tokens, strict=True):
            if not r.generated:
                r.first_token = now
                self.cache.commit(r.rid, len(r.prompt))
                self.offload(r)
            r.generated.append(token)
            if token in self.eos_token_ids:
                finished.append(self._finish(r, now, "eos"))
            elif len(r.generated) >= r.max_new_tokens:
                finished.append(self._finish(r, now, "length"))
            else:
                self.cache.append_tokens(r.rid, [token])
                r.growth_blocks = self._growth(r)
                still.append(r)
        self._running = still
        self.stats.steps += 1
        self.stats.generated_tokens += len(next_tokens)
        self.stats.store_errors = self._health.errors
        self.stats.busy_s += time.monotonic() - start
        return finished

    def beam_search(
        self,
        prompts: Sequence[Sequence[int]],
        beam_width: int,
        max_new_tokens: int,
        *,
        share: bool = True,
        length_penalty: float = 1.0,
    ) -> list[BeamResult]:
        """Beam search for each prompt, all in one batch, on an idle worker (see
        ``kvstore.worker.beam``): beams share their prompt's blocks by copy-on-write
        (``share=False`` copies them instead, for comparison); the prompt's stored prefix is
        loaded from the store and the rest offloaded to it, once per prompt."""
        return beam_search(
            self, prompts, beam_width, max_new_tokens, share=share, length_penalty=length_penalty
        )

    @property
    def busy(self) -> bool:
        """Requests are submitted, waiting or running."""
        return bool(self._inbox or self._waiting or self._running)

    def flush(self) -> None:
        """Wait for the offload thread to finish every queued offload and unpin its blocks."""
        if self._offloader is not None:
            self._offloader.wait()
            self._unpin(self._offloader.finished())
            self.stats.offloaded_blocks = self._offloader.stored
            self.stats.offload_errors = self._offloader.errors

    def close(self) -> None:
        """Finish queued offloads and stop the offload thread (the caller's client stays open)."""
        if self._offloader is not None:
            self.flush()
            self._offloader.close()
            self._offloader = None

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- for decoding strategies (kvstore.worker.interface.Engine) -----------------------------

    def begin(self, prompt: list[int]) -> _Request:
        """A sequence for ``prompt`` outside the request queues (beam search's shared prompt):
        blocks allocated, resident and stored prefix reused, as ``_start`` does for requests."""
        r = _Request(next(self._ids), prompt, 1, time.monotonic())
        self._start(r)
        return r

    def offload(self, r: _Request) -> None:
        """Hand ``r``'s committed full blocks not yet in the store to the offload thread, pinned
        so that they outlive the sequence until the copy is done."""
        if self._offloader is None:
            return
        keys = self.cache.keys(r.rid)
        full = min(self.cache.num_tokens(r.rid) // self.layout.block_size, len(keys))
        if full <= r.offloaded_blocks:
            return
        ids = self.cache.block_ids(r.rid)[r.offloaded_blocks : full]
        self.cache.allocator.touch(ids)
        self._pinned += len(ids)
        self._offloader.put(ids, keys[r.offloaded_blocks : full])
        r.offloaded_blocks = full

    # -- scheduling ----------------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.layout.block_size)

    def _growth(self, r: _Request) -> int:
        # The last generated token never gets K/V, so a sequence peaks at
        # prompt + max_new_tokens - 1 tokens.
        peak = self._blocks_for(len(r.prompt) + r.max_new_tokens - 1)
        return peak - len(self.cache.block_ids(r.rid)) if r.rid in self.cache else peak

    def _intake(self) -> None:
        """Move submitted requests to the waiting queue; ask the store to start promoting their
        stored prefixes now, so the blocks are in its memory tier by the time they load."""
        while self._inbox:
            r = self._inbox.popleft()
            self._waiting.append(r)
            usable = (len(r.prompt) - 1) // self.layout.block_size
            if self.client is not None and usable > 0 and self._health.usable():
                bs = self.layout.block_size
                keys = block_hashes(self.client.namespace.seed, r.prompt[: usable * bs], bs)
                try:
                    self.client.prefetch(keys)
                except StoreFailure as exc:
                    self._health.failed(exc)

    def _admit(self) -> list[_Request]:
        """Start waiting requests, first come first served, while batch slots, the step's prefill
        token budget and the cache's unreserved blocks allow."""
        admitted: list[_Request] = []
        budget = self.max_prefill_tokens
        while self._waiting and len(self._running) + len(admitted) < self.max_batch:
            r = self._waiting[0]
            if admitted and len(r.prompt) > budget:
                break
            reserved = sum(x.growth_blocks for x in [*self._running, *admitted])
            headroom = self.cache.allocator.num_allocatable - reserved
            if self._growth(r) > headroom:
                if self._running or admitted or not self._pinned:
                    break
                # Only blocks pinned for offload stand in the way: wait for them.
                self.flush()
                continue
            self._waiting.popleft()
            self._start(r)
            r.growth_blocks = self._growth(r)
            admitted.append(r)
            budget -= len(r.prompt) - r.resident_tokens - r.store_tokens
        return admitted

    def _start(self, r: _Request) -> None:
        """Give ``r`` its blocks: reuse resident prefix blocks, load what the store holds after
        them, and commit both so later prompts can share them."""
        bs = self.layout.block_size
        resident = self.cache.add_sequence(r.rid, r.prompt)
        r.resident_tokens = resident
        first = resident // bs
        usable = (len(r.prompt) - 1) // bs  # the last prompt token is always computed
        found = 0
        if self.client is not None and usable > first and self._health.usable():
            keys = self.cache.keys(r.rid)[:usable]
            try:
                found = self.client.lookup(keys)
                if found > first:
                    ids = self.cache.block_ids(r.rid)[first:found]
                    loaded = self.client.load(self.cache.kv_caches, ids, keys[first:found])
                    r.store_tokens = loaded * bs
                self._health.succeeded()
            except StoreFailure as exc:
                # A load that failed midway may have written some blocks: they are neither
                # counted nor committed, and prefill overwrites them.
                r.store_tokens = 0
                found = 0
                self._health.failed(exc)
        done = resident + r.store_tokens
        self.cache.commit(r.rid, done)
        # Blocks the store reported present need no offload, unless the load found them bad.
        r.offloaded_blocks = min(found, done // bs)
        s = self.stats
        s.requests += 1
        s.prompt_tokens += len(r.prompt)
        s.computed_prompt_tokens += len(r.prompt) - done
        s.resident_tokens += resident
        s.store_tokens += r.store_tokens

    def _unpin(self, done: list[list[int]]) -> None:
        for ids in done:
            self.cache.allocator.free(reversed(ids))
            self._pinned -= len(ids)
        if self._offloader is not None:
            self.stats.offloaded_blocks = self._offloader.stored
            self.stats.offload_errors = self._offloader.errors

    def _finish(self, r: _Request, now: float, reason: str) -> Result:
        # Every token in the table has its K/V now: commit and offload the generated full blocks
        # too, so the next turn of a conversation reuses them.
        self.cache.commit(r.rid, self.cache.num_tokens(r.rid))
        self.offload(r)
        self.cache.free(r.rid)
        result = Result(
            request_id=r.rid,
            tokens=list(r.generated),
            prompt_tokens=len(r.prompt),
            ttft_s=r.first_token - r.submitted,
            latency_s=now - r.submitted,
            cached_tokens=r.resident_tokens + r.store_tokens,
            resident_tokens=r.resident_tokens,
            store_tokens=r.store_tokens,
            finish_reason=reason,
        )
        self._results[r.rid] = result
        return result


def _default_eos(config: Any, tokenizer: Any) -> list[int]:
    """EOS ids: the tokenizer's, else the config's (an int or a list, as transformers keeps it)."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list | tuple) else [int(eos)]
