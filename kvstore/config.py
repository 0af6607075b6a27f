"""Daemon configuration: frozen dataclasses with units in their names, loaded from TOML.

Precedence (lowest first): the embedded ``configs/default.toml``, a ``--config FILE``,
``KVSTORE_*`` environment variables, command-line flags.

Values are taken only as the TOML type they mean: a boolean is ``true``/``false`` (never the
string "false", which Python would read as true), a whole number an integer, a duration a
finite number, a size an integer of bytes or a string like "4GiB". Anything else is refused
with a ValueError naming the key, ``section.key: what is wrong (got value)``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvstore.units import parse_size

POLICIES = ("lru", "priority", "prefix")

C_INT_MAX = 2**31 - 1
"""gRPC takes its channel options (connection and stream caps, idle timeout in ms, message
size) as C ints: a larger value stops the daemon at start with an OverflowError."""


def _check_finite(where: str, value: float) -> None:
    """NaN passes every ``<= 0`` check and an infinite duration stops a timer (or overflows
    one): a duration or share must be a finite number."""
    if not math.isfinite(value):
        raise ValueError(f"{where}: must be a finite number (got {value!r})")


@dataclass(frozen=True)
class CpuTierConfig:
    capacity_bytes: int = 2 << 30
    slab_bytes: int = 64 << 20
    prefault: bool = True
    policy: str = "lru"
    # Background write-back keeps at least (1 - high_watermark) of the tier free or clean
    # (already on the tier below), so a put rarely waits for a demotion.
    high_watermark: float = 0.9

    def __post_init__(self) -> None:
        _check_finite("cpu.high_watermark", self.high_watermark)
        if self.capacity_bytes <= 0:
            raise ValueError(f"cpu capacity must be positive, got {self.capacity_bytes}")
        if self.slab_bytes <= 0:
            raise ValueError(f"cpu slab size must be positive, got {self.slab_bytes}")
        if self.policy not in POLICIES:
            raise ValueError(f"cpu policy {self.policy!r} unknown; choose one of {POLICIES}")
        if not 0.0 < self.high_watermark <= 1.0:
            raise ValueError(f"cpu high_watermark must be in (0, 1], got {self.high_watermark}")


CODECS = ("none", "lz4", "fp8", "fp8+lz4")
"""Codecs of the tiers below the CPU tier (``kvstore.tiers.codecs``); the fp8 ones are lossy."""
LOSSY_CODECS = ("fp8", "fp8+lz4")


@dataclass(frozen=True)
class NvmeTierConfig:
    """The local-disk tier. Off unless ``path`` is set."""

    path: str = ""
    capacity_bytes: int = 16 << 30
    codec: str = "none"
    write_through: bool = False
    # True: a put is acknowledged only once its blocks are on disk and fdatasync'd (it then
    # survives kill -9 and power loss); False: a put is acknowledged once it is in memory.
    durable_puts: bool = False
    direct_io: bool = True
    io_threads: int = 4
    policy: str = "lru"

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"nvme capacity must be positive, got {self.capacity_bytes}")
        if self.codec not in CODECS:
            raise ValueError(f"nvme codec {self.codec!r} unknown; choose one of {CODECS}")
        if self.policy not in POLICIES:
            raise ValueError(f"nvme policy {self.policy!r} unknown; choose one of {POLICIES}")
        if self.io_threads <= 0:
            raise ValueError(f"nvme io_threads must be positive, got {self.io_threads}")


@dataclass(frozen=True)
class RedisTierConfig:
    """The tier shared by every host's daemon. Off unless ``url`` is set."""

    url: str = ""
    timeout_s: float = 0.5
    # True: every put is written to Redis at once (what sharing across hosts needs); False:
    # blocks reach Redis when they leave the last local tier.
    write_through: bool = True
    ttl_s: float = 0.0  # 0: no expiry
    max_bytes_per_namespace: int = 0  # 0: no per-namespace bound (use Redis's maxmemory)
    key_prefix: str = "kvs"
    codec: str = "none"  # of the values this host writes; [[codecs]] overrides per namespace
    # A file holding a secret shared by every daemon of the Redis (``kvstore redis-secret``
    # writes one): values carry a keyed MAC and only values with a right one are read.
    mac_key_file: str = ""
    # Serve a Redis tier without a secret: xxh3 checksums only, which anyone who can write to
    # Redis can compute, so every host would serve their forged blocks. Off: such a daemon
    # refuses to start (``check_keyed``); on: it starts with a warning.
    allow_unkeyed: bool = False

    @property
    def keyed(self) -> bool:
        return bool(self.mac_key_file)

    def check_keyed(self) -> None:
        """Refuse a Redis tier without a MAC secret unless the operator allowed it. Checked once
        every layer (file, ``KVSTORE_*``, flags) is applied: any of them may add the secret."""
        if self.url and not self.mac_key_file and not self.allow_unkeyed:
            raise ValueError(
                "redis.mac_key_file is not set: without a secret anyone who can write to this "
                "Redis can make every host serve forged KV blocks. Run `kvstore redis-secret "
                "PATH` once, copy the file to every host and set redis.mac_key_file = PATH "
                "(--redis-mac-key-file, KVSTORE_REDIS_MAC_KEY_FILE), or accept the risk with "
                "redis.allow_unkeyed = true (--redis-allow-unkeyed, KVSTORE_REDIS_ALLOW_UNKEYED)"
            )

    def __post_init__(self) -> None:
        if self.allow_unkeyed and self.mac_key_file:
            # A keyed daemon reads keyed values only: "allow unkeyed" would not do what it says
            # (read old unkeyed values during a move to a secret), so the pair is a mistake.
            raise ValueError(
                "redis.allow_unkeyed = true and redis.mac_key_file both set: a daemon with a "
                "secret writes and reads keyed values only; drop allow_unkeyed"
            )
        if self.codec not in CODECS:
            raise ValueError(f"redis codec {self.codec!r} unknown; choose one of {CODECS}")
        _check_finite("redis.timeout_s", self.timeout_s)
        _check_finite("redis.ttl_s", self.ttl_s)
        if self.timeout_s <= 0:
            raise ValueError(f"redis timeout_s must be positive, got {self.timeout_s}")
        if self.ttl_s < 0 or self.max_bytes_per_namespace < 0:
            raise ValueError("redis ttl_s and max_bytes_per_namespace must be >= 0")


