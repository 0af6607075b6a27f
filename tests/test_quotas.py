"""Quotas and fairness, against real daemons: what one tenant may hold, and what it can never
take from another (docs/security.md, "Quotas and fairness").

The two wedges pinned here used to let one client stop everyone else's puts: leasing every
block (and renewing the leases), and reserving the whole arena (its slots then quarantined for
another ``reservation_ttl_s``, so 60 s per round, repeatably). A hostile tenant now meets its
own bounds (RESOURCE_EXHAUSTED naming them) while a victim tenant keeps putting and getting.
"""

from __future__ import annotations

import os
import shutil

import grpc
import pytest
from conftest import SMALL_LAYOUT, kv_channel, random_blocks, same_bytes, tokens

from kvstore import KVStoreClient
from kvstore.errors import CapacityError
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

BB = SMALL_LAYOUT.block_bytes  # 8 KiB


def policy(extra: str = "") -> str:
    """A tenant policy giving this test's uid the tenants "hostile" and "victim" (tenants
    have slabs of their own then, like the real thing), plus ``extra`` ([tenants.*])."""
    return f"""
[[access]]
name = "tests"
uids = [{os.getuid()}]
tenants = ["hostile", "victim", "other"]
role = "operator"
{extra}
"""


def client(daemon, tenant: str, model: str = "q") -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model=model, tenant=tenant)


def n_blocks(kv: KVStoreClient) -> int:
    return kv.stats().tiers[0].capacity_bytes // BB


# ----------------------------------------------------------------- the two wedges


def test_a_tenant_leasing_everything_cannot_block_other_tenants_puts(daemon_factory) -> None:
    """Wedge 1: a hostile client filled the tier, leased every block and renewed its leases (a
    new Acquire before the old lease ran out): every other client's put was RESOURCE_EXHAUSTED
    for as long as it kept renewing. Now one tenant may pin at most
    ``limits.max_pinned_share`` of the tier; its leases past that are refused with a message
    naming the bound, and the victim's puts evict the hostile tenant's unpinned blocks."""
    d = daemon_factory(cpu_capacity="1MiB", slab="64KiB", extra=policy())
    hostile, victim = client(d, "hostile"), client(d, "victim")
    with hostile, victim:
        n = n_blocks(hostile)
        keys = hostile.hash_tokens(tokens(n))
        for i in range(0, n, 32):
            hostile.put(keys[i : i + 32], random_blocks(SMALL_LAYOUT, 32, seed=i))
        leases, refused = [], []
        with kv_channel(hostile) as ch:
            stub = pb_grpc.KVStoreStub(ch)
            for _round in range(2):  # lease everything, then renew every lease once
                for i in range(0, n, 16):
                    request = pb.AcquireRequest(
                        handle=hostile._handle, keys=b"".join(keys[i : i + 16])
                    )
                    try:
                        leases.append(stub.Acquire(request, timeout=10).lease_id)
                    except grpc.RpcError as e:
                        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                        refused.append(e.details())
            mine = victim.hash_tokens(tokens(8, offset=10_000))
            blocks = random_blocks(SMALL_LAYOUT, 8, seed=99)
            assert victim.put(mine, blocks) == 8  # RESOURCE_EXHAUSTED before the fix
            assert same_bytes(victim.get(mine), blocks)
            assert refused and all("max_pinned" in r for r in refused), refused[:1]
            for lease_id in leases:
                stub.Release(pb.ReleaseRequest(handle=hostile._handle, lease_id=lease_id))
    assert d.alive()


