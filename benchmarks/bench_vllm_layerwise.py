"""Whether layer-wise synchronous loads pay on vLLM's CPU backend (``layerwise`` option).

Runs in ``.venv-vllm``. One engine stores long prompts; then fresh engines with
``load: "sync"`` load them, alternating ``layerwise: "off"`` (the whole load before the forward
pass, the CPU default) and ``"on"`` (each layer's blocks copied as the forward pass reaches
that layer), and report the median TTFT of the stored prompts served one at a time
(``max_tokens=1``; vLLM's CPU backend, the random-weight 200M Llama ``RANDOM_200M``, bf16,
prefix caching off). The ratio on/off is within one run; the load is printed before and after.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm_connector"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import KVStoreDaemon, Reporter, parse_args, print_header, run_main
from harness import RANDOM_200M, Engine, bench_spec, make_random_model, median_seconds, prompt


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    report = Reporter(args.json)
    if not args.json:
        print_header("bench_vllm_layerwise", args)
    n, length = (3, 1024) if args.quick else (4, 1536)
    arms = ["off", "on"] if args.quick else ["off", "on", "off", "on"]
    stored = [{"ids": prompt(length, 700 + i)} for i in range(n)]
    work = Path(tempfile.mkdtemp(prefix="kvbench-vllm-layerwise-"))
    load_before = os.getloadavg()
    results: dict[str, list[float]] = {"off": [], "on": []}
    try:
        model = make_random_model(work / "random-200m", **RANDOM_200M)
        with KVStoreDaemon(2 << 30) as daemon:
            conn: dict[str, Any] = {"address": daemon.address}
            phases = [{"prompts": stored, "max_tokens": 1}]
            Engine(bench_spec(model, connector=conn, phases=phases), work, "store").result()
            serve = [
                {"prompts": [{"ids": prompt(64, 999)}], "max_tokens": 1},
                {"prompts": stored, "max_tokens": 1, "one_by_one": True},
            ]
            for i, mode in enumerate(arms):
                sync = {**conn, "load": "sync", "layerwise": mode}
                r = Engine(bench_spec(model, connector=sync, phases=serve), work, f"{mode}{i}")
                rows = r.result()["phases"][1]["outputs"]
                assert all(o["num_cached_tokens"] > 0 for o in rows), "nothing was loaded"
                results[mode].append(median_seconds(rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    off, on = min(results["off"]), min(results["on"])
    report.table(
        f"vLLM CPU, random-200M, sync loads of {length}-token stored prompts (median TTFT of {n},"
        f" best of {len(results['on'])} engines per arm); load {load_before[0]:.1f} before,"
        f" {load_after[0]:.1f} after",
        ["layerwise", "TTFT", "vs off"],
        [
            ["off (whole load before the forward pass)", f"{off * 1e3:.0f} ms", ""],
            ["on (each layer as the forward pass reaches it)", f"{on * 1e3:.0f} ms",
             f"{(on / off - 1) * 100:+.1f}%"],
        ],
    )  # fmt: skip
    if args.json:
        print(json.dumps({"seconds": results, "load": [load_before, load_after]}, indent=2))
    return 0


if __name__ == "__main__":
    run_main(main)
