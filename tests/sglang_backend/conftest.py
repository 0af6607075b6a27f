"""SGLang's real HiCache objects on CPU, built as a new user would build them, for the backend's
tests: the device KV pools, the host pools (every MHA layout, MLA), and the cache controller
whose backup, prefetch-query, prefetch-IO and ack threads drive a storage backend that SGLang's
own factory makes from a ``--hicache-storage-backend-extra-config`` dict.

What it takes to run that code without a GPU (SGLang 0.5.23, torch 2.13 CPU):

- the PyPI torchvision wheel is a CUDA build whose C extension does not load under CPU torch,
  and its import then fails on ``operator torchvision::nms does not exist``; the op schemas
  are defined first (``torchvision_op_schemas``), HiCache never calls them;
- a published configuration: ``get_context().override_server_args(...)``, SGLang's own way to
  publish a dummy ``ServerArgs`` (``hicache_io_backend="direct"``, the layout, the backend);
- the parallel layout of a single rank without ``torch.distributed``:
  ``get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
  attn_dcp_size=1, attn_dcp_rank=0)``;
- host pools built by SGLang's ``build_kv_only_group`` / ``build_kv_host_pool`` with
  ``pin_memory=False`` (the default pins through CUDA and fails); everything else is theirs.

Fixtures (each documented where it is defined):

- ``make_pools(layout="page_first", *, mla=False, ...) -> Pools``
- ``make_controller(pools, backend_config, *, storage_backend="dynamic", kind="hybrid", ...)
  -> Controller``
- ``hicache_file_config`` -> the extra-config dict that loads SGLang's ``HiCacheFile`` through
  the dynamic factory, writing under the test's ``tmp_path``.
- ``daemon`` -> a real ``kvstore serve`` for the test module (64 MiB CPU tier, 1 MiB slabs).

Helpers: ``kvstore_config(address, **more)`` (the extra-config dict that loads kvstore's
backend) and ``storage_config(model, extra, ...)`` (SGLang's ``HiCacheStorageConfig`` of one
rank).

A ``Controller`` fills host pages with random bytes, backs them up through the controller's
backup thread (``write_storage``, waits for the ack), prefetches them through its prefetch
threads into OTHER host pages (query, allocation, transfer, waits for the final ack), reads
pages back, and snapshots the whole host pool to show nothing outside the target pages moved.

In .venv, where SGLang is not installed, nothing here imports it and the test modules skip;
in .venv-sglang a missing or broken SGLang is an error, never a skip.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
from conftest import DaemonProcess, config_toml

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
if not HAVE_SGLANG and Path(sys.prefix).name == ".venv-sglang":
    raise RuntimeError("sglang is not installed in .venv-sglang: run `make sglang-env`")

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
WAIT_S = 60.0  # the longest a helper waits for one of the controller's acks

_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"


def torchvision_op_schemas() -> None:
    """Define ``torchvision::nms`` and ``torchvision::qnms`` where torchvision's own C extension
    does not load (the PyPI wheel is a CUDA build), so that ``import torchvision``, which SGLang
    makes, succeeds. Idempotent; a no-op where the extension loads or torchvision is absent."""
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return
    try:
        torch._C._dispatch_find_schema_or_throw("torchvision::nms", "")
        return  # torchvision's extension, or an earlier call, defined it
    except RuntimeError:
        pass
    ext = next(Path(spec.origin).parent.glob("_C*.so"), None)
    if ext is not None:
        try:
            torch.ops.load_library(str(ext))
            return
        except OSError:
            pass
    for op in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{op}", _SCHEMA)
        except RuntimeError:
            pass  # defined already (by an earlier call or a test module)


if HAVE_SGLANG:
    torchvision_op_schemas()
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        HybridCacheController,
    )
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.runtime_context import get_context, get_memory, get_parallel


@pytest.fixture(scope="session")
def sglang_runtime() -> Iterator[None]:
    """SGLang's process-wide context for one CPU rank: a published dummy configuration
    (``hicache_io_backend="direct"``, the dynamic storage backend) and the parallel layout of
    rank 0 of 1, set without ``torch.distributed``. Undone at the end of the session."""
    override = get_context().override_server_args(
        device="cpu",
        enable_hierarchical_cache=True,
        hicache_io_backend="direct",
        hicache_write_policy="write_through",
        hicache_ratio=2.0,
        hicache_size=0,
        hicache_storage_backend="dynamic",
    )
    override.install()
    get_parallel().override_permanently(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
    )
    yield
    get_parallel().clear_stamp()
    override.restore()


@dataclass
class Pools:
    """One SGLang KV stack on CPU.

    ``device``: the ``MHATokenToKVPool`` / ``MLATokenToKVPool``; ``allocator``: the
    ``PagedTokenToKVPoolAllocator`` over it (what the controller is given); ``group``: the
    ``HostPoolGroup`` from ``build_kv_only_group`` (what ``HybridCacheController`` takes);
    ``host``: its anchor host pool (``MHATokenToKVPoolHost`` or ``MLATokenToKVPoolHost``,
    unpinned), the pool a storage backend is registered with."""

    device: Any
    allocator: Any
    group: Any
    host: Any
    layout: str
    mla: bool
    page_size: int
    layer_num: int

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of the host pool (all layers, K and V)."""
        return int(self.host.get_size_per_token()) * self.page_size