def test_a_tenant_reserving_the_whole_arena_cannot_block_others(daemon_factory) -> None:
    """Wedge 2: a hostile client reserved every slot and never committed: everyone's puts
    failed until the reservations expired (reservation_ttl_s) and their slots left quarantine
    (another reservation_ttl_s), and it could start again at once. Now its reservations past
    its pinned share are refused (quarantined slots count as its pins too), and the victim's
    puts go on."""
    d = daemon_factory(cpu_capacity="1MiB", slab="64KiB", reservation_ttl_s=60.0, extra=policy())
    hostile, victim = client(d, "hostile"), client(d, "victim")
    with hostile, victim:
        n = n_blocks(hostile)
        keys = hostile.hash_tokens(tokens(n))
        refused = []
        with kv_channel(hostile) as ch:
            stub = pb_grpc.KVStoreStub(ch)
            for i in range(0, n, 16):
                request = pb.ReserveRequest(handle=hostile._handle, keys=b"".join(keys[i : i + 16]))
                try:
                    stub.Reserve(request, timeout=10)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                    refused.append(e.details())
            mine = victim.hash_tokens(tokens(8, offset=10_000))
            blocks = random_blocks(SMALL_LAYOUT, 8, seed=98)
            assert victim.put(mine, blocks) == 8  # RESOURCE_EXHAUSTED for 60 s before the fix
            assert same_bytes(victim.get(mine), blocks)
            assert refused and all("max_pinned" in r for r in refused), refused[:1]
    assert d.alive()


# ----------------------------------------------------------------- quotas and guarantees


def tenant_stats(kv: KVStoreClient) -> dict:
    return {t.name: t for t in kv.stats().tenants}


def test_a_tenant_at_its_quota_evicts_its_own_blocks_first(daemon_factory) -> None:
    """A flood from a tenant at its quota_cpu evicts that tenant's own coldest blocks, never
    the victim's (which are older, so plain LRU would take them first); its CPU bytes never
    pass the quota, and Stats shows usage against it."""
    quota = 32 * BB
    d = daemon_factory(
        cpu_capacity="1MiB",
        slab="64KiB",
        extra=policy(f'[tenants.hostile]\nquota_cpu = "{quota}"\n'),
    )
    hostile, victim = client(d, "hostile"), client(d, "victim")
    with hostile, victim:
        mine = victim.hash_tokens(tokens(32, offset=50_000))
        blocks = random_blocks(SMALL_LAYOUT, 32, seed=7)
        assert victim.put(mine, blocks) == 32
        flood = hostile.hash_tokens(tokens(128))
        for i in range(0, 128, 16):
            assert hostile.put(flood[i : i + 16], random_blocks(SMALL_LAYOUT, 16, seed=i)) == 16
            books = tenant_stats(hostile)["hostile"]
            assert books.cpu_bytes <= quota and books.quota_cpu_bytes == quota, books
        assert victim.lookup(mine) == 32
        assert same_bytes(victim.get(mine), blocks)
        assert hostile.lookup(flood[:16]) == 0  # its own oldest went
        assert hostile.lookup(flood[-32:]) == 32  # its newest are all there
        assert tenant_stats(victim)["victim"].cpu_bytes == 32 * BB
        # A put it cannot make room for (its own blocks are all leased) is refused by name.
        with hostile.acquire(flood[-32:]) as lease:
            assert len(lease) == 32
            with pytest.raises(CapacityError, match="quota_cpu"):
                hostile.put(hostile.hash_tokens(tokens(1, offset=90_000)), blocks[:1])
    assert d.alive()


def test_a_victim_keeps_its_guaranteed_share_while_another_tenant_floods(daemon_factory) -> None:
    """The victim's blocks are the coldest in the tier, yet a flood of twice the tier from a
    tenant without quota never takes the victim below its guaranteed_cpu: the flood evicts
    its own blocks instead, and the victim still puts and gets."""
    d = daemon_factory(
        cpu_capacity="1MiB",
        slab="64KiB",
        extra=policy('[tenants.victim]\nguaranteed_cpu = "384KiB"\n'),
    )
    hostile, victim = client(d, "hostile"), client(d, "victim")
    with hostile, victim:
        mine = victim.hash_tokens(tokens(48, offset=50_000))
        blocks = random_blocks(SMALL_LAYOUT, 48, seed=8)
        assert victim.put(mine, blocks) == 48
        n = 2 * n_blocks(hostile)
        flood = hostile.hash_tokens(tokens(n))
        for i in range(0, n, 32):
            assert hostile.put(flood[i : i + 32], random_blocks(SMALL_LAYOUT, 32, seed=i)) == 32
        assert victim.lookup(mine) == 48
        assert same_bytes(victim.get(mine), blocks)
        books = tenant_stats(victim)["victim"]
        assert books.cpu_bytes == 48 * BB and books.guaranteed_cpu_bytes == 384 << 10
        more = victim.hash_tokens(tokens(8, offset=60_000))
        assert victim.put(more, blocks[:8]) == 8
        assert hostile.lookup(flood[-32:]) == 32
    assert d.alive()


