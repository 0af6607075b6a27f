"""KV events a router can use, from the daemon's own picture of its blocks.

KV-aware routers (llm-d, Dynamo) learn where prefixes live from vLLM's KV events. The blocks
this engine offloads live in the daemon, which may evict them, move them to disk or delete
them at any time; only the daemon knows when. So the events come from its ``WatchBlocks``
stream (``KVStoreClient.watch_blocks``): each change of a block's tiers becomes a
``BlockStored`` in the media it gained and a ``BlockRemoved`` from the media it lost, in vLLM's
canonical media:

- the CPU tier: ``CPU``;
- the NVMe tier: ``STORAGE``, locality ``LOCAL``; the shared Redis tier: ``STORAGE``,
  locality ``REMOTE`` (where the installed vLLM's events have a locality field);
- the daemon's GPU pool (CUDA hosts): ``GPU``.

A block is named with vLLM's own block hash, parent hash, token ids, LoRA name and extra keys,
which the scheduler knows for the blocks it saves or loads (``remember``); a block this engine
never handled (another engine's, on the same daemon) is left for that engine to announce.

A watch that fell behind, or one opened again after the daemon restarted, starts from a
snapshot: the relay compares it with what it told before and sends the difference, removals
included. (``AllBlocksCleared`` carries no medium: a router would drop the engine's GPU blocks
with it, so the relay never sends one.) One thread per tenant reads the stream; the events it
queues are turned into vLLM's on the scheduler's thread, in ``take``.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvstore.client.block_watch import BlockEvents
from kvstore.client.sync import KVStoreClient

logger = logging.getLogger(__name__)

Medium = tuple[str, str | None]
"""(vLLM medium, locality)."""

MEDIA: dict[str, Medium] = {
    "gpu": ("GPU", "LOCAL"),
    "cpu": ("CPU", "LOCAL"),
    "nvme": ("STORAGE", "LOCAL"),
    "redis": ("STORAGE", "REMOTE"),
}
OWNERSHIP = "kvstore"
"""The ``ownership`` field of vLLM's events: the offloading tier that generated them."""

_HAS_LOCALITY = "locality" in getattr(BlockStored, "__struct_fields__", ())
_HAS_OWNERSHIP = "ownership" in getattr(BlockStored, "__struct_fields__", ())

RETRY_S = (0.5, 1.0, 2.0, 5.0)
"""Waits before watching again after the stream failed (the last repeats)."""

MAX_PENDING_CHANGES = 65536
"""Changed blocks a tenant's stream may have waiting for ``take`` (an idle engine beside busy
ones on the same daemon takes nothing for a while): past it they are dropped and the stream is
opened again, so the next ``take`` starts from a fresh snapshot."""


class _Waiting:
    """What a tenant's stream told since the last ``take``: the latest tiers of each block,
    and whether they start from a snapshot (``reset``)."""

    __slots__ = ("changes", "overflowed", "reset")

    def __init__(self) -> None:
        self.reset = False
        self.changes: dict[bytes, frozenset[str]] = {}
        self.overflowed = False


def _placement(medium: Medium) -> dict[str, Any]:
    """The locality and ownership fields of an event, where this vLLM's events have them."""
    fields: dict[str, Any] = {}
    if _HAS_LOCALITY:
        fields["locality"] = medium[1]
    if _HAS_OWNERSHIP:
        fields["ownership"] = OWNERSHIP
    return fields


def media_of(tiers: frozenset[str]) -> frozenset[Medium]:
    return frozenset(MEDIA[t] for t in tiers if t in MEDIA)


