"""Latency of ``lookup`` of 128 present keys against an empty unary RPC on the same channel.

A real daemon holds 128 blocks whose keys chain over one 2048-token prompt. Calls alternate
(empty, lookup, empty, lookup, ...; the order flips every iteration) on one client's gRPC
channel, so both see the same load. The empty call is the gRPC health ``Check``: a ``Lookup``
of zero keys never leaves the client, and ``Stats`` carries a reply body.

Also reported, to split the cost: ``lookup`` of one key, the ``Lookup`` RPC on the raw stub with
the keys packed in advance (no client-side checks), and, in process, the daemon-side
``BlockStore.lookup`` of 128 keys and the client-side key packing. Then ``lookup(128)`` again
on its own, back to back (``lookup128_alone``: what a scheduler calling it per request sees,
without gRPC calls of the same process in between), and the same from ``AsyncKVStoreClient``
(``async_lookup128``).

Same-host clients answer a lookup from their namespace's presence table (``kvstore.presence``)
where they can, with no call: ``lookup128`` is that path, and ``call128`` the same lookup from a
client told to always call (``KVSTORE_PRESENCE_TABLES=0``), interleaved with it.

Targets: median lookup(128) within 1.5x of the median empty call, and at most 100 us.

``--smoke``: 20 calls of each kind after 5 warm-up ones; checks the script runs (the test
suite runs it so), its figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import os
import sys
import time
from collections.abc import Callable

import torch
from _harness import (
    KVStoreDaemon,
    Reporter,
    Timing,
    emit,
    in_process_store,
    maybe_await,
    median_time,
    parse_args,
    print_header,
    run_main,
    summarize,
    verdict,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import AsyncKVStoreClient, KVLayout, KVStoreClient
from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig
from kvstore.keys import Namespace, pack_keys
from kvstore.v1 import kvstore_pb2 as pb

N_KEYS = 128
TARGET = 1.5
TARGET_US = 100.0
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB blocks


def interleaved(calls: dict[str, Callable[[], object]], n: int, warmup: int) -> dict[str, Timing]:
    """Time every call ``n`` times, round-robin, the order reversed every other round."""
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(n):
        for name in names if i % 2 == 0 else reversed(names):
            fn = calls[name]
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: summarize(s) for name, s in samples.items()}


async def in_process_costs(keys: list[bytes], k: int, warmup: int) -> dict[str, Timing]:
    """Daemon-side lookup and client-side packing of the same keys, without any RPC."""
    config = DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        cpu=CpuTierConfig(capacity_bytes=16 << 20, prefault=False),
    )
    async with in_process_store(config) as store:
        handle = store.open_namespace(Namespace(model="bench-lookup", layout=LAYOUT))
        rid, _, _ = await maybe_await(store.reserve(handle, keys))
        store.commit(handle, rid, [0] * len(keys))
        if await maybe_await(store.lookup(handle, keys)) != len(keys):
            raise RuntimeError("in-process store did not find every key")
        # The local part of a lookup (what the daemon does without a Redis tier); lookup itself
        # is a coroutine because it may ask Redis for the rest of the run.
        ns_id = handle.record.ns_id
        return {
            "store": median_time(lambda: store.leading_run(ns_id, keys), k, warmup),
            "pack": median_time(lambda: pack_keys(keys), k, warmup),
        }


def three_calls_or_one(kv: KVStoreClient, keys: list[bytes]) -> dict[str, Callable[[], object]]:
    """lookup + acquire + prefetch of one request as three calls, and as one (``acquire`` with
    ``lookup`` and ``prefetch``, where the client has it); each lease released (that rides on
    the next call)."""

    def three() -> None:
        kv.lookup(keys)
        kv.acquire(keys).release()
        kv.prefetch(keys)

    calls: dict[str, Callable[[], object]] = {"three_calls128": three}
    if "lookup" in inspect.signature(kv.acquire).parameters:
        calls["one_call128"] = lambda: kv.acquire(keys, lookup=True, prefetch=True).release()
    return calls


async def async_lookups(address: str, keys: list[bytes], n: int, warmup: int) -> Timing:
    """``lookup`` of the same keys from an ``AsyncKVStoreClient``, back to back."""
    async with AsyncKVStoreClient(address, layout=LAYOUT, model="bench-lookup") as kv:
        for _ in range(warmup):
            await kv.lookup(keys)
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            await kv.lookup(keys)
            samples.append(time.perf_counter() - t0)
        if await kv.lookup(keys) != len(keys):
            raise RuntimeError("async lookup did not find every key")
    return summarize(samples)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calls", type=int, default=None, help="timed calls of each kind")


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0], add_args)
    n = args.calls or (20 if args.smoke else 300 if args.quick else 3000)
    warm = 5 if args.smoke else 50
    rep = Reporter(args.json)
    if not args.json:
        print_header("bench_lookup", args)
    with (
        KVStoreDaemon(16 << 20) as daemon,
        KVStoreClient(daemon.address, layout=LAYOUT, model="bench-lookup") as kv,
        contextlib.ExitStack() as stack,
    ):
        tokens = torch.arange(N_KEYS * LAYOUT.block_size, dtype=torch.int64)
        keys = kv.hash_tokens(tokens)
        blocks = torch.zeros((N_KEYS, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
        if kv.put(keys, blocks) != N_KEYS or kv.lookup(keys) != N_KEYS:
            raise RuntimeError(f"could not store {N_KEYS} blocks")

        # The same lookup over gRPC (a client told not to use local calls), for the A/B.
        over_grpc = KVStoreClient(daemon.address, layout=LAYOUT, model="bench-lookup")
        stack.callback(over_grpc.close)
        if over_grpc._session is not None:
            over_grpc._session.calls = False
            over_grpc._session.presence_tables = False
        # The same lookup as a local call: a client that never answers from its table.
        by_call = KVStoreClient(daemon.address, layout=LAYOUT, model="bench-lookup")
        stack.callback(by_call.close)
        if by_call._session is not None:
            by_call._session.presence_tables = False
        missing = keys[:-1] + kv.hash_tokens(torch.arange(16) + 10**6)
        health = health_pb2_grpc.HealthStub(kv._channel)  # the client's own channel
        check = health_pb2.HealthCheckRequest()
        raw = pb.LookupRequest(handle=kv._handle, keys=pack_keys(keys))
        one = keys[:1]
        calls: dict[str, Callable[[], object]] = {
            "empty": lambda: health.Check(check, timeout=10),
            "lookup128": lambda: kv.lookup(keys),
            "call128": lambda: by_call.lookup(keys),
            "lookup128_miss": lambda: kv.lookup(missing),
            "raw128": lambda: kv._stub.Lookup(raw, timeout=10),
            "lookup1": lambda: kv.lookup(one),
            "grpc128": lambda: over_grpc.lookup(keys),
        }
        t = interleaved(calls, n, warm)
        if kv.lookup(keys) != N_KEYS:
            raise RuntimeError("lookup lost keys during the run")
        presence = getattr(kv, "_presence", None)
        answered = presence.answered if presence is not None else 0
        t.update(interleaved({"lookup128_alone": lambda: kv.lookup(keys)}, n, warm))
        t.update(interleaved(three_calls_or_one(kv, keys), n, warm))
        t["async_lookup128"] = asyncio.run(async_lookups(daemon.address, keys, n, warm))
    local = asyncio.run(in_process_costs(keys, 10 * n, warm))

    empty = t["empty"]
    rows = [
        ("empty unary call (health Check)", empty),
        (f"kv.lookup({N_KEYS} keys, all present)", t["lookup128"]),
        (f"kv.lookup({N_KEYS} keys), the last one missing", t["lookup128_miss"]),
        (f"kv.lookup({N_KEYS} keys) as a local call (no presence table)", t["call128"]),
        (f"Lookup RPC, {N_KEYS} keys packed in advance", t["raw128"]),
        ("kv.lookup(1 key)", t["lookup1"]),
        (f"kv.lookup({N_KEYS} keys), back to back", t["lookup128_alone"]),
        (f"AsyncKVStoreClient.lookup({N_KEYS} keys), back to back", t["async_lookup128"]),
        (f"lookup + acquire + prefetch ({N_KEYS} keys), three calls", t["three_calls128"]),
    ]
    if "one_call128" in t:
        rows.append((f"the same, one call: acquire({N_KEYS}, lookup, prefetch)", t["one_call128"]))
    rows += [
        (f"kv.lookup({N_KEYS} keys) over gRPC (no local calls)", t["grpc128"]),
        (f"in process: BlockStore.lookup({N_KEYS})", local["store"]),
        (f"in process: pack_keys({N_KEYS})", local["pack"]),
    ]
    rep.table(
        f"Latency, {n} calls each, interleaved on one channel (us)",
        ["call", "median", "p99", "min", "median / empty"],
        [
            [label, x.median_s * 1e6, x.p99_s * 1e6, x.min_s * 1e6, x.median_s / empty.median_s]
            for label, x in rows
        ],
    )
    ratio = t["lookup128"].median_s / empty.median_s
    ratio_p99 = t["lookup128"].p99_s / empty.p99_s
    status = verdict(ratio <= TARGET)
    lookup_us = t["lookup128"].median_s * 1e6
    status_us = verdict(lookup_us <= TARGET_US)
    rep.table(
        "Target",
        ["target", "value", "needed", "status"],
        [
            [f"lookup({N_KEYS}) / empty call, median", ratio, f"<= {TARGET:g}", status],
            [f"lookup({N_KEYS}) / empty call, p99", ratio_p99, "(info)", ""],
            [f"lookup({N_KEYS}), median us", lookup_us, f"<= {TARGET_US:g}", status_us],
            [
                f"lookup({N_KEYS}) as a call / from the table",
                t["call128"].median_s / t["lookup128"].median_s,
                "(info)",
                "",
            ],
        ],
    )
    rep.line(f"lookups answered from the presence table: {answered}")
    rep.line(f"load {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    emit(
        {
            "keys": N_KEYS,
            "calls": n,
            "us": {
                name: {"median": x.median_s * 1e6, "p99": x.p99_s * 1e6, "min": x.min_s * 1e6}
                for name, x in {**t, **{f"in_process_{k}": v for k, v in local.items()}}.items()
            },
            "answered_from_table": answered,
            "ratio_median": ratio,
            "ratio_p99": ratio_p99,
            "target": {"max_ratio": TARGET, "status": status},
            "target_us": {"max_us": TARGET_US, "status": status_us},
        },
        args,
    )
    return 0


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    run_main(main)
