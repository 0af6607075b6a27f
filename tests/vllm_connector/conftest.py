"""Fixtures the engine test modules share: one working folder, one random-weight model and one
daemon per module (engines take tens of seconds to start, so a module runs a few engines
against them), and how those engines lay out their processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DaemonProcess, config_toml

from .harness import IN_PROCESS, make_random_model


@pytest.fixture(scope="module", autouse=True)
def engine_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """Engines of a module run in one process each (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
    here an engine then starts in ~2 s instead of ~15 s (its core and worker processes each
    import vLLM and torch again), which is most of what the connector's suite spends. A module
    that sets ``ENGINE_PROCESSES = True`` keeps vLLM's own process layout, as a deployment runs
    it: the connector's round trips (``test_vllm_connector``), whose metadata then crosses a
    process boundary as it does in production, tensor parallel ranks, ``vllm serve`` and the
    harness's own process handling. One engine may ask for it in its spec's ``env``
    (``IN_PROCESS: "1"``)."""
    with pytest.MonkeyPatch.context() as patch:
        if not getattr(request.module, "ENGINE_PROCESSES", False):
            patch.setenv(IN_PROCESS, "0")  # engine_env() copies it into each engine's env
        yield


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
