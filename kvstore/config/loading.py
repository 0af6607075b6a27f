"""Reading the configuration: the embedded default, a TOML file, ``KVSTORE_*`` variables.

Every TOML value goes through a strict converter for the type it means; an error names its key.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from kvstore.config.daemon import DaemonConfig
from kvstore.config.tenants import AccessRule, Quota, SharedTenant, TenantQuota
from kvstore.config.tiers import CodecRule
from kvstore.units import parse_size

# Strict converters: each takes the TOML value and returns the field's value, or raises a
# ValueError saying what is wrong and quoting the value; _convert prefixes the key.


def _bool(value: Any) -> bool:
    # Never bool(value): bool("false") is True, and a string "false" for auth.insecure would
    # serve a public address without TLS or credentials.
    if isinstance(value, bool):
        return value
    raise ValueError(f"must be true or false, a TOML boolean without quotes (got {value!r})")


def _env_bool(value: str) -> bool:
    """A boolean ``KVSTORE_*`` variable: ``true`` or ``false``, as TOML writes them. Never
    "anything non-empty is true": ``=0`` or ``=no`` must not turn a safety off."""
    if value in ("true", "false"):
        return value == "true"
    raise ValueError(f"must be true or false (got {value!r})")


def _int(value: Any) -> int:
    # bool is an int in Python; a float would be truncated (3.7 -> 3) and a string parsed.
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"must be a whole number (got {value!r})")


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number (got {value!r})")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        raise ValueError(f"must be a finite number (got {value!r})") from None
    if not math.isfinite(number):
        raise ValueError(f"must be a finite number (got {value!r})")
    return number


def _size(value: Any) -> int:
    """An int of bytes (>= 0) or a string like "4GiB" (``parse_size``); not a bool (true is
    not 1 byte) nor a float (a size is a whole number of bytes)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"must be >= 0 (got {value!r})")
        return value
    if isinstance(value, str):
        try:
            return parse_size(value)
        except OverflowError:  # "1000...0": float() gives inf
            raise ValueError(f"is too large (got {value!r})") from None
    raise ValueError(f'must be a whole number of bytes or a string like "4GiB" (got {value!r})')


