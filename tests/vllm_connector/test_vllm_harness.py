"""The engine harness itself: an engine the tests kill (a timeout, a failed test) leaves no
process behind. vLLM's engine core and workers are children of the engine process; killed
alone, the parent left them computing, orphaned, for the rest of the run (one such worker
took a core for 40 minutes beside the next tests and benchmarks)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm builds .venv-vllm)", allow_module_level=True)

from .harness import Engine, engine_spec, prompt

ENGINE_PROCESSES = True  # the engines' own processes are what it checks (conftest)

pytestmark = pytest.mark.timeout(900)


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process, from /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def _descendants(pid: int) -> set[int]:
    parents, found, todo = _parents(), set(), [pid]
    while todo:
        p = todo.pop()
        children = {c for c, pp in parents.items() if pp == p}
        todo += list(children - found)
        found |= children
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (nobody may reap an orphan here: a zombie has stopped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_killed_engine_leaves_none_of_its_processes_running(work: Path, model: Path) -> None:
    never = work / "never"  # the engine's only phase waits for this file, which never comes
    phase = {"prompts": [{"ids": prompt(40, 1)}], "max_tokens": 1, "wait_for": str(never)}
    engine = Engine(engine_spec(model, None, [phase]), work, "killed")
    try:
        deadline = time.monotonic() + 600  # a hang guard: an engine starts in ~15-60 s
        while True:  # wait for its engine core and worker processes
            spawned = _descendants(engine.proc.pid)
            if any(b"VLLM::Worker" in _cmdline(p) for p in spawned if _running(p)):
                break
            assert engine.proc.poll() is None, f"engine exited early:\n{engine.tail()}"
            assert time.monotonic() < deadline, f"engine never started:\n{engine.tail()}"
            time.sleep(0.5)
    finally:
        engine.kill()
    deadline = time.monotonic() + 30  # SIGKILL ends a process at once; this is a hang guard
    while (left := {p for p in spawned if _running(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes of the killed engine still running: {sorted(left)}"
