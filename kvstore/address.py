"""Where the daemon listens by default, and how addresses are written.

Addresses are gRPC target strings: ``unix:/path/to.sock`` (the default, owner-only) or
``host:port`` for TCP. The default is ``$KVSTORE_ADDRESS``, else a socket in the user's runtime
directory (``$XDG_RUNTIME_DIR/kvstore/kvstore.sock``), else under ``/tmp/kvstore-<uid>/``.
"""

from __future__ import annotations

import os


def default_socket_path() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "kvstore") if runtime else f"/tmp/kvstore-{os.getuid()}"
    return os.path.join(base, "kvstore.sock")


def default_address() -> str:
    return os.environ.get("KVSTORE_ADDRESS") or f"unix:{default_socket_path()}"


def session_socket_path(grpc_socket_path: str) -> str:
    """The daemon's session socket, beside its gRPC socket (``kvstore.daemon.session``)."""
    return grpc_socket_path + ".session"


def unix_socket_path(address: str) -> str | None:
    """The filesystem path of a ``unix:`` address, or None for TCP."""
    if address.startswith("unix://"):
        return address[len("unix://") :]
    if address.startswith("unix:"):
        return address[len("unix:") :]
    return None