def _unpinned(cls: Any) -> Any:
    def build(*args: Any, **kwargs: Any) -> Any:
        return cls(*args, pin_memory=False, **kwargs)

    return build


@pytest.fixture
def make_pools(sglang_runtime: None) -> Callable[..., Pools]:
    """``make_pools(layout="page_first", *, mla=False, page_size=4, layer_num=3, head_num=2,
    head_dim=8, kv_lora_rank=32, qk_rope_head_dim=8, dtype=torch.bfloat16, device_tokens=64,
    host_ratio=2.0) -> Pools``.

    The device pool is SGLang's ``MHATokenToKVPool`` (or, with ``mla=True``,
    ``MLATokenToKVPool``) on ``device="cpu"``; the host pool is built by SGLang's own
    ``build_kv_only_group`` -> ``build_kv_host_pool`` under the published ``layout``
    (``hicache_mem_layout``), the only change being ``pin_memory=False``. MHA takes every
    layout of ``MHA_LAYOUTS``, MLA those of ``MLA_LAYOUTS``. The host pool holds
    ``device_tokens * host_ratio`` tokens (plus SGLang's padding page)."""

    def make(
        layout: str = "page_first",
        *,
        mla: bool = False,
        page_size: int = 4,
        layer_num: int = 3,
        head_num: int = 2,
        head_dim: int = 8,
        kv_lora_rank: int = 32,
        qk_rope_head_dim: int = 8,
        dtype: Any = None,
        device_tokens: int = 64,
        host_ratio: float = 2.0,
    ) -> Pools:
        dtype = dtype or torch.bfloat16
        if mla:
            device = MLATokenToKVPool(
                size=device_tokens,
                page_size=page_size,
                dtype=dtype,
                kv_lora_rank=kv_lora_rank,
                qk_rope_head_dim=qk_rope_head_dim,
                layer_num=layer_num,
                device="cpu",
                enable_memory_saver=False,
            )
        else:
            device = MHATokenToKVPool(
                size=device_tokens,
                page_size=page_size,
                dtype=dtype,
                head_num=head_num,
                head_dim=head_dim,
                layer_num=layer_num,
                device="cpu",
                enable_memory_saver=False,
            )
        allocator = PagedTokenToKVPoolAllocator(
            device_tokens, page_size, dtype, "cpu", device, need_sort=False
        )
        # build_kv_host_pool constructs the host pool class with SGLang's defaults, which pin
        # the buffer through CUDA; only that argument is changed, for the length of the call.
        asm = hybrid_pool_assembler
        mha_cls, mla_cls = asm.get_mha_host_pool_cls, asm.MLATokenToKVPoolHost
        asm.get_mha_host_pool_cls = lambda info: _unpinned(mha_cls(info))
        asm.MLATokenToKVPoolHost = _unpinned(mla_cls)
        try:
            with get_memory().override(hicache_mem_layout=layout, hicache_ratio=host_ratio):
                group = asm.build_kv_only_group(
                    page_size=page_size,
                    kv_pool=device,
                    full_layer_mapping={i: i for i in range(layer_num)},
                    use_mla=mla,
                )
        finally:
            asm.get_mha_host_pool_cls, asm.MLATokenToKVPoolHost = mha_cls, mla_cls
        host = group.anchor_entry.host_pool
        assert host.layout == layout and host.pin_memory is False, (host.layout, layout)
        return Pools(device, allocator, group, host, layout, mla, page_size, layer_num)

    return make


