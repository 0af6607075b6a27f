"""What the block store's parts share: the tiers and the ledger they compose, the per-request
bounds, and the results of the public operations.

``BlockStore`` (``kvstore.daemon.store``) is composed of ``ReadOps`` (``store_reads``: lookup,
acquire, release, prefetch), ``WriteOps`` (``store_writes``: reserve, commit, abort, the bytes
path, delete) and ``SpareOps`` (``store_spares``: spare slots and Bind, a put in one call), each
a class over ``StoreParts``; the store itself holds namespaces and handles, reaping, the checker
and Stats. Every change to block state is a ledger method (``kvstore.daemon.ledger``).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.config import DaemonConfig, LimitsConfig
from kvstore.daemon.cpu_room import CpuRoom
from kvstore.daemon.device import DeviceTier
from kvstore.daemon.ledger import Ledger
from kvstore.daemon.movement import Mover
from kvstore.daemon.namespaces import Handle
from kvstore.daemon.quotas import Usage
from kvstore.daemon.shared import SharedTier
from kvstore.keys import KEY_BYTES, SplitKeys


@dataclass
class ReserveResult:
    reservation_id: int  # 0 when nothing was reserved
    offsets: list[int]  # per key: slot offset, or -1 (present, being written, or a repeat)
    gpu: bool  # the offsets are GPU pool offsets
    pending: int = 0  # keys another client was still writing when the wait ended
    codec: int = 0  # what the arena slots take: the block (0) or its fp8 payload (``cpu_bytes``)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter((self.reservation_id, self.offsets, self.gpu))


@dataclass
class BindResult:
    committed: int  # keys newly stored
    pending: int  # keys another client was still writing when the wait ended
    unbound: list[int]  # the slots named that stay spare (a key present, repeated or pending)


@dataclass
class AcquireResult:
    lease_id: int  # 0 when nothing was found
    offsets: list[int]
    checksums: list[int]
    on_gpu: list[bool]
    pending: bool = False  # the run ended at a key another client was still writing
    # Per block, where any arena block is an fp8 payload: its codec and its payload checksum
    # (``checksums`` are then of the decoded form, what a reader verifies after decoding).
    codecs: list[int] | None = None
    payload_checksums: list[int] | None = None

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter((self.lease_id, self.offsets, self.checksums, self.on_gpu))


def distinct(keys: Sequence[bytes], what: str) -> None:
    if len(set(keys)) != len(keys):
        raise ValueError(f"{what}: a key is repeated (a prefix chain never repeats a key)")


class StoreParts:
    """The state every part of the store reaches (set by ``BlockStore.__init__``)."""

    config: DaemonConfig
    limits: LimitsConfig
    _clock: Callable[[], float]
    ledger: Ledger
    cpu_room: CpuRoom
    mover: Mover
    shared: SharedTier
    device: DeviceTier
    # Spare slots (``SpareOps``): RESERVED entries with no key until a Bind keys them
    # (reserved under stand-in keys: a secret prefix and a count); the bytes all handles
    # hold, of those expired and still quarantined (a heap of (until, bytes)) and of grants
    # under way.
    _spare_prefix: bytes
    _spare_count: itertools.count[int]
    _spare_tasks: set[asyncio.Task[None]]
    spare_reserved_bytes: int
    spare_quarantined_bytes: int
    _spare_quarantine: list[tuple[float, int]]
    _spare_granting_bytes: int

    def check_keys(self, keys: Sequence[bytes], what: str) -> None:
        """The per-request bounds every call with keys obeys (ValueError names the bound)."""
        if len(keys) > self.limits.max_keys_per_request:
            raise ValueError(
                f"{what}: {len(keys)} keys, more than limits.max_keys_per_request "
                f"({self.limits.max_keys_per_request})"
            )
        # Keys split from a request's packed field are 32 bytes each by construction; others
        # are measured in C (map, set): the common case.
        if type(keys) is SplitKeys or set(map(len, keys)) <= {KEY_BYTES}:
            return
        for i, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                raise ValueError(f"{what}: key {i} is {len(key)} bytes, not {KEY_BYTES}")

    def _bound(self, handle: Handle) -> Usage | None:
        """The books to bound ``handle``'s pins by (``Quotas.check_pin``): while it is the only
        open handle nobody else can be wedged, so it may pin what its tenant may."""
        return handle.books if len(self.ledger.names) > 1 else None

    def _maps_pool(self, handle: Handle) -> bool:
        """Whether ``handle``'s caller may be given GPU pool slots: the pool is one undivided
        allocation, handed only to callers of every tenant (``OpenNamespace``); anyone else
        could only hold its slots and blocks, never use them."""
        principal = handle.principal
        return (
            self.device.enabled
            and getattr(principal, "all_tenants", True)
            and not handle.record.cpu_codec  # not built for payload entries
        )

    @property
    def spare_ttl_s(self) -> float:
        """How long unbound spare slots live: briefly (an idle client's come back soon), and
        no longer than a reservation shortened for a newcomer (``pin_grace_s``), so a client
        that writes into them within half of it never writes into a slot given to another."""
        return min(self.config.reservation_ttl_s, self.limits.pin_grace_s)
