"""Before/after of the same-host client: benchmark scripts run against two source trees, A/B/A/B.

``--before DIR`` is a checkout (or ``git archive``) of the revision to compare with; the scripts
come from this tree and import ``kvstore`` from the tree under test (``PYTHONPATH``), so both
sides run the same measurement code. Runs alternate (A B, then B A, ...) so that load from
other processes hits both alike, and each figure is the median over ``--runs`` runs. The
figures: ``bench_transfer`` (shm put/get GB/s and their ratio to memcpy, 64 KiB and 2 MiB
blocks, batches of 32, in the steady state; the first write's put and the cost of a client
mapping a slab, per MiB and against memcpy, reported apart), ``bench_lookup`` (lookup of 128
keys, p50 us) and ``bench_store_share`` (lookup + load of a 120-block prefix, ms). A figure a
revision does not report (an older script) is left blank. ``KVSTORE_LOCAL_CALLS=0`` in
``--env-after`` measures the after side without local calls (what the other steps bought alone).

``--smoke`` checks the machinery: ``bench_lookup --smoke`` once on each side (``--before``
defaults to this tree then); a side that fails, or reports none of its figures, is an error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from _harness import add_run_args, emit, finish_args, print_header, run_main

HERE = os.path.dirname(os.path.abspath(__file__))
AFTER = os.path.dirname(HERE)

SCRIPTS = {
    "transfer": ["bench_transfer.py", "--quick", "--no-redis", "--json"],
    "lookup": ["bench_lookup.py", "--quick", "--json"],
    "store_share": ["bench_store_share.py", "--quick", "--json"],
}


def figures(name: str, doc: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    if name == "transfer":
        for size, label in ((str(64 << 10), "64KiB"), (str(2 << 20), "2MiB")):
            res = doc["results"].get(size, {})
            for path in ("memcpy", "shm_put", "shm_get", "shm_put_first"):
                if path in res:
                    out[f"{path} {label} GB/s"] = res[path]["gbps"]
            if "memcpy" in res:
                for path in ("shm_put", "shm_get", "shm_put_first"):
                    if path in res:
                        out[f"{path} {label} / memcpy"] = res[path]["gbps"] / res["memcpy"]["gbps"]
            first_map = (doc.get("first_map") or {}).get(size)
            if first_map:
                out[f"first map {label} ms/MiB"] = first_map["ms_per_mib"]
                out[f"first map {label} x memcpy"] = first_map["of_memcpy"]
    elif name == "lookup":
        out["lookup(128) p50 us"] = doc["us"]["lookup128"]["median"]
        out["empty gRPC call p50 us"] = doc["us"]["empty"]["median"]
        for key, label in (
            ("lookup128_alone", "back to back"),
            ("call128", "as a call (no presence table)"),
            ("lookup128_miss", "last key missing"),
            ("async_lookup128", "async"),
            ("three_calls128", "+ acquire + prefetch, 3 calls"),
            ("one_call128", "+ acquire + prefetch, 1 call"),
        ):
            if key in doc["us"]:
                out[f"lookup(128) {label} p50 us"] = doc["us"][key]["median"]
    elif name == "store_share":
        for layout, r in doc["s"].items():
            out[f"{layout} lookup+load ms"] = r["store"] * 1e3
            out[f"{layout} load ms"] = r["load"] * 1e3
    return out


def run(
    tree: str, script: list[str], env_extra: dict[str, str], strict: bool = False
) -> dict[str, Any] | None:
    """The JSON document of one script run on ``tree``; None if it failed (an error with
    ``strict``)."""
    env = dict(os.environ, PYTHONPATH=tree, **env_extra)
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, script[0]), *script[1:]],
        capture_output=True,
        text=True,
        env=env,
        cwd=HERE,
        timeout=1800,
    )
    if proc.returncode != 0:
        if strict:
            raise RuntimeError(f"{script[0]} failed on {tree}:\n{proc.stderr[-3000:]}")
        print(f"  {script[0]} failed on {tree}: {proc.stderr[-600:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout[proc.stdout.index("{") :])


def parse_env(pairs: list[str]) -> dict[str, str]:
    return dict(p.split("=", 1) for p in pairs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(p)
    p.add_argument("--before", help="source tree of the revision to compare with (required)")
    p.add_argument("--after", default=AFTER, help="source tree under test (default: this one)")
    p.add_argument("--runs", type=int, default=None, help="A/B pairs (default 3)")
    p.add_argument("--only", nargs="*", default=None, choices=list(SCRIPTS))
    p.add_argument("--env-after", nargs="*", default=[], help="NAME=VALUE for the after side")
    p.add_argument(
        "--full-transfer",
        action="store_true",
        help="bench_transfer without --quick: 512 MiB per size, 3 rounds (24 batches of 2 MiB "
        "blocks a run, not 4)",
    )
    args = finish_args(p.parse_args())
    if args.before is None:
        if not args.smoke:
            p.error("--before is required (outside --smoke)")
        args.before = AFTER
    args.runs = args.runs or (1 if args.smoke else 3)
    args.only = args.only or (["lookup"] if args.smoke else list(SCRIPTS))
    scripts = dict(SCRIPTS)
    if args.full_transfer:
        scripts["transfer"] = [a for a in SCRIPTS["transfer"] if a != "--quick"]
    if args.smoke:
        scripts = {k: [a if a != "--quick" else "--smoke" for a in v] for k, v in scripts.items()}
    if not args.json:
        print_header("bench_client_ab", args)
    sides = {"before": (args.before, {}), "after": (args.after, parse_env(args.env_after))}
    samples: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    loads = [os.getloadavg()]  # the figures mean little without the load they ran under
    for i in range(args.runs):
        order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
        for name in args.only:
            for side in order:
                tree, env = sides[side]
                doc = run(tree, scripts[name], env, strict=args.smoke)
                if doc is None:
                    continue
                got = figures(name, doc)
                if args.smoke and not got:
                    raise RuntimeError(f"{name} on {tree}: none of its figures in its result")
                for k, v in got.items():
                    samples[side].setdefault(k, []).append(v)
                loads.append(os.getloadavg())
                print(f"run {i + 1} {name} {side} done", file=sys.stderr, flush=True)
    keys = sorted(set(samples["before"]) | set(samples["after"]))
    table = {
        k: {
            side: statistics.median(samples[side][k]) if samples[side].get(k) else None
            for side in ("before", "after")
        }
        for k in keys
    }
    if not args.json:
        print(f"{'figure':<36} {'before':>10} {'after':>10} {'after/before':>12}")
        for k, row in table.items():
            b, a = row["before"], row["after"]
            ratio = f"{a / b:.2f}" if a is not None and b else ""
            fb = f"{b:.2f}" if b is not None else "-"
            fa = f"{a:.2f}" if a is not None else "-"
            print(f"{k:<36} {fb:>10} {fa:>10} {ratio:>12}")
        one_min = [load[0] for load in loads]
        print(f"load average (1 min) over the run: {min(one_min):.2f}-{max(one_min):.2f}")
    emit({"runs": args.runs, "medians": table, "samples": samples, "loads": loads}, args)
    return 0


if __name__ == "__main__":
    run_main(main)
