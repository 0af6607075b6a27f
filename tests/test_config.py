"""The daemon's configuration: the embedded default, the shipped examples, overrides, errors."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from kvstore.config import DaemonConfig, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_the_embedded_default_is_the_dataclass_default() -> None:
    # The TOML and the dataclasses must not drift apart: the file documents the defaults.
    assert load_config(env={}) == DaemonConfig()


def test_the_examples_parse_to_what_they_say() -> None:
    single = load_config(CONFIGS / "single-host.toml", env={})
    assert single.cpu.capacity_bytes == 64 << 30 and single.cpu.policy == "priority"
    assert single.nvme.enabled and single.nvme.capacity_bytes == 1 << 40
    assert single.gpu.capacity_bytes == 16 << 30 and not single.redis.url
    multi = load_config(CONFIGS / "multi-host-redis.toml", env={})
    assert multi.redis.url.startswith("redis+cluster://") and multi.redis.write_through
    assert multi.redis.max_bytes_per_namespace == 64 << 30 and multi.redis.ttl_s == 86400


def test_the_examples_ship_in_the_package() -> None:
    shipped = {p.name for p in resources.files("kvstore.configs").iterdir()}
    assert {"default.toml", "single-host.toml", "multi-host-redis.toml"} <= shipped


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text('[cpu]\ncapacity = "1GiB"\n[nvme]\npath = "/a"\n')
    cfg = load_config(path, env={"KVSTORE_CPU_CAPACITY": "3GiB", "KVSTORE_NVME_PATH": "/b"})
    assert cfg.cpu.capacity_bytes == 3 << 30 and cfg.nvme.path == "/b"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[cpu]\ncapacty = 1\n", "unknown key cpu.capacty"),
        ("[cache]\n", "unknown config sections"),
        ('[cpu]\ncapacity = "lots"\n', "lots"),
        ('[cpu]\npolicy = "fifo"\n', "cpu policy 'fifo' unknown"),
        ('[nvme]\ncodec = "zstd"\n', "nvme codec 'zstd' unknown"),
        ("[redis]\ntimeout_s = 0\n", "redis timeout_s must be positive"),
        ("[daemon]\nlease_ttl_s = -1\n", "lease_ttl_s must be positive"),
        ("cpu = 3\n", "must be a table"),
    ],
)
def test_a_bad_config_names_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(path, env={})
