"""The vLLM connector against real vLLM engines (each in its own process) and a real daemon.

Runs in the environment ``scripts/vllm_env.sh`` builds (``make test-vllm``); skipped where
vLLM is not installed. Engines take 30-80 s each to start here, so one module runs a few
engines over many prompts: engine A stores, engine B (fresh, prefix caching off so every
reused token comes through the connector) loads, engine C (no connector) is the reference,
and engine D lives through a corrupted block, a stalled, a killed and a restarted daemon.
"""

from __future__ import annotations

import importlib.util
import signal
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm builds .venv-vllm)", allow_module_level=True)

from conftest import DaemonProcess, config_toml

from .harness import BLOCK, Engine, assert_same_answers, outputs, prompt
from .harness import engine_spec as base_spec

ENGINE_PROCESSES = True  # vLLM's own process layout, as deployed (conftest.engine_processes)

pytestmark = pytest.mark.timeout(1800)

P_FULL = prompt(200, 1)  # 6 full blocks and 8 tokens
P_MULT = prompt(6 * BLOCK, 2)  # exactly 6 blocks: 5 can load, the last token is computed
P_PART = prompt(160, 3, prefix=P_FULL[:100])  # shares 3 full blocks with P_FULL
S_BASE = prompt(4 * BLOCK + 40, 4)
SHARED = [prompt(4 * BLOCK + 20 + 13 * k, 10 + k, prefix=S_BASE[: 4 * BLOCK]) for k in range(3)]
P_SALT = prompt(130, 5)
Q = [prompt(90 + 20 * k, 20 + k) for k in range(3)]  # fresh prompts for engine D

A_PROMPTS = [
    {"ids": P_FULL},
    {"ids": P_MULT},
    {"ids": S_BASE},
    {"ids": P_SALT, "salt": "alice"},
]
B_PROMPTS = [
    {"ids": P_FULL},
    {"ids": P_MULT},
    {"ids": P_PART},
    *({"ids": s} for s in SHARED),
    {"ids": P_SALT, "salt": "bob"},
    {"ids": P_SALT, "salt": "alice"},
    {"ids": P_SALT},
]
B_CACHED = [6 * BLOCK, 5 * BLOCK, 3 * BLOCK, 4 * BLOCK, 4 * BLOCK, 4 * BLOCK, 0, 4 * BLOCK, 0]
D_PROMPTS = [{"ids": P_FULL}, {"ids": P_PART}, {"ids": P_MULT}, *({"ids": q} for q in Q)]


def engine_spec(model: Path, connector: dict | None, phases: list[dict], **kw: object) -> dict:
    # Chunked prefill in 64-token steps: a prompt is computed (and saved) over several steps.
    return base_spec(model, connector, phases, max_num_batched_tokens=64, **kw)


def connector_config(daemon: DaemonProcess, stall_s: float = 20.0) -> dict:
    # Deadlines long enough that a loaded 2-core machine never turns a hit into a miss; the
    # failure test shortens them, since a stopped daemon costs each call its deadline.
    return {
        "address": daemon.address,
        "timeout_s": stall_s,
        "lookup_timeout_s": stall_s,
        "retry_after_s": 1.0,
    }


@pytest.fixture(scope="module")
def reference(model: Path, work: Path) -> dict:
    """Engine C: no connector, every prompt the other engines serve."""
    phases = [
        {"prompts": A_PROMPTS},
        {"prompts": B_PROMPTS},
        {"prompts": D_PROMPTS, "one_by_one": True},
    ]
    return Engine(engine_spec(model, None, phases, prefix_caching=False), work, "C").result()


@pytest.fixture(scope="module")
def stored_then_loaded(model: Path, work: Path, daemon: DaemonProcess) -> tuple[dict, dict]:
    conn = connector_config(daemon)
    a = Engine(engine_spec(model, conn, [{"prompts": A_PROMPTS}]), work, "A").result()
    b = Engine(
        engine_spec(model, conn, [{"prompts": B_PROMPTS}], prefix_caching=False), work, "B"
    ).result()
    return a, b


