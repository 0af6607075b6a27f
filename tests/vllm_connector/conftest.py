"""Fixtures the engine test modules share: one working folder, one random-weight model and one
daemon per module (engines take tens of seconds to start, so a module runs a few engines
against them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DaemonProcess, config_toml

from .harness import make_random_model


@pytest.fixture(scope="module")
def work(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2]))


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    """The small random Llama (``RANDOM_LLAMA``: 4 layers, 2 KV heads)."""
    return make_random_model(work / "model")


@pytest.fixture(scope="module")
def daemon(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DaemonProcess]:
    """A daemon with a 256 MiB CPU tier, under the module's ``DAEMON_POLICY`` if it has one."""
    extra = getattr(request.module, "DAEMON_POLICY", "")
    d = DaemonProcess(
        Path(tmp_path_factory.mktemp("kvd")),
        config_toml(cpu_capacity="256MiB", slab="4MiB", extra=extra),
    ).start()
    yield d
    d.stop()
