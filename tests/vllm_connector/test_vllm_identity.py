"""Which engines share blocks: the namespace the connector derives from vLLM's real config
(``store_identity``, as the connector calls it) and the keys its real scheduler gives LoRA
requests. Blocks are shared only where the operator declared it: never between two checkpoints
served under one alias, nor between two adapters behind one LoRA name."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm builds .venv-vllm)", allow_module_level=True)

import torch

from kvstore.integrations.vllm import ConnectorConfig, _Scheduler, store_identity
from kvstore.keys import Namespace

from .harness import BLOCK, make_random_model, prompt
from .test_vllm_parts import ident


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two checkpoints of one architecture (same files, same sizes), different weights: last
    month's fine-tune and this month's."""
    root = Path(tmp_path_factory.mktemp("ckpt"))
    return make_random_model(root / "ft-06", seed=0), make_random_model(root / "ft-07", seed=1)


def namespace(model: Path, served: str | None, extra: dict[str, Any] | None = None) -> Namespace:
    """The namespace of an engine serving ``model`` as ``served`` (``--served-model-name``)
    with the connector options ``extra``: vLLM's own config objects, the connector's own
    identity code, the client's own namespace."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    mc = ModelConfig(
        model=str(model), served_model_name=served, dtype="float32", skip_tokenizer_init=True
    )
    vllm_config = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BLOCK))
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    kv_cache_config = KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )
    i = store_identity(vllm_config, kv_cache_config, ConnectorConfig.parse(extra))
    return Namespace(
        model=i.model,
        layout=i.layout,
        revision=i.revision,
        tenant=i.tenant,
        tp_rank=i.tp_rank,
        tp_size=i.tp_size,
    )


def test_checkpoints_behind_one_served_name_never_share_a_namespace(checkpoints) -> None:
    """Regression: the namespace was named by vLLM's served model name, which vLLM always
    fills (the alias, else the model): two deployments serving different checkpoints as
    "chat" (blue/green) loaded each other's KV."""
    old, new = checkpoints
    a, b = namespace(old, "chat"), namespace(new, "chat")
    assert a.fingerprint != b.fingerprint, f"both engines use namespace {a.name}"
    assert a.model == str(old) and b.model == str(new)  # the checkpoint, never the alias


def test_served_names_are_aliases_and_the_model_option_declares_sharing(checkpoints) -> None:
    """The served name is an alias: the same checkpoint served as "chat" and as "assistant"
    (or unaliased) computes the same KV, so it shares one namespace. ``model`` (and
    ``revision``) is the operator's declaration that engines share blocks: it names the
    namespace alone, whatever checkpoint each engine loads, as in earlier versions (blocks
    stored under a declared name stay valid)."""
    old, new = checkpoints
    fingerprints = {namespace(old, name).fingerprint for name in ("chat", "assistant", None)}
    assert len(fingerprints) == 1
    declared = {"model": "chat-ft", "revision": "2024-07"}
    a, b = namespace(old, "chat", declared), namespace(new, None, declared)
    assert a.fingerprint == b.fingerprint
    assert a.model == "chat-ft" and a.revision.startswith("2024-07|kv=vllm-cpu")
    # Declared apart, they are apart.
    other = namespace(new, None, {**declared, "revision": "2024-08"})
    assert other.fingerprint != a.fingerprint


def test_new_weights_at_the_same_path_are_a_new_namespace(checkpoints, tmp_path: Path) -> None:
    """Regression: a checkpoint replaced in place (same path, same files and sizes, no hub
    revision: blue/green into one folder, or another host's copy) kept the namespace of the
    weights it replaced. A copy of the same weights elsewhere has the same fingerprint."""
    old, new = checkpoints
    path = tmp_path / "chat"
    shutil.copytree(old, path)
    before = namespace(path, "chat")
    shutil.rmtree(path)
    shutil.copytree(new, path)
    after = namespace(path, "chat")
    assert before.fingerprint != after.fingerprint, f"both weights use {before.name}"
    assert before.revision == namespace(old, "chat").revision  # copies agree, mtimes aside


def test_weights_fingerprint_sees_one_changed_tensor(checkpoints, tmp_path: Path) -> None:
    """A checkpoint that differs from another in one tensor only (a layer retrained, a merged
    adapter) has another fingerprint: every safetensors tensor is sampled."""
    from safetensors.torch import load_file, save_file

    from kvstore.integrations.vllm.identity import weights_fingerprint

    old, _ = checkpoints
    (weights,) = old.glob("*.safetensors")
    for name in ("model.layers.2.mlp.down_proj.weight", "lm_head.weight", "model.norm.weight"):
        copy = tmp_path / name
        shutil.copytree(old, copy)
        tensors = load_file(weights)
        if name not in tensors:  # tied embeddings: no lm_head of its own
            continue
        tensors[name] = tensors[name] * 1.01
        save_file(tensors, copy / weights.name, metadata={"format": "pt"})
        assert (copy / weights.name).stat().st_size == weights.stat().st_size
        assert weights_fingerprint(copy) != weights_fingerprint(old), name
    assert weights_fingerprint(old) == weights_fingerprint(old)
    assert weights_fingerprint(tmp_path / "nowhere") is None


