"""Prefix reuse for Hugging Face transformers models: load a prompt's cached prefix from the
kvstore daemon into a ``DynamicCache`` before generating, and offload the blocks computed.

```python
from kvstore import KVStoreClient
from kvstore.integrations.transformers import KVCacheConnector
from kvstore.models import layout_for

layout = layout_for(model.config, model.dtype)  # block_size=16 by default
client = KVStoreClient(layout=layout, model="HuggingFaceTB/SmolLM2-135M-Instruct")
conn = KVCacheConnector(client, model)         # checks the client's layout against the model

cache, n_cached = conn.load_cache(input_ids)   # fresh DynamicCache holding input_ids[:, :n_cached]
out = model.generate(input_ids, cache=cache, max_new_tokens=32)  # computes only the rest
conn.offload(input_ids, cache)                 # store the full blocks not yet stored

out = conn.generate(input_ids, max_new_tokens=32)  # the same three steps in one call
```

* ``input_ids``: one sequence, ``[1, seq]`` or ``[seq]`` (batch size 1 only: each row of a batch
  would hit a different prefix length, which one ``DynamicCache`` cannot hold).
* ``load_cache`` loads the longest stored prefix in whole blocks, at most ``seq - 1`` tokens so
  the model computes at least the last token (it needs that token's logits). It returns a new
  cache every call: a forward pass extends a cache in place, so one cache object must never
  serve two requests.
* Pass the full ``input_ids`` to ``generate`` together with the cache (it skips the cached
  part), or run a forward pass on ``input_ids[:, n_cached:]``. Pass no attention mask or a
  full-length one, and no ``position_ids``: a mask covering only the new tokens, or positions
  restarting at 0, give wrong logits without any error. Keys are stored after the rotary
  embedding, so a block is valid only at the positions it was computed at; chained block keys
  guarantee that (a key names its whole prefix from token 0).
* ``offload(input_ids, cache)`` stores the cache's full blocks that the store lacks, keyed by
  ``input_ids``; a cache that also holds generated tokens is fine (only positions covered by
  ``input_ids`` are stored).
* The store is a cache: when the daemon is down or fails a call (any ``KVStoreError``),
  ``load_cache`` returns an empty cache and ``offload`` returns 0, with a warning logged, and
  generation goes on by recomputing. Wrong arguments (shapes, dtypes) still raise.
* Supported models: those whose ``DynamicCache`` is one full-attention ``DynamicLayer`` per
  decoder layer (Llama, Mistral without sliding window, Qwen2, ...). Sliding-window, chunked,
  linear-attention and KV-sharing layers hold something other than every token's K and V, and
  are refused at construction.

A connector is not thread-safe (nor is the client): one per worker thread. It keeps one CPU
staging buffer, grown to the largest transfer so far and reused, so steady-state loads and
offloads allocate no staging memory.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

try:
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvstore.integrations.transformers needs transformers: pip install 'transformers==5.24.0'"
    ) from exc

from kvstore.client.sync import KVStoreClient
from kvstore.errors import KVStoreError
from kvstore.models import kv_shape

logger = logging.getLogger(__name__)


class KVCacheConnector:
    """Moves one model's KV cache between transformers ``DynamicCache`` objects and the store.

    Owns a staging buffer ``[n, *layout.block_shape]`` on the CPU (pinned when the model is on
    CUDA); borrows the client and the model, which the caller closes and keeps.
    """

    def __init__(self, client: KVStoreClient, model: Any) -> None:
        self.client = client
        self.model = model
        self.layout = client.layout
        self._check_model()
        self._staging: torch.Tensor | None = None
        self._store_failing = False

    # ------------------------------------------------------------------ checks
    def _check_model(self) -> None:
        lay = self.layout
        layers, kv_heads, head_dim = kv_shape(self.model.config)
        for what, want, got in (
            ("num_layers", layers, lay.num_layers),
            ("num_kv_heads", kv_heads, lay.num_kv_heads),
            ("head_dim", head_dim, lay.head_dim),
            ("dtype", self.model.dtype, lay.dtype),
        ):
            if want != got:
                raise ValueError(
                    f"the client's layout has {what}={got} but the model needs {what}={want}; "
                    "build the client with kvstore.models.layout_for(model.config, model.dtype)"
                )
        probe = DynamicCache(config=self.model.config)
        kinds = {type(layer).__name__ for layer in probe.layers}
        if len(probe.layers) != layers or kinds != {DynamicLayer.__name__}:
            raise ValueError(
                f"unsupported model: its cache layers are {sorted(kinds)} ({len(probe.layers)} "
                f"for {layers} decoder layers); only full-attention DynamicLayer caches hold "
                "every token's K and V"
            )

    @staticmethod
    def _tokens(input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` as one 1-D sequence; a batch of more than one row is refused."""
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            return input_ids[0]
        if input_ids.dim() == 1:
            return input_ids
        raise ValueError(
            f"input_ids must be [1, seq] or [seq] (batch size 1), got {tuple(input_ids.shape)}"
        )

    def _staging_blocks(self, n: int) -> torch.Tensor:
        """The first ``n`` blocks of the staging buffer, growing it if needed."""
        if self._staging is None or self._staging.shape[0] < n:
            pin = self.model.device.type == "cuda" and torch.cuda.is_available()
            # A normal tensor even when first needed under inference_mode: an inference tensor
            # could not be written in place by a later call made outside that mode.
            with torch.inference_mode(False):
                self._staging = torch.empty(
                    (n, *self.layout.block_shape), dtype=self.layout.dtype, pin_memory=pin
                )
        return self._staging[:n]

    def _store_failed(self, what: str, exc: KVStoreError) -> None:
        # Warn once per outage, not once per request: a dead daemon must not flood the log.
        if not self._store_failing:
            logger.warning("kvstore %s failed, recomputing without the store: %s", what, exc)
            self._store_failing = True
        else:
            logger.debug("kvstore %s failed again: %s", what, exc)

    def _store_ok(self) -> None:
        if self._store_failing:
            logger.info("kvstore reachable again")
            self._store_failing = False

    # ------------------------------------------------------------------ API
    def load_cache(self, input_ids: torch.Tensor) -> tuple[Any, int]:
        """(a new ``DynamicCache`` holding the longest stored prefix of ``input_ids``, its length
        in tokens): whole blocks, at most ``len - 1`` tokens. ``(empty cache, 0)`` on a miss or
        when the store fails."""
        tokens = self._tokens(input_ids)
        bs = self.layout.block_size
        max_blocks = (tokens.shape[0] - 1) // bs
        if max_blocks <= 0:
            return DynamicCache(config=self.model.config), 0
        keys = self.client.hash_tokens(tokens[: max_blocks * bs])
        try:
            n = self.client.lookup(keys)
            blocks = self.client.get(keys[:n], out=self._staging_blocks(n)) if n else None
        except KVStoreError as exc:
            self._store_failed("load", exc)
            return DynamicCache(config=self.model.config), 0
        self._store_ok()
        # get may return fewer blocks than lookup counted (evicted in between, or a block that
        # failed its checksum): use only what arrived.
        if blocks is None or blocks.shape[0] == 0:
            return DynamicCache(config=self.model.config), 0
        with torch.no_grad():
            return self._cache_from_blocks(blocks), blocks.shape[0] * bs

    def _cache_from_blocks(self, blocks: torch.Tensor) -> Any:
        lay = self.layout
        m = blocks.shape[0]
        seq = m * lay.block_size
        # [m, L, 2, bs, H, D] -> [L, 2, 1, H, m*bs, D] in one copy into a fresh tensor (never a
        # view of the staging buffer, which the next call overwrites). On CUDA the blocks cross
        # to the device as they are, in one contiguous transfer, and are reordered there.
        src = blocks.to(self.model.device)
        kv = torch.empty(
            (lay.num_layers, 2, 1, lay.num_kv_heads, seq, lay.head_dim),
            dtype=lay.dtype,
            device=self.model.device,
        )
        kv.view(lay.num_layers, 2, lay.num_kv_heads, m, lay.block_size, lay.head_dim).copy_(
            src.permute(1, 2, 4, 0, 3, 5)
        )
        return DynamicCache([(k, v) for k, v in kv.unbind(0)], config=self.model.config)

    def offload(self, input_ids: torch.Tensor, cache: Any) -> int:
        """Store the full blocks of ``cache`` (for the tokens ``input_ids``) that the store
        lacks; returns how many were newly stored (0 when the store fails)."""
        tokens = self._tokens(input_ids)
        lay = self.layout
        layers = cache.layers
        if len(layers) != lay.num_layers:
            raise ValueError(f"cache has {len(layers)} layers, layout expects {lay.num_layers}")
        cached = cache.get_seq_length()
        n_blocks = min(tokens.shape[0], cached) // lay.block_size
        if n_blocks == 0:
            return 0
        keys = self.client.hash_tokens(tokens[: n_blocks * lay.block_size])
        try:
            start = self.client.lookup(keys)
            if start == n_blocks:
                self._store_ok()
                return 0
            # no_grad: a cache from a forward pass outside no_grad carries autograd history,
            # which copying it into the staging buffer must not inherit.
            with torch.no_grad():
                blocks = self._blocks_from_cache(layers, start, n_blocks)
            stored = self.client.put(keys[start:], blocks)
        except KVStoreError as exc:
            self._store_failed("offload", exc)
            return 0
        self._store_ok()
        return stored

    def _blocks_from_cache(self, layers: Any, start: int, stop: int) -> torch.Tensor:
        """Blocks ``start:stop`` of the cache as ``[stop - start, *block_shape]`` staging."""
        lay = self.layout
        m = stop - start
        want = (1, lay.num_kv_heads, lay.head_dim)
        blocks = self._staging_blocks(m)
        s0, s1 = start * lay.block_size, stop * lay.block_size
        # One copy per layer and K/V, each moving all m blocks: the cache keeps a separate
        # [1, H, seq, D] tensor per layer, so a layer loop is the fewest copies there can be.
        for i, layer in enumerate(layers):
            for j, t in enumerate((layer.keys, layer.values)):
                if (t.shape[0], t.shape[1], t.shape[3]) != want or t.dtype != lay.dtype:
                    raise ValueError(
                        f"cache layer {i} holds {tuple(t.shape)} {t.dtype}; expected "
                        f"[1, {lay.num_kv_heads}, seq, {lay.head_dim}] {lay.dtype}"
                    )
                part = t[0, :, s0:s1].unflatten(1, (m, lay.block_size))  # [H, m, bs, D]
                blocks[:, i, j].copy_(part.permute(1, 2, 0, 3))
        return blocks

    def generate(self, input_ids: torch.Tensor, **generate_kwargs: Any) -> Any:
        """``model.generate`` reusing the stored prefix of ``input_ids``, then offloading the
        prompt's blocks. Returns what ``model.generate`` returns."""
        for name in ("cache", "past_key_values"):
            if name in generate_kwargs:
                raise TypeError(f"generate() makes its own cache; do not pass {name}=")
        tokens = self._tokens(input_ids)
        ids = tokens.unsqueeze(0).to(self.model.device)
        cache, _ = self.load_cache(ids)
        # A mask left for generate to infer is guessed from the pad token, which for many chat
        # models equals EOS: spell out the full-length mask instead.
        generate_kwargs.setdefault("attention_mask", torch.ones_like(ids))
        out = self.model.generate(ids, cache=cache, **generate_kwargs)
        first = cache.layers[0].keys if cache.layers else None
        if first is not None and first.shape[0] == 1:
            self.offload(ids, cache)
        else:
            # Beam search or several return sequences expand the cache's batch: which row holds
            # the prompt is generate's business, so nothing is offloaded rather than a guess.
            logger.debug("cache batch is not 1 after generate; prompt blocks not offloaded")
        return out
