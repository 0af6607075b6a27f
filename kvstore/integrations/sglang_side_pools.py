"""The side pools of hybrid models in kvstore's SGLang backend: the ``batch_*_v2`` calls of
SGLang's ``HiCacheStorage`` (``kvstore.integrations.sglang``).

A hybrid model keeps, beside its KV pool, host pools of other kinds that SGLang's controller
stores under the same page hashes: Mamba/linear-attention states (``"mamba"``, one state slot a
page), sliding-window KV (``"swa"``), sparse-attention indexer keys (``"indexer"``, whose host
indices are the KV pool's), draft-model pools. SGLang registers each with
``register_mem_host_pool_v2(pool, name)`` and moves their pages with ``PoolTransfer`` lists
(``name``, ``keys``, ``host_indices``, ``hit_policy``).

- Each side pool is its own kvstore namespace: the model, plus a revision naming the pool
  (``sglang-side:v1:NAME:`` and its page format: host pool class, layout, dtypes, page tensors'
  shapes, tokens a page), the pipeline stage and attention context-parallel rank, and its TP
  shard. Pages of two pools, or of a pool and the KV pool, never meet, even where their formats
  are the same (SWA and full-attention KV often are).
- TP shard: Mamba states are sharded by TP rank even where an MLA model's KV is replicated
  (SGLang writes them from every rank); MLA and DSA-indexer pools of an MLA model are the same
  on every rank, and share one namespace as the KV does (SGLang writes them from one rank); any
  other pool is per TP rank, so a pool whose replication is not known is a miss on another rank,
  never that rank's bytes.
- A page is the pool's flat page (``get_data_page(index, flat=True)``: for a Mamba state its
  temporal, conv and slot states one after the other), copied in place, one copy each way, where
  its tensors are views of the pool's memory; otherwise through the pool's flat-page copies. Each
  copy is checksummed against the key and the pool's namespace (``sglang_pages``).
- ``batch_exists_v2``: the leading run of KV pages, cut by each side pool's hit policy:
  ``all_pages`` needs every page of the prefix, ``trailing_pages`` the last ``len(keys)`` pages
  before a stop point (a Mamba state at the end of a prefix, an SWA window). The answer says
  which prefix lengths every pool can restore (``restorable_prefix_pages``), which SGLang
  intersects across ranks. Another hit policy is a miss.
- A pool transfer named ``"kv"`` is the KV pool's pages (the v1 namespace).

Failure is a miss, as for the v1 calls: an unknown pool, one whose pages cannot be stored, host
indices that are not one page per key, a bad key, a daemon that is down: ``False`` for those
pages (a shorter prefix), never an exception and never another pool's bytes; each kind of
problem is logged once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from kvstore.integrations.sglang_pages import HostPages, Space, describe_pool

logger = logging.getLogger("kvstore.integrations.sglang")  # the backend's: one logger to set

T = TypeVar("T")

KV = "kv"
MAMBA = "mamba"
ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"

REPLICATED_POOLS = frozenset({"MLATokenToKVPoolHost", "DSAIndexerPoolHost"})
"""Host pool classes whose pages are the same on every TP rank of an MLA model."""


class Backend(Protocol):
    """What the side pools use of the backend (``KVStoreHiCacheStorage``)."""

    storage_config: Any
    options: Any
    is_mla: bool

    def _warn(self, kind: str, message: str, *args: Any) -> None: ...

    def _keys(self, keys: Sequence[object]) -> list[bytes]: ...

    def _with_client(
        self, what: str, call: Callable[[Any], T], default: T, space: Space | None = None
    ) -> T: ...

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int: ...

    def move_pages(
        self, what: str, space: Space | None, keys: list[str], host_indices: Any
    ) -> list[bool]: ...


def shard_parts(cfg: Any) -> list[str]:
    """The parts of a namespace's revision that name a pipeline stage and an attention
    context-parallel rank (empty where there is one of each)."""
    parts = []
    if int(getattr(cfg, "pp_size", 1) or 1) > 1:
        parts.append(f"pp{cfg.pp_rank}of{cfg.pp_size}")
    if int(getattr(cfg, "attn_cp_size", 1) or 1) > 1:
        parts.append(f"cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}")
    return parts


def pool_name(name: Any) -> str:
    """SGLang's pool name (a ``PoolName`` or its value) as its value."""
    return str(getattr(name, "value", name))


def side_space(name: str, pool: Any, cfg: Any, revision: str, is_mla: bool) -> Space:
    """The namespace of side pool ``name`` (module docstring); ValueError when its pages cannot
    be stored."""
    fmt = describe_pool(pool, side=True)
    replicated = any(c.__name__ in REPLICATED_POOLS for c in type(pool).__mro__)
    if is_mla and name != MAMBA and replicated:
        tp_rank = int(getattr(cfg, "dcp_rank", 0) or 0)
        tp_size = int(getattr(cfg, "dcp_size", 1) or 1)
        shard = "mla"
    else:
        tp_rank, tp_size = int(cfg.tp_rank), int(cfg.tp_size)
        shard = "tp"
    side = "sglang-side:v1:" + ":".join([name, fmt.description, *shard_parts(cfg), shard])
    return Space(
        name,
        HostPages(pool, fmt, side=True),
        f"{revision}|{side}" if revision else side,
        tp_rank,
        tp_size,
    )


def _run_ends(present: list[bool], window: int) -> list[int]:
    """The prefix lengths ``p`` (1..len) whose last ``window`` pages (clipped at the first page)
    are all present."""
    missing = [0]
    for ok in present:
        missing.append(missing[-1] + (not ok))
    return [p for p in range(1, len(present) + 1) if missing[p] == missing[max(0, p - window)]]


