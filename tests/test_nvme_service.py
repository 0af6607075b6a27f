"""The NVMe tier through a real daemon: real slab files on a real filesystem, real restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import SMALL_LAYOUT, random_blocks, same_bytes, tiers, tmpfs, tokens, wait_for

from kvstore import AsyncKVStoreClient, KVLayout, KVStoreClient
from kvstore.client import presence_link
from kvstore.errors import UnavailableError
from kvstore.tiers import codecs
from kvstore.tiers.codecs import block_format_of

BLOCK = SMALL_LAYOUT.block_bytes  # 8 KiB


def client(daemon, **kw) -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="test-model", **kw)


def put_in_batches(
    kv: KVStoreClient, keys: list[bytes], blocks: torch.Tensor, batch: int = 8
) -> None:
    for i in range(0, len(keys), batch):
        kv.put(keys[i : i + batch], blocks[i : i + batch])


@pytest.fixture
def nvme_dir(tmp_path: Path) -> Path:
    d = tmp_path / "nvme"
    d.mkdir()
    return d


def test_demotion_and_promotion_round_trip_bit_exact(daemon_factory, nvme_dir) -> None:
    d = daemon_factory(
        cpu_capacity="256KiB", slab="64KiB", nvme_path=nvme_dir, nvme_capacity="4MiB"
    )
    n = 120  # almost 4x the CPU tier
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(n))
        blocks = random_blocks(SMALL_LAYOUT, n, seed=3)
        put_in_batches(kv, keys, blocks)
        t = tiers(kv)
        assert t["cpu"].used_bytes <= t["cpu"].capacity_bytes
        assert t["nvme"].demotions > 0 and t["nvme"].blocks > 0
        assert kv.lookup(keys) == n  # every block is somewhere
        for i in range(0, n, 8):  # each batch fits the CPU tier once promoted
            assert same_bytes(kv.get(keys[i : i + 8]), blocks[i : i + 8]), i
        t = tiers(kv)
        assert t["nvme"].promotions > 0 and t["nvme"].checksum_failures == 0


def test_capacity_is_never_exceeded_under_churn(daemon_factory, nvme_dir) -> None:
    d = daemon_factory(
        cpu_capacity="128KiB", slab="64KiB", nvme_path=nvme_dir, nvme_capacity="512KiB"
    )
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(300))
        blocks = random_blocks(SMALL_LAYOUT, 300, seed=4)
        for i in range(0, 300, 10):
            kv.put(keys[i : i + 10], blocks[i : i + 10])
            for t in kv.stats().tiers:
                assert t.used_bytes <= t.capacity_bytes, t
        on_disk = sum(f.stat().st_blocks * 512 for f in nvme_dir.rglob("*") if f.is_file())
        t = tiers(kv)
        assert t["nvme"].capacity_bytes <= 512 * 1024
        assert on_disk <= 512 * 1024 + 64 * 1024  # the slabs plus the tier's small index
        assert t["nvme"].evictions > 0
        # The newest blocks are served exactly; the oldest were evicted from both tiers.
        assert same_bytes(kv.get(keys[-10:]), blocks[-10:])
        assert kv.lookup(keys[:10]) == 0


def test_restart_serves_what_was_written_down(daemon_factory, nvme_dir) -> None:
    d = daemon_factory(cpu_capacity="1MiB", slab="64KiB", nvme_path=nvme_dir, nvme_capacity="4MiB")
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(40))
        blocks = random_blocks(SMALL_LAYOUT, 40, seed=5)
        put_in_batches(kv, keys, blocks)  # fits the CPU tier: all dirty
    assert d.stop(signal.SIGTERM) == 0  # a graceful stop writes dirty blocks down
    d.start()
    with client(d) as kv:
        assert kv.lookup(keys) == 40  # the cache is not empty after a restart
        assert same_bytes(kv.get(keys), blocks)
        assert tiers(kv)["nvme"].promotions == 40


WRITER = """
import sys, time
sys.path.insert(0, {tests!r})
from conftest import SMALL_LAYOUT, random_blocks
from kvstore import KVStoreClient
kv = KVStoreClient({address!r}, layout=SMALL_LAYOUT, model="test-model")
i = 0
while i < 400:  # bounded: 4000 blocks fit the disk tier, so nothing is evicted
    keys = kv.hash_tokens(list(range(10_000_000 + i * 160, 10_000_000 + (i + 1) * 160)))
    kv.put(keys, random_blocks(SMALL_LAYOUT, 10, seed=1000 + i))
    i += 1
