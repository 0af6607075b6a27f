"""Beam search in the reference worker: the same beams with and without copy-on-write sharing,
the same as a beam search that recomputes every beam with transformers (no cache at all), the
memory sharing saves, and the store serving the shared prompt."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from kvstore import KVStoreClient

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None, reason="needs transformers"
    ),
    pytest.mark.usefixtures("one_torch_thread"),
]

CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    # Wide logits: no two candidates' scores are near-ties that float rounding could swap.
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}
WIDTH, MAX_NEW = 3, 9


@pytest.fixture(scope="module")
def model() -> Any:
    from kvstore.models import random_llama

    return random_llama(CONFIG, dtype=torch.float32, seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 512, (60,), generator=g).tolist()
    # 30 and 21 tokens: blocks of 8 leave both prompts a partial last block the beams share.
    return [base[:30], base[30:51]]


def eos_of(model: Any, prompt: list[int]) -> int:
    """A token the beams will meet: the third greedy token, made an EOS id."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=3, do_sample=False, pad_token_id=0
        )
    return int(out[0, -1])


def recomputed_beams(
    model: Any, prompt: list[int], width: int, max_new: int, eos: set[int]
) -> list[tuple[list[int], float]]:
    """The worker's beam search algorithm with every beam's logits recomputed from scratch by
    transformers: no cache, no blocks, nothing shared."""
    live: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float]] = []
    for _ in range(max_new):
        with torch.no_grad():
            rows = [
                torch.log_softmax(model(torch.tensor([prompt + t])).logits[0, -1].float(), -1)
                for t, _ in live
            ]
        scores = torch.stack(
            [torch.tensor(s, dtype=torch.float32) + r for (_, s), r in zip(live, rows, strict=True)]
        )
        top = torch.topk(scores.flatten(), min(2 * width, scores.numel()))
        chosen = []
        for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            parent, token = divmod(int(index), scores.shape[1])
            tokens = [*live[parent][0], token]
            (done if token in eos else chosen).append((tokens, float(value)))
            if len(chosen) == width:
                break
        live = chosen
        if not live:
            break
    hyps = done + live
    order = sorted(range(len(hyps)), key=lambda i: (-hyps[i][1] / len(hyps[i][0]), i))
    return [hyps[i] for i in order[:width]]


@pytest.mark.parametrize("kv_cache_dtype", [None, torch.float8_e4m3fn])
def test_beams_are_the_same_with_and_without_sharing(model, prompts, kv_cache_dtype) -> None:
    from kvstore.worker import Worker

    eos = eos_of(model, prompts[0])
    runs = {}
    for share in (True, False):
        with Worker(
            model, num_blocks=64, block_size=8, eos_token_ids=[eos], kv_cache_dtype=kv_cache_dtype
        ) as worker:
            runs[share] = worker.beam_search(prompts, WIDTH, MAX_NEW, share=share)
            worker.cache.check_invariants()
            assert worker.cache.stats().num_in_use == 0  # losers and finished beams freed
            assert not worker.busy
    shared, copied = runs[True], runs[False]
    for a, b in zip(shared, copied, strict=True):
        assert [(x.tokens, x.score, x.finished) for x in a.beams] == [
            (x.tokens, x.score, x.finished) for x in b.beams
        ]
        assert len(a.beams) == WIDTH
    assert any(x.finished and x.tokens[-1] == eos for r in shared for x in r.beams)
    # Sharing: the prompts' blocks once, one private tail per beam. Copying: every beam
    # holds its whole sequence; copy-on-write copies only a shared partial tail.
    assert shared[0].peak_blocks < copied[0].peak_blocks
    assert copied[0].cow_copies == 0 < shared[0].cow_copies


def test_beams_equal_a_beam_search_that_recomputes_everything(model, prompts) -> None:
    from kvstore.worker import Worker

    eos = eos_of(model, prompts[0])
    with Worker(model, num_blocks=64, block_size=8, eos_token_ids=[eos]) as worker:
        results = worker.beam_search(prompts, WIDTH, MAX_NEW)
    for prompt, result in zip(prompts, results, strict=True):
        want = recomputed_beams(model, prompt, WIDTH, MAX_NEW, {eos})
        assert [b.tokens for b in result.beams] == [t for t, _ in want]
        for b, (_, score) in zip(result.beams, want, strict=True):
            assert b.score == pytest.approx(score, abs=1e-3)


def test_the_store_serves_the_shared_prompt(model, prompts, daemon_factory) -> None:
    from kvstore.models import layout_for
    from kvstore.worker import Worker

    d = daemon_factory(cpu_capacity="16MiB", slab="1MiB")
    layout = layout_for(model.config, torch.float32, 8)
    with KVStoreClient(d.address, layout=layout, model="beam-test") as client:
        runs = []
        for _ in range(2):
            with Worker(model, num_blocks=64, block_size=8, client=client) as worker:
                runs.append(worker.beam_search(prompts, WIDTH, MAX_NEW))
                worker.flush()
                offloaded = worker.stats.offloaded_blocks
            assert worker.stats.offload_errors == 0
        cold, warm = runs
        # The first run offloaded each prompt's full blocks once (3 + 2), not once per beam;
        # the second, a fresh worker, loaded them instead of computing them.
        assert offloaded == 0  # the second worker found everything stored already
        assert client.stats().tiers[0].blocks >= 5
        assert [r.store_tokens for r in cold] == [0, 0]
        assert [r.store_tokens for r in warm] == [24, 16]
        for a, b in zip(cold, warm, strict=True):
            assert [x.tokens for x in a.beams] == [x.tokens for x in b.beams]


def test_beam_search_refuses_a_busy_worker_and_bad_arguments(model, prompts) -> None:
    from kvstore.worker import Worker

    with Worker(model, num_blocks=64, block_size=8) as worker:
        with pytest.raises(ValueError, match="positive"):
            worker.beam_search(prompts, 0, 4)
        with pytest.raises(ValueError, match="non-empty"):
            worker.beam_search([[]], 2, 4)
        worker.submit(prompts[0], 2)
        with pytest.raises(RuntimeError, match="idle"):
            worker.beam_search(prompts, 2, 4)
        worker.run_until_done()
        assert len(worker.beam_search(prompts, 2, 4)) == 2


def test_a_beam_search_that_runs_out_of_blocks_frees_everything(model, prompts) -> None:
    from kvstore.errors import CapacityError
    from kvstore.worker import Worker

    # 30 + 21 prompt tokens in blocks of 8: 7 blocks for the prompts, 4 beams copying them
    # need far more than 12.
    with Worker(model, num_blocks=12, block_size=8) as worker:
        with pytest.raises(CapacityError):
            worker.beam_search(prompts, 4, MAX_NEW, share=False)
        worker.cache.check_invariants()
        assert worker.cache.stats().num_in_use == 0
        # Sharing fits: the same worker serves it afterwards.
        assert len(worker.beam_search(prompts, 2, 4)) == 2
