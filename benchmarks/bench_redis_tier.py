"""The Redis tier against redis-py on the same real ``redis-server``, measured in one run.

For a 128-block prefix (one batch of 128 keys) of 2 MiB blocks and of 512 KiB blocks, over a
unix socket:

* tier put / get_into: ``RedisTier.put`` of 128 new blocks (checksum check, header, SET NX),
  ``get_into`` of them into preallocated buffers (header and xxh3-64 verified);
* tier (redis-py driver): the same through redis-py, as TLS and Cluster use it (one copy per
  value each way);
* redis-py SET / GET seq: one awaited SET or GET per block, memoryview values out, new
  ``bytes`` in and not copied further: the raw peer, read as favourably as it can be;
* redis-py SET / GET pipelined: one pipeline of 128 commands;

and the latency of one block: ``get_into`` of one key against one redis-py GET (median of 128).
redis-py is set up as the tier's redis-py driver: RESP3 (its default; RESP2 is also shown for
GET), pure-Python parser and packer (hiredis is not installed: its packer copies values),
1 MiB socket reads. Each figure is the median of ``--runs`` rounds; a round runs every phase
once, in an order that rotates between rounds so load from other processes hits all alike.
Puts always write new keys (Redis is flushed before each). Sources and destinations are 256 MiB
each at 2 MiB blocks, beyond the 32 MiB L3, so nothing is cache-hot. Every tier get is checked
(untimed) to return the bytes put. Redis holds at most two copies of a batch (~512 MiB).

Reading the figures (2-vCPU VM, client and Redis share both CPUs): puts into a just-flushed
Redis are bound by Redis faulting in fresh memory (~1.5-2 GB/s here, whoever sends). redis-py's
GET speed swings with the allocator's state: in a fresh process reading 2 MiB values it ran
~1.2 GB/s, here (after the puts) ~2.7-3 GB/s; the ratio is taken to the figure of this run.
Values of exactly the block's size ("raw values") are shown beside the tier's own
(``HEADER_BYTES``, 96 bytes, longer), which the other peer rows read. The tier here is
unkeyed (no ``mac_secret``): the figures are of the header checks and copies alone.

The tier's calls run with ``timeout_s`` 10 s here: the point is throughput, not the deadline.

    .venv/bin/python benchmarks/bench_redis_tier.py [--runs 5] [--quick | --smoke] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import mmap
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from _harness import (
    RedisServer,
    Reporter,
    emit,
    expect,
    fmt_size,
    gbps,
    parse_args,
    print_header,
    run_main,
)

from kvstore.checksum import block_checksum
from kvstore.tiers.redis import HEADER_BYTES, RedisTier

NS = bytes(range(16))
BLOCKS = 128


def arena(count: int, nbytes: int, random_fill: bool) -> list[memoryview]:
    """``count`` buffers in one pre-faulted mapping (what the CPU tier's slots look like)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    view = memoryview(mmap.mmap(-1, count * nbytes, flags=flags))
    bufs = [view[i * nbytes : (i + 1) * nbytes] for i in range(count)]
    if random_fill:
        for b in bufs:
            b[:] = os.urandom(nbytes)
    return bufs


def peer(socket_path: str, protocol: int) -> Any:
    pool = aioredis.ConnectionPool.from_url(
        f"unix://{socket_path}", protocol=protocol, socket_read_size=1 << 20
    )
    return aioredis.Redis(connection_pool=pool)


def rotated(names: list[str], k: int) -> list[str]:
    k %= len(names)
    return names[k:] + names[:k]


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


async def one_size(sock: str, size: int, runs: int, blocks: int) -> dict[str, Any]:
    src = arena(blocks, size, random_fill=True)
    dst = arena(blocks, size, random_fill=False)
    keys = [i.to_bytes(32, "big") for i in range(blocks)]
    sums = [block_checksum(b, NS, k) for b, k in zip(src, keys, strict=True)]
    entries = list(zip(keys, src, sums, strict=True))
    items = list(zip(keys, sums, dst, strict=True))
    fast = RedisTier(f"unix://{sock}", timeout_s=10.0)
    slow = RedisTier(f"unix://{sock}", timeout_s=10.0, driver="redis-py")
    r3, r2 = peer(sock, 3), peer(sock, 2)
    # The peer reads the very values the tier wrote (longer by the header), and also
    # plain copies of the blocks: its speed depends on the value's exact size (see the doc).
    names = [b"kvs:" + NS.hex().encode() + b":" + k.hex().encode() for k in keys]
    raw_names = [b"raw:%d" % i for i in range(blocks)]
    for t in (fast, slow):
        await t.start()
    samples: dict[str, list[float]] = {}

    async def flush() -> None:
        await r3.flushall()

    async def tier_put(tier: RedisTier) -> None:
        expect(await tier.put(NS, entries) == blocks, "the tier did not store every block")

    async def tier_get(tier: RedisTier) -> None:
        found = await tier.get_into(NS, items)
        expect(found == [True] * blocks, f"the tier found {sum(found)} of {blocks} blocks")

    async def set_seq() -> None:
        for n, b in zip(names, src, strict=True):
            await r3.set(n, b)

    async def set_pipe() -> None:
        pipe = r3.pipeline(transaction=False)
        for n, b in zip(names, src, strict=True):
            pipe.set(n, b)
        await pipe.execute()

    def get_seq(r: Any, names: list[bytes]) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            for n in names:
                await r.get(n)

        return run

    async def get_pipe() -> None:
        pipe = r3.pipeline(transaction=False)
        for n in names:
            pipe.get(n)
        await pipe.execute()

    puts: dict[str, Callable[[], Awaitable[None]]] = {
        "tier put": lambda: tier_put(fast),
        "tier put (redis-py driver)": lambda: tier_put(slow),
        "redis-py SET seq": set_seq,
        "redis-py SET pipelined": set_pipe,
    }
    gets: dict[str, Callable[[], Awaitable[None]]] = {
        "tier get_into": lambda: tier_get(fast),
        "tier get_into (redis-py driver)": lambda: tier_get(slow),
        "redis-py GET seq": get_seq(r3, names),
        "redis-py GET seq (RESP2)": get_seq(r2, names),
        "redis-py GET seq (raw values)": get_seq(r3, raw_names),
        "redis-py GET pipelined": get_pipe,
    }
    try:
        for run in range(runs):
            for name in rotated(list(puts), run):
                await flush()
                samples.setdefault(name, []).append(await timed(puts[name]))
            await flush()
            await tier_put(fast)  # what the gets read
            for n, b in zip(raw_names, src, strict=True):
                await r3.set(n, b)
            value, raw = await r3.get(names[0]), await r3.get(raw_names[0])
            expect(
                len(value) == len(raw) + HEADER_BYTES,
                f"the tier's value is {len(value)} bytes, a block and a header {len(raw)} + "
                f"{HEADER_BYTES}",
            )
            for name in rotated(list(gets), run):
                samples.setdefault(name, []).append(await timed(gets[name]))
            # Untimed: the tier's reads return exactly the bytes put.
            for b in dst:
                b[:16] = bytes(16)
            await tier_get(fast)
            expect(all(d == s for d, s in zip(dst, src, strict=True)), "a block read differs")
        # Latency of one block, interleaved.
        lat_tier, lat_peer = [], []
        for i in range(blocks):
            lat_tier.append(await timed(functools.partial(fast.get_into, NS, [items[i]])))
            lat_peer.append(await timed(functools.partial(r3.get, names[i])))
        stats = fast.stats()
        expect(stats["checksum_failures"] == 0, f"{stats['checksum_failures']} checksum failures")
        expect(stats["misses"] == 0, f"{stats['misses']} misses")
    finally:
        await flush()
        for t in (fast, slow):
            await t.close()
        for r in (r3, r2):
            await r.aclose()
    med = {name: statistics.median(v) for name, v in samples.items()}
    return {
        "block_bytes": size,
        "blocks": blocks,
        "median_s": med,
        "gbps": {name: gbps(size * blocks, s) for name, s in med.items()},
        "one_block_us": {
            "tier get_into": statistics.median(lat_tier) * 1e6,
            "redis-py GET": statistics.median(lat_peer) * 1e6,
        },
    }


def report(rep: Reporter, res: dict[str, Any]) -> None:
    size, g, med = res["block_bytes"], res["gbps"], res["median_s"]
    rows = [
        (name, f"{g[name]:.2f}", f"{med[name] * 1e3:.1f}", f"{g[name] / g[base]:.2f}x")
        for base, group in (
            (
                "redis-py SET seq",
                [
                    "tier put",
                    "tier put (redis-py driver)",
                    "redis-py SET seq",
                    "redis-py SET pipelined",
                ],
            ),
            (
                "redis-py GET seq",
                [
                    "tier get_into",
                    "tier get_into (redis-py driver)",
                    "redis-py GET seq",
                    "redis-py GET seq (RESP2)",
                    "redis-py GET seq (raw values)",
                    "redis-py GET pipelined",
                ],
            ),
        )
        for name in group
    ]
    title = f"{fmt_size(size)} blocks, batches of {res['blocks']} (ratio: to redis-py seq)"
    rep.table(title, ["phase", "GB/s", "ms/batch", "ratio"], rows)
    lat = res["one_block_us"]
    rep.table(
        f"{fmt_size(size)}: one block",
        ["call", "median us"],
        [(k, f"{v:.0f}") for k, v in lat.items()],
    )
    if not rep.as_json:
        print(
            f"tier get_into / redis-py GET seq {g['tier get_into'] / g['redis-py GET seq']:.2f}x,"
            f" / pipelined {g['tier get_into'] / g['redis-py GET pipelined']:.2f}x;"
            f" tier put / SET seq {g['tier put'] / g['redis-py SET seq']:.2f}x,"
            f" / pipelined {g['tier put'] / g['redis-py SET pipelined']:.2f}x"
        )


def main() -> int:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--runs", type=int, default=5, help="rounds; figures are medians")

    args = parse_args(__doc__.split("\n")[0], extra)
    runs = 1 if args.smoke else 2 if args.quick else args.runs
    blocks = 4 if args.smoke else 32 if args.quick else BLOCKS
    rep = Reporter(args.json)
    if not args.json:
        print_header("bench_redis_tier", args)
    results = []
    t0 = time.perf_counter()
    with RedisServer() as srv:
        for size in (2 << 20, 512 << 10):
            res = asyncio.run(one_size(srv.socket_path, size, runs, blocks))
            report(rep, res)
            results.append(res)
    if not args.json:
        print(f"\n{time.perf_counter() - t0:.0f} s")
    emit({"runs": runs, "results": results}, args)
    return 0


if __name__ == "__main__":
    run_main(main)
