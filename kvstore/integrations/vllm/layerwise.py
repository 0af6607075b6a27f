"""Synchronous loads copied into vLLM's cache one layer at a time.

vLLM calls ``wait_for_layer_load(layer)`` before each attention layer of the forward pass. A
``LayeredLoad`` holds the step's synchronous loads fetched from the store (shared-memory leases,
or blocks received over gRPC) and copies them layer by layer, so layer ``i`` waits only for
its own blocks: on the transfer thread (CUDA caches: the host copies layer ``i + 1`` while the
GPU computes layer ``i``), or lazily on the engine's thread as each layer is reached (CPU
caches with ``layerwise: "on"``). Whether a block arrived intact is known only once its every
layer is copied and its lease checked: blocks that did not are reported through
``get_block_ids_with_load_errors`` after the step, and vLLM recomputes from them, as for any
other failed load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.client.sync import KVStoreClient
from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.copier import _LayerCopier
from kvstore.integrations.vllm.metadata import LoadJob
from kvstore.integrations.vllm.store import _Stores

logger = logging.getLogger(__name__)

CHUNK_BLOCKS = 32


@dataclass
class _Piece:
    """Up to ``CHUNK_BLOCKS`` fetched blocks of one job: ``views[i]`` holds block ``ids[i]``."""

    views: Sequence[torch.Tensor]
    ids: list[int]
    lease: Any = None
    """The shared-memory lease the views read from: checked (``intact``) and released once
    every layer is copied."""


@dataclass
class _Fetched:
    job: LoadJob
    pieces: list[_Piece] = field(default_factory=list)
    answered: bool = False
    """The store answered: a block it did not return is gone (a ``BlockRemoved`` event)."""


@dataclass
class LoadOutcome:
    job: LoadJob
    loaded: int
    """Blocks from the job's first that arrived whole (every layer, intact)."""
    answered: bool

    @property
    def failed_block_ids(self) -> list[int]:
        return self.job.block_ids[self.loaded :]

    @property
    def missing_keys(self) -> list[bytes]:
        return self.job.keys[self.loaded :] if self.answered else []


class LayeredLoad:
    """The synchronous loads of one step. ``fetch``, then ``copy_layer`` for each layer in
    order, then ``finish``, all on one thread (the store's clients are not thread-safe); other
    threads only read ``layers_done`` under the worker's lock."""

    def __init__(self, jobs: list[LoadJob], num_layers: int) -> None:
        self.jobs = jobs
        self.num_layers = num_layers
        self.fetched: list[_Fetched] = []
        self.layers_done = 0
        self.finished = False
        self.outcomes: list[LoadOutcome] = []
        self.seconds = 0.0
        """Spent fetching and copying (the statistics' ``load_seconds``)."""

    def fetch(self, stores: _Stores, copier: _LayerCopier | None) -> None:
        t0 = time.perf_counter()
        for job in self.jobs:
            self.fetched.append(_fetch(job, stores, copier))
        self.seconds += time.perf_counter() - t0

    def copy_layer(self, copier: _LayerCopier, layer: int) -> None:
        t0 = time.perf_counter()
        for fetched in self.fetched:
            for piece in fetched.pieces:
                for view, block_id in zip(piece.views, piece.ids, strict=True):
                    copier.scatter_layer(view, block_id, layer)
        if copier.device.type == "cuda":
            # The forward pass reads this layer on its own stream once it is marked done.
            torch.cuda.current_stream(copier.device).synchronize()
        self.seconds += time.perf_counter() - t0

    def finish(self) -> list[LoadOutcome]:
        """Check and release every lease; each job's outcome (its leading run of whole
        blocks)."""
        outcomes = []
        for fetched in self.fetched:
            loaded, whole = 0, True
            for piece in fetched.pieces:
                n = len(piece.views)
                if piece.lease is not None:
                    # Checked after the copies: a slot that changed under us ends the run.
                    try:
                        n = min(n, int(piece.lease.intact()))
                    except KVStoreError:
                        n = 0
                    _release(piece.lease)
                if whole:
                    loaded += n
                    whole = n == len(piece.ids)
            outcomes.append(LoadOutcome(fetched.job, loaded, fetched.answered))
        self.fetched = []
        return outcomes

    def abandon(self) -> None:
        """Release every lease without copying (the load died)."""
        for fetched in self.fetched:
            for piece in fetched.pieces:
                if piece.lease is not None:
                    _release(piece.lease)
        self.fetched = []


def _fetch(job: LoadJob, stores: _Stores, copier: _LayerCopier | None) -> _Fetched:
    """The job's blocks, each run fetched from the tenant that holds it (the request's own, or
    a shared one), from the first up to the first one missing; nothing more once a store fails
    (one retry on a fresh client, as every call)."""
    fetched = _Fetched(job)
    if copier is None:
        return fetched
    for tenant, start, stop in job.sources():
        got = len(fetched.pieces)

        def fetch_from(
            client: KVStoreClient, start: int = start, stop: int = stop, got: int = got
        ) -> bool:
            try:
                for lo in range(start, stop, CHUNK_BLOCKS):
                    keys = job.keys[lo : min(lo + CHUNK_BLOCKS, stop)]
                    ids = job.block_ids[lo : min(lo + CHUNK_BLOCKS, stop)]
                    if client.uses_shared_memory:
                        lease = client.acquire(keys)
                        views = list(lease.views)
                        fetched.pieces.append(_Piece(views, ids[: len(views)], lease))
                    else:
                        lay = copier.layout
                        out = torch.empty((len(keys), *lay.block_shape), dtype=lay.dtype)
                        blocks = client.get(keys, out=out)
                        views = [blocks[i] for i in range(blocks.shape[0])]
                        fetched.pieces.append(_Piece(views, ids[: len(views)]))
                    if len(views) < len(keys):
                        return False
            except KVStoreError:  # released: a retry on a fresh client starts the run again
                for piece in fetched.pieces[got:]:
                    if piece.lease is not None:
                        _release(piece.lease)
                del fetched.pieces[got:]
                raise
            return True

        whole = stores.of(tenant).with_client("load", fetch_from)
        if whole is None:  # the store failed: this run and the rest are not loaded
            fetched.answered = False
            break
        fetched.answered = True
        if not whole:
            break
    return fetched


def _release(lease: Any) -> None:
    try:
        lease.release()
    except Exception:  # the daemon reclaims an expired lease on its own
        logger.debug("releasing a kvstore lease failed", exc_info=True)
