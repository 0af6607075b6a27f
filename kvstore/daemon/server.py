"""``kvstore serve``: the grpc.aio server, its socket, the reaper, the metrics endpoint and a
graceful stop.

One event loop owns the store. SIGTERM/SIGINT stop accepting calls, let calls in flight finish
(up to ``grace_s``), unlink the shared-memory arena and the socket, and return normally so the
process exits 0. With ``metrics_address`` set, the same loop serves Prometheus scrapes
(``kvstore.daemon.metrics``) and an interceptor times the RPCs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.address import default_address, session_socket_path, unix_socket_path
from kvstore.config import AuthConfig, DaemonConfig
from kvstore.daemon.auth import Authenticator, Policy
from kvstore.daemon.local_calls import LocalCalls
from kvstore.daemon.metrics import MetricsServer, RpcMetrics, RpcMetricsInterceptor, render_metrics
from kvstore.daemon.service import KVStoreServicer, add_to_server
from kvstore.daemon.session import SessionServer
from kvstore.daemon.side_streams import SideStreamGuard
from kvstore.daemon.store import BlockStore
from kvstore.units import format_size
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.version import __version__

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
METHOD_NAMES = [m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods]


def _check_tcp_bind(address: str, auth: AuthConfig) -> None:
    """A TCP address other than loopback needs TLS and a credential (tokens or client
    certificates), unless the operator says ``insecure`` (then a warning at every start)."""
    if auth.has_policy and not (auth.tokens or auth.tls_client_ca):
        raise RuntimeError(
            f"refusing to serve {address} with a tenant policy ([[access]]) but neither "
            "auth.tokens or auth.tls_client_ca: uids and gids are known only on a unix socket, "
            "so every TCP caller would be anonymous and reach every tenant"
        )
    host = address.rsplit(":", 1)[0].strip("[]")
    loopback = host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")
    secured = auth.tls and (bool(auth.tokens) or bool(auth.tls_client_ca))
    if loopback or secured:
        return
    if not auth.insecure:
        raise RuntimeError(
            f"refusing to serve {address} without TLS and credentials: anyone who reaches it "
            "could read and write every tenant's cache. Set auth.tls_cert/tls_key and "
            "auth.tokens or auth.tls_client_ca, bind to loopback, or pass --insecure"
        )
    log.warning(
        "serving %s WITHOUT TLS or credentials (--insecure): every peer that reaches it can "
        "read and write every tenant's cache",
        address,
    )


def _server_credentials(auth: AuthConfig) -> grpc.ServerCredentials:
    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_server_credentials(
        [(read(auth.tls_key), read(auth.tls_cert))],
        root_certificates=read(auth.tls_client_ca) if auth.tls_client_ca else None,
        require_client_auth=bool(auth.tls_client_ca),
    )


def _prepare_unix_socket(path: str, shared: bool) -> None:
    """Create the socket's directory (owner-only; searchable by others when a tenant policy
    lets other users in) and refuse one this user does not own or others can write: whoever
    controls the directory can put their own socket where clients connect. Refuse to start
    over a live daemon's socket."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.stat(directory)
    if st.st_uid != os.geteuid():
        raise RuntimeError(
            f"socket directory {directory} belongs to uid {st.st_uid}, not to this user "
            f"({os.geteuid()}): another user may have created it to receive this daemon's "
            "clients; remove it or choose another address"
        )
    if st.st_mode & 0o022:
        raise RuntimeError(
            f"socket directory {directory} is writable by others (mode {st.st_mode & 0o777:o}): "
            "anyone could replace the socket; chmod go-w it or choose another address"
        )
    if not shared:
        os.chmod(directory, 0o700)
    elif st.st_mode & 0o001 == 0 and st.st_mode & 0o010:
        pass  # the operator let a group in (say 0710, group kvstore-users): keep it so
    else:
        os.chmod(directory, 0o711)
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale socket of a daemon that died
        else:
            raise RuntimeError(f"another daemon is already serving on unix:{path}")
        finally:
            probe.close()