@dataclass(frozen=True)
class CodecRule:
    """``[[codecs]]``: the codecs of the namespaces whose model and tenant match (an empty
    ``model`` or ``tenant`` matches any) in the NVMe and Redis tiers; an empty codec keeps that
    tier's default (``nvme.codec``, ``redis.codec``). The first matching rule applies. A lossy
    codec (fp8) applies only where an operator names it here or as a tier's default.

    ``cpu = "fp8"`` (opt-in; default lossless) lets the matching namespaces' CPU-tier entries
    hold the fp8 payload of a block instead of the block: slots of ~0.5x, filled by the
    writer (on the GPU path by the quantizing gather kernel, so only the payload crosses PCIe)
    and written down to NVMe as they are. Every reader gets the block's deterministic fp8 form.
    It needs the NVMe tier to keep that form (an ``nvme`` codec of fp8 or fp8+lz4) and is not
    built for the Redis tier (the daemon refuses such a configuration) nor the GPU pool (such
    a namespace's blocks stay in the CPU arena)."""

    model: str = ""
    tenant: str = ""
    nvme: str = ""
    redis: str = ""
    cpu: str = ""

    def __post_init__(self) -> None:
        if self.cpu not in CPU_CODECS:
            raise ValueError(
                f"codecs rule (model {self.model!r}, tenant {self.tenant!r}): cpu codec "
                f"{self.cpu!r} unknown; choose one of {CPU_CODECS}"
            )
        for tier in ("nvme", "redis"):
            codec = getattr(self, tier)
            if codec and codec not in CODECS:
                raise ValueError(
                    f"codecs rule (model {self.model!r}, tenant {self.tenant!r}): {tier} codec "
                    f"{codec!r} unknown; choose one of {CODECS}"
                )

    def matches(self, model: str, tenant: str) -> bool:
        return self.model in ("", model) and self.tenant in ("", tenant)


CPU_CODECS = ("", "none", "fp8")
"""What a ``[[codecs]]`` rule's ``cpu`` may name ("" and "none": the block itself)."""

