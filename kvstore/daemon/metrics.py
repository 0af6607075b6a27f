"""Prometheus metrics of the daemon: the RPC timings, the text exposition and its HTTP endpoint.

Operators scrape the daemon itself (``[daemon] metrics_address``), so this module owns three
small things and needs no new dependency:

- ``RpcMetrics`` and ``RpcMetricsInterceptor``: a latency histogram and an error count per
  ``kvstore.v1.KVStore`` method, kept by a grpc.aio server interceptor, so the servicer's code
  does not change and a daemon without a metrics address pays nothing;
- ``render_metrics``: the text exposition format (version 0.0.4) of what ``Stats`` reports,
  built from the same sources (``BlockStore.tier_snapshots()``, ``namespaces()``, the lease
  and reservation counts) and from ``RpcMetrics``;
- ``MetricsServer``: a tiny asyncio HTTP/1.x server answering ``GET /metrics`` and
  ``GET /healthz``. It runs on the daemon's event loop, so every request is bounded in size,
  time and number of connections, and nothing a client sends can raise out of it.

Why not ``prometheus_client``: measured on this machine (``benchmarks/bench_metrics_lib.py``,
medians of 5), its ``labels(m).observe`` costs 1.65 us (1.14 us on a bound child) against 0.41 us
here, on the daemon's one event loop, per call; a local call (``kvstore.local_calls``) takes
30-60 us in all, so the library would add 2-4% to every one. Its ``generate_latest`` of the RPC
histogram alone takes 1.6 ms against 0.5 ms for this whole exposition, and its HTTP server runs
in a thread of its own, outside the bounds this endpoint keeps. The format is small and
pinned by ``tests/test_metrics.py`` (parsed back by its own reader).

A scrape costs what a ``Stats`` call does: it reads counters the store keeps, except the GPU
tier's ``clean_below_bytes``, which ``DeviceTier.clean_bytes`` sums over the pool's blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import time
from bisect import bisect_left
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from kvstore.config import split_host_port

if TYPE_CHECKING:
    from kvstore.daemon.store import BlockStore

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Upper bounds (seconds) of the RPC latency buckets. A lookup over the local socket takes a few
# hundred microseconds; a cold multi-block get from NVMe or Redis, tens to hundreds of ms.
RPC_BUCKETS_S: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

# The HTTP side. A scraper sends one small request at once; anything larger or slower is not a
# scraper and must not hold a slot on the daemon's loop.
MAX_REQUEST_BYTES = 8192
READ_TIMEOUT_S = 3.0
WRITE_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 32
# After refusing a request, read (and drop) what the client still sends for this long before
# closing: closing with unread input resets the connection, and the client loses the reply.
LINGER_S = 1.0
LINGER_BYTES = 1 << 20


# --------------------------------------------------------------------------- RPC timings
class _Histogram:
    __slots__ = ("count", "counts", "sum_s")

    def __init__(self) -> None:
        self.counts = [0] * (len(RPC_BUCKETS_S) + 1)  # per bucket, the last one is +Inf
        self.sum_s = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bucket (Prometheus' "le").
        self.counts[bisect_left(RPC_BUCKETS_S, seconds)] += 1
        self.sum_s += seconds
        self.count += 1


class RpcMetrics:
    """Latency histogram per method and error count per (method, status code). Event-loop only."""

    def __init__(self, methods: Iterable[str] = ()) -> None:
        # Known methods start at zero, so a rate() over them exists before their first call.
        self.histograms: dict[str, _Histogram] = {m: _Histogram() for m in methods}
        self.errors: dict[tuple[str, str], int] = {}

    def observe(self, method: str, seconds: float, code: grpc.StatusCode | None) -> None:
        hist = self.histograms.get(method)
        if hist is None:
            hist = self.histograms[method] = _Histogram()
        hist.observe(seconds)
        if code is not None and code != grpc.StatusCode.OK:
            key = (method, code.name)
            self.errors[key] = self.errors.get(key, 0) + 1


def _status_code(exc: BaseException, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status a call ends with when its handler raises ``exc``."""
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    code = _context_code(context)
    if isinstance(exc, grpc.aio.AbortError) and code is not None:
        return code
    return grpc.StatusCode.UNKNOWN  # what grpc.aio answers for an unexpected exception


