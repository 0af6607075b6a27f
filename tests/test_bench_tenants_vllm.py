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


def test_each_servers_kv_cache_holds_every_request_it_may_admit(bench: ModuleType) -> None:
    # A server admits up to ``concurrency`` requests (``--max-num-seqs``): a smaller cache
    # preempts some, which then load their prompt again (measured: 191.9% of prompt tokens).
    tokens = 2048 + 64 + 32
    blocks = -(-tokens // bench.BLOCK)
    for concurrency in (1, 4, 12, 24, 32, 100):
        sizes = {"system": 2048, "question": 64, "generated": 32, "concurrency": concurrency}
        gib = bench.kv_cache_gib(sizes)
        assert gib * (1 << 30) >= concurrency * blocks * bench.BLOCK_BYTES, concurrency
        assert gib >= 1
    # At the default load, the harness's 1 GiB, as before.
    assert (
        bench.kv_cache_gib({"system": 2048, "question": 64, "generated": 32, "concurrency": 4}) == 1
    )


@pytest.mark.parametrize("flag", ["--concurrency", "--per-tenant"])
def test_a_load_below_one_is_refused_before_anything_starts(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, flag: str
) -> None:
    def started(*args: object, **kw: object) -> NoReturn:
        raise AssertionError("the benchmark started something")

    for name in ("can_run_as_other_uids", "KVStoreDaemon", "Engine", "Server", "open_dir"):
        monkeypatch.setattr(bench, name, started)
    monkeypatch.setattr(sys, "argv", ["bench_tenants_vllm.py", flag, "0"])
    with pytest.raises(SystemExit, match=f"{flag} must be at least 1, got 0"):
        bench.main()
