"""Bounds: ``[limits]`` (what one request, one client and all clients together may hold) and
``[connections]`` (connections and calls in flight)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvstore.config.checks import check_finite

C_INT_MAX = 2**31 - 1
"""gRPC takes its channel options (connection and stream caps, idle timeout in ms, message
size) as C ints: a larger value stops the daemon at start with an OverflowError."""


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
            check_finite(f"limits.{name}", getattr(self, name))
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
class ConnectionsConfig:
    """Bounds on connections (gRPC and the session socket), so idle or hostile peers cannot
    take the daemon's memory or descriptors."""

    max_connections: int = 1024  # open gRPC connections; more are refused at accept
    max_sessions: int = 1024  # open session-socket connections (same-host clients)
    max_concurrent_rpcs: int = 8192  # calls in flight, OpenNamespace streams included
    max_streams_per_connection: int = 512
    idle_timeout_s: float = 300.0  # a connection with no call for this long is closed

    def __post_init__(self) -> None:
        check_finite("connections.idle_timeout_s", self.idle_timeout_s)
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
