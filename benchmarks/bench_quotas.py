"""What quotas buy a victim tenant under a hostile flood, and what they cost on the hot path.

1. **Fairness.** Two tenants share a 64 MiB CPU tier (64 KiB blocks, a tenant policy, so each
   tenant has slabs of its own). The victim serves requests over a 16 MiB working set: each
   request looks up a random 8-block prefix and puts what was missing. The hostile tenant, in
   every round, puts 64 new blocks and leases its newest 64 blocks, keeping every lease (a
   client that pins whatever it can). Without quotas (``max_pinned_share = 1``, no
   ``[tenants]``), the hostile tenant ends up pinning the tier and the victim's puts fail;
   with quotas (hostile ``quota_cpu = 32MiB``, victim ``guaranteed_cpu = 16MiB``, the default
   pinned share of half the tier), the victim keeps its set. Per mode: the victim's lookup hit
   rate over the last three quarters of the rounds, its put success rate over all rounds, and
   the hostile tenant's refused calls.
2. **Hot path.** Lookup of 128 present keys, acquire+release of 32 blocks and a put of 32
   blocks (p50, us) on a daemon with quotas configured for the tenant (CPU quota, pinned
   bound, leases, reservations and a keys/s bucket large enough never to refuse: every check
   runs), one without ``[tenants]`` (the books are kept, nothing is bounded), and with
   ``--before TREE`` a daemon of a tree without quotas: the three run side by side and each
   iteration times each in turn.

Usage: ``python benchmarks/bench_quotas.py [--quick | --smoke] [--json] [--part fair|hot]
[--before /path/to/tree]``. ``--smoke``: 4 rounds of the flood, 5 iterations of the hot path.
"""

from __future__ import annotations

import itertools
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import KVStoreDaemon, emit, parse_args, print_header, print_table, run_main

from kvstore import KVLayout, KVStoreClient
from kvstore.errors import KVStoreError

MiB = 1 << 20
LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.bfloat16)
TIER = 64 * MiB


_CONFIGS = tempfile.TemporaryDirectory(prefix="kvbench-quota-")  # removed at exit
_made = itertools.count()


def _config(text: str) -> str:
    path = os.path.join(_CONFIGS.name, f"daemon{next(_made)}.toml")
    with open(path, "w") as f:
        f.write(
            f'[cpu]\ncapacity = "{TIER}"\nslab = "1MiB"\n\n'
            f'[[access]]\nname = "bench"\nuids = [{os.getuid()}]\n'
            f'tenants = ["victim", "hostile", "bench"]\nrole = "operator"\n\n{text}'
        )
    return path


QUOTAS = {
    "no quotas": "[limits]\nmax_pinned_share = 1.0\n",
    "quotas": (
        '[tenants.hostile]\nquota_cpu = "32MiB"\n\n[tenants.victim]\nguaranteed_cpu = "16MiB"\n'
    ),
}


def blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *LAYOUT.block_shape, generator=g).to(LAYOUT.dtype)


