"""What names a block: the namespace both roles derive from vLLM's config alone, and the
kvstore key of a vLLM block hash."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.integrations.vllm.options import ConnectorConfig
from kvstore.layout import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


KEY_DOMAIN = b"kvstore.vllm.v1"


@dataclass(frozen=True)
class StoreIdentity:
    """What both roles must agree on to name the same blocks: the client's constructor
    arguments. Built from the vLLM config alone, so the scheduler and every worker compute it
    without talking to each other."""

    layout: KVLayout
    model: str
    revision: str
    tenant: str
    tp_rank: int
    tp_size: int
    kv_format: str
    layer_names: tuple[str, ...]


def _kv_format(spec: Any, on_cpu: bool, cache_dtype: str) -> str:
    if not on_cpu:
        return "canonical"
    isa = "unknown"
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(spec.dtype, spec.block_size, spec.head_size, cache_dtype)
    except Exception:  # the backend's private helper moved: the format stays distinct
        logger.debug("could not determine the CPU attention ISA", exc_info=True)
    return f"vllm-cpu[nb,H,bs,2D]:{isa}"


def store_identity(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: ConnectorConfig
) -> StoreIdentity:
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise ValueError(
            f"KVStoreConnector supports models with one full-attention KV cache group; this "
            f"model has {kinds}"
        )
    spec = groups[0].kv_cache_spec
    hash_block = getattr(kv_cache_config, "hash_block_size", None)
    if hash_block not in (None, spec.block_size):
        # Keys are vLLM's block hashes, one per block: they must cover exactly one block.
        raise ValueError(
            f"KVStoreConnector needs hash_block_size == block_size, got {hash_block} and "
            f"{spec.block_size}"
        )
    if getattr(spec, "sliding_window", None):
        raise ValueError("KVStoreConnector does not support sliding-window attention")
    if spec.head_size_v not in (None, spec.head_size):
        raise ValueError("KVStoreConnector needs equal K and V head sizes")
    cache_dtype = vllm_config.cache_config.cache_dtype
    layout = KVLayout(
        num_layers=len(groups[0].layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        block_size=spec.block_size,
        dtype=spec.dtype,
    )
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    kv_format = _kv_format(spec, current_platform.is_cpu(), cache_dtype)
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    base_revision = cfg.revision if cfg.revision is not None else (mc.revision or "")
    return StoreIdentity(
        layout=layout,
        model=cfg.model or mc.served_model_name or mc.model,
        revision=f"{base_revision}|kv={kv_format}|cache={cache_dtype}|hash={algo}",
        tenant=cfg.tenant,
        tp_rank=_tp_rank(pc),
        tp_size=pc.tensor_parallel_size,
        kv_format=kv_format,
        layer_names=tuple(groups[0].layer_names),
    )


def _tp_rank(parallel_config: Any) -> int:
    if parallel_config.tensor_parallel_size == 1:
        return 0
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # the scheduler has no TP group: it looks up rank 0's namespace
        return 0


def store_key(block_hash: bytes | int) -> bytes:
    """The kvstore key of one vLLM block hash (32 bytes whatever the hash algorithm)."""
    raw = block_hash if isinstance(block_hash, bytes) else int(block_hash).to_bytes(16, "little")
    return hashlib.sha256(KEY_DOMAIN + raw).digest()
