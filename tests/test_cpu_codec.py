"""``cpu = "fp8"``: a namespace whose CPU-tier entries are fp8 payloads, through a real daemon
(real grpc.aio server, real shared memory, real slab files). On this CPU the paged gather and
scatter run the kernels' torch reference; the CUDA kernels are covered by tests/test_kernels.py
(marked ``cuda``) against the same reference."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import grpc
import pytest
import torch
from conftest import SMALL_LAYOUT, kv_channel, random_blocks, same_bytes, tiers, tokens
from test_nvme_service import fp8_form  # the codec's decode of its encode of each block

from kvstore import KVStoreClient
from kvstore.config import load_config
from kvstore.tiers import codecs
from kvstore.tiers.codecs import block_format_of
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

BB = SMALL_LAYOUT.block_bytes  # 8 KiB of bf16
PAYLOAD = codecs.fp8_payload_bytes(block_format_of(SMALL_LAYOUT))  # its fp8 payload
FP8_MODEL = "fp8-cpu-model"
RULE = f'\n[[codecs]]\nmodel = "{FP8_MODEL}"\ncpu = "fp8"\nnvme = "fp8"\n'


def client(daemon, model: str = FP8_MODEL) -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model=model)


def paged_cache(num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    lay = SMALL_LAYOUT
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim, generator=g).to(
            lay.dtype
        )
        for _ in range(lay.num_layers)
    ]


def blocks_of(caches: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The blocks ``ids`` of a paged cache as ``[n, *block_shape]``."""
    return torch.stack([torch.stack([c[:, i] for c in caches]) for i in ids])


def cpu_row(kv: KVStoreClient):
    return tiers(kv)["cpu"]


def test_config_refuses_cpu_fp8_where_the_lower_tiers_would_not_keep_it(tmp_path: Path) -> None:
    bad_codec = tmp_path / "a.toml"
    bad_codec.write_text('[[codecs]]\ncpu = "lz4"\n')
    with pytest.raises(ValueError, match="cpu codec 'lz4' unknown"):
        load_config(bad_codec, env={})
    lossless_nvme = tmp_path / "b.toml"
    lossless_nvme.write_text(f'[nvme]\npath = "{tmp_path}"\n[[codecs]]\ncpu = "fp8"\n')
    with pytest.raises(ValueError, match="nvme codec that keeps the fp8 form"):
        load_config(lossless_nvme, env={})


def test_put_get_and_paged_round_trip_store_payloads_and_serve_the_fp8_form(daemon_factory):
    d = daemon_factory(extra=RULE)
    n = 6
    with client(d) as kv, client(d, "lossless-model") as plain:
        # A plain put and get: the CPU tier holds payloads, the reader gets the fp8 form.
        keys = kv.hash_tokens(tokens(n))
        blocks = random_blocks(SMALL_LAYOUT, n, seed=1)
        assert kv.put(keys, blocks) == n
        want = fp8_form(blocks)
        assert not same_bytes(want, blocks)  # lossy: the test could tell the two apart
        assert same_bytes(kv.get(keys), want)
        row = cpu_row(kv)
        # Counted as payloads (slots round them up to a page: negligible for real blocks of
        # MiBs, though these 8 KiB test blocks still take 8 KiB slots).
        assert (row.logical_bytes, row.stored_bytes) == (n * BB, n * PAYLOAD)
        assert PAYLOAD / BB < 0.51

        # Paged offload (the gather kernel quantizes into the slots) and load (the scatter
        # kernel dequantizes), and a plain get of the offloaded blocks: the same fp8 form.
        caches = paged_cache(8, seed=2)
        pkeys = kv.hash_tokens(tokens(4, offset=500))
        assert kv.offload(caches, [1, 3, 5, 7], pkeys) == 4
        expect = fp8_form(blocks_of(caches, [1, 3, 5, 7]))
        fresh = [torch.zeros_like(c) for c in caches]
        assert kv.load(fresh, [0, 2, 4, 6], pkeys) == 4
        assert same_bytes(blocks_of(fresh, [0, 2, 4, 6]), expect)
        assert same_bytes(kv.get(pkeys), expect)

        # A lossless namespace beside it is byte for byte unaffected, on every path.
        assert plain.put(keys, blocks) == n
        assert same_bytes(plain.get(keys), blocks)
        assert plain.offload(caches, [1, 3, 5, 7], pkeys) == 4
        fresh = [torch.zeros_like(c) for c in caches]
        assert plain.load(fresh, [0, 2, 4, 6], pkeys) == 4
        assert same_bytes(blocks_of(fresh, [0, 2, 4, 6]), blocks_of(caches, [1, 3, 5, 7]))
        row = cpu_row(kv)
        assert row.logical_bytes == (n + 4) * BB * 2
        assert row.stored_bytes == (n + 4) * (BB + PAYLOAD)


