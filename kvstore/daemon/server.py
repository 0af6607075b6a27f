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
import signal
import socket
import sys
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore import __version__
from kvstore.address import default_address, unix_socket_path
from kvstore.config import DaemonConfig
from kvstore.daemon.metrics import MetricsServer, RpcMetrics, RpcMetricsInterceptor, render_metrics
from kvstore.daemon.service import KVStoreServicer, add_to_server
from kvstore.daemon.store import BlockStore
from kvstore.units import format_size
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
METHOD_NAMES = [m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods]


def _prepare_unix_socket(path: str) -> None:
    """Create the socket's directory owner-only; refuse to start over a live daemon's socket."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
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
        self._serving = False
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        socket_path = unix_socket_path(self.address)
        if socket_path is not None:
            _prepare_unix_socket(socket_path)
        if self.config.metrics_address:
            # Bound first: a taken port fails the start before the arena and the socket exist.
            self.rpc_metrics = RpcMetrics(METHOD_NAMES)
            self.metrics_server = MetricsServer(
                self.config.metrics_address, self.render_metrics, lambda: self._serving
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
            await self.store.stop()
            raise

    async def _start_grpc(self, socket_path: str | None) -> None:
        assert self.store is not None
        options = [
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
        interceptors = []
        if self.rpc_metrics is not None:
            interceptors.append(RpcMetricsInterceptor(self.rpc_metrics, SERVICE_NAME))
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        self.servicer = KVStoreServicer(self.store)
        add_to_server(self.servicer, self.server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        port = self.server.add_insecure_port(self.address)
        if socket_path is None and port == 0:
            raise RuntimeError(f"could not bind {self.address}")
        await self.server.start()
        if socket_path is not None:
            os.chmod(socket_path, 0o600)
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
        f"(cpu tier {format_size(daemon.store.allocator.capacity_bytes)} at "
        f"{daemon.store.arena.path}, policy {cpu.policy}, pid {os.getpid()}{metrics})",
        file=sys.stderr,
        flush=True,
    )