GPU_MODES = ("auto", "on", "off")


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or ``:port`` (every interface) -> (host, port); a clear
    ValueError otherwise. Port 0 binds a free port (the daemon's ready line names it)."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"address {address!r}: port {port} is out of range")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"address {address!r}: write an IPv6 host in brackets, [::1]:{port}")
    return host, port


@dataclass(frozen=True)
class GpuTierConfig:
    """The device-memory tier, shared with workers on the same GPU through CUDA IPC.

    ``enabled``: "auto" turns it on where torch sees a CUDA device and CuPy is installed (and
    off elsewhere, silently); "on" makes a daemon without them refuse to start; "off" never.
    """

    enabled: str = "auto"
    device: int = 0
    capacity_bytes: int = 4 << 30
    slab_bytes: int = 256 << 20
    policy: str = "lru"
    # Background write-back keeps at least (1 - high_watermark) of the pool free or clean
    # (already in the CPU tier or below), so a worker's offload rarely waits for PCIe.
    high_watermark: float = 0.8

    def __post_init__(self) -> None:
        if self.enabled not in GPU_MODES:
            raise ValueError(f"gpu enabled {self.enabled!r} unknown; choose one of {GPU_MODES}")
        _check_finite("gpu.high_watermark", self.high_watermark)
        if self.device < 0:
            raise ValueError(f"gpu device must be >= 0, got {self.device}")
        if self.capacity_bytes <= 0:
            raise ValueError(f"gpu capacity must be positive, got {self.capacity_bytes}")
        if self.slab_bytes <= 0:
            raise ValueError(f"gpu slab size must be positive, got {self.slab_bytes}")
        if self.policy not in POLICIES:
            raise ValueError(f"gpu policy {self.policy!r} unknown; choose one of {POLICIES}")
        if not 0.0 < self.high_watermark <= 1.0:
            raise ValueError(f"gpu high_watermark must be in (0, 1], got {self.high_watermark}")


@dataclass(frozen=True)
class LimitsConfig:
    """Bounds on what one request, one client and all clients together may hold. A request past
    a bound is refused with INVALID_ARGUMENT (its shape) or RESOURCE_EXHAUSTED (a table is full)
    and a message naming the bound; nothing is changed by it."""

    max_keys_per_request: int = 16384  # a 256K-token prompt in 16-token blocks
    max_name_bytes: int = 256  # model, revision and tenant, each
    max_handles: int = 4096  # open namespace handles, every client together
    max_namespaces: int = 4096  # namespaces known (open, or holding blocks)
    max_reservations_per_handle: int = 256
    max_leases_per_handle: int = 1024
    max_stats_namespaces: int = 512  # namespaces listed in one Stats reply
    # How long a put or get that meets keys another client is writing waits for that commit
    # (the call's own deadline bounds it too); past it the result says so.
    write_wait_s: float = 5.0
    # Largest data field of one bytes-path message: a block travels as chunks of this size.
    chunk_bytes: int = 1 << 20
    # The share of the CPU tier one tenant may pin (leased, reserved and quarantined blocks),
    # unless its [tenants.NAME] max_pinned says otherwise: the rest stays evictable, so one
    # tenant's leases or reservations can never stop everyone else's puts. 0: 0.5 with a
    # tenant policy or [tenants] tables; on a single-user daemon the whole tier, and half of it
    # per handle while other handles are open (DaemonConfig.handle_pinned_share).
    max_pinned_share: float = 0.0
    # On a single-user daemon, when a second handle opens while one handle pins more than its
    # half of the CPU tier, the leases and reservations past that half expire this soon (or
    # when they would anyway, if sooner): the newcomer gets room within a bounded time, and a
    # handle alone on the daemon may still use the whole tier (BlockStore.open_namespace).
    pin_grace_s: float = 2.0
    # Slots one handle may hold reserved ahead for its next puts (spare slots: a put of small
    # blocks then takes one call, Bind, instead of Reserve and Commit). They expire unbound
    # within min(reservation_ttl_s, pin_grace_s). 0: none are granted.
    max_spare_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        for name in ("write_wait_s", "pin_grace_s", "max_pinned_share"):
            _check_finite(f"limits.{name}", getattr(self, name))
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0 and f.name not in ("max_pinned_share", "max_spare_bytes"):
                raise ValueError(f"limits.{f.name} must be positive, got {getattr(self, f.name)}")
        if self.max_spare_bytes < 0:
            raise ValueError(f"limits.max_spare_bytes must be >= 0, got {self.max_spare_bytes}")
        if self.chunk_bytes > 16 << 20:
            raise ValueError(f"limits.chunk_bytes must be at most 16MiB, got {self.chunk_bytes}")
        if not 0.0 <= self.max_pinned_share <= 1.0:
            raise ValueError(
                f"limits.max_pinned_share is a share of the CPU tier, in (0, 1]; got "
                f"{self.max_pinned_share}"
            )


@dataclass(frozen=True)
class Quota:
    """Bounds on what one tenant (or each namespace of it) may hold; 0 is "no bound". A call
    past one is refused with RESOURCE_EXHAUSTED and a message naming it; a put past a byte
    quota first evicts the tenant's (or namespace's) own coldest blocks."""

    cpu_bytes: int = 0  # bytes in the CPU tier (committed, being written, quarantined)
    nvme_bytes: int = 0  # block bytes in the NVMe tier (before its codec compresses them)
    redis_bytes: int = 0  # bytes this daemon writes to Redis (per namespace only)
    pinned_bytes: int = 0  # leased + reserved CPU bytes (0: limits.max_pinned_share)
    leases: int = 0  # read leases outstanding
    reservations: int = 0  # write reservations outstanding
    keys_per_s: float = 0.0  # keys touched by lookup, acquire and reserve (a token bucket)
    keys_burst: int = 0  # the bucket's size (0: one second's worth, keys_per_s)

    def __post_init__(self) -> None:
        _check_finite("keys_per_s", self.keys_per_s)
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0, got {getattr(self, f.name)}")
        if self.keys_burst and not self.keys_per_s:
            raise ValueError("keys_burst needs keys_per_s")

    @property
    def burst(self) -> int:
        return self.keys_burst or max(1, int(self.keys_per_s))


@dataclass(frozen=True)
class TenantQuota:
    """``[tenants.NAME]``: tenant NAME's quotas (``tenant``), the quotas each of its namespaces
    gets (``namespace``, from ``[tenants.NAME.namespace]``), and its guaranteed shares: bytes
    of a tier that other tenants' puts can never push it below (eviction spares them), and
    that other tenants' quotas and pins leave room for."""

    name: str
    tenant: Quota = field(default_factory=Quota)
    namespace: Quota = field(default_factory=Quota)
    guaranteed_cpu_bytes: int = 0
    guaranteed_nvme_bytes: int = 0

    def __post_init__(self) -> None:
        if self.namespace.keys_burst and not self.namespace.keys_per_s:
            raise ValueError(f"tenants.{self.name}.namespace: keys_burst needs keys_per_s")
        if self.tenant.redis_bytes:
            raise ValueError(
                f"tenants.{self.name}: quota_redis bounds each namespace (Redis keeps an age "
                f"index per namespace): write it under [tenants.{self.name}.namespace]"
            )
        guarantees = (("cpu", self.guaranteed_cpu_bytes), ("nvme", self.guaranteed_nvme_bytes))
        for tier, guaranteed in guarantees:
            if guaranteed < 0:
                raise ValueError(f"tenants.{self.name}: guaranteed_{tier} must be >= 0")
            quota = getattr(self.tenant, f"{tier}_bytes")
            if quota and guaranteed > quota:
                raise ValueError(
                    f"tenants.{self.name}: guaranteed_{tier} ({guaranteed}) is above its "
                    f"quota_{tier} ({quota})"
                )


ROLES = ("user", "operator")


@dataclass(frozen=True)
class AccessRule:
    """One ``[[access]]`` entry of the tenant policy: callers matching any of its credentials
    (a unix uid or primary gid from the kernel, a bearer token's name, a TLS client
    certificate's name) may use ``tenants``; an ``operator`` also sees every namespace in
    ``Stats``."""

    name: str = ""
    uids: tuple[int, ...] = ()
    gids: tuple[int, ...] = ()
    tokens: tuple[str, ...] = ()
    cert_names: tuple[str, ...] = ()
    tenants: tuple[str, ...] = ()
    role: str = "user"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"access {self.name!r}: role {self.role!r} unknown; choose {ROLES}")
        if not (self.uids or self.gids or self.tokens or self.cert_names):
            raise ValueError(
                f"access {self.name!r} names no credential (uids, gids, tokens, cert_names)"
            )