"""


def test_kill_9_during_heavy_writes_then_restart(daemon_factory, nvme_dir) -> None:
    d = daemon_factory(
        cpu_capacity="2MiB",
        slab="64KiB",
        nvme_path=nvme_dir,
        nvme_capacity="128MiB",
        write_through=True,
    )
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(60))
        blocks = random_blocks(SMALL_LAYOUT, 60, seed=6)
        put_in_batches(kv, keys, blocks)
        wait_for(lambda: tiers(kv)["nvme"].blocks >= 60, what="write-through")
    code = WRITER.format(tests=os.path.dirname(__file__), address=d.address)
    writer = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(2.0)  # heavy writes in flight
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
    finally:
        writer.kill()
        writer.wait()
    d.log.close()
    d.start()
    with client(d) as kv:
        # Everything committed to disk before the kill is found, bit-exact.
        assert kv.lookup(keys) == 60
        assert same_bytes(kv.get(keys), blocks)
        # Blocks written during the kill are either whole or missing: never torn.
        for i in range(0, 400):
            wkeys = kv.hash_tokens(list(range(10_000_000 + i * 160, 10_000_000 + (i + 1) * 160)))
            got = kv.get(wkeys)
            expected = random_blocks(SMALL_LAYOUT, 10, seed=1000 + i)
            assert same_bytes(got, expected[: got.shape[0]]), i
        assert tiers(kv)["nvme"].checksum_failures == 0


def test_durable_puts_survive_a_kill_9_right_after_the_put_returns(
    daemon_factory, nvme_dir
) -> None:
    """With write_through, a kill -9 within ~50 ms of a returned put lost the whole put: the
    put was acknowledged before the write began. With durable_puts the acknowledgement comes
    only after the blocks are on disk and fdatasync'd."""
    d = daemon_factory(
        cpu_capacity="2MiB",
        slab="64KiB",
        nvme_path=nvme_dir,
        nvme_capacity="64MiB",
        extra="durable_puts = true\n",
    )
    batches = []
    with client(d) as kv:
        for i in range(5):
            keys = kv.hash_tokens(tokens(16, offset=16 * i))
            blocks = random_blocks(SMALL_LAYOUT, 16, seed=50 + i)
            assert kv.put(keys, blocks) == 16
            batches.append((keys, blocks))
        d.proc.send_signal(signal.SIGKILL)  # at once: no drain, no time for a background write
        d.proc.wait()
    d.log.close()
    d.start()
    with client(d) as kv:
        for keys, blocks in batches:
            assert kv.lookup(keys) == 16
            assert same_bytes(kv.get(keys), blocks)


def _flip_payload_byte(nvme_dir: Path, block: torch.Tensor) -> None:
    needle = block.contiguous().view(torch.uint8).reshape(-1)[:256].numpy().tobytes()
    for f in sorted(nvme_dir.rglob("*")):
        if not f.is_file():
            continue
        data = f.read_bytes()
        pos = data.find(needle)
        if pos >= 0:
            with open(f, "r+b") as fh:
                fh.seek(pos + 100)
                byte = fh.read(1)
                fh.seek(pos + 100)
                fh.write(bytes([byte[0] ^ 0xFF]))
            return
    raise AssertionError("block not found in the slab files")


def test_a_flipped_byte_on_disk_is_a_miss_and_neighbours_are_served(
    daemon_factory, nvme_dir
) -> None:
    d = daemon_factory(cpu_capacity="1MiB", slab="64KiB", nvme_path=nvme_dir, nvme_capacity="4MiB")
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(6))
        blocks = random_blocks(SMALL_LAYOUT, 6, seed=7)
        kv.put(keys, blocks)
    assert d.stop() == 0
    _flip_payload_byte(nvme_dir, blocks[3])
    d.start()
    with client(d) as kv:
        got = kv.get(keys)
        assert got.shape[0] == 3 and same_bytes(got, blocks[:3])  # the corrupt block ends the run
        assert kv.get(keys[3:4]).shape[0] == 0  # never served, and now gone
        assert same_bytes(kv.get(keys[4:]), blocks[4:])  # its neighbours are intact
        t = tiers(kv)["nvme"]
        assert t.checksum_failures == 1


