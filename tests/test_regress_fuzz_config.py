"""Guard, found by fuzzing the config file (tests/fuzz/fuzz_config.py): a TOML file nested
too deeply is refused with a ValueError naming the file, like any other invalid TOML (Python
3.11's tomllib recursed into a RecursionError)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import load_config


@pytest.mark.parametrize("nested", ["a = " + "[" * 3000, "a = " + "{b = " * 3000])
def test_deeply_nested_toml_is_refused_with_a_value_error(tmp_path: Path, nested: str) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text(nested)
    with pytest.raises(ValueError, match=str(path)):
        load_config(path, env={})