def _str(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ValueError(f"must be a string (got {value!r})")


def _convert(convert: Any, value: Any, where: str) -> Any:
    """``convert(value)``, any error it raises as a ValueError naming ``where``."""
    try:
        return convert(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _str_list(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: must be an array of strings (got {value!r})")
    return tuple(_convert(_str, x, f"{where}[{i}]") for i, x in enumerate(value))


def _int_list(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: must be an array of whole numbers (got {value!r})")
    return tuple(_convert(_int, x, f"{where}[{i}]") for i, x in enumerate(value))


def _gpu_mode(value: Any) -> str:
    """``enabled`` accepts auto/on/off and TOML booleans (true = on)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return _str(value).strip().lower()


def _tokens(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise ValueError(f"must be a table of name = source (got {value!r})")
    return tuple(sorted((str(k), _convert(_str, x, str(k))) for k, x in value.items()))


def _section(data: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ValueError(f"{source}: config section [{name}] must be a table")
    return value


# Per section: config-file key -> (dataclass field, converter).
_KEYS: dict[str, dict[str, tuple[str, Any]]] = {
    "daemon": {
        "address": ("address", _str),
        "lease_ttl_s": ("lease_ttl_s", _float),
        "reservation_ttl_s": ("reservation_ttl_s", _float),
        "reaper_interval_s": ("reaper_interval_s", _float),
        "max_message_bytes": ("max_message_bytes", _size),
        "drain_timeout_s": ("drain_timeout_s", _float),
        "metrics_address": ("metrics_address", _str),
    },
    "limits": {
        "max_keys_per_request": ("max_keys_per_request", _int),
        "max_name_bytes": ("max_name_bytes", _int),
        "max_handles": ("max_handles", _int),
        "max_namespaces": ("max_namespaces", _int),
        "max_reservations_per_handle": ("max_reservations_per_handle", _int),
        "max_leases_per_handle": ("max_leases_per_handle", _int),
        "max_stats_namespaces": ("max_stats_namespaces", _int),
        "write_wait_s": ("write_wait_s", _float),
        "chunk": ("chunk_bytes", _size),
        "max_pinned_share": ("max_pinned_share", _float),
        "pin_grace_s": ("pin_grace_s", _float),
        "max_spare": ("max_spare_bytes", _size),
    },
    "auth": {
        "tls_cert": ("tls_cert", _str),
        "tls_key": ("tls_key", _str),
        "tls_client_ca": ("tls_client_ca", _str),
        "insecure": ("insecure", _bool),
        "reflection": ("reflection", _bool),
        "tokens": ("tokens", _tokens),
    },
    "connections": {
        "max_connections": ("max_connections", _int),
        "max_sessions": ("max_sessions", _int),
        "max_concurrent_rpcs": ("max_concurrent_rpcs", _int),
        "max_streams_per_connection": ("max_streams_per_connection", _int),
        "idle_timeout_s": ("idle_timeout_s", _float),
    },
    "gpu": {
        "enabled": ("enabled", _gpu_mode),
        "device": ("device", _int),
        "capacity": ("capacity_bytes", _size),
        "slab": ("slab_bytes", _size),
        "policy": ("policy", _str),
        "high_watermark": ("high_watermark", _float),
    },
    "cpu": {
        "capacity": ("capacity_bytes", _size),
        "slab": ("slab_bytes", _size),
        "prefault": ("prefault", _bool),
        "policy": ("policy", _str),
        "high_watermark": ("high_watermark", _float),
    },
    "nvme": {
        "path": ("path", _str),
        "capacity": ("capacity_bytes", _size),
        "codec": ("codec", _str),
        "write_through": ("write_through", _bool),
        "durable_puts": ("durable_puts", _bool),
        "direct_io": ("direct_io", _bool),
        "io_threads": ("io_threads", _int),
        "policy": ("policy", _str),
    },
    "redis": {
        "url": ("url", _str),
        "timeout_s": ("timeout_s", _float),
        "write_through": ("write_through", _bool),
        "ttl_s": ("ttl_s", _float),
        "max_bytes_per_namespace": ("max_bytes_per_namespace", _size),
        "key_prefix": ("key_prefix", _str),
        "codec": ("codec", _str),
        "mac_key_file": ("mac_key_file", _str),
        "allow_unkeyed": ("allow_unkeyed", _bool),
    },
}


def _table(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a table")
    return value


_ACCESS_KEYS = {f.name for f in dataclasses.fields(AccessRule)}


def _access(value: Any, source: str) -> tuple[AccessRule, ...]:
    """``[[access]]``: a list of tables (see ``AccessRule``)."""
    if not isinstance(value, list):
        raise ValueError(f"{source}: [[access]] must be an array of tables")
    rules = []
    for i, entry in enumerate(value):
        entry = _table(entry, f"{source}: access[{i}]")
        unknown = set(entry) - _ACCESS_KEYS
        if unknown:
            raise ValueError(f"{source}: unknown keys in access[{i}]: {sorted(unknown)}")
        where = f"{source}: access[{i}]"
        kwargs: dict[str, Any] = {
            "name": _convert(_str, entry.get("name", f"access[{i}]"), f"{where}.name")
        }
        for key in ("uids", "gids"):
            kwargs[key] = _int_list(entry.get(key, []), f"{where}.{key}")
        for key in ("tokens", "cert_names", "tenants"):
            kwargs[key] = _str_list(entry.get(key, []), f"{where}.{key}")
        kwargs["role"] = _convert(_str, entry.get("role", "user"), f"{where}.role")
        rules.append(AccessRule(**kwargs))
    return tuple(rules)


_CODEC_RULE_KEYS = {f.name for f in dataclasses.fields(CodecRule)}


def _codec_rules(value: Any, source: str) -> tuple[CodecRule, ...]:
    """``[[codecs]]``: a list of tables (see ``CodecRule``)."""
    if not isinstance(value, list):
        raise ValueError(f"{source}: [[codecs]] must be an array of tables")
    rules = []
    for i, entry in enumerate(value):
        entry = _table(entry, f"{source}: codecs[{i}]")
        unknown = set(entry) - _CODEC_RULE_KEYS
        if unknown:
            raise ValueError(f"{source}: unknown keys in codecs[{i}]: {sorted(unknown)}")
        where = f"{source}: codecs[{i}]"
        rules.append(CodecRule(**{k: _convert(_str, v, f"{where}.{k}") for k, v in entry.items()}))
    return tuple(rules)


def _shared(value: Any, source: str) -> tuple[tuple[str, SharedTenant], ...]:
    out = []
    for name, entry in sorted(_table(value, f"{source}: [shared]").items()):
        entry = _table(entry, f"{source}: [shared.{name}]")
        unknown = set(entry) - {"readers", "writers"}
        if unknown:
            raise ValueError(f"{source}: unknown keys in [shared.{name}]: {sorted(unknown)}")
        out.append(
            (
                str(name),
                SharedTenant(
                    readers=_str_list(entry.get("readers", []), f"{source}: shared.{name}.readers"),
                    writers=_str_list(entry.get("writers", []), f"{source}: shared.{name}.writers"),
                ),
            )
        )
    return tuple(out)


# [tenants.NAME] and [tenants.NAME.namespace] keys -> Quota fields.
_QUOTA_KEYS: dict[str, tuple[str, Any]] = {
    "quota_cpu": ("cpu_bytes", _size),
    "quota_nvme": ("nvme_bytes", _size),
    "quota_redis": ("redis_bytes", _size),
    "max_pinned": ("pinned_bytes", _size),
    "max_leases": ("leases", _int),
    "max_reservations": ("reservations", _int),
    "keys_per_s": ("keys_per_s", _float),
    "keys_burst": ("keys_burst", _int),
}
_GUARANTEE_KEYS = {
    "guaranteed_cpu": "guaranteed_cpu_bytes",
    "guaranteed_nvme": "guaranteed_nvme_bytes",
}


def _quota(entry: dict[str, Any], where: str) -> Quota:
    kwargs = {}
    for key, value in entry.items():
        name, convert = _QUOTA_KEYS[key]
        kwargs[name] = _convert(convert, value, f"{where}.{key}")
    try:
        return Quota(**kwargs)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _tenants(value: Any, source: str) -> tuple[TenantQuota, ...]:
    """``[tenants.NAME]`` tables (see ``TenantQuota``)."""
    out = []
    for name, entry in sorted(_table(value, f"{source}: [tenants]").items()):
        where = f"{source}: tenants.{name}"
        entry = dict(_table(entry, where))
        namespace = _table(entry.pop("namespace", {}), f"{where}.namespace")
        known = set(_QUOTA_KEYS) | set(_GUARANTEE_KEYS)
        unknown = set(entry) - known
        if unknown:
            raise ValueError(
                f"{where}: unknown keys {sorted(unknown)} (known: {sorted(known)} and a "
                "[namespace] table)"
            )
        unknown = set(namespace) - set(_QUOTA_KEYS)
        if unknown:
            raise ValueError(
                f"{where}.namespace: unknown keys {sorted(unknown)} (known: {sorted(_QUOTA_KEYS)})"
            )
        guarantees = {}
        for key, field_name in _GUARANTEE_KEYS.items():
            if key in entry:
                guarantees[field_name] = _convert(_size, entry.pop(key), f"{where}.{key}")
        try:
            out.append(
                TenantQuota(
                    name=str(name),
                    tenant=_quota(entry, where),
                    namespace=_quota(namespace, f"{where}.namespace"),
                    **guarantees,
                )
            )
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
    return tuple(out)


def _fields(data: dict[str, Any], section: str, source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in _section(data, section, source).items():
        if key not in _KEYS[section]:
            raise ValueError(f"{source}: unknown key {section}.{key}")
        name, convert = _KEYS[section][key]
        out[name] = _convert(convert, value, f"{source}: {section}.{key}")
    return out


def _apply(base: DaemonConfig, data: dict[str, Any], source: str) -> DaemonConfig:
    unknown = set(data) - set(_KEYS) - {"access", "shared", "codecs", "tenants"}
    if unknown:
        raise ValueError(f"{source}: unknown config sections {sorted(unknown)}")
    # Every value converted first (an error names its key), then the dataclasses built (an
    # error of theirs, a bound or a combination, names the file).
    fields = {section: _fields(data, section, source) for section in _KEYS}
    access = _access(data["access"], source) if "access" in data else base.auth.access
    shared = _shared(data["shared"], source) if "shared" in data else base.auth.shared
    codecs = _codec_rules(data["codecs"], source) if "codecs" in data else base.codecs
    tenants = _tenants(data["tenants"], source) if "tenants" in data else base.tenants
    try:
        auth = dataclasses.replace(base.auth, **fields["auth"])
        auth = dataclasses.replace(auth, access=access, shared=shared)
        return dataclasses.replace(
            base,
            auth=auth,
            codecs=codecs,
            tenants=tenants,
            connections=dataclasses.replace(base.connections, **fields["connections"]),
            gpu=dataclasses.replace(base.gpu, **fields["gpu"]),
            cpu=dataclasses.replace(base.cpu, **fields["cpu"]),
            nvme=dataclasses.replace(base.nvme, **fields["nvme"]),
            redis=dataclasses.replace(base.redis, **fields["redis"]),
            limits=dataclasses.replace(base.limits, **fields["limits"]),
            **fields["daemon"],
        )
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def default_config_text() -> str:
    return (resources.files("kvstore.configs") / "default.toml").read_text()


def _env_override(cfg: DaemonConfig, variable: str, value: str) -> DaemonConfig:
    """``cfg`` with the ``KVSTORE_*`` variable applied; an error names the variable."""
    try:
        if variable == "KVSTORE_CPU_CAPACITY":
            cpu = dataclasses.replace(cfg.cpu, capacity_bytes=_size(value))
            return dataclasses.replace(cfg, cpu=cpu)
        if variable == "KVSTORE_GPU":
            return dataclasses.replace(
                cfg, gpu=dataclasses.replace(cfg.gpu, enabled=_gpu_mode(value))
            )
        if variable == "KVSTORE_REDIS_URL":
            return dataclasses.replace(cfg, redis=dataclasses.replace(cfg.redis, url=value))
        if variable == "KVSTORE_REDIS_MAC_KEY_FILE":
            return dataclasses.replace(
                cfg, redis=dataclasses.replace(cfg.redis, mac_key_file=value)
            )
        if variable == "KVSTORE_REDIS_ALLOW_UNKEYED":
            return dataclasses.replace(
                cfg, redis=dataclasses.replace(cfg.redis, allow_unkeyed=_env_bool(value))
            )
        if variable == "KVSTORE_METRICS_ADDRESS":
            return dataclasses.replace(cfg, metrics_address=value)
        if variable == "KVSTORE_NVME_PATH":
            return dataclasses.replace(cfg, nvme=dataclasses.replace(cfg.nvme, path=value))
    except ValueError as exc:
        raise ValueError(f"{variable}: {exc}") from None
    raise AssertionError(variable)


_ENV_OVERRIDES = (
    "KVSTORE_CPU_CAPACITY",
    "KVSTORE_GPU",
    "KVSTORE_REDIS_URL",
    "KVSTORE_REDIS_MAC_KEY_FILE",
    "KVSTORE_REDIS_ALLOW_UNKEYED",
    "KVSTORE_METRICS_ADDRESS",
    "KVSTORE_NVME_PATH",
)


def _read_toml(path: str | Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise ValueError(f"{path}: not valid TOML: {exc}") from None


def load_config(
    path: str | Path | None = None, env: Mapping[str, str] | None = None
) -> DaemonConfig:
    """The embedded default, overlaid by ``path`` (if given) and ``KVSTORE_*`` variables.

    A value of the wrong type or out of range raises ValueError naming its key (or variable);
    an unreadable file, OSError. A Redis tier's secret is checked by whoever starts the daemon,
    once its flags are applied too (``RedisTierConfig.check_keyed``)."""
    cfg = _apply(DaemonConfig(), tomllib.loads(default_config_text()), "default config")
    if path is not None:
        cfg = _apply(cfg, _read_toml(path), str(path))
    if env is None:
        env = os.environ
    for variable in _ENV_OVERRIDES:
        if env.get(variable):
            cfg = _env_override(cfg, variable, env[variable])
    return cfg