def _operator_token_check(policy: Policy) -> Callable[[str | None], bool]:
    """Whether an HTTP ``Authorization`` header carries the bearer token of an operator: with
    a tenant policy, /metrics lists every tenant's namespaces and the tiers' counters, which
    ``Stats`` shows only to operators."""

    def authorized(header: str | None) -> bool:
        name = policy.bearer_token_name(header or "")
        principal = policy.for_token(name) if name is not None else None
        return principal is not None and principal.operator

    return authorized


class Daemon:
    """Owns the server, the store and the background tasks of one daemon process."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.address = config.address or default_address()
        self.store: BlockStore | None = None
        self.server: grpc.aio.Server | None = None
        self.servicer: KVStoreServicer | None = None
        self.rpc_metrics: RpcMetrics | None = None
        self.metrics_server: MetricsServer | None = None
        self.sessions: SessionServer | None = None
        self.policy: Policy | None = None
        self._serving = False
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def _raise_fd_limit(self) -> None:
        """Descriptors for every connection the caps allow (and the slab files), so that
        reaching a cap refuses the next peer instead of starving the daemon of descriptors."""
        conns = self.config.connections
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = conns.max_connections + conns.max_sessions + 1024
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(want, hard)
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            if soft < want:
                log.warning(
                    "descriptor limit %d is below what connections.max_connections + "
                    "max_sessions need (%d): lower them or raise the limit",
                    soft,
                    want,
                )

    async def start(self) -> None:
        self._raise_fd_limit()
        socket_path = unix_socket_path(self.address)
        # Tokens are read (and a bind without protection refused) before anything is made.
        self.policy = Policy.from_config(self.config.auth)
        if socket_path is not None:
            _prepare_unix_socket(socket_path, shared=self.policy.enabled)
        else:
            _check_tcp_bind(self.address, self.config.auth)
        if self.config.metrics_address:
            # Bound first: a taken port fails the start before the arena and the socket exist.
            self.rpc_metrics = RpcMetrics(METHOD_NAMES)
            self.metrics_server = MetricsServer(
                self.config.metrics_address,
                self.render_metrics,
                lambda: self._serving,
                _operator_token_check(self.policy) if self.policy.enabled else None,
            )
            await self.metrics_server.start()
        try:
            await self._start_serving(socket_path)
        except BaseException:
            if self.metrics_server is not None:
                await self.metrics_server.close()
            raise
        self._serving = True

    async def _start_serving(self, socket_path: str | None) -> None:
        self.store = BlockStore(self.config)
        try:
            await self.store.start()
        except BaseException:
            self.store.close()
            raise
        try:
            await self._start_grpc(socket_path)
        except BaseException:
            # The gRPC side failed (say, the address is taken): stop the store so its arena,
            # its GPU pool and its NVMe file are released before the error reaches the caller.
            if self.server is not None:
                await self.server.stop(0)
            if self.sessions is not None:
                await self.sessions.stop()
            await self.store.stop()
            raise

    async def _start_grpc(self, socket_path: str | None) -> None:
        assert self.store is not None and self.policy is not None
        conns = self.config.connections
        options = [
            # Bounds on what peers can hold: idle connections are closed (their memory comes
            # back), connections past the cap are refused at accept.
            ("grpc.max_allowed_incoming_connections", conns.max_connections),
            ("grpc.max_concurrent_streams", conns.max_streams_per_connection),
            ("grpc.max_connection_idle_ms", int(conns.idle_timeout_s * 1000)),
            ("grpc.max_receive_message_length", self.config.max_message_bytes),
            ("grpc.max_send_message_length", self.config.max_message_bytes),
            ("grpc.so_reuseport", 0),
            # A TCP client that vanishes without closing its connection is noticed by pings,
            # so its handles (and the leases and reservations they hold) are reclaimed.
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ]
        side_streams = SideStreamGuard(SERVICE_NAME)
        interceptors: list[grpc.aio.ServerInterceptor] = [side_streams]
        if self.rpc_metrics is not None:
            interceptors.append(RpcMetricsInterceptor(self.rpc_metrics, SERVICE_NAME))
        self.server = grpc.aio.server(
            options=options,
            interceptors=interceptors,
            maximum_concurrent_rpcs=conns.max_concurrent_rpcs,
        )
        mode = 0o666 if self.policy.enabled else 0o600  # the policy decides who, not the mode
        if socket_path is not None:
            self.sessions = SessionServer(
                session_socket_path(socket_path),
                self.policy,
                self.store.arena,
                self.store.names.tenant_of_domain,
                conns.max_sessions,
                mode,
            )
            await self.sessions.start()
        sessions = self.sessions
        auth = Authenticator(
            self.policy,
            unix=socket_path is not None,
            session_principal=sessions.principal if sessions is not None else lambda t: None,
        )
        self.servicer = KVStoreServicer(self.store, auth)
        side_streams.authenticate = auth.principal
        if sessions is not None:
            # Before any await: every session that connects from now on is offered them.
            observe = self.rpc_metrics.observe if self.rpc_metrics is not None else None
            sessions.calls = LocalCalls(self.servicer, observe).serve
            sessions.presence = self.servicer.presence_of
        add_to_server(self.servicer, self.server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        if self.config.auth.reflection:
            reflection.enable_server_reflection(
                [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
            )
        if socket_path is None and self.config.auth.tls:
            port = self.server.add_secure_port(self.address, _server_credentials(self.config.auth))
        else:
            port = self.server.add_insecure_port(self.address)
        if socket_path is None and port == 0:
            raise RuntimeError(f"could not bind {self.address}")
        await self.server.start()
        if socket_path is not None:
            os.chmod(socket_path, mode)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self._tasks.append(asyncio.create_task(self._reaper()))

    def render_metrics(self) -> str:
        """The Prometheus exposition; tier and namespace figures once the store is serving."""
        assert self.rpc_metrics is not None
        servicer = self.servicer if self._serving else None
        return render_metrics(
            self.store if servicer is not None else None,
            self.rpc_metrics,
            version=__version__,
            # The servicer's clock, so the figure matches Stats' uptime_s.
            uptime_s=time.monotonic() - servicer.started_at if servicer is not None else None,
        )

    async def _reaper(self) -> None:
        assert self.store is not None
        while True:
            await asyncio.sleep(self.config.reaper_interval_s)
            try:
                self.store.reap()
            except Exception:  # keep reaping: one bad entry must not stop reclamation
                log.exception("reaper failed")

    def request_stop(self) -> None:
        self._stop.set()

    async def wait(self) -> None:
        await self._stop.wait()

    async def stop(self, grace_s: float = 5.0) -> None:
        self._serving = False  # /healthz answers 503 while calls drain
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.servicer is not None:
            self.servicer.close_streams()
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.sessions is not None:
            await self.sessions.stop()
        if self.store is not None:
            await self.store.stop()
        if self.metrics_server is not None:
            await self.metrics_server.close()
        socket_path = unix_socket_path(self.address)
        if socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(socket_path)


async def run_daemon(
    config: DaemonConfig, on_ready: Callable[[Daemon], None] | None = None
) -> None:
    import torch

    # The daemon's torch work (the tiers' codecs) runs on its IO threads, several blocks at
    # once; torch's own intra-op pool inside each of them oversubscribes the cores (fp8
    # encoding ran ~20x slower on a loaded 2-core host with two threads than with one).
    torch.set_num_threads(1)
    daemon = Daemon(config)
    await daemon.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop)
    if on_ready is not None:
        on_ready(daemon)
    try:
        await daemon.wait()
    finally:
        await daemon.stop()


def print_ready(daemon: Daemon) -> None:
    assert daemon.store is not None
    cpu = daemon.config.cpu
    metrics = ""
    if daemon.metrics_server is not None:
        metrics = f", metrics on http://{daemon.metrics_server.bound_address}/metrics"
    print(
        f"kvstore serving on {daemon.address} "
        f"(cpu tier {format_size(daemon.store.allocator.capacity_bytes)}, "
        f"policy {cpu.policy}, pid {os.getpid()}{metrics})",
        file=sys.stderr,
        flush=True,
    )
