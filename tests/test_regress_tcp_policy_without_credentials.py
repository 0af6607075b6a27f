"""A daemon on a TCP loopback address with a tenant policy ([[access]] by uid or gid) but no
tokens and no client certificates started, and every caller of it was the anonymous operator
of every tenant: uids and gids are known only on a unix socket, so any local user reaching the
port could read and write every tenant's blocks, whatever the policy said. Such a daemon now
refuses to start, with a message naming what is missing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from conftest import config_toml

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

POLICY = f"""
[[access]]
name = "alice"
uids = [{os.getuid() + 1}]
tenants = ["alice"]
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_tenant_policy_on_tcp_without_credentials_refuses_to_start(tmp_path: Path) -> None:
    port = _free_port()
    config = tmp_path / "tcp.toml"
    config.write_text(config_toml(cpu_capacity="16MiB", extra=POLICY))
    log_path = tmp_path / "tcp.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--address", f"127.0.0.1:{port}",
             "--config", str(config)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        listening = False
        while proc.poll() is None and time.monotonic() < deadline and not listening:
            with socket.socket() as s:
                listening = s.connect_ex(("127.0.0.1", port)) == 0
            time.sleep(0.05)
        if listening:
            # What any local user could do: no credential at all, a tenant the policy gives
            # nobody.
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                request = pb.OpenNamespaceRequest(
                    model="m",
                    tenant="bob",
                    layout=pb.Layout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16,
                                     dtype="float16"),
                )  # fmt: skip
                try:
                    next(pb_grpc.KVStoreStub(ch).OpenNamespace(request, timeout=10))
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
                else:
                    raise AssertionError("a caller with no credential opened tenant 'bob'")
        assert proc.wait(60) != 0
        text = log_path.read_text(errors="replace")
        assert "auth.tokens or auth.tls_client_ca" in text, text[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
