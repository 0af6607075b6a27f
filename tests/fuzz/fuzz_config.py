"""Fuzz target: the daemon's config file (``kvstore.config.load_config``): TOML text -> a
``DaemonConfig``, or a ValueError that names the problem.

The input is written to a file and loaded as ``--config FILE`` is, without ``KVSTORE_*``
variables. Contract: ``load_config`` returns a config or raises ValueError (never another
exception: not a TypeError from a value of an unexpected TOML type, not a RecursionError);
a config it returns re-validates (every section rebuilt through its own checks gives the same
value) and loading the same file again gives an equal config."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

import _harness
import atheris

with atheris.instrument_imports(include=["kvstore"]):
    from kvstore.config import DaemonConfig, load_config

_path = os.path.join(tempfile.mkdtemp(prefix="fuzz-config-"), "kvstore.toml")


def rebuilt(value: Any) -> Any:
    """``value`` built again through every dataclass's ``__post_init__``, innermost first."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: rebuilt(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init
        }
        return dataclasses.replace(value, **changes)
    if isinstance(value, tuple):
        return tuple(rebuilt(v) for v in value)
    return value


def TestOneInput(data: bytes) -> None:
    with open(_path, "wb") as f:
        f.write(data)
    try:
        cfg = load_config(_path, env={})
    except ValueError as exc:
        assert str(exc), "a ValueError without a message"
        return
    assert isinstance(cfg, DaemonConfig)
    assert rebuilt(cfg) == cfg
    assert load_config(_path, env={}) == cfg


if __name__ == "__main__":
    _harness.main(TestOneInput)