def test_pins_leave_room_for_other_tenants_guarantees(daemon_factory) -> None:
    """A tenant allowed to pin the whole tier still cannot pin into the room another tenant's
    guarantee needs: the lease is refused with a message naming guaranteed_cpu."""
    d = daemon_factory(
        cpu_capacity="1MiB",
        slab="64KiB",
        extra=policy(
            '[tenants.hostile]\nmax_pinned = "1MiB"\n\n'
            '[tenants.victim]\nguaranteed_cpu = "512KiB"\n'
        ),
    )
    hostile, victim = client(d, "hostile"), client(d, "victim")
    with hostile, victim:
        keys = hostile.hash_tokens(tokens(96))
        for i in range(0, 96, 32):
            hostile.put(keys[i : i + 32], random_blocks(SMALL_LAYOUT, 32, seed=i))
        with hostile.acquire(keys[:64]) as lease:  # 512 KiB: up to the victim's guarantee
            assert len(lease) == 64
            with pytest.raises(CapacityError, match="guaranteed_cpu"):
                hostile.acquire(keys[64:72])
            mine = victim.hash_tokens(tokens(64, offset=50_000))
            blocks = random_blocks(SMALL_LAYOUT, 64, seed=3)
            assert victim.put(mine, blocks) == 64  # its whole guarantee, with hostile pinned
            assert same_bytes(victim.get(mine), blocks)


def test_the_keys_per_second_limit_refuses_with_resource_exhausted(
    daemon_factory, monkeypatch
) -> None:
    """Past keys_per_s (burst keys_burst) a lookup, acquire or reserve is RESOURCE_EXHAUSTED
    naming the limit and spends nothing; another tenant is unaffected, the daemon serves on.
    (Lookups a client answers from its presence table cost the daemon nothing and are not
    charged: these clients call for each.)"""
    monkeypatch.setenv("KVSTORE_PRESENCE_TABLES", "0")
    d = daemon_factory(
        extra=policy("[tenants.hostile]\nkeys_per_s = 1\nkeys_burst = 64\n"),
    )
    hostile, victim = client(d, "hostile"), client(d, "victim")
    with hostile, victim:
        keys = hostile.hash_tokens(tokens(64))
        assert hostile.lookup(keys) == 0  # the burst
        with pytest.raises(CapacityError, match="keys_per_s"):
            hostile.lookup(keys)
        with kv_channel(hostile) as ch:
            request = pb.ReserveRequest(handle=hostile._handle, keys=b"".join(keys[:8]))
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.KVStoreStub(ch).Reserve(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "keys_per_s" in (err.value.details() or "")
        assert tenant_stats(hostile)["hostile"].refused_keys >= 64 + 8
        for _ in range(20):  # a victim's calls are not counted against the hostile tenant
            assert victim.lookup(victim.hash_tokens(tokens(64))) == 0
    assert d.alive()


def test_leases_and_reservations_outstanding_are_bounded(daemon_factory) -> None:
    """max_leases and max_reservations bound what a tenant holds outstanding, by name."""
    d = daemon_factory(
        extra=policy("[tenants.hostile]\nmax_leases = 2\nmax_reservations = 1\n"),
    )
    with client(d, "hostile") as kv:
        keys = kv.hash_tokens(tokens(4))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 4))
        held = [kv.acquire(keys[:1]), kv.acquire(keys[1:2])]
        with pytest.raises(CapacityError, match="max_leases"):
            kv.acquire(keys[2:3])
        held.pop().release()
        held.append(kv.acquire(keys[2:3]))  # room again once one is released
        reservation = kv.reserve(kv.hash_tokens(tokens(1, offset=500)))
        with pytest.raises(CapacityError, match="max_reservations"):
            kv.reserve(kv.hash_tokens(tokens(1, offset=600)))
        reservation.abort()
        for lease in held:
            lease.release()


