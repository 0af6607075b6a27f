"""Beam search in the reference worker, over copy-on-write blocks.

Every prompt's beams share its prompt blocks: the prompt is prefilled once (its stored prefix
loaded from the store and the rest offloaded to it, as for any request), then ``fork`` gives each
beam a table naming the same blocks. A step decodes one token for every live beam of every
prompt in one forward pass; each prompt keeps the ``beam_width`` best continuations among its
beams' (log-probability sums), forking a beam chosen more than once and freeing the losers. A
beam writes only its own last block, which ``append_tokens`` copies first if it is shared, so a
step costs at most one block copy per beam and the prompt is stored once however many beams
read it. ``share=False`` copies every block at every fork instead (an engine without
copy-on-write), which must give the same beams: the bytes are the same, only where they sit
differs.

A hypothesis ends at an EOS token (kept with its score) or at ``max_new_tokens``; results are
ranked by ``score / len(tokens) ** length_penalty``, best first, ties by order found.

It uses the engine only through ``kvstore.worker.interface.Engine`` (and never imports the
engine module, which imports this one).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvstore.paged import SeqId
from kvstore.worker.interface import Engine, StartedSequence
from kvstore.worker.model import forward

S = TypeVar("S", bound=StartedSequence)


@dataclass(frozen=True)
class Beam:
    """One finished hypothesis: generated tokens (EOS included when it ended there) and the
    sum of their log-probabilities."""

    tokens: list[int]
    score: float
    finished: bool

    def ranked(self, length_penalty: float) -> float:
        return self.score / (len(self.tokens) ** length_penalty)


@dataclass(frozen=True)
class BeamResult:
    """The beams of one prompt (best first) and what serving them cost. ``peak_blocks`` is the
    most blocks in use at once during the whole call (every prompt of it together)."""

    beams: list[Beam]
    prompt_tokens: int
    cached_tokens: int
    store_tokens: int
    peak_blocks: int
    cow_copies: int
    elapsed_s: float


@dataclass
class _Live:
    seq: SeqId
    tokens: list[int]
    score: float


@dataclass
class _Group:
    prompt: list[int]
    live: list[_Live] = field(default_factory=list)
    done: list[Beam] = field(default_factory=list)


def beam_search(
    worker: Engine[S],
    prompts: Sequence[Sequence[int]],
    beam_width: int,
    max_new_tokens: int,
    *,
    share: bool = True,
    length_penalty: float = 1.0,
) -> list[BeamResult]:
    """Run beam search for every prompt at once on an idle worker; one result per prompt."""
    if beam_width < 1 or max_new_tokens < 1:
        raise ValueError("beam_width and max_new_tokens must be positive")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("beam search needs non-empty prompts")
    if worker.busy:
        raise RuntimeError("beam search runs on an idle worker (requests are queued or running)")
    cache = worker.cache
    start = time.monotonic()
    cow_before = cache.cow_copies
    ids = itertools.count()
    groups = [_Group([int(t) for t in p]) for p in prompts]
    roots: list[S] = []
    owned: list[SeqId] = []  # every sequence this call made: all freed when it ends, or fails
    peak = cache.stats().num_in_use
    try:
        for g in groups:
            roots.append(worker.begin(g.prompt))
            owned.append(roots[-1].rid)
        prefills = [(r.rid, r.resident_tokens + r.store_tokens, r.prompt) for r in roots]
        with torch.no_grad():
            logits = forward(worker.weights, cache, prefills, [])
        for r in roots:
            cache.commit(r.rid, len(r.prompt))
            worker.offload(r)  # the shared prompt goes to the store once, not once per beam
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        for g, r, lp in zip(groups, roots, logprobs, strict=True):
            # The prompt's sequence is the parent of the first beams (the first carries on in
            # its table, the others fork from it).
            _select(worker, g, [_Live(r.rid, [], 0.0)], lp[None], beam_width, ids, share, owned)
        peak = max(peak, cache.stats().num_in_use)
        for _ in range(max_new_tokens - 1):
            live = [b for g in groups for b in g.live]
            if not live:
                break
            for b in live:
                cache.append_tokens(b.seq, [b.tokens[-1]])
            peak = max(peak, cache.stats().num_in_use)
            with torch.no_grad():
                logits = forward(worker.weights, cache, [], [(b.seq, b.tokens[-1]) for b in live])
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            at = 0
            for g in groups:
                n = len(g.live)
                _select(worker, g, g.live, logprobs[at : at + n], beam_width, ids, share, owned)
                at += n
            peak = max(peak, cache.stats().num_in_use)
    finally:
        for seq in owned:
            if seq in cache:
                cache.free(seq)
        worker.flush()
    elapsed = time.monotonic() - start
    results = []
    for g, r in zip(groups, roots, strict=True):
        hyps = g.done + [Beam(b.tokens, b.score, False) for b in g.live]
        order = sorted(range(len(hyps)), key=lambda i: (-hyps[i].ranked(length_penalty), i))
        results.append(
            BeamResult(
                beams=[hyps[i] for i in order[:beam_width]],
                prompt_tokens=len(g.prompt),
                cached_tokens=r.resident_tokens + r.store_tokens,
                store_tokens=r.store_tokens,
                peak_blocks=peak,
                cow_copies=cache.cow_copies - cow_before,
                elapsed_s=elapsed,
            )
        )
    return results


def _select(
    worker: Engine[Any],
    g: _Group,
    parents: list[_Live],
    logprobs: torch.Tensor,
    beam_width: int,
    ids: itertools.count[int],
    share: bool,
    owned: list[SeqId],
) -> None:
    """Keep the group's ``beam_width`` best continuations of ``parents`` (``logprobs`` ``[len
    (parents), vocab]``): EOS ones end as hypotheses, the others become the live beams, forked
    from their parents; parents no continuation chose are freed."""
    vocab = logprobs.shape[1]
    scores = torch.tensor([p.score for p in parents], dtype=torch.float32)[:, None] + logprobs
    # 2 * beam_width candidates: enough live ones even if up to beam_width end at EOS.
    k = min(2 * beam_width, scores.numel())
    top = torch.topk(scores.flatten(), k)
    chosen: list[tuple[int, int, float]] = []
    for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        parent, token = divmod(int(index), vocab)
        tokens = [*parents[parent].tokens, token]
        if token in worker.eos_token_ids:
            g.done.append(Beam(tokens, float(value), True))
        else:
            chosen.append((parent, token, float(value)))
        if len(chosen) == beam_width:
            break
    cache = worker.cache
    used = {p for p, _, _ in chosen}
    for i, p in enumerate(parents):
        if i not in used:
            cache.free(p.seq)  # a loser: its private blocks go back, shared ones lose a ref
    live: list[_Live] = []
    taken: set[int] = set()
    for parent, token, score in chosen:
        src = parents[parent]
        seq: SeqId
        if parent in taken:
            seq = ("beam", next(ids))
            cache.fork(src.seq, seq, share=share)
            owned.append(seq)
        else:
            seq = src.seq  # the first continuation of a beam carries on in its table
            taken.add(parent)
        live.append(_Live(seq, [*src.tokens, token], score))
    g.live = live
