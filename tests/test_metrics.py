"""The Prometheus endpoint as an operator meets it: a real daemon with ``--metrics-address``,
scraped over HTTP; its figures against ``Stats``; requests that are not scrapes; the Grafana
dashboard's queries against what the endpoint exports."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from conftest import SMALL_LAYOUT, DaemonProcess, config_toml, kv_channel, random_blocks, tokens

from kvstore import KVStoreClient
from kvstore.config import AccessRule, AuthConfig, DaemonConfig, load_config, split_host_port
from kvstore.daemon.metrics import (
    MAX_CONNECTIONS,
    READ_TIMEOUT_S,
    RpcMetrics,
    escape_label_value,
    render_metrics,
)
from kvstore.daemon.store import TierCounters, TierSnapshot
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

# ---------------------------------------------------------------- a parser of the text format
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,?)')
_COMMENT = re.compile(rf"^# (HELP|TYPE) ({_NAME}) ?(.*)$")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], value)


def _labels(text: str) -> frozenset[tuple[str, str]]:
    out: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        assert m, f"bad labels at {text[pos:]!r}"
        assert m[1] not in out, f"label {m[1]} repeated"
        out[m[1]] = _unescape(m[2])
        pos = m.end()
        assert m[3] or pos == len(text), f"labels not separated by commas: {text!r}"
    return frozenset(out.items())


@dataclass
class Exposition:
    types: dict[str, str] = field(default_factory=dict)
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = field(default_factory=dict)

    def value(self, metric: str, /, **labels: str) -> float:
        return self.samples[(metric, frozenset(labels.items()))]

    def series(self, name: str) -> dict[frozenset[tuple[str, str]], float]:
        return {labels: v for (n, labels), v in self.samples.items() if n == name}


def parse_exposition(text: str) -> Exposition:
    """Parse text format 0.0.4 strictly: every non-comment line is ``name{labels} value``, every
    sample belongs to a family declared by a TYPE line above it, a family's lines are together,
    no series appears twice."""
    assert text.endswith("\n")
    exp = Exposition()
    finished: set[str] = set()
    current: str | None = None
    for line in text.splitlines():
        assert line, "empty line"
        if line.startswith("#"):
            m = _COMMENT.match(line)
            if m is None:
                continue  # a plain comment
            kind, name, rest = m.groups()
            if kind == "TYPE":
                assert name not in exp.types, f"TYPE of {name} twice"
                assert rest in ("counter", "gauge", "histogram", "summary", "untyped"), line
                exp.types[name] = rest
            family = name
        else:
            m = _SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            name, labels_text, value_text = m.groups()
            family = name
            if name not in exp.types:
                base = next((name[: -len(s)] for s in _HISTOGRAM_SUFFIXES if name.endswith(s)), "")
                assert exp.types.get(base) == "histogram", f"{name} has no TYPE line"
                family = base
            key = (name, _labels(labels_text or ""))
            assert key not in exp.samples, f"series repeated: {line!r}"
            exp.samples[key] = float(value_text)  # float() reads +Inf, -Inf and NaN too
        if family != current:
            assert family not in finished, f"lines of {family} are not together"
            if current is not None:
                finished.add(current)
            current = family
    return exp


# ---------------------------------------------------------------- helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class MetricsDaemon:
    process: DaemonProcess
    port: int

    @property
    def address(self) -> str:
        return self.process.address

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
        request = urllib.request.Request(self.url(path), method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, dict(reply.headers), reply.read()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read()

    def scrape(self) -> Exposition:
        status, headers, body = self.get("/metrics")
        assert status == 200
        assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse_exposition(body.decode())


@pytest.fixture(scope="module")
def metrics_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetricsDaemon]:
    port = free_port()
    directory = Path(tmp_path_factory.mktemp("kvm", numbered=True))
    process = DaemonProcess(
        directory, config_toml(), extra_args=["--metrics-address", f"127.0.0.1:{port}"]
    ).start()
    yield MetricsDaemon(process, port)
    if process.alive():
        process.stop()


def client(d: MetricsDaemon, **kw) -> KVStoreClient:
    return KVStoreClient(d.address, layout=SMALL_LAYOUT, model="metrics-model", **kw)


def rpc_count(exp: Exposition, method: str) -> float:
    return exp.value("kvstore_rpc_duration_seconds_count", method=method)


# ---------------------------------------------------------------- through a real daemon
def test_exposition_matches_stats(metrics_daemon: MetricsDaemon) -> None:
    with client(metrics_daemon) as kv:
        keys = kv.hash_tokens(tokens(6, offset=1000))
        kv.put(keys[:4], random_blocks(SMALL_LAYOUT, 4, seed=3))
        assert kv.lookup(keys) == 4
        stats = kv.stats()
        exp = metrics_daemon.scrape()

    assert stats.tiers
    for t in stats.tiers:
        assert exp.value("kvstore_tier_capacity_bytes", tier=t.name) == t.capacity_bytes
        assert exp.value("kvstore_tier_used_bytes", tier=t.name) == t.used_bytes
        assert exp.value("kvstore_tier_blocks", tier=t.name) == t.blocks
        for counter in (
            "hits",
            "misses",
            "evictions",
            "promotions",
            "demotions",
            "checksum_failures",
        ):
            assert exp.value(f"kvstore_tier_{counter}_total", tier=t.name) == getattr(t, counter)
        assert exp.value("kvstore_tier_up", tier=t.name) == (1 if t.up else 0)
        for name, value in t.extra.items():
            assert exp.value("kvstore_tier_extra", tier=t.name, name=name) == pytest.approx(value)
    cpu = next(t for t in stats.tiers if t.name == "cpu")
    assert cpu.blocks >= 4 and cpu.used_bytes >= 4 * SMALL_LAYOUT.block_bytes and cpu.hits >= 4

    names = {n.name for n in stats.namespaces}
    assert any(name.startswith("metrics-model") for name in names)
    assert {dict(labels)["namespace"] for labels in exp.series("kvstore_namespace_blocks")} == names
    for n in stats.namespaces:
        assert exp.value("kvstore_namespace_blocks", namespace=n.name) == n.blocks
        assert exp.value("kvstore_namespace_used_bytes", namespace=n.name) == n.used_bytes
        assert exp.value("kvstore_namespace_lookup_hits_total", namespace=n.name) == n.hits
        assert exp.value("kvstore_namespace_lookup_misses_total", namespace=n.name) == n.misses

    assert exp.value("kvstore_active_leases") == stats.active_leases
    assert exp.value("kvstore_active_reservations") == stats.active_reservations
    assert exp.value("kvstore_build_info", version=stats.version) == 1
    assert exp.value("kvstore_uptime_seconds") >= stats.uptime_s  # scraped after Stats
    assert exp.types["kvstore_tier_hits_total"] == "counter"
    assert exp.types["kvstore_tier_used_bytes"] == "gauge"
    assert exp.types["kvstore_rpc_duration_seconds"] == "histogram"


def test_rpc_histogram_counts_calls_and_errors(
    metrics_daemon: MetricsDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTORE_PRESENCE_TABLES", "0")  # every lookup is a call to count
    with client(metrics_daemon) as kv, client(metrics_daemon, transport="grpc") as kv_bytes:
        keys = kv.hash_tokens(tokens(3, offset=2000))
        before = metrics_daemon.scrape()
        for _ in range(3):
            kv.lookup(keys)
        with grpc.insecure_channel(metrics_daemon.address) as channel:
            stub = pb_grpc.KVStoreStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.Lookup(pb.LookupRequest(handle=b"\7" * 16, keys=b"\0" * 32), timeout=10)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert kv_bytes.put(keys, random_blocks(SMALL_LAYOUT, 3, seed=4)) == 3  # PutBlocks
        assert kv_bytes.get(keys).shape[0] == 3  # GetBlocks, a response stream
        after = metrics_daemon.scrape()

    assert rpc_count(after, "Lookup") - rpc_count(before, "Lookup") == 4
    assert rpc_count(after, "PutBlocks") - rpc_count(before, "PutBlocks") == 1
    assert rpc_count(after, "GetBlocks") - rpc_count(before, "GetBlocks") == 1
    errors = "kvstore_rpc_errors_total"
    assert (
        after.value(errors, method="Lookup", code="NOT_FOUND")
        - before.series(errors).get(frozenset({("method", "Lookup"), ("code", "NOT_FOUND")}), 0)
        == 1
    )
    lookup_sum = "kvstore_rpc_duration_seconds_sum"
    assert after.value(lookup_sum, method="Lookup") > before.value(lookup_sum, method="Lookup")
    for method in ("Lookup", "GetBlocks", "PutBlocks"):
        buckets = {
            dict(labels)["le"]: v
            for labels, v in after.series("kvstore_rpc_duration_seconds_bucket").items()
            if dict(labels)["method"] == method
        }
        ordered = [buckets[le] for le in sorted(buckets, key=float)]
        assert ordered == sorted(ordered), "buckets are cumulative"
        assert buckets["+Inf"] == rpc_count(after, method)
    # Health checks (and reflection) are not KVStore calls: no series of their own.
    methods = {dict(lb)["method"] for lb in after.series("kvstore_rpc_duration_seconds_count")}
    assert "Check" not in methods and "Lookup" in methods and "Stats" in methods


def test_a_cancelled_stream_is_timed_and_gives_its_lease_back(
    metrics_daemon: MetricsDaemon,
) -> None:
    # The interceptor wraps GetBlocks' generator: closing it early must still run the
    # handler's own cleanup (the release of its read lease).
    with client(metrics_daemon) as kv:
        keys = kv.hash_tokens(tokens(512, offset=4000))
        assert kv.put(keys, random_blocks(SMALL_LAYOUT, 512, seed=6)) == 512
        before = metrics_daemon.scrape()
        with kv_channel(kv) as channel:
            stream = pb_grpc.KVStoreStub(channel).GetBlocks(
                pb.GetBlocksRequest(handle=kv._handle, keys=b"".join(keys)), timeout=30
            )
            next(stream)
            stream.cancel()
        deadline = time.monotonic() + 10
        while kv.stats().active_leases and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kv.stats().active_leases == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = metrics_daemon.scrape()
        if rpc_count(after, "GetBlocks") > rpc_count(before, "GetBlocks"):
            break
        time.sleep(0.05)
    assert rpc_count(after, "GetBlocks") - rpc_count(before, "GetBlocks") == 1

    # 4 MiB cannot all be in flight when the client cancels after the first block.
    def cancelled(scrape: Exposition) -> float:
        labels = frozenset({"method": "GetBlocks", "code": "CANCELLED"}.items())
        return scrape.samples.get(("kvstore_rpc_errors_total", labels), 0.0)

    assert cancelled(after) - cancelled(before) == 1
    assert metrics_daemon.process.alive()


def test_healthz_unknown_paths_and_methods(metrics_daemon: MetricsDaemon) -> None:
    status, _, body = metrics_daemon.get("/healthz")
    assert (status, body) == (200, b"ok\n")
    assert metrics_daemon.get("/nope")[0] == 404
    assert metrics_daemon.get("/metricsx")[0] == 404
    assert metrics_daemon.get("/metrics?name[]=x")[0] == 200  # a query string is ignored
    status, headers, _ = metrics_daemon.get("/metrics", method="POST")
    assert status == 405 and headers["Allow"] == "GET, HEAD"
    status, headers, body = metrics_daemon.get("/metrics", method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0


def _raw(port: int, payload: bytes, timeout_s: float = 10.0) -> bytes:
    """Send ``payload`` on a fresh connection; whatever comes back until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        try:
            s.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server gave up on the request before it was all sent: fine
        return _read_all(s)


