"""A system prompt shared across tenants (``shared_tenants``), with real engines of distinct
uids against a real daemon whose policy declares ``[shared.system-prompts]``.

The writer (uid W, a writer of the shared tenant) serves the system prompt once and stores its
4 blocks in tenant ``system-prompts``. Alice's engine (uid A, a reader) serves her question
behind that prompt: the 4 blocks load from the shared tenant, her own 2 question blocks are
stored in her tenant (the shared ones are not copied there); asked again, she loads the shared
run then her own. Bob's engine (uid B, a reader) loads the shared prompt behind his question
and behind alice's, and never finds alice's question blocks. Carol's engine (uid C, not a
reader) is refused the shared tenant by the daemon: a logged error and a miss, never a crash.
Every answer equals an engine's without the connector.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm builds .venv-vllm)", allow_module_level=True)

from conftest import DaemonProcess, config_toml

from .harness import (
    BLOCK,
    Engine,
    assert_same_answers,
    can_run_as_other_uids,
    engine_spec,
    make_random_model,
    open_dir,
    outputs,
    prompt,
    readable_by_all,
)

pytestmark = [
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        not can_run_as_other_uids(), reason="needs root and setpriv to run engines as tenants"
    ),
]

ALICE, BOB, CAROL, WRITER = 2101, 2102, 2103, 2104
SHARED = "system-prompts"
SYSTEM = prompt(4 * BLOCK, 71)  # the shared system prompt: 4 full blocks
Q_ALICE = prompt(4 * BLOCK + 2 * BLOCK + 10, 72, prefix=SYSTEM)  # + 2 blocks of her own
Q_BOB = prompt(4 * BLOCK + 2 * BLOCK + 10, 73, prefix=SYSTEM)
Q_OTHER = prompt(4 * BLOCK + 2 * BLOCK + 10, 74, prefix=SYSTEM)
# RANDOM_LLAMA in float32: 4 layers x 2 (K, V) x 32 tokens x 2 heads x 64 x 4 bytes.
BLOCK_BYTES = 4 * 2 * BLOCK * 2 * 64 * 4

POLICY = f"""
[[access]]
name = "alice"
uids = [{ALICE}]
tenants = ["alice"]

[[access]]
name = "bob"
uids = [{BOB}]
tenants = ["bob"]

[[access]]
name = "carol"
uids = [{CAROL}]
tenants = ["carol"]

[[access]]
name = "prompt-admin"
uids = [{WRITER}]
tenants = ["prompt-admin"]

[[access]]
name = "test-runner"
uids = [0]
tenants = ["root"]
role = "operator"