@dataclass
class HybridPools(Pools):
    """``Pools`` of a hybrid model: SGLang's ``HostPoolGroup`` holds the KV anchor and side
    pools (``side``: pool name -> host pool), each registered with a storage backend through
    ``register_mem_host_pool_v2`` as SGLang's controller does at attach."""

    side: dict[str, Any] = field(default_factory=dict)


def mamba_host_pool(
    *,
    layout: str = "page_first",
    slots: int = 8,
    layers: int = 2,
    slot_states: bool = False,
    temporal: tuple[int, ...] = (2, 4, 4),
    temporal_dtype: Any = None,
    conv: tuple[tuple[int, ...], ...] = ((6, 3), (2, 3)),
    conv_dtype: Any = None,
) -> Any:
    """SGLang's ``MambaPoolHost`` (a state slot a page: the temporal state, the conv states and,
    with ``slot_states``, an int32 side state of each slot) built by its own constructor over
    CPU device buffers (``MambaStateBufferInfo``), unpinned, twice the device slots."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    temporal_dtype = temporal_dtype or torch.float32
    conv_dtype = conv_dtype or torch.bfloat16
    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, *temporal, dtype=temporal_dtype),
        conv=tuple(torch.zeros(layers, slots, *shape, dtype=conv_dtype) for shape in conv),
        extra_checkpoint_buffers=(torch.zeros(slots, 5, dtype=torch.int32),) if slot_states else (),
    )
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, layout=layout)


@pytest.fixture
def make_hybrid_pools(sglang_runtime: None) -> Callable[..., HybridPools]:
    """``make_hybrid_pools(layout="page_first", *, page_size=4, kv_layers=2, swa_layers=1,
    mamba_layout="page_first", slot_states=False) -> HybridPools``.

    SGLang's hybrid-SWA stack on CPU: full-attention and sliding-window ``MHATokenToKVPool``
    device pools, host pools built by SGLang's ``build_hybrid_swa_group`` (KV anchor and
    ``"swa"``, unpinned), and a ``"mamba"`` ``MambaPoolHost`` entry (``mamba_host_pool``)
    added to the group with SGLang's ``build_pool_entry``. ``swa_layers=kv_layers`` makes the
    SWA pool's page format the KV pool's."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    def make(
        layout: str = "page_first",
        *,
        page_size: int = 4,
        kv_layers: int = 2,
        swa_layers: int = 1,
        mamba_layout: str = "page_first",
        slot_states: bool = False,
    ) -> HybridPools:
        def device(layers: int) -> Any:
            return MHATokenToKVPool(
                size=64,
                page_size=page_size,
                dtype=torch.bfloat16,
                head_num=2,
                head_dim=8,
                layer_num=layers,
                device="cpu",
                enable_memory_saver=False,
            )

        full, swa = device(kv_layers), device(swa_layers)
        allocator = PagedTokenToKVPoolAllocator(
            64, page_size, torch.bfloat16, "cpu", full, need_sort=False
        )
        asm = hybrid_pool_assembler
        mha_cls = asm.get_mha_host_pool_cls
        asm.get_mha_host_pool_cls = lambda info: _unpinned(mha_cls(info))
        n = kv_layers + swa_layers
        try:
            with get_memory().override(hicache_mem_layout=layout, hicache_ratio=2.0):
                group = asm.build_hybrid_swa_group(
                    page_size=page_size,
                    full_kv_pool=full,
                    swa_kv_pool=swa,
                    full_layer_mapping={i: i for i in range(kv_layers)},
                    swa_layer_mapping={kv_layers + i: i for i in range(swa_layers)},
                    use_mla=False,
                    transfer_layer_id_max=n + 1,
                )
        finally:
            asm.get_mha_host_pool_cls = mha_cls
        mamba = mamba_host_pool(layout=mamba_layout, slot_states=slot_states)
        group.add_entry(
            asm.build_pool_entry(
                name=PoolName.MAMBA,
                host_pool=mamba,
                device_pool=None,
                layer_mapping={n: 0},
                transfer_layer_id_max=n + 1,
            )
        )
        host = group.anchor_entry.host_pool
        side = {"swa": group.entry_map[PoolName.SWA].host_pool, "mamba": mamba}
        return HybridPools(full, allocator, group, host, layout, False, page_size, n + 1, side)

    return make


