"""The CPU tier's arena and slab allocator, on real shared memory.

The backing tests need a filesystem that fills up: each runs in a child process, in its own
mount namespace (``unshare``) with a fresh small tmpfs, so a SIGBUS fails the test instead of
killing pytest and nothing is left mounted. The child loads ``tiers/cpu.py`` by path (it imports
only the standard library), which keeps each child at tens of milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvstore.tiers.cpu as cpu
from kvstore.tiers.cpu import HEADER_BYTES

KiB, MiB = 1 << 10, 1 << 20

# ----------------------------------------------------------------- a small tmpfs per child

_UNSHARE = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "-r", "--mount"]
_PRELUDE = f"""
import importlib.util, json, mmap, os, sys
spec = importlib.util.spec_from_file_location("cpu_under_test", {cpu.__file__!r})
cpu = importlib.util.module_from_spec(spec)
sys.modules["cpu_under_test"] = cpu
spec.loader.exec_module(cpu)
MNT = sys.argv[1]
KiB, MiB = 1 << 10, 1 << 20


def fill(path):
    \"\"\"Write a file until its filesystem is full.\"\"\"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\\1" * (64 * KiB))
    except OSError:
        pass
    finally:
        os.close(fd)
"""


@pytest.fixture(scope="session")
def small_tmpfs_ok(tmp_path_factory: pytest.TempPathFactory) -> None:
    mnt = tmp_path_factory.mktemp("probe")
    try:
        probe = subprocess.run(
            [*_UNSHARE, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot make a small tmpfs in a mount namespace: {e}")
    if probe.returncode:
        pytest.skip(f"cannot make a small tmpfs in a mount namespace: {probe.stderr.strip()}")


def run_on_small_tmpfs(tmp_path: Path, size: str, body: str) -> dict:
    """Run ``body`` in a child with a fresh ``size`` tmpfs mounted at ``MNT``; its last line of
    output is JSON. A child killed by SIGBUS fails the test with that name."""
    script = tmp_path / "child.py"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    shell = 'mount -t tmpfs -o size="$1" tmpfs "$2" && exec "$3" "$4" "$2"'
    cmd = [*_UNSHARE, "sh", "-c", shell, "sh", size, str(mnt), sys.executable, str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode in (-signal.SIGBUS, 128 + signal.SIGBUS):
        pytest.fail(f"the child was killed by SIGBUS\n{proc.stdout}{proc.stderr}")
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------- 1. never SIGBUS


def test_an_arena_its_directory_cannot_hold_is_refused_at_start(
    small_tmpfs_ok: None, tmp_path: Path
) -> None:
    """A clear OSError naming the directory and the sizes, never a SIGBUS: a prefaulted arena
    bigger than the directory's free space, a range that cannot be backed, a full directory
    (where the token write into the header page used to SIGBUS). Nothing is left."""
    out = run_on_small_tmpfs(
        tmp_path,
        "4m",
        """
        out = {}
        try:
            cpu.SharedMemoryArena(cpu.HEADER_BYTES + 8 * MiB, prefault=True, directory=MNT)
        except OSError as e:
            out["prefault"] = [e.errno, str(e)]
        arena = cpu.SharedMemoryArena(cpu.HEADER_BYTES + 8 * MiB, prefault=False, directory=MNT)
        try:
            arena.reserve_backing(cpu.HEADER_BYTES, 8 * MiB)
        except OSError as e:
            out["first_slab"] = [e.errno, str(e)]
        arena.close()
        fill(os.path.join(MNT, "ballast"))
        try:
            cpu.SharedMemoryArena(cpu.HEADER_BYTES + 1 * MiB, prefault=False, directory=MNT)
        except OSError as e:
            out["full"] = [e.errno, str(e)]
        out["left"] = [n for n in os.listdir(MNT) if n.startswith("kvstore-")]
        print(json.dumps(out))
        """,
    )
    mnt = str(tmp_path / "mnt")
    for case, needed in (("prefault", 8 * MiB + HEADER_BYTES), ("first_slab", 8 * MiB)):
        assert case in out, out
        code, message = out[case]
        assert code == 28 and mnt in message, out  # ENOSPC
        assert f"needs {needed} more" in message and "bytes free" in message, out
    assert out["full"][0] == 28 and mnt in out["full"][1], out
    assert out["left"] == [], out
