"""FP8 KV end to end: the scaled layout and its fingerprint, the FP8 paged cache and its
attention, FP8 blocks through a real daemon (bytes and scales), and an FP8 reference worker
served from the store. The kernels' own FP8 tests are in test_kernels.py."""

from __future__ import annotations

import importlib.util
from typing import Any

import grpc
import pytest
import torch
import torch.nn.functional as F

from kvstore import KVLayout, KVStoreClient, kernels
from kvstore.errors import NamespaceMismatchError
from kvstore.kernels import reference
from kvstore.keys import Namespace
from kvstore.paged import PagedKVCache
from kvstore.tiers import codecs
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.conftest import same_bytes

FP8 = torch.float8_e4m3fn
BF16 = KVLayout(num_layers=2, num_kv_heads=3, head_dim=16, block_size=8)
SCALED = KVLayout.fp8(BF16)


def kv(n: int, layout: KVLayout, seed: int) -> torch.Tensor:
    """K or V of n tokens, one head ten times larger than the others (per-head scales)."""
    x = torch.randn(
        n, layout.num_kv_heads, layout.head_dim, generator=torch.Generator().manual_seed(seed)
    )
    x[:, -1] *= 10.0
    return x


# -- layout and namespace ----------------------------------------------------------------------


def test_scaled_layout_shape_bytes_and_checks() -> None:
    assert SCALED.dtype == FP8 and SCALED.scale_format == "block_head_f32" and SCALED.scaled
    assert SCALED.block_rows == 9 and SCALED.block_shape == (2, 2, 9, 3, 16)
    # e4m3 values plus one row of scales per (layer, K|V): 9/16 of the bf16 block.
    assert SCALED.block_bytes == 2 * 2 * 9 * 3 * 16 and BF16.block_bytes == 2 * 2 * 8 * 3 * 16 * 2
    plain_fp8 = KVLayout(2, 3, 16, 8, FP8)
    assert not plain_fp8.scaled and plain_fp8.block_rows == 8
    with pytest.raises(ValueError, match="needs dtype float8_e4m3fn"):
        KVLayout(2, 3, 16, 8, torch.bfloat16, "block_head_f32")
    with pytest.raises(ValueError, match="multiple of 4"):
        KVLayout(2, 3, 18, 8, FP8, "block_head_f32")
    with pytest.raises(ValueError, match="unsupported scale_format"):
        KVLayout(2, 3, 16, 8, FP8, "per_token")


def test_fp8_and_bf16_namespaces_never_share_a_key_or_fingerprint() -> None:
    layouts = [BF16, KVLayout(2, 3, 16, 8, FP8), SCALED]
    spaces = [Namespace("m", lay) for lay in layouts]
    assert len({ns.seed for ns in spaces}) == 3
    assert len({ns.fingerprint for ns in spaces}) == 3
    # Unscaled layouts keep the eleven-field seed (their keys are those of earlier builds).
    assert Namespace("m", BF16).seed == Namespace("m", KVLayout(2, 3, 16, 8)).seed


