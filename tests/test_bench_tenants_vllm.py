"""``benchmarks/bench_tenants_vllm.py`` runs each tenant under a uid of its own: run by
another user than root, it skips (``_harness.SKIP_EXIT``, naming ``root``) before it starts
anything. Its smoke run proper is ``tests/test_bench_smoke.py``'s (as root, in .venv-vllm)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_EXIT = 77  # benchmarks/_harness.py


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module (its imports put benchmarks/ and tests/ on ``sys.path``, for
    this test only)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    path = ROOT / "benchmarks" / "bench_tenants_vllm.py"
    spec = importlib.util.spec_from_file_location("bench_tenants_vllm", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_not_root_it_skips_naming_root_before_starting_anything(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def started(*args: object, **kw: object) -> NoReturn:
        raise AssertionError("the benchmark started something")

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    for name in ("can_run_as_other_uids", "KVStoreDaemon", "Engine", "Server", "open_dir"):
        monkeypatch.setattr(bench, name, started)
    out = tmp_path / "result.json"
    argv = ["bench_tenants_vllm.py", "--smoke", "--json-out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert bench.main() == SKIP_EXIT
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "tenants_vllm"
    assert doc["skipped"]["needs"] == "root"
    assert "euid 1000" in doc["skipped"]["reason"]


def test_as_root_it_does_not_skip(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    args = argparse.Namespace(json=False, json_out=None, smoke=True, quick=True)
    assert bench.skip_unless_root(args) is None
