"""With ``nvme.durable_puts``, a block size that had no slab on a full NVMe tier had every put
refused (UNAVAILABLE "could not be made durable") for as long as each disk slab held a block
that also had a CPU copy, which with durable puts the recent blocks all have: making room took
another size's slab only when none of its blocks was cached above (a rule against write-back
churn). So a second model or tenant with another block size, started after the first filled
the disk, could store nothing durably, though nothing on disk was leased. Found by the soak
with faults (``benchmarks/soak.py --faults``: its durable ledger never got a put through). Now a
durable put's write takes such a slab (its blocks keep their CPU copies and become dirty);
write-back still leaves it alone.

Real daemon, real NVMe file, two block sizes; a kill -9 afterwards proves the small blocks were
on disk when acknowledged.
"""

from __future__ import annotations

import signal
from pathlib import Path

import torch
from conftest import random_blocks, same_bytes, tokens

from kvstore import KVLayout, KVStoreClient

BIG = KVLayout(num_layers=16, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float16)
SMALL = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float16)


def test_a_durable_put_of_a_new_block_size_finds_room_on_a_full_disk(
    daemon_factory, tmp_path: Path
) -> None:
    assert BIG.block_bytes == 64 * 1024 and SMALL.block_bytes == 4 * 1024
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    d = daemon_factory(
        cpu_capacity="2MiB",  # every big block keeps its CPU copy
        slab="64KiB",  # one big block per slab
        nvme_path=nvme,
        nvme_capacity="1MiB",  # fewer big slots than big blocks: the disk fills with them
        extra="durable_puts = true\n",
    )
    with KVStoreClient(d.address, layout=BIG, model="target") as kv:
        for i in range(20):
            keys = kv.hash_tokens(tokens(1, offset=16 * i))
            assert kv.put(keys, random_blocks(BIG, 1, seed=i)) == 1
        nvme_tier = next(t for t in kv.stats().tiers if t.name == "nvme")
        assert nvme_tier.evictions > 0  # full: big puts took each other's disk slots
    small_keys, small_blocks = [], []
    with KVStoreClient(d.address, layout=SMALL, model="draft") as kv:
        for i in range(3):
            keys = kv.hash_tokens(tokens(4, offset=10_000 + 64 * i))
            blocks = random_blocks(SMALL, 4, seed=100 + i)
            assert kv.put(keys, blocks) == 4  # before the fix: UnavailableError every time
            small_keys.append(keys)
            small_blocks.append(blocks)
    d.proc.send_signal(signal.SIGKILL)  # no drain: only what was durable survives
    d.proc.wait()
    d.log.close()
    d.start()
    with KVStoreClient(d.address, layout=SMALL, model="draft") as kv:
        for keys, blocks in zip(small_keys, small_blocks, strict=True):
            assert kv.lookup(keys) == 4
            assert same_bytes(kv.get(keys), blocks)
