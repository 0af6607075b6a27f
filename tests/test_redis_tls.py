"""The Redis shared tier over TLS (``rediss://``, through redis-py) against a real TLS-only
Redis server: two real daemons sharing blocks, a daemon that trusts another CA, a server
certificate for another host name, a TLS endpoint that never answers, and the RESP driver's
refusal of TLS.

Once per module ``openssl`` makes a private CA, a server certificate it signs for ``localhost``
(and 127.0.0.1), a certificate it signs for another host name, and a second, unrelated CA (EC
P-256 keys, valid for 2 days, with the extensions Python's strict X.509 checks want). Each test
starts its own server that listens only on a TLS port of 127.0.0.1, with no persistence, killed
at the end.

Which server: the one tests/redis_binary.py finds. Once per module it is started with
``--tls-port``; if it speaks TLS (the apt ``redis-server``, as CI installs it) every test uses
it directly (``--port 0 --tls-port N --tls-auth-clients no``). If it was built without TLS (the
dev extra's ``valkey-server``), each test starts it on a unix socket only and puts a
``TlsTerminator`` (tests/tls_terminator.py) in front: a real TLS endpoint, Python's ``ssl`` with
the same certificate, TLS 1.2 and 1.3 and no client certificate asked for, that relays each
connection to one connection of the server. Either way the client side (redis-py in the tier,
its certificate checks, its errors) is the real one, and the server sees one client per TLS
connection. Skipped with a message when no Redis server or ``openssl`` is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import redis as redis_py
import torch
from conftest import (
    SMALL_LAYOUT,
    RedisProcess,
    random_blocks,
    same_bytes,
    tiers,
    tokens,
    wait_for,
)
from redis_binary import NOT_INSTALLED, redis_server_binary
from tls_terminator import TlsTerminator

from kvstore import KVStoreClient
from kvstore.checksum import block_checksum
from kvstore.tiers.redis import HEADER_BYTES, RedisTier, RedisTierUnavailable

pytestmark = pytest.mark.redis

NS = bytes(range(16))

OPENSSL_CONFIG = """
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
[localhost]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
subjectAltName = DNS:localhost, IP:127.0.0.1
[elsewhere]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
subjectAltName = DNS:redis.elsewhere.invalid
"""


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA that signed both server certificates
    other_ca: Path  # an unrelated CA: trusts neither server
    localhost: tuple[Path, Path]  # (certificate, key) for localhost and 127.0.0.1
    elsewhere: tuple[Path, Path]  # (certificate, key) for redis.elsewhere.invalid, signed by ca


def _openssl(directory: Path, *args: str) -> None:
    out = subprocess.run(["openssl", *args], cwd=directory, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{out.stderr}")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (apt openssl)")
    d = tmp_path_factory.mktemp("pki")
    (d / "openssl.cnf").write_text(OPENSSL_CONFIG)
    new_key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    conf = ("-config", "openssl.cnf", "-days", "2")
    for name in ("ca", "other-ca"):
        subj, files = f"/CN=kvstore-test-{name}", ("-keyout", f"{name}.key", "-out", f"{name}.crt")
        _openssl(d, "req", "-x509", *new_key, *conf, "-extensions", "ca", "-subj", subj, *files)
    for name in ("localhost", "elsewhere"):
        files = ("-keyout", f"{name}.key", "-out", f"{name}.csr")
        _openssl(d, "req", *new_key, "-config", "openssl.cnf", "-subj", f"/CN={name}", *files)
        signer = ("-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2")
        ext = ("-extfile", "openssl.cnf", "-extensions", name)
        _openssl(d, "x509", "-req", "-in", f"{name}.csr", *signer, *ext, "-out", f"{name}.crt")
    return Pki(
        ca=d / "ca.crt",
        other_ca=d / "other-ca.crt",
        localhost=(d / "localhost.crt", d / "localhost.key"),
        elsewhere=(d / "elsewhere.crt", d / "elsewhere.key"),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NoTls(Exception):
    """The Redis server at hand was built without TLS."""


NO_TLS = ("Failed finding TLS support", "not supported", "Bad directive")
"""What a server built without TLS logs when given ``--tls-port`` (Valkey and Redis 7.2+, Redis
6 and 7.0)."""


class TlsRedis:
    """A Redis server that speaks only TLS, on a free TCP port of 127.0.0.1: the server itself
    when it is built with TLS (``native``), else a plain one on a unix socket of ``directory``
    (no TCP port) behind a ``TlsTerminator`` with the same certificate."""

    def __init__(self, directory: Path, cert: Path, key: Path, ca: Path, native: bool) -> None:
        self.dir, self.cert, self.key, self.ca = directory, cert, key, ca
        self.native = native
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None  # the native server
        self.plain: RedisProcess | None = None  # the server behind the terminator
        self.terminator: TlsTerminator | None = None

    def url(self, ca: Path | None = None, host: str = "localhost", **query: str) -> str:
        """``rediss://`` to this server, trusting ``ca`` (by default the CA that signed it)."""
        params = {"ssl_ca_certs": str(ca or self.ca), "ssl_cert_reqs": "required", **query}
        return f"rediss://{host}:{self.port}/0?{urlencode(params)}"

    def client(self, check_hostname: bool = True) -> Any:
        # Any: redis-py's annotations want str keys; this module reads bytes names.
        url = self.url(ssl_check_hostname=str(check_hostname).lower())
        return redis_py.Redis.from_url(url, socket_timeout=2, protocol=2)

    def start(self) -> TlsRedis:
        if self.native:
            return self._start_native()
        self.plain = RedisProcess(self.dir).start()
        self.terminator = TlsTerminator(self.cert, self.key, self.plain.socket_path).start()
        self.port = self.terminator.port
        if not self._answers(None):
            raise RuntimeError("no PING answer over TLS through the terminator")
        return self

    def _answers(self, proc: subprocess.Popen[bytes] | None) -> bool:
        """Whether it answers PING over TLS within 10 s (any host name: some certificates are
        for others), or before ``proc`` exits."""
        deadline = time.monotonic() + 10
        with contextlib.closing(self.client(check_hostname=False)) as c:
            while True:
                with contextlib.suppress(redis_py.ConnectionError, redis_py.TimeoutError):
                    if c.ping():
                        return True
                if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
                    return False
                time.sleep(0.02)

    def _start_native(self) -> TlsRedis:
        binary = redis_server_binary()
        assert binary is not None
        for _ in range(3):  # another process may take the free port before redis-server binds it
            self.port = _free_port()
            log = self.dir / "redis.log"
            with open(log, "wb") as out:
                proc = self.proc = subprocess.Popen(
                    [
                        *(binary, "--port", "0", "--bind", "127.0.0.1"),
                        *("--tls-port", str(self.port), "--tls-auth-clients", "no"),
                        *("--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key)),
                        *("--tls-ca-cert-file", str(self.ca)),
                        *("--save", "", "--appendonly", "no", "--dir", str(self.dir)),
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            if self._answers(proc):
                return self
            self.stop()
            text = log.read_text(errors="replace")
            if "Address already in use" in text:
                continue
            if "tls" in text.lower() and any(m in text for m in NO_TLS):
                raise NoTls(text.strip().splitlines()[-1])
            raise RuntimeError(f"redis-server with TLS did not start:\n{text[-2000:]}")
        raise RuntimeError("no free port for redis-server")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.terminator is not None:
            self.terminator.stop()
        if self.plain is not None:
            self.plain.stop()


@pytest.fixture(scope="module")
def native_tls(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> bool:
    """Whether the Redis server at hand speaks TLS itself (one start with TLS tells)."""
    if redis_server_binary() is None:
        pytest.skip(NOT_INSTALLED)
    probe = TlsRedis(tmp_path_factory.mktemp("tlsprobe"), *pki.localhost, pki.ca, native=True)
    try:
        probe.start()
    except NoTls:
        return False
    finally:
        probe.stop()
    return True


@pytest.fixture
def tls_server_factory(
    pki: Pki, native_tls: bool, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[tuple[Path, Path]], TlsRedis]]:
    started: list[TlsRedis] = []

    def start(cert_key: tuple[Path, Path]) -> TlsRedis:
        directory = tmp_path_factory.mktemp("tlsredis")
        server = TlsRedis(directory, *cert_key, pki.ca, native=native_tls)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def tls_redis(tls_server_factory, pki: Pki) -> TlsRedis:
    """A TLS-only Redis server whose certificate (for localhost) the test CA signed."""
    return tls_server_factory(pki.localhost)


def client(daemon) -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="test-model")


def raw(blocks: torch.Tensor) -> list[bytes]:
    return [b.contiguous().view(torch.uint8).numpy().tobytes() for b in blocks]


# ---------------------------------------------------------------------------- daemons
def test_two_daemons_share_blocks_over_tls(daemon_factory, tls_redis: TlsRedis) -> None:
    # The port speaks only TLS: a plain-text client gets nowhere.
    with pytest.raises(redis_py.ConnectionError):
        redis_py.Redis(host="127.0.0.1", port=tls_redis.port, socket_timeout=2).ping()
    a = daemon_factory(redis_url=tls_redis.url())
    b = daemon_factory(redis_url=tls_redis.url())
    blocks = random_blocks(SMALL_LAYOUT, 8, seed=31)
    with client(a) as kv_a, client(b) as kv_b:
        # Up over TLS (wait: a first handshake slower than the 0.5 s deadline is retried).
        wait_for(lambda: tiers(kv_a)["redis"].up and tiers(kv_b)["redis"].up, 10, "tiers up")
        keys = kv_a.hash_tokens(tokens(8))
        assert kv_a.put(keys, blocks) == 8
        wait_for(lambda: tiers(kv_a)["redis"].demotions >= 8, 10, "write-through over TLS")
        assert kv_b.lookup(keys) == 8  # b has none of them locally: found in Redis
        assert tiers(kv_b)["cpu"].blocks == 0
        assert same_bytes(kv_b.get(keys), blocks)
        stats = tiers(kv_b)["redis"]
        assert stats.up and stats.promotions == 8 and stats.checksum_failures == 0
        fp = kv_a.namespace.fingerprint.hex()
    # Redis really holds them: header + the raw block under each key's name, nothing else.
    with contextlib.closing(tls_redis.client()) as r:
        assert r.dbsize() == 8
        for k, data in zip(keys, raw(blocks), strict=True):
            value = r.get(f"kvs:{fp}:{k.hex()}")
            assert value is not None and len(value) == HEADER_BYTES + len(data)
            assert value[HEADER_BYTES:] == data


def test_a_daemon_trusting_another_ca_never_uses_that_redis(
    daemon_factory, tls_redis: TlsRedis, pki: Pki
) -> None:
    a = daemon_factory(redis_url=tls_redis.url())
    c = daemon_factory(redis_url=tls_redis.url(ca=pki.other_ca))
    blocks = random_blocks(SMALL_LAYOUT, 4, seed=32)
    with client(a) as kv_a, client(c) as kv_c:
        keys = kv_a.hash_tokens(tokens(4))
        kv_a.put(keys, blocks)
        wait_for(lambda: tiers(kv_a)["redis"].demotions >= 4, 10, "write-through over TLS")
        # c's handshakes fail verification: its tier is down from the start, every call
        # returns at once, and c serves from its own tiers.
        assert not tiers(kv_c)["redis"].up
        t0 = time.monotonic()
        assert kv_c.lookup(keys) == 0  # in that Redis, but never a hit through an untrusted link
        assert kv_c.get(keys).shape[0] == 0
        local = kv_c.hash_tokens(tokens(3, offset=4000))
        local_blocks = random_blocks(SMALL_LAYOUT, 3, seed=33)
        assert kv_c.put(local, local_blocks) == 3
        assert kv_c.lookup(local) == 3 and same_bytes(kv_c.get(local), local_blocks)
        assert time.monotonic() - t0 < 10.0  # no call waits on the unusable Redis
        time.sleep(1.0)  # the tier retries (50 ms, 100 ms, ... apart): every handshake fails
        stats = tiers(kv_c)["redis"]
        assert not stats.up and stats.promotions == 0 and stats.demotions == 0
        assert kv_c.lookup(keys) == 0
    with contextlib.closing(tls_redis.client()) as r:
        assert r.dbsize() == 4  # a's blocks only: nothing of c's reached Redis
    assert "CERTIFICATE_VERIFY_FAILED" in c.logs()


# ---------------------------------------------------------------------------- the tier
async def _down_and_fast(url: str) -> None:
    """A tier on ``url`` starts within its deadline, stays down, and fails calls at once."""
    tier = RedisTier(url, timeout_s=0.5)
    t0 = time.monotonic()
    await tier.start()
    try:
        assert time.monotonic() - t0 < 5.0  # bounded by the deadline, not hung
        assert not tier.up and tier.driver == "redis-py"
        await asyncio.sleep(0.4)  # a few reconnection attempts
        assert not tier.up
        t0 = time.monotonic()
        with pytest.raises(RedisTierUnavailable):
            await tier.contains(NS, [bytes(32)])
        assert time.monotonic() - t0 < 5.0  # refused, not hung
    finally:
        t0 = time.monotonic()
        await tier.close()
        assert time.monotonic() - t0 < 5.0


async def test_a_certificate_for_another_host_name_is_refused(tls_server_factory, pki) -> None:
    # Signed by the trusted CA, but for redis.elsewhere.invalid: the name check refuses it
    # (redis-py 5 skips that check unless asked; the driver asks).
    server = tls_server_factory(pki.elsewhere)
    await _down_and_fast(server.url())
    await _down_and_fast(server.url(host="127.0.0.1"))
    await _down_and_fast(server.url(ca=pki.other_ca))


@pytest.mark.parametrize(
    ("query", "trusted"),
    [({"ssl_check_hostname": "false"}, True), ({"ssl_cert_reqs": "none"}, False)],
    ids=["no-name-check", "no-verification"],
)
async def test_a_url_may_turn_verification_down(tls_server_factory, pki, query, trusted) -> None:
    # The same server, accepted when the URL says so explicitly: the refusal above was the
    # name check (or the chain), nothing else, and an explicit opt-out is not overridden.
    server = tls_server_factory(pki.elsewhere)
    tier = RedisTier(server.url(ca=pki.ca if trusted else pki.other_ca, **query), timeout_s=5.0)
    await tier.start()
    try:
        assert tier.up
        data = bytes(range(256)) * 64
        assert await tier.put(NS, [(bytes(32), data, block_checksum(data, NS, bytes(32)))]) == 1
    finally:
        await tier.close()


async def test_tier_round_trip_and_close_over_tls(tls_redis: TlsRedis) -> None:
    sizes = [1, 4096 + 7, 2 << 20]
    blocks = [(bytes([i]) * 32, bytes([i + 1]) * n) for i, n in enumerate(sizes)]
    with contextlib.closing(tls_redis.client()) as r:
        tier = RedisTier(tls_redis.url(), timeout_s=2.0)
        await tier.start()
        try:
            assert tier.up and tier.driver == "redis-py"
            entries = [(k, d, block_checksum(d, NS, k)) for k, d in blocks]
            assert await tier.put(NS, entries) == 3
            outs = [bytearray(n) for n in sizes]
            items = [(k, c, memoryview(o)) for (k, _, c), o in zip(entries, outs, strict=True)]
            assert await tier.get_into(NS, items) == [True] * 3
            assert [bytes(o) for o in outs] == [d for _, d in blocks]
            assert r.info("clients")["connected_clients"] > 1
        finally:
            await tier.close()
        # close() drops the tier's TLS connections (not left to the garbage collector).
        wait_for(lambda: r.info("clients")["connected_clients"] == 1, what="connections closed")
        del tier


async def test_a_tls_endpoint_that_never_answers_does_not_hang(pki) -> None:
    # TCP connects (the kernel accepts into the backlog) but no TLS handshake ever comes back.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        await _down_and_fast(f"rediss://localhost:{port}/0?ssl_ca_certs={pki.ca}")


def test_the_resp_driver_refuses_tls() -> None:
    # The daemon's config has no driver setting: "auto" always takes redis-py for rediss://.
    with pytest.raises(ValueError, match="does not speak TLS"):
        RedisTier("rediss://localhost:6379/0", driver="resp")
    assert RedisTier("rediss://localhost:6379/0").driver == "redis-py"