def test_engine_a_stores_and_answers_as_without_the_connector(stored_then_loaded, reference):
    a, _ = stored_then_loaded
    assert_same_answers(outputs(a), outputs(reference, 0), "engine A (storing)")


def test_a_fresh_engine_loads_stored_prefixes_and_answers_identically(
    stored_then_loaded, reference
):
    _, b = stored_then_loaded
    got = outputs(b)
    # Full prompt, a length that is a multiple of the block size (its last block is computed,
    # never loaded), a prompt sharing only a prefix, three concurrent requests sharing one
    # prefix, and chunked prefill throughout (64-token steps).
    assert [o["num_cached_tokens"] for o in got] == B_CACHED
    assert_same_answers(got, outputs(reference, 1), "engine B (loading)")


def test_two_cache_salts_never_share_blocks(stored_then_loaded):
    _, b = stored_then_loaded
    bob, alice, unsalted = (o["num_cached_tokens"] for o in outputs(b)[-3:])
    assert (bob, alice, unsalted) == (0, 4 * BLOCK, 0)


def test_blocks_live_in_a_namespace_naming_the_physical_format(stored_then_loaded, daemon):
    from kvstore.client.sync import KVStoreClient
    from kvstore.layout import KVLayout

    del stored_then_loaded
    with KVStoreClient(daemon.address, layout=KVLayout(1, 1, 32, BLOCK), model="probe") as kv:
        names = [ns.name for ns in kv.stats().namespaces]
    ours = [n for n in names if "kv=vllm-cpu[nb,H,bs,2D]" in n]
    assert len(ours) == 1, names


# ---------------------------------------------------------------------------- failures
def _flip_block_on_disk(nvme_dir: Path, block: bytes) -> None:
    needle = block[:64]
    for f in sorted(nvme_dir.rglob("*")):
        if not f.is_file():
            continue
        data = f.read_bytes()
        pos = data.find(needle)
        if pos >= 0:
            with open(f, "r+b") as fh:
                fh.seek(pos + 100)
                byte = fh.read(1)
                fh.seek(pos + 100)
                fh.write(bytes([byte[0] ^ 0xFF]))
            return
    raise AssertionError("block not found in the NVMe slab files")


