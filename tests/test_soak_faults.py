"""The soak with faults, two minutes of it: ``benchmarks/soak.py --faults --seconds 120`` as a
subprocess (a real daemon, Redis and four client processes under two uids; the daemon
``kill -9``-ed twice, Redis restarted once, the NVMe filesystem filled once). It must exit 0,
and its report must say: no wrong byte, no acknowledged durable block lost, no unexpected error
kind, a ledger check after every daemon kill, every fault injected, and the daemon stopped
cleanly at the end.

The faults come on a fixed schedule and every check counts what happened, not how fast: the
run cannot pass or fail by timing (errors are judged by the period they fall in, each fault's
window reaching until a few seconds after the process answers again). Needs root (setpriv,
mount) and redis-server, as CI has; skipped otherwise. Also ``soak.py --smoke`` (the plain
soak, a few seconds) must pass.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from redis_binary import NOT_INSTALLED, redis_server_binary

ROOT = Path(__file__).resolve().parent.parent
SOAK = ROOT / "benchmarks" / "soak.py"

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or redis_server_binary() is None,
    reason="needs root (clients under other uids, a tmpfs), setpriv and a Redis server",
)


def run_soak(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SOAK), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=ROOT,
    )


@needs_root
def test_two_minutes_of_faults_lose_and_corrupt_nothing(tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    plot = tmp_path / "soak.png"
    r = run_soak(
        "--faults",
        "--seconds",
        "120",
        "--plot",
        str(plot),
        "--summary-json",
        str(summary_path),
        timeout_s=600,
    )
    report = r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0, report
    summary = json.loads(summary_path.read_text())
    assert summary["failures"] == [], report
    assert summary["wrong_blocks"] == 0 and summary["wrong_bytes"] == 0, report
    assert summary["durable_lost"] == 0 and summary["durable_wrong"] == 0, report
    assert summary["unexpected_errors"] == {}, report
    assert summary["daemon_kills"] == 2, report
    kinds = [f["kind"] for f in summary["faults"]]
    assert sorted(kinds) == sorted(
        ["daemon kill", "daemon kill", "redis restart", "disk fill", "disk free"]
    ), report
    assert all(f["done_s"] >= 0 for f in summary["faults"]), report
    after_kills = [c for c in summary["ledger_checks"] if c["after"].startswith("daemon kill")]
    assert len(after_kills) == 2 and all(c["acked"] > 0 for c in after_kills), report
    assert summary["blocks_read"] > 0 and summary["ops"]["put"] > 0, report
    assert summary["sigterm_exit"] == 0, report
    assert plot.stat().st_size > 0


def test_the_plain_soak_smoke_run_passes() -> None:
    if redis_server_binary() is None:
        pytest.skip(NOT_INSTALLED)
    r = run_soak("--smoke", timeout_s=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert "RESULT: PASS" in r.stdout
