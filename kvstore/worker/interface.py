"""What a decoding strategy (beam search, ``kvstore.worker.beam``) needs of the engine.

The engine (``kvstore.worker.engine.Worker``) satisfies ``Engine``; a strategy takes an
``Engine`` and never imports the engine module, so the engine may import the strategies.
``Engine`` is generic in the engine's own sequence type: what ``begin`` returns is what
``offload`` takes back, and the strategy reads it only through ``StartedSequence``.

Threading contract: every member belongs to the engine's one scheduler thread (see ``Worker``),
and a strategy runs only on an idle engine (``busy`` is false): it owns the cache while it
runs and hands every sequence it made back (``cache.free``) before it returns.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from kvstore.paged import PagedKVCache
from kvstore.worker.model import LlamaWeights


class StartedSequence(Protocol):
    """A prompt's sequence in the cache, made by ``Engine.begin``: its leading
    ``resident_tokens + store_tokens`` tokens have their K/V (reused resident blocks, then
    blocks loaded from the store) and are committed; the rest of ``prompt`` has blocks but no
    K/V yet. ``rid`` is its sequence id in the cache."""

    @property
    def rid(self) -> int: ...

    @property
    def prompt(self) -> list[int]: ...

    @property
    def resident_tokens(self) -> int: ...

    @property
    def store_tokens(self) -> int: ...


S = TypeVar("S", bound=StartedSequence)


class Engine(Protocol[S]):
    """The engine's members a strategy uses."""

    @property
    def cache(self) -> PagedKVCache:
        """The paged KV cache the strategy allocates, forks and frees sequences in."""
        ...

    @property
    def weights(self) -> LlamaWeights:
        """The model, for ``kvstore.worker.model.forward``."""
        ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def busy(self) -> bool:
        """Requests are submitted, waiting or running: a strategy must not start."""
        ...

    def begin(self, prompt: list[int]) -> S:
        """A sequence for ``prompt`` outside the request queues: blocks allocated, the resident
        and stored prefix reused (and counted in the engine's stats) as for a request."""
        ...

    def offload(self, seq: S) -> None:
        """Hand ``seq``'s committed full blocks not yet in the store to the offload thread
        (pinned until copied, so ``cache.free`` of the sequence is safe at once). No-op
        without a store."""
        ...

    def flush(self) -> None:
        """Wait until every offload is done and its blocks are unpinned."""
        ...
