"""Who may call, and what they reach: real daemons, real processes under other uids (dropped
with ``setpriv``), real TLS certificates made at test time.

docs/security.md states the promises these tests check: a tenant cannot open, look up, read,
write, delete or see another tenant's namespace by any RPC (through the client and raw stubs),
cannot map its memory, and cannot poison its keys; a shared namespace serves its readers and
refuses non-writers; TCP without credentials is refused; a squatted socket directory is
refused; a slab descriptor cannot be used to truncate the daemon's memory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from conftest import DaemonProcess, config_toml, random_blocks, same_bytes, tokens

from kvstore import KVLayout, KVStoreClient
from kvstore.client.session import ClientSession
from kvstore.errors import PermissionDeniedError, UnauthenticatedError, UnavailableError
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float16)
ALICE, BOB, OPS, MALLORY = 2001, 2002, 2003, 2004

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to run clients under other uids (CI runs as root)",
)


def access(name: str, uid: int, tenant: str, role: str = "") -> str:
    """One ``[[access]]`` entry of a daemon policy: ``uid`` may open ``tenant``."""
    entry = f'[[access]]\nname = "{name}"\nuids = [{uid}]\ntenants = ["{tenant}"]\n'
    return entry + (f'role = "{role}"\n' if role else "") + "\n"


TEST_RUNNER = access("test-runner", 0, "root", role="operator")
"""The uid running the tests (root) is an operator, of a tenant of its own."""

POLICY = (
    access("alice-app", ALICE, "alice")
    + access("bob-app", BOB, "bob")
    + access("ops", OPS, "ops", role="operator")
    + TEST_RUNNER
    + """[shared.prompts]
readers = ["alice", "bob"]
writers = ["ops"]
"""
)


def policy_daemon_address(open_daemon_factory: Callable[..., DaemonProcess], policy: str) -> str:
    """The address of a daemon (32 MiB CPU tier) under ``policy`` that other uids can reach."""
    return open_daemon_factory(cpu_capacity="32MiB", extra=policy).address


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory other uids can traverse (pytest's tmp dirs are owner-only)."""
    base = Path(tempfile.mkdtemp(prefix="kvsec-", dir="/tmp"))
    base.chmod(0o711)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def policy_daemon(open_daemon_factory: Callable[..., DaemonProcess]) -> DaemonProcess:
    return open_daemon_factory(cpu_capacity="32MiB", extra=POLICY)


def run_as(uid: int, address: str, body: str) -> dict:
    """Run ``body`` as ``uid`` (and gid ``uid``, no other groups) in a fresh interpreter; it
    ends by printing one JSON line, which is returned."""
    args, env = _as_uid(uid, address, body)
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, cwd="/tmp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


class RunningAs:
    """``body`` running as another uid (``start_as``): ``result`` is the first JSON line it
    printed; it runs on (holding what it holds) until ``finish`` closes its stdin."""

    def __init__(self, uid: int, address: str, body: str) -> None:
        args, env = _as_uid(uid, address, body)
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env, cwd="/tmp",
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.finish()
            raise AssertionError(f"the client under uid {uid} failed: {self.stderr[-3000:]}")
        self.result: dict = json.loads(line)

    def finish(self) -> None:
        """Close its stdin (the body's ``sys.stdin.read()`` returns) and wait for it."""
        _, self.stderr = self.proc.communicate(timeout=120)


def start_as(uid: int, address: str, body: str) -> RunningAs:
    return RunningAs(uid, address, body)


def _as_uid(uid: int, address: str, body: str) -> tuple[list[str], dict[str, str]]:
    code = textwrap.dedent(
        """
        import json, mmap, os, sys, torch
        from kvstore import KVLayout, KVStoreClient
        from kvstore.errors import KVStoreError, PermissionDeniedError, UnauthenticatedError
        ADDRESS = sys.argv[1]
        LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16,
                          dtype=torch.float16)
        def blocks(n, seed):
            g = torch.Generator().manual_seed(seed)
            return torch.randn(n, *LAYOUT.block_shape, generator=g).to(torch.float16)
        def error(fn):
            try:
                fn()
            except Exception as e:
                return type(e).__name__
            return None
        """
    ) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
    args = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            sys.executable, "-c", code, address]  # fmt: skip
    return args, env


