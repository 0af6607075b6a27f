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