[shared.{SHARED}]
readers = ["alice", "bob"]
writers = ["prompt-admin"]
"""


@pytest.fixture(scope="module")
def open_work() -> Iterator[Path]:
    """A folder engines of other uids can read (the model) and reach (the daemon's socket)."""
    path = open_dir("kvshared-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def shared_model(open_work: Path) -> Path:
    return readable_by_all(make_random_model(open_work / "model"))


@pytest.fixture(scope="module")
def policy_daemon(open_work: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(
        open_work / "d", config_toml(cpu_capacity="256MiB", slab="4MiB", extra=POLICY)
    )
    d.directory.mkdir()
    d.start()
    yield d
    d.stop()


def tenant_spec(model: Path, daemon: DaemonProcess, uid: int, tenant: str, phases, **conn):
    connector = {
        "address": daemon.address,
        "tenant": tenant,
        "timeout_s": 30,
        "lookup_timeout_s": 30,
        **conn,
    }
    return {
        **engine_spec(model, connector, phases, max_model_len=512, prefix_caching=False),
        "uid": uid,
        "log_stats": True,
    }


def one_by_one(*prompts: list[int], max_tokens: int = 8) -> dict:
    return {"prompts": [{"ids": p} for p in prompts], "max_tokens": max_tokens, "one_by_one": True}


def tenant_bytes(daemon: DaemonProcess) -> dict[str, int]:
    """Each tenant's CPU bytes, as the daemon's operator sees them."""
    from kvstore.client.sync import KVStoreClient
    from kvstore.layout import KVLayout

    with KVStoreClient(
        daemon.address, layout=KVLayout(1, 1, 32, BLOCK), model="probe", tenant="root"
    ) as kv:
        return {t.name: t.cpu_bytes for t in kv.stats().tenants}


@pytest.fixture(scope="module")
def runs(shared_model: Path, open_work: Path, policy_daemon: DaemonProcess) -> dict:
    m, d, work = shared_model, policy_daemon, open_work
    shared = {"shared_tenants": [SHARED]}
    got: dict = {}
    got["writer"] = Engine(
        tenant_spec(m, d, WRITER, SHARED, [one_by_one(SYSTEM, max_tokens=1)], store="prompt"),
        work,
        "writer",
    ).result()
    got["after_writer"] = tenant_bytes(d)
    got["alice"] = Engine(
        tenant_spec(m, d, ALICE, "alice", [one_by_one(Q_ALICE), one_by_one(Q_ALICE)], **shared),
        work,
        "alice",
    ).result()
    # With vLLM's prefix cache on: the system prompt cached by the engine itself, alice's
    # question blocks beyond it loaded from her tenant, into the blocks that follow it.
    got["alice_apc"] = Engine(
        {
            **tenant_spec(
                m, d, ALICE, "alice", [one_by_one(Q_OTHER), one_by_one(Q_ALICE)], **shared
            ),
            "prefix_caching": True,
        },
        work,
        "alice-apc",
    ).result()
    got["bob"] = Engine(
        tenant_spec(m, d, BOB, "bob", [one_by_one(Q_BOB, Q_ALICE)], **shared), work, "bob"
    ).result()
    got["carol"] = Engine(
        tenant_spec(m, d, CAROL, "carol", [one_by_one(Q_ALICE)], **shared), work, "carol"
    ).result()
    got["carol_log"] = (work / "carol.log").read_text(errors="replace")
    got["usage"] = tenant_bytes(d)
    got["plain"] = Engine(
        engine_spec(m, None, [one_by_one(Q_ALICE, Q_BOB)], max_model_len=512), work, "plain"
    ).result()
    return got


def cached(result: dict, phase: int = 0) -> list[int]:
    return [o["num_cached_tokens"] for o in outputs(result, phase)]


def test_the_writer_stores_the_system_prompt_in_the_shared_tenant(runs) -> None:
    assert runs["after_writer"].get(SHARED) == 4 * BLOCK_BYTES, runs["after_writer"]


def test_readers_load_the_shared_prompt_and_keep_their_own_blocks_apart(runs) -> None:
    # Alice: the shared prompt's 4 blocks; asked again, the shared run then her own 2.
    assert cached(runs["alice"], 0) == [4 * BLOCK]
    assert cached(runs["alice"], 1) == [6 * BLOCK]
    # Bob: the shared prompt behind his question, and behind alice's, whose own blocks live
    # in her tenant only.
    assert cached(runs["bob"]) == [4 * BLOCK, 4 * BLOCK]
    counters = runs["bob"].get("counters", {})
    if "vllm:kvstore_shared_hit_tokens" in counters:
        assert counters["vllm:kvstore_shared_hit_tokens"] == 8 * BLOCK, counters


def test_a_load_past_vllms_own_prefix_cache_fills_the_blocks_after_it(runs) -> None:
    """Regression: vLLM sets a request's ``num_computed_tokens`` only after
    ``update_state_after_alloc``, so a load behind a local prefix-cache hit went into the
    request's first blocks (the cached prompt's) and left the blocks it was for unfilled."""
    assert cached(runs["alice_apc"], 0) == [4 * BLOCK]  # the shared prompt, loaded
    assert cached(runs["alice_apc"], 1) == [6 * BLOCK]  # 4 cached locally, 2 loaded
    plain = outputs(runs["plain"])
    assert_same_answers(outputs(runs["alice_apc"], 1), [plain[0]], "alice, prefix cache on")


def test_saves_go_to_the_requests_own_tenant_never_copying_the_shared_prompt(runs) -> None:
    usage = runs["usage"]
    assert usage.get(SHARED) == 4 * BLOCK_BYTES, usage  # untouched by the readers
    # Alice holds her 2 questions' 2 blocks each (the second engine's system prompt, cached
    # by vLLM itself, was not saved again); bob his question's and alice's (he computed
    # them, in his own tenant). Carol, refused the shared tenant, computed and stored all 6.
    assert usage.get("alice") == 4 * BLOCK_BYTES, usage
    assert usage.get("bob") == 4 * BLOCK_BYTES, usage
    assert usage.get("carol") == 6 * BLOCK_BYTES, usage


def test_a_tenant_the_policy_does_not_make_a_reader_gets_a_clear_error_and_a_miss(runs) -> None:
    assert cached(runs["carol"]) == [0]
    assert f"refused to open tenant '{SHARED}'" in runs["carol_log"], runs["carol_log"][-3000:]
    assert f"[shared.{SHARED}] readers" in runs["carol_log"]


def test_answers_from_shared_blocks_equal_an_engine_without_the_connector(runs) -> None:
    plain = outputs(runs["plain"])
    alice_first, alice_again = outputs(runs["alice"], 0), outputs(runs["alice"], 1)
    assert_same_answers(alice_first + alice_again, [plain[0], plain[0]], "alice")
    assert_same_answers(outputs(runs["bob"]), [plain[1], plain[0]], "bob")
    assert_same_answers(outputs(runs["carol"]), [plain[0]], "carol")