def _context_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode | None:
    try:
        code = context.code()
    except Exception:  # an older grpc.aio without code(): count the call, not its code
        return None
    if isinstance(code, int) and not isinstance(code, grpc.StatusCode):
        # Some grpc releases hand back the raw integer code.
        return next((c for c in grpc.StatusCode if c.value[0] == code), None)
    return code


Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


def _time_call(behavior: Behavior, method: str, metrics: RpcMetrics) -> Behavior:
    """Time a handler that returns its reply (unary or request-streaming) or writes with
    ``context.write``."""

    async def timed(request: Any, context: grpc.aio.ServicerContext) -> Any:
        start = time.perf_counter()
        code: grpc.StatusCode | None = None
        try:
            reply = await behavior(request, context)
            code = _context_code(context)
            return reply
        except BaseException as exc:
            code = _status_code(exc, context)
            raise
        finally:
            metrics.observe(method, time.perf_counter() - start, code)

    return timed


def _time_stream(behavior: Behavior, method: str, metrics: RpcMetrics) -> Behavior:
    """Time a response-streaming handler written as an async generator, to its last message."""

    async def timed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        start = time.perf_counter()
        code: grpc.StatusCode | None = None
        gen = behavior(request, context)
        try:
            async for item in gen:
                yield item
            code = _context_code(context)
        except GeneratorExit:
            code = grpc.StatusCode.CANCELLED  # the call ended before the stream did
            raise
        except BaseException as exc:
            code = _status_code(exc, context)
            raise
        finally:
            # Close the handler's generator now, not at garbage collection: its own finally
            # releases what it holds (GetBlocks: its read lease).
            try:
                await gen.aclose()
            finally:
                metrics.observe(method, time.perf_counter() - start, code)

    return timed


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Times every call of one service's methods into ``metrics``; other services (health,
    reflection) pass through untouched so probes do not blur the figures."""

    def __init__(self, metrics: RpcMetrics, service: str) -> None:
        self.metrics = metrics
        self._prefix = f"/{service}/"
        # method -> (handler as registered, its timed copy): the generic handler hands back the
        # same object on every call, so each call costs a dict lookup, not a new wrapper.
        self._timed: dict[str, tuple[Any, Any]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        path = handler_call_details.method
        if handler is None or not path.startswith(self._prefix):
            return handler
        method = path[len(self._prefix) :]
        cached = self._timed.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        timed = self._wrap(handler, method)
        self._timed[method] = (handler, timed)
        return timed

    def _wrap(self, handler: Any, method: str) -> Any:
        m = self.metrics
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_time_call(handler.unary_unary, method, m))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_time_call(handler.stream_unary, method, m))
        for field_name in ("unary_stream", "stream_stream"):
            behavior = getattr(handler, field_name)
            if behavior is not None:
                wrap = _time_stream if inspect.isasyncgenfunction(behavior) else _time_call
                return handler._replace(**{field_name: wrap(behavior, method, m)})
        return handler


# --------------------------------------------------------------------------- exposition
def escape_label_value(value: str) -> str:
    """A label value as the text format writes it between double quotes."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _format_bound(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)


Labels = Sequence[tuple[str, str]]


@dataclass
class _Family:
    name: str
    kind: str  # "gauge", "counter" or "histogram"
    help: str