def test_prefetch_then_get_is_served_from_cpu(daemon_factory, nvme_dir, monkeypatch) -> None:
    # The get goes to the daemon (not the presence table, whose reads it learns of only with
    # the client's next call), so its counters say at once what the get found.
    monkeypatch.setattr(presence_link, "FLUSH_S", 0.0)
    d = daemon_factory(
        cpu_capacity="256KiB", slab="64KiB", nvme_path=nvme_dir, nvme_capacity="4MiB"
    )
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(16))
        blocks = random_blocks(SMALL_LAYOUT, 16, seed=8)
        kv.put(keys, blocks)
        filler = kv.hash_tokens(tokens(64, offset=50_000))
        put_in_batches(kv, filler, random_blocks(SMALL_LAYOUT, 64, seed=9))
        assert tiers(kv)["cpu"].hits == 0
        before = tiers(kv)["nvme"]
        kv.prefetch(keys)  # returns at once
        wait_for(lambda: tiers(kv)["nvme"].promotions >= before.promotions + 16, what="prefetch")
        assert same_bytes(kv.get(keys), blocks)
        after = tiers(kv)["nvme"]
        assert after.promotions == before.promotions + 16  # the get read nothing from disk
        assert after.extra["prefetch_hits"] == 16


async def test_concurrent_readers_of_a_promoting_block_read_the_disk_once(
    daemon_factory, nvme_dir
) -> None:
    d = daemon_factory(
        cpu_capacity="256KiB", slab="64KiB", nvme_path=nvme_dir, nvme_capacity="4MiB"
    )
    import asyncio

    async with AsyncKVStoreClient(d.address, layout=SMALL_LAYOUT, model="test-model") as kv:
        keys = kv.hash_tokens(tokens(8))
        blocks = random_blocks(SMALL_LAYOUT, 8, seed=10)
        await kv.put(keys, blocks)
        filler = kv.hash_tokens(tokens(64, offset=70_000))
        fill = random_blocks(SMALL_LAYOUT, 64, seed=11)
        for i in range(0, 64, 8):
            await kv.put(filler[i : i + 8], fill[i : i + 8])
        before = {t.name: t for t in (await kv.stats()).tiers}["nvme"].promotions
        results = await asyncio.gather(*(kv.get(keys) for _ in range(4)))
        for got in results:
            assert same_bytes(got, blocks)
        after = {t.name: t for t in (await kv.stats()).tiers}["nvme"].promotions
        assert after - before == 8


def test_a_durable_put_retried_after_a_full_disk_is_acknowledged_only_once_on_disk(
    daemon_factory, tmp_path
) -> None:
    """A durable put refused because its blocks could not reach the disk leaves them in
    memory, and the error says the put may be retried. The retry found its keys stored and
    was acknowledged at once, with nothing on disk: a kill -9 then lost an acknowledged put.
    Now a retry writes what it finds in memory down first, on every put path."""
    with tmpfs(tmp_path / "small", "256k") as mount:
        d = daemon_factory(
            cpu_capacity="1MiB",
            slab="64KiB",
            nvme_path=mount,
            nvme_capacity="4MiB",
            extra="durable_puts = true\n",
        )
        refused = []
        with client(d) as kv:
            for i in range(60):
                keys = kv.hash_tokens(tokens(4, offset=1000 * i))
                blocks = random_blocks(SMALL_LAYOUT, 4, seed=i)
                try:
                    kv.put(keys, blocks)
                except UnavailableError as exc:
                    assert "could not be made durable" in str(exc)
                    refused.append((keys, blocks))
                    if len(refused) == 2:
                        break
            assert len(refused) == 2, "the disk never filled"
            assert kv.lookup(refused[0][0]) == 4  # stored in memory, as the error said
            subprocess.run(["mount", "-o", "remount,size=16m", str(mount)], check=True)
            keys, blocks = refused[0]
            kv.put(keys, blocks)  # this handle's path (spare slots, or a reserve)
        with client(d) as fresh:  # a new handle: a plain reserve
            keys, blocks = refused[1]
            fresh.put(keys, blocks)
        d.proc.send_signal(signal.SIGKILL)  # no drain: only what was durable survives
        d.proc.wait()
        d.log.close()
        d.start()
        with client(d) as kv:
            for keys, blocks in refused:
                assert kv.lookup(keys) == 4
                assert same_bytes(kv.get(keys), blocks)
        d.stop()