# ----------------------------------------------------------------- unix: tenants apart


@needs_root
def test_a_tenant_reaches_nothing_of_another_tenant(policy_daemon: DaemonProcess) -> None:
    """alice stores blocks; bob, another uid, cannot open alice's tenant (client or raw stub,
    with or without his own session), cannot use her handle, does not see her namespace in
    Stats, and cannot map her memory: the slab his session asks for is refused, and no file
    under /dev/shm names the arena. Poisoning: bob cannot put under alice's keys at all."""
    address = policy_daemon.address
    alice = run_as(
        ALICE,
        address,
        """
        kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="alice")
        keys = kv.hash_tokens(list(range(64)))
        stored = kv.put(keys, blocks(4, 1))
        got = kv.get(keys)
        slab = next(iter(kv._arena._slabs))
        print(json.dumps({"shm": kv.uses_shared_memory, "stored": int(stored),
                          "same": bool(torch.equal(got, blocks(4, 1))), "slab": slab,
                          "keys": [k.hex() for k in keys], "handle": kv._handle.hex(),
                          "bob": error(lambda: KVStoreClient(ADDRESS, layout=LAYOUT,
                                                             model="m", tenant="bob"))}))
        kv.close()
        """,
    )
    assert alice["shm"] and alice["stored"] == 4 and alice["same"], alice
    assert alice["bob"] == "PermissionDeniedError", alice
    bob = run_as(
        BOB,
        address,
        f"""
        import grpc
        from kvstore.client.session import ClientSession
        from kvstore.v1 import kvstore_pb2 as pb, kvstore_pb2_grpc as pb_grpc
        out = {{}}
        out["open_alice"] = error(lambda: KVStoreClient(ADDRESS, layout=LAYOUT, model="m",
                                                        tenant="alice"))
        kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="bob")
        keys = [bytes.fromhex(k) for k in {alice["keys"]!r}]
        out["bob_sees"] = kv.lookup(keys)  # his namespace: alice's keys mean nothing there
        kv.put(keys, blocks(4, 666))
        out["stats"] = sorted(n.name for n in kv.stats().namespaces)
        session = ClientSession(ADDRESS[len("unix:"):], 5.0)
        out["map_alice"] = error(lambda: session.slab({alice["slab"]}))
        handle = bytes.fromhex({alice["handle"]!r})
        path = ADDRESS
        with grpc.insecure_channel(path) as ch:
            stub = pb_grpc.KVStoreStub(ch)
            for name, md in (("no_session", ()), ("own_session", session.metadata())):
                try:
                    stub.Lookup(pb.LookupRequest(handle=handle, keys=keys[0]), metadata=md,
                                timeout=5)
                    out[name] = "OK"
                except grpc.RpcError as e:
                    out[name] = e.code().name
        print(json.dumps(out))
        """,
    )
    assert bob["open_alice"] == "PermissionDeniedError", bob
    assert bob["bob_sees"] == 0, bob
    assert all("alice" not in name for name in bob["stats"]) and bob["stats"], bob
    assert bob["map_alice"] == "SlabUnavailable", bob
    assert bob["no_session"] == "UNAUTHENTICATED", bob
    assert bob["own_session"] == "NOT_FOUND", bob  # her handle is hers alone
    assert policy_daemon.proc is not None  # no name of this daemon's memory to open, anywhere
    assert not [n for n in os.listdir("/dev/shm") if f"-{policy_daemon.proc.pid}-" in n]
    # alice's blocks are untouched by everything bob did.
    again = run_as(
        ALICE,
        address,
        f"""
        kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="alice")
        keys = [bytes.fromhex(k) for k in {alice["keys"]!r}]
        print(json.dumps({{"same": bool(torch.equal(kv.get(keys), blocks(4, 1)))}}))
        """,
    )
    assert again["same"], again
    # The operator sees every namespace; a uid outside the policy is refused at the session.
    with KVStoreClient(address, layout=LAYOUT, model="m", tenant="root") as kv:
        names = [n.name for n in kv.stats().namespaces]
        assert any("alice" in n for n in names) and any("bob" in n for n in names), names
    stranger = run_as(
        MALLORY,
        address,
        """
        print(json.dumps({"open": error(lambda: KVStoreClient(ADDRESS, layout=LAYOUT,
                                                                model="m", tenant="alice"))}))
        """,
    )
    assert stranger["open"] == "PermissionDeniedError", stranger
    assert policy_daemon.alive()


