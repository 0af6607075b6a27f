"""The connector through vLLM's request lifecycle, against real engines and a real daemon:
synchronous loads, requests preempted for want of KV blocks, and a request aborted while its
load is in flight.

Engine A stores the prompts (and serves a batch on a KV cache too small for it, so vLLM
preempts); engine S loads them with ``load: "sync"``; engine G (the gated connector: real, with
its loads held until the test lets them go) has a request aborted while it waits in
WAITING_FOR_REMOTE_KVS; engine R (no connector) is the reference for every answer.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm builds .venv-vllm)", allow_module_level=True)

from conftest import DaemonProcess

from .harness import BLOCK, IN_PROCESS, Engine, assert_same_answers, engine_spec, outputs, prompt

pytestmark = pytest.mark.timeout(1800)

X = [prompt(200, 31), prompt(150, 32)]  # 6 and 4 full blocks load (the last token computes)
X_CACHED = [6 * BLOCK, 4 * BLOCK]
# Four requests of 100-130 prompt tokens and 64 generated: ~26 blocks, on a 16-block cache.
PRE = [prompt(100 + 10 * k, 40 + k) for k in range(4)]
PRE_TOKENS = 64
SMALL_CACHE = 16

X_PHASE = {"prompts": [{"ids": x} for x in X], "max_tokens": 8, "one_by_one": True}
PRE_PHASE = {"prompts": [{"ids": p} for p in PRE], "max_tokens": PRE_TOKENS}


def spec(model: Path, connector: dict | None, phases: list[dict], **kw: object) -> dict:
    return engine_spec(
        model,
        connector,
        phases,
        max_num_batched_tokens=64,
        max_model_len=256,
        prefix_caching=False,
        **kw,
    )


def conn(daemon: DaemonProcess, **extra: object) -> dict:
    # Deadlines long enough that a loaded 2-core machine never turns a hit into a miss.
    return {"address": daemon.address, "timeout_s": 30, "lookup_timeout_s": 30, **extra}


@pytest.fixture(scope="module")
def reference(model: Path, work: Path) -> dict:
    return Engine(spec(model, None, [X_PHASE, PRE_PHASE]), work, "R").result()


@pytest.fixture(scope="module")
def stored(model: Path, work: Path, daemon: DaemonProcess) -> dict:
    """Engine A: stores X, then serves the preemption batch on a 16-block KV cache."""
    return Engine(
        spec(
            model,
            conn(daemon),
            [X_PHASE, PRE_PHASE],
            num_gpu_blocks=SMALL_CACHE,
            log_stats=True,
            check_blocks_free=True,
        ),
        work,
        "A",
    ).result()


def test_preempted_requests_answer_as_without_preemption(stored: dict, reference: dict) -> None:
    # The cache was too small for the batch: vLLM preempted requests, freeing their blocks
    # while saves may still have been reading them; each resumed request recomputed or
    # loaded its prefix again.
    assert stored["counters"].get("vllm:num_preemptions", 0) > 0, stored["counters"]
    assert_same_answers(outputs(stored, 0), outputs(reference, 0), "engine A, X")
    assert_same_answers(outputs(stored, 1), outputs(reference, 1), "engine A, preempted batch")
    assert stored["blocks_free"], "KV blocks still held once engine A was idle"


@pytest.mark.parametrize("layerwise", ["off", "on"])
def test_sync_loads_answer_identically(
    stored: dict, reference: dict, model: Path, work: Path, daemon: DaemonProcess, layerwise: str
) -> None:
    """Sync loads whole before the forward pass ("off", the CPU default), and layer by layer
    ("on": each layer's blocks copied as the forward pass reaches that layer)."""
    del stored  # X is in the store
    s = Engine(
        spec(model, conn(daemon, load="sync", layerwise=layerwise), [X_PHASE]),
        work,
        f"S-{layerwise}",
    ).result()
    got = outputs(s)
    assert [o["num_cached_tokens"] for o in got] == X_CACHED
    assert_same_answers(got, outputs(reference, 0), "engine S (sync loads)")


def test_abort_while_loading_leaks_nothing_and_the_engine_keeps_serving(
    stored: dict, reference: dict, model: Path, work: Path, daemon: DaemonProcess
) -> None:
    del stored  # X is in the store
    files = {name: str(work / f"G.{name}") for name in ("started", "finished", "gate")}
    g = Engine(
        spec(
            model,
            conn(daemon, transfers="thread"),
            [{"abort": {"ids": X[0], **files}}, X_PHASE],
            connector_class=["gated_connector", "GatedKVStoreConnector"],
            check_blocks_free=True,
            env={
                # The engine core in its own process, stepping while this one waits for the
                # load to start (in one process, nothing steps until the next generate).
                IN_PROCESS: "1",
                "KVSTORE_TEST_LOAD_STARTED": files["started"],
                "KVSTORE_TEST_LOAD_GATE": files["gate"],
                "KVSTORE_TEST_FINISHED": files["finished"],
            },
        ),
        work,
        "G",
    ).result()
    # vLLM finished the aborted request while its load was still held: the connector must
    # not have asked vLLM to hold its blocks for a save (they are freed when the load
    # reports), and nothing else may have been finished.
    (line,) = [f for f in g["phases"][0]["finished"] if "aborted-while-loading" in f]
    assert "load_pending=True delay=False" in line
    # The engine still loads and answers, and once idle every block is free again.
    got = outputs(g, 1)
    assert [o["num_cached_tokens"] for o in got] == X_CACHED
    assert_same_answers(got, outputs(reference, 0), "engine G after the abort")
    assert g["blocks_free"], "the aborted request's blocks (or others) were never freed"


def test_a_failed_layerwise_sync_load_is_recomputed(
    stored: dict, reference: dict, model: Path, work: Path, daemon: DaemonProcess
) -> None:
    """Sync loads copied layer by layer (``layerwise: "on"``, each layer copied as vLLM's
    forward pass reaches it); the third block of each load is deleted from the daemon just
    before it loads, so the load fails there: the connector reports the blocks from it on, and
    vLLM recomputes them, with answers unchanged."""
    # X is in the store. Runs last: it deletes blocks of X that the other tests load.
    del stored
    errors = work / "F.errors"
    f = Engine(
        spec(
            model,
            conn(daemon, load="sync", layerwise="on"),
            [X_PHASE],
            connector_class=["deleting_connector", "DeletingKVStoreConnector"],
            check_blocks_free=True,
            env={"KVSTORE_TEST_LOAD_ERRORS": str(errors)},
        ),
        work,
        "F",
    ).result()
    reported = [line.split() for line in errors.read_text().splitlines()]
    # One report per prompt: its blocks from the third on (6 and 4 blocks load).
    assert [len(r) for r in reported] == [4, 2], reported
    assert_same_answers(outputs(f), outputs(reference, 0), "engine F (a failed sync load)")
    assert f["blocks_free"]
