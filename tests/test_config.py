"""The daemon's configuration: the embedded default, the shipped examples, overrides, errors."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from kvstore.config import DaemonConfig, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_the_embedded_default_is_the_dataclass_default() -> None:
    # The TOML and the dataclasses must not drift apart: the file documents the defaults.
    assert load_config(env={}) == DaemonConfig()


def test_the_examples_parse_to_what_they_say() -> None:
    single = load_config(CONFIGS / "single-host.toml", env={})
    assert single.cpu.capacity_bytes == 64 << 30 and single.cpu.policy == "priority"
    assert single.nvme.enabled and single.nvme.capacity_bytes == 1 << 40
    assert single.gpu.capacity_bytes == 16 << 30 and not single.redis.url
    multi = load_config(CONFIGS / "multi-host-redis.toml", env={})
    assert multi.redis.url.startswith("redis+cluster://") and multi.redis.write_through
    assert multi.redis.max_bytes_per_namespace == 64 << 30 and multi.redis.ttl_s == 86400


def test_the_examples_ship_in_the_package() -> None:
    shipped = {p.name for p in resources.files("kvstore.configs").iterdir()}
    assert {"default.toml", "single-host.toml", "multi-host-redis.toml"} <= shipped


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text('[cpu]\ncapacity = "1GiB"\n[nvme]\npath = "/a"\n')
    cfg = load_config(path, env={"KVSTORE_CPU_CAPACITY": "3GiB", "KVSTORE_NVME_PATH": "/b"})
    assert cfg.cpu.capacity_bytes == 3 << 30 and cfg.nvme.path == "/b"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[cpu]\ncapacty = 1\n", "unknown key cpu.capacty"),
        ("[cache]\n", "unknown config sections"),
        ('[cpu]\ncapacity = "lots"\n', "lots"),
        ('[cpu]\npolicy = "fifo"\n', "cpu policy 'fifo' unknown"),
        ('[nvme]\ncodec = "zstd"\n', "nvme codec 'zstd' unknown"),
        ("[redis]\ntimeout_s = 0\n", "redis timeout_s must be positive"),
        ("[daemon]\nlease_ttl_s = -1\n", "lease_ttl_s must be positive"),
        ("cpu = 3\n", "must be a table"),
    ],
)
def test_a_bad_config_names_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(path, env={})


def test_the_tenant_policy_parses_and_rejects_secrets_in_the_file(tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text(
        """
[auth]
tokens = { web = "env:KVS_WEB" }

[[access]]
name = "chat"
uids = [1001]
tokens = ["web"]
tenants = ["chat"]

[[access]]
gids = [50]
tenants = ["ops"]
role = "operator"

[shared.prompts]
readers = ["chat"]
writers = ["ops"]
"""
    )
    cfg = load_config(policy, env={})
    assert cfg.auth.has_policy and len(cfg.auth.access) == 2
    assert cfg.auth.access[0].uids == (1001,) and cfg.auth.access[1].role == "operator"
    assert dict(cfg.auth.shared)["prompts"].writers == ("ops",)
    for text, message in (
        ('[auth]\ntokens = { web = "hunter2hunter2hunter2" }', "not the secret"),
        ('[[access]]\ntokens = ["nope"]\ntenants = ["a"]', "not in auth.tokens"),
        ('[[access]]\ntenants = ["a"]', "names no credential"),
        ('[[access]]\nuids = [1]\nrole = "root"', "role 'root' unknown"),
        ('[shared.p]\nreaders = ["a"]', "needs a tenant policy"),
        ('[auth]\ntls_client_ca = "/ca.pem"', "needs auth.tls_cert"),
    ):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_config(bad, env={})


def test_the_policy_maps_credentials_to_tenants() -> None:
    from kvstore.config import AccessRule, AuthConfig, SharedTenant
    from kvstore.daemon.auth import Policy

    policy = Policy(
        AuthConfig(
            access=(
                AccessRule(name="a", uids=(10,), tenants=("alice",)),
                AccessRule(name="b", gids=(20,), tenants=("bob",), role="operator"),
            ),
            shared=(("prompts", SharedTenant(readers=("alice",), writers=("bob",))),),
        )
    )
    alice = policy.for_unix_peer(10, 99)
    assert alice is not None and alice.may_read("alice") and alice.may_write("alice")
    assert alice.may_read("prompts") and not alice.may_write("prompts")
    assert not alice.may_read("bob") and not alice.operator
    bob = policy.for_unix_peer(7, 20)  # by primary gid
    assert bob is not None and bob.may_write("prompts") and bob.operator
    assert policy.for_unix_peer(11, 21) is None
    assert policy.token_name(b"anything") is None  # no tokens configured
