"""Who is calling, and which tenants they may use.

Identity comes from what the transport proves, never from what a request claims:
- on the unix socket, the kernel's peer credentials (``SO_PEERCRED``: uid, gid, pid), read by
  the session socket (``kvstore.daemon.session``) when a client connects; the session's random
  token then travels as ``kvstore-session`` metadata on the client's gRPC calls, which the
  kernel cannot attribute (gRPC does not expose the peer's socket);
- on TCP, a TLS client certificate's names (from the handshake) or a bearer token
  (``authorization: Bearer <token>``) compared in constant time with the configured ones.

The tenant policy (``[[access]]`` in the config) maps those credentials to tenants and a role.
Without a policy the daemon is single-user: its socket and directory are owner-only, so whoever
reaches the unix socket is its owner (or root) and may use every tenant. Callers are still told
apart (``caller_key``) for the per-caller bounds (sessions, open handles, namespaces holding
blocks): by uid on the unix socket, by token or certificate name on TCP; with a policy, by the
tenant the caller's rules name first, so the several uids (or tokens) of one tenant share one
bound rather than get one each.

Shared tenants (``[shared.NAME]``) are the one way a namespace crosses tenants: their readers
may read, their writers may write, both declared by the operator.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.config import AuthConfig
from kvstore.errors import UnauthenticatedError

SESSION_METADATA = "kvstore-session"
SESSION_TOKEN_BYTES = 32


@dataclass(frozen=True)
class Principal:
    """An authenticated caller. ``tenants`` None: every tenant (a single-user daemon's owner)."""

    name: str
    readable: frozenset[str] | None = None
    writable: frozenset[str] | None = None
    operator: bool = False
    # The tenants its rules name (None: every tenant). It pays for its own calls (keys per
    # second, leases) from these tenants' budgets, also when it reads a shared tenant: a reader
    # never spends the owner's (``Quotas.payer``).
    own: frozenset[str] | None = None
    # Shared tenant -> the tenant of its own that pays for its calls there: the one the
    # ``[shared.NAME]`` declaration names (the first by name if it names several of them).
    pays_for_shared: tuple[tuple[str, str], ...] = ()
    # The session that authenticated it (unix socket): handles it opens are that session's
    # alone, even against another session of the same process.
    session: str = ""

    def may_read(self, tenant: str) -> bool:
        return self.readable is None or tenant in self.readable

    def may_write(self, tenant: str) -> bool:
        return self.writable is None or tenant in self.writable

    @property
    def all_tenants(self) -> bool:
        return self.readable is None

    def paying_tenant(self, tenant: str) -> str | None:
        """The tenant of its own whose budget (keys per second, leases) its calls in a
        namespace of ``tenant`` spend: ``tenant`` itself when it is one of its own, else the
        one through which the policy lets it reach ``tenant`` (a shared tenant), else the
        first of its own by name. None: it names no tenant of its own (or every tenant)."""
        if self.own is None or tenant in self.own:
            return tenant if self.own is not None else None
        for shared, payer in self.pays_for_shared:
            if shared == tenant:
                return payer
        return min(self.own) if self.own else None


OWNER = Principal("owner", operator=True)


def caller_key(principal: Principal) -> str:
    """Whose share of a per-caller bound (open handles, namespaces holding blocks) a call
    spends: with a tenant policy, the tenant its rules name first by name (the one
    ``Quotas.payer`` charges by default); otherwise its name (``uid N`` on the unix socket,
    ``owner`` for a call without a session there, a token or certificate name on TCP)."""
    return f"tenant {min(principal.own)!r}" if principal.own else principal.name


def load_tokens(sources: Sequence[tuple[str, str]]) -> dict[str, bytes]:
    """Token name -> secret, read from ``env:VAR`` or ``file:/path`` (stripped). A missing or
    empty secret refuses the start: a token that silently matches nothing locks users out, one
    that is empty would let anybody in."""
    tokens: dict[str, bytes] = {}
    for name, source in sources:
        kind, _, where = source.partition(":")
        if kind == "env":
            secret = os.environ.get(where, "")
        else:
            try:
                with open(where, encoding="utf-8") as f:
                    secret = f.read()
            except OSError as exc:
                raise ValueError(f"auth.tokens.{name}: cannot read {where}: {exc}") from None
        secret = secret.strip()
        if len(secret) < 16:
            raise ValueError(
                f"auth.tokens.{name}: the secret from {source} is missing or shorter than 16 "
                "characters"
            )
        tokens[name] = secret.encode("utf-8")
    return tokens


@dataclass
class Policy:
    """The config's tenant policy, resolved for lookups by credential."""

    config: AuthConfig
    tokens: dict[str, bytes] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: AuthConfig) -> Policy:
        return cls(config, load_tokens(config.tokens))

    @property
    def enabled(self) -> bool:
        return self.config.has_policy

    def _principal(self, name: str, matches: list[int]) -> Principal:
        """The union of the rules that matched (a caller may be in several)."""
        rules = [self.config.access[i] for i in matches]
        own = {t for r in rules for t in r.tenants}
        readable, writable = set(own), set(own)
        pays: dict[str, str] = {}
        for tenant, shared in self.config.shared:
            if own & set(shared.writers):
                readable.add(tenant)
                writable.add(tenant)
                pays[tenant] = min(own & set(shared.writers))
            elif own & set(shared.readers):
                readable.add(tenant)
                pays[tenant] = min(own & set(shared.readers))
        return Principal(
            name,
            frozenset(readable),
            frozenset(writable),
            operator=any(r.role == "operator" for r in rules),
            own=frozenset(own),
            pays_for_shared=tuple(sorted(pays.items())),
        )

    def for_unix_peer(self, uid: int, gid: int) -> Principal | None:
        """The principal of a unix-socket peer, None if the policy does not know it."""
        if not self.enabled:
            # Single-user: only the owner (or root) can reach the owner-only socket. Named by
            # its uid, so root's processes and the owner's each have bounds of their own.
            return Principal(f"uid {uid}", operator=True)
        matches = [i for i, r in enumerate(self.config.access) if uid in r.uids or gid in r.gids]
        if not matches:
            return None
        return self._principal(f"uid {uid}", matches)

    def token_name(self, presented: bytes) -> str | None:
        """The name of the configured token equal to ``presented``: every token is compared,
        in constant time, so the time taken says nothing about which one (or how much) matched."""
        found = None
        for name, secret in self.tokens.items():
            if hmac.compare_digest(secret, presented):
                found = name
        return found

    def bearer_token_name(self, header: str) -> str | None:
        """The name of the configured token an ``authorization`` value (``Bearer <token>``)
        carries; None for another scheme or a token not configured."""
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self.token_name(value.strip().encode("utf-8"))

    def for_token(self, name: str) -> Principal | None:
        if not self.enabled:
            return Principal(f"token {name}", operator=True)
        matches = [i for i, r in enumerate(self.config.access) if name in r.tokens]
        return self._principal(f"token {name}", matches) if matches else None

    def for_cert(self, names: Sequence[str]) -> Principal | None:
        if not self.enabled:
            return Principal(f"certificate {names[0]}", operator=True) if names else None
        matches = [
            i for i, r in enumerate(self.config.access) if any(n in r.cert_names for n in names)
        ]
        return self._principal(f"certificate {names[0]}", matches) if matches else None


