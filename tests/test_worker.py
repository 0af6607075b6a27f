"""The reference worker against transformers: same greedy tokens, with and without the store.

SmolLM2-135M runs in float32, where the worker's own forward pass and transformers' agree closely
enough that greedy tokens are identical; a small random Llama covers shapes the real model lacks
(GQA ratio 2, attention biases, llama3 RoPE scaling, blocks of 8 tokens).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import pytest
import torch

from kvstore import KVStoreClient
from kvstore.models import layout_for, random_llama
from kvstore.worker import Worker

MAX_NEW = 8


pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None,
        reason="needs transformers (pip install 'transformers==5.24.0')",
    ),
    pytest.mark.usefixtures("one_torch_thread"),
]


@pytest.fixture(scope="module")
def smollm2(smollm2_fp32: tuple[Any, Any]) -> tuple[Any, Any]:
    return smollm2_fp32


@pytest.fixture(scope="module")
def prompts(smollm2: tuple[Any, Any]) -> dict[str, list[int]]:
    """Prompts of 5, 9, 32, 45, 70 and 65 tokens: under one block, an exact multiple of 16, and
    ragged ones; ``eos`` is answered by EOS at once. ``long`` extends ``mid`` (whose 2 full
    blocks it can reuse); ``partial`` shares 40 tokens with them (2 full blocks), then
    diverges."""
    _, tok = smollm2
    story = tok(
        "Once upon a time, in a small village at the edge of a great forest, there lived an old "
        "clockmaker named Elias. Every morning he opened his shop before sunrise, wound every "
        "clock on the walls, and listened to them tick together like a choir of tiny hearts. "
        "Children from the village often stopped by on their way to school, pressing their "
        "noses against the window to watch the pendulums swing."
    )["input_ids"]
    other = tok(
        "The mitochondria is the powerhouse of the cell, and it produces energy through a "
        "process called cellular respiration, which turns sugar and oxygen into the fuel "
        "every muscle needs."
    )["input_ids"]
    capital = tok("The capital of France is")["input_ids"]
    # The model answers this one with EOS at once.
    question = tok("What is the capital of France? Answer:")["input_ids"]
    assert len(story) >= 70 and len(other) >= 32
    return {
        "short": capital,
        "eos": question,
        "exact": other[:32],
        "mid": story[:45],
        "long": story[:70],
        "partial": story[:40] + other[:25],
    }


def _transformers_greedy(model: Any, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=model.generation_config.pad_token_id,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def reference(smollm2: tuple[Any, Any], prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    model, _ = smollm2
    return {name: _transformers_greedy(model, p, MAX_NEW) for name, p in prompts.items()}


BATCH = ("short", "eos", "exact", "mid", "long")


def _serve(worker: Worker, prompts: dict[str, list[int]], names: tuple[str, ...]) -> dict:
    ids = {name: worker.submit(prompts[name], MAX_NEW) for name in names}
    results = worker.run_until_done()
    assert sorted(results) == sorted(ids.values())
    return {name: results[rid] for name, rid in ids.items()}


def _reusable(prompt: list[int], block: int = 16) -> int:
    """Prompt tokens a cache can supply: whole blocks, leaving the last token to compute."""
    return (len(prompt) - 1) // block * block


def test_batch_matches_transformers(smollm2, prompts, reference) -> None:
    model, tok = smollm2
    with Worker(model, tok, num_blocks=64) as worker:
        out = _serve(worker, prompts, BATCH)
        # All four were admitted together: one prefill step, then one step per further token.
        assert worker.stats.steps == MAX_NEW
        assert worker.stats.generated_tokens == sum(len(reference[n]) for n in BATCH)
        worker.cache.check_invariants()
        assert worker.cache.stats().num_in_use == 0
    for name in BATCH:
        r = out[name]
        assert r.tokens == reference[name], name
        assert r.prompt_tokens == len(prompts[name])
        assert r.cached_tokens == 0
        assert r.finish_reason == ("eos" if name == "eos" else "length")
        assert 0 < r.ttft_s <= r.latency_s
    # A text prompt goes through the tokenizer.
    with Worker(model, tok, num_blocks=16) as worker:
        rid = worker.submit(tok.decode(prompts["short"]), 2)
        assert worker.run_until_done()[rid].tokens == reference["short"][:2]


def test_resident_prefix_reuse(smollm2, prompts, reference) -> None:
    model, _ = smollm2
    with Worker(model, num_blocks=64) as worker:
        first = _serve(worker, prompts, ("mid",))["mid"]
        second = _serve(worker, prompts, ("long",))["long"]
        third = _serve(worker, prompts, ("partial",))["partial"]
        worker.cache.check_invariants()
    assert first.tokens == reference["mid"] and first.cached_tokens == 0
    # "mid" left its 2 prompt blocks (and a third, holding generated tokens) resident.
    assert second.tokens == reference["long"]
    assert second.resident_tokens == 32 and second.store_tokens == 0
    assert third.tokens == reference["partial"] and third.resident_tokens == 32


def test_store_reuse_partial_hit_and_outage(
    smollm2, prompts, reference, daemon_factory, caplog
) -> None:
    model, _ = smollm2
    d = daemon_factory(cpu_capacity="64MiB", slab="8MiB")
    layout = layout_for(model.config, torch.float32)
    with KVStoreClient(d.address, layout=layout, model="smollm2-135m-test") as client:
        with Worker(model, num_blocks=64, client=client) as worker:
            cold = _serve(worker, prompts, BATCH)
            assert worker.stats.offloaded_blocks > 0 and worker.stats.offload_errors == 0
        assert all(cold[n].tokens == reference[n] and cold[n].cached_tokens == 0 for n in BATCH)

        # A fresh worker (nothing resident) finds every reusable block in the store.
        with Worker(model, num_blocks=64, client=client) as worker:
            warm = _serve(worker, prompts, BATCH)
        for name in BATCH:
            assert warm[name].tokens == reference[name], name
            assert warm[name].cached_tokens == _reusable(prompts[name]), name
        assert warm["exact"].store_tokens == 16 and warm["mid"].store_tokens == 32
        # "long" was admitted with "mid": it shares the blocks "mid" had just loaded.
        assert warm["long"].resident_tokens + warm["long"].store_tokens == 64

        with Worker(model, num_blocks=64, client=client) as worker:
            partial = _serve(worker, prompts, ("partial",))["partial"]
        assert partial.tokens == reference["partial"]
        assert partial.store_tokens == 32 and partial.resident_tokens == 0

        # The daemon goes away under a running worker: every request is still answered,
        # identically, by recomputing; the outage is logged once, not once per call.
        with Worker(model, num_blocks=64, client=client) as worker:
            d.stop()
            with caplog.at_level(logging.WARNING, logger="kvstore.worker"):
                down = _serve(worker, prompts, BATCH)
            assert worker.stats.store_errors >= 1
        for name in BATCH:
            assert down[name].tokens == reference[name] and down[name].cached_tokens == 0
        warnings = [r.getMessage() for r in caplog.records if r.name == "kvstore.worker"]
        lookups = [m for m in warnings if "lookup/load failed" in m]
        offloads = [m for m in warnings if "offload failed" in m]
        assert len(lookups) == 1 and len(offloads) <= 1, warnings


RANDOM_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "attention_bias": True,
    # Wider than the default 0.02: logits spread enough that no greedy choice is a near-tie
    # (smallest top-2 gap 0.02 here, against 1e-5 at 0.02) that float rounding could flip.
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def test_random_llama_matches_transformers() -> None:
    model = random_llama(RANDOM_CONFIG, dtype=torch.float32, seed=0)
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 512, (60,), generator=g).tolist()
    prompts = [base[:3], base[:17], base[:30], base[:24] + base[40:60], base[:41]]
    max_new = 12
    reference = [_transformers_greedy(model, p, max_new) for p in prompts]
    # Blocks of 8 tokens and a cache of 12 (the requests peak at 2, 4, 6, 7 and 7 blocks):
    # requests wait for blocks, reuse each other's resident blocks, and decode crosses block
    # boundaries.
    with Worker(model, num_blocks=12, block_size=8) as worker:
        ids = [worker.submit(p, max_new) for p in prompts]
        results = worker.run_until_done()
        assert worker.stats.steps > max_new + 1  # not all admitted at once
        worker.cache.check_invariants()
        with pytest.raises(ValueError):
            worker.submit([], 1)
        with pytest.raises(ValueError):
            worker.submit(base, 200)  # more than the model's 256 positions
        with pytest.raises(ValueError):
            worker.submit(base[:8], 8 * 12)  # more than the whole cache
    for rid, prompt, ref in zip(ids, prompts, reference, strict=True):
        assert results[rid].tokens == ref, (len(prompt), results[rid].tokens, ref)
    assert sum(r.resident_tokens for r in results.values()) > 0


def test_identical_after_a_restart_served_from_nvme(
    smollm2, prompts, reference, daemon_factory, tmp_path
) -> None:
    model, _ = smollm2
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    d = daemon_factory(cpu_capacity="64MiB", slab="8MiB", nvme_path=nvme, nvme_capacity="64MiB")
    layout = layout_for(model.config, torch.float32)
    with KVStoreClient(d.address, layout=layout, model="smollm2-135m-test") as client:
        with Worker(model, num_blocks=64, client=client) as worker:
            _serve(worker, prompts, BATCH)
        d.stop()  # a graceful stop writes the CPU tier's blocks to NVMe
        d.start()  # a new daemon, an empty CPU tier: the prefixes are on disk only
        with Worker(model, num_blocks=64, client=client) as worker:
            warm = _serve(worker, prompts, BATCH)
        tiers = {t.name: t for t in client.stats().tiers}
    for name in BATCH:
        assert warm[name].tokens == reference[name], name
        assert warm[name].cached_tokens == _reusable(prompts[name]), name
    assert tiers["nvme"].promotions > 0 and tiers["nvme"].checksum_failures == 0


def test_a_tenant_never_hits_another_tenants_prefix(
    smollm2, prompts, reference, daemon_factory
) -> None:
    model, _ = smollm2
    d = daemon_factory(cpu_capacity="64MiB", slab="8MiB")
    layout = layout_for(model.config, torch.float32)
    kw = {"layout": layout, "model": "smollm2-135m-test"}
    acme = KVStoreClient(d.address, tenant="acme", **kw)
    with acme, Worker(model, num_blocks=64, client=acme) as worker:
        _serve(worker, prompts, ("long",))
    globex = KVStoreClient(d.address, tenant="globex", **kw)
    with globex, Worker(model, num_blocks=64, client=globex) as worker:
        other = _serve(worker, prompts, ("long",))["long"]
    assert other.tokens == reference["long"]
    assert other.cached_tokens == 0  # same prompt, other tenant: computed, never shared