@dataclass(frozen=True)
class SharedTenant:
    """``[shared.NAME]``: tenant NAME's namespaces are readable by ``readers`` and writable by
    ``writers`` (tenant names), on purpose: a system prompt many applications share."""

    readers: tuple[str, ...] = ()
    writers: tuple[str, ...] = ()


@dataclass(frozen=True)
class AuthConfig:
    """Who may call, and how they prove it. See README "Security"."""

    # Bearer tokens by name: "env:VARIABLE" or "file:/path" (never the secret itself, so the
    # config can be world-readable). A TCP caller sends ``authorization: Bearer <token>``.
    tokens: tuple[tuple[str, str], ...] = ()
    tls_cert: str = ""  # server certificate chain (PEM): TLS on the TCP address
    tls_key: str = ""
    tls_client_ca: str = ""  # set: clients must present a certificate signed by this CA
    # Serve a non-loopback TCP address without TLS and credentials (logged at every start).
    insecure: bool = False
    reflection: bool = True  # gRPC server reflection (grpcurl); only the schema, never data
    access: tuple[AccessRule, ...] = ()  # the tenant policy; empty: single-user daemon
    shared: tuple[tuple[str, SharedTenant], ...] = ()

    @property
    def has_policy(self) -> bool:
        return bool(self.access)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("auth.tls_cert and auth.tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError(
                "auth.tls_client_ca needs auth.tls_cert (client certificates need TLS)"
            )
        names = {name for name, _ in self.tokens}
        for name, source in self.tokens:
            if not source.startswith(("env:", "file:")):
                raise ValueError(
                    f"auth.tokens.{name} must be 'env:VARIABLE' or 'file:/path', not the secret"
                )
        for rule in self.access:
            for token in rule.tokens:
                if token not in names:
                    raise ValueError(
                        f"access {rule.name!r} names token {token!r}, not in auth.tokens"
                    )
        if self.shared and not self.access:
            raise ValueError("[shared.*] needs a tenant policy ([[access]] entries)")