# -- the FP8 paged cache -------------------------------------------------------------------------


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per head ``[Hq, D]`` over ``k``/``v`` ``[n, Hkv, D]`` (float32 SDPA)."""
    o = F.scaled_dot_product_attention(
        q.float()[None, :, None, :],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        scale=scale,
        enable_gqa=True,
    )
    return o[0, :, 0]


def test_fp8_cache_attention_equals_dequantize_then_attend() -> None:
    """Prefill (write_kv), decode tokens (write_tail), a fork whose child diverges: the kernel's
    attention over each sequence equals SDPA over the sequence's dequantized K/V, every value
    is within the format's bound of what was written, and the parent never sees the child's
    writes (its bytes and scales are unchanged)."""
    cache = PagedKVCache(SCALED, 16)
    prompt = list(range(13))
    cache.add_sequence("a", prompt)
    ks = {layer: kv(13, SCALED, 10 + layer) for layer in range(2)}
    vs = {layer: kv(13, SCALED, 20 + layer) for layer in range(2)}
    for layer in range(2):
        cache.write_kv("a", layer, 0, ks[layer].to(torch.bfloat16), vs[layer].to(torch.bfloat16))
    cache.commit("a", 13)
    cache.fork("a", "b")
    parent_before = cache.gather_sequence_blocks("a")
    for step in range(6):  # decode: tokens 13.. into "a" and "b", crossing a block boundary
        for s in ("a", "b"):
            cache.append_tokens(s, [100 + step])
        tail = cache.tail_slots(["a", "b"])
        for layer in range(2):
            new_k = kv(2, SCALED, 100 * step + layer) * (1 + step)  # growing: scales grow
            cache.write_tail(tail, layer, new_k, -new_k)
            ks[layer] = torch.cat([ks[layer], new_k[:1]])
            vs[layer] = torch.cat([vs[layer], -new_k[:1]])
    cache.check_invariants()
    assert cache.stats().cow_copies >= 1
    # The parent's first full block is still shared and byte-identical.
    assert cache.block_ids("a")[0] == cache.block_ids("b")[0]
    assert same_bytes(cache.gather_sequence_blocks("a")[0], parent_before[0])
    q = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(3))
    tables = cache.block_table_tensor(["a", "b"])
    lens = cache.seq_lens_tensor(["a", "b"])
    for layer in range(2):
        got = cache.decode_attention(q, layer, tables, lens, 0.25)
        for i, s in enumerate(("a", "b")):
            k, v = cache.sequence_kv(s, layer)
            assert k.dtype == torch.float32 and k.shape == (19, 3, 16)
            want = dense_attention(q[i], k, v, 0.25)
            torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)
        # What "a" holds is what was written to it, within the format's bound: the prompt at
        # its block's scale, decode tokens after at most one requantization per growth.
        k, _ = cache.sequence_kv("a", layer)
        prompt_k = ks[layer][:8].to(torch.bfloat16).float()
        scales = reference.fp8_scales(cache.kv_caches[layer])[0, cache.block_ids("a")[0]]
        bound = reference.fp8_error_bound(prompt_k, scales[None, :, None])
        assert bool(((k[:8] - prompt_k).abs() <= bound * (1 + 1e-6)).all())
        rel = (k - ks[layer].to(torch.bfloat16).float()).abs().amax() / ks[layer].abs().amax()
        assert float(rel) < 1 / 8


def test_fp8_cache_refuses_what_it_cannot_quantize() -> None:
    cache = PagedKVCache(SCALED, 4)
    cache.add_sequence("a", list(range(3)))
    with pytest.raises(ValueError, match="quantizes floats"):
        cache.write_kv("a", 0, 0, torch.zeros(3, 3, 16, dtype=torch.int32), torch.zeros(3, 3, 16))
    cache.write_kv("a", 0, 0, torch.ones(3, 3, 16), torch.ones(3, 3, 16))
    cache.commit("a", 3)
    cache.fork("a", "b")
    with pytest.raises(ValueError, match="shared or committed"):
        cache.tail_slots(["a"])  # shared with "b": append_tokens would copy it first


# -- through the store ---------------------------------------------------------------------------


def filled_cache(n_tokens: int, seed: int) -> PagedKVCache:
    cache = PagedKVCache(SCALED, 12, seed=Namespace("fp8-test", SCALED).seed)
    cache.add_sequence("s", list(range(n_tokens)))
    for layer in range(SCALED.num_layers):
        cache.write_kv(
            "s", layer, 0, kv(n_tokens, SCALED, seed + layer), kv(n_tokens, SCALED, seed - layer)
        )
    cache.commit("s", n_tokens)
    return cache


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_fp8_blocks_round_trip_exactly_through_the_store(daemon_factory, transport: str) -> None:
    d = daemon_factory(cpu_capacity="16MiB", slab="1MiB")
    cache = filled_cache(32, seed=5)
    keys = cache.keys("s")
    blocks = cache.gather_sequence_blocks("s")
    assert blocks.shape == (4, *SCALED.block_shape)
    with KVStoreClient(d.address, layout=SCALED, model="fp8-test", transport=transport) as kv:
        assert kv.put(keys[:2], blocks[:2]) == 2
        assert same_bytes(kv.get(keys[:2]), blocks[:2])  # values and scale rows, bit for bit
        if transport == "shm":
            assert kv.offload(cache.kv_caches, cache.block_ids("s")[2:], keys[2:]) == 2
        else:
            assert kv.put(keys[2:], blocks[2:]) == 2
        fresh = PagedKVCache(SCALED, 12)
        fresh.add_sequence("t", list(range(32)))
        ids = fresh.block_ids("t")
        assert kv.load(fresh.kv_caches, ids, keys) == 4
        assert same_bytes(fresh.gather_sequence_blocks("t"), blocks)
        for layer in range(SCALED.num_layers):
            for a, b in zip(
                fresh.sequence_kv("t", layer), cache.sequence_kv("s", layer), strict=True
            ):
                assert torch.equal(a, b)


def test_the_daemon_keeps_fp8_and_bf16_apart(daemon_factory) -> None:
    d = daemon_factory(cpu_capacity="16MiB", slab="1MiB")
    cache = filled_cache(16, seed=9)
    keys = cache.keys("s")
    with KVStoreClient(d.address, layout=SCALED, model="shared-name") as fp8:
        fp8.put(keys, cache.gather_sequence_blocks("s"))
        # The same model name with a bf16 layout, or FP8 without scales: refused while the
        # FP8 namespace holds blocks, so nothing can read them as anything else.
        for other in (BF16, KVLayout(2, 3, 16, 8, FP8)):
            with pytest.raises(NamespaceMismatchError, match="registered with layout"):
                KVStoreClient(d.address, layout=other, model="shared-name")
        with KVStoreClient(d.address, layout=BF16, model="other-name") as bf16:
            assert bf16.lookup(keys) == 0  # same keys, another namespace: nothing found
        assert fp8.lookup(keys) == 2
    with grpc.insecure_channel(d.address) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        layout = pb.Layout(num_layers=2, num_kv_heads=3, head_dim=16, block_size=8)
        for dtype, fmt, message in (
            ("float8_e4m3fn", "per_token", "unsupported scale_format 'per_token'"),
            ("bfloat16", "block_head_f32", "needs dtype float8_e4m3fn"),
        ):
            layout.dtype, layout.scale_format = dtype, fmt
            call = stub.OpenNamespace(pb.OpenNamespaceRequest(model="m", layout=layout))
            with pytest.raises(grpc.RpcError) as err:
                next(call)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in err.value.details()
    with KVStoreClient(d.address, layout=SCALED, model="shared-name") as fp8:
        assert fp8.lookup(keys) == 2  # and the daemon kept serving


# -- the FP8 reference worker --------------------------------------------------------------------

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers"
)

RANDOM_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}


@needs_transformers
@pytest.mark.usefixtures("one_torch_thread")
def test_fp8_worker_serves_the_same_tokens_from_the_store(daemon_factory) -> None:
    """An FP8 worker offloads its prompts' blocks, a fresh FP8 worker loads them from the
    store instead of computing them and generates the same tokens: it attends over the same
    dequantized values either way."""
    from kvstore.models import random_llama
    from kvstore.worker import Worker

    model = random_llama(RANDOM_CONFIG, dtype=torch.float32, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 57, 17)]
    d = daemon_factory(cpu_capacity="16MiB", slab="1MiB")
    with Worker(model, num_blocks=32, kv_cache_dtype=FP8) as probe:
        layout = probe.layout
    assert layout.scaled and layout.dtype == FP8
    with KVStoreClient(d.address, layout=layout, model="rand-fp8") as client:
        runs = []
        for _ in range(2):
            with Worker(model, num_blocks=32, client=client, kv_cache_dtype=FP8) as worker:
                ids = [worker.submit(p, 10) for p in prompts]
                results = worker.run_until_done()
                runs.append([results[i] for i in ids])
                assert worker.stats.offload_errors == 0
        cold, warm = runs
        assert [r.tokens for r in cold] == [r.tokens for r in warm]
        assert all(r.store_tokens == 0 for r in cold)
        assert [r.store_tokens for r in warm] == [32, 48, 16]
    client = KVStoreClient(d.address, layout=layout, model="rand-fp8")
    with client, pytest.raises(ValueError, match="client layout"):
        Worker(model, num_blocks=32, client=client)  # a bf16 cache, an FP8 namespace


# -- one format for the cache and the cold tiers ----------------------------------------------


def test_the_fp8_cache_and_the_fp8_codec_write_and_read_the_same_bytes() -> None:
    """A full block quantized by the cache's kernel (write_kv_fp8) and by the tiers' fp8 codec:
    the same e4m3 bytes and scales; dequantized by each, the same bf16 bytes. Both use the one
    definition in ``kvstore.kernels.fp8``."""
    layers, bs, h, d = 3, 16, BF16.num_kv_heads, BF16.head_dim
    block = torch.stack(
        [torch.stack([kv(bs, BF16, 30 + 2 * i), kv(bs, BF16, 31 + 2 * i)]) for i in range(layers)]
    ).to(torch.bfloat16)  # [layers, 2, bs, H, D]
    caches = [torch.zeros(2, 3, bs + 1, h, d).to(FP8) for _ in range(layers)]
    for layer, cache in enumerate(caches):
        kernels.write_kv_fp8(cache, block[layer, 0], block[layer, 1], [2], [0], [bs], [bs])
    fmt = codecs.BlockFormat("bfloat16", (layers, 2, bs, h, d))
    payload = bytearray(codecs.fp8_payload_bytes(fmt))
    codecs.fp8_encode(
        memoryview(block.view(torch.uint8).numpy()).cast("B"), fmt, memoryview(payload)
    )
    groups = fmt.groups
    scales = torch.frombuffer(payload, dtype=torch.float32, offset=24, count=groups)
    q = torch.frombuffer(payload, dtype=torch.uint8, offset=24 + 4 * groups)
    scales, q = scales.view(layers, 2, h), q.view(layers, 2, bs, h, d)
    out = bytearray(block.numel() * 2)
    assert codecs.fp8_decode(memoryview(payload), memoryview(out))
    decoded = torch.frombuffer(out, dtype=torch.bfloat16).view(block.shape)
    for layer, cache in enumerate(caches):
        assert torch.equal(reference.fp8_scales(cache)[:, 2], scales[layer])
        assert torch.equal(cache[:, 2, :bs].view(torch.uint8), q[layer])
        back = reference.fp8_dequantize_blocks(cache, torch.tensor([2]))[:, 0]
        assert torch.equal(
            back.to(torch.bfloat16).view(torch.int16), decoded[layer].view(torch.int16)
        )
