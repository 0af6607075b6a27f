"""``KVStoreConnector``: vLLM's ``KVConnectorBase_V1`` calls, routed to the scheduler side
or the worker side (see the package docstring)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import KVCacheEvent
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

from kvstore.integrations.vllm.binding import _check_cpu_binding
from kvstore.integrations.vllm.identity import store_identity
from kvstore.integrations.vllm.metadata import KVStoreConnectorMetadata
from kvstore.integrations.vllm.options import ConnectorConfig
from kvstore.integrations.vllm.scheduler import _Scheduler
from kvstore.integrations.vllm.stats import KVStoreConnectorStats, KVStorePromMetrics
from kvstore.integrations.vllm.worker import _Worker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class KVStoreConnector(KVConnectorBase_V1):
    """See the package docstring (kvstore.integrations.vllm)."""

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
        if self.cfg.load != "sync":
            for job in meta.loads:
                worker.submit("load", job)
        elif meta.loads and worker.layerwise:
            worker.start_layered(meta.loads)
        else:
            for job in meta.loads:
                worker._errors.update(worker.run_sync(job))

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Async loads (the default) fill blocks of requests that are not in this forward
        # pass: no layer waits on them. Layer-wise sync loads: this layer's blocks only.
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

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
        worker.finish_layered()
        if meta.saves and worker.copier is not None and worker.copier.device.type == "cuda":
            # The transfer thread copies on its own stream: the step's writes into the blocks
            # it saves must be complete first.
            torch.cuda.current_stream(worker.copier.device).synchronize()
        worker.save_step(meta.saves)
        worker.hold(meta.held)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        sending, recving = self._worker.results()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        self._worker.finish_layered()  # wait_for_save may be deferred past this call
        return self._worker.take_errors()

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
            self._scheduler.close()

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
