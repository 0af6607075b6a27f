"""The shared Redis tier through real daemons: two hosts' sidecars sharing one real redis-server."""

from __future__ import annotations

import time

import pytest
from conftest import SMALL_LAYOUT, random_blocks, same_bytes, tiers, tokens, wait_for
from test_redis_tier import cluster  # noqa: F401  (the three-node Redis Cluster fixture)

from kvstore import KVStoreClient


def client(daemon, **kw) -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="test-model", **kw)


@pytest.fixture
def two_hosts(daemon_factory, redis_server, tmp_path):
    (tmp_path / "nvme_b").mkdir()
    a = daemon_factory(redis_url=redis_server.url)
    b = daemon_factory(
        redis_url=redis_server.url, nvme_path=tmp_path / "nvme_b", nvme_capacity="4MiB"
    )
    return a, b


def test_a_block_put_on_one_host_is_served_on_another(two_hosts) -> None:
    a, b = two_hosts
    blocks = random_blocks(SMALL_LAYOUT, 8, seed=1)
    with client(a) as kv_a, client(b) as kv_b:
        keys = kv_a.hash_tokens(tokens(8))
        assert kv_a.put(keys, blocks) == 8
        wait_for(lambda: tiers(kv_a)["redis"].demotions >= 8, what="write-through to redis")
        assert kv_b.lookup(keys) == 8  # found in the shared tier
        assert tiers(kv_b)["cpu"].blocks == 0
        # Fetched bit-exact, under the right checksums: b keeps the xxh3-64 its Redis tier
        # verified (it does not hash again), and the client checks every block against it.
        assert same_bytes(kv_b.get(keys), blocks)
        assert tiers(kv_b)["redis"].promotions == 8
        assert tiers(kv_b)["cpu"].blocks == 8
        assert same_bytes(kv_b.get(keys), blocks)  # now served from b's own CPU tier
        assert tiers(kv_b)["redis"].promotions == 8
        # A prefix extended locally on b continues past what Redis holds.
        more = kv_b.hash_tokens(tokens(10))
        kv_b.put(more[8:], random_blocks(SMALL_LAYOUT, 2, seed=2))
        assert kv_b.lookup(more) == 10


def test_lookup_mixes_local_and_shared_blocks(two_hosts) -> None:
    a, b = two_hosts
    blocks = random_blocks(SMALL_LAYOUT, 6, seed=3)
    with client(a) as kv_a, client(b) as kv_b:
        keys = kv_a.hash_tokens(tokens(6))
        kv_b.put(keys[:2], blocks[:2])  # b computed the head itself
        kv_a.put(keys, blocks)  # a computed all of it
        wait_for(lambda: tiers(kv_a)["redis"].demotions >= 6, what="write-through")
        assert kv_b.lookup(keys) == 6
        assert same_bytes(kv_b.get(keys), blocks)
        assert tiers(kv_b)["redis"].promotions == 4


def test_redis_down_keeps_both_hosts_serving_then_recovers(two_hosts, redis_server) -> None:
    a, b = two_hosts
    blocks = random_blocks(SMALL_LAYOUT, 4, seed=4)
    with client(a) as kv_a, client(b) as kv_b:
        keys = kv_a.hash_tokens(tokens(4))
        kv_a.put(keys, blocks)
        wait_for(lambda: tiers(kv_a)["redis"].demotions >= 4, what="write-through")
        redis_server.stop()
        for kv in (kv_a, kv_b):
            t0 = time.monotonic()
            kv.lookup(keys)
            kv.get(keys)
            assert time.monotonic() - t0 < 3.0  # deadlines, no hung call
        wait_for(lambda: not tiers(kv_b)["redis"].up, what="redis marked down")
        assert kv_a.lookup(keys) == 4 and same_bytes(kv_a.get(keys), blocks)  # local tiers
        assert kv_b.lookup(keys) == 0  # only in Redis: not a hit while unreachable
        assert kv_b.get(keys).shape[0] == 0
        local = kv_b.hash_tokens(tokens(3, offset=9000))
        assert kv_b.put(local, random_blocks(SMALL_LAYOUT, 3, seed=5)) == 3
        # A writes during the outage: its write-through waits for Redis instead of dropping.
        during = kv_a.hash_tokens(tokens(3, offset=7000))
        during_blocks = random_blocks(SMALL_LAYOUT, 3, seed=13)
        assert kv_a.put(during, during_blocks) == 3
        # Redis comes back (empty: it had no persistence) and the tier recovers.
        redis_server.start()
        wait_for(lambda: tiers(kv_b)["redis"].up, what="redis back up")
        again = kv_a.hash_tokens(tokens(4, offset=5000))
        more = random_blocks(SMALL_LAYOUT, 4, seed=6)
        kv_a.put(again, more)
        wait_for(lambda: kv_b.lookup(again) == 4, what="sharing again")
        assert same_bytes(kv_b.get(again), more)
        wait_for(lambda: kv_b.lookup(during) == 3, what="blocks written during the outage")
        assert same_bytes(kv_b.get(during), during_blocks)


