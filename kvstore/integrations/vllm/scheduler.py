"""The scheduler side: one lookup per request, the load and save jobs of each step, the
blocks held for saves, and the block events for a KV-aware router."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvstore.client.sync import KVStoreClient
from kvstore.integrations.vllm.events import EventRelay
from kvstore.integrations.vllm.identity import AdapterKeys, StoreIdentity, store_key
from kvstore.integrations.vllm.metadata import (
    KVStoreConnectorMetadata,
    KVStoreWorkerMetadata,
    LoadJob,
    SaveJob,
)
from kvstore.integrations.vllm.options import ConnectorConfig
from kvstore.integrations.vllm.stats import KVStoreConnectorStats
from kvstore.integrations.vllm.store import _Stores

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


MEDIUM = "CPU"
"""The medium of events told from workers' reports (no block watch: vLLM's KV events are off)."""

MAX_PENDING_EVENTS = 65536

MAX_RUNS = 8
"""At most this many runs (own tenant / shared tenants, alternating) per request's lookup."""


@dataclass
class _Found:
    """What a request's lookup found, kept until vLLM allocates its blocks."""

    runs: list[tuple[str, int]]
    """``(tenant, blocks)`` runs from block ``start`` on (``_Scheduler._find``)."""
    start: int
    """The first block looked up (those before it vLLM has cached itself)."""
    held: int
    """Leading blocks (of those before ``start``) a shared tenant holds."""


def _truncate(runs: list[tuple[str, int]], count: int) -> list[tuple[str, int]]:
    """The leading ``count`` blocks of ``runs``."""
    out = []
    for tenant, n in runs:
        if count <= 0:
            break
        out.append((tenant, min(n, count)))
        count -= n
    return out


@dataclass
class _Pending:
    """What a block's BlockStored / BlockRemoved event needs, kept while its transfers run."""

    block_hash: Any
    parent: Any
    tokens: list[int]
    lora: Any
    extra_keys: Any
    """vLLM's extra keys of the block, as its own events publish them (None: none)."""
    waiting: int
    """Settle reports still expected: one per worker per job naming the block."""
    told: str = ""
    """The last event sent for it ("stored", "removed"), so TP ranks never repeat one."""


@dataclass
class _Tracked:
    request: Request
    saved: int = 0
    """Blocks from 0 whose save has been scheduled (or that the store is known to hold)."""
    load: LoadJob | None = None
    holds: bool = False
    """A save was scheduled: request_finished keeps the blocks until the worker reports."""
    tenant: str | None = None
    """The tenant of the request's blocks (its ``cache_salt`` mapped by ``salt_tenants``);
    None: the request has no store access (an unmapped salt under ``unmapped_salt="refuse"``,
    or a LoRA adapter whose files cannot be read here)."""
    adapter: bytes = b""
    """What the request's LoRA adapter adds to its keys (``AdapterKeys``), fixed when the
    request is first scheduled; b"": no adapter."""


