"""The connector's counters: vLLM's stats logger and Prometheus."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

logger = logging.getLogger(__name__)


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
    "salts_refused",
    "adapters_unread",
    "shared_hit_tokens",
    "lookups_refused",
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

    def take(self) -> KVStoreConnectorStats | None:
        """The counters so far (None if all are zero), these starting again from zero: what
        the scheduler and each worker hand vLLM's stats logger."""
        if self.is_empty():
            return None
        taken = KVStoreConnectorStats(data=self.data)
        self.reset()
        return taken


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
    "salts_refused": "Requests given no store access: their cache_salt maps to no tenant",
    "adapters_unread": "LoRA requests given no store access: their adapter could not be read",
    "shared_hit_tokens": "Of hit_tokens, those found in a shared tenant (shared_tenants)",
    "lookups_refused": "Lookups not made: the daemon refused the tenant's namespace (policy)",
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