class EventRelay:
    """Turns the daemon's block events into vLLM's KV events for this engine's blocks.

    ``remember`` (scheduler thread) records what a block's events say about it; ``watch``
    starts the stream of a tenant's namespace; ``take`` (scheduler thread) returns the events
    since the last call. ``max_infos`` bounds the blocks remembered but not (or no longer)
    known to be stored; the oldest go first, counted by ``on_dropped``."""

    def __init__(
        self,
        block_size: int,
        max_infos: int,
        on_dropped: Callable[[int], None] | None = None,
    ) -> None:
        self.block_size = block_size
        self.max_infos = max_infos
        self._on_dropped = on_dropped
        self._infos: OrderedDict[bytes, Any] = OrderedDict()
        self._known: dict[tuple[str, bytes], tuple[Any, frozenset[Medium]]] = {}
        # Blocks the daemon told of before the scheduler remembered them (a load of a block
        # stored before this engine started): told once it does. Bounded like ``_infos``.
        self._unseen: OrderedDict[bytes, tuple[str, frozenset[Medium]]] = OrderedDict()
        self._ready: list[KVCacheEvent] = []
        self._waiting: dict[str, _Waiting] = {}  # the stream threads' side, under ``_lock``
        self._threads: dict[str, threading.Thread] = {}
        self._stop = threading.Event()
        self._watches: dict[str, Any] = {}  # tenant -> its open BlockWatch, for close()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ scheduler thread
    def remember(self, key: bytes, info: Any, tenant: str) -> None:
        """What ``key``'s events will say (``block_hash``, ``parent``, ``tokens``, ``lora``,
        ``extra_keys`` attributes), kept until the daemon tells of the block in ``tenant``'s
        namespace."""
        if (tenant, key) in self._known:
            return  # told already: its info is kept with what was told
        unseen = self._unseen.get(key)
        if unseen is not None and unseen[0] == tenant:
            del self._unseen[key]
            self._known[(tenant, key)] = (info, frozenset())
            self._apply(tenant, key, unseen[1], self._ready)
            return
        infos = self._infos
        infos[key] = info
        infos.move_to_end(key)
        dropped = 0
        while len(infos) > self.max_infos:
            infos.popitem(last=False)
            dropped += 1
        if dropped and self._on_dropped is not None:
            self._on_dropped(dropped)

    def watch(self, tenant: str, open_client: Callable[[], KVStoreClient]) -> None:
        """Follow ``tenant``'s namespace (once; ``open_client`` opens a client of it)."""
        if tenant in self._threads or self._stop.is_set():
            return
        thread = threading.Thread(
            target=self._follow, args=(tenant, open_client), name=f"kvstore-events-{tenant}"
        )
        thread.daemon = True
        self._threads[tenant] = thread
        thread.start()

    @property
    def watching(self) -> bool:
        return bool(self._threads)

    def take(self) -> list[KVCacheEvent]:
        out, self._ready = self._ready, []
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for tenant, told in waiting.items():
            if told.reset:
                self._resync(tenant, told.changes, out)
            else:
                for key, tiers in told.changes.items():
                    self._apply(tenant, key, media_of(tiers), out)
        return out

    def _resync(
        self, tenant: str, snapshot: dict[bytes, frozenset[str]], out: list[KVCacheEvent]
    ) -> None:
        now = {key: media_of(tiers) for key, tiers in snapshot.items() if tiers}
        for known_tenant, key in [k for k in self._known if k[0] == tenant]:
            if key not in now:
                self._apply(known_tenant, key, frozenset(), out)
        for key, media in now.items():
            self._apply(tenant, key, media, out)

    def _apply(
        self, tenant: str, key: bytes, media: frozenset[Medium], out: list[KVCacheEvent]
    ) -> None:
        known = self._known.get((tenant, key))
        if known is None:
            info = self._infos.get(key)
            if info is None or not media:
                # Not a block this engine handled (yet: kept a while, should it load it), or
                # gone before it was told.
                if media:
                    self._unseen[key] = (tenant, media)
                    self._unseen.move_to_end(key)
                    while len(self._unseen) > self.max_infos:
                        self._unseen.popitem(last=False)
                else:
                    self._unseen.pop(key, None)
                return
            before: frozenset[Medium] = frozenset()
        else:
            info, before = known
        for medium in sorted(media - before):
            out.append(self._stored(info, medium))
        for medium in sorted(before - media):
            out.append(self._removed(info, medium))
        if media:
            self._known[(tenant, key)] = (info, media)
            self._infos.pop(key, None)  # kept with what is known from here on
        else:
            self._known.pop((tenant, key), None)

    def _stored(self, info: Any, medium: Medium) -> BlockStored:
        return BlockStored(
            block_hashes=[info.block_hash],
            parent_block_hash=info.parent,
            token_ids=list(info.tokens),
            block_size=self.block_size,
            lora_id=None,
            medium=medium[0],
            lora_name=info.lora,
            extra_keys=info.extra_keys,
            **_placement(medium),
        )

    def _removed(self, info: Any, medium: Medium) -> BlockRemoved:
        return BlockRemoved(block_hashes=[info.block_hash], medium=medium[0], **_placement(medium))

    # ------------------------------------------------------------------ the stream threads
    def push(self, tenant: str, events: BlockEvents) -> bool:
        """Keep the daemon's events of ``tenant``'s namespace for the next ``take`` (any
        thread), the latest tiers of each block only. False: more than
        ``MAX_PENDING_CHANGES`` blocks wait, so they were dropped: watch again (a snapshot)."""
        with self._lock:
            told = self._waiting.get(tenant)
            if told is None:
                told = self._waiting[tenant] = _Waiting()
            if events.reset:  # the whole picture: what waited before is superseded
                told.reset, told.overflowed = True, False
                told.changes = dict(events.blocks)
                return True
            if told.overflowed:
                return False  # a snapshot is on its way
            told.changes.update(events.blocks)
            if told.reset:  # a snapshot holds only what is there: its size stays the namespace's
                for key, tiers in events.blocks:
                    if not tiers:
                        told.changes.pop(key, None)
            elif len(told.changes) > MAX_PENDING_CHANGES:
                told.changes.clear()
                told.overflowed = True
                return False
            return True

    def _follow(self, tenant: str, open_client: Callable[[], KVStoreClient]) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                client = open_client()
            except Exception as exc:
                failures += 1
                self._failed(tenant, exc, failures)
                continue
            try:
                with client.watch_blocks() as watch:
                    with self._lock:
                        self._watches[tenant] = watch
                    if self._stop.is_set():
                        break
                    for events in watch:
                        failures = 0
                        if not self.push(tenant, events) or self._stop.is_set():
                            break  # fell behind: watch again, from a snapshot
            except Exception as exc:
                failures += 1
                self._failed(tenant, exc, failures)
            finally:
                with self._lock:
                    self._watches.pop(tenant, None)
                try:
                    client.close()
                except Exception:
                    logger.debug("closing the kvstore events client failed", exc_info=True)

    def _failed(self, tenant: str, exc: BaseException, failures: int) -> None:
        if self._stop.is_set():
            return
        if failures == 1:
            logger.warning(
                "kvstore block events of tenant %r stopped (%s); watching again", tenant, exc
            )
        self._stop.wait(RETRY_S[min(failures, len(RETRY_S)) - 1])

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            watches = list(self._watches.values())
        for watch in watches:
            watch.close()  # its thread sees the stream end, and closes its client
        for thread in self._threads.values():
            thread.join(timeout=5)