class Authenticator:
    """Turns a gRPC call's context into its ``Principal`` (``UnauthenticatedError`` when it
    has none).

    ``sessions`` maps a session token (hex, from the ``kvstore-session`` metadata) to the
    principal of the unix peer that opened it, while its session socket stays connected."""

    def __init__(
        self,
        policy: Policy,
        unix: bool,
        session_principal: Callable[[str], Principal | None],
    ) -> None:
        self.policy = policy
        self.unix = unix
        self._session_principal = session_principal
        config = policy.config
        # TCP with neither tokens nor client certificates: only a loopback bind (or an
        # operator's --insecure) gets here; every caller is the anonymous owner. Never with a
        # tenant policy (the daemon refuses to start so): that caller would reach every tenant.
        self._open_tcp = not policy.tokens and not config.tls_client_ca and not policy.enabled

    def principal(self, context: Any) -> Principal:
        metadata = {k: v for k, v in (context.invocation_metadata() or ())}
        session = metadata.get(SESSION_METADATA)
        if self.unix:
            if isinstance(session, str) and session:
                principal = self._session_principal(session)
                if principal is None:
                    raise UnauthenticatedError(
                        "unknown or closed session: connect the session socket again"
                    )
                return principal
            if not self.policy.enabled:
                return OWNER  # the owner-only socket is the proof
            raise UnauthenticatedError(
                "no session: same-host callers authenticate through the session socket "
                "(kvstore-session metadata), which the kvstore client opens"
            )
        if self.policy.config.tls_client_ca:
            names = _cert_names(context)
            if names:
                principal = self.policy.for_cert(names)
                if principal is None:
                    raise UnauthenticatedError(
                        f"client certificate {names[0]!r} is not in the policy"
                    )
                return principal
        header = metadata.get("authorization")
        if isinstance(header, str) and header:
            name = self.policy.bearer_token_name(header)
            if name is None:
                raise UnauthenticatedError("invalid bearer token")
            principal = self.policy.for_token(name)
            if principal is None:
                raise UnauthenticatedError(f"token {name!r} grants no tenant")
            return principal
        if self._open_tcp:
            return Principal("anonymous", operator=True)
        raise UnauthenticatedError("no credential: send a bearer token or a client certificate")


def _cert_names(context: Any) -> list[str]:
    """The verified client certificate's subject alternative names and common name."""
    auth = context.auth_context() or {}
    names: list[str] = []
    for key in ("x509_subject_alternative_name", "x509_common_name"):
        for value in auth.get(key, ()):
            name = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            if name not in names:
                names.append(name)
    return names
