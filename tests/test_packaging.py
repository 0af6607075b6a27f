"""A wheel holds every package of the source tree: ``pyproject.toml`` lists packages one by
one (``tiers/``, ``kernels/`` and ``configs/`` are top-level folders mapped into ``kvstore``),
so a package added by splitting a module must be listed too, or an installed kvstore fails to
import where the editable checkout works."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_of_the_tree_is_in_the_wheel() -> None:
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = set()
    for directory, dirs, files in os.walk(ROOT / "kvstore", followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if "__init__.py" in files:
            found.add(".".join(Path(directory).relative_to(ROOT).parts))
    assert found - listed == set(), "packages missing from pyproject.toml's list"
    assert listed - found == set(), "pyproject.toml lists packages that do not exist"