class SidePools:
    """The side pools of one backend: their namespaces, and the v2 calls over them."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.spaces: dict[str, Space] = {}
        self.refused: set[str] = set()  # registered, but their pages cannot be stored
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ set-up
    def register(self, pool: Any, name: Any) -> None:
        """Give side pool ``name`` its namespace; the KV pool's (``"kv"``) is the backend's
        own. A pool whose pages cannot be stored leaves its pages misses (a warning)."""
        key = pool_name(name)
        if key == KV:
            return
        b = self.backend
        try:
            space = side_space(key, pool, b.storage_config, b.options.revision, b.is_mla)
        except Exception as exc:
            with self._lock:
                self.spaces.pop(key, None)
                self.refused.add(key)
            b._warn(
                f"pool:{key}",
                "kvstore HiCache backend cannot store the pages of side pool %r: %s",
                key,
                exc,
            )
            return
        with self._lock:
            self.spaces[key] = space
            self.refused.discard(key)
        fmt = space.fmt
        logger.info(
            "kvstore HiCache backend: side pool %r, namespace %s tp%d/%d, %d-byte pages%s",
            key,
            space.revision,
            space.tp_rank,
            space.tp_size,
            fmt.page_bytes,
            "" if fmt.zero_copy else " (through flat page copies)",
        )

    def space(self, name: str) -> Space | None:
        """Side pool ``name``'s namespace, or None if no pool of that name could be registered
        (with a warning, once a pool: at registration for one whose pages cannot be stored)."""
        with self._lock:
            space = self.spaces.get(name)
            refused = name in self.refused
        if space is None and not refused:
            self.backend._warn(
                f"unknown:{name}",
                "kvstore HiCache backend: no side pool %r it can store: its pages are misses",
                name,
            )
        return space

    # ------------------------------------------------------------------ v2 calls
    def exists(self, keys: list[str], transfers: Sequence[Any] | None) -> Any:
        """``batch_exists_v2`` (module docstring): a ``PoolTransferResult``."""
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        try:
            kv_pages, hits, restorable = self._exists(keys, list(transfers or ()))
        except Exception as exc:
            self.backend._warn("v2", "kvstore HiCache backend: a v2 call failed: %r", exc)
            return PoolTransferResult(0, {}, [])
        return PoolTransferResult(kv_pages, hits, restorable)

    def _exists(
        self, keys: list[str], transfers: list[Any]
    ) -> tuple[int, dict[Any, int], list[int]]:
        b = self.backend
        kv = b._keys(keys)
        kv_pages = int(b.batch_exists(keys)) if kv else 0
        kv = kv[:kv_pages]
        hits: dict[Any, int] = {}
        kv_name = next((t.name for t in transfers if pool_name(t.name) == KV), KV)
        if kv_pages:
            hits[kv_name] = kv_pages
        restorable = set(range(1, kv_pages + 1))
        for t in transfers:
            name = pool_name(t.name)
            if name == KV:
                continue
            if not restorable:
                break
            policy = pool_name(t.hit_policy)
            if policy not in (ALL_PAGES, TRAILING_PAGES):
                b._warn(
                    f"policy:{policy}",
                    "kvstore HiCache backend: hit policy %r of side pool %r: its pages are misses",
                    policy,
                    name,
                )
                restorable = set()
                break
            space = self.space(name)
            if space is None:
                restorable = set()
                break
            if policy == ALL_PAGES:
                run = self._leading(space, kv)
                ends = list(range(1, run + 1))
            else:
                ends = _run_ends(self._present(space, kv), max(1, len(t.keys or ())))
            if ends:
                hits[t.name] = ends[-1]
            restorable &= set(ends)
        ordered = sorted(restorable)
        return (ordered[-1] if ordered else 0), hits, ordered

    def _leading(self, space: Space, kv: list[bytes]) -> int:
        """How many leading ``kv`` are stored in ``space``."""
        if not kv:
            return 0
        return int(self.backend._with_client("lookup", lambda c: c.lookup(kv), 0, space))

    def _present(self, space: Space, kv: list[bytes]) -> list[bool]:
        """Which ``kv`` are stored in ``space``: the leading run in one lookup, then one small
        lookup a key (same-host clients answer them from the namespace's presence table, some
        30 us each; the client has no call that says which keys of a list are present)."""

        def look(client: Any) -> list[bool]:
            run = int(client.lookup(kv)) if kv else 0
            return [True] * run + [bool(client.lookup([k])) for k in kv[run:]]

        return self.backend._with_client("lookup", look, [False] * len(kv), space)

    def move(self, what: str, transfers: Sequence[Any] | None) -> dict[Any, list[bool]]:
        """``batch_set_v2`` (``what="write"``) / ``batch_get_v2`` (``"read"``): each
        transfer's pages moved between its host pool and its namespace; per pool, per page:
        moved (a leading run)."""
        results: dict[Any, list[bool]] = {}
        for t in transfers or ():
            keys = list(getattr(t, "keys", None) or ())
            try:
                name = pool_name(t.name)
                space = None if name == KV else self.space(name)
                if name == KV or space is not None:
                    results[t.name] = self.backend.move_pages(what, space, keys, t.host_indices)
                else:
                    results[t.name] = [False] * len(keys)
            except Exception as exc:
                self.backend._warn("v2", "kvstore HiCache backend: a v2 call failed: %r", exc)
                results[getattr(t, "name", "?")] = [False] * len(keys)
        return results

    def clear(self) -> None:
        """Delete every page of every side pool's namespace."""
        with self._lock:
            spaces = list(self.spaces.values())
        for space in spaces:
            self.backend._with_client("clear", lambda c: c.clear(), 0, space)
