"""The worker side: runs the loads and saves of each step, inline or on a transfer thread,
and reports what finished and what failed."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kvstore.client.sync import KVStoreClient
from kvstore.integrations.vllm.copier import _LayerCopier
from kvstore.integrations.vllm.identity import StoreIdentity
from kvstore.integrations.vllm.layerwise import CHUNK_BLOCKS, LayeredLoad, LoadOutcome
from kvstore.integrations.vllm.metadata import KVStoreWorkerMetadata, LoadJob, SaveJob
from kvstore.integrations.vllm.options import ConnectorConfig
from kvstore.integrations.vllm.stats import KVStoreConnectorStats
from kvstore.integrations.vllm.store import _Stores

logger = logging.getLogger(__name__)


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
        self.stores = _Stores(ident, cfg, cfg.timeout_s)
        self.stats = KVStoreConnectorStats()
        self.meta = KVStoreWorkerMetadata()
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._queue: deque[tuple[str, LoadJob | SaveJob | LayeredLoad]] = deque()
        self._layered: LayeredLoad | None = None
        """This step's synchronous loads, copied layer by layer (``layerwise``)."""
        self._layer_index = {name: i for i, name in enumerate(ident.layer_names)}
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

    def save_step(self, jobs: list[SaveJob]) -> None:
        """Submit this step's saves, less every block from the first one whose synchronous load
        failed in this step: vLLM scheduled the save with the load, before it learns of the
        failure, and that block (and each computed after it) holds no valid KV until vLLM
        recomputes it; stored, it would poison the store under a valid key. The blocks
        dropped are counted in ``saves_dropped`` (a later miss, never a wrong answer)."""
        failed = self._errors  # this step's sync load failures (async ones come later)
        for job in jobs:
            cut = next((i for i, b in enumerate(job.block_ids) if b in failed), None)
            if cut is not None:
                dropped = job.keys[cut:]
                job = SaveJob(job.req_id, job.keys[:cut], job.block_ids[:cut], job.tenant)
                with self._cv:
                    self.stats.add("saves_dropped", len(dropped))
                    self.meta.settled.extend(dropped)
            self.submit("save", job)

    def submit(self, kind: str, job: LoadJob | SaveJob) -> None:
        with self._cv:
            if kind == "save":
                self._pending_saves[job.req_id] = self._pending_saves.get(job.req_id, 0) + 1
            if self.inline:
                self._busy = True
            else:
                self._ensure_thread()
                self._queue.append((kind, job))
                self._cv.notify_all()
                return
        self._execute(kind, job)

    @property
    def layerwise(self) -> bool:
        """Synchronous loads are copied layer by layer, each layer waited for by vLLM just
        before its attention: by default on the transfer thread (CUDA caches: host copies
        overlap the GPU's compute of earlier layers); CPU caches load whole before the forward
        pass unless ``layerwise`` is on (``docs/engines.md``, "Layer-wise loads", says what it
        was measured to cost)."""
        mode = self.cfg.layerwise
        if mode == "auto":
            return not self.inline
        return mode == "on"

    def start_layered(self, jobs: list[LoadJob]) -> None:
        """Start this step's synchronous loads layer by layer: on the transfer thread ahead of
        everything queued, or (inline) fetched now and copied as ``wait_layer`` reaches each
        layer."""
        self.finish_layered()  # a previous step's, if vLLM never asked for its end
        layered = LayeredLoad(jobs, self.ident.layout.num_layers)
        self._layered = layered
        if self.inline:
            try:
                layered.fetch(self.stores, self.copier)
            except Exception:
                logger.exception("kvstore load failed")
                layered.abandon()
            return
        with self._cv:
            self._ensure_thread()
            self._queue.appendleft(("layered", layered))
            self._cv.notify_all()

    def wait_layer(self, layer_name: str) -> None:
        """Return once ``layer_name``'s blocks of this step's synchronous loads are copied."""
        layered = self._layered
        index = self._layer_index.get(layer_name)
        if layered is None or index is None:
            return
        if self.inline:
            self._copy_layers(layered, index + 1)
            return
        with self._cv:
            while layered.layers_done <= index and not layered.finished:
                self._cv.wait()

    def finish_layered(self) -> None:
        """End this step's layered loads: every layer copied, every lease checked and
        released, the failed blocks recorded for ``take_errors``."""
        layered, self._layered = self._layered, None
        if layered is None:
            return
        if self.inline:
            self._copy_layers(layered, layered.num_layers)
            self._settle_layered(layered)
        with self._cv:
            while not layered.finished:
                self._cv.wait()
        for outcome in layered.outcomes:
            self._errors.update(outcome.failed_block_ids)

    def _copy_layers(self, layered: LayeredLoad, through: int) -> None:
        copier = self.copier
        try:
            while layered.layers_done < through and copier is not None and layered.fetched:
                layered.copy_layer(copier, layered.layers_done)
                with self._cv:
                    layered.layers_done += 1
                    self._cv.notify_all()
        except Exception:  # the blocks are reported failed: vLLM recomputes them
            logger.exception("kvstore layered load failed")
            layered.abandon()

    def _settle_layered(self, layered: LayeredLoad) -> None:
        """Check and release the leases, then count and report (on the thread that fetched)."""
        t0 = time.perf_counter()
        try:
            outcomes = layered.finish()
        except Exception:
            logger.exception("kvstore layered load failed")
            layered.abandon()
            outcomes = [LoadOutcome(job, 0, False) for job in layered.jobs]
        if len(outcomes) < len(layered.jobs):  # abandoned: nothing of those jobs loaded
            outcomes += [LoadOutcome(job, 0, False) for job in layered.jobs[len(outcomes) :]]
        with self._cv:
            for outcome in outcomes:
                self._count_load(outcome.loaded, len(outcome.failed_block_ids))
                self.meta.missing.extend(outcome.missing_keys)
                self.meta.settled.extend(outcome.job.keys)
            self._count_load(0, 0, time.perf_counter() - t0 + layered.seconds)
            layered.outcomes = outcomes
            layered.finished = True
            self._cv.notify_all()

    def _count_load(self, loaded: int, failed: int, seconds: float = 0.0) -> None:
        """Count a load's outcome (under ``_cv``): whole loads and layered ones alike."""
        self.stats.add("blocks_loaded", loaded)
        self.stats.add("load_errors", failed)
        if seconds:
            self.stats.add("load_seconds", seconds)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvstore-vllm", daemon=True)
            self._thread.start()

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
            return self.stats.take()

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
        self.stores.close()

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

    def _execute(self, kind: str, job: LoadJob | SaveJob | LayeredLoad) -> None:
        if isinstance(job, LayeredLoad):
            self._run_layered(job)
            return
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

    def _run_layered(self, layered: LayeredLoad) -> None:
        """On the transfer thread: fetch, copy each layer in order (vLLM's forward pass waits
        on each in ``wait_layer``), then check and release."""
        try:
            layered.fetch(self.stores, self.copier)
        except Exception:
            logger.exception("kvstore load failed")
            layered.abandon()
        self._copy_layers(layered, layered.num_layers)
        self._settle_layered(layered)
        with self._cv:
            self._busy = False
            self._cv.notify_all()

    def _load(self, job: LoadJob) -> list[int]:
        """Copy the job's blocks into vLLM's cache; returns the ids of the blocks not loaded
        (from the first one that failed on: a prefix must be whole)."""
        t0 = time.perf_counter()
        copier = self.copier
        loaded = 0
        answered = False  # the store answered (a miss it reports means the block is gone)
        # Each run from the tenant that holds it (the request's own, or a shared one).
        for tenant, _, stop in job.sources() if copier is not None else ():

            def load_from(client: KVStoreClient, stop: int = stop) -> bool:
                nonlocal loaded
                assert copier is not None
                for start in range(loaded, stop, CHUNK_BLOCKS):
                    keys = job.keys[start : min(start + CHUNK_BLOCKS, stop)]
                    ids = job.block_ids[start : min(start + CHUNK_BLOCKS, stop)]
                    n = self._load_chunk(client, copier, keys, ids)
                    loaded += n
                    if n < len(keys):
                        break
                return True

            answered = bool(self.stores.of(tenant).with_client("load", load_from))
            if loaded < stop:
                break
        failed = job.block_ids[loaded:]
        with self._cv:
            self._count_load(loaded, len(failed), time.perf_counter() - t0)
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
        if copier is not None:

            def save_to(client: KVStoreClient) -> None:
                nonlocal stored, done
                for start in range(done, len(job.keys), CHUNK_BLOCKS):
                    keys = job.keys[start : start + CHUNK_BLOCKS]
                    ids = job.block_ids[start : start + CHUNK_BLOCKS]
                    new = self._save_chunk(client, copier, keys, ids)
                    stored += len(new)
                    done = start + len(keys)
                    with self._cv:
                        self.meta.stored.extend(new)

            self.stores.of(job.tenant).with_client("save", save_to)
        with self._cv:
            self.stats.add("saves_dropped", len(job.keys) - done)
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