def test_bytes_path_stores_and_serves_the_fp8_form(daemon_factory) -> None:
    """PutBlocks / GetBlocks (clients without the arena): the daemon encodes and decodes."""
    d = daemon_factory(extra=RULE)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(3))
        blocks = random_blocks(SMALL_LAYOUT, 3, seed=4)
        stub_kv = KVStoreClient(d.address, layout=SMALL_LAYOUT, model=FP8_MODEL, transport="grpc")
        with stub_kv:
            assert stub_kv.put(keys, blocks) == 3
            assert same_bytes(stub_kv.get(keys), fp8_form(blocks))
        assert same_bytes(kv.get(keys), fp8_form(blocks))  # the arena reader agrees


def test_write_back_to_nvme_and_read_back_after_eviction_give_the_same_bytes(
    daemon_factory, tmp_path: Path
) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    d = daemon_factory(
        cpu_capacity="256KiB", slab="64KiB", nvme_path=nvme, nvme_capacity="4MiB", extra=RULE
    )
    n = 120  # payloads of ~4.3 KiB in 8 KiB slots: ~4x the CPU tier
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(n))
        blocks = random_blocks(SMALL_LAYOUT, n, seed=5)
        for i in range(0, n, 8):
            assert kv.put(keys[i : i + 8], blocks[i : i + 8]) == 8
        t = tiers(kv)
        assert t["nvme"].demotions > 0 and t["cpu"].blocks < n
        assert t["nvme"].extra["records_fp8"] == t["nvme"].blocks  # stored as they were
        want = fp8_form(blocks)
        for i in range(0, n, 8):  # each batch promoted back (its payload kept)
            assert same_bytes(kv.get(keys[i : i + 8]), want[i : i + 8]), i
        caches = paged_cache(8)
        assert kv.load(caches, list(range(8)), keys[:8]) == 8  # payloads through the scatter
        assert same_bytes(blocks_of(caches, list(range(8))), want[:8])
        t = tiers(kv)
        assert t["nvme"].promotions > 0 and t["nvme"].checksum_failures == 0