def test_a_namespace_quota_evicts_that_namespaces_blocks(daemon_factory) -> None:
    """[tenants.NAME.namespace] quota_cpu bounds each namespace of the tenant: a second
    namespace of the same tenant keeps its blocks while the first churns its own."""
    d = daemon_factory(
        cpu_capacity="1MiB",
        slab="64KiB",
        extra=policy(f'[tenants.hostile.namespace]\nquota_cpu = "{16 * BB}"\n'),
    )
    a, b = client(d, "hostile", model="a"), client(d, "hostile", model="b")
    with a, b:
        keep = b.hash_tokens(tokens(16))
        blocks = random_blocks(SMALL_LAYOUT, 16, seed=4)
        assert b.put(keep, blocks) == 16
        churn = a.hash_tokens(tokens(64))
        for i in range(0, 64, 8):
            a.put(churn[i : i + 8], random_blocks(SMALL_LAYOUT, 8, seed=i))
        assert a.lookup(churn[:8]) == 0 and a.lookup(churn[-16:]) == 16
        assert same_bytes(b.get(keep), blocks)
        assert tenant_stats(a)["hostile"].cpu_bytes == 32 * BB


# ----------------------------------------------------------------- a hostile client, another uid

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to run the hostile client under another uid",
)


@needs_root
def test_a_hostile_uid_cannot_starve_a_victim() -> None:
    """The hostile tenant is another uid, in its own process, mapping only its own slabs: it
    fills the tier, leases what it can and reserves the rest, over and over. The victim
    (this process) keeps its guaranteed share and its puts and gets succeed throughout."""
    import tempfile
    from pathlib import Path

    from conftest import DaemonProcess, config_toml
    from test_security import run_as

    base = Path(tempfile.mkdtemp(prefix="kvq-", dir="/tmp"))  # other uids can traverse it
    base.chmod(0o711)
    text = config_toml(cpu_capacity="1MiB", slab="64KiB") + policy(
        '[[access]]\nname = "mallory"\nuids = [2004]\ntenants = ["hostile"]\n\n'
        '[tenants.victim]\nguaranteed_cpu = "256KiB"\n'
    ).replace('"hostile", "victim", "other"', '"victim", "other"')
    d = DaemonProcess(base / "d", text)
    d.directory.mkdir()
    d.directory.chmod(0o711)
    d.start()
    try:
        with client(d, "victim") as victim:
            mine = victim.hash_tokens(tokens(32, offset=50_000))
            blocks = random_blocks(SMALL_LAYOUT, 32, seed=5)
            assert victim.put(mine, blocks) == 32
            out = run_as(
                2004,
                d.address,
                """
                kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="hostile")
                keys = kv.hash_tokens(list(range(16 * 256)))
                refused, stored, held = {}, 0, []
                for i in range(0, 256, 16):
                    try:
                        stored += kv.put(keys[i : i + 16], blocks(16, i))
                    except KVStoreError as e:
                        refused["put"] = str(e)
                for i in range(0, 256, 16):
                    try:
                        held.append(kv.acquire(keys[i : i + 16]))
                    except KVStoreError as e:
                        refused["lease"] = str(e)
                try:
                    kv.reserve(kv.hash_tokens(list(range(10**6, 10**6 + 16 * 96))))
                except KVStoreError as e:
                    refused["reserve"] = str(e)
                print(json.dumps({"stored": stored, "refused": refused,
                                  "leased": sum(len(h) for h in held)}))
                """,
            )
            assert out["stored"] > 0, out
            assert "max_pinned" in out["refused"].get("lease", ""), out
            assert "max_pinned" in out["refused"].get("reserve", ""), out
            assert victim.lookup(mine) == 32
            assert same_bytes(victim.get(mine), blocks)
            more = victim.hash_tokens(tokens(32, offset=70_000))
            assert victim.put(more, blocks) == 32
            assert same_bytes(victim.get(more), blocks)
        assert d.alive()
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)


