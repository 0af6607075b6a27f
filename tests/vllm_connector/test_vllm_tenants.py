"""``cache_salt`` -> tenant (``salt_tenants``), against real engines and a real daemon with a
tenant policy.

Engine S maps salt "salt-a" to tenant alice and "salt-b" to tenant bob (bob has a CPU quota of
two blocks), refuses unmapped salts, and serves one prompt four times: salted a, salted b,
unsalted (the engine's tenant, "eng") and salted with an unmapped salt. The daemon's per-tenant
statistics then show each tenant's share. Engine L, fresh, maps both salts to alice and sends
unmapped salts to the engine's tenant: salt a loads from alice, salt b finds nothing in alice's
tenant although its blocks are stored (in bob's), and every answer equals engine S's.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm builds .venv-vllm)", allow_module_level=True)

from conftest import DaemonProcess

from .harness import BLOCK, Engine, assert_same_answers, engine_spec, outputs, prompt

pytestmark = pytest.mark.timeout(1800)

P = prompt(4 * BLOCK + 10, 61)  # 4 full blocks (the tail and 8 generated tokens stay partial)
FULL_BLOCKS = 4
# RANDOM_LLAMA in float32: 4 layers x 2 (K, V) x 32 tokens x 2 heads x 64 x 4 bytes.
BLOCK_BYTES = 4 * 2 * BLOCK * 2 * 64 * 4
PROMPTS = [
    {"ids": P, "salt": "salt-a"},
    {"ids": P, "salt": "salt-b"},
    {"ids": P},
    {"ids": P, "salt": "salt-x"},  # mapped to no tenant
]

# The engines run as this test's uid: the policy lets it open the three tenants, each with its
# own namespaces, slabs and quotas (bob's CPU quota holds two of the prompt's four blocks).
DAEMON_POLICY = f"""
[[access]]
name = "engines"
uids = [{os.getuid()}]
tenants = ["eng", "alice", "bob"]

[tenants.bob]
quota_cpu = "{2 * BLOCK_BYTES}"
"""


def spec(model: Path, connector: dict, phases: list[dict]) -> dict:
    return engine_spec(model, connector, phases, max_model_len=256, prefix_caching=False)


def conn(daemon: DaemonProcess, salts: dict, unmapped: str) -> dict:
    return {
        "address": daemon.address,
        "tenant": "eng",
        "salt_tenants": salts,
        "unmapped_salt": unmapped,
        "timeout_s": 30,
        "lookup_timeout_s": 30,
    }


def tenant_bytes(daemon: DaemonProcess) -> dict[str, int]:
    from kvstore.client.sync import KVStoreClient
    from kvstore.layout import KVLayout

    with KVStoreClient(
        daemon.address, layout=KVLayout(1, 1, 32, BLOCK), model="probe", tenant="eng"
    ) as kv:
        return {t.name: t.cpu_bytes for t in kv.stats().tenants}


@pytest.fixture(scope="module")
def stored(model: Path, work: Path, daemon: DaemonProcess) -> tuple[dict, dict[str, int]]:
    salts = {"salt-a": "alice", "salt-b": {"tenant": "bob"}}
    s = Engine(
        spec(model, conn(daemon, salts, "refuse"), [{"prompts": PROMPTS, "one_by_one": True}]),
        work,
        "S",
    ).result()
    # Saves are asynchronous but complete before the engine's process exits.
    return s, tenant_bytes(daemon)


@pytest.fixture(scope="module")
def loaded(model: Path, work: Path, daemon: DaemonProcess, stored) -> dict:
    salts = {"salt-a": "alice", "salt-b": "alice"}
    return Engine(
        spec(model, conn(daemon, salts, "default"), [{"prompts": PROMPTS, "one_by_one": True}]),
        work,
        "L",
    ).result()


def test_each_salt_stores_in_its_own_tenant_under_the_daemons_quotas(stored) -> None:
    _, usage = stored
    # alice and the engine's tenant each hold the prompt's 4 blocks; bob, past his quota,
    # at most 2; the refused salt stored nothing anywhere (eng holds only the unsalted copy).
    assert usage.get("alice") == FULL_BLOCKS * BLOCK_BYTES, usage
    assert usage.get("eng") == FULL_BLOCKS * BLOCK_BYTES, usage
    assert usage.get("bob", 0) <= 2 * BLOCK_BYTES, usage


def test_a_tenant_never_sees_another_tenants_blocks_and_answers_stay_identical(
    stored, loaded
) -> None:
    s, _ = stored
    got = outputs(loaded)
    cached = [o["num_cached_tokens"] for o in got]
    # salt a: alice's blocks; salt b routed to alice: bob's blocks are not there; unsalted: the
    # engine's tenant; the unmapped salt, now sent to the engine's tenant: its key (salted)
    # was never stored there.
    assert cached == [FULL_BLOCKS * BLOCK, 0, FULL_BLOCKS * BLOCK, 0]
    assert_same_answers(got, outputs(s), "engine L against engine S")


def test_a_refused_salt_is_computed_and_answers_as_the_others(stored) -> None:
    s, _ = stored
    rows = outputs(s)
    assert [r["num_cached_tokens"] for r in rows] == [0, 0, 0, 0]
    # One prompt, four salts: the same answer (the salt changes where blocks live, not tokens).
    assert_same_answers(rows[3:], rows[:1], "refused salt against salt a")
