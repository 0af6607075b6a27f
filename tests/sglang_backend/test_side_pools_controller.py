"""Hybrid models' side pools through SGLang's real ``HybridCacheController`` (``conftest.py``
here) and kvstore's backend, against a real daemon: its backup thread writes the KV pages
(``batch_set_v1``) and the side pools' pages (``batch_set_v2``), its prefetch query thread asks
``batch_exists_v2`` with each pool's hit policy, and its IO thread loads the KV pages and then
the side pools' (``batch_get_v2``) into other host pages. The side pools: SGLang's hybrid-SWA
stack's sliding-window pool and a Mamba state pool (trailing pages), and the DSA indexer pool of
an MLA model (every page, on the KV pool's host indices)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import DaemonProcess

from .conftest import HAVE_SGLANG, Pools, kvstore_config

if not HAVE_SGLANG:
    pytest.skip("needs SGLang (make sglang-env)", allow_module_level=True)

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as asm
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup

from .test_side_pools import buffers, dsa_pools, fill_random, page, wrote_only

TRAILING = PoolHitPolicy.TRAILING_PAGES


def pages_of(pool: Any, indices: Any) -> list[bytes]:
    return [page(pool, int(s)) for s in indices[:: pool.page_size]]


def side_backup(pools: Any, hashes: list[str], window: int) -> tuple[list[Any], dict[str, Any]]:
    """The transfers SGLang's hybrid caches hand a backup: the SWA pages of the last ``window``
    pages and the Mamba state of the last page, in host slots filled with random bytes."""
    swa, mamba = pools.side["swa"], pools.side["mamba"]
    where = {"swa": swa.alloc(window * swa.page_size), "mamba": mamba.alloc(1)}
    extra = [
        PoolTransfer(
            PoolName.SWA, host_indices=where["swa"], keys=hashes[-window:], hit_policy=TRAILING
        ),
        PoolTransfer(
            PoolName.MAMBA, host_indices=where["mamba"], keys=hashes[-1:], hit_policy=TRAILING
        ),
    ]
    return extra, where


def side_prefetch(pools: Any, window: int) -> tuple[list[Any], Any]:
    """The transfers of a prefetch query (placeholder keys: only their number counts), and the
    step that gives them host slots once the hit is known, as SGLang's caches do."""
    extra = [
        PoolTransfer(PoolName.SWA, keys=["?"] * window, hit_policy=TRAILING),
        PoolTransfer(PoolName.MAMBA, keys=["?"], hit_policy=TRAILING),
    ]

    def give(op: Any) -> None:
        swa, mamba = pools.side["swa"], pools.side["mamba"]
        extra[0].host_indices = swa.alloc(window * swa.page_size)
        extra[1].host_indices = mamba.alloc(1)

    return extra, give


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_head"])
def test_swa_and_mamba_pages_come_back_bit_exact_through_prefetch(
    daemon: DaemonProcess, make_hybrid_pools: Any, make_controller: Any, layout: str
) -> None:
    pools = make_hybrid_pools(layout)
    c = make_controller(pools, kvstore_config(daemon.address), model_name=f"side-{layout}")
    ps = c.page_size
    tokens = [300 + 3 * i for i in range(3 * ps)]
    src = c.alloc(3)
    kv_written = c.fill_random(src, seed=len(layout))
    for pool in pools.side.values():
        fill_random(pool, seed=len(layout) + 1)
    extra, where = side_backup(pools, c.hashes(tokens), window=2)
    side_written = {n: pages_of(pools.side[n], where[n]) for n in where}
    assert c.backup(src, tokens, extra_pools=extra) == 3 * ps

    before = {n: [b.clone() for b in buffers(p)] for n, p in pools.side.items()}
    query, give = side_prefetch(pools, window=2)
    got = c.prefetch(tokens + [9] * ps, extra_pools=query, side_indices=give)
    assert got.hit_tokens == 3 * ps and got.completed_tokens == 3 * ps
    assert c.read_pages(got.host_indices) == kv_written
    assert got.pool_hits == {"swa": 2, "mamba": 1}
    for t in query:
        name = str(t.name)
        assert pages_of(pools.side[name], t.host_indices) == side_written[name]
        pool = pools.side[name]
        assert wrote_only(pool, before[name], t.host_indices), f"{name}: wrote outside its pages"
    counters = c.backend.counters()
    assert counters["side_pages_written"] == 3 and counters["side_hits"] == 3


