"""Daemon configuration: frozen dataclasses with units in their names, loaded from TOML.

Precedence (lowest first): the embedded ``configs/default.toml``, a ``--config FILE``,
``KVSTORE_*`` environment variables, command-line flags.

Values are taken only as the TOML type they mean: a boolean is ``true``/``false`` (never the
string "false", which Python would read as true), a whole number an integer, a duration a
finite number, a size an integer of bytes or a string like "4GiB". Anything else is refused
with a ValueError naming the key, ``section.key: what is wrong (got value)``.

One module per part, each importing only those above it in this list:

* ``checks``: the check every part shares (durations and shares are finite numbers);
* ``tiers``: ``[gpu]``, ``[cpu]``, ``[nvme]``, ``[redis]`` and the ``[[codecs]]`` rules;
* ``limits``: ``[limits]`` and ``[connections]``;
* ``tenants``: ``[auth]``, ``[[access]]``, ``[shared.NAME]`` and ``[tenants.NAME]``;
* ``daemon``: ``DaemonConfig``, the whole of it, with the checks that span sections;
* ``loading``: TOML and ``KVSTORE_*`` variables -> a ``DaemonConfig`` (``load_config``).

Command-line flags are applied by ``kvstore.cli``. Import the names from ``kvstore.config``.
"""

from __future__ import annotations

from kvstore.config.daemon import DaemonConfig, split_host_port
from kvstore.config.limits import C_INT_MAX, ConnectionsConfig, LimitsConfig
from kvstore.config.loading import default_config_text, load_config
from kvstore.config.tenants import ROLES, AccessRule, AuthConfig, Quota, SharedTenant, TenantQuota
from kvstore.config.tiers import (
    CODECS,
    CPU_CODECS,
    GPU_MODES,
    LOSSY_CODECS,
    POLICIES,
    CodecRule,
    CpuTierConfig,
    GpuTierConfig,
    NvmeTierConfig,
    RedisTierConfig,
)

__all__ = [
    "CODECS",
    "CPU_CODECS",
    "C_INT_MAX",
    "GPU_MODES",
    "LOSSY_CODECS",
    "POLICIES",
    "ROLES",
    "AccessRule",
    "AuthConfig",
    "CodecRule",
    "ConnectionsConfig",
    "CpuTierConfig",
    "DaemonConfig",
    "GpuTierConfig",
    "LimitsConfig",
    "NvmeTierConfig",
    "Quota",
    "RedisTierConfig",
    "SharedTenant",
    "TenantQuota",
    "default_config_text",
    "load_config",
    "split_host_port",
]