def test_a_tampered_value_in_redis_is_a_miss(two_hosts, redis_server) -> None:
    a, b = two_hosts
    blocks = random_blocks(SMALL_LAYOUT, 3, seed=7)
    with client(a) as kv_a, client(b) as kv_b:
        keys = kv_a.hash_tokens(tokens(3))
        kv_a.put(keys, blocks)
        wait_for(lambda: tiers(kv_a)["redis"].demotions >= 3, what="write-through")
        fp = kv_a.namespace.fingerprint.hex()
        name = f"kvs:{fp}:{keys[1].hex()}"
        value_len = int(redis_server.cli("STRLEN", name).strip())
        assert value_len > SMALL_LAYOUT.block_bytes
        redis_server.cli("SETRANGE", name, str(value_len - 100), "X")
        got = kv_b.get(keys)
        assert got.shape[0] == 1 and same_bytes(got, blocks[:1])  # the run ends at the bad one
        assert kv_b.get(keys[1:2]).shape[0] == 0  # never served as data
        assert tiers(kv_b)["redis"].checksum_failures >= 1
        assert same_bytes(kv_b.get(keys[2:]), blocks[2:])  # its neighbour is fine


def test_stat_shows_the_redis_tier(two_hosts) -> None:
    import json
    import subprocess
    import sys

    a, _ = two_hosts
    with client(a) as kv:
        keys = kv.hash_tokens(tokens(2))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 2, seed=8))
        wait_for(lambda: tiers(kv)["redis"].demotions >= 2, what="write-through")
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "stat", "--json", "--address", a.address],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    redis = next(t for t in json.loads(out)["tiers"] if t["name"] == "redis")
    assert redis["up"] and redis["demotions"] == 2


def test_two_hosts_share_through_a_redis_cluster(daemon_factory, cluster) -> None:  # noqa: F811
    url = f"redis+cluster://127.0.0.1:{cluster[0]}"
    a = daemon_factory(redis_url=url)
    b = daemon_factory(redis_url=url)
    blocks = random_blocks(SMALL_LAYOUT, 12, seed=21)
    with client(a) as kv_a, client(b) as kv_b:
        keys = kv_a.hash_tokens(tokens(12))
        assert kv_a.put(keys, blocks) == 12
        wait_for(lambda: tiers(kv_a)["redis"].demotions >= 12, what="write-through to the cluster")
        assert kv_b.lookup(keys) == 12
        assert same_bytes(kv_b.get(keys), blocks)
        assert tiers(kv_b)["redis"].promotions == 12


def test_blocks_queued_during_an_outage_survive_eviction_until_redis_is_back(
    daemon_factory, redis_server
) -> None:
    """Blocks committed while Redis was down used to be evicted like any other (LRU) and so
    never reached Redis afterwards. While Redis is down, eviction takes blocks Redis already
    holds first."""
    a = daemon_factory(redis_url=redis_server.url, cpu_capacity="128KiB", slab="128KiB")
    b = daemon_factory(redis_url=redis_server.url)
    with client(a) as kv_a, client(b) as kv_b:
        shared = kv_a.hash_tokens(tokens(8))
        kv_a.put(shared, random_blocks(SMALL_LAYOUT, 8, seed=20))
        wait_for(lambda: tiers(kv_a)["redis"].demotions >= 8, what="write-through")
        redis_server.stop()
        unknown = kv_a.hash_tokens(tokens(1, offset=7777))
        wait_for(
            lambda: kv_a.lookup(unknown) == 0 and not tiers(kv_a)["redis"].up,
            what="redis marked down",
        )
        during = kv_a.hash_tokens(tokens(4, offset=500))
        during_blocks = random_blocks(SMALL_LAYOUT, 4, seed=21)
        assert kv_a.put(during, during_blocks) == 4
        kv_a.get(shared)  # the blocks Redis holds are now the hot ones
        # 8 KiB blocks in a 128 KiB tier: 16 slots, 12 used. Four more push four out.
        assert (
            kv_a.put(
                kv_a.hash_tokens(tokens(8, offset=900))[:8], random_blocks(SMALL_LAYOUT, 8, seed=22)
            )
            == 8
        )
        assert kv_a.lookup(during) == 4  # spared: Redis does not have them yet
        redis_server.start()
        wait_for(lambda: kv_b.lookup(during) == 4, what="queued blocks reaching redis")
        assert same_bytes(kv_b.get(during), during_blocks)


def test_a_host_configured_lossless_never_serves_another_hosts_fp8_form(
    daemon_factory, redis_server
) -> None:
    """Host a's operator chose fp8 for the namespace's Redis values; host b's chose nothing
    (lossless). b served a's fp8 form, decoded: bytes other than those committed, to a
    namespace its operator never made lossy. Now a lossy value is a miss on b; a host that
    chose fp8 too still reads it."""
    rule = '\n[[codecs]]\nmodel = "test-model"\nredis = "fp8"\n'
    a = daemon_factory(redis_url=redis_server.url, extra=rule)
    b = daemon_factory(redis_url=redis_server.url)
    c = daemon_factory(redis_url=redis_server.url, extra=rule)
    blocks = random_blocks(SMALL_LAYOUT, 4, seed=1)
    with client(a) as kv_a, client(b) as kv_b, client(c) as kv_c:
        keys = kv_a.hash_tokens(tokens(4))
        assert kv_a.put(keys, blocks) == 4
        wait_for(lambda: tiers(kv_a)["redis"].demotions >= 4, what="write-through to redis")
        assert kv_b.lookup(keys) == 0  # not found: as a get would read it
        assert kv_b.get(keys).shape[0] == 0  # a miss, never the fp8 form
        assert tiers(kv_b)["redis"].checksum_failures == 0  # not damage: a choice
        got = kv_c.get(keys)  # a lossy host reads the fp8 form, as its operator chose
        assert got.shape[0] == 4 and not same_bytes(got, blocks)
        kv_b.put(keys, blocks)  # b's own exact blocks serve b
        assert same_bytes(kv_b.get(keys), blocks)
