"""What the scheduler tells the workers each step (loads, saves, held requests) and what the
workers tell it back (keys stored, found missing, settled)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class TransferJob:
    """Blocks of one request to copy between vLLM's cache and the store: ``keys[i]`` is the
    block in ``block_ids[i]``."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    tenant: str | None = None
    """The tenant whose namespace holds the blocks (the request's ``cache_salt`` mapped by
    ``salt_tenants``); None: the engine's own tenant."""


@dataclass
class LoadJob(TransferJob):
    runs: list[tuple[str | None, int]] = field(default_factory=list)
    """Where the job's blocks are read from, in order: ``(tenant, count)`` runs covering every
    key (the request's own tenant, or one of ``shared_tenants``); empty: all from ``tenant``."""

    def sources(self) -> list[tuple[str | None, int, int]]:
        """``(tenant, start, stop)`` of each run of keys, in order."""
        if not self.runs:
            return [(self.tenant, 0, len(self.keys))]
        out, start = [], 0
        for tenant, count in self.runs:
            out.append((tenant, start, start + count))
            start += count
        return out


@dataclass
class SaveJob(TransferJob):
    pass


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    """Requests whose blocks the scheduler holds until the worker reports their saves done."""
    preempted: bool = False


@dataclass
class KVStoreWorkerMetadata(KVConnectorWorkerMetadata):
    stored: list[bytes] = field(default_factory=list)
    """Keys this step's saves newly stored."""
    missing: list[bytes] = field(default_factory=list)
    """Keys a load found gone (evicted, corrupt): the store no longer holds them."""
    settled: list[bytes] = field(default_factory=list)
    """Every key of each job this worker finished (loaded, stored, already present, dropped):
    the scheduler forgets what it kept for that job's events."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVStoreWorkerMetadata)
        return KVStoreWorkerMetadata(
            self.stored + other.stored,
            self.missing + other.missing,
            self.settled + other.settled,
        )
