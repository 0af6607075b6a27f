"""The GPU tier through a real daemon and real CUDA IPC: a worker's offload lands in the daemon's
device pool, loads come back device to device, bit-exact, and fail closed.

Needs a CUDA device and CuPy (``scripts/gpu_check.sh`` runs these on a GPU host); skipped
elsewhere. The tier's logic is also tested without a GPU in ``tests/test_gpu_tier.py``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import SMALL_LAYOUT, tiers, wait_for

from kvstore import AsyncKVStoreClient, KVLayout, KVStoreClient

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and CuPy"),
]

LAYOUT = SMALL_LAYOUT  # 8 KiB blocks


def caches(num_blocks: int, seed: int | None, layout: KVLayout = LAYOUT) -> list[torch.Tensor]:
    shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if seed is None:
        return [
            torch.zeros(shape, dtype=layout.dtype, device="cuda") for _ in range(layout.num_layers)
        ]
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(shape, generator=g, device="cuda").to(layout.dtype)
        for _ in range(layout.num_layers)
    ]


def block(kv: list[torch.Tensor], b: int) -> torch.Tensor:
    return torch.stack([layer[:, b] for layer in kv]).view(torch.uint8).cpu()


@pytest.fixture
def gpu_daemon(daemon_factory):
    return daemon_factory(gpu="on", gpu_capacity="4MiB", slab="256KiB")


def test_offload_lands_in_the_pool_and_loads_back_bit_exact(gpu_daemon) -> None:
    src, dst = caches(32, seed=1), caches(32, seed=None)
    with KVStoreClient(gpu_daemon.address, layout=LAYOUT, model="m") as kv:
        keys = kv.hash_tokens(list(range(16 * 32)))
        assert kv.offload(src, list(range(32)), keys) == 32
        t = tiers(kv)
        assert t["gpu"].blocks == 32 and t["gpu"].used_bytes >= 32 * LAYOUT.block_bytes
        ids = list(range(31, -1, -1))
        assert kv.load(dst, ids, keys) == 32
        for i in range(32):
            assert torch.equal(block(dst, ids[i]), block(src, i)), i
        assert tiers(kv)["gpu"].hits == 0  # load does not look up; lookup counts hits
        assert kv.lookup(keys) == 32 and tiers(kv)["gpu"].hits == 32
    # A reader on the CPU (no pool) is served CPU copies made on demand.
    with KVStoreClient(gpu_daemon.address, layout=LAYOUT, model="m") as cpu_kv:
        got = cpu_kv.get(keys)
        assert got.shape[0] == 32
        for i in range(32):
            assert torch.equal(got[i].view(torch.uint8), block(src, i)), i


async def test_async_client_uses_the_pool_too(gpu_daemon) -> None:
    src, dst = caches(8, seed=2), caches(8, seed=None)
    async with AsyncKVStoreClient(gpu_daemon.address, layout=LAYOUT, model="m") as kv:
        keys = kv.hash_tokens(list(range(16 * 8)))
        assert await kv.offload(src, list(range(8)), keys) == 8
        assert {t.name: t for t in (await kv.stats()).tiers}["gpu"].blocks == 8
        assert await kv.load(dst, list(range(8)), keys) == 8
    for i in range(8):
        assert torch.equal(block(dst, i), block(src, i))


def test_another_process_reads_the_pool(gpu_daemon) -> None:
    src = caches(8, seed=3)
    with KVStoreClient(gpu_daemon.address, layout=LAYOUT, model="m") as kv:
        keys = kv.hash_tokens(list(range(16 * 8)))
        assert kv.offload(src, list(range(8)), keys) == 8
    want = hashlib.sha256(torch.cat([block(src, i) for i in range(8)]).numpy()).hexdigest()
    script = textwrap.dedent(
        f"""
        import hashlib, torch
        from kvstore import KVLayout, KVStoreClient
        layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16)
        dst = [torch.zeros(2, 8, 16, 2, 32, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        with KVStoreClient({gpu_daemon.address!r}, layout=layout, model="m") as kv:
            keys = kv.hash_tokens(list(range(16 * 8)))
            n = kv.load(dst, list(range(8)), keys)
            pool = kv._pool_link.pool is not None
        rows = [torch.stack([l[:, b] for l in dst]).view(torch.uint8).cpu() for b in range(8)]
        print(n, pool, hashlib.sha256(torch.cat(rows).numpy()).hexdigest())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["8", "True", want]


def test_a_scribbled_pool_slot_is_a_miss(gpu_daemon) -> None:
    src, dst = caches(6, seed=4), caches(6, seed=None)
    with KVStoreClient(gpu_daemon.address, layout=LAYOUT, model="m") as kv:
        keys = kv.hash_tokens(list(range(16 * 6)))
        kv.offload(src, list(range(6)), keys)
        device = src[0].device
        with kv.acquire(keys, _device=device) as lease:
            assert all(lease.on_gpu)
            lease.views[3].view(torch.uint8).view(-1)[17] ^= 0xFF  # a buggy worker
        assert kv.load(dst, list(range(6)), keys) == 3  # fail closed at the scribbled block
        for i in range(3):
            assert torch.equal(block(dst, i), block(src, i))


def test_prefetch_brings_cpu_blocks_into_the_pool(gpu_daemon) -> None:
    cpu_src = [
        torch.randn(2, 8, 16, 2, 32, generator=torch.Generator().manual_seed(5)).bfloat16()
        for _ in range(2)
    ]
    with KVStoreClient(gpu_daemon.address, layout=LAYOUT, model="m") as cpu_kv:
        keys = cpu_kv.hash_tokens(list(range(16 * 8)))
        assert cpu_kv.offload(cpu_src, list(range(8)), keys) == 8  # lands in the CPU tier
    dst = caches(8, seed=None)
    with KVStoreClient(gpu_daemon.address, layout=LAYOUT, model="m") as kv:
        assert kv._pool_link.device_for(dst) is not None  # maps the pool
        kv.prefetch(keys)
        wait_for(lambda: tiers(kv)["gpu"].promotions >= 8, what="promotion into the pool")
        with kv.acquire(keys, _device=dst[0].device) as lease:
            assert all(lease.on_gpu)
        assert kv.load(dst, list(range(8)), keys) == 8
    for i in range(8):
        want = torch.stack([layer[:, i] for layer in cpu_src]).view(torch.uint8)
        assert torch.equal(block(dst, i), want)


def test_a_full_pool_writes_back_and_loses_nothing(gpu_daemon) -> None:
    # 4 MiB pool, 8 KiB blocks: 1,000 blocks go through a pool of ~480.
    n = 1000
    src, dst = caches(n, seed=6), caches(n, seed=None)
    with KVStoreClient(gpu_daemon.address, layout=LAYOUT, model="m") as kv:
        keys = kv.hash_tokens(list(range(16 * n)))
        assert kv.offload(src, list(range(n)), keys) == n
        t = tiers(kv)
        assert t["gpu"].evictions > 0 and t["gpu"].used_bytes <= t["gpu"].capacity_bytes
        assert kv.load(dst, list(range(n)), keys) == n
    for layer_src, layer_dst in zip(src, dst, strict=True):
        assert torch.equal(layer_src, layer_dst)


def test_a_restarted_daemon_gives_a_new_pool_and_the_client_follows(gpu_daemon) -> None:
    src, dst = caches(4, seed=7), caches(4, seed=None)
    with KVStoreClient(gpu_daemon.address, layout=LAYOUT, model="m") as kv:
        keys = kv.hash_tokens(list(range(16 * 4)))
        kv.offload(src, list(range(4)), keys)
        gpu_daemon.stop()
        gpu_daemon.start()
        assert kv.load(dst, list(range(4)), keys) == 0  # gone with the old daemon (no disk)
        assert kv.offload(src, list(range(4)), keys) == 4
        assert tiers(kv)["gpu"].blocks == 4
        assert kv.load(dst, list(range(4)), keys) == 4
    for i in range(4):
        assert torch.equal(block(dst, i), block(src, i))


def test_cuda_caches_through_the_cpu_tier_when_the_gpu_tier_is_off(daemon_factory) -> None:
    d = daemon_factory(gpu="off")
    src, dst = caches(40, seed=8), caches(40, seed=None)
    with KVStoreClient(d.address, layout=LAYOUT, model="m") as kv:
        keys = kv.hash_tokens(list(range(16 * 40)))
        assert kv.offload(src, list(range(40)), keys) == 40  # gathered into the pinned arena
        assert "gpu" not in tiers(kv) and tiers(kv)["cpu"].blocks == 40
        assert kv.load(dst, list(range(40)), keys) == 40
    for layer_src, layer_dst in zip(src, dst, strict=True):
        assert torch.equal(layer_src, layer_dst)
