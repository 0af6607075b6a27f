"""The reference worker: a small serving engine over ``PagedKVCache`` and the kvstore client.

It is the example engine authors read to see how kvstore is meant to be used, and what the demo
and the end-to-end tests run. It serves a transformers Llama-architecture model with its own
forward pass (only the weights are taken from the transformers model):

* Continuous batching. Every ``step`` admits waiting requests (whole prompts, up to a token
  budget) and runs one decode token for every running sequence, all in one forward pass: the
  linear layers see every new token of the step packed into one ``[tokens, hidden]`` matrix;
  prefill tokens attend causally over their sequence's K/V gathered from the paged cache (torch
  SDPA), decode tokens through ``kernels.paged_attention`` over the block tables of all running
  sequences at once. Greedy sampling; a request stops at ``max_new_tokens`` or an EOS token.
* Resident prefix reuse. The paged cache is seeded with the store namespace's seed, so a prompt
  whose leading full blocks are still resident (in use by another sequence, or cached after one
  finished) reuses them without recomputing or reloading.
* The store, when a client is given:

  - when the scheduler first sees a request it sends ``prefetch(keys)``: the daemon starts
    promoting the prompt's stored leading run (from disk or Redis) while the request waits;
  - at admission it asks ``lookup(keys)`` for the blocks after the resident ones, ``load``\\ s
    that run straight into the sequence's physical blocks and computes only the rest (the last
    prompt token is always computed: its logits give the first token);
  - after prefill, the prompt's new full blocks (and at the end, generated full blocks, so a
    follow-up turn of a conversation can reuse them) are offloaded by a background thread with
    its own client, so decode never waits on the store. The scheduler pins those blocks (one
    extra reference) until the thread is done with them, so they cannot be reallocated and
    overwritten while being copied: no path offloads bytes that are not the key's content.

  A store error (``KVStoreError``, including ``UnavailableError``) never fails a request: it is
  logged once per outage, the request recomputes, and the store is left alone for
  ``store_retry_s`` before it is tried again.

Beam search (``Worker.beam_search``, ``kvstore.worker.beam``) forks each prompt's sequence into
its beams over copy-on-write blocks, frees the losers at every step, and uses the store for the
shared prompt as for any request. It reaches the engine only through
``kvstore.worker.interface.Engine`` (what a decoding strategy needs: the cache, the weights,
``begin``, ``offload``, ``flush``) and never imports ``kvstore.worker.engine``.

Memory is reserved at admission: a request is admitted only when the free and cached blocks,
less what running sequences may still grow into, hold its prompt plus ``max_new_tokens``. So a
running sequence never runs out of blocks and nothing is ever preempted (simple, and
conservative: it may admit fewer requests than an engine that preempts).
"""

from kvstore.worker.beam import Beam, BeamResult
from kvstore.worker.engine import Result, Worker, WorkerStats
from kvstore.worker.model import LlamaWeights, forward

__all__ = ["Beam", "BeamResult", "LlamaWeights", "Result", "Worker", "WorkerStats", "forward"]
