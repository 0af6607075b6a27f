"""The layer rule, checked: the daemon never imports the client (nor the worker-side faces),
and the client never imports daemon code; they share only the protocol and the core types."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import {module}
loaded = sorted(m for m in sys.modules if m.startswith({forbidden!r}))
print(",".join(loaded))
"""


def loaded_by(module: str, forbidden: tuple[str, ...]) -> list[str]:
    code = CHECK.format(module=module, forbidden=forbidden)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def test_the_daemon_imports_no_client_code() -> None:
    faces = ("kvstore.client", "kvstore.paged", "kvstore.worker", "kvstore.integrations")
    assert loaded_by("kvstore.daemon.server", faces) == []


def test_the_client_imports_no_daemon_code() -> None:
    assert loaded_by("kvstore.client", ("kvstore.daemon",)) == []


def test_the_faces_import_no_circle() -> None:
    # The demos show the stats table without importing the CLI, which starts them.
    faces = {"kvstore.cli", "kvstore.demo", "kvstore.chat_demo"}

    def faces_loaded_by(module: str) -> set[str]:
        return set(loaded_by(module, tuple(faces))) & (faces - {module})

    assert faces_loaded_by("kvstore.stats_table") == set()
    assert faces_loaded_by("kvstore.demo") == set()
    assert faces_loaded_by("kvstore.chat_demo") == set()