# ---------------------------------------------------------------------------------- LoRA
def make_adapter(directory: Path, seed: int) -> Path:
    """A PEFT-style LoRA adapter folder (config and weights); another seed, other weights of
    the same shapes."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    tensors = {
        f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight": torch.randn(
            (8, 256) if ab == "A" else (256, 8), generator=g
        )
        for i in range(4)
        for ab in "AB"
    }
    save_file(tensors, directory / "adapter_model.safetensors")
    return directory


def lora_request(req_id: str, ids: list[int], name: str | None, path: Path | None) -> Any:
    """A request as vLLM builds it: its block hashes by vLLM's own hasher, which covers
    the LoRA request as this vLLM version does."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    lora = LoRARequest(name, 1, str(path)) if name is not None else None
    return Request(
        req_id,
        ids,
        SamplingParams(max_tokens=1),
        None,
        lora_request=lora,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def scheduler(tmp_path: Path) -> _Scheduler:
    """The connector's scheduler side (its store unreachable: keys need none)."""
    cfg = ConnectorConfig.parse({"address": f"unix:{tmp_path / 'nobody.sock'}"})
    return _Scheduler(ident(), cfg, SimpleNamespace(cache_config=SimpleNamespace(block_size=32)))


IDS = prompt(3 * BLOCK + 4, 71)


def test_one_lora_name_and_path_with_other_weights_gets_other_keys(tmp_path: Path) -> None:
    """Regression: vLLM's block hashes name the adapter (name and path) but not its weights,
    and the connector added nothing: engine B with adapter "support" at /adapters/support
    loaded the KV engine A computed with another adapter at that path (another host, or the
    adapter replaced and reloaded in place)."""
    path = make_adapter(tmp_path / "support", seed=0)
    engine_a = scheduler(tmp_path)
    keys_a = engine_a.keys_of(lora_request("a", IDS, "support", path), 0, 3)
    shutil.rmtree(path)
    make_adapter(path, seed=1)
    engine_b = scheduler(tmp_path)
    keys_b = engine_b.keys_of(lora_request("b", IDS, "support", path), 0, 3)
    assert set(keys_a).isdisjoint(keys_b)
    # Engine A notices the new files too (its fingerprint is cached per adapter files).
    assert engine_a.keys_of(lora_request("a2", IDS, "support", path), 0, 3) == keys_b
    # Unchanged adapters keep their keys; requests without an adapter keep the keys of earlier
    # versions (vLLM's block hash, re-hashed once), so blocks stored before stay valid.
    assert engine_b.keys_of(lora_request("b2", IDS, "support", path), 0, 3) == keys_b
    plain = lora_request("p", IDS, None, None)
    assert engine_a.keys_of(plain, 0, 3) == [
        hashlib.sha256(b"kvstore.vllm.v1" + h).digest() for h in plain.block_hashes
    ]
    assert set(engine_a.keys_of(plain, 0, 3)).isdisjoint(keys_a + keys_b)


@pytest.mark.parametrize("vllm_hashes", ["name-and-path", "name-only"])
def test_one_lora_name_at_two_paths_gets_other_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vllm_hashes: str
) -> None:
    """Two adapters under one name at two paths never share keys, whatever vLLM's block
    hashes cover: this vLLM's cover the name and path, earlier versions' the name (or a
    per-engine id) only ("name-only" stands in for them; before the fix it shared keys)."""
    if vllm_hashes == "name-only":
        from vllm.v1.core import kv_cache_utils

        monkeypatch.setattr(
            kv_cache_utils,
            "_gen_lora_extra_hash_keys",
            lambda request: [request.lora_request.lora_name] if request.lora_request else [],
        )
    a = make_adapter(tmp_path / "a", seed=0)
    b = make_adapter(tmp_path / "b", seed=1)
    sched = scheduler(tmp_path)
    ra, rb = lora_request("a", IDS, "support", a), lora_request("b", IDS, "support", b)
    if vllm_hashes == "name-only":
        assert ra.block_hashes == rb.block_hashes  # vLLM alone cannot tell them apart
    assert set(sched.keys_of(ra, 0, 3)).isdisjoint(sched.keys_of(rb, 0, 3))


def test_a_lora_adapter_that_cannot_be_read_gets_no_store_access(tmp_path: Path) -> None:
    """An adapter whose files the scheduler cannot read (not on this machine, not in the hub
    cache) cannot be fingerprinted: its requests neither look up, load nor save, and are
    counted."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    sched = scheduler(tmp_path)
    req = lora_request("r", IDS, "gone", tmp_path / "no-such-adapter")
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = KVCacheBlocks(blocks=([KVCacheBlock(block_id=b) for b in range(4)],))
    sched.update_state_after_alloc(req, blocks, 0)
    sched.kv_cache_manager = SimpleNamespace(get_block_ids=lambda req_id: ([0, 1, 2, 3],))
    out = SimpleNamespace(preempted_req_ids=set(), num_scheduled_tokens={"r": len(IDS)})
    assert sched.build_connector_meta(out).saves == []
    stats = sched.take_stats()
    assert stats is not None and stats.data["adapters_unread"] == 1
    # Readable again (the worker fetched it): the next request uses the store.
    make_adapter(tmp_path / "no-such-adapter", seed=2)
    req2 = lora_request("r2", IDS, "gone", tmp_path / "no-such-adapter")
    sched.update_state_after_alloc(req2, blocks, 0)
    out = SimpleNamespace(preempted_req_ids=set(), num_scheduled_tokens={"r2": len(IDS)})
    (save,) = sched.build_connector_meta(out).saves
    assert save.keys == sched.keys_of(req2, 0, 3)
