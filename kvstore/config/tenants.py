"""Who may call and how much each tenant may hold: ``[auth]``, ``[[access]]``, ``[shared.NAME]``
and ``[tenants.NAME]``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvstore.config.checks import check_finite


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
        check_finite("keys_per_s", self.keys_per_s)
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