def _read_all(s: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := s.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def test_garbage_and_slow_requests_break_nothing(metrics_daemon: MetricsDaemon) -> None:
    port = metrics_daemon.port
    # Not HTTP at all (a TLS hello, random bytes), and malformed request lines: 400, closed.
    for garbage in (
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)) + b"\r\n\r\n",
        bytes((i * 7919) % 256 for i in range(4096)),
        b"GET\r\n\r\n",
        b"GET /metrics\r\n\r\n",
        b"GET metrics HTTP/1.1\r\n\r\n",
        b"G\xc3\xa9T /metrics HTTP/1.1\r\n\r\n",
    ):
        reply = _raw(port, garbage)
        assert reply.startswith(b"HTTP/1.1 400 "), reply[:80]
    # Too large: one endless line, or endless headers.
    assert _raw(port, b"GET /" + b"a" * 100_000).startswith(b"HTTP/1.1 400 ")
    many = b"GET /metrics HTTP/1.1\r\n" + b"X-Padding: yyyyyyyyyyyyyyyy\r\n" * 2000 + b"\r\n"
    assert _raw(port, many).startswith(b"HTTP/1.1 400 ")
    # Connections that say nothing and leave.
    for _ in range(5):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()

    # A slow client holding half a request does not hold up a scrape; the server drops it.
    slow = socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S + 10)
    slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
    started = time.monotonic()
    metrics_daemon.scrape()
    assert time.monotonic() - started < READ_TIMEOUT_S
    assert _read_all(slow).startswith(b"HTTP/1.1 408 ")
    assert time.monotonic() - started < READ_TIMEOUT_S + 5
    slow.close()

    # More idle connections than the endpoint serves at once: all are dropped, none lingers.
    idle = [
        socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S + 10)
        for _ in range(MAX_CONNECTIONS + 8)
    ]
    for s in idle:
        reply = _read_all(s)
        assert reply == b"" or reply.startswith(b"HTTP/1.1 408 ")
        s.close()

    # The endpoint, the daemon and gRPC all still serve; nothing was logged as a failure.
    assert metrics_daemon.get("/healthz")[0] == 200
    metrics_daemon.scrape()
    with client(metrics_daemon) as kv:
        keys = kv.hash_tokens(tokens(2, offset=3000))
        assert kv.put(keys, random_blocks(SMALL_LAYOUT, 2, seed=5)) == 2
        assert kv.lookup(keys) == 2
    assert metrics_daemon.process.alive()
    assert "metrics endpoint" not in metrics_daemon.process.logs()