@dataclass
class Prefetched:
    """What one prefetch did: ``hit_tokens`` the controller's query found in storage (leading
    run), ``host_indices`` the host token slots it loaded into (empty on a miss),
    ``completed_tokens`` the tokens the transfer reported done, ``hashes`` the page keys
    queried (SGLang's SHA-256 chain); with side pools (``extra_pools``), ``pool_hits`` the
    pages of each pool its ack reports loaded, ``query_pool_hits`` each pool's boundary the
    query found."""

    hit_tokens: int
    host_indices: Any
    completed_tokens: int
    hashes: list[str]
    pool_hits: dict[str, int] = field(default_factory=dict)
    query_pool_hits: dict[str, int] = field(default_factory=dict)


@dataclass
class Controller:
    """A running SGLang cache controller (``ctl``) over ``pools``, with its storage backend
    (``backend``, made by SGLang's factory), and the steps a test takes through it. Every wait
    is bounded by ``WAIT_S`` and fails the test with a message instead of hanging."""

    ctl: Any
    pools: Pools
    kind: str
    _backup_acks: dict[int, Any] = field(default_factory=dict)
    _rids: Iterator[int] = field(default_factory=itertools.count)
    _closed: bool = False

    @property
    def backend(self) -> Any:
        return self.ctl.storage_backend

    @property
    def host(self) -> Any:
        return self.pools.host

    @property
    def page_size(self) -> int:
        return self.pools.page_size

    # -- host pages -------------------------------------------------------------------------

    def alloc(self, pages: int) -> Any:
        """``pages`` pages of the host pool (token indices, page-aligned, a multiple of
        ``page_size`` long), from SGLang's host allocator."""
        indices = self.host.alloc(pages * self.page_size)
        assert indices is not None, f"host pool has no room for {pages} pages"
        return indices

    def page_starts(self, host_indices: Any) -> list[int]:
        """The first token index of each page of ``host_indices``."""
        return [int(i) for i in host_indices[:: self.page_size]]

    def fill_random(self, host_indices: Any, seed: int) -> list[bytes]:
        """Writes random bytes (every bit pattern, NaNs included) into each page of
        ``host_indices`` through the pool's ``set_from_flat_data_page``; returns each page's
        bytes as written."""
        gen = torch.Generator().manual_seed(seed)
        written = []
        for start in self.page_starts(host_indices):
            like = self.host.get_data_page(start, flat=True)
            raw = torch.randint(
                0, 256, (like.numel() * like.element_size(),), dtype=torch.uint8, generator=gen
            )
            self.host.set_from_flat_data_page(start, raw.view(like.dtype).reshape(like.shape))
            written.append(raw.numpy().tobytes())
        return written

    def read_pages(self, host_indices: Any) -> list[bytes]:
        """The bytes of each page of ``host_indices``, read through ``get_data_page``."""
        return [
            self.host.get_data_page(start, flat=True)
            .contiguous()
            .view(torch.uint8)
            .numpy()
            .tobytes()
            for start in self.page_starts(host_indices)
        ]

    def _buffers(self) -> list[Any]:
        buffers = self.host.kv_buffer
        return list(buffers) if isinstance(buffers, (list, tuple)) else [buffers]

    def snapshot(self) -> list[Any]:
        """A copy of every buffer of the host pool, to compare with ``changed_outside``."""
        return [b.clone() for b in self._buffers()]

    def changed_outside(self, before: list[Any], host_indices: Any) -> bool:
        """Whether any byte of the host pool outside the pages of ``host_indices`` differs from
        ``before`` (a ``snapshot``): the pages' present bytes are written over ``before``, and
        the result must equal the present pool. The pool is left as it is."""
        present = self.snapshot()
        pages = {
            s: self.host.get_data_page(s, flat=True).clone() for s in self.page_starts(host_indices)
        }
        buffers = self._buffers()
        try:
            for b, old in zip(buffers, before, strict=True):
                b.copy_(old)
            for s, page in pages.items():
                self.host.set_from_flat_data_page(s, page)
            return any(
                not torch.equal(b.view(torch.uint8), p.view(torch.uint8))
                for b, p in zip(buffers, present, strict=True)
            )
        finally:
            for b, p in zip(buffers, present, strict=True):
                b.copy_(p)

    # -- keys -------------------------------------------------------------------------------

    def hashes(self, tokens: list[int], last_hash: str | None = None) -> list[str]:
        """SGLang's storage keys of the full pages of ``tokens`` (``get_storage_hash_str``, the
        chain the controller's prefetch query computes), continuing ``last_hash``."""
        return list(get_storage_hash_str(tokens, last_hash, page_size=self.page_size))

    # -- storage ----------------------------------------------------------------------------

    def backup(
        self,
        host_indices: Any,
        tokens: list[int],
        hashes: list[str] | None = None,
        prefix_keys: list[str] | None = None,
        extra_pools: list[Any] | None = None,
    ) -> int:
        """Backs the pages of ``host_indices`` up to storage through the controller's backup
        thread (``write_storage``) under ``hashes`` (default: ``self.hashes(tokens)``), with
        the side pools' ``PoolTransfer`` list ``extra_pools`` (hybrid controller only), waits
        for its ack and returns the tokens it reports written (``completed_tokens``)."""
        hashes = self.hashes(tokens) if hashes is None else hashes
        more = {} if extra_pools is None else {"extra_pools": extra_pools}
        op_id = self.ctl.write_storage(
            host_indices, tokens, hash_value=hashes, prefix_keys=prefix_keys, **more
        )
        deadline = time.monotonic() + WAIT_S
        while op_id not in self._backup_acks:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no backup ack for operation {op_id} in {WAIT_S} s")
            try:
                op = self.ctl.ack_backup_queue.get(timeout=min(left, 1.0))
            except Empty:
                continue
            self._backup_acks[op.id] = op
        return int(self._backup_acks.pop(op_id).completed_tokens)

    def prefetch(
        self,
        tokens: list[int],
        last_hash: str | None = None,
        prefix_keys: list[str] | None = None,
        into: Any = None,
        extra_pools: list[Any] | None = None,
        side_indices: Callable[[Any], None] | None = None,
    ) -> Prefetched:
        """Prefetches ``tokens`` from storage as the scheduler does: the controller's query
        thread runs ``batch_exists`` (``batch_exists_v2`` with side pools: ``extra_pools``, a
        ``PoolTransfer`` list, hybrid controller only) on the page keys; on a hit, host pages
        are allocated from the host pool (or ``into``, token indices of as many pages as hit),
        ``side_indices(operation)`` gives the side pools' transfers their host indices, the
        operation goes to the IO thread, and this waits for the final ack (``completed_req``)
        of that request."""
        rid = f"req-{next(self._rids)}"
        if self.kind == "hybrid":
            op = self.ctl.prefetch(
                CacheRequestHandle(rid=rid, attempt_id=0),
                tokens,
                last_hash,
                prefix_keys,
                extra_pools=extra_pools,
            )
        else:
            op = self.ctl.prefetch(rid, tokens, last_hash, prefix_keys)
        hit = self._get(self.ctl.prefetch_hit_queue, lambda o: o is op, "prefetch query")
        hashes = list(op.all_hash_values or [])
        hit_tokens = int(hit.storage_hit_count)
        query_hits = {
            str(k): int(v) for k, v in (getattr(op, "query_pool_hit_pages", None) or {}).items()
        }
        if hit_tokens == 0:
            return Prefetched(0, torch.empty(0, dtype=torch.int64), 0, hashes, {}, query_hits)
        if into is None:
            if self.kind == "hybrid":
                into, _ = self.ctl.allocate_storage_hit(
                    op,
                    hit_tokens,
                    allow_partial=False,
                    min_tokens=self.page_size,
                    evict_host=lambda n: 0,
                )
            else:
                into = self.ctl.alloc_prefetch_host_buffers(op, hit_tokens)
            assert into is not None, f"host pool has no room for {hit_tokens} tokens"
        assert into.numel() == hit_tokens, (into.numel(), hit_tokens)
        op.host_indices = into
        if side_indices is not None:
            side_indices(op)
        self.ctl.prefetch_buffer.put(op)
        completed = 0
        pool_hits: dict[str, int] = {}
        while True:
            ack = self._get(self.ctl.ack_prefetch_queue, lambda a: a.rid == rid, "prefetch ack")
            if ack.completed_tokens is not None:
                completed = int(ack.completed_tokens)
            if getattr(ack, "pool_hits", None):
                pool_hits = {str(k): int(v) for k, v in ack.pool_hits.items() if v}
            if ack.completed_req:
                break
        return Prefetched(hit_tokens, into, completed, hashes, pool_hits, query_hits)

    def _get(self, queue: Any, match: Callable[[Any], bool], what: str) -> Any:
        deadline = time.monotonic() + WAIT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {what} from the controller in {WAIT_S} s")
            try:
                item = queue.get(timeout=min(left, 1.0))
            except Empty:
                continue
            if match(item):
                return item

    def close(self) -> None:
        """Stops the controller's storage threads (``detach_storage_backend``, which also closes
        the backend). Idempotent; the fixture calls it at teardown."""
        if not self._closed:
            self._closed = True
            self.ctl.detach_storage_backend()


