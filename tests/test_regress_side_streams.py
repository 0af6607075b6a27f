"""Health's ``Watch`` and reflection's stream hold a gRPC call slot for as long as they last.
They were served to callers without credentials and without a bound: 8 ``Watch`` streams from a
peer with no token held every slot of a daemon with ``max_concurrent_rpcs = 8`` and locked every
tenant out (the default 8192 fall to 16 connections). Now a stream of those services needs a
principal and few are open at once; ``Check`` (what probes use) stays open."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from test_security import _tcp_daemon, _wait_port, certs  # noqa: F401

from kvstore.daemon.side_streams import MAX_STREAMS_PER_PRINCIPAL
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


def test_health_and_reflection_streams_need_credentials_and_are_bounded(
    tmp_path: Path,
    certs: Path,  # noqa: F811
) -> None:
    token = "s3cret-" + "z" * 32
    (tmp_path / "alice.token").write_text(token + "\n")
    extra = f"""
[connections]
max_concurrent_rpcs = 8

[auth]
tls_cert = "{certs / "server.pem"}"
tls_key = "{certs / "server.key"}"
tokens = {{ alice = "file:{tmp_path / "alice.token"}" }}

[[access]]
tokens = ["alice"]
tenants = ["alice"]
"""
    proc, address = _tcp_daemon(tmp_path, extra, {})
    creds = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
    md = (("authorization", f"Bearer {token}"),)
    try:
        _wait_port(proc, int(address.rsplit(":", 1)[1]))
        with (
            grpc.secure_channel(address, creds) as bad,
            grpc.secure_channel(address, creds) as good,
        ):
            health = health_pb2_grpc.HealthStub(bad)
            # A probe needs nothing: Check ends at once.
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # No credential, no stream (8 of them held every slot before).
            for _ in range(8):
                with pytest.raises(grpc.RpcError) as err:
                    next(health.Watch(health_pb2.HealthCheckRequest(), timeout=5))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            with pytest.raises(grpc.RpcError) as err:
                next(
                    reflection_pb2_grpc.ServerReflectionStub(bad).ServerReflectionInfo(
                        iter([request]), timeout=5
                    )
                )
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            pb_grpc.KVStoreStub(good).Stats(pb.StatsRequest(), metadata=md, timeout=5)

            # A principal holds a few, then is refused; the store's calls keep their slots.
            watch = health_pb2_grpc.HealthStub(good).Watch
            held = [
                watch(health_pb2.HealthCheckRequest(), metadata=md)
                for _ in range(MAX_STREAMS_PER_PRINCIPAL)
            ]
            for stream in held:
                assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:
                next(watch(health_pb2.HealthCheckRequest(), metadata=md, timeout=5))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "use health's Check" in (err.value.details() or "")
            pb_grpc.KVStoreStub(good).Stats(pb.StatsRequest(), metadata=md, timeout=5)
            # Ended streams give their places back.
            for stream in held:
                stream.cancel()
            deadline = time.monotonic() + 30
            while True:
                stream = watch(health_pb2.HealthCheckRequest(), metadata=md)
                try:
                    assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
                    break
                except grpc.RpcError as exc:  # the cancellations are still being noticed
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert time.monotonic() < deadline, "cancelled streams kept their places"
                    time.sleep(0.05)
            stream.cancel()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