def test_a_lossless_record_written_before_the_rule_is_promoted_as_its_fp8_form(
    daemon_factory, tmp_path: Path
) -> None:
    """A namespace's codec may change between runs: blocks written down lossless before an
    operator set ``cpu = "fp8"`` are still found after it, in the fp8 form the rule asks for
    (they were misses, and dropped)."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    sizes = {"cpu_capacity": "256KiB", "slab": "64KiB", "nvme_path": nvme, "nvme_capacity": "4MiB"}
    n = 16
    blocks = random_blocks(SMALL_LAYOUT, n, seed=9)
    before = daemon_factory(**sizes)  # no rule: the NVMe tier's lossless default
    with client(before) as kv:
        keys = kv.hash_tokens(tokens(n))
        assert kv.put(keys, blocks) == n
    before.stop()  # a graceful stop writes every block down
    after = daemon_factory(**sizes, extra=RULE)
    with client(after) as kv:
        assert tiers(kv)["nvme"].blocks == n and tiers(kv)["cpu"].blocks == 0
        assert kv.lookup(keys) == n
        assert same_bytes(kv.get(keys), fp8_form(blocks))
        row = cpu_row(kv)
        assert (row.logical_bytes, row.stored_bytes) == (n * BB, n * PAYLOAD)
        caches = paged_cache(n)
        assert kv.load(caches, list(range(n)), keys) == n  # the payloads, through the scatter
        assert same_bytes(blocks_of(caches, list(range(n))), fp8_form(blocks))
        assert tiers(kv)["nvme"].checksum_failures == 0


def test_a_scribbled_fp8_slot_is_a_miss(daemon_factory) -> None:
    d = daemon_factory(extra=RULE)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(3))
        blocks = random_blocks(SMALL_LAYOUT, 3, seed=6)
        assert kv.put(keys, blocks) == 3
        lease = kv.acquire(keys)
        assert [v.numel() for v in lease.views] == [PAYLOAD] * 3
        lease.views[1][100:164] = 0x7F  # scales and codes of block 1 overwritten
        lease.release()
        assert same_bytes(kv.get(keys), fp8_form(blocks[:1]))  # a miss from block 1 on
        caches = paged_cache(4)
        assert kv.load(caches, [0, 1, 2], keys) == 1
        header = kv.acquire(keys[2:])
        header.views[0][:4] = 0  # the frame's magic: the payload no longer decodes
        header.release()
        assert kv.get(keys[2:]).shape[0] == 0
        assert kv.load(caches, [2], keys[2:]) == 0


def test_a_commit_naming_another_codec_or_length_is_refused(daemon_factory) -> None:
    d = daemon_factory(extra=RULE)
    with client(d) as kv, kv_channel(kv) as ch, client(d, "lossless-model") as plain:
        stub = pb_grpc.KVStoreStub(ch)
        keys = kv.hash_tokens(tokens(2))
        blocks = random_blocks(SMALL_LAYOUT, 2, seed=7)
        reservation = kv.reserve(keys)
        assert (reservation.codec, reservation.payload_bytes) == (codecs.CODEC_FP8, PAYLOAD)
        reservation.fill_from(blocks.view(torch.uint8).reshape(2, BB))
        good = reservation.checksums()
        sums = reservation.payload_sums
        rid = reservation.reservation_id

        def commit(**fields) -> grpc.StatusCode:
            request = pb.CommitRequest(handle=kv._handle, reservation_id=rid, **fields)
            with pytest.raises(grpc.RpcError) as err:
                stub.Commit(request, timeout=10)
            return err.value.code()

        fp8 = codecs.CODEC_FP8
        for fields in (
            {"checksums": good},  # as if whole blocks
            {"checksums": good, "codec": 1, "payload_bytes": PAYLOAD, "payload_checksums": sums},
            {"checksums": good, "codec": fp8, "payload_bytes": BB, "payload_checksums": sums},
            {"checksums": good, "codec": fp8, "payload_bytes": PAYLOAD},
            {"checksums": good, "codec": fp8, "payload_bytes": PAYLOAD, "payload_checksums": [1]},
        ):
            assert commit(**fields) == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert kv.lookup(keys) == 0  # nothing stored
        assert reservation.commit() == 2  # the reservation is intact: the honest commit lands
        assert same_bytes(kv.get(keys), fp8_form(blocks))

        # A lossless reservation naming a codec is refused too.
        other = plain.reserve(keys)
        other.fill_from(blocks.view(torch.uint8).reshape(2, BB))
        with kv_channel(plain) as ch2:
            request = pb.CommitRequest(
                handle=plain._handle,
                reservation_id=other.reservation_id,
                checksums=other.checksums(),
                codec=fp8,
                payload_bytes=PAYLOAD,
                payload_checksums=[1, 2],
            )
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.KVStoreStub(ch2).Commit(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert other.commit() == 2
        assert same_bytes(plain.get(keys), blocks)
        assert kv.put(kv.hash_tokens(tokens(2, offset=50)), blocks) == 2  # still serving


# ----------------------------------------------------------------- the store in-process
async def test_store_keeps_its_invariants_with_payload_entries() -> None:
    """Reserve, refused and honest commits, acquire, eviction and delete of payload entries,
    the store's invariants (payload sizes, logical bytes, payload checksums) checked after
    each step, next to a lossless namespace in the same arena."""
    from kvstore.checksum import block_checksum
    from kvstore.config import CodecRule, CpuTierConfig, DaemonConfig, GpuTierConfig
    from kvstore.daemon.store import BlockStore
    from kvstore.keys import Namespace, block_hashes

    cfg = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        cpu=CpuTierConfig(capacity_bytes=8 * BB, slab_bytes=2 * BB, prefault=False),
        codecs=(CodecRule(model=FP8_MODEL, cpu="fp8"),),
    )
    store = BlockStore(cfg)
    try:
        fp8_ns = Namespace(model=FP8_MODEL, layout=SMALL_LAYOUT)
        raw_ns = Namespace(model="raw", layout=SMALL_LAYOUT)
        h = store.open_namespace(fp8_ns)
        raw = store.open_namespace(raw_ns)
        assert (h.record.cpu_codec, h.record.cpu_bytes) == (codecs.CODEC_FP8, PAYLOAD)
        assert (raw.record.cpu_codec, raw.record.cpu_bytes) == (0, BB)
        fmt = block_format_of(SMALL_LAYOUT)
        blocks = random_blocks(SMALL_LAYOUT, 12, seed=8)

        async def put(ks: list[bytes], first: int) -> int:
            res = await store.reserve(h, ks)
            assert res.codec == codecs.CODEC_FP8
            sums, payload_sums = [], []
            for j, (off, k) in enumerate(zip(res.offsets, ks, strict=True)):
                slot = store.arena.view[off : off + PAYLOAD]
                block = blocks[first + j].view(torch.uint8).numpy().tobytes()
                d, p = codecs.encode_payload(block, fmt, slot, fp8_ns.fingerprint, k)
                sums.append(d)
                payload_sums.append(p)
            with pytest.raises(ValueError, match="nothing was stored"):
                store.commit(h, res.reservation_id, sums)  # names no codec
            store.check()
            return store.commit(
                h, res.reservation_id, sums, (), codecs.CODEC_FP8, PAYLOAD, payload_sums
            )

        ks = block_hashes(fp8_ns.seed, list(range(12 * 16)))
        assert await put(ks[:4], 0) == 4
        store.check()
        cpu = store.tier_snapshots()[0]
        assert (cpu.logical_bytes, cpu.stored_bytes) == (4 * BB, 4 * PAYLOAD)
        lease = await store.acquire(h, ks[:4])
        assert lease.codecs == [codecs.CODEC_FP8] * 4 and lease.payload_checksums
        for off, k, s in zip(lease.offsets, ks, lease.payload_checksums, strict=False):
            assert block_checksum(store.arena.view[off : off + PAYLOAD], fp8_ns.fingerprint, k) == s
        store.release(h, lease.lease_id)
        # More than the 8-slot tier holds: the oldest payload entries are evicted.
        assert await put(ks[4:8], 4) == 4
        assert await put(ks[8:12], 8) == 4
        store.check()
        rk = block_hashes(raw_ns.seed, list(range(2 * 16)))
        res = await store.reserve(raw, rk)
        with pytest.raises(ValueError, match="whole blocks"):
            store.commit(raw, res.reservation_id, [1, 2], (), codecs.CODEC_FP8, PAYLOAD, [1, 2])
        assert store.commit(raw, res.reservation_id, [1, 2]) == 2
        store.check()
        assert store.delete(h, ks) > 0
        store.check()
        assert store.cpu_slots.payload_savings == 0 and not store.payload_sums
    finally:
        store.close()


@pytest.mark.cuda
@pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("cupy")),
    reason="needs a CUDA device and CuPy",
)
def test_cuda_paged_round_trip_matches_the_torch_reference(daemon_factory) -> None:
    """The GPU path: the gather kernel quantizes a CUDA cache into the pinned payload slots
    and the scatter kernel dequantizes them back; the oracle is the torch reference (the
    codec's decode of its encode), as on a CPU cache."""
    d = daemon_factory(extra=RULE)
    with client(d) as kv:
        host = paged_cache(8, seed=9)
        dev = [c.cuda() for c in host]
        keys = kv.hash_tokens(tokens(4))
        assert kv.offload(dev, [0, 2, 4, 6], keys) == 4
        want = fp8_form(blocks_of(host, [0, 2, 4, 6]))
        assert same_bytes(kv.get(keys), want)
        fresh = [torch.zeros_like(c) for c in dev]
        assert kv.load(fresh, [1, 3, 5, 7], keys) == 4
        torch.cuda.synchronize()
        got = blocks_of([c.cpu() for c in fresh], [1, 3, 5, 7])
        assert same_bytes(got, want)


# ----------------------------------------------------------------- the NVMe tier, in-process
@pytest.mark.parametrize("codec", ["fp8", "fp8+lz4"])
async def test_nvme_tier_stores_a_payload_as_it_is_and_reads_it_back(tmp_path, codec) -> None:
    """Write-back of a payload entry: stored without re-encoding (lz4 over it for fp8+lz4),
    refused when it is not a payload of the block or does not decode to its checksum; read
    back as the payload (promotion into a payload slot) or decoded (a lossless reader)."""
    from kvstore.checksum import block_checksum
    from kvstore.tiers.nvme import NvmeTier

    fmt = block_format_of(SMALL_LAYOUT)
    ns, key = b"n" * 16, b"k" * 32
    block = torch.zeros(SMALL_LAYOUT.block_shape, dtype=SMALL_LAYOUT.dtype)
    block[0, 0, :4] = torch.randn(4, SMALL_LAYOUT.num_kv_heads, SMALL_LAYOUT.head_dim)
    raw = block.view(torch.uint8).numpy().tobytes()
    payload = memoryview(bytearray(PAYLOAD))
    decoded_sum, payload_sum = codecs.encode_payload(raw, fmt, payload, ns, key)
    tier = NvmeTier(tmp_path / "nvme", 8 << 20, slab_bytes=1 << 20, codec=codec)
    await tier.open()
    try:
        for bad, why in ((payload[:-1], "cannot be stored"), (payload, "does not decode")):
            slot = tier.allocate(BB)
            assert slot is not None
            with pytest.raises(ValueError, match=why):
                checksum = decoded_sum if why != "does not decode" else decoded_sum ^ 1
                await tier.write(
                    slot, key, ns, bad, checksum, codec=codec, block_format=fmt, encoded_length=BB
                )  # and the slot is free again
        slot = tier.allocate(BB)
        await tier.write(
            slot, key, ns, payload, decoded_sum, codec=codec, block_format=fmt, encoded_length=BB
        )
        stats = tier.stats()
        used = "records_fp8_lz4" if codec == "fp8+lz4" else "records_fp8"
        assert stats[used] == 1
        back = bytearray(PAYLOAD)
        assert await tier.read_payload_into(slot, key, ns, decoded_sum, back) == (
            decoded_sum,
            payload_sum,
        )
        assert bytes(back) == bytes(payload)
        out = bytearray(BB)
        assert await tier.read_into_checked(slot, key, ns, decoded_sum, out) == decoded_sum
        assert block_checksum(out, ns, key) == decoded_sum
        assert same_bytes(
            torch.frombuffer(out, dtype=SMALL_LAYOUT.dtype).view(1, *SMALL_LAYOUT.block_shape),
            fp8_form(block.unsqueeze(0)),
        )
    finally:
        await tier.close()