def _storage_threads(ctl: Any) -> list[threading.Thread]:
    names = ("prefetch_thread", "prefetch_io_aux_thread", "prefetch_sync_thread", "backup_thread")
    return [t for t in (getattr(ctl, n, None) for n in names) if t is not None]


@pytest.fixture
def make_controller(sglang_runtime: None) -> Iterator[Callable[..., Controller]]:
    """``make_controller(pools, backend_config, *, storage_backend="dynamic", kind="hybrid",
    model_name="test-model", write_policy="write_through") -> Controller``.

    Builds SGLang's cache controller over ``pools`` (from ``make_pools``) with
    ``io_backend="direct"``: ``kind="hybrid"`` is ``HybridCacheController`` over the
    ``HostPoolGroup`` (what 0.5.23 servers build, as ``build_kv_only_stack`` does),
    ``kind="legacy"`` is ``HiCacheController`` over the bare host pool. Its storage backend is
    made by SGLang's ``StorageBackendFactory`` at attach: with ``storage_backend="dynamic"``,
    ``backend_config`` is the ``--hicache-storage-backend-extra-config`` dict
    (``{"backend_name", "module_path", "class_name", "interface_v1", ...}``, passed as a copy;
    ``interface_v1`` truthy selects the zero-copy ``batch_get_v1``/``batch_set_v1`` calls);
    with a built-in name (``"file"``) it is that backend's extra config. The backend is
    constructed (``cls(storage_config, kwargs)`` for dynamic ones), then
    ``register_mem_pool_host(host pool)``. The controller's four storage threads run until
    teardown, which stops them and checks they are gone."""
    made: list[Controller] = []

    def make(
        pools: Pools,
        backend_config: dict[str, Any],
        *,
        storage_backend: str = "dynamic",
        kind: str = "hybrid",
        model_name: str = "test-model",
        write_policy: str = "write_through",
    ) -> Controller:
        config = json.loads(json.dumps(backend_config))
        common = dict(
            load_cache_event=threading.Event(),
            write_policy=write_policy,
            io_backend="direct",
            storage_backend=storage_backend,
            model_name=model_name,
            storage_backend_extra_config=config,
        )
        if kind == "hybrid":
            ctl = HybridCacheController(
                pools.allocator,
                pools.group,
                pools.page_size,
                None,
                transfer_layer_id_max=pools.layer_num,
                **common,
            )
        elif kind == "legacy":
            ctl = HiCacheController(pools.allocator, pools.host, pools.page_size, None, **common)
        else:
            raise ValueError(f"unknown controller kind {kind!r}")
        c = Controller(ctl, pools, kind)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
        alive = [t.name for t in _storage_threads(c.ctl) if t.is_alive()]
        assert not alive, f"storage threads still running after detach: {alive}"