def fairness(mode: str, rounds: int) -> dict[str, Any]:
    with KVStoreDaemon(TIER, extra_args=["--config", _config(QUOTAS[mode])]) as d:
        victim = KVStoreClient(d.address, layout=LAYOUT, model="m", tenant="victim")
        hostile = KVStoreClient(d.address, layout=LAYOUT, model="m", tenant="hostile")
        working = 256  # 16 MiB
        vkeys = victim.hash_tokens(list(range(working * 16)))
        data = blocks(8, 1)
        rng = random.Random(7)
        held = []
        hits = asked = puts_ok = puts = refused = 0
        next_key = 0
        for r in range(rounds):
            # The hostile tenant: 64 new blocks, then a lease on its newest 64, kept.
            hk = hostile.hash_tokens(list(range(next_key * 16, (next_key + 64) * 16)))
            next_key += 64
            try:
                hostile.put(hk, blocks(64, r))
            except KVStoreError:
                refused += 1
            try:
                held.append(hostile.acquire(hk))
            except KVStoreError:
                refused += 1
            # The victim: 16 requests, each an 8-block prefix of its working set.
            for _ in range(16):
                start = rng.randrange(0, working // 8) * 8
                keys = vkeys[start : start + 8]
                found = victim.lookup(keys)
                if r >= rounds // 4:
                    hits += found
                    asked += len(keys)
                if found < len(keys):
                    try:
                        victim.put(keys, data)
                        ok = True
                    except KVStoreError:
                        ok = False
                    puts += 1  # every round: the victim puts mostly while it warms up
                    puts_ok += ok
        for lease in held:
            lease.release()
        victim.close()
        hostile.close()
    return {
        "mode": mode,
        "victim_hit_rate": hits / max(1, asked),
        "victim_put_success": puts_ok / max(1, puts),
        "victim_puts": puts,
        "hostile_refused_calls": refused,
    }


def _p50_us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


def _start(text: str, tree: str | None) -> KVStoreDaemon:
    """A daemon with config ``text``, running this tree's kvstore or ``tree``'s."""
    import _harness

    d = KVStoreDaemon(TIER, extra_args=["--config", _config(text)])
    if tree is None:
        d.start()
        return d
    ours = _harness._env_with_our_kvstore
    _harness._env_with_our_kvstore = lambda: {**os.environ, "PYTHONPATH": tree}
    try:
        d.start()
    except BaseException:
        d.stop()
        raise
    finally:
        _harness._env_with_our_kvstore = ours
    return d


HOT = {
    "off": "",
    "on": (
        '[tenants.bench]\nquota_cpu = "48MiB"\nmax_pinned = "32MiB"\nmax_leases = 100000\n'
        "max_reservations = 100000\nkeys_per_s = 1e9\nkeys_burst = 1000000000\n\n"
        '[tenants.bench.namespace]\nquota_cpu = "48MiB"\nkeys_per_s = 1e9\n'
    ),
}


def hot_path(iterations: int, before: str | None) -> list[dict[str, Any]]:
    """The daemons run side by side and every iteration times each of them in turn (the
    order rotating), so the load of a shared machine falls on all alike."""
    modes: list[tuple[str, str, str | None]] = [(m, t, None) for m, t in HOT.items()]
    if before:
        modes.insert(0, ("before (tree at --before)", "", before))
    daemons, clients = [], []
    try:
        for _, text, tree in modes:
            daemons.append(_start(text, tree))
            kv = KVStoreClient(daemons[-1].address, layout=LAYOUT, model="hot", tenant="bench")
            clients.append(kv)
        keys = clients[0].hash_tokens(list(range(128 * 16)))
        for kv in clients:
            kv.put(keys, blocks(128, 0))
        data = blocks(32, 1)
        samples: list[dict[str, list[float]]] = [
            {"lookup": [], "acquire": [], "put": []} for _ in modes
        ]
        for i in range(iterations):
            fresh = clients[0].hash_tokens(list(range((1000 + 32 * i) * 16, (1032 + 32 * i) * 16)))
            order = list(range(len(modes)))
            order = order[i % len(order) :] + order[: i % len(order)]
            for j in order:
                kv, s = clients[j], samples[j]
                t0 = time.perf_counter()
                kv.lookup(keys)
                s["lookup"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                kv.acquire(keys[:32]).release()
                s["acquire"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                kv.put(fresh, data)
                s["put"].append(time.perf_counter() - t0)
                kv.delete(fresh)
    finally:
        for kv in clients:
            kv.close()
        for d in daemons:
            d.stop()
    return [
        {
            "quotas": mode,
            "lookup_128_p50_us": _p50_us(s["lookup"]),
            "acquire_release_32_p50_us": _p50_us(s["acquire"]),
            "put_32_p50_us": _p50_us(s["put"]),
        }
        for (mode, _, _), s in zip(modes, samples, strict=True)
    ]


def main() -> int:
    args = parse_args(
        __doc__.split("\n\n")[0],
        lambda p: (
            p.add_argument("--part", choices=("all", "fair", "hot"), default="all"),
            p.add_argument("--before", help="a kvstore tree without quotas, timed alongside"),
        ),
    )
    print_header("bench_quotas", args)
    result: dict[str, Any] = {}
    if args.part in ("all", "fair"):
        rounds = 4 if args.smoke else 16 if args.quick else 48
        rows = [fairness("no quotas", rounds), fairness("quotas", rounds)]
        result["fair"] = rows
        print_table(
            f"victim vs a hostile flood, {rounds} rounds, 64 MiB CPU tier (hits: last 3/4)",
            ["mode", "victim hit rate", "victim put success", "victim puts", "hostile refused"],
            [[r["mode"], f"{r['victim_hit_rate']:.1%}", f"{r['victim_put_success']:.1%}",
              r["victim_puts"], r["hostile_refused_calls"]] for r in rows],
        )  # fmt: skip
    if args.part in ("all", "hot"):
        rows = hot_path(5 if args.smoke else 100 if args.quick else 400, args.before)
        result["hot"] = rows
        print_table(
            "hot path with and without quotas (p50 us; daemons side by side, timed in turn)",
            ["quotas", "lookup 128 keys", "acquire+release 32", "put 32"],
            [[r["quotas"], r["lookup_128_p50_us"], r["acquire_release_32_p50_us"],
              r["put_32_p50_us"]] for r in rows],
        )  # fmt: skip
    emit(result, args)
    return 0


if __name__ == "__main__":
    run_main(main)
