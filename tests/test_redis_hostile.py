"""The shared Redis tier when someone else can write to Redis: keyed values by default.

A daemon with a Redis tier and no secret (``redis.mac_key_file``) refuses to start, exit 2 with
one line naming the setting and the fix, unless ``redis.allow_unkeyed`` (config, flag or
``KVSTORE_REDIS_ALLOW_UNKEYED``), which starts it with a warning. ``kvstore redis-secret`` writes
a secret file. Against real daemons sharing a real redis-server, every value an attacker can
write is a miss on a keyed host, never served, and the daemon serves on: a value forged with
kvstore's own public encoder for the namespace read from the key names (the attack on an
unkeyed Redis tier), a value keyed with another secret, genuine values swapped between keys and
between namespaces, bit flips in the header (with its xxh3 sealed again, as an attacker would),
the MAC and the payload, truncated and extended values, and an unkeyed value written by a host
allowed to run without the secret. Two keyed hosts with different codec rules never serve fp8
bytes as exact.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch
import xxhash
from conftest import SMALL_LAYOUT, random_blocks, same_bytes, tiers, tokens, wait_for

from kvstore import KVStoreClient
from kvstore.checksum import block_checksum
from kvstore.config import RedisTierConfig, load_config
from kvstore.daemon.shared import read_mac_secret
from kvstore.tiers.redis import RedisTier
from kvstore.tiers.redis_tier import value as fmt

pytestmark = pytest.mark.redis

BB = SMALL_LAYOUT.block_bytes
HB = fmt.HEADER_BYTES


def client(daemon, model: str = "test-model") -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model=model)


def kvstore_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args],
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard: the refusal comes before anything is served
        # Only the variables a test gives: a KVSTORE_* of the caller's shell must not decide.
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")},
            **(env or {}),
        },
    )


def new_secret(path: Path) -> Path:
    """A secret file written by ``kvstore redis-secret``, as an operator makes one."""
    r = kvstore_cli("redis-secret", str(path))
    assert r.returncode == 0, r.stderr
    return path


# ------------------------------------------------------------------ refusing to start
def test_a_redis_tier_without_a_secret_refuses_to_start(redis_server, tmp_path: Path) -> None:
    """A Redis tier given by the config file, by ``--redis-url`` or by KVSTORE_REDIS_URL, with no
    secret: exit 2 before serving, one line naming the setting and how to fix it."""
    config = tmp_path / "c.toml"
    config.write_text(f'[redis]\nurl = "{redis_server.url}"\n')
    address = f"unix:{tmp_path / 'kv.sock'}"
    tries = [
        (["--config", str(config)], {}),
        (["--redis-url", redis_server.url], {}),
        ([], {"KVSTORE_REDIS_URL": redis_server.url}),
    ]
    for args, env in tries:
        r = kvstore_cli("serve", "--address", address, "--gpu", "off", *args, env=env)
        assert r.returncode == 2, (args, env, r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, r.stderr
        assert lines[0].startswith("kvstore serve: redis.mac_key_file is not set")
        for fix in ("kvstore redis-secret", "redis.allow_unkeyed = true", "forged"):
            assert fix in lines[0]
        assert not (tmp_path / "kv.sock").exists()


def test_allow_unkeyed_starts_with_a_warning_and_unkeyed_hosts_share(
    daemon_factory, redis_server
) -> None:
    a = daemon_factory(redis_url=redis_server.url, redis_allow_unkeyed=True)
    b = daemon_factory(redis_url=redis_server.url, redis_allow_unkeyed=True)
    for d in (a, b):
        assert "WITHOUT a MAC secret" in d.logs()
        assert "can make every host serve forged KV blocks" in d.logs()
    blocks = random_blocks(SMALL_LAYOUT, 3, seed=5)
    with client(a) as kv_a, client(b) as kv_b:
        keys = kv_a.hash_tokens(tokens(3))
        assert kv_a.put(keys, blocks) == 3
        wait_for(lambda: tiers(kv_a)["redis"].demotions >= 3, what="write-through to redis")
        assert same_bytes(kv_b.get(keys), blocks)  # what the operator chose: unkeyed sharing
        fp = kv_a.namespace.fingerprint
    r = redis.Redis(unix_socket_path=str(redis_server.socket_path))
    try:
        value = r.get(fmt.block_name(fmt.namespace_prefix("kvs", fp), keys[0]))
        assert value is not None and not fmt.is_keyed(value[:HB])
    finally:
        r.close()


def test_the_allow_unkeyed_setting_is_typed_strictly(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[redis]\nurl = "redis://h:6379/0"\nallow_unkeyed = "true"\n')
    with pytest.raises(ValueError, match=r"redis\.allow_unkeyed: must be true or false"):
        load_config(cfg, env={})
    cfg.write_text('[redis]\nurl = "redis://h:6379/0"\nallow_unkeyed = true\n')
    load_config(cfg, env={}).redis.check_keyed()  # allowed: no error
    for bad in ("1", "yes", "True", "on"):
        env = {"KVSTORE_REDIS_URL": "redis://h:6379/0", "KVSTORE_REDIS_ALLOW_UNKEYED": bad}
        with pytest.raises(ValueError, match="KVSTORE_REDIS_ALLOW_UNKEYED: must be true or false"):
            load_config(env=env)
    env = {"KVSTORE_REDIS_URL": "redis://h:6379/0", "KVSTORE_REDIS_ALLOW_UNKEYED": "false"}
    with pytest.raises(ValueError, match=r"redis\.mac_key_file is not set"):
        load_config(env=env).redis.check_keyed()
    env["KVSTORE_REDIS_ALLOW_UNKEYED"] = "true"
    load_config(env=env).redis.check_keyed()
    env = {"KVSTORE_REDIS_URL": "redis://h:6379/0", "KVSTORE_REDIS_MAC_KEY_FILE": "/k"}
    assert load_config(env=env).redis.mac_key_file == "/k"
    load_config(env=env).redis.check_keyed()
    # Both: a keyed daemon never reads unkeyed values, so "allow" would not mean what it says.
    with pytest.raises(ValueError, match=r"allow_unkeyed = true and redis\.mac_key_file both set"):
        RedisTierConfig(url="redis://h:6379/0", mac_key_file="/k", allow_unkeyed=True)
    RedisTierConfig().check_keyed()  # no Redis tier: nothing to key


def test_the_multi_host_example_is_keyed() -> None:
    path = Path(__file__).parent.parent / "configs" / "multi-host-redis.toml"
    multi = load_config(path, env={}).redis
    assert multi.url and multi.mac_key_file and not multi.allow_unkeyed
    multi.check_keyed()


# ------------------------------------------------------------------ kvstore redis-secret
def test_redis_secret_writes_a_new_0600_file_and_keeps_an_existing_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "redis.key"
    umask = os.umask(0o022)  # what a shell usually has: the file must still be 0600
    try:
        r = kvstore_cli("redis-secret", str(path))
    finally:
        os.umask(umask)
    assert r.returncode == 0, r.stderr
    assert f'mac_key_file = "{path}"' in r.stdout and "every host" in r.stdout
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert len(text) == 65 and text.endswith("\n") and bytes.fromhex(text.strip())
    assert read_mac_secret(str(path)) == text.strip().encode()  # what the daemon reads

    r = kvstore_cli("redis-secret", str(path))  # never over an existing secret
    assert r.returncode == 2 and "exists; pass --force" in r.stderr
    assert path.read_text() == text

    path.chmod(0o644)
    with caplog.at_level("WARNING", logger="kvstore.daemon.shared"):
        assert read_mac_secret(str(path)) == text.strip().encode()
    assert "readable by others (mode 644)" in caplog.text  # whoever reads it can forge
    r = kvstore_cli("redis-secret", "--force", str(path))
    assert r.returncode == 0, r.stderr
    assert path.read_text() != text and len(path.read_text()) == 65
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["redis.key"]  # no temporary left

    link = tmp_path / "link.key"
    link.symlink_to(tmp_path / "elsewhere.key")
    r = kvstore_cli("redis-secret", str(link))  # a link is not followed to make its target
    assert r.returncode == 2 and not (tmp_path / "elsewhere.key").exists()


# ------------------------------------------------------------------ hostile writers
def _seal(head: bytearray) -> bytes:
    """A header with its xxh3 made right again: the public checksum an attacker recomputes."""
    head[88:96] = xxhash.xxh3_64_intdigest(bytes(head[:88])).to_bytes(8, "little")
    return bytes(head)


def _flip(value: bytes, at: int, reseal: bool) -> bytes:
    out = bytearray(value)
    out[at] ^= 0x01
    if reseal and at < 88:
        return _seal(out[:HB]) + bytes(out[HB:])
    return bytes(out)


def test_every_value_an_attacker_writes_is_a_miss_on_a_keyed_host(
    daemon_factory, redis_server, tmp_path: Path
) -> None:
    a = daemon_factory(redis_url=redis_server.url)  # the suite's secret
    b = daemon_factory(redis_url=redis_server.url)
    other = new_secret(tmp_path / "other.key")
    c = daemon_factory(redis_url=redis_server.url, redis_mac_key_file=other)
    d = daemon_factory(redis_url=redis_server.url, redis_allow_unkeyed=True)
    n = 40
    blocks = random_blocks(SMALL_LAYOUT, n, seed=11)
    evil = random_blocks(SMALL_LAYOUT, n, seed=666)  # what the attacker wants served
    r = redis.Redis(unix_socket_path=str(redis_server.socket_path))
    with (
        client(a) as kv_a,
        client(b) as kv_b,
        client(c) as kv_c,
        client(d) as kv_d,
        client(b, model="other-model") as kv_b2,
        client(a, model="other-model") as kv_a2,
    ):
        keys = kv_a.hash_tokens(tokens(n))
        assert kv_a.put(keys, blocks) == n
        keys2 = kv_a2.hash_tokens(tokens(4))
        assert kv_a2.put(keys2, blocks[:4]) == 4
        wait_for(lambda: tiers(kv_a)["redis"].demotions >= n + 4, what="write-through to redis")

        # The attacker reads the namespace from the key names in Redis, no secret needed.
        names = sorted(r.scan_iter(match="kvs:*"))
        ns_hex = {name.split(b":")[1] for name in names}
        fp, fp2 = kv_a.namespace.fingerprint, kv_a2.namespace.fingerprint
        assert ns_hex == {fp.hex().encode(), fp2.hex().encode()}
        prefix, prefix2 = fmt.namespace_prefix("kvs", fp), fmt.namespace_prefix("kvs", fp2)

        def name(i: int) -> bytes:
            return fmt.block_name(prefix, keys[i])

        genuine = {i: r.get(name(i)) for i in range(n)}
        assert all(fmt.is_keyed(v[:HB]) for v in genuine.values())
        evil_bytes = [
            evil[i].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() for i in range(n)
        ]

        def forge_with_the_public_encoder(i: int, secret: bytes | None) -> None:
            # kvstore's own writer, pointed at this Redis: header, bound checksum, SET.
            async def put() -> None:
                tier = RedisTier(redis_server.url, timeout_s=5.0, mac_secret=secret)
                await tier.start()
                try:
                    r.delete(name(i))  # SET NX: the attacker makes room first
                    data = evil_bytes[i]
                    stored = await tier.put(
                        fp, [(keys[i], data, block_checksum(data, fp, keys[i]))]
                    )
                    assert stored == 1
                finally:
                    await tier.close()

            asyncio.run(put())

        cases: dict[int, str] = {}

        def tamper(i: int, what: str, value: bytes) -> None:
            r.set(name(i), value)
            cases[i] = what

        # 0-1: forged with the public code and no secret (the attack on an unkeyed tier), by
        # the tier class and by hand from the value format.
        forge_with_the_public_encoder(0, None)
        cases[0] = "forged: public encoder, no secret"
        data = evil_bytes[1]
        head = fmt.pack_header(keys[1], fp, len(data), block_checksum(data, fp, keys[1]))
        tamper(1, "forged: pack_header, no secret", head + data)
        # 2-3: keyed with another secret, by the tier class and by a guess at the MAC key.
        forge_with_the_public_encoder(2, b"not the operator's secret at all")
        cases[2] = "keyed with another secret"
        data = evil_bytes[3]
        head = fmt.pack_header(
            keys[3], fp, len(data), block_checksum(data, fp, keys[3]), keyed=(b"k" * 32, data)
        )
        tamper(3, "keyed with a guessed MAC key", head + data)
        # 4-6: genuine values under other keys: a copy, and a swap of two.
        tamper(4, "a genuine value copied under another key", genuine[30])
        tamper(5, "swapped with 6", genuine[6])
        tamper(6, "swapped with 5", genuine[5])
        # 7-20: one bit flipped: header fields (their xxh3 sealed again), the MAC, the xxh3,
        # the payload.
        fields = {
            "magic": 0, "version": 4, "codec": 5, "flags": 6, "length": 8, "checksum": 16,
            "stored length": 24, "stored checksum": 32, "key": 50,
        }  # fmt: skip
        i = 7
        for field, at in fields.items():
            tamper(i, f"header {field} flipped, xxh3 sealed", _flip(genuine[i], at, reseal=True))
            i += 1
        tamper(i, "MAC first byte flipped", _flip(genuine[i], 72, reseal=True))
        tamper(i + 1, "MAC last byte flipped", _flip(genuine[i + 1], 87, reseal=True))
        tamper(i + 2, "header xxh3 flipped", _flip(genuine[i + 2], 90, reseal=False))
        tamper(i + 3, "payload first byte", _flip(genuine[i + 3], HB, reseal=False))
        tamper(i + 4, "payload middle byte", _flip(genuine[i + 4], HB + BB // 2, reseal=False))
        i += 5
        assert i == 21
        tamper(21, "payload last byte", _flip(genuine[21], HB + BB - 1, reseal=False))
        # 22-27: truncated and extended.
        tamper(22, "one byte short", genuine[22][:-1])
        tamper(23, "the header alone", genuine[23][:HB])
        tamper(24, "half a header", genuine[24][: HB // 2])
        tamper(25, "empty", b"")
        tamper(26, "one byte more", genuine[26] + b"\0")
        tamper(27, "twice as long", genuine[27] + genuine[27])
        # 28: the payload replaced, header kept (the MAC covers the payload).
        tamper(28, "payload replaced", genuine[28][:HB] + evil_bytes[28])

        # 29: keyed with another secret by a real daemon (another deployment on this Redis),
        # 31: an unkeyed value by a real daemon allowed to run without the secret.
        r.delete(name(29), name(31))
        assert kv_c.put([keys[29]], evil[29:30]) == 1
        assert kv_d.put([keys[31]], evil[31:32]) == 1
        wait_for(lambda: r.exists(name(29)) and r.exists(name(31)), what="c and d writing")
        cases[29] = "a daemon keyed with another secret"
        cases[31] = "a daemon without a secret (allow_unkeyed)"
        # Between namespaces: a genuine value of test-model under other-model's name for the
        # same key, and other-model's genuine value under test-model's name.
        r.set(fmt.block_name(prefix2, keys[32]), genuine[32])
        tamper(33, "another namespace's genuine value", r.get(fmt.block_name(prefix2, keys2[0])))
        # 34: a value from another namespace, its header rewritten for this key and sealed.
        moved = bytearray(r.get(fmt.block_name(prefix2, keys2[1])))
        moved[40:72] = keys[34]
        tamper(34, "another namespace's value, key field rewritten", _seal(moved[:HB]) + moved[HB:])

        # A lookup counts what the value's first bytes promise: unkeyed values (forged with
        # the public code, or a host without the secret), and keyed flags cleared, are absent.
        for i in (0, 1, 10, 31):
            assert kv_b.lookup([keys[i]]) == 0, cases[i]
        for i, what in cases.items():
            got = kv_b.get([keys[i]])
            assert got.shape[0] == 0, f"{what}: served"
            assert kv_b.get(keys[i : i + 1]).shape[0] == 0, f"{what}: served on a second try"
        got = kv_b2.get([keys[32]])
        assert got.shape[0] == 0, "a genuine value moved to another namespace was served"
        # The genuine values nobody touched, and the namespace moved from, still serve.
        untouched = [30, 36, 37, 38, 39]
        assert same_bytes(kv_b.get([keys[i] for i in untouched]), blocks[untouched])
        # A run stops at the first bad value: what comes before it is served exact.
        got = kv_b.get([keys[35], keys[5], keys[36]])
        assert got.shape[0] == 1 and same_bytes(got, blocks[35:36])
        assert same_bytes(kv_b2.get(keys2), blocks[:4])
        stats = tiers(kv_b)["redis"]
        assert stats.extra["mac_failures"] >= 8
        assert stats.checksum_failures >= 8
        # The writers still serve their own exact blocks from their local tiers, and b takes
        # new work.
        assert same_bytes(kv_a.get(keys), blocks)
        more = kv_b.hash_tokens(tokens(2, offset=9000))
        assert kv_b.put(more, evil[:2]) == 2 and same_bytes(kv_b.get(more), evil[:2])
    r.close()
    assert a.alive() and b.alive() and c.alive() and d.alive()


async def test_lookup_counts_only_values_a_read_would_take(redis_server) -> None:
    """A keyed tier's ``contains`` skips unkeyed values and an unkeyed tier's skips keyed ones,
    as their reads do: a lookup said "found" for values every get then refused."""
    ns = bytes(range(16))
    data = random_blocks(SMALL_LAYOUT, 4, seed=9).view(torch.uint8).reshape(4, -1).numpy()
    keys = [bytes([i]) * 32 for i in range(4)]
    blocks = [
        (k, data[i].tobytes(), block_checksum(data[i].tobytes(), ns, k)) for i, k in enumerate(keys)
    ]
    keyed = RedisTier(redis_server.url, timeout_s=5.0, mac_secret=b"s" * 32)
    unkeyed = RedisTier(redis_server.url, timeout_s=5.0)
    await keyed.start()
    await unkeyed.start()
    try:
        assert await keyed.put(ns, blocks[:2]) == 2
        assert await unkeyed.put(ns, blocks[2:]) == 2
        assert await keyed.contains(ns, keys) == 2 and await keyed.contains(ns, keys[2:]) == 0
        assert await unkeyed.contains(ns, keys) == 0 and await unkeyed.contains(ns, keys[2:]) == 2
        for tier, mine in ((keyed, keys[:2]), (unkeyed, keys[2:])):
            outs = [bytearray(BB) for _ in keys]
            items = [(k, None, memoryview(o)) for k, o in zip(keys, outs, strict=True)]
            got = await tier.get_into(ns, items)
            assert got == [k in mine for k in keys]  # what contains said
    finally:
        await keyed.close()
        await unkeyed.close()


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "unkeyed"])
def test_keyed_hosts_with_different_codec_rules_never_serve_fp8_as_exact(
    daemon_factory, redis_server, tmp_path: Path, keyed: bool
) -> None:
    """Both hosts share one secret (or both run unkeyed): a's rule writes the namespace's
    values fp8, b keeps it lossless. The MAC vouches for a's value, a genuine fp8 form: b must
    still read a miss, never those bytes; a relabelled as lossless is a miss too."""
    how: dict[str, object] = (
        {"redis_mac_key_file": new_secret(tmp_path / "shared.key")}
        if keyed
        else {"redis_allow_unkeyed": True}
    )
    rule = '\n[[codecs]]\nmodel = "test-model"\nredis = "fp8"\n'
    a = daemon_factory(redis_url=redis_server.url, extra=rule, **how)
    b = daemon_factory(redis_url=redis_server.url, **how)
    blocks = random_blocks(SMALL_LAYOUT, 5, seed=3)
    with (
        client(a) as kv_a,
        client(b) as kv_b,
        client(a, model="exact-model") as kv_a2,
        client(b, model="exact-model") as kv_b2,
    ):
        keys = kv_a.hash_tokens(tokens(5))
        assert kv_a.put(keys, blocks) == 5
        keys2 = kv_a2.hash_tokens(tokens(2))
        assert kv_a2.put(keys2, blocks[:2]) == 2  # no rule: written lossless
        wait_for(lambda: tiers(kv_a)["redis"].demotions >= 7, what="write-through to redis")
        fp = kv_a.namespace.fingerprint
        r = redis.Redis(unix_socket_path=str(redis_server.socket_path))
        try:
            name = fmt.block_name(fmt.namespace_prefix("kvs", fp), keys[4])
            value = r.get(name)
            assert value is not None and value[fmt.CODEC_OFFSET] != fmt.CODEC_NONE
            assert fmt.is_keyed(value[:HB]) == keyed
            relabel = bytearray(value)  # the codec byte says "none", the xxh3 sealed again
            relabel[fmt.CODEC_OFFSET] = fmt.CODEC_NONE
            r.set(name, _seal(relabel[:HB]) + relabel[HB:])
        finally:
            r.close()
        assert kv_b.lookup(keys) == 0
        assert kv_b.get(keys).shape[0] == 0  # never the fp8 form
        assert kv_b.get(keys[4:]).shape[0] == 0  # nor the relabelled one
        assert same_bytes(kv_b2.get(keys2), blocks[:2])  # the same writer's lossless values
        kv_b.put(keys, blocks)  # b's own exact blocks serve b
        assert same_bytes(kv_b.get(keys), blocks)
    assert a.alive() and b.alive()
