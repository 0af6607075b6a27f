"""Whether layer-wise synchronous loads pay on vLLM's CPU backend (``layerwise`` option).

Runs in ``.venv-vllm``. One engine stores long prompts; then fresh engines serve them one at
a time (``max_tokens=1``, so the time is the TTFT), alternating three arms: ``load: "sync"``
with ``layerwise: "off"`` (the whole load before the forward pass, the CPU default), with
``layerwise: "on"`` (each layer's blocks copied as the forward pass reaches that layer), and an
engine without the connector (every token computed: what the load saves). vLLM's CPU backend,
the random-weight 200M Llama ``RANDOM_200M``, bf16, prefix caching off. Each arm's figure is the
median TTFT over every stored prompt of every engine of that arm; the ratios are within one run,
and the load average is printed before and after. Every connector engine must load every whole
block of each stored prompt but the last token's, and the engine without it nothing.

``--smoke`` checks the script, not the figures: the tests' small random Llama
(``RANDOM_LLAMA``), one 128-token stored prompt, one engine per arm (four engines with the one
that stores: minutes here, mostly engine start-up).
"""

from __future__ import annotations

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
from harness import BLOCK, RANDOM_200M, Engine, bench_spec, make_random_model, prompt

VENV = ".venv-vllm"  # the environment this script runs in (make vllm-env)
SMOKE_TIMEOUT_S = 1500  # --smoke starts four vLLM engines, ~1-3 minutes each here
LABELS = {
    "off": "layerwise off (whole load before the forward pass)",
    "on": "layerwise on (each layer as the forward pass reaches it)",
    "none": "no connector (every token computed)",
}


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    report = Reporter(args.json)
    if not args.json:
        print_header("bench_vllm_layerwise", args)
    n, length = (1, 128) if args.smoke else (3, 1024) if args.quick else (4, 1536)
    arms = ["off", "on", "none"] * (1 if args.quick else 2)
    stored = [{"ids": prompt(length, 700 + i)} for i in range(n)]
    loadable = (length - 1) // BLOCK * BLOCK  # the last token is always computed
    work = Path(tempfile.mkdtemp(prefix="kvbench-vllm-layerwise-"))
    load_before = os.getloadavg()
    seconds: dict[str, list[float]] = {arm: [] for arm in LABELS}
    try:
        if args.smoke:
            model = make_random_model(work / "random-tiny")
        else:
            model = make_random_model(work / "random-200m", **RANDOM_200M)
        with KVStoreDaemon((256 << 20) if args.smoke else (2 << 30)) as daemon:
            conn: dict[str, Any] = {"address": daemon.address}
            phases = [{"prompts": stored, "max_tokens": 1}]
            Engine(bench_spec(model, connector=conn, phases=phases), work, "store").result()
            serve = [
                # A warm-up request no arm has stored (fresh per engine): the first forward
                # pass of an engine is slow.
                None,
                {"prompts": stored, "max_tokens": 1, "one_by_one": True},
            ]
            for i, arm in enumerate(arms):
                serve[0] = {"prompts": [{"ids": prompt(64, 900 + i)}], "max_tokens": 1}
                connector = None if arm == "none" else {**conn, "load": "sync", "layerwise": arm}
                spec = bench_spec(model, connector=connector, phases=serve)
                rows = Engine(spec, work, f"{arm}{i}").result()["phases"][1]["outputs"]
                want = 0 if arm == "none" else loadable
                got = [o["num_cached_tokens"] for o in rows]
                expect(got == [want] * n, f"{arm}: {got} tokens loaded, expected {want} each")
                seconds[arm].extend(o["seconds"] for o in rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    kib_per_token = 2 if args.smoke else 32  # bf16 KV of RANDOM_LLAMA, of RANDOM_200M
    med = {arm: statistics.median(s) for arm, s in seconds.items()}
    engines = arms.count("on")
    report.table(
        f"vLLM CPU, {'random-tiny' if args.smoke else 'random-200M'} bf16, {length}-token stored "
        f"prompts ({loadable} tokens loaded, {loadable * kib_per_token / 1024:g} MiB), one at a "
        f"time; median TTFT of {n * engines} requests"
        f" ({engines} engine(s) per arm, alternated); load {load_before[0]:.2f} before,"
        f" {load_after[0]:.2f} after",
        ["arm", "TTFT", "vs layerwise off"],
        [
            [LABELS[arm], f"{med[arm] * 1e3:.0f} ms", f"{(med[arm] / med['off'] - 1) * 100:+.1f}%"]
            for arm in LABELS
        ],
    )
    emit({"seconds": seconds, "median_s": med, "load": [load_before, load_after]}, args)
    return 0


if __name__ == "__main__":
    run_main(main)