def test_dashboard_is_valid_and_queries_only_exported_metrics(
    metrics_daemon: MetricsDaemon,
) -> None:
    text = (resources.files("kvstore.configs") / "grafana-dashboard.json").read_text()
    dash = json.loads(text)
    assert 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    titles = {p["title"] for p in panels}
    assert {
        "Tier occupancy (used / capacity)",
        "Hit rate per tier",
        "Evictions, promotions, demotions",
        "Checksum failures",
        "RPC latency p50 / p99",
        "Tier up",
    } <= titles

    exprs = [t["expr"] for p in panels for t in p["targets"]]
    exprs += [v["query"]["query"] for v in variables.values() if isinstance(v["query"], dict)]
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}"
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
        assert set(p["gridPos"]) == {"x", "y", "w", "h"}
    latency = next(p for p in panels if p["title"] == "RPC latency p50 / p99")
    assert all("histogram_quantile" in t["expr"] for t in latency["targets"])

    exported = metrics_daemon.scrape().types
    used = {name for expr in exprs for name in re.findall(r"kvstore_[a-z_]+", expr)}
    assert used
    for name in used:
        base = next((name[: -len(s)] for s in _HISTOGRAM_SUFFIXES if name.endswith(s)), None)
        assert name in exported or exported.get(base or "") == "histogram", name


