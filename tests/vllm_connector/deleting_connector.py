"""``KVStoreConnector`` whose worker deletes one block of each load from the store just before
loading it, so that the load fails there for real (the daemon no longer holds the key).

A test uses it to check that a failed synchronous (layer-wise) load is recomputed: the
connector, the daemon and the engine are the real ones; only the block's disappearance is
arranged. Each job's third block is deleted, and the block ids the connector reports to vLLM
through ``get_block_ids_with_load_errors`` are appended to ``$KVSTORE_TEST_LOAD_ERRORS``.
"""

from __future__ import annotations

import os
from typing import Any

from kvstore.integrations.vllm import KVStoreConnector, KVStoreConnectorMetadata


class DeletingKVStoreConnector(KVStoreConnector):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._meta()
        worker = self._worker
        if isinstance(meta, KVStoreConnectorMetadata) and worker is not None:
            for job in meta.loads:
                client = worker.stores.of(job.tenant).client()
                if client is not None and len(job.keys) > 2:
                    client.delete(job.keys[2:3])
        super().start_load_kv(forward_context, **kwargs)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = super().get_block_ids_with_load_errors()
        if errors:
            with open(os.environ["KVSTORE_TEST_LOAD_ERRORS"], "a") as f:
                f.write(" ".join(map(str, sorted(errors))) + "\n")
        return errors
