"""``DaemonConfig``: the whole configuration, the ``[daemon]`` section's own values, and the
checks that span sections."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.config.checks import check_finite
from kvstore.config.limits import C_INT_MAX, ConnectionsConfig, LimitsConfig
from kvstore.config.tenants import AuthConfig, TenantQuota
from kvstore.config.tiers import (
    LOSSY_CODECS,
    CodecRule,
    CpuTierConfig,
    GpuTierConfig,
    NvmeTierConfig,
    RedisTierConfig,
)


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
            check_finite(f"daemon.{name}", value)
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