@dataclass(frozen=True)
class ConnectionsConfig:
    """Bounds on connections (gRPC and the session socket), so idle or hostile peers cannot
    take the daemon's memory or descriptors."""

    max_connections: int = 1024  # open gRPC connections; more are refused at accept
    max_sessions: int = 1024  # open session-socket connections (same-host clients)
    max_concurrent_rpcs: int = 8192  # calls in flight, OpenNamespace streams included
    max_streams_per_connection: int = 512
    idle_timeout_s: float = 300.0  # a connection with no call for this long is closed

    def __post_init__(self) -> None:
        _check_finite("connections.idle_timeout_s", self.idle_timeout_s)
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(
                    f"connections.{f.name} must be positive, got {getattr(self, f.name)}"
                )
        for f in dataclasses.fields(self):
            if f.name.startswith("max_") and getattr(self, f.name) > C_INT_MAX:
                raise ValueError(
                    f"connections.{f.name}: must be at most {C_INT_MAX}, gRPC's limit "
                    f"(got {getattr(self, f.name)})"
                )
        if self.idle_timeout_s * 1000 > C_INT_MAX:
            raise ValueError(
                f"connections.idle_timeout_s: must be at most {C_INT_MAX / 1000:g} seconds, "
                f"gRPC's limit (got {self.idle_timeout_s!r})"
            )