def test_a_full_disk_leaves_the_daemon_serving_from_cpu(daemon_factory, tmp_path) -> None:
    with tmpfs(tmp_path / "small", "256k") as mount:
        d = daemon_factory(
            cpu_capacity="256KiB", slab="64KiB", nvme_path=mount, nvme_capacity="8MiB"
        )
        with client(d) as kv:
            keys = kv.hash_tokens(tokens(64))
            blocks = random_blocks(SMALL_LAYOUT, 64, seed=12)
            put_in_batches(kv, keys, blocks)  # 2x the CPU tier: the disk cannot take it all
            assert same_bytes(kv.get(keys[-8:]), blocks[-8:])
            nvme = tiers(kv).get("nvme")
            assert nvme is None or not nvme.up or nvme.used_bytes <= 256 * 1024
            errors = nvme.extra["io_errors"] if nvme is not None else 0
        assert d.alive()
        # Every failed write is counted; the log gets a line per 10 s, not one per write.
        d.log.flush()
        lines = (d.directory / "daemon.log").read_text(errors="replace").count("write failed")
        assert lines <= 1 + errors // 2, (lines, errors)
        d.stop()


def test_stat_shows_the_nvme_tier_and_check_verifies_it(daemon_factory, nvme_dir) -> None:
    d = daemon_factory(
        cpu_capacity="256KiB",
        slab="64KiB",
        nvme_path=nvme_dir,
        nvme_capacity="2MiB",
        nvme_codec="lz4",
    )
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(48))
        # Low-entropy blocks so lz4 has something to do.
        blocks = torch.zeros((48, *SMALL_LAYOUT.block_shape), dtype=torch.bfloat16)
        blocks[:, :, :, :, :, :4] = random_blocks(SMALL_LAYOUT, 48)[:, :, :, :, :, :4]
        put_in_batches(kv, keys, blocks)
        assert same_bytes(kv.get(keys[:8]), blocks[:8])
    cli = [sys.executable, "-m", "kvstore"]
    table = subprocess.run(
        [*cli, "stat", "--address", d.address], capture_output=True, text=True, check=True
    ).stdout
    assert "nvme" in table and "io ratio" in table and "logical" in table
    data = json.loads(
        subprocess.run(
            [*cli, "stat", "--json", "--address", d.address],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    nvme = next(t for t in data["tiers"] if t["name"] == "nvme")
    assert nvme["extra"]["compression_ratio"] > 1.5
    assert nvme["demotions"] > 0 and nvme["used_bytes"] <= nvme["capacity_bytes"]
    assert d.stop() == 0
    check = [*cli, "check", "--nvme-path", str(nvme_dir), "--nvme-capacity", "2MiB"]
    ok = subprocess.run(check, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr


FP8_RULE = """
[[codecs]]
model = "test-model"
nvme = "fp8"
"""


def fp8_form(blocks: torch.Tensor) -> torch.Tensor:
    """What the fp8 codec gives back for each block: its deterministic decoded form."""
    fmt = block_format_of(SMALL_LAYOUT)
    out = [
        torch.frombuffer(
            bytearray(
                codecs.round_trip(
                    codecs.CODEC_FP8, memoryview(b.view(torch.uint8).numpy().reshape(-1)), fmt
                )
            ),
            dtype=SMALL_LAYOUT.dtype,
        ).view(SMALL_LAYOUT.block_shape)
        for b in blocks
    ]
    return torch.stack(out)


def test_records_written_under_one_codec_are_read_after_the_codec_changes(
    daemon_factory, nvme_dir
) -> None:
    d = daemon_factory(
        cpu_capacity="256KiB",
        slab="64KiB",
        nvme_path=nvme_dir,
        nvme_capacity="4MiB",
        extra=FP8_RULE,
    )
    n = 24
    with client(d) as kv:
        lossy_keys = kv.hash_tokens(tokens(n))
        lossy = random_blocks(SMALL_LAYOUT, n, seed=21)
        put_in_batches(kv, lossy_keys, lossy)
        # Served from the CPU tier: the committed bytes, exactly.
        assert same_bytes(kv.get(lossy_keys[:8]), lossy[:8])
    assert d.stop(signal.SIGTERM) == 0  # written down with fp8
    # Restarted with a rule that still chooses fp8 below the CPU tier: the records decode.
    d.config_text = d.config_text.replace(FP8_RULE, FP8_RULE.replace('"fp8"', '"fp8+lz4"'))
    d.start()
    with client(d) as kv:
        assert kv.lookup(lossy_keys) == n
        got = kv.get(lossy_keys)  # the client verifies each block against its checksum
        assert same_bytes(got, fp8_form(lossy)) and not same_bytes(got, lossy)
        assert (got.float() - lossy.float()).norm() <= lossy.float().norm() / 16
    assert d.stop(signal.SIGTERM) == 0
    # With no codec rule and lz4 by default the namespace is lossless: its fp8 records are
    # not its bytes, dropped when it is opened (never counted as found, never read).
    d.config_text = d.config_text.replace(FP8_RULE.replace('"fp8"', '"fp8+lz4"'), "").replace(
        'codec = "none"', 'codec = "lz4"'
    )
    d.start()
    with client(d) as kv:
        assert kv.lookup(lossy_keys) == 0
        assert kv.get(lossy_keys).shape[0] == 0
        nv = tiers(kv)["nvme"]
        assert nv.extra["lossy_refused"] == n and nv.checksum_failures == 0
        exact_keys = kv.hash_tokens(tokens(n, offset=50_000))
        exact = random_blocks(SMALL_LAYOUT, n, seed=22)
        exact[..., 4:] = 0  # compressible by more than a page: lz4 stores it
        put_in_batches(kv, exact_keys, exact)
        put_in_batches(kv, lossy_keys, lossy)  # stored exactly again
    assert d.stop(signal.SIGTERM) == 0
    # Again with codec none: the lz4 records are read as their codec says.
    d.config_text = d.config_text.replace('codec = "lz4"', 'codec = "none"')
    d.start()
    with client(d) as kv:
        assert same_bytes(kv.get(exact_keys), exact)
        assert same_bytes(kv.get(lossy_keys), lossy)
        nv = tiers(kv)["nvme"]
        assert nv.extra["records_fp8"] == 0 and nv.extra["records_lz4"] == n
        assert nv.checksum_failures == 0


def test_a_lossy_block_promoted_within_one_run_is_its_decoded_form(
    daemon_factory, nvme_dir
) -> None:
    d = daemon_factory(
        cpu_capacity="256KiB",
        slab="64KiB",
        nvme_path=nvme_dir,
        nvme_capacity="4MiB",
        extra=FP8_RULE,
    )
    n = 96  # three times the CPU tier: most blocks leave it for the disk
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(n))
        blocks = random_blocks(SMALL_LAYOUT, n, seed=23)
        put_in_batches(kv, keys, blocks)
        for i in range(0, 8, 8):
            got = kv.get(keys[i : i + 8])
            assert same_bytes(got, fp8_form(blocks[i : i + 8]))
        t = tiers(kv)
        assert t["nvme"].promotions > 0 and t["nvme"].checksum_failures == 0
        assert t["cpu"].checksum_failures == 0


def test_stat_shows_logical_and_stored_bytes_per_tier_and_namespace(daemon_factory, nvme_dir):
    layout = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16)  # 64 KiB
    d = daemon_factory(
        cpu_capacity="1MiB",
        slab="256KiB",
        nvme_path=nvme_dir,
        nvme_capacity="520MiB",  # two 256 MiB slabs: one per slot size (raw, fp8)
        write_through=True,
        extra='[[codecs]]\nmodel = "lossy-model"\nnvme = "fp8"\n',
    )
    n = 8
    for want, model in enumerate(("lossy-model", "exact-model"), start=1):
        with KVStoreClient(d.address, layout=layout, model=model) as kv:
            kv.put(kv.hash_tokens(tokens(n)), random_blocks(layout, n, seed=31))
            wait_for(lambda kv=kv, want=want: tiers(kv)["nvme"].blocks >= n * want)
    cli = [sys.executable, "-m", "kvstore", "stat", "--address", d.address]
    table = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
    assert "fp8" in table and "logical" in table
    data = json.loads(subprocess.run([*cli, "--json"], capture_output=True, text=True).stdout)
    nvme = next(t for t in data["tiers"] if t["name"] == "nvme")
    raw_slot, fp8_slot = 4096 + layout.block_bytes, 4096 + 40960 - 4096
    assert nvme["logical_bytes"] == 2 * n * layout.block_bytes
    assert nvme["stored_bytes"] == nvme["used_bytes"] == n * (raw_slot + fp8_slot)
    by_model = {ns["name"].split("/")[0]: ns for ns in data["namespaces"]}
    (lossy,) = by_model["lossy-model"]["tiers"]
    (exact,) = by_model["exact-model"]["tiers"]
    assert (lossy["tier"], lossy["codec"], exact["codec"]) == ("nvme", "fp8", "none")
    assert lossy["stored_bytes"] == n * fp8_slot and exact["stored_bytes"] == n * raw_slot
    assert lossy["ratio"] > 1.5 and exact["ratio"] < 1.0
    assert lossy["logical_bytes"] == exact["logical_bytes"] == n * layout.block_bytes
