"""The ``batch_*_v2`` calls of kvstore's SGLang backend (hybrid models' side pools), against
SGLang's real host pools on CPU and a real daemon: the sliding-window pool of SGLang's hybrid-SWA
stack (``MHATokenToKVPoolHost``), Mamba state pools (``MambaPoolHost``, with and without slot
side states) and the DSA indexer pool (``DSAIndexerPoolHost`` over a ``DSATokenToKVPool``), each
registered as SGLang's controller registers them (``register_mem_host_pool_v2``) on a backend
made by SGLang's own factory. SGLang's ``HiCacheFile`` is the oracle of ``batch_exists_v2``."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess

from .conftest import HAVE_SGLANG, kvstore_config, mamba_host_pool, storage_config

if not HAVE_SGLANG:
    pytest.skip("needs SGLang (make sglang-env)", allow_module_level=True)

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from sglang.srt.mem_cache.pool_host.dsa import (
    DSAIndexerPoolHost,
    make_dsa_indexer_pool_decl,
)
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.runtime_context import get_memory

from kvstore.integrations.sglang import KVStoreHiCacheStorage
from kvstore.integrations.sglang_pages import HostPages, Space

LOGGER = "kvstore.integrations.sglang"
ALL, TRAILING = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES


def attach(backend: Any, anchor: Any, side: dict[str, Any]) -> Any:
    """What SGLang's hybrid controller does at attach: the anchor, then every pool of the group
    (the anchor too) through ``register_mem_host_pool_v2``, then the end of the burst."""
    backend.register_mem_pool_host(anchor)
    backend.register_mem_host_pool_v2(anchor, PoolName.KV)
    for name, pool in side.items():
        backend.register_mem_host_pool_v2(pool, PoolName(name))
    backend.on_host_pools_registered()
    return backend


def make_backend(
    address: str,
    anchor: Any,
    side: dict[str, Any],
    *,
    model: str,
    mla: bool = False,
    tp: tuple[int, int] = (0, 1),
    **more: Any,
) -> Any:
    config = storage_config(model, kvstore_config(address, **more), mla=mla, tp=tp)
    backend = StorageBackendFactory.create_backend("dynamic", config, anchor)
    assert type(backend) is KVStoreHiCacheStorage
    return attach(backend, anchor, side)


def buffers(pool: Any) -> list[Any]:
    """The memory of a host pool's pages."""
    held = getattr(pool, "kv_buffer", None)
    if held is None:
        held = pool.index_k_with_scale_buffer
    return list(held) if isinstance(held, (list, tuple)) else [held]