def test_the_prefetch_stops_where_every_pool_can_restore(
    daemon: DaemonProcess, make_hybrid_pools: Any, make_controller: Any
) -> None:
    """Four KV pages are stored, the Mamba state and SWA window only at the end of the second:
    a prefetch of the four loads two pages and the state of the second (the longest prefix all
    pools can restore), and a prefetch with no side state stored is no hit at all."""
    pools = make_hybrid_pools()
    c = make_controller(pools, kvstore_config(daemon.address), model_name="side-stops")
    ps = c.page_size
    tokens = [700 + i for i in range(4 * ps)]
    hashes = c.hashes(tokens)
    src = c.alloc(4)
    c.fill_random(src, seed=5)
    for pool in pools.side.values():
        fill_random(pool, seed=6)
    extra, where = side_backup(pools, hashes[:2], window=2)
    mamba_state = pages_of(pools.side["mamba"], where["mamba"])
    assert c.backup(src[: 2 * ps], tokens[: 2 * ps], extra_pools=extra) == 2 * ps
    assert c.backup(src[2 * ps :], tokens[2 * ps :], hashes=hashes[2:]) == 2 * ps
    assert c.backend.batch_exists(hashes) == 4

    query, give = side_prefetch(pools, window=2)
    got = c.prefetch(tokens, extra_pools=query, side_indices=give)
    assert got.hit_tokens == 2 * ps and got.completed_tokens == 2 * ps
    assert pages_of(pools.side["mamba"], query[1].host_indices) == mamba_state

    other = [900 + i for i in range(2 * ps)]
    src2 = c.alloc(2)
    c.fill_random(src2, seed=7)
    assert c.backup(src2, other) == 2 * ps  # KV only
    query, give = side_prefetch(pools, window=1)
    assert c.prefetch(other, extra_pools=query, side_indices=give).hit_tokens == 0


@pytest.fixture
def dsa_stack(sglang_runtime: None) -> Iterator[Pools]:
    """An MLA model with DSA sparse attention: SGLang's MLA host pool of a ``DSATokenToKVPool``
    (the anchor) and its ``DSAIndexerPoolHost`` (``"indexer"``, on the KV pool's host
    indices), in one ``HostPoolGroup``."""
    anchor, indexer = dsa_pools("page_first")
    device = indexer.device_pool
    group = HostPoolGroup(
        [
            asm.build_pool_entry(
                name=PoolName.KV,
                host_pool=anchor,
                device_pool=device,
                layer_mapping={0: 0, 1: 1},
                transfer_layer_id_max=2,
                is_anchor=True,
            ),
            asm.build_pool_entry(
                name=PoolName.INDEXER,
                host_pool=indexer,
                device_pool=device,
                layer_mapping={0: 0, 1: 1},
                transfer_layer_id_max=2,
            ),
        ]
    )
    allocator = PagedTokenToKVPoolAllocator(
        device.size, 64, torch.bfloat16, "cpu", device, need_sort=False
    )
    pools = Pools(device, allocator, group, anchor, "page_first", True, 64, 2)
    pools.indexer = indexer  # type: ignore[attr-defined]
    yield pools


def test_dsa_indexer_pages_ride_with_the_kv_pages(
    daemon: DaemonProcess, dsa_stack: Any, make_controller: Any
) -> None:
    """The indexer pool takes the KV pool's host indices and keys (``indices_from_pool="kv"``):
    the controller backs its pages up beside the KV pages and loads them with each KV batch."""
    c = make_controller(dsa_stack, kvstore_config(daemon.address), model_name="dsa")
    indexer = dsa_stack.indexer
    ps = c.page_size
    tokens = [50 + i for i in range(2 * ps)]
    src = c.alloc(2)
    kv_written = c.fill_random(src, seed=11)
    fill_random(indexer, seed=12)
    idx_written = pages_of(indexer, src)

    def derived() -> list[Any]:
        return [
            PoolTransfer(
                PoolName.INDEXER,
                indices_from_pool=PoolName.KV,
                hit_policy=PoolHitPolicy.ALL_PAGES,
            )
        ]

    assert c.backup(src, tokens, extra_pools=derived()) == 2 * ps
    got = c.prefetch(tokens, extra_pools=derived())
    assert got.completed_tokens == 2 * ps
    assert c.read_pages(got.host_indices) == kv_written
    assert pages_of(indexer, got.host_indices) == idx_written
    assert c.backend.counters()["side_hits"] == 2
