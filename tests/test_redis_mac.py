"""Redis values with a keyed MAC (``redis.mac_key_file``): a value written to Redis by anyone
without the secret (a forged block with a right xxh3 checksum, a keyed-looking one with a wrong
MAC, a keyed value moved under another key) is a miss, never served; daemons sharing the secret
serve each other's blocks bit-exact. Without the secret (``redis.allow_unkeyed``) xxh3 alone
guards the bytes (docs/redis.md; ``test_redis_hostile.py`` has every kind of forgery). Real
redis-server, real daemons, the forgeries written with redis-py.
"""

from __future__ import annotations

import redis
import torch
from conftest import SMALL_LAYOUT, random_blocks, same_bytes, tiers, tokens, wait_for

from kvstore import KVStoreClient
from kvstore.checksum import block_checksum
from kvstore.tiers.redis_tier import value as fmt


def client(daemon) -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="test-model")


def test_forged_redis_values_are_misses_with_a_mac_secret(daemon_factory, redis_server, tmp_path):
    secret = tmp_path / "redis.key"
    secret.write_text("a shared secret of at least sixteen bytes\n")
    a = daemon_factory(redis_url=redis_server.url, redis_mac_key_file=secret)
    b = daemon_factory(redis_url=redis_server.url, redis_mac_key_file=secret)
    blocks = random_blocks(SMALL_LAYOUT, 8, seed=1)
    with client(a) as kv_a, client(b) as kv_b:
        keys = kv_a.hash_tokens(tokens(8))
        assert kv_a.put(keys[:4], blocks[:4]) == 4
        wait_for(lambda: tiers(kv_a)["redis"].demotions >= 4, what="write-through to redis")
        assert same_bytes(kv_b.get(keys[:4]), blocks[:4])  # keyed values round-trip

        # Someone who can write to Redis, without the secret, forges the next blocks.
        fp = kv_a.namespace.fingerprint
        prefix = fmt.namespace_prefix("kvs", fp)
        raw = random_blocks(SMALL_LAYOUT, 4, seed=66).contiguous().view(torch.uint8)
        forged = raw.view(4, SMALL_LAYOUT.block_bytes)
        r = redis.Redis(unix_socket_path=str(redis_server.socket_path))
        try:
            for i in (4, 5):  # unkeyed values, right xxh3 checksums: what passed before
                data = forged[i - 4].numpy().tobytes()
                head = fmt.pack_header(keys[i], fp, len(data), block_checksum(data, fp, keys[i]))
                r.set(fmt.block_name(prefix, keys[i]), head + data)
            data = forged[2].numpy().tobytes()
            wrong = fmt.pack_header(
                keys[6], fp, len(data), block_checksum(data, fp, keys[6]), keyed=(b"x" * 32, data)
            )
            r.set(fmt.block_name(prefix, keys[6]), wrong + data)  # keyed, a guessed key
            genuine = r.get(fmt.block_name(prefix, keys[0]))
            r.set(fmt.block_name(prefix, keys[7]), genuine)  # a genuine value under another key
        finally:
            r.close()
        for i in (4, 5, 6, 7):  # none is served, by either daemon
            for kv in (kv_a, kv_b):
                got = kv.get([keys[i]])
                assert len(got) == 0, f"a forged value for block {i} was served"
        # The MAC-less ones are not even looked up as present (their flags say unkeyed); the
        # keyed-looking ones are read, and refused by their MAC or their header.
        assert kv_b.lookup(keys[4:5]) == 0 and kv_b.lookup(keys[5:6]) == 0
        assert same_bytes(kv_b.get(keys[:4]), blocks[:4])
        redis_b = tiers(kv_b)["redis"]
        assert redis_b.extra["mac_failures"] >= 1  # the guessed MAC key
        assert redis_b.checksum_failures >= 2  # that one, and the value under another key
    assert a.alive() and b.alive()


def test_a_daemon_without_the_secret_file_refuses_to_start(daemon_factory, redis_server, tmp_path):
    short = tmp_path / "short.key"
    short.write_text("too short\n")
    for path in (tmp_path / "missing.key", short):
        try:
            daemon_factory(redis_url=redis_server.url, redis_mac_key_file=path)
        except Exception as exc:  # the daemon exits before serving
            assert "exited" in str(exc) or "not serving" in str(exc)
        else:
            raise AssertionError(f"a daemon started with redis.mac_key_file = {path}")
