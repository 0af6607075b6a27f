"""Tensor parallelism: a TP=2 engine (two worker processes, one core each on this 2-core
machine) with the connector, against a real daemon.

Each rank stores its own shard (its KV heads) in a namespace of its own (``tp_rank`` and
``tp_size`` are in the namespace); a fresh TP=2 engine loads both shards and answers as the
engine that stored them; a TP=1 engine, whose namespace is another (tp_size 1), never loads a
TP=2 shard.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm builds .venv-vllm)", allow_module_level=True)

from conftest import DaemonProcess

from .harness import BLOCK, Engine, assert_same_answers, engine_spec, outputs, prompt

ENGINE_PROCESSES = True  # tensor parallel ranks run in processes (conftest.engine_processes)

pytestmark = pytest.mark.timeout(1800)

X = [prompt(200, 71), prompt(150, 72)]  # 6 and 4 full blocks load (the last token computes)
X_CACHED = [6 * BLOCK, 4 * BLOCK]
PHASE = {"prompts": [{"ids": x} for x in X], "max_tokens": 8, "one_by_one": True}
# Two ranks on two cores: each rank's OpenMP threads on a core of its own, none reserved
# (vLLM would reserve one core per rank for its own processes, leaving the ranks none).
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def spec(model: Path, daemon: DaemonProcess, tp: int) -> dict:
    return engine_spec(
        model,
        {"address": daemon.address, "timeout_s": 30, "lookup_timeout_s": 30},
        [PHASE],
        max_model_len=256,
        prefix_caching=False,
        tensor_parallel_size=tp,
        env=TP2_ENV if tp > 1 else {},
    )


def our_namespaces(daemon: DaemonProcess) -> dict[str, int]:
    from kvstore.client.sync import KVStoreClient
    from kvstore.layout import KVLayout

    with KVStoreClient(daemon.address, layout=KVLayout(1, 1, 32, BLOCK), model="probe") as kv:
        return {ns.name: ns.blocks for ns in kv.stats().namespaces if "vllm-cpu" in ns.name}


@pytest.fixture(scope="module")
def stored(model: Path, work: Path, daemon: DaemonProcess) -> tuple[dict, dict[str, int]]:
    result = Engine(spec(model, daemon, 2), work, "T2-store").result()
    return result, our_namespaces(daemon)


def test_each_rank_stores_its_own_shard(stored) -> None:
    result, namespaces = stored
    assert [w["cpus"] for w in result["workers"]] == [["0"], ["1"]], result["workers"]
    # Two namespaces (rank 0 and rank 1 of 2), the same blocks in each: 6 + 4 prompt blocks.
    assert len(namespaces) == 2 and set(namespaces.values()) == {10}, namespaces


def test_a_fresh_tp2_engine_loads_both_shards_and_answers_identically(
    stored, model: Path, work: Path, daemon: DaemonProcess
) -> None:
    first, _ = stored
    got = outputs(Engine(spec(model, daemon, 2), work, "T2-load").result())
    assert [o["num_cached_tokens"] for o in got] == X_CACHED
    assert_same_answers(got, outputs(first), "fresh TP=2 engine against the storing one")


def test_a_tp1_engine_never_loads_tp2_shards(
    stored, model: Path, work: Path, daemon: DaemonProcess
) -> None:
    del stored
    got = outputs(Engine(spec(model, daemon, 1), work, "T1").result())
    assert [o["num_cached_tokens"] for o in got] == [0, 0]
    assert len(our_namespaces(daemon)) == 3  # its own, beside the two TP=2 shards