class _Exposition:
    """Collects samples by family: the format wants each family's lines together, after its
    HELP and TYPE lines (written even when it has no samples, so the names are discoverable)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> _Family:
        self.lines.append(f"# HELP {name} {_escape_help(help_text)}")
        self.lines.append(f"# TYPE {name} {kind}")
        return _Family(name, kind, help_text)

    def sample(self, name: str, labels: Labels, value: float) -> None:
        if labels:
            body = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels)
            self.lines.append(f"{name}{{{body}}} {format_value(value)}")
        else:
            self.lines.append(f"{name} {format_value(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


# (metric suffix, TierSnapshot attribute or counter name, type, help)
_TIER_GAUGES = (
    (
        "capacity_bytes",
        "capacity_bytes",
        "Bytes the tier may hold (redis: the per-namespace bound, 0 when unbounded).",
    ),
    ("used_bytes", "used_bytes", "Bytes of blocks held by the tier."),
    ("blocks", "blocks", "Blocks held by the tier."),
)
_TIER_COUNTERS = (
    ("hits", "Looked-up keys found in this tier (the highest tier holding them)."),
    ("misses", "Looked-up keys this tier was asked for and did not hold."),
    ("evictions", "Blocks evicted from the tier."),
    ("promotions", "Blocks read up out of the tier."),
    ("demotions", "Blocks written down into the tier."),
    ("checksum_failures", "Blocks whose checksum did not match when read from the tier."),
)


def render_metrics(
    store: BlockStore | None,
    rpc: RpcMetrics,
    *,
    version: str,
    uptime_s: float | None,
) -> str:
    """The text exposition of the daemon. ``store`` None (not started yet): only the build
    info, the RPC figures and the family headers."""
    out = _Exposition()
    tiers = store.tier_snapshots() if store is not None else []

    for suffix, attr, help_text in _TIER_GAUGES:
        name = f"kvstore_tier_{suffix}"
        out.family(name, "gauge", help_text)
        for t in tiers:
            out.sample(name, (("tier", t.name),), getattr(t, attr))
    for counter, help_text in _TIER_COUNTERS:
        name = f"kvstore_tier_{counter}_total"
        out.family(name, "counter", help_text)
        for t in tiers:
            out.sample(name, (("tier", t.name),), getattr(t.counters, counter))
    for attr, help_text in (
        ("logical_bytes", "Bytes of the tier's blocks as readers get them."),
        ("stored_bytes", "Bytes the tier stores them in, after its codecs (what it counts)."),
    ):
        out.family(f"kvstore_tier_{attr}", "gauge", help_text)
        for t in tiers:
            out.sample(f"kvstore_tier_{attr}", (("tier", t.name),), getattr(t, attr))
    out.family("kvstore_tier_up", "gauge", "1 while the tier can be reached (redis), else 0.")
    for t in tiers:
        out.sample("kvstore_tier_up", (("tier", t.name),), bool(t.up))
    out.family(
        "kvstore_tier_extra", "gauge", "Tier-specific figures, by name (as `kvstore stat` shows)."
    )
    for t in tiers:
        for key, value in t.extra.items():
            out.sample("kvstore_tier_extra", (("tier", t.name), ("name", key)), float(value))

    # Namespace names are what operators know; two records sharing a name (should not happen)
    # are summed so the exposition never repeats a series.
    per_ns: dict[str, list[int]] = {}
    if store is not None:
        for ns in store.namespaces():
            row = per_ns.setdefault(ns.name, [0, 0, 0, 0])
            row[0] += ns.blocks
            row[1] += ns.blocks * ns.block_bytes
            row[2] += ns.lookup_hits
            row[3] += ns.lookup_misses
    ns_families = (
        ("kvstore_namespace_blocks", "gauge", "Blocks of the namespace in the daemon's index."),
        ("kvstore_namespace_used_bytes", "gauge", "Bytes of the namespace's blocks."),
        ("kvstore_namespace_lookup_hits_total", "counter", "Looked-up keys found."),
        ("kvstore_namespace_lookup_misses_total", "counter", "Looked-up keys not found."),
    )
    for column, (name, kind, help_text) in enumerate(ns_families):
        out.family(name, kind, help_text)
        for ns_name, row in per_ns.items():
            out.sample(name, (("namespace", ns_name),), row[column])

    # Per namespace and tier below the CPU tier: logical and stored bytes (after codecs).
    per_tier: dict[tuple[str, str], list[int]] = {}
    if store is not None:
        below = store.namespace_tier_bytes()
        names = {r.fingerprint: r.name for r in store.namespaces()} if below else {}
        for fp, rows in below.items():
            for tier, _, logical, stored, _ in rows:
                row = per_tier.setdefault((names.get(fp, fp.hex()), tier), [0, 0])
                row[0] += logical
                row[1] += stored
    for column, (name, help_text) in enumerate(
        (
            ("kvstore_namespace_tier_logical_bytes", "A namespace's bytes in a tier, as read."),
            ("kvstore_namespace_tier_stored_bytes", "A namespace's bytes in a tier, as stored."),
        )
    ):
        out.family(name, "gauge", help_text)
        for (ns_name, tier), row in per_tier.items():
            out.sample(name, (("namespace", ns_name), ("tier", tier)), row[column])

    out.family("kvstore_active_leases", "gauge", "Read leases not released yet.")
    if store is not None:
        out.sample("kvstore_active_leases", (), store.active_leases)
    out.family("kvstore_active_reservations", "gauge", "Write reservations not committed yet.")
    if store is not None:
        out.sample("kvstore_active_reservations", (), store.active_reservations)
    out.family("kvstore_uptime_seconds", "gauge", "Seconds since the daemon started serving.")
    if uptime_s is not None:
        out.sample("kvstore_uptime_seconds", (), uptime_s)
    out.family("kvstore_build_info", "gauge", "Always 1; the label says the daemon's version.")
    out.sample("kvstore_build_info", (("version", version),), 1)

    name = "kvstore_rpc_duration_seconds"
    out.family(name, "histogram", "Time to serve kvstore.v1.KVStore calls, by method.")
    bounds = (*RPC_BUCKETS_S, math.inf)
    for method, hist in sorted(rpc.histograms.items()):
        cumulative = 0
        for bound, count in zip(bounds, hist.counts, strict=True):
            cumulative += count
            labels = (("method", method), ("le", _format_bound(bound)))
            out.sample(f"{name}_bucket", labels, cumulative)
        out.sample(f"{name}_sum", (("method", method),), hist.sum_s)
        out.sample(f"{name}_count", (("method", method),), hist.count)
    out.family(
        "kvstore_rpc_errors_total", "counter", "Calls that ended with a non-OK status, by code."
    )
    for (method, code), count in sorted(rpc.errors.items()):
        out.sample("kvstore_rpc_errors_total", (("method", method), ("code", code)), count)
    return out.text()


# --------------------------------------------------------------------------- HTTP endpoint
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class _BadRequest(Exception):
    pass


class MetricsServer:
    """``GET /metrics`` and ``GET /healthz`` over HTTP/1.x on ``address`` (host:port).

    ``render``: the exposition text; ``healthy``: whether /healthz answers 200 (else 503);
    ``authorize``: given a request's ``Authorization`` header (None: it sent none), whether
    it may read /metrics (None: anyone may, as on a single-user daemon; with a tenant policy the
    text names every tenant's namespaces). /healthz says nothing but up or down: open. One
    request per connection (the reply says ``Connection: close``).
    """

    def __init__(
        self,
        address: str,
        render: Callable[[], str],
        healthy: Callable[[], bool],
        authorize: Callable[[str | None], bool] | None = None,
    ) -> None:
        self.address = address
        self._render = render
        self._healthy = healthy
        self._authorize = authorize
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def bound_address(self) -> str:
        """host:port actually bound (the port a ``:0`` address got)."""
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def start(self) -> None:
        host, port = split_host_port(self.address)
        try:
            self._server = await asyncio.start_server(
                self._accept, host or None, port, limit=MAX_REQUEST_BYTES
            )
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise RuntimeError(
                f"could not serve metrics on {self.address} (daemon.metrics_address): {reason}"
            ) from exc

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        # Connections in flight end now: a stalled scraper must not hold up a stop.
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._server.wait_closed()
        self._server = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= MAX_CONNECTIONS:
            writer.transport.abort()  # over the bound: not worth even an error reply
            return
        self._connections.add(task)
        try:
            await self._serve(reader, writer)
        except (asyncio.CancelledError, ConnectionError, TimeoutError):
            pass  # stopped, or the client went away / stalled: nothing to report
        except Exception:  # a bug here must cost one request, never the daemon
            log.exception("metrics endpoint: request failed")
        finally:
            self._connections.discard(task)
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                method, path, authorization = await _read_request(reader)
        except TimeoutError:
            await _respond(writer, 408, "request not received in time\n")
            return
        except _BadRequest as exc:
            await _respond(writer, 400, f"{exc}\n")
            await _discard_input(reader, writer)
            return
        head = method == "HEAD"
        if method not in ("GET", "HEAD"):
            await _respond(writer, 405, "only GET\n", extra_headers=("Allow: GET, HEAD",))
            return
        path = path.split("?", 1)[0]
        if path == "/metrics":
            if self._authorize is not None and not self._authorize(authorization):
                await _respond(
                    writer,
                    401,
                    "a bearer token of an operator is needed: this daemon has tenants\n",
                    head=head,
                    extra_headers=('WWW-Authenticate: Bearer realm="kvstore"',),
                )
                return
            try:
                body = self._render()
            except Exception:
                log.exception("metrics endpoint: rendering failed")
                await _respond(writer, 500, "rendering the metrics failed\n", head=head)
                return
            await _respond(writer, 200, body, content_type=CONTENT_TYPE, head=head)
        elif path == "/healthz":
            if self._healthy():
                await _respond(writer, 200, "ok\n", head=head)
            else:
                await _respond(writer, 503, "not serving\n", head=head)
        else:
            await _respond(writer, 404, "not found: try /metrics or /healthz\n", head=head)


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, str | None]:
    """(method, path, Authorization header or None) of one request; its other headers are read
    (bounded) and ignored. The request line is checked first, so bytes that are not HTTP are
    refused without waiting for more."""
    total = 0

    async def line() -> bytes:
        nonlocal total
        try:
            data = await reader.readline()
        except ValueError:  # a line longer than the stream's limit
            raise _BadRequest("request too large") from None
        total += len(data)
        if total > MAX_REQUEST_BYTES:
            raise _BadRequest("request too large")
        if not data.endswith(b"\n"):
            raise _BadRequest("incomplete request")  # EOF before the end of the headers
        return data

    parts = (await line()).decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
        raise _BadRequest("malformed request line")
    if not parts[0].isascii() or not parts[0].isalpha():
        raise _BadRequest("malformed method")
    authorization = None
    while header := (await line()).strip():
        name, _, value = header.decode("latin-1").partition(":")
        if name.strip().lower() == "authorization":
            authorization = value.strip()
    return parts[0].upper(), parts[1], authorization


async def _discard_input(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Half-close, then drop the client's remaining input (bounded in bytes and time)."""
    with contextlib.suppress(Exception):
        if writer.can_write_eof():
            writer.write_eof()
        received = 0
        async with asyncio.timeout(LINGER_S):
            while received < LINGER_BYTES and (chunk := await reader.read(65536)):
                received += len(chunk)


async def _respond(
    writer: asyncio.StreamWriter,
    status: int,
    body: str,
    *,
    content_type: str = "text/plain; charset=utf-8",
    head: bool = False,
    extra_headers: Sequence[str] = (),
) -> None:
    payload = body.encode()
    lines = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(payload)}",
        "Connection: close",
        *extra_headers,
    ]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    if not head:
        writer.write(payload)
    async with asyncio.timeout(WRITE_TIMEOUT_S):
        await writer.drain()
