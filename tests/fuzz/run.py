"""Runs the fuzz targets (``tests/fuzz/fuzz_*.py``): ``make fuzz`` and ``tests/test_fuzz.py``.

    python tests/fuzz/run.py [--seconds S] [--target NAME] [--runs N --seed K]

``--seconds``: each target fuzzes for S seconds (``-max_total_time``), starting from its
committed seed corpus (``tests/fuzz/corpus/<name>/``, never written) and its work corpus
(``var/fuzz/corpus/<name>/``, where new inputs go, kept across runs); a crashing input is
written to ``var/fuzz/crashes/<name>-crash-<sha1>``. ``--runs``: a bounded, deterministic check
instead (the committed corpus, then N mutations from seed K, new inputs to a throw-away
folder). Prints per target the inputs executed, the rate and any crash; exits 1 if any target
crashed."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CORPUS = HERE / "corpus"
WORK = ROOT / "var" / "fuzz" / "corpus"
CRASHES = ROOT / "var" / "fuzz" / "crashes"

MAX_LEN = {
    "config": 4096,
    "grpc_requests": 8192,
    "local_call": 8192,
    "nvme_open": 16384,
    "nvme_records": 12288,
    "nvme_superblock": 16384,
    "redis_value": 12288,
    "resp": 4096,
    "session_op": 4096,
}
"""Largest input per target (libFuzzer's ``-max_len``): room for the largest seed, bounded so
an input runs in milliseconds."""
TIMEOUT_S = 10
"""An input that runs longer is a hang: a crash."""


def targets() -> list[str]:
    return sorted(p.stem.removeprefix("fuzz_") for p in HERE.glob("fuzz_*.py"))


@dataclass
class Result:
    target: str
    executed: int
    seconds: float
    rate: int
    """Inputs a second, as libFuzzer counts them (start-up excluded)."""
    crash: str | None
    returncode: int
    output: str


def run_target(
    name: str,
    *,
    seconds: int | None = None,
    runs: int | None = None,
    seed: int = 1,
    python: str = sys.executable,
    crashes: Path = CRASHES,
) -> Result:
    """Fuzz target ``name``: for ``seconds``, or a check of ``runs`` mutations from ``seed``."""
    crashes.mkdir(parents=True, exist_ok=True)
    corpus = CORPUS / name
    flags = [
        f"-max_len={MAX_LEN.get(name, 4096)}",
        f"-timeout={TIMEOUT_S}",
        "-rss_limit_mb=3072",
        "-print_final_stats=1",
        f"-artifact_prefix={crashes}/{name}-",
    ]
    env = dict(os.environ, PYTHONHASHSEED="0")
    with tempfile.TemporaryDirectory(prefix=f"fuzz-{name}-") as scratch:
        if runs is not None:
            flags += [f"-runs={runs}", f"-seed={seed}"]
            dirs = [scratch, str(corpus)]  # new inputs to a throw-away folder
        else:
            work = WORK / name
            work.mkdir(parents=True, exist_ok=True)
            flags += [f"-max_total_time={seconds}"]
            dirs = [str(work), str(corpus)]
        env["TMPDIR"] = scratch  # what a target writes (files, sockets) goes with it
        cmd = [python, str(HERE / f"fuzz_{name}.py"), *flags, *dirs]
        start = time.monotonic()
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        elapsed = time.monotonic() - start
    out = proc.stdout
    executed = re.findall(r"stat::number_of_executed_units: (\d+)", out)
    rate = re.findall(r"stat::average_exec_per_sec: +(\d+)", out)
    crash = re.findall(r"(?:Test unit|crash|timeout|oom) written to (\S+)", out)
    if not crash and re.search(r"Test unit written to (\S+)", out):
        crash = re.findall(r"Test unit written to (\S+)", out)
    return Result(
        name,
        int(executed[-1]) if executed else 0,
        elapsed,
        int(rate[-1]) if rate else 0,
        crash[-1] if crash else (f"exit status {proc.returncode}" if proc.returncode else None),
        proc.returncode,
        out,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=60, help="per target (default 60)")
    parser.add_argument("--target", default="", help="one target (default: all)")
    parser.add_argument("--runs", type=int, help="a bounded check: this many mutations")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    names = targets()
    if args.target:
        wanted = args.target.removeprefix("fuzz_").removesuffix(".py")
        if wanted not in names:
            parser.error(f"no target {args.target!r}; there are {', '.join(names)}")
        names = [wanted]
    failed = False
    for name in names:
        r = run_target(name, seconds=args.seconds, runs=args.runs, seed=args.seed)
        line = f"{name:16s} {r.executed:>10d} inputs in {r.seconds:7.1f} s ({r.rate:6d}/s)"
        print(line + (f"  CRASH: {r.crash}" if r.crash else "  no crash"), flush=True)
        if r.crash:
            failed = True
            print(r.output[-6000:], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
