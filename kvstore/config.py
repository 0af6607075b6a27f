"""Daemon configuration: frozen dataclasses with units in their names, loaded from TOML.

Precedence (lowest first): the embedded ``configs/default.toml``, a ``--config FILE``,
``KVSTORE_*`` environment variables, command-line flags.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvstore.units import parse_size

POLICIES = ("lru", "priority", "prefix")


@dataclass(frozen=True)
class CpuTierConfig:
    capacity_bytes: int = 2 << 30
    slab_bytes: int = 64 << 20
    prefault: bool = True
    policy: str = "lru"

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"cpu capacity must be positive, got {self.capacity_bytes}")
        if self.slab_bytes <= 0:
            raise ValueError(f"cpu slab size must be positive, got {self.slab_bytes}")
        if self.policy not in POLICIES:
            raise ValueError(f"cpu policy {self.policy!r} unknown; choose one of {POLICIES}")


@dataclass(frozen=True)
class DaemonConfig:
    address: str = ""
    lease_ttl_s: float = 30.0
    reservation_ttl_s: float = 30.0
    reaper_interval_s: float = 0.5
    max_message_bytes: int = 256 << 20
    cpu: CpuTierConfig = field(default_factory=CpuTierConfig)

    def __post_init__(self) -> None:
        for name in ("lease_ttl_s", "reservation_ttl_s", "reaper_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def _section(data: dict[str, Any], name: str) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ValueError(f"config section [{name}] must be a table")
    return value


def _apply(base: DaemonConfig, data: dict[str, Any], source: str) -> DaemonConfig:
    known = {"daemon", "cpu"}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{source}: unknown config sections {sorted(unknown)}")
    d = _section(data, "daemon")
    c = _section(data, "cpu")
    cpu_kw: dict[str, Any] = {}
    for key, value in c.items():
        if key == "capacity":
            cpu_kw["capacity_bytes"] = parse_size(value)
        elif key == "slab":
            cpu_kw["slab_bytes"] = parse_size(value)
        elif key in ("prefault", "policy"):
            cpu_kw[key] = value
        else:
            raise ValueError(f"{source}: unknown key cpu.{key}")
    daemon_kw: dict[str, Any] = {}
    for key, value in d.items():
        if key == "max_message_bytes":
            daemon_kw[key] = parse_size(value)
        elif key in ("address", "lease_ttl_s", "reservation_ttl_s", "reaper_interval_s"):
            daemon_kw[key] = value
        else:
            raise ValueError(f"{source}: unknown key daemon.{key}")
    return dataclasses.replace(base, cpu=dataclasses.replace(base.cpu, **cpu_kw), **daemon_kw)


def default_config_text() -> str:
    return (resources.files("kvstore.configs") / "default.toml").read_text()


def load_config(
    path: str | Path | None = None, env: Mapping[str, str] | None = None
) -> DaemonConfig:
    """The embedded default, overlaid by ``path`` (if given) and ``KVSTORE_*`` variables."""
    cfg = _apply(DaemonConfig(), tomllib.loads(default_config_text()), "default config")
    if path is not None:
        with open(path, "rb") as f:
            cfg = _apply(cfg, tomllib.load(f), str(path))
    if env is None:
        env = os.environ
    if env.get("KVSTORE_CPU_CAPACITY"):
        cpu = dataclasses.replace(cfg.cpu, capacity_bytes=parse_size(env["KVSTORE_CPU_CAPACITY"]))
        cfg = dataclasses.replace(cfg, cpu=cpu)
    return cfg
