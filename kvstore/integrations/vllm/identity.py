"""What names a block: the namespace both roles derive from vLLM's config alone (with the
checkpoint's weights fingerprint), and the kvstore key of a vLLM block hash (with the LoRA
adapter's fingerprint)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
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
    model, base_revision = model_identity(mc, cfg)
    return StoreIdentity(
        layout=layout,
        model=model,
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


def model_identity(mc: Any, cfg: ConnectorConfig) -> tuple[str, str]:
    """The namespace's model and revision (before the KV format is added to the latter).

    With the ``model`` option the operator declares which engines share blocks: the namespace
    is ``model`` and ``revision`` (default: vLLM's revision) and nothing else, as in earlier
    versions. Without it the namespace names the checkpoint vLLM loaded, never the served
    name (an alias two deployments of different weights may both use): its path or hub id,
    its revision, and a fingerprint of its weights (``weights_fingerprint``) with the
    quantization and ``hf_overrides`` they are run with, so the same path holding other
    weights (blue/green swaps, another host) is another namespace."""
    base_revision = cfg.revision if cfg.revision is not None else str(mc.revision or "")
    if cfg.model:
        return cfg.model, base_revision
    checkpoint = str(getattr(mc, "model_weights", "") or mc.model)
    local = _local_checkpoint(str(mc.model), mc.revision)
    weights = weights_fingerprint(local) if local is not None else None
    if weights is None:
        logger.warning(
            "KVStoreConnector: cannot read the checkpoint %s to fingerprint its weights; its "
            "blocks are named by path and revision only (set the 'model' option to declare "
            "which engines share blocks)",
            mc.model,
        )
        weights = "unread"
    overrides = getattr(mc, "hf_overrides", None)
    if callable(overrides):
        overrides = f"callable:{getattr(overrides, '__qualname__', type(overrides).__name__)}"
    run = json.dumps(
        [getattr(mc, "quantization", None), overrides], sort_keys=True, default=str
    ).encode()
    weights += ":" + hashlib.sha256(run).hexdigest()[:8]
    return checkpoint, f"{base_revision}|weights={weights}"


# What ``weights_fingerprint`` reads: the checkpoint's top-level JSON files (config.json,
# adapter_config.json, the shard index, ...) and its weight files.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npz", ".h5")
_SAMPLE = 4096
"""Bytes read at each offset sampled in a file whose tensors are not listed."""
_TENSOR_SAMPLE = 512
"""Bytes read at the start, middle and end of each safetensors tensor."""
_MAX_TENSORS = 4096
"""Tensors sampled per safetensors file at most (evenly spaced beyond that)."""
_WHOLE = 1 << 20
"""Files up to this size are hashed whole."""
_SPREAD = 64
"""Samples spread over a weight file whose tensors are not listed (not safetensors)."""
FINGERPRINT_DOMAIN = b"kvstore.vllm.weights.v1"


def _local_checkpoint(name: str, revision: Any = None) -> Path | None:
    """Where the checkpoint ``name`` (a path or a hub id) lies on this machine, or None."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    try:  # a hub id: the snapshot vLLM loaded, from the local cache only
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except Exception:
        logger.debug("no local snapshot of %s", name, exc_info=True)
        return None


def _checkpoint_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(
        f
        for f in path.iterdir()
        if (f.suffix == ".json" or f.name.endswith(_WEIGHT_SUFFIXES)) and f.is_file()
    )


def checkpoint_signature(path: Path) -> tuple[Any, ...]:
    """What changes when the checkpoint's files are rewritten (names, sizes, mtimes, inodes):
    when to compute a cached fingerprint again. Not a fingerprint: it differs between two
    copies of the same files."""
    rows = []
    for f in _checkpoint_files(path):
        st = f.stat()
        rows.append((f.name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev))
    return tuple(rows)


def weights_fingerprint(path: Path) -> str | None:
    """A fingerprint of the checkpoint (or adapter) at ``path``, a folder or a single file
    (GGUF), independent of where it lies and of its files' times, so copies on two hosts
    agree and two different checkpoints differ; None if it cannot be read.

    Cheap enough to compute at start-up for any model: JSON files and files up to 1 MiB are
    hashed whole; of a larger safetensors file, its header (every tensor's name, dtype, shape
    and offsets) and 512 bytes at the start, middle and end of every tensor (of 4096 tensors
    evenly spaced in a file that has more); of other weight files, the first 1 MiB and 64
    samples of 4 KiB spread over the file. Training changes practically every value of a
    tensor it touches, so two checkpoints that differ in any safetensors tensor differ here.
    What it cannot see: a change confined to bytes between the samples (a handful of weights
    edited inside a tensor, a tensor skipped in a file of more than 4096), or a
    non-safetensors file that differs only between its samples."""
    try:
        h = hashlib.sha256(FINGERPRINT_DOMAIN)
        for f in _checkpoint_files(path):
            _hash_file(h, f)
        return h.hexdigest()[:32]
    except (OSError, ValueError):
        logger.debug("cannot fingerprint %s", path, exc_info=True)
        return None


def _chunk(h: Any, data: bytes) -> None:
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def _hash_file(h: Any, f: Path) -> None:
    with open(f, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        _chunk(h, f.name.encode())
        h.update(size.to_bytes(8, "little"))
        if size <= _WHOLE or f.suffix == ".json":
            _chunk(h, fh.read())
            return
        offsets = _safetensors_samples(fh, size) if f.suffix == ".safetensors" else None
        if offsets is None:
            step = (size - _SAMPLE) // (_SPREAD - 1)
            offsets = [(0, _WHOLE)] + [(i * step, _SAMPLE) for i in range(_SPREAD)]
        for offset, length in offsets:
            fh.seek(offset)
            _chunk(h, fh.read(length))


def _safetensors_samples(fh: Any, size: int) -> list[tuple[int, int]] | None:
    """(offset, length) of a safetensors file's header and of 4 KiB at the start, middle and
    end of each tensor; None if the header does not parse."""
    head = fh.read(8)
    if len(head) != 8:
        return None
    n = int.from_bytes(head, "little")
    if n > min(size - 8, 256 << 20):
        return None
    try:
        header = json.loads(fh.read(n))
        spans = sorted(
            (int(v["data_offsets"][0]), int(v["data_offsets"][1]))
            for k, v in header.items()
            if k != "__metadata__"
        )
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    base = 8 + n
    samples = [(0, base)]
    stride = -(-len(spans) // _MAX_TENSORS)
    for start, end in spans[::stride]:
        length = min(_TENSOR_SAMPLE, end - start)
        for at in sorted({start, (start + end - length) // 2, end - length}):
            samples.append((base + at, length))
    return samples


ADAPTER_DOMAIN = b"kvstore.vllm.lora.v1"


class AdapterKeys:
    """The key material of each LoRA adapter (``adapter_material``), computed once per adapter
    and again when its files change (an adapter reloaded in place at the same path)."""

    MAX_ADAPTERS = 1024

    def __init__(self) -> None:
        self._known: OrderedDict[tuple[str, str], tuple[tuple[Any, ...], bytes]] = OrderedDict()

    def of(self, lora_request: Any) -> bytes | None:
        """b"" without an adapter (keys are those of earlier versions); the adapter's 32-byte
        identity; None if its files cannot be read here (the request then gets no store
        access: its blocks could not be told from another adapter's)."""
        if lora_request is None:
            return b""
        name, path = str(lora_request.lora_name), str(lora_request.lora_path)
        local = _local_checkpoint(path)
        if local is None:
            return None
        try:
            signature = checkpoint_signature(local)
        except OSError:
            return None
        known = self._known.get((name, path))
        if known is not None and known[0] == signature:
            self._known.move_to_end((name, path))
            return known[1]
        weights = weights_fingerprint(local)
        if weights is None:
            return None
        material = adapter_material(name, path, weights)
        self._known[(name, path)] = (signature, material)
        while len(self._known) > self.MAX_ADAPTERS:
            self._known.popitem(last=False)
        return material


def adapter_material(name: str, path: str, weights: str) -> bytes:
    """What a LoRA adapter adds to its requests' keys: its name, path as vLLM was given it,
    and weights fingerprint. vLLM's block hashes name the adapter (0.32: name and path; older
    versions: the name or a per-engine id) but never its contents."""
    h = hashlib.sha256(ADAPTER_DOMAIN)
    for part in (name, path, weights):
        _chunk(h, part.encode())
    return h.digest()


def store_key(block_hash: bytes | int, adapter: bytes = b"") -> bytes:
    """The kvstore key of one vLLM block hash (32 bytes whatever the hash algorithm); a LoRA
    request's keys also cover its adapter's identity (``AdapterKeys``). Without an adapter the
    keys are those of earlier versions."""
    raw = block_hash if isinstance(block_hash, bytes) else int(block_hash).to_bytes(16, "little")
    if not adapter:
        return hashlib.sha256(KEY_DOMAIN + raw).digest()
    return hashlib.sha256(KEY_DOMAIN + b"+lora" + adapter + raw).digest()