@pytest.fixture
def hicache_file_config(tmp_path: Path) -> dict[str, Any]:
    """The extra config that makes SGLang's factory load its own ``HiCacheFile`` backend by
    module and class name (the dynamic path kvstore's backend takes), keeping its files under
    the test's ``tmp_path``. ``HiCacheFile`` has no zero-copy v1 calls: ``interface_v1`` is 0,
    so the controller moves flat pages (``batch_get``/``batch_set``)."""
    return {
        "backend_name": "hicache-file",
        "module_path": "sglang.srt.mem_cache.hicache_storage",
        "class_name": "HiCacheFile",
        "interface_v1": 0,
        "file_storage_path": str(tmp_path / "hicache"),
    }


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A real daemon for the test module: a 64 MiB CPU tier of 1 MiB slabs."""
    d = DaemonProcess(
        Path(tmp_path_factory.mktemp("kvd")), config_toml(cpu_capacity="64MiB", slab="1MiB")
    ).start()
    yield d
    d.stop()


def kvstore_config(address: str, **more: Any) -> dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` dict that makes SGLang's factory load
    kvstore's backend (zero-copy v1 calls), talking to the daemon at ``address``."""
    return {
        "backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang",
        "class_name": "KVStoreHiCacheStorage",
        "interface_v1": 1,
        "address": address,
        **more,
    }


def storage_config(
    model: str,
    extra: dict[str, Any],
    *,
    mla: bool = False,
    tp: tuple[int, int] = (0, 1),
    page_first: bool = True,
    metrics: bool = False,
) -> Any:
    """SGLang's ``HiCacheStorageConfig`` for one rank ``tp`` (rank, size), one pipeline stage
    and no context parallelism, with backend extra config ``extra``."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp[0],
        tp_size=tp[1],
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=page_first,
        model_name=model,
        extra_config=extra,
    )