@needs_root
def test_a_shared_namespace_serves_readers_and_refuses_non_writers(
    policy_daemon: DaemonProcess,
) -> None:
    """ops writes the shared system prompt; alice and bob read it; alice's put and delete are
    refused; the slab alice is handed is read-only (mapping it writable fails)."""
    address = policy_daemon.address
    written = run_as(
        OPS,
        address,
        """
        kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="prompts")
        keys = kv.hash_tokens(list(range(48)))
        print(json.dumps({"stored": int(kv.put(keys, blocks(3, 7)))}))
        """,
    )
    assert written["stored"] == 3
    for uid in (ALICE, BOB):
        reader = run_as(
            uid,
            address,
            """
            kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="prompts")
            keys = kv.hash_tokens(list(range(48)))
            got = kv.get(keys)
            uid = next(iter(kv._arena._slabs))
            fd, size, writable = kv._session.slab(uid)
            try:
                mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
                rw = "mapped"
            except OSError as e:
                rw = e.errno
            os.close(fd)
            print(json.dumps({
                "same": bool(torch.equal(got, blocks(3, 7))),
                "put": error(lambda: kv.put(kv.hash_tokens(list(range(64))), blocks(4, 8))),
                "delete": error(lambda: kv.delete(keys)),
                "writable": writable, "rw": rw, "still": kv.lookup(keys)}))
            """,
        )
        assert reader["same"], reader
        assert reader["put"] == "PermissionDeniedError", reader
        assert reader["delete"] == "PermissionDeniedError", reader
        assert reader["writable"] is False and reader["rw"] == 13, reader  # EACCES
        assert reader["still"] == 3, reader


@needs_root
def test_a_slab_descriptor_cannot_shrink_the_daemons_memory(
    policy_daemon: DaemonProcess,
) -> None:
    """A writer's slab descriptor is sealed: truncating it (which would SIGBUS the daemon at its
    next touch) fails, and the daemon keeps serving the blocks in it."""
    out = run_as(
        ALICE,
        address := policy_daemon.address,
        """
        kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="alice")
        keys = kv.hash_tokens(list(range(32)))
        kv.put(keys, blocks(2, 3))
        fd, size, writable = kv._session.slab(next(iter(kv._arena._slabs)))
        try:
            os.ftruncate(fd, 0)
            r = "truncated"
        except OSError as e:
            r = e.errno
        print(json.dumps({"writable": writable, "truncate": r,
                          "same": bool(torch.equal(kv.get(keys), blocks(2, 3)))}))
        """,
    )
    assert out["writable"] is True and out["truncate"] == 1, out  # EPERM: sealed
    assert out["same"] and policy_daemon.alive(), out
    assert address


# ----------------------------------------------------------------- single-user daemons


def test_a_single_user_daemon_refuses_other_users(daemon: DaemonProcess) -> None:
    """Without a policy the socket and its directory are the owner's alone."""
    directory = daemon.socket_path.parent
    assert directory.stat().st_mode & 0o777 == 0o700
    assert daemon.socket_path.stat().st_mode & 0o777 == 0o600
    if os.geteuid() == 0 and shutil.which("setpriv"):
        out = run_as(
            MALLORY,
            daemon.address,
            """
            print(json.dumps({"open": error(lambda: KVStoreClient(ADDRESS, layout=LAYOUT,
                                                                    model="m", timeout_s=2))}))
            """,
        )
        assert out["open"] in ("UnavailableError", "PermissionError"), out


