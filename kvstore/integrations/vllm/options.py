"""The connector's options (``kv_connector_extra_config``), parsed and checked once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
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
    "salt_tenants": None,
    "unmapped_salt": "default",
    "layerwise": "auto",
    "shared_tenants": None,
}


@dataclass(frozen=True)
class SaltTenant:
    """The kvstore tenant (and its credential) a request's ``cache_salt`` puts its blocks in."""

    tenant: str
    token: str | None = None


def _parse_shared_tenants(value: Any, tenant: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(t, str) and t for t in value):
        raise ValueError(
            f"shared_tenants must be a list of tenant names ([shared.NAME] in the daemon's "
            f"policy), got {value!r}"
        )
    if tenant in value:
        raise ValueError(
            f"shared_tenants names the engine's own tenant {tenant!r}: its namespace is always "
            "consulted first"
        )
    if len(set(value)) != len(value):
        raise ValueError(f"shared_tenants names a tenant twice: {value!r}")
    return tuple(value)


def _parse_salt_tenants(value: Any) -> dict[str, SaltTenant]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(
            "salt_tenants must map cache_salt -> tenant name or {'tenant': ..., 'token': ...}, "
            f"got {type(value).__name__}"
        )
    routes: dict[str, SaltTenant] = {}
    for salt, entry in value.items():
        if isinstance(entry, str):
            entry = {"tenant": entry}
        if not isinstance(salt, str) or not salt or not isinstance(entry, dict):
            raise ValueError(f"salt_tenants[{salt!r}]: expected a tenant name or a dict")
        unknown = sorted(set(entry) - {"tenant", "token"})
        tenant, token = entry.get("tenant"), entry.get("token")
        if unknown or not isinstance(tenant, str) or not (token is None or isinstance(token, str)):
            raise ValueError(
                f"salt_tenants[{salt!r}]: expected {{'tenant': str, 'token': str (optional)}}, "
                f"got {entry!r}"
            )
        routes[salt] = SaltTenant(tenant, token)
    return routes


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
    salt_tenants: dict[str, SaltTenant] = field(default_factory=dict)
    """cache_salt -> the tenant its requests' blocks live in (the daemon's tenant model:
    quotas, namespaces, credentials). Requests without a salt use ``tenant``."""
    unmapped_salt: str = "default"
    """A salt not in ``salt_tenants`` (when that is set): ``"default"`` uses ``tenant`` (the
    salt still keys its blocks apart), ``"refuse"`` gives the request no store access."""
    layerwise: str = "auto"
    """Synchronous loads copied layer by layer, each waited for in ``wait_for_layer_load``:
    ``"auto"`` where transfers run on the transfer thread (CUDA caches), ``"on"``, ``"off"``."""
    shared_tenants: tuple[str, ...] = ()
    """Tenants declared shared in the daemon's policy (``[shared.NAME]``) whose namespaces a
    request's lookup also consults, in order, for the leading blocks its own tenant's namespace
    lacks: loaded from there (read only), never saved there. Opened with ``token``."""

    def tenant_of(self, cache_salt: str | None) -> str | None:
        """The tenant a request with this salt loads from and saves to; None: no store access
        (an unmapped salt under ``unmapped_salt="refuse"``)."""
        if cache_salt is None or not self.salt_tenants:
            return self.tenant
        route = self.salt_tenants.get(cache_salt)
        if route is not None:
            return route.tenant
        return self.tenant if self.unmapped_salt == "default" else None

    def token_of(self, tenant: str) -> str | None:
        """The credential for ``tenant``: ``token`` for the engine's own tenant and the shared
        tenants it reads, else the one given with the salts mapped to it."""
        if (tenant == self.tenant or tenant in self.shared_tenants) and self.token is not None:
            return self.token
        for route in self.salt_tenants.values():
            if route.tenant == tenant and route.token is not None:
                return route.token
        return None

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
            # Finite: an infinite deadline would let a stalled daemon hang the engine, and an
            # infinite back-off would never try the store again.
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")
            values[name] = float(value)
        if values["unmapped_salt"] not in ("default", "refuse"):
            raise ValueError(
                f"unmapped_salt must be 'default' or 'refuse', got {values['unmapped_salt']!r}"
            )
        if values["layerwise"] not in ("auto", "on", "off"):
            raise ValueError(
                f"layerwise must be 'auto', 'on' or 'off', got {values['layerwise']!r}"
            )
        values["salt_tenants"] = _parse_salt_tenants(values["salt_tenants"])
        values["shared_tenants"] = _parse_shared_tenants(values["shared_tenants"], values["tenant"])
        tokens: dict[str, str | None] = {values["tenant"]: values["token"]}
        for salt, route in values["salt_tenants"].items():
            # One tenant, one credential: the client of a tenant is shared by its salts.
            known = tokens.setdefault(route.tenant, route.token)
            if None not in (known, route.token) and known != route.token:
                raise ValueError(
                    f"salt_tenants[{salt!r}]: tenant {route.tenant!r} is given two different tokens"
                )
        if values["timeout_s"] == 0 or values["lookup_timeout_s"] == 0:
            raise ValueError("timeout_s and lookup_timeout_s must be positive")
        return cls(**values)
