"""How a client reaches the daemon: channels (TLS and credentials, the metadata every call
carries), the session on a unix socket, and waiting for a daemon to serve. Shared by the sync and
async clients and the CLI; re-exported by ``kvstore.client._common``."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvstore.client.session import ClientSession
from kvstore.errors import UnavailableError

# Control messages are small and bytes-path blocks travel in chunks (the daemon says how large in
# OpenNamespace), so no message comes near this.
MAX_MESSAGE_BYTES = 32 << 20


# Reconnect backoff. gRPC's default starts at 1 s and grows 1.6x a try to 120 s: after a
# daemon restart of a few seconds, during which the client's calls failed (fast, as an engine
# wants: it recomputes), the channel would not try again for seconds more, and every call in
# between fails although the daemon serves. A sidecar is near and cheap to reach, so a client
# tries at most a second apart (the connect deadline keeps gRPC's 20 s floor: a TLS handshake
# to a remote daemon is never cut short).
RECONNECT_BACKOFF_MS = (100, 1000)


def channel_options() -> list[tuple[str, int]]:
    initial, most = RECONNECT_BACKOFF_MS
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.initial_reconnect_backoff_ms", initial),
        ("grpc.max_reconnect_backoff_ms", most),
    ]


def wait_for_daemon(
    address: str, timeout_s: float = 30.0, proc: subprocess.Popen | None = None
) -> None:
    """Block until the daemon at ``address`` answers its health check as SERVING.

    Raises UnavailableError after ``timeout_s``, or at once if ``proc`` (the daemon's process,
    when the caller started it) exits first.
    """
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    # Short reconnect backoff: the socket may not exist yet on the first tries.
    options = [("grpc.initial_reconnect_backoff_ms", 20), ("grpc.max_reconnect_backoff_ms", 100)]
    with grpc.insecure_channel(address, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                raise UnavailableError(f"daemon exited with {proc.returncode} before serving")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise UnavailableError(f"daemon at {address} not serving after {timeout_s}s")
            time.sleep(0.05)


# ----------------------------------------------------------------- credentials and channels
@dataclass(frozen=True)
class Credentials:
    """How a client proves who it is over TCP: a bearer token and/or TLS (a CA to verify the
    daemon, and a client certificate and key where the daemon asks for one). Unset fields come
    from ``KVSTORE_TOKEN`` (or the file ``KVSTORE_TOKEN_FILE``), ``KVSTORE_TLS_CA``,
    ``KVSTORE_TLS_CERT`` and ``KVSTORE_TLS_KEY``. Same-host clients on the unix socket need
    none of these: the kernel vouches for them (the session socket)."""

    token: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    @classmethod
    def resolve(
        cls,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> Credentials:
        env = os.environ
        if token is None:
            token = env.get("KVSTORE_TOKEN", "")
            if not token and env.get("KVSTORE_TOKEN_FILE"):
                with open(env["KVSTORE_TOKEN_FILE"], encoding="utf-8") as f:
                    token = f.read().strip()
        return cls(
            token=token,
            tls_ca=tls_ca if tls_ca is not None else env.get("KVSTORE_TLS_CA", ""),
            tls_cert=tls_cert if tls_cert is not None else env.get("KVSTORE_TLS_CERT", ""),
            tls_key=tls_key if tls_key is not None else env.get("KVSTORE_TLS_KEY", ""),
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls_ca:
            return None

        def read(path: str) -> bytes | None:
            if not path:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(
            read(self.tls_ca), read(self.tls_key), read(self.tls_cert)
        )


def call_metadata(
    credentials: Credentials, session: ClientSession | None
) -> tuple[tuple[str, str], ...]:
    """What every call carries: the session token (unix socket) or the bearer token (TCP)."""
    if session is not None:
        return session.metadata()
    if credentials.token:
        return (("authorization", f"Bearer {credentials.token}"),)
    return ()


class _Details(grpc.ClientCallDetails):
    def __init__(self, d: Any, metadata: Sequence[tuple[str, str]]) -> None:
        self.method = d.method
        self.timeout = d.timeout
        self.metadata = [*(d.metadata or ()), *metadata]
        self.credentials = d.credentials
        self.wait_for_ready = d.wait_for_ready
        self.compression = getattr(d, "compression", None)


class MetadataInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``metadata()`` (read at each call: it changes when a session is reopened) to every
    call of a blocking channel."""

    def __init__(self, metadata: Callable[[], Sequence[tuple[str, str]]]) -> None:
        self._metadata = metadata

    def _d(self, d: Any) -> _Details:
        return _Details(d, self._metadata())

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._d(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._d(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._d(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._d(client_call_details), request_iterator)


def make_channel(
    address: str,
    credentials: Credentials,
    metadata: Callable[[], Sequence[tuple[str, str]]],
) -> grpc.Channel:
    """A blocking channel to ``address`` (TLS when a CA is configured) whose calls carry
    ``metadata()``."""
    secure = credentials.channel_credentials()
    if secure is not None:
        channel = grpc.secure_channel(address, secure, options=channel_options())
    else:
        channel = grpc.insecure_channel(address, options=channel_options())
    return grpc.intercept_channel(channel, MetadataInterceptor(metadata))


def make_aio_channel(
    address: str,
    credentials: Credentials,
    metadata: Callable[[], Sequence[tuple[str, str]]],
) -> grpc.aio.Channel:
    """The asyncio twin of ``make_channel``."""
    from kvstore.client._aio_auth import aio_interceptors

    secure = credentials.channel_credentials()
    interceptors = aio_interceptors(metadata)
    if secure is not None:
        return grpc.aio.secure_channel(
            address, secure, options=channel_options(), interceptors=interceptors
        )
    return grpc.aio.insecure_channel(address, options=channel_options(), interceptors=interceptors)


def open_session(address: str, timeout_s: float) -> ClientSession | None:
    """A session with a daemon on a unix socket (None over TCP: TCP callers prove themselves
    with TLS and tokens). UnavailableError when no daemon answers within ``timeout_s``."""
    from kvstore.address import unix_socket_path

    path = unix_socket_path(address)
    if path is None:
        return None
    return ClientSession(path, timeout_s)