def _connector_view(daemon: DaemonProcess, model: Path, tokens: list[int]):
    """(a client of the namespace the connector stores ``tokens`` in, the keys of its full
    blocks): the keys are vLLM's sha256 block hashes, re-hashed (see kvstore.integrations.vllm),
    computed here independently of the connector."""
    import torch
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kcu

    from kvstore.client.sync import KVStoreClient
    from kvstore.integrations.vllm import store_key
    from kvstore.layout import KVLayout

    kcu.init_none_hash(sha256)
    parent = None
    keys = []
    for i in range(len(tokens) // BLOCK):
        parent = kcu.hash_block_tokens(sha256, parent, tokens[i * BLOCK : (i + 1) * BLOCK])
        keys.append(store_key(parent))
    layout = KVLayout(4, 2, 64, BLOCK, dtype=torch.float32)
    with KVStoreClient(daemon.address, layout=layout, model="probe") as probe:
        revision = next(
            ns.name.split("@", 1)[1].rsplit("/", 1)[0]
            for ns in probe.stats().namespaces
            if "vllm-cpu" in ns.name
        )
    return KVStoreClient(daemon.address, layout=layout, model=str(model), revision=revision), keys


def _stored_block(daemon: DaemonProcess, model: Path, tokens: list[int], index: int) -> bytes:
    """The bytes the connector stored for block ``index`` of ``tokens``."""
    import torch

    kv, keys = _connector_view(daemon, model, tokens)
    with kv:
        got = kv.get(keys[: index + 1])
    assert got.shape[0] == index + 1, "the connector's keys are not the documented ones"
    return got[index].contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _wait_stored(daemon: DaemonProcess, model: Path, tokens: list[int]) -> None:
    """Wait until every full block of ``tokens`` is stored (saves are asynchronous)."""
    kv, keys = _connector_view(daemon, model, tokens)
    with kv:
        deadline = time.monotonic() + 120
        while kv.lookup(keys) < len(keys):
            assert time.monotonic() < deadline, "the connector never stored the blocks again"
            time.sleep(0.1)


def _checksum_failures(daemon: DaemonProcess) -> int:
    from kvstore.client.sync import KVStoreClient
    from kvstore.layout import KVLayout

    with KVStoreClient(daemon.address, layout=KVLayout(1, 1, 32, BLOCK), model="probe") as kv:
        return sum(t.checksum_failures for t in kv.stats().tiers)


def test_corrupt_stalled_killed_restarted_daemon_never_changes_an_answer(
    model: Path, work: Path, reference: dict, tmp_path_factory: pytest.TempPathFactory
):
    nvme = Path(tmp_path_factory.mktemp("nvme"))
    d = DaemonProcess(
        Path(tmp_path_factory.mktemp("kvd")),
        config_toml(
            cpu_capacity="64MiB",
            slab="4MiB",
            nvme_path=nvme,
            nvme_capacity="64MiB",
            write_through=True,
        ),
    ).start()
    flags = [work / f"D.{name}" for name in ("s0", "g1", "s1", "g2", "s2", "g3", "s3", "g4")]
    s0, g1, s1, g2, s2, g3, s3, g4 = flags
    phases = [
        {"prompts": [{"ids": P_FULL}, {"ids": Q[0]}], "signal": str(s0), "one_by_one": True},
        {"prompts": [{"ids": P_FULL}], "wait_for": str(g1), "signal": str(s1)},
        {
            "prompts": [{"ids": P_PART}, {"ids": Q[1]}],
            "wait_for": str(g2),
            "signal": str(s2),
            "one_by_one": True,
        },
        {
            "prompts": [{"ids": P_MULT}, {"ids": Q[2]}],
            "wait_for": str(g3),
            "signal": str(s3),
            "one_by_one": True,
        },
        {"prompts": [{"ids": P_FULL}], "wait_for": str(g4)},
    ]
    engine = Engine(
        engine_spec(model, connector_config(d, stall_s=5.0), phases, prefix_caching=False),
        work,
        "D",
    )
    try:
        engine.wait_file(s0)
        _wait_stored(d, model, P_FULL[: 6 * BLOCK])
        block3 = _stored_block(d, model, P_FULL, 3)
        assert d.stop() == 0
        _flip_block_on_disk(nvme, block3)
        d.start()
        g1.touch()
        engine.wait_file(s1)
        checksum_failures = _checksum_failures(d)
        _wait_stored(d, model, P_FULL[: 6 * BLOCK])  # block 3, recomputed, is stored again
        d.proc.send_signal(signal.SIGSTOP)  # a daemon that answers nothing
        g2.touch()
        engine.wait_file(s2)
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        d.log.close()
        g3.touch()
        engine.wait_file(s3)
        d.start()  # restarted: the NVMe tier still holds what was written through
        # After a failure the connector leaves the store alone for retry_after_s (1 s here):
        # wait that out so the last phase meets the restarted daemon.
        time.sleep(2.5)
        g4.touch()
        result = engine.result()
    finally:
        engine.kill()
        if d.alive():
            d.proc.send_signal(signal.SIGCONT)
            d.stop()
    ref = {tuple(p["ids"]): o for p, o in zip(D_PROMPTS, outputs(reference, 2), strict=True)}
    for i, phase in enumerate(phases):
        want = [ref[tuple(p["ids"])] for p in phase["prompts"]]
        assert_same_answers(outputs(result, i), want, f"engine D phase {i}")
    # Phase 1 met the corrupt block 3: the daemon refused it (a checksum failure), the worker
    # reported it and the blocks after it as load errors, vLLM recomputed them, and the answer
    # above is still identical. (vLLM's num_cached_tokens counts what was scheduled to load.)
    assert checksum_failures >= 1
    # Phase 4, after the restart, loads every block, block 3 included: it was stored again
    # when phase 1 recomputed it.
    assert outputs(result, 0)[0]["num_cached_tokens"] == 0
    assert outputs(result, 4)[0]["num_cached_tokens"] == 6 * BLOCK
