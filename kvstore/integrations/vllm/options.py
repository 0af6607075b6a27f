"""The connector's options (``kv_connector_extra_config``), parsed and checked once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_OPTIONS = {
    "address": None,
    "tenant": "",
    "token": None,
    "model": None,
    "revision": None,
    "store": "all",
    "load": "async",
    "timeout_s": 2.0,
    "lookup_timeout_s": 0.5,
    "retry_after_s": 2.0,
    "transfers": "auto",
}


@dataclass(frozen=True)
class ConnectorConfig:
    address: str | None
    tenant: str
    token: str | None
    model: str | None
    revision: str | None
    store: str
    load: str
    timeout_s: float
    lookup_timeout_s: float
    retry_after_s: float
    transfers: str

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_OPTIONS))
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config option(s) {unknown} for KVStoreConnector; "
                f"known: {sorted(_OPTIONS)}"
            )
        values = {**_OPTIONS, **extra}
        if values["store"] not in ("all", "prompt", "none"):
            raise ValueError(f"store must be 'all', 'prompt' or 'none', got {values['store']!r}")
        if values["load"] not in ("async", "sync", "none"):
            raise ValueError(f"load must be 'async', 'sync' or 'none', got {values['load']!r}")
        if values["transfers"] not in ("auto", "thread", "inline"):
            raise ValueError(
                f"transfers must be 'auto', 'thread' or 'inline', got {values['transfers']!r}"
            )
        for name in ("timeout_s", "lookup_timeout_s", "retry_after_s"):
            value = values[name]
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
            values[name] = float(value)
        if values["timeout_s"] == 0 or values["lookup_timeout_s"] == 0:
            raise ValueError("timeout_s and lookup_timeout_s must be positive")
        return cls(**values)