class _Scheduler:
    def __init__(self, ident: StoreIdentity, cfg: ConnectorConfig, vllm_config: Any) -> None:
        self.ident = ident
        self.cfg = cfg
        self.block_size = ident.layout.block_size
        self.stores = _Stores(ident, cfg, cfg.lookup_timeout_s)
        self.tracked: dict[str, _Tracked] = {}
        self.pending_loads: list[LoadJob] = []
        self.found: dict[str, _Found] = {}
        """Request id -> what its last lookup found, until vLLM allocates its blocks."""
        self.held: list[str] = []
        self.stats = KVStoreConnectorStats()
        self.events: list[KVCacheEvent] = []
        self.announce: OrderedDict[bytes, _Pending] = OrderedDict()
        """key -> what its events need, for every key of a transfer not yet settled, oldest
        first. Each worker settles every key of every job it finishes, so the map holds only
        what is in flight; ``max_pending`` bounds it even if a worker never reports (the
        oldest are dropped and counted in ``events_dropped``)."""
        self.max_pending = MAX_PENDING_EVENTS
        self._dropped_warned = False
        pc = getattr(vllm_config, "parallel_config", None)
        # Every worker (tensor and pipeline ranks) finishes and settles each job once.
        self.reporters = max(1, int(getattr(pc, "world_size", 1) or 1))
        self.hash_block_size = vllm_config.cache_config.block_size
        self.adapters = AdapterKeys()
        # With vLLM's KV events on, the daemon's block events say what is stored where.
        self.relay: EventRelay | None = None
        if _kv_events_on(vllm_config):
            self.relay = EventRelay(
                self.block_size,
                self.max_pending,
                on_dropped=lambda n: self.stats.add("events_dropped", n),
            )

    def access(self, request: Request, count: bool = False) -> tuple[str, bytes] | None:
        """The tenant of the request's blocks and what its LoRA adapter adds to their keys;
        None: no store access (an unmapped salt refused, or an adapter that cannot be read
        here, whose blocks could not be told from another adapter's). ``count``: count a
        refusal (once per request: when it is first scheduled)."""
        tenant = self.cfg.tenant_of(request.cache_salt)
        if tenant is None:
            if count:
                self.stats.add("salts_refused")
            return None
        adapter = self.adapters.of(request.lora_request)
        if adapter is None:
            if count:
                self.stats.add("adapters_unread")
            if not self._adapter_warned:
                self._adapter_warned = True
                logger.warning(
                    "KVStoreConnector: cannot read LoRA adapter %r at %r to fingerprint it; "
                    "its requests do not use the store",
                    request.lora_request.lora_name if request.lora_request else None,
                    request.lora_request.lora_path if request.lora_request else None,
                )
            return None
        return tenant, adapter

    _adapter_warned = False

    def keys_of(
        self, request: Request, start: int, stop: int, adapter: bytes | None = None
    ) -> list[bytes]:
        """The store keys of the request's blocks ``start:stop``: vLLM's block hashes, with
        the LoRA adapter's identity (``adapter``, default: computed now) mixed in."""
        if adapter is None:
            adapter = self.adapters.of(request.lora_request)
            if adapter is None:
                raise ValueError("the request's LoRA adapter cannot be read: it has no keys")
        return [store_key(h, adapter) for h in request.block_hashes[start:stop]]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self.cfg.load == "none" or num_computed_tokens % self.block_size:
            return 0, False
        bs = self.block_size
        start = num_computed_tokens // bs
        # Always leave the last token to compute: its logits are the output.
        stop = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        if stop <= start:
            return 0, False
        state = self.tracked.get(request.request_id)
        if state is not None:  # preempted and scheduled again: the access it was given
            if state.tenant is None:
                return 0, False
            tenant, adapter = state.tenant, state.adapter
        else:
            access = self.access(request)
            if access is None:
                return 0, False
            tenant, adapter = access
        sources = [tenant, *(t for t in self.cfg.shared_tenants if t != tenant)]
        runs = self._find(self.keys_of(request, start, stop, adapter), sources)
        held = 0
        if len(sources) > 1 and state is None and start:
            # What the shared tenants already hold is never saved again to the request's own
            # tenant: the leading blocks they hold of what vLLM has cached itself, then the
            # runs about to load, while they continue from there.
            held = self._shared_prefix(self.keys_of(request, 0, start, adapter), sources[1:])
        self.found[request.request_id] = _Found(runs, start, held)
        found = sum(n for _, n in runs)
        if not found:
            return 0, False
        tokens = found * bs
        self.stats.add("hit_tokens", tokens)
        shared = sum(n for t, n in runs if t != tenant)
        if shared:
            self.stats.add("shared_hit_tokens", shared * bs)
        return tokens, self.cfg.load == "async"

    def _lookup(self, tenant: str, keys: list[bytes]) -> int:
        """The leading run of ``keys`` stored in ``tenant``'s namespace (0 if the store fails
        or refuses it: a miss)."""
        store = self.stores.of(tenant)

        def lookup(client: KVStoreClient) -> int:
            self.stats.add("lookups")
            return client.lookup(keys)

        found = store.with_client("lookup", lookup, lambda: self.stats.add("lookup_failures"))
        if found is None and store.refused:
            self.stats.add("lookups_refused")
        return found or 0

    def _find(self, keys: list[bytes], sources: list[str]) -> list[tuple[str, int]]:
        """Runs ``(tenant, count)`` covering the leading stored blocks of ``keys``: from the
        request's own tenant (``sources[0]``) or, where it lacks them, the shared tenants in
        their order, each run as long as its tenant holds them. One lookup without shared
        tenants; a few more with them (one per source tried at each run's end)."""
        runs: list[tuple[str, int]] = []
        pos = 0
        while pos < len(keys) and len(runs) < MAX_RUNS:
            for source in sources:
                if runs and runs[-1][0] == source:
                    continue  # its run ended here
                n = self._lookup(source, keys[pos:])
                if n:
                    runs.append((source, n))
                    pos += n
                    break
            else:
                break
        return runs

    def _shared_prefix(self, keys: list[bytes], shared: list[str]) -> int:
        """The leading run of ``keys`` one of the ``shared`` tenants holds."""
        best = 0
        for tenant in shared:
            best = max(best, self._lookup(tenant, keys))
            if best == len(keys):
                break
        return best

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self.tracked.get(request.request_id)
        found = self.found.pop(request.request_id, None)
        if state is None:
            access = self.access(request, count=True)
            tenant, adapter = access if access is not None else (None, b"")
            state = _Tracked(request, tenant=tenant, adapter=adapter)
            self.tracked[request.request_id] = state
        state.request = request
        if state.tenant is None:
            return
        bs = self.block_size
        # vLLM sets ``num_computed_tokens`` only after this call: the blocks its own prefix
        # cache holds are those the lookup started after.
        start = found.start if found is not None else request.num_computed_tokens // bs
        count = num_external_tokens // bs
        runs = _truncate(found.runs if found is not None else [], count)
        if found is not None and self.cfg.shared_tenants:
            # Blocks known held (by a shared tenant, or loading from one of them and from
            # the request's own) are not saved again: saves start after them.
            known = found.held
            if known == start:
                known += sum(n for _, n in runs)
            state.saved = max(state.saved, known)
        if num_external_tokens == 0:
            return
        if sum(n for _, n in runs) != count:  # no plan from the lookup: all from its own
            runs = [(state.tenant, count)]
        block_ids = blocks.get_block_ids()[0]
        stop = start + count
        job = LoadJob(
            request.request_id,
            self.keys_of(request, start, stop, state.adapter),
            list(block_ids[start:stop]),
            tenant=state.tenant,
            runs=[] if len(runs) == 1 and runs[0][0] == state.tenant else list(runs),
        )
        state.load = job
        for source, lo, hi in job.sources():
            for i in range(lo, hi):
                self._remember(request, start + i, job.keys[i], source or state.tenant)
        self.pending_loads.append(job)

    def _remember(self, request: Request, index: int, key: bytes, tenant: str) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        pending = self.announce.get(key)
        if pending is not None:
            # The same block in another job (a shared prefix): one entry, settled by both.
            pending.waiting += self.reporters
            self.announce.move_to_end(key)
            if self.relay is not None:
                self.relay.remember(key, pending, tenant)
            return
        parent = _external(hashes[index - 1]) if index > 0 else None
        lora = request.lora_request.lora_name if request.lora_request else None
        tokens = list(request.all_token_ids[index * bs : (index + 1) * bs])
        pending = _Pending(
            _external(hashes[index]),
            parent,
            tokens,
            lora,
            _extra_keys(request, index * bs, (index + 1) * bs),
            self.reporters,
        )
        self.announce[key] = pending
        if self.relay is not None:
            self.relay.remember(key, pending, tenant)
            self.relay.watch(tenant, self.stores.of(tenant).new_client)
        while len(self.announce) > self.max_pending:
            self.announce.popitem(last=False)
            self.stats.add("events_dropped")
            if not self._dropped_warned:
                self._dropped_warned = True
                logger.warning(
                    "KVStoreConnector: more than %d blocks in flight; the oldest lose their "
                    "events (counted in events_dropped)",
                    self.max_pending,
                )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=self.pending_loads, held=self.held)
        self.pending_loads, self.held = [], []
        meta.preempted = bool(scheduler_output.preempted_req_ids)
        for req_id in scheduler_output.preempted_req_ids or ():
            state = self.tracked.get(req_id)
            if state is not None:
                state.load = None
        if self.cfg.store == "none":
            return meta
        bs = self.block_size
        for req_id, n_new in scheduler_output.num_scheduled_tokens.items():
            state = self.tracked.get(req_id)
            if state is None:
                continue
            req = state.request
            state.load = None  # running: any load it had is complete
            if state.tenant is None:
                continue  # no store access for this request
            done = req.num_computed_tokens + n_new  # tokens with KV once this step ran
            if self.cfg.store == "prompt":
                done = min(done, req.num_prompt_tokens)
            stop = min(done // bs, len(req.block_hashes))
            if stop <= state.saved:
                continue
            block_ids = self._block_ids(req_id)
            if block_ids is None or len(block_ids) < stop:
                continue
            start = state.saved
            keys = self.keys_of(req, start, stop, state.adapter)
            for i, key in enumerate(keys):
                self._remember(req, start + i, key, state.tenant)
            meta.saves.append(
                SaveJob(req_id, keys, list(block_ids[start:stop]), tenant=state.tenant)
            )
            state.saved = stop
            state.holds = True
        return meta

    def _block_ids(self, req_id: str) -> list[int] | None:
        manager = self.kv_cache_manager
        if manager is None:
            return None
        ids = manager.get_block_ids(req_id)
        return list(ids[0]) if ids else None

    kv_cache_manager: Any = None

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        self.found.pop(request.request_id, None)
        state = self.tracked.pop(request.request_id, None)
        if state is None or not state.holds:
            return False
        from vllm.v1.request import RequestStatus

        # A request still waiting on its load is freed by vLLM when that load reports; it must
        # not also be reported as a finished save (it would be freed twice).
        if state.load is not None or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return False
        self.held.append(request.request_id)
        return True

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, KVStoreWorkerMetadata):
            return
        if self.relay is None:  # else the daemon's events tell what is stored where
            self._tell_reports(meta)
        for key in meta.settled:
            info = self.announce.get(key)
            if info is not None:
                info.waiting -= 1
                if info.waiting <= 0:
                    del self.announce[key]

    def _tell_reports(self, meta: KVStoreWorkerMetadata) -> None:
        """Events from what the workers report (no block watch): stored, found missing."""
        for key in meta.stored:
            info = self.announce.get(key)
            if info is not None and info.told != "stored":  # once, whatever the TP ranks say
                info.told = "stored"
                self.events.append(
                    BlockStored(
                        block_hashes=[info.block_hash],
                        parent_block_hash=info.parent,
                        token_ids=info.tokens,
                        block_size=self.block_size,
                        lora_id=None,
                        medium=MEDIUM,
                        lora_name=info.lora,
                        extra_keys=info.extra_keys,
                    )
                )
        for key in meta.missing:
            info = self.announce.get(key)
            if info is not None and info.told != "removed":
                info.told = "removed"
                self.events.append(BlockRemoved(block_hashes=[info.block_hash], medium=MEDIUM))

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self.events = self.events, []
        if self.relay is not None:
            events.extend(self.relay.take())
        return events

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
        self.stores.close()

    def take_stats(self) -> KVStoreConnectorStats | None:
        return self.stats.take()


def _kv_events_on(vllm_config: Any) -> bool:
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and getattr(config, "enable_kv_cache_events", False))


def _external(block_hash: Any) -> Any:
    """A block hash as vLLM's own events publish it (bytes, or an int with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    except ImportError:  # a vLLM without it publishes the hash as it is
        return block_hash
    return maybe_convert_block_hash(block_hash)


def _extra_keys(request: Request, start: int, stop: int) -> Any:
    """The block's extra keys (LoRA name, multimodal inputs, cache salt...) in the untagged
    form vLLM's own ``BlockStored`` events carry; None where this vLLM cannot say."""
    try:
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            to_event_extra_keys,
        )

        keys, _ = generate_block_hash_extra_keys(request, start, stop, 0)
        return to_event_extra_keys([keys])
    except Exception:  # an older vLLM, or a request it cannot describe: no extra keys
        return None
