"""offload/load: an engine's paged KV cache to the store and back, through a real daemon."""

from __future__ import annotations

import pytest
import torch
from conftest import SMALL_LAYOUT

from kvstore import AsyncKVStoreClient, KVLayout, KVStoreClient, PagedKVCache

LAYOUT = SMALL_LAYOUT


def caches(num_blocks: int, seed: int | None = 0, layout: KVLayout = LAYOUT) -> list[torch.Tensor]:
    shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if seed is None:
        return [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(layout.dtype) for _ in range(layout.num_layers)]


def block(kv: list[torch.Tensor], b: int) -> torch.Tensor:
    return torch.stack([layer[:, b] for layer in kv]).view(torch.uint8)


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_offload_then_load_restores_blocks_bit_exact(daemon, transport: str) -> None:
    src = caches(16, seed=1)
    dst = caches(16, seed=None)
    with KVStoreClient(daemon.address, layout=LAYOUT, model="m", transport=transport) as kv:
        keys = kv.hash_tokens(list(range(16 * 40)))  # 40 blocks: more than one chunk
        src_ids = [(7 * i) % 16 for i in range(40)]
        # Only 16 physical blocks: offload the first 16 keys from 16 distinct blocks.
        assert kv.offload(src, src_ids[:16], keys[:16]) == 16
        assert kv.offload(src, src_ids[:16], keys[:16]) == 0  # already stored
        dst_ids = list(range(15, -1, -1))
        assert kv.load(dst, dst_ids, keys[:16]) == 16
        for i in range(16):
            assert torch.equal(block(dst, dst_ids[i]), block(src, src_ids[i])), i


def test_load_stops_at_the_first_missing_block(daemon) -> None:
    src = caches(8, seed=2)
    dst = caches(8, seed=None)
    with KVStoreClient(daemon.address, layout=LAYOUT, model="m") as kv:
        keys = kv.hash_tokens(list(range(16 * 6)))
        kv.offload(src, [0, 1, 2, 4], [keys[0], keys[1], keys[2], keys[4]])
        assert kv.load(dst, [0, 1, 2, 3, 4, 5], keys) == 3
        assert torch.equal(block(dst, 2), block(src, 2))
        assert not block(dst, 3).any() and not block(dst, 4).any()  # untouched past the run


def test_offload_and_load_across_chunks(daemon) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, block_size=16)
    src = caches(100, seed=3, layout=layout)
    dst = caches(100, seed=None, layout=layout)
    with KVStoreClient(daemon.address, layout=layout, model="chunks") as kv:
        keys = kv.hash_tokens(list(range(16 * 100)))
        assert kv.offload(src, list(range(100)), keys) == 100
        assert kv.load(dst, list(range(100)), keys) == 100
        assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))


def test_a_paged_cache_round_trips_through_the_store(daemon) -> None:
    engine_a = PagedKVCache(LAYOUT, num_blocks=16)
    tokens = list(range(1000, 1000 + 16 * 4 + 5))
    engine_a.add_sequence("s", tokens)
    g = torch.Generator().manual_seed(4)
    for layer in range(LAYOUT.num_layers):
        k = torch.randn(len(tokens), LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=g)
        engine_a.write_kv("s", layer, 0, k.to(LAYOUT.dtype), (-k).to(LAYOUT.dtype))
    engine_a.commit("s", len(tokens))
    engine_b = PagedKVCache(LAYOUT, num_blocks=16)
    engine_b.add_sequence("s", tokens)
    with KVStoreClient(daemon.address, layout=LAYOUT, model="m") as kv:
        keys = kv.hash_tokens(tokens)
        assert len(keys) == 4
        assert kv.offload(engine_a.kv_caches, engine_a.block_ids("s")[:4], keys) == 4
        assert kv.load(engine_b.kv_caches, engine_b.block_ids("s")[:4], keys) == 4
    for layer in range(LAYOUT.num_layers):
        ka, va = engine_a.sequence_kv("s", layer)
        kb, vb = engine_b.sequence_kv("s", layer)
        n = 4 * LAYOUT.block_size
        assert torch.equal(ka[:n].view(torch.uint8), kb[:n].view(torch.uint8))
        assert torch.equal(va[:n].view(torch.uint8), vb[:n].view(torch.uint8))


async def test_async_offload_and_load(daemon) -> None:
    src = caches(8, seed=5)
    dst = caches(8, seed=None)
    async with AsyncKVStoreClient(daemon.address, layout=LAYOUT, model="m") as kv:
        keys = kv.hash_tokens(list(range(16 * 8)))
        assert await kv.offload(src, list(range(8)), keys) == 8
        assert await kv.load(dst, list(range(8)), keys) == 8
    assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))


def test_bad_paged_arguments_raise(daemon) -> None:
    src = caches(4, seed=6)
    with KVStoreClient(daemon.address, layout=LAYOUT, model="m") as kv:
        keys = kv.hash_tokens(list(range(16 * 2)))
        with pytest.raises(ValueError, match="layers"):
            kv.offload(src[:1], [0, 1], keys)
        with pytest.raises(ValueError, match="dtype"):
            kv.offload([c.float() for c in src], [0, 1], keys)
        with pytest.raises(ValueError, match="2 keys but 1 block ids"):
            kv.load(src, [0], keys)
        with pytest.raises(ValueError, match=r"out of range|block_ids"):
            kv.offload(src, [0, 99], keys)
        assert kv.lookup(keys) == 0  # nothing half-stored
