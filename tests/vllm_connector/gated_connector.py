"""``KVStoreConnector`` whose worker holds each load until a file exists.

A test uses it to act (abort a request) while that request waits in vLLM's
WAITING_FOR_REMOTE_KVS with its load in flight. Only the timing changes: the connector, the
daemon and the engine are the real ones. The worker touches ``$KVSTORE_TEST_LOAD_STARTED`` when
a load begins and waits for ``$KVSTORE_TEST_LOAD_GATE`` (at most 300 s) before loading; the
scheduler writes, for each finished request, whether its load was still pending into
``$KVSTORE_TEST_FINISHED`` (so the test knows vLLM has processed an abort).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from kvstore.integrations.vllm import KVStoreConnector, LoadJob


class GatedKVStoreConnector(KVStoreConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        worker = self._worker
        if worker is None:
            return
        load = worker._load

        def gated(job: LoadJob) -> list[int]:
            Path(os.environ["KVSTORE_TEST_LOAD_STARTED"]).touch()
            gate = Path(os.environ["KVSTORE_TEST_LOAD_GATE"])
            deadline = time.monotonic() + 300
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            return load(job)

        worker._load = gated  # type: ignore[method-assign]

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        assert self._scheduler is not None
        state = self._scheduler.tracked.get(request.request_id)
        pending = state is not None and state.load is not None
        result = super().request_finished(request, block_ids)
        path = os.environ.get("KVSTORE_TEST_FINISHED")
        if path:
            with open(path, "a") as f:
                f.write(f"{request.request_id} load_pending={pending} delay={result[0]}\n")
        return result
