"""Every benchmark still runs: each ``benchmarks/bench_*.py`` (found by glob, so a new one is
tested too) is run as a subprocess with ``--smoke`` (tiny sizes, a few seconds, every byte it
reads back verified) and ``--json-out``. It must exit 0 and write its result document, which
names the benchmark and the smoke mode. Figures are never looked at.

A script that cannot run here exits 77 (``_harness.SKIP_EXIT``) naming what it needs: the test
skips only after checking, with the script's own interpreter, that this is really missing (no
CUDA device, a package not installed, a data file that is not there, not root); otherwise it
fails. A
script whose module sets ``VENV = ".venv-vllm"`` runs with that environment's Python (``make
vllm-env`` builds it; ``.venv-sglang``, ``make sglang-env``) and is skipped, naming that
target, when it is not built. Peers (redis-server) are not
optional: a script that needs one fails without it. A smoke run gets ``SCRIPT_TIMEOUT_S``, or
the ``SMOKE_TIMEOUT_S`` its module sets (the vLLM ones start engines: minutes).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "benchmarks").glob("bench_*.py"))
SKIP_EXIT = 77  # benchmarks/_harness.py
SCRIPT_TIMEOUT_S = 240  # a smoke run takes seconds; this catches a hang, not a slow machine


def module_constant(script: Path, name: str, kind: type) -> object | None:
    """The literal a script's module assigns to ``name`` at top level (None: it does not)."""
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            value = node.value
            if not (isinstance(value, ast.Constant) and isinstance(value.value, kind)):
                raise AssertionError(f"{script.name}: {name} must be a {kind.__name__} literal")
            return value.value
    return None


def interpreter_for(script: Path) -> str:
    venv = module_constant(script, "VENV", str)
    if not isinstance(venv, str):
        return sys.executable
    python = ROOT / venv / "bin" / "python"
    if not python.exists():
        # .venv-vllm is built by `make vllm-env`, .venv-sglang by `make sglang-env`
        target = f"make {venv.removeprefix('.venv-')}-env"
        pytest.skip(f"{script.name} runs in {venv}, which is not built here ({target})")
    return str(python)


def really_missing(python: str, needs: str) -> bool:
    """Whether ``needs`` (``cuda``, ``module:NAME``, ``file:PATH``, a data file outside the
    repository such as a trace, relative to the repository root, or ``root``, running as root)
    is missing for ``python``."""
    if needs == "root":
        return os.geteuid() != 0  # the script runs as this process does
    if needs.startswith("file:"):
        path = Path(needs.removeprefix("file:"))
        if not path.parts:
            raise AssertionError(f"a skip names no file: {needs!r}")
        return not (ROOT / path).exists()  # an absolute path stays itself
    if needs == "cuda":
        code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"
    elif needs.startswith("module:"):
        name = needs.removeprefix("module:")
        code = f"import importlib.util as u, sys; sys.exit(0 if u.find_spec({name!r}) else 3)"
    else:
        raise AssertionError(f"a skip names an unknown prerequisite: {needs!r}")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    if r.returncode not in (0, 3):
        raise AssertionError(f"checking {needs} failed:\n{r.stderr[-2000:]}")
    return r.returncode == 3


def run_script(python: str, script: Path, out: Path, timeout_s: float) -> tuple[int, str, str]:
    """Run ``script --smoke --json-out out``; past ``timeout_s``, SIGTERM it (its harness then
    stops the daemons and peers it started), SIGKILL it if that does not end it, and fail."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [python, str(script), "--smoke", "--json-out", str(out)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        pytest.fail(
            f"{script.name} --smoke ran past {timeout_s} s\n"
            f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
        )
    return proc.returncode, stdout, stderr


def timeout_for(script: Path) -> float:
    own = module_constant(script, "SMOKE_TIMEOUT_S", int)
    return float(own) if isinstance(own, int) else SCRIPT_TIMEOUT_S


@pytest.mark.parametrize(
    "script",
    # pytest-timeout's limit: past the script's own, with room for the SIGTERM and the checks
    [pytest.param(s, marks=pytest.mark.timeout(timeout_for(s) + 150), id=s.stem) for s in SCRIPTS],
)
def test_benchmark_runs_in_smoke_mode(script: Path, tmp_path: Path) -> None:
    python = interpreter_for(script)
    out = tmp_path / "result.json"
    rc, stdout, stderr = run_script(python, script, out, timeout_for(script))
    tail = f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-4000:]}"
    name = script.stem.removeprefix("bench_")
    if rc == SKIP_EXIT:
        assert out.exists(), f"{script.name} exited {SKIP_EXIT} without its result\n{tail}"
        skipped = json.loads(out.read_text())["skipped"]
        needs = skipped["needs"]
        assert really_missing(python, needs), (
            f"{script.name} skipped for want of {needs}, which is present\n{tail}"
        )
        pytest.skip(f"{script.name}: needs {needs}: {skipped['reason']}")
    assert rc == 0, f"{script.name} --smoke exited {rc}\n{tail}"
    assert out.exists(), f"{script.name} --smoke wrote no result (--json-out)\n{tail}"
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == name, doc.get("benchmark")
    assert doc["mode"] == "smoke"
    assert "skipped" not in doc
    figures = set(doc) - {"benchmark", "mode", "machine"}
    assert figures, f"{script.name}: the result holds no figures\n{tail}"
    assert stdout.strip(), f"{script.name} printed nothing (its tables)\n{tail}"


def test_the_benchmarks_are_found() -> None:
    """The glob above sees the scripts (a moved folder would leave nothing to parametrize)."""
    assert (ROOT / "benchmarks" / "bench_lookup.py") in SCRIPTS


def test_a_script_whose_environment_is_not_built_names_what_builds_it(tmp_path: Path) -> None:
    """The skip of a script that runs in its own venv names that venv's make target (an
    SGLang benchmark once said ``make vllm-env``)."""
    script = tmp_path / "bench_elsewhere.py"
    script.write_text('VENV = ".venv-absent"\n')
    with pytest.raises(pytest.skip.Exception, match=r"\.venv-absent, .*\(make absent-env\)"):
        interpreter_for(script)


def test_a_data_file_is_missing_only_when_it_is_not_there(tmp_path: Path) -> None:
    """``file:PATH`` (bench_trace's trace, beside the repository): absolute, or relative to
    the repository root, as the scripts run from there."""
    trace = tmp_path / "trace.jsonl.gz"
    assert really_missing(sys.executable, f"file:{trace}")
    trace.write_bytes(b"")
    assert not really_missing(sys.executable, f"file:{trace}")
    assert not really_missing(sys.executable, "file:pyproject.toml")
    assert really_missing(sys.executable, "file:benchmarks/no-such-trace.jsonl.gz")
    with pytest.raises(AssertionError, match="names no file"):
        really_missing(sys.executable, "file:")


def test_root_is_missing_only_when_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """``root`` (bench_tenants_vllm runs its tenants under uids of their own)."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert really_missing(sys.executable, "root")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert not really_missing(sys.executable, "root")


def test_the_harness_skips_for_a_missing_data_file(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _harness
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = tmp_path / "result.json"
    args = argparse.Namespace(json=False, json_out=str(out), smoke=True, quick=True)
    needs = f"file:{tmp_path / 'trace.jsonl.gz'}"
    assert _harness.skip(args, needs, "the trace is not here") == SKIP_EXIT
    assert json.loads(out.read_text())["skipped"]["needs"] == needs
    with pytest.raises(ValueError, match="unknown prerequisite"):
        _harness.skip(args, "file:", "no path")
