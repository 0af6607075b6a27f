"""The smallest KV connector vLLM accepts: it never loads, never stores, holds nothing.

``benchmarks/bench_vllm_binding.py`` configures it to show what merely configuring a connector
costs a vLLM CPU engine, apart from any connector's work."""

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NoopConnector(KVConnectorBase_V1):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
    def wait_for_layer_load(self, layer_name: str) -> None: ...
    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any
    ) -> None: ...
    def wait_for_save(self) -> None: ...
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None: ...
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
