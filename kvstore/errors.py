"""Exceptions of the kvstore library. Each names the problem; the client maps gRPC status codes
onto them so callers can catch one type per cause."""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of every kvstore error."""


class InvalidRequestError(KVStoreError, ValueError):
    """The daemon refused a request as malformed (INVALID_ARGUMENT); its message says why."""


class UnknownNamespaceError(KVStoreError, LookupError):
    """The namespace id is not known to the daemon (it restarted): open the namespace again."""


class NamespaceMismatchError(KVStoreError):
    """A client claims a namespace whose fingerprint differs from the one already registered."""


class CapacityError(KVStoreError):
    """A tier is full and nothing in it can be evicted (every block is leased or reserved)."""


class LeaseExpiredError(KVStoreError):
    """A reservation or read lease expired (or was never granted) before it was used."""


class UnavailableError(KVStoreError):
    """The daemon cannot be reached."""


class UnauthenticatedError(KVStoreError):
    """The daemon does not know who is calling (UNAUTHENTICATED): no credential, or a wrong one."""


class PermissionDeniedError(KVStoreError, PermissionError):
    """The caller is known but may not do this (PERMISSION_DENIED): another tenant's namespace,
    or a write to a namespace it may only read."""


ERRORS_BY_NAME: dict[str, type[KVStoreError]] = {
    cls.__name__: cls
    for cls in (
        InvalidRequestError,
        UnknownNamespaceError,
        NamespaceMismatchError,
        CapacityError,
        LeaseExpiredError,
        UnavailableError,
        UnauthenticatedError,
        PermissionDeniedError,
    )
}
"""Error classes by name: the daemon sends the name in the ``kvstore-error`` trailer and the
client raises the same class."""