# ----------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[tenants.a]\nquota_cpu = "lots"\n', "tenants.a.quota_cpu: cannot parse size"),
        ("[tenants.a]\nquota_gpu = 1\n", "unknown keys ['quota_gpu']"),
        ('[tenants.a]\nquota_redis = "1MiB"\n', "write it under [tenants.a.namespace]"),
        ('[tenants.a]\nquota_cpu = "1MiB"\nguaranteed_cpu = "2MiB"\n', "above its quota_cpu"),
        ('[tenants.a]\nguaranteed_cpu = "12MiB"\n[tenants.b]\nguaranteed_cpu = "12MiB"\n',
         "guaranteed_cpu add up to"),
        ("[tenants.a]\nkeys_burst = 10\n", "keys_burst needs keys_per_s"),
        ('[tenants.a]\nmax_pinned = "1GiB"\n', "more than the cpu tier"),
        ("[tenants.a.namespace]\nbogus = 1\n", "tenants.a.namespace: unknown keys"),
        ("[limits]\nmax_pinned_share = 1.5\n", "max_pinned_share"),
    ],
)  # fmt: skip
def test_bad_quota_configs_are_refused_with_a_message(tmp_path, text: str, words: str) -> None:
    from conftest import config_toml

    from kvstore.config import load_config

    path = tmp_path / "q.toml"
    path.write_text(config_toml(cpu_capacity="16MiB") + text)
    with pytest.raises(ValueError) as err:
        load_config(path, env={})
    assert words in str(err.value), str(err.value)