@dataclass(frozen=True)
class DaemonConfig:
    address: str = ""
    lease_ttl_s: float = 30.0
    reservation_ttl_s: float = 30.0
    reaper_interval_s: float = 0.5
    # Largest gRPC message either way. Control messages are small (16384 keys are 512 KiB) and
    # bytes-path blocks travel in limits.chunk_bytes chunks, so this stays far below a block.
    max_message_bytes: int = 4 << 20
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    connections: ConnectionsConfig = field(default_factory=ConnectionsConfig)
    gpu: GpuTierConfig = field(default_factory=GpuTierConfig)
    cpu: CpuTierConfig = field(default_factory=CpuTierConfig)
    nvme: NvmeTierConfig = field(default_factory=NvmeTierConfig)
    redis: RedisTierConfig = field(default_factory=RedisTierConfig)
    codecs: tuple[CodecRule, ...] = ()  # per-namespace codecs of the tiers below the CPU tier
    # Seconds a graceful stop may spend writing dirty CPU blocks down so a restart finds them.
    # Positive and finite: 0 or less would make every graceful stop write nothing down (and
    # lose what write-back holds in memory), NaN or infinity a stop that never ends.
    drain_timeout_s: float = 30.0
    # host:port of the Prometheus endpoint (GET /metrics, /healthz). Empty: no HTTP listener,
    # so tests, the demo and a default install open no port.
    metrics_address: str = ""
    tenants: tuple[TenantQuota, ...] = ()  # [tenants.NAME]: quotas and guaranteed shares

    @property
    def pinned_share(self) -> float:
        """The share of the CPU tier a tenant may pin by default (``limits.max_pinned_share``;
        its default: half with tenants to keep apart, the whole tier for a single user)."""
        if self.limits.max_pinned_share:
            return self.limits.max_pinned_share
        return 0.5 if self.auth.has_policy or self.tenants else 1.0

    @property
    def handle_pinned_share(self) -> float:
        """The share of the CPU tier one namespace handle may pin (0: no bound of its own). A
        single-user daemon's clients share one tenant, whose pinned share is the whole tier: so
        that one client cannot lease or reserve everything and stop the others' puts, each
        handle may pin half of it, unless ``limits.max_pinned_share`` says otherwise."""
        if self.limits.max_pinned_share or self.auth.has_policy or self.tenants:
            return 0.0
        return 0.5

    def __post_init__(self) -> None:
        for name in ("lease_ttl_s", "reservation_ttl_s", "reaper_interval_s", "drain_timeout_s"):
            value = getattr(self, name)
            _check_finite(f"daemon.{name}", value)
            if value <= 0:
                raise ValueError(f"daemon.{name} must be positive (got {value!r})")
        if self.max_message_bytes > C_INT_MAX:
            raise ValueError(
                f"daemon.max_message_bytes: must be at most {C_INT_MAX} bytes, gRPC's limit "
                f"(got {self.max_message_bytes})"
            )
        need = self.limits.chunk_bytes + self.limits.max_keys_per_request * 32 + (64 << 10)
        if self.max_message_bytes < need:
            raise ValueError(
                f"max_message_bytes {self.max_message_bytes} is below what the limits need "
                f"({need}: one chunk plus a request of max_keys_per_request keys)"
            )
        if self.metrics_address:
            try:
                split_host_port(self.metrics_address)
            except ValueError as exc:
                raise ValueError(f"metrics_address: {exc}") from None
            if self.auth.has_policy and not any(
                r.role == "operator" and r.tokens for r in self.auth.access
            ):
                raise ValueError(
                    "metrics_address: with a tenant policy ([[access]]), /metrics lists every "
                    "tenant's namespaces and is served only to a bearer token of an [[access]] "
                    'rule with role = "operator"; the policy names none'
                )
        self._check_tenants()
        self._check_cpu_codecs()

    def _check_cpu_codecs(self) -> None:
        """A ``cpu = "fp8"`` rule needs tiers below that keep the fp8 form as it is."""
        for rule in self.codecs:
            if rule.cpu != "fp8":
                continue
            where = f"codecs rule (model {rule.model!r}, tenant {rule.tenant!r})"
            nvme = rule.nvme or self.nvme.codec
            if self.nvme.path and nvme not in LOSSY_CODECS:
                raise ValueError(
                    f'{where}: cpu = "fp8" needs an nvme codec that keeps the fp8 form '
                    f"(fp8 or fp8+lz4), not {nvme!r}"
                )
            if self.redis.url:
                raise ValueError(f'{where}: cpu = "fp8" is not built for the redis tier')

    def _check_tenants(self) -> None:
        """Guarantees must fit their tier together, and a bound must be one the tier can
        hold: a config that promises what it cannot keep is refused at start."""
        tiers = (("cpu", self.cpu.capacity_bytes), ("nvme", self.nvme.capacity_bytes))
        for tier, capacity in tiers:
            total = sum(getattr(t, f"guaranteed_{tier}_bytes") for t in self.tenants)
            if total > capacity:
                raise ValueError(
                    f"the tenants' guaranteed_{tier} add up to {total} bytes, more than the "
                    f"{tier} tier's capacity ({capacity})"
                )
        for t in self.tenants:
            for level, quota in (("", t.tenant), (".namespace", t.namespace)):
                if quota.pinned_bytes > self.cpu.capacity_bytes:
                    raise ValueError(
                        f"tenants.{t.name}{level}: max_pinned ({quota.pinned_bytes}) is more "
                        f"than the cpu tier ({self.cpu.capacity_bytes})"
                    )


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