@needs_root
def test_a_squatted_socket_directory_is_refused(tmp_path: Path) -> None:
    """A directory another user made (who would then receive this daemon's clients), or one
    others can write, is refused with a message naming it; nothing is started."""
    squatted = tmp_path / "squat"
    squatted.mkdir()
    os.chown(squatted, MALLORY, MALLORY)
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    for directory, words in ((squatted, "belongs to uid 2004"), (loose, "writable by others")):
        proc = subprocess.run(
            [sys.executable, "-m", "kvstore", "serve", "--address", f"unix:{directory}/kv.sock"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode != 0 and words in proc.stderr, proc.stderr[-2000:]
        assert not (directory / "kv.sock").exists()


# ----------------------------------------------------------------- TCP


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_certs(directory: Path) -> None:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    (directory / "san.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, cn in (("server", "localhost"), ("client", "alice-client")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr")  # fmt: skip
        extra = ["-extfile", "san.cnf"] if name == "server" else []
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "1", "-out", f"{name}.pem", *extra)  # fmt: skip


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    directory = tmp_path / "certs"
    directory.mkdir()
    _make_certs(directory)
    return directory


def _tcp_daemon(tmp_path: Path, extra: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    address = f"127.0.0.1:{port}"
    config = tmp_path / "tcp.toml"
    config.write_text(config_toml(cpu_capacity="16MiB", extra=extra))
    log = open(tmp_path / "tcp.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--address", address, "--config", str(config)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
    )  # fmt: skip
    return proc, address


def _wait_port(proc: subprocess.Popen, port: int) -> None:
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, "daemon exited"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError("daemon did not listen")


def test_tcp_with_tls_needs_a_valid_token_or_certificate(tmp_path: Path, certs: Path) -> None:
    """Over TLS: no token, a wrong token and an unknown certificate get UNAUTHENTICATED
    (raw stubs too) and touch nothing; the right token, or the client certificate named in the
    policy, works and reaches only its tenant."""
    token = "t0ken-" + "x" * 32
    extra = f"""
[auth]
tls_cert = "{certs / "server.pem"}"
tls_key = "{certs / "server.key"}"
tls_client_ca = "{certs / "ca.pem"}"
tokens = {{ alice = "env:KVS_TEST_ALICE_TOKEN" }}

[[access]]
name = "alice by token"
tokens = ["alice"]
tenants = ["alice"]

[[access]]
name = "alice by certificate"
cert_names = ["alice-client"]
tenants = ["alice"]
"""
    proc, address = _tcp_daemon(tmp_path, extra, {"KVS_TEST_ALICE_TOKEN": token})
    try:
        _wait_port(proc, int(address.rsplit(":", 1)[1]))
        ca = str(certs / "ca.pem")
        cert, key = str(certs / "client.pem"), str(certs / "client.key")
        common = dict(layout=LAYOUT, model="m", tenant="alice", tls_ca=ca, timeout_s=10)
        # The daemon requires a client certificate: without one no connection is made, so
        # even the right token reaches nothing.
        for bearer in ("", token):
            with pytest.raises(UnavailableError):
                KVStoreClient(address, **{**common, "timeout_s": 3}, token=bearer)  # type: ignore[arg-type]
        with KVStoreClient(address, **common, tls_cert=cert, tls_key=key, token="") as kv:
            keys = kv.hash_tokens(tokens(2))
            blocks = random_blocks(LAYOUT, 2, seed=5)
            assert kv.put(keys, blocks) == 2
            assert same_bytes(kv.get(keys), blocks)
            assert not kv.uses_shared_memory  # TCP: the bytes path
            with pytest.raises(PermissionDeniedError):
                KVStoreClient(address, **{**common, "tenant": "bob"}, tls_cert=cert, tls_key=key)
        with KVStoreClient(address, **common, tls_cert=cert, tls_key=key, token=token) as kv:
            assert kv.lookup(kv.hash_tokens(tokens(2))) == 2
        # A raw stub with the client certificate sees only its tenant's namespaces.
        creds = grpc.ssl_channel_credentials(
            (certs / "ca.pem").read_bytes(),
            (certs / "client.key").read_bytes(),
            (certs / "client.pem").read_bytes(),
        )
        with grpc.secure_channel(address, creds) as ch:
            reply = pb_grpc.KVStoreStub(ch).Stats(pb.StatsRequest(), timeout=10)
            assert all("alice" in n.name for n in reply.namespaces)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_tcp_bearer_tokens_are_checked(tmp_path: Path, certs: Path) -> None:
    """TLS without client certificates: a call without a token, or with a wrong one, is
    UNAUTHENTICATED; the right token opens its tenant."""
    token = "s3cret-" + "z" * 32
    (tmp_path / "alice.token").write_text(token + "\n")
    extra = f"""
[auth]
tls_cert = "{certs / "server.pem"}"
tls_key = "{certs / "server.key"}"
tokens = {{ alice = "file:{tmp_path / "alice.token"}" }}

[[access]]
tokens = ["alice"]
tenants = ["alice"]
"""
    proc, address = _tcp_daemon(tmp_path, extra, {})
    try:
        _wait_port(proc, int(address.rsplit(":", 1)[1]))
        ca = str(certs / "ca.pem")
        common = dict(layout=LAYOUT, model="m", tenant="alice", tls_ca=ca, timeout_s=10)
        for bad in ("", "wrong-" + "y" * 32):
            with pytest.raises(UnauthenticatedError):
                KVStoreClient(address, **common, token=bad)  # type: ignore[arg-type]
        creds = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
        with grpc.secure_channel(address, creds) as ch:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.KVStoreStub(ch).Stats(pb.StatsRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with KVStoreClient(address, **common, token=token) as kv:  # type: ignore[arg-type]
            keys = kv.hash_tokens(tokens(1))
            assert kv.put(keys, random_blocks(LAYOUT, 1)) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_a_public_bind_without_protection_refuses_to_start(tmp_path: Path) -> None:
    """0.0.0.0 without TLS and credentials: refused with a message; with --insecure it starts
    and says so in its log."""
    port = _free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--address", f"0.0.0.0:{port}",
         "--cpu-capacity", "16MiB"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0 and "refusing to serve" in proc.stderr, proc.stderr[-2000:]
    log = open(tmp_path / "insecure.log", "ab")  # noqa: SIM115
    daemon = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--address", f"0.0.0.0:{port}",
         "--cpu-capacity", "16MiB", "--insecure", "--log-level", "WARNING"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        _wait_port(daemon, port)
        assert "WITHOUT TLS or credentials" in (tmp_path / "insecure.log").read_text()
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)


def test_session_socket_is_required_with_a_policy(policy_daemon: DaemonProcess) -> None:
    """With a policy, a unix caller without a session is UNAUTHENTICATED for every RPC,
    OpenNamespace included, and nothing is created by its calls."""
    with grpc.insecure_channel(policy_daemon.address) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Stats(pb.StatsRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        request = pb.OpenNamespaceRequest(
            model="m",
            tenant="root",
            layout=pb.Layout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16,
                             dtype="float16"),
        )  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            next(stub.OpenNamespace(request, timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    if os.geteuid() != 0:
        return  # the policy below lets uid 0 in; other users' sessions are refused
    session = ClientSession(str(policy_daemon.socket_path), 5.0)
    try:
        with grpc.insecure_channel(policy_daemon.address) as ch:
            reply = pb_grpc.KVStoreStub(ch).Stats(
                pb.StatsRequest(), metadata=session.metadata(), timeout=5
            )
            assert reply.open_handles == 0
    finally:
        session.close()


# ----------------------------------------------------------------- connections


def test_connections_are_capped_and_idle_ones_closed(daemon_factory) -> None:
    """Idle connections cannot pile up: past ``connections.max_connections`` a new peer is
    refused at accept, and connections idle for ``idle_timeout_s`` are closed, after which
    legitimate clients connect again (idle peers used to cost memory that never came back,
    and filling the descriptor limit starved everyone)."""
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    d = daemon_factory(extra="\n[connections]\nmax_connections = 4\nidle_timeout_s = 2.0\n")

    def check(channel: grpc.Channel) -> bool:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    # Each channel its own connection (channels in one process share them by default).
    own = [("grpc.use_local_subchannel_pool", 1)]
    idle = [grpc.insecure_channel(d.address, options=own) for _ in range(4)]
    try:
        assert all(check(ch) for ch in idle)  # four connections, the cap: then they sit idle
        extra = grpc.insecure_channel(d.address, options=own)
        assert not check(extra)  # a fifth peer is refused
        extra.close()
        # Idle past the timeout, the four are closed by the daemon (they never closed
        # themselves), and a new client gets in.
        deadline = time.monotonic() + 30
        ok = False
        while not ok and time.monotonic() < deadline:
            fresh = grpc.insecure_channel(d.address, options=own)
            ok = check(fresh)
            fresh.close()
            if not ok:
                time.sleep(0.5)
        assert ok, "a new client never got in after the idle connections timed out"
        with KVStoreClient(d.address, layout=LAYOUT, model="m", timeout_s=10) as kv:
            assert kv.put(kv.hash_tokens(tokens(1)), random_blocks(LAYOUT, 1)) == 1
        assert d.alive()
    finally:
        for ch in idle:
            ch.close()


def test_sessions_are_capped_per_user(daemon_factory) -> None:
    """A user may hold at most half of ``connections.max_sessions``: past that its next session
    is refused with a message (RESOURCE_EXHAUSTED's CapacityError), and closing one lets the
    next in; the daemon keeps serving."""
    from kvstore.errors import CapacityError

    d = daemon_factory(extra="\n[connections]\nmax_sessions = 4\n")
    held = [ClientSession(str(d.socket_path), 5.0) for _ in range(2)]
    try:
        with pytest.raises(CapacityError, match="too many sessions"):
            ClientSession(str(d.socket_path), 5.0)
        held.pop().close()
        # The daemon notices the closed connection on its own loop: the next session gets in
        # once it has (a bounded wait, never a sleep that could be too short).
        import time

        deadline = time.monotonic() + 20
        while True:
            try:
                held.append(ClientSession(str(d.socket_path), 5.0))
                break
            except CapacityError:
                assert time.monotonic() < deadline, "the closed session was never freed"
                time.sleep(0.05)
        held.pop().close()
        deadline = time.monotonic() + 20
        while True:
            try:
                kv = KVStoreClient(d.address, layout=LAYOUT, model="m", timeout_s=10)
                break
            except CapacityError:
                assert time.monotonic() < deadline, "the closed session was never freed"
                time.sleep(0.05)
        with kv:
            assert kv.put(kv.hash_tokens(tokens(1)), random_blocks(LAYOUT, 1)) == 1
    finally:
        for s in held:
            s.close()


@needs_root
def test_one_caller_cannot_take_every_handle(open_dir: Path) -> None:
    """With a policy, one caller (here uid 0) may hold at most a quarter of
    ``limits.max_handles``: past that OpenNamespace is RESOURCE_EXHAUSTED with a message, and a
    handle closed makes room again."""
    from kvstore.errors import CapacityError

    d = DaemonProcess(open_dir / "h", config_toml(extra=POLICY + "\n[limits]\nmax_handles = 8\n"))
    d.directory.mkdir()
    d.start()
    clients = []
    try:
        clients = [
            KVStoreClient(d.address, layout=LAYOUT, model=f"m{i}", tenant="root") for i in range(2)
        ]
        with pytest.raises(CapacityError, match=r"a quarter of limits\.max_handles"):
            KVStoreClient(d.address, layout=LAYOUT, model="m2", tenant="root")
        clients.pop().close()
        import time

        deadline = time.monotonic() + 20
        while True:  # the daemon reclaims the closed handle when it sees its stream end
            try:
                clients.append(KVStoreClient(d.address, layout=LAYOUT, model="m3", tenant="root"))
                break
            except CapacityError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        for kv in clients:
            kv.close()
        d.stop()