# ---------------------------------------------------------------- start-up and config
def test_a_taken_port_or_a_bad_address_stops_the_daemon_with_a_clear_error(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    directory = Path(tmp_path_factory.mktemp("kvb", numbered=True))
    config = directory / "daemon.toml"
    config.write_text(config_toml())
    sock = directory / "kv.sock"

    def serve(metrics_address: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "kvstore", "serve", "--address", f"unix:{sock}"]
        command += ["--config", str(config), "--metrics-address", metrics_address]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        result = serve(address)
    assert result.returncode == 1, result.stderr
    assert f"could not serve metrics on {address}" in result.stderr
    assert "Traceback" not in result.stderr
    assert not sock.exists()

    result = serve("localhost")
    assert result.returncode == 2
    assert "metrics_address: address 'localhost' is not host:port" in result.stderr


def test_a_stalled_scraper_does_not_hold_up_a_stop(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    port = free_port()
    directory = Path(tmp_path_factory.mktemp("kvs", numbered=True))
    process = DaemonProcess(
        directory, config_toml(), extra_args=["--metrics-address", f"127.0.0.1:{port}"]
    ).start()
    assert f"metrics on http://127.0.0.1:{port}/metrics" in process.logs()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as stalled:
        stalled.sendall(b"GET /metrics HTTP/1.1\r\n")
        assert process.stop() == 0
        # Closed by the stop, not timed out: no 408 was ever sent to the stalled scraper.
        assert not _read_all(stalled).startswith(b"HTTP/1.1 408 ")
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_metrics_address_config() -> None:
    assert load_config(env={}).metrics_address == ""  # off unless asked for
    env = {"KVSTORE_METRICS_ADDRESS": "127.0.0.1:9464"}
    assert load_config(env=env).metrics_address == "127.0.0.1:9464"
    assert split_host_port("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert split_host_port("[::1]:9464") == ("::1", 9464)
    assert split_host_port(":9464") == ("", 9464)
    for bad in ("9464", "host:", "host:port", "::1:9464", "h:70000"):
        with pytest.raises(ValueError, match="metrics_address"):
            DaemonConfig(metrics_address=bad)


def test_with_tenants_metrics_are_served_only_to_an_operators_token(tmp_path: Path) -> None:
    """/metrics names every tenant's namespaces and shows the tiers' counters, which Stats
    shows only to operators. With a tenant policy it was served to anyone who could reach
    the port (any local user of 127.0.0.1): now only to an operator's bearer token."""
    import os

    ops, alice = "ops-" + "o" * 32, "alice-" + "a" * 32
    (tmp_path / "ops.token").write_text(ops)
    (tmp_path / "alice.token").write_text(alice)
    policy = f"""
[auth]
tokens = {{ ops = "file:{tmp_path / "ops.token"}", alice = "file:{tmp_path / "alice.token"}" }}

[[access]]
name = "operators"
uids = [{os.getuid()}]
tokens = ["ops"]
tenants = ["bob"]
role = "operator"

[[access]]
name = "alice"
tokens = ["alice"]
tenants = ["alice"]
"""
    port = free_port()
    directory = tmp_path / "d"
    directory.mkdir()
    process = DaemonProcess(
        directory,
        config_toml() + policy,
        extra_args=["--metrics-address", f"127.0.0.1:{port}"],
    ).start()
    try:
        d = MetricsDaemon(process, port)
        with KVStoreClient(d.address, layout=SMALL_LAYOUT, model="secret", tenant="bob") as kv:
            kv.put(kv.hash_tokens(tokens(2)), random_blocks(SMALL_LAYOUT, 2))

        def get(token: str | None) -> tuple[int, dict[str, str], bytes]:
            request = urllib.request.Request(d.url("/metrics"))
            if token is not None:
                request.add_header("Authorization", f"Bearer {token}")
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    return reply.status, dict(reply.headers), reply.read()
            except urllib.error.HTTPError as err:
                return err.code, dict(err.headers), err.read()

        for token in (None, alice, "wrong-" + "w" * 32, ""):
            status, headers, body = get(token)
            assert status == 401, token
            assert headers["WWW-Authenticate"].startswith("Bearer")
            assert b"secret" not in body and b"kvstore_tier" not in body
        status, _, body = get(ops)
        assert status == 200 and b"secret" in body and b"kvstore_tier_hits_total" in body
        assert d.get("/healthz")[0] == 200  # up or down only: open
    finally:
        process.stop()


def test_metrics_with_tenants_need_an_operator_token_in_the_policy() -> None:
    policy = AuthConfig(access=(AccessRule(name="a", uids=(1000,), tenants=("a",)),))
    with pytest.raises(ValueError, match='role = "operator"'):
        DaemonConfig(metrics_address="127.0.0.1:9464", auth=policy)
    assert DaemonConfig(auth=policy).metrics_address == ""  # no endpoint: nothing to guard


# ---------------------------------------------------------------- the format itself
def test_label_values_are_escaped_and_parse_back() -> None:
    assert escape_label_value('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
    tricky = 'model "x"\\y\n/tenant,{}=} 1'
    store = SimpleNamespace(
        tier_snapshots=lambda: [
            TierSnapshot(
                "cpu", 100, 40, 5, TierCounters(hits=3, misses=1), extra={"clean_bytes": 8.0}
            ),
            TierSnapshot("redis", 0, 0, 0, TierCounters(), up=False),
        ],
        namespaces=lambda: [
            SimpleNamespace(name=tricky, blocks=2, block_bytes=10, lookup_hits=7, lookup_misses=1),
            SimpleNamespace(name="plain", blocks=1, block_bytes=10, lookup_hits=0, lookup_misses=0),
        ],
        namespace_tier_bytes=lambda: {},
        active_leases=1,
        active_reservations=2,
    )
    rpc = RpcMetrics(["Lookup"])
    rpc.observe("Lookup", 0.001, grpc.StatusCode.OK)  # on a bound: counted in that bucket
    rpc.observe("Lookup", 20.0, grpc.StatusCode.NOT_FOUND)
    text = render_metrics(store, rpc, version='1.0"rc', uptime_s=12.5)  # type: ignore[arg-type]
    exp = parse_exposition(text)

    assert exp.value("kvstore_namespace_used_bytes", namespace=tricky) == 20
    assert exp.value("kvstore_namespace_lookup_hits_total", namespace=tricky) == 7
    assert exp.value("kvstore_build_info", version='1.0"rc') == 1
    assert exp.value("kvstore_tier_up", tier="redis") == 0
    assert exp.value("kvstore_tier_extra", tier="cpu", name="clean_bytes") == 8
    assert exp.value("kvstore_active_reservations") == 2
    assert exp.value("kvstore_uptime_seconds") == 12.5
    bucket = "kvstore_rpc_duration_seconds_bucket"
    assert exp.value(bucket, method="Lookup", le="0.0005") == 0
    assert exp.value(bucket, method="Lookup", le="0.001") == 1
    assert exp.value(bucket, method="Lookup", le="10.0") == 1
    assert exp.value(bucket, method="Lookup", le="+Inf") == 2
    assert exp.value("kvstore_rpc_errors_total", method="Lookup", code="NOT_FOUND") == 1

    # Before the store serves: the headers and the build info, and still a valid exposition.
    early = parse_exposition(render_metrics(None, RpcMetrics(), version="0", uptime_s=None))
    assert "kvstore_tier_used_bytes" in early.types
    assert early.value("kvstore_build_info", version="0") == 1
