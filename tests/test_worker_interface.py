"""The reference worker's layers: decoding strategies (beam search) reach the engine through
``kvstore.worker.interface.Engine`` and never import the engine module, anywhere in the file
(function-level and type-checking imports included), so the engine may import them."""

from __future__ import annotations

import ast
from pathlib import Path

import kvstore.worker

WORKER = Path(kvstore.worker.__file__).parent
ENGINE = "kvstore.worker.engine"


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, wherever the import statement sits."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = "kvstore.worker" if node.level == 1 else "kvstore"
                module = f"{base}.{node.module}" if node.module else base
                found.add(module)
                found.update(f"{module}.{alias.name}" for alias in node.names)
            else:
                assert node.module is not None
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_helper_sees_every_kind_of_import(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from kvstore.worker.engine import Worker\n"
        "def f():\n"
        "    from . import engine\n"
    )
    found = imported_modules(sample)
    assert ENGINE in found
    assert "kvstore.worker.engine.Worker" in found


def test_strategies_do_not_import_the_engine() -> None:
    for name in ("beam.py", "interface.py"):
        found = imported_modules(WORKER / name)
        assert not {m for m in found if m == ENGINE or m.startswith(ENGINE + ".")}, name
    assert "kvstore.worker.interface" in imported_modules(WORKER / "beam.py")
