"""The store side of the reference worker: outage handling and the background offload thread.

Both exist so that the store can only ever make a request faster: an unreachable or failing
daemon costs one failed call per retry window and one log line per outage, and offloads copy
blocks into the store on their own thread while the scheduler goes on decoding.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from kvstore.client.sync import KVStoreClient
from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey

log = logging.getLogger("kvstore.worker")

StoreFailure = (KVStoreError, OSError)
"""What a store call may raise that must cost a recompute, never a request: daemon errors and
unreachable daemons (KVStoreError) and shared-memory mapping failures (OSError)."""


class StoreHealth:
    """Remembers an outage so a dead daemon costs one failed call per ``retry_s`` and one log
    line per outage, not one per request. Used by one thread only."""

    def __init__(self, what: str, retry_s: float) -> None:
        self.what = what
        self.retry_s = retry_s
        self.errors = 0
        self._down = False
        self._retry_at = 0.0

    def usable(self) -> bool:
        return not self._down or time.monotonic() >= self._retry_at

    def failed(self, exc: BaseException) -> None:
        self.errors += 1
        self._retry_at = time.monotonic() + self.retry_s
        if not self._down:
            self._down = True
            log.warning(
                "kvstore %s failed, recomputing instead (retry in %.0f s): %s: %s",
                self.what,
                self.retry_s,
                type(exc).__name__,
                exc,
            )

    def succeeded(self) -> None:
        if self._down:
            self._down = False
            log.info("kvstore %s works again", self.what)


class Offloader:
    """Owns a background thread and the KVStoreClient it alone uses; offloads pinned blocks.

    Threading contract: the scheduler thread calls ``put``, ``finished``, ``wait`` and ``close``;
    the background thread only reads ``kv_caches`` at blocks the scheduler pinned before
    ``put`` (committed, so immutable, and referenced, so never reallocated) and hands the ids
    back through ``finished`` for the scheduler to unpin. It never touches the allocator.
    """

    def __init__(
        self,
        make_client: Callable[[], KVStoreClient],
        kv_caches: list[torch.Tensor],
        retry_s: float,
    ) -> None:
        self._make_client = make_client
        self._kv_caches = kv_caches
        self._health = StoreHealth("offload", retry_s)
        # Connected here, on the scheduler thread, while the daemon that just served the
        # caller's client is surely up; the thread owns the client from then on. Only a failed
        # connect is retried from the thread, where waiting for a dead daemon (up to the
        # client's timeout) delays offloads but never decode.
        self._client: KVStoreClient | None = None
        try:
            self._client = make_client()
        except StoreFailure as exc:
            self._health.failed(exc)
        self._jobs: queue.Queue[tuple[list[int], list[BlockKey]] | None] = queue.Queue()
        self._done: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
        self.stored = 0  # written by the thread only; ints are read atomically
        self._thread = threading.Thread(target=self._run, name="kvstore-offload", daemon=True)
        self._thread.start()

    @property
    def errors(self) -> int:
        return self._health.errors

    def put(self, block_ids: list[int], keys: list[BlockKey]) -> None:
        self._jobs.put((block_ids, keys))

    def finished(self) -> list[list[int]]:
        """Block id lists whose offload ended (stored or not), ready to unpin."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def wait(self) -> None:
        self._jobs.join()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        client = self._client
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                break
            ids, keys = job
            try:
                if self._health.usable():
                    if client is None:
                        client = self._make_client()
                    self.stored += client.offload(self._kv_caches, ids, keys)
                    self._health.succeeded()
            except StoreFailure as exc:
                self._health.failed(exc)
            finally:
                self._done.put(ids)
                self._jobs.task_done()
        if client is not None:
            client.close()


def clone_client(client: KVStoreClient) -> Callable[[], KVStoreClient]:
    """A factory of clients of the same daemon and namespace (one per thread: not thread-safe)."""
    ns = client.namespace

    def make() -> KVStoreClient:
        return KVStoreClient(
            client.address,
            layout=client.layout,
            model=ns.model,
            revision=ns.revision,
            tenant=ns.tenant,
            tp_rank=ns.tp_rank,
            tp_size=ns.tp_size,
            transport=client.transport,
            timeout_s=client.timeout_s,
            verify_checksums=client.verify_checksums,
        )

    return make