def test_stat_cli_shows_tenants_against_their_quotas(daemon_factory) -> None:
    import json
    import subprocess
    import sys

    d = daemon_factory(extra=policy('[tenants.victim]\nquota_cpu = "4MiB"\n'))
    with client(d, "victim") as kv:
        kv.put(kv.hash_tokens(tokens(2)), random_blocks(SMALL_LAYOUT, 2))
        out = subprocess.run(
            [sys.executable, "-m", "kvstore", "stat", "--address", d.address, "--json"],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        tenants = {t["name"]: t for t in json.loads(out.stdout)["tenants"]}
        assert tenants["victim"]["cpu_bytes"] == 2 * BB
        assert tenants["victim"]["quota_cpu_bytes"] == 4 << 20
        table = subprocess.run(
            [sys.executable, "-m", "kvstore", "stat", "--address", d.address],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        assert "TENANT" in table and "16.0KiB / 4.0MiB" in table, table


# ----------------------------------------------------------------- the tiers below


def test_a_tenant_at_its_nvme_quota_drops_its_own_disk_blocks(daemon_factory, tmp_path) -> None:
    """Write-back of a tenant at its quota_nvme makes room from that tenant's own coldest disk
    blocks: its NVMe bytes never pass the quota, its oldest blocks are gone, and the victim's
    blocks (written down first) stay readable."""
    quota = 48 * BB
    d = daemon_factory(
        cpu_capacity="256KiB",
        slab="64KiB",
        nvme_path=tmp_path / "nvme",
        nvme_capacity="4MiB",
        extra=policy(f'[tenants.hostile]\nquota_nvme = "{quota}"\n'),
    )
    hostile, victim = client(d, "hostile"), client(d, "victim")
    with hostile, victim:
        mine = victim.hash_tokens(tokens(16, offset=50_000))
        blocks = random_blocks(SMALL_LAYOUT, 16, seed=6)
        assert victim.put(mine, blocks) == 16
        flood = hostile.hash_tokens(tokens(256))
        for i in range(0, 256, 16):
            assert hostile.put(flood[i : i + 16], random_blocks(SMALL_LAYOUT, 16, seed=i)) == 16
            assert tenant_stats(hostile)["hostile"].nvme_bytes <= quota
        assert hostile.lookup(flood[:32]) == 0  # 256 blocks, at most 32 + 48 kept
        assert same_bytes(victim.get(mine), blocks)
        assert (
            tenant_stats(victim)["victim"].nvme_bytes + tenant_stats(victim)["victim"].cpu_bytes
            >= 16 * BB
        )
    assert d.alive()


def test_a_namespace_quota_bounds_what_it_keeps_in_redis(daemon_factory, redis_server) -> None:
    """[tenants.NAME.namespace] quota_redis bounds the bytes each of the tenant's namespaces
    keeps in Redis (the oldest go first); another tenant's blocks there are untouched."""
    from conftest import tiers, wait_for

    from kvstore.tiers.redis import HEADER_BYTES

    per = HEADER_BYTES + BB
    d = daemon_factory(
        cpu_capacity="1MiB",
        slab="64KiB",
        redis_url=redis_server.url,
        extra=policy(f"[tenants.hostile.namespace]\nquota_redis = {16 * per}\n"),
    )
    hostile, victim = client(d, "hostile"), client(d, "victim")
    with hostile, victim:
        mine = victim.hash_tokens(tokens(8, offset=50_000))
        assert victim.put(mine, random_blocks(SMALL_LAYOUT, 8, seed=2)) == 8
        flood = hostile.hash_tokens(tokens(64))
        for i in range(0, 64, 16):
            hostile.put(flood[i : i + 16], random_blocks(SMALL_LAYOUT, 16, seed=i))
        wait_for(lambda: tiers(victim)["redis"].demotions >= 72, what="write-through")
        # 16 of the hostile namespace's blocks, the victim's 8, the bounded namespace's index.
        assert int(redis_server.cli("DBSIZE").strip()) == 16 + 8 + 1
    assert d.alive()


# ----------------------------------------------------------------- the books, in the store


async def test_expired_reservations_stay_charged_until_their_quarantine_ends() -> None:
    """Reserving, letting the reservation expire and reserving again used to be the second
    wedge's loop: the expired slots sit in quarantine for another reservation_ttl_s. They stay
    charged to their tenant (cpu bytes and pins) until they are reusable, so the loop gains
    nothing; the books match the index at every step (``check``)."""
    from test_store import LAYOUT, Clock, keys

    from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig, TenantQuota
    from kvstore.daemon.store import BlockStore
    from kvstore.keys import Namespace

    clock = Clock()
    cfg = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        reservation_ttl_s=10,
        cpu=CpuTierConfig(
            capacity_bytes=16 * LAYOUT.block_bytes,
            slab_bytes=2 * LAYOUT.block_bytes,
            prefault=False,
        ),
        tenants=(TenantQuota("hostile"),),  # tenants configured: the default share is half
    )
    s = BlockStore(cfg, clock=clock)
    try:
        hostile = s.open_namespace(Namespace(model="m", layout=LAYOUT, tenant="hostile"))
        victim = s.open_namespace(Namespace(model="m", layout=LAYOUT, tenant="victim"))
        assert (await s.reserve(hostile, keys(8))).reservation_id  # half the tier
        with pytest.raises(CapacityError, match="max_pinned"):
            await s.reserve(hostile, keys(1, start=100))
        s.check()
        clock.now = 11.0
        assert s.reap() == (1, 0)
        books = s.quotas.tenant("hostile")
        assert books.reservations == 0 and books.pinned_bytes == 8 * LAYOUT.block_bytes
        assert books.cpu_bytes == 8 * LAYOUT.block_bytes
        with pytest.raises(CapacityError, match="max_pinned"):
            await s.reserve(hostile, keys(1, start=100))  # the quarantine is still its pin
        assert (await s.reserve(victim, keys(8, start=200))).reservation_id  # the other half
        s.check()
        clock.now = 22.0
        s.reap()
        assert books.pinned_bytes == 0 and books.cpu_bytes == 0
        s.check()
    finally:
        s.close()


def test_a_tenant_whose_quota_equals_its_guarantee_still_evicts_its_own(daemon_factory) -> None:
    """A guarantee protects a tenant from others, never from its own quota: at
    quota_cpu == guaranteed_cpu its puts still make room from its own coldest blocks."""
    d = daemon_factory(
        cpu_capacity="1MiB",
        slab="64KiB",
        extra=policy(f'[tenants.victim]\nquota_cpu = "{16 * BB}"\nguaranteed_cpu = "{16 * BB}"\n'),
    )
    with client(d, "victim") as kv:
        keys = kv.hash_tokens(tokens(48))
        for i in range(0, 48, 8):
            assert kv.put(keys[i : i + 8], random_blocks(SMALL_LAYOUT, 8, seed=i)) == 8
        assert kv.lookup(keys[:8]) == 0 and kv.lookup(keys[-16:]) == 16
        assert tenant_stats(kv)["victim"].cpu_bytes == 16 * BB


# ----------------------------------------------------------------- under random use


def _quota_machine():  # type: ignore[no-untyped-def]
    """The store's random-use machine (``test_store_properties``) with tenant t1 under a CPU
    quota and t2 holding a guarantee: after every step the books match the index, t1 is within
    its quota and its pinned share, pins leave room for t2's guarantee, and no step of t1's
    took t2 below its guarantee."""
    import dataclasses

    from hypothesis import settings
    from hypothesis.stateful import invariant
    from test_store_properties import NAMESPACES, SMALL, StoreMachine

    from kvstore.config import Quota, TenantQuota

    quota, guaranteed = 10 * SMALL.block_bytes, 6 * SMALL.block_bytes

    class QuotaMachine(StoreMachine):
        def __init__(self) -> None:
            super().__init__()
            self.run(self.store.stop())
            self.config = dataclasses.replace(
                self.config,
                tenants=(
                    TenantQuota("t1", tenant=Quota(cpu_bytes=quota)),
                    TenantQuota("t2", guaranteed_cpu_bytes=guaranteed),
                ),
            )
            self.store = self._start()
            self.last_tenant: str | None = None
            self.t2_before = 0

        def handle(self, ns: int):  # type: ignore[no-untyped-def]
            self.last_tenant = NAMESPACES[ns].tenant
            return super().handle(ns)

        @invariant()
        def quotas_hold(self) -> None:
            self.settle()
            quotas = self.store.quotas
            t1, t2 = quotas.tenant("t1"), quotas.tenant("t2")
            assert t1.cpu_bytes <= quota, f"t1 holds {t1.cpu_bytes} over its quota {quota}"
            assert t1.pinned_bytes <= quotas.pinned_cap(t1)
            assert quotas.total_pinned + max(0, guaranteed - t2.pinned_bytes) <= quotas.capacity
            if self.last_tenant == "t1":
                floor = min(self.t2_before, guaranteed)
                assert t2.cpu_bytes >= floor, f"t1 took t2 to {t2.cpu_bytes}, under {floor}"
            self.last_tenant = None
            self.t2_before = t2.cpu_bytes

    QuotaMachine.TestCase.settings = settings(
        max_examples=60, stateful_step_count=40, deadline=None, derandomize=True
    )
    return QuotaMachine.TestCase


TestQuotasUnderRandomUse = _quota_machine()


async def test_books_of_tenants_nobody_configured_go_with_their_last_namespace() -> None:
    """Without a policy a client names any tenant: the books of one the config does not name
    are forgotten with its last namespace, so ever new names fill nothing; a configured
    tenant's books (its rate bucket) stay."""
    from test_store import LAYOUT, keys

    from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig, Quota, TenantQuota
    from kvstore.daemon.store import BlockStore
    from kvstore.keys import Namespace

    cfg = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        cpu=CpuTierConfig(capacity_bytes=16 * LAYOUT.block_bytes, prefault=False),
        tenants=(TenantQuota("kept", tenant=Quota(keys_per_s=1.0, keys_burst=4)),),
    )
    s = BlockStore(cfg)
    try:
        for i in range(50):
            h = s.open_namespace(Namespace(model="m", layout=LAYOUT, tenant=f"t{i}"))
            await s.lookup(h, keys(1))
            s.close_handle(h)
        assert [b.name for b in s.quotas.tenants()] == []
        h = s.open_namespace(Namespace(model="m", layout=LAYOUT, tenant="kept"))
        await s.lookup(h, keys(4))
        s.close_handle(h)
        h = s.open_namespace(Namespace(model="m", layout=LAYOUT, tenant="kept"))
        with pytest.raises(CapacityError, match="keys_per_s"):  # closing did not refill it
            await s.lookup(h, keys(4))
        s.close_handle(h)
        assert [b.name for b in s.quotas.tenants()] == ["kept"]
        s.check()
    finally:
        s.close()