def fill_random(pool: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for b in buffers(pool):
        raw = b.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


def page(pool: Any, start: int) -> bytes:
    return pool.get_data_page(start, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def slots(pool: Any, first: int, n: int) -> Any:
    """Host indices of ``n`` pages from page ``first``, as the controller passes them."""
    ps = pool.page_size
    return torch.arange(first * ps, (first + n) * ps, dtype=torch.int64)


def starts(pool: Any, indices: Any) -> list[int]:
    return [int(i) for i in indices[:: pool.page_size]]


def keys_of(tag: str, n: int) -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def transfer(name: str, keys: list[str], indices: Any = None, policy: Any = ALL) -> Any:
    return PoolTransfer(name=PoolName(name), host_indices=indices, keys=keys, hit_policy=policy)


def wrote_only(pool: Any, before: list[Any], indices: Any) -> bool:
    """Whether the pool differs from ``before`` (a copy of its buffers) in the pages of
    ``indices`` alone: with those pages put back as they were (through the pool's own
    ``set_from_flat_data_page``), it is ``before`` again. The pool is left as it is."""
    now = buffers(pool)
    after = [b.clone() for b in now]
    targets = starts(pool, indices)
    for b, old in zip(now, before, strict=True):
        b.copy_(old)
    old_pages = {s: pool.get_data_page(s, flat=True).clone() for s in targets}
    for b, new in zip(now, after, strict=True):
        b.copy_(new)
    for s, old_page in old_pages.items():
        pool.set_from_flat_data_page(s, old_page)
    same = all(
        torch.equal(b.view(torch.uint8), old.view(torch.uint8))
        for b, old in zip(now, before, strict=True)
    )
    for b, new in zip(now, after, strict=True):
        b.copy_(new)
    return same


def read_into_other_pages(
    backend: Any, pool: Any, name: str, keys: list[str], src: Any, dst: Any
) -> None:
    """Wipe the ``dst`` pages, read ``keys`` into them, and check that they now hold the bytes of
    the ``src`` pages and that nothing else of the pool changed."""
    wanted = [page(pool, s) for s in starts(pool, src)]
    zeros = torch.zeros_like(pool.get_dummy_flat_data_page())
    for s in starts(pool, dst):
        pool.set_from_flat_data_page(s, zeros)
    before = [b.clone() for b in buffers(pool)]
    got = backend.batch_get_v2([transfer(name, keys, dst)])
    assert got == {PoolName(name): [True] * len(keys)}
    assert [page(pool, s) for s in starts(pool, dst)] == wanted
    assert wrote_only(pool, before, dst), "the read wrote outside its pages"


def dsa_pools(layout: str) -> tuple[Any, Any]:
    """SGLang's DSA (sparse attention) KV on CPU: the MLA host pool of a ``DSATokenToKVPool``
    (built by SGLang's ``build_kv_host_pool``, unpinned) and its ``DSAIndexerPoolHost`` (64-token
    pages, as DSA requires)."""
    dsa = DSATokenToKVPool(256, 64, 32, torch.bfloat16, 8, 2, "cpu", 128, False, 40)
    asm = hybrid_pool_assembler
    mla_cls = asm.MLATokenToKVPoolHost
    asm.MLATokenToKVPoolHost = lambda *a, **k: mla_cls(*a, pin_memory=False, **k)
    try:
        with get_memory().override(hicache_mem_layout=layout, hicache_ratio=2.0):
            anchor = asm.build_kv_host_pool(kv_pool=dsa, page_size=64, use_mla=True)
    finally:
        asm.MLATokenToKVPoolHost = mla_cls
    indexer = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(dsa), anchor, pin_memory=False)
    return anchor, indexer


SIDE_CASES = [
    ("swa", "page_first", {}),
    ("swa", "layer_first", {}),
    ("swa", "page_head", {}),
    ("mamba", "page_first", {}),
    ("mamba", "page_first_direct", {}),
    ("mamba", "page_first", {"slot_states": True}),
    ("indexer", "page_first", {}),
    ("indexer", "layer_first", {}),
]


def side_stack(make_hybrid_pools: Any, name: str, layout: str, opts: dict) -> tuple[Any, dict]:
    if name == "indexer":
        anchor, indexer = dsa_pools(layout)
        return anchor, {"indexer": indexer}
    mamba_layout = layout if layout.startswith("page_first") else "page_first"
    hp = make_hybrid_pools(
        layout if name == "swa" else "page_first", mamba_layout=mamba_layout, **opts
    )
    return hp.host, hp.side


@pytest.mark.parametrize("name,layout,opts", SIDE_CASES)
def test_side_pool_pages_round_trip_bit_exact_into_other_pages(
    daemon: DaemonProcess, make_hybrid_pools: Any, name: str, layout: str, opts: dict
) -> None:
    anchor, side = side_stack(make_hybrid_pools, name, layout, opts)
    pool = side[name]
    fill_random(pool, seed=len(layout) + len(opts))
    model = f"rt-{name}-{layout}-{len(opts)}"
    backend = make_backend(daemon.address, anchor, side, model=model)
    try:
        space = backend.side.spaces[name]
        assert space.fmt.zero_copy  # one copy each way
        keys = keys_of(model, 3)
        src, dst = slots(pool, 1, 3), slots(pool, 4, 3)
        assert backend.batch_set_v2([transfer(name, keys, src)]) == {PoolName(name): [True] * 3}
        read_into_other_pages(backend, pool, name, keys, src, dst)
        counters = backend.counters()
        assert counters["side_pages_written"] == 3 and counters["side_hits"] == 3
        assert counters["pages_written"] == 0 and counters["hits"] == 0  # not KV pages
    finally:
        backend.close()


def test_the_flat_page_path_stores_what_the_zero_copy_one_does(
    daemon: DaemonProcess, make_hybrid_pools: Any
) -> None:
    """A pool whose pages are not views goes through its own flat-page copies: the same bytes,
    in the same namespace (here a Mamba pool with slot states, made to take that path)."""
    hp = make_hybrid_pools(slot_states=True)
    mamba = hp.side["mamba"]
    fill_random(mamba, seed=21)
    backend = make_backend(daemon.address, hp.host, hp.side, model="flat-side")
    try:
        direct = backend.side.spaces["mamba"]
        fmt = dataclasses.replace(direct.fmt, zero_copy=False)
        flat = Space("mamba", HostPages(mamba, fmt, side=True), direct.revision, 0, 1)
        keys = keys_of("flat-side", 4)
        backend.side.spaces["mamba"] = flat
        assert backend.batch_set_v2([transfer("mamba", keys[:2], slots(mamba, 1, 2))]) == {
            PoolName.MAMBA: [True, True]
        }
        backend.side.spaces["mamba"] = direct
        assert backend.batch_set_v2([transfer("mamba", keys[2:], slots(mamba, 3, 2))]) == {
            PoolName.MAMBA: [True, True]
        }
        read_into_other_pages(backend, mamba, "mamba", keys, slots(mamba, 1, 4), slots(mamba, 8, 4))
        backend.side.spaces["mamba"] = flat
        read_into_other_pages(backend, mamba, "mamba", keys, slots(mamba, 1, 4), slots(mamba, 8, 4))
    finally:
        backend.close()


def test_pools_never_read_each_others_pages(daemon: DaemonProcess, make_hybrid_pools: Any) -> None:
    """The SWA pool here has the KV pool's very page format, and a second name for the same
    pool: pages stored in one are misses in the others, by lookup and by read; and bytes moved
    from one pool's slot into another's, under the same key, fail their check (the checksum is
    bound to the namespace)."""
    hp = make_hybrid_pools(kv_layers=2, swa_layers=2)
    swa = hp.side["swa"]
    assert buffers(swa)[0].shape == buffers(hp.host)[0].shape
    side = {**hp.side, "draft_swa": swa}
    fill_random(hp.host, seed=31)
    fill_random(swa, seed=32)
    backend = make_backend(daemon.address, hp.host, side, model="apart")
    try:
        kv_only, swa_only, both = keys_of("kv", 2), keys_of("swa", 2), keys_of("both", 1)
        assert backend.batch_set_v1(kv_only + both, slots(hp.host, 1, 3)) == [True] * 3
        assert backend.batch_set_v2([transfer("swa", swa_only + both, slots(swa, 5, 3))]) == {
            PoolName.SWA: [True] * 3
        }
        assert backend.batch_exists(swa_only) == 0
        assert backend.batch_get_v1(swa_only, slots(hp.host, 10, 2)) == [False, False]
        for name in ("swa", "draft_swa"):
            assert backend.batch_get_v2([transfer(name, kv_only, slots(swa, 10, 2))]) == {
                PoolName(name): [False, False]
            }
            got = backend.batch_exists_v2(kv_only, [transfer(name, [], policy=ALL)])
            assert got.kv_hit_pages == 0 and got.restorable_prefix_pages == []
        assert backend.batch_get_v2([transfer("draft_swa", swa_only, slots(swa, 10, 2))]) == {
            PoolName.DRAFT_SWA: [False, False]
        }

        # The KV page of key ``both`` copied over its SWA page, inside the daemon's memory.
        kv_client = backend._client()
        swa_client = backend._client(backend.side.spaces["swa"])
        nbytes = backend.side.spaces["swa"].fmt.page_bytes
        key = bytes.fromhex(both[0])
        with kv_client.acquire([key]) as lease:
            kv_bytes = kv_client._arena.slot(lease.offsets[0], nbytes).clone()
        with swa_client.acquire([key]) as lease:
            swa_client._arena.slot(lease.offsets[0], nbytes)[:] = kv_bytes
        assert backend.batch_get_v2([transfer("swa", both, slots(swa, 12, 1))]) == {
            PoolName.SWA: [False]
        }
    finally:
        backend.close()


def test_a_corrupt_side_page_is_a_miss(daemon: DaemonProcess, make_hybrid_pools: Any) -> None:
    hp = make_hybrid_pools()
    mamba = hp.side["mamba"]
    fill_random(mamba, seed=41)
    backend = make_backend(daemon.address, hp.host, hp.side, model="corrupt-side")
    try:
        keys = keys_of("corrupt-side", 3)
        assert backend.batch_set_v2([transfer("mamba", keys, slots(mamba, 1, 3))]) == {
            PoolName.MAMBA: [True] * 3
        }
        space = backend.side.spaces["mamba"]
        client = backend._client(space)
        with client.acquire([bytes.fromhex(k) for k in keys]) as lease:
            slot = client._arena.slot(lease.offsets[1], space.fmt.page_bytes)
        slot[-1] ^= 0xFF  # the last byte of the last conv state of page 1
        got = backend.batch_get_v2([transfer("mamba", keys, slots(mamba, 8, 3))])
        assert got == {PoolName.MAMBA: [True, False, False]}
        assert page(mamba, 8) == page(mamba, 1)
        assert backend.counters()["side_misses"] == 2
    finally:
        backend.close()


def test_unknown_pools_and_wrong_sizes_are_misses_with_one_warning(
    daemon: DaemonProcess, make_hybrid_pools: Any, caplog: pytest.LogCaptureFixture
) -> None:
    hp = make_hybrid_pools()
    mamba, swa = hp.side["mamba"], hp.side["swa"]
    fill_random(mamba, seed=51)
    # A Mamba pool whose pages are 3 bytes: no raw-bytes layout holds them.
    odd = mamba_host_pool(
        layers=1, temporal=(2,), temporal_dtype=torch.uint8, conv=((1,),), conv_dtype=torch.uint8
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        backend = make_backend(daemon.address, hp.host, {**hp.side, "draft": odd}, model="bad-side")
        try:
            keys = keys_of("bad-side", 2)
            assert backend.batch_set_v2([transfer("mamba", keys, slots(mamba, 1, 2))]) == {
                PoolName.MAMBA: [True, True]
            }
            for _ in range(2):
                # A pool no one registered, and one whose pages cannot be stored.
                for name in ("indexer", "draft"):
                    assert backend.batch_set_v2([transfer(name, keys, slots(mamba, 1, 2))]) == {
                        PoolName(name): [False, False]
                    }
                    assert backend.batch_get_v2([transfer(name, keys, slots(mamba, 1, 2))]) == {
                        PoolName(name): [False, False]
                    }
                # Host indices that are not one page per key, or none.
                for indices in (slots(mamba, 1, 3), slots(swa, 1, 1), None):
                    assert backend.batch_get_v2([transfer("mamba", keys, indices)]) == {
                        PoolName.MAMBA: [False, False]
                    }
                # Keys that are not 64 hex digits.
                assert backend.batch_get_v2(
                    [transfer("mamba", [keys[0], "zz"], slots(mamba, 4, 2))]
                ) == {PoolName.MAMBA: [True, False]}
            # Each pool answers for itself in one call.
            got = backend.batch_get_v2(
                [
                    transfer("indexer", keys, slots(mamba, 1, 2)),
                    transfer("mamba", keys, slots(mamba, 5, 2)),
                ]
            )
            assert got == {PoolName.INDEXER: [False, False], PoolName.MAMBA: [True, True]}
        finally:
            backend.close()
    warned = [r.getMessage() for r in caplog.records]
    assert len([m for m in warned if "no side pool 'indexer'" in m]) == 1
    assert len([m for m in warned if "side pool 'draft'" in m]) == 1  # at registration
    assert any("host indices" in m for m in warned)


def test_a_pool_registered_again_with_another_page_size_misses_its_old_pages(
    daemon: DaemonProcess, make_hybrid_pools: Any
) -> None:
    hp = make_hybrid_pools()
    fill_random(hp.side["mamba"], seed=61)
    keys = keys_of("resized", 2)
    backend = make_backend(daemon.address, hp.host, hp.side, model="resized")
    try:
        assert backend.batch_set_v2([transfer("mamba", keys, slots(hp.side["mamba"], 1, 2))]) == {
            PoolName.MAMBA: [True, True]
        }
        bigger = mamba_host_pool(temporal=(2, 4, 8))
        backend.register_mem_host_pool_v2(bigger, PoolName.MAMBA)
        assert backend.batch_get_v2([transfer("mamba", keys, slots(bigger, 1, 2))]) == {
            PoolName.MAMBA: [False, False]
        }
        result = backend.batch_exists_v2(keys, [transfer("mamba", ["x"], policy=TRAILING)])
        assert result.kv_hit_pages == 0
    finally:
        backend.close()


def file_backend(tmp_path: Path, anchor: Any, side: dict[str, Any]) -> Any:
    config = storage_config("oracle", {"file_storage_path": str(tmp_path / "hicache")})
    return attach(HiCacheFile(config), anchor, side)


def test_exists_v2_answers_as_sglangs_file_backend(
    daemon: DaemonProcess, make_hybrid_pools: Any, tmp_path: Path
) -> None:
    """The same pages stored in kvstore and in SGLang's own ``HiCacheFile``: ``batch_exists_v2``
    gives the same usable prefix, per-pool boundaries and restorable prefix lengths, for every
    hit policy SGLang's backends implement and mixes of them, over KV gaps and side-pool gaps."""
    hp = make_hybrid_pools()
    swa, mamba = hp.side["swa"], hp.side["mamba"]
    for pool in (hp.host, swa, mamba):
        fill_random(pool, seed=71)
    ours = make_backend(daemon.address, hp.host, hp.side, model="oracle")
    theirs = file_backend(tmp_path, hp.host, hp.side)
    keys = keys_of("oracle", 8)
    kv_pages = [0, 1, 2, 3, 4, 5, 7]  # a gap at page 6
    swa_pages = [0, 1, 3, 4, 5, 7]
    mamba_pages = [1, 4, 5, 7]
    try:
        for b in (ours, theirs):
            for i in kv_pages:  # HiCacheFile has no batch_set_v1: flat pages, for both
                assert b.batch_set([keys[i]], [hp.host.get_data_page((1 + i) * hp.page_size)])
            for name, pages_ in (("swa", swa_pages), ("mamba", mamba_pages)):
                for i in pages_:
                    pool = hp.side[name]
                    got = b.batch_set_v2([transfer(name, [keys[i]], slots(pool, 1 + i, 1))])
                    assert got == {PoolName(name): [True]}
        queries = [
            [],
            [transfer("mamba", ["x"], policy=TRAILING)],
            [transfer("swa", ["x", "x"], policy=TRAILING)],
            [transfer("swa", ["x"] * 3, policy=TRAILING)],
            [transfer("swa", [], policy=ALL)],
            [transfer("mamba", [], policy=ALL)],
            [
                transfer("swa", ["x", "x"], policy=TRAILING),
                transfer("mamba", ["x"], policy=TRAILING),
            ],
            [transfer("mamba", ["x"], policy=TRAILING), transfer("swa", [], policy=ALL)],
        ]
        for query in queries:
            for span in (keys, keys[2:], keys[:3]):
                a = ours.batch_exists_v2(span, [dataclasses.replace(t) for t in query])
                b = theirs.batch_exists_v2(span, [dataclasses.replace(t) for t in query])
                what = ([t.name for t in query], len(span))
                assert a.kv_hit_pages == b.kv_hit_pages, what
                assert dict(a.extra_pool_hit_pages) == dict(b.extra_pool_hit_pages), what
                assert list(a.restorable_prefix_pages) == list(b.restorable_prefix_pages), what
        # One they do not implement: a miss here, with a warning (theirs raises).
        got = ours.batch_exists_v2(
            keys, [transfer("swa", ["x"], policy=PoolHitPolicy.BLOCK_GROUPS)]
        )
        assert got.kv_hit_pages == 0 and got.restorable_prefix_pages == []
    finally:
        ours.close()


def test_mla_ranks_share_replicated_pools_and_never_a_sharded_one(
    daemon: DaemonProcess, make_hybrid_pools: Any
) -> None:
    """An MLA model's DSA indexer pages are the same on every TP rank: one rank writes, every
    rank reads them, as SGLang's controller expects. Mamba states and MHA (SWA) pages are
    per rank even then: another rank's are misses."""
    anchor, indexer = dsa_pools("page_first")
    hp = make_hybrid_pools()
    side = {"indexer": indexer, "mamba": hp.side["mamba"], "swa": hp.side["swa"]}
    for pool in side.values():
        fill_random(pool, seed=81)
    rank0 = make_backend(daemon.address, anchor, side, model="mla-side", mla=True, tp=(0, 2))
    rank1 = make_backend(daemon.address, anchor, side, model="mla-side", mla=True, tp=(1, 2))
    try:
        keys = keys_of("mla-side", 2)
        for name, pool in side.items():
            got = rank0.batch_set_v2([transfer(name, keys, slots(pool, 1, 2))])
            assert got == {PoolName(name): [True, True]}
        read_into_other_pages(
            rank1, indexer, "indexer", keys, slots(indexer, 1, 2), slots(indexer, 3, 2)
        )
        for name in ("mamba", "swa"):
            got = rank1.batch_get_v2([transfer(name, keys, slots(side[name], 4, 2))])
            assert got == {PoolName(name): [False, False]}
            assert rank0.batch_get_v2([transfer(name, keys, slots(side[name], 4, 2))]) == {
                PoolName(name): [True, True]
            }
    finally:
        rank0.close()
        rank1.close()


def test_a_daemon_that_is_down_is_a_miss_for_side_pools(
    tmp_path: Path, make_hybrid_pools: Any, caplog: pytest.LogCaptureFixture
) -> None:
    hp = make_hybrid_pools()
    address = f"unix:{tmp_path / 'nobody.sock'}"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        backend = make_backend(
            address, hp.host, hp.side, model="down-side", timeout_s=0.5, retry_after_s=0
        )
        try:
            keys = keys_of("down-side", 2)
            for _ in range(2):
                for name in ("swa", "mamba"):
                    t = transfer(name, keys, slots(hp.side[name], 1, 2))
                    assert backend.batch_set_v2([t]) == {PoolName(name): [False, False]}
                    assert backend.batch_get_v2([t]) == {PoolName(name): [False, False]}
                got = backend.batch_exists_v2(keys, [transfer("mamba", ["x"], policy=TRAILING)])
                assert got.kv_hit_pages == 0
                backend.clear()
        finally:
            backend.close()
    assert len([r for r in caplog.records if "pages are misses" in r.getMessage()]) == 1


def test_clear_deletes_the_side_pools_pages_too(
    daemon: DaemonProcess, make_hybrid_pools: Any
) -> None:
    hp = make_hybrid_pools()
    fill_random(hp.side["mamba"], seed=91)
    backend = make_backend(daemon.address, hp.host, hp.side, model="clear-side")
    try:
        keys = keys_of("clear-side", 2)
        assert backend.batch_set_v1(keys, slots(hp.host, 1, 2)) == [True, True]
        t = transfer("mamba", keys, slots(hp.side["mamba"], 1, 2), TRAILING)
        assert backend.batch_set_v2([t]) == {PoolName.MAMBA: [True, True]}
        assert backend.batch_exists_v2(keys, [t]).kv_hit_pages == 2
        backend.clear()
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v2([t]) == {PoolName.MAMBA: [False, False]}
    finally:
        backend.close()
