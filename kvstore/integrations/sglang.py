"""kvstore as the L3 storage of SGLang's hierarchical cache (HiCache): a ``HiCacheStorage``.

```
python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
    '{"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
      "class_name": "KVStoreHiCacheStorage", "interface_v1": 1}'
```

SGLang's own factory loads the class by name and builds it as it builds every dynamic backend
(``KVStoreHiCacheStorage(storage_config, kwargs)``), then registers the host pool
(``register_mem_pool_host``). ``"interface_v1": 1`` makes SGLang's cache controller use the
zero-copy calls (``batch_get_v1``/``batch_set_v1``); without it the controller copies each page
into a flat tensor first and calls ``batch_get``/``batch_set``, which work too. SGLang >= 0.5.6.

Options (the extra config; SGLang's own keys are ignored, an unknown one is warned about):

* ``address``: the daemon (default ``$KVSTORE_ADDRESS``, else the daemon's default socket).
* ``tenant``, ``token``: the tenant the pages belong to, and the credential the daemon asks for.
* ``model``, ``revision``: which engines share pages. Default: SGLang's model name (its
  ``--model-path``, tagged by SGLang with the pool's page format where it has one of its own),
  no revision. Give engines of different weights behind one name their own ``revision``.
* ``timeout_s`` (5.0): the deadline of each call to the daemon; ``retry_after_s`` (2.0): after
  a failure the store is left alone that long (every page a miss, every write False), so a daemon
  that is down costs SGLang nothing but the first deadline.
* ``priority`` (0): the eviction priority of the pages written.

What is stored, and under which keys:

* One kvstore block per SGLang page: the bytes of the page as SGLang's own flat page holds them
  (``host_pool.get_data_page(index, flat=True)``, what SGLang's ``HiCacheFile`` writes), in a
  raw-bytes kvstore layout (``uint8``, ``page_bytes`` a block).
* The key is SGLang's page hash (64 hex digits of a SHA-256 chain over every token of the
  prefix, seeded with the request's ``extra_key``/``cache_salt``), as its 32 bytes.
* The namespace adds what the key leaves out: the model, tenant, tensor-parallel rank and size,
  pipeline stage, attention context-parallel rank, and the page format (host pool class,
  layout, dtype, page shape: layers, heads, head size, tokens per page), so pages of two models,
  two TP layouts, two host layouts or two tenants never meet. An MLA model's KV is the same on
  every TP rank: all ranks use one namespace (rank 0 of 1), and SGLang's controller writes from
  one rank only (``HiCacheStorageConfig.is_storage_writer``), as for its own backends.
* Pages live in the daemon, so a restarted SGLang (a new backend) finds what the last stored.

Copies: each call copies straight between SGLang's host pool and the daemon's shared memory,
one copy each way, in the contiguous pieces the host layout offers (one or two per page for
``page_first``, ``page_first_direct`` and ``page_head``; one per layer and K/V for
``layer_first``), each checksummed as it is copied (the source on a write, the copy on a read,
against the key and namespace it is read for): a page that fails its check is a miss.

Failure: the store is a cache. A page of the wrong size, a key that is not 64 hex digits, a host
pool this backend cannot read, a daemon that is down or answers late: SGLang sees a miss
(``False``, ``None``, a shorter leading run), never an exception from these calls and never
another page's bytes. Each kind of problem is logged once as a warning.

Hybrid models (Mamba/linear attention, sliding-window attention, DSA sparse attention, draft
models): SGLang registers each side pool of its host pool group (``register_mem_host_pool_v2``)
and moves their pages with the ``batch_*_v2`` calls; each side pool's pages live in their own
namespace, under the same page hashes, copied one copy each way where the pool's pages are views
of its memory, checksummed the same way, and every failure is a miss
(``kvstore.integrations.sglang_side_pools``).

Not supported: host layouts whose ``get_data_page`` is not a view of the pool (their pages go
through a flat copy: two copies each way); the ``block_groups`` hit policy of ``batch_exists_v2``
(no SGLang pool of 0.5.23 uses it): a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvstore.integrations.sglang needs SGLang >= 0.5.6 (`make sglang-env` builds an "
        "environment with sglang==0.5.23)"
    ) from exc

from kvstore.address import default_address
from kvstore.client.sync import KVStoreClient
from kvstore.errors import (
    KVStoreError,
    NamespaceMismatchError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
    UnknownNamespaceError,
)
from kvstore.integrations.sglang_pages import (
    HostPages,
    PageFormat,
    Space,
    batch_bounds,
    describe_pool,
    page_key,
    page_starts,
    read_pages,
    write_pages,
)
from kvstore.integrations.sglang_side_pools import SidePools, shard_parts

logger = logging.getLogger(__name__)

T = TypeVar("T")

_DAEMON_DOWN = (
    UnavailableError,
    UnknownNamespaceError,
    UnauthenticatedError,
    PermissionDeniedError,
    NamespaceMismatchError,
    OSError,
    grpc.RpcError,
)
"""Failures that mean the daemon cannot be used for now (down, restarted, refusing us): every
page is a miss for ``retry_after_s``. Any other failure is its batch's alone."""

SGLANG_KEYS = frozenset(
    {"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"}
)
"""Keys of the extra config that SGLang reads itself."""


@dataclass(frozen=True)
class BackendOptions:
    """The extra config's kvstore options (module docstring)."""

    address: str
    tenant: str = ""
    token: str | None = None
    model: str = ""
    revision: str = ""
    timeout_s: float = 5.0
    retry_after_s: float = 2.0
    priority: int = 0

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> tuple[BackendOptions, list[str]]:
        """The options, and the unknown keys (neither SGLang's nor ours)."""
        extra = dict(extra or {})
        names = {f for f in cls.__dataclass_fields__}
        unknown = sorted(k for k in extra if k not in names and k not in SGLANG_KEYS)
        address = extra.get("address") or default_address()
        opts = cls(
            address=str(address),
            tenant=str(extra.get("tenant", "")),
            token=extra.get("token"),
            model=str(extra.get("model", "")),
            revision=str(extra.get("revision", "")),
            timeout_s=float(extra.get("timeout_s", 5.0)),
            retry_after_s=float(extra.get("retry_after_s", 2.0)),
            priority=int(extra.get("priority", 0)),
        )
        if opts.timeout_s <= 0 or opts.retry_after_s < 0:
            raise ValueError("timeout_s must be positive and retry_after_s not negative")
        return opts, unknown


class _Counters:
    """What the backend did since it started (``counters()``) and, for SGLang's storage
    metrics, per call since the last ``get_stats``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.totals = {
            "hits": 0,
            "misses": 0,
            "bytes_read": 0,
            "bytes_written": 0,
            "pages_written": 0,
            "pages_present": 0,
            "write_failures": 0,
            "errors": 0,
            # The same, for the pages of hybrid models' side pools (the v2 calls).
            "side_hits": 0,
            "side_misses": 0,
            "side_bytes_read": 0,
            "side_bytes_written": 0,
            "side_pages_written": 0,
            "side_pages_present": 0,
            "side_write_failures": 0,
        }
        self.prefetch_pgs: list[int] = []
        self.backup_pgs: list[int] = []
        self.prefetch_bandwidth: list[float] = []
        self.backup_bandwidth: list[float] = []

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                self.totals[name] += n


class KVStoreHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang's class
    """An SGLang HiCache L3 backend over a kvstore daemon (module docstring).

    SGLang's cache controller calls it from several threads at once (backup, prefetch query,
    prefetch IO); each thread gets its own kvstore client (clients are not thread-safe and are
    cheap), opened on first use. Every public call returns SGLang's failure value rather than
    raise."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.options, unknown = BackendOptions.from_extra(storage_config.extra_config)
        if unknown:
            logger.warning("kvstore HiCache backend: unknown extra config keys %s", unknown)
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        self.enable_metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self.mem_pool_host: Any = None
        self.kv_space: Space | None = None
        self.fmt: PageFormat | None = None
        self.model = self.options.model or str(storage_config.model_name or "") or "sglang"
        self.revision = ""
        self.tp_rank, self.tp_size = 0, 1
        self.stats = _Counters()
        self._local = threading.local()
        self._clients: list[KVStoreClient] = []
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._warned: set[str] = set()
        self._closed = False
        self.side = SidePools(self)

    # ------------------------------------------------------------------ set-up
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the host pool's page format and derive the namespace from it. A pool whose
        pages cannot be stored leaves the backend answering misses (with a warning)."""
        self.mem_pool_host = mem_pool_host
        self._close_clients()
        try:
            fmt = describe_pool(mem_pool_host)
        except Exception as exc:
            self.fmt = self.kv_space = None
            self._warn(
                "pool", "kvstore HiCache backend cannot store this host pool's pages: %s", exc
            )
            return
        cfg = self.storage_config
        if self.is_mla:
            # The same KV on every TP rank: one namespace for all (per DCP shard).
            self.tp_rank = int(getattr(cfg, "dcp_rank", 0) or 0)
            self.tp_size = int(getattr(cfg, "dcp_size", 1) or 1)
        else:
            self.tp_rank, self.tp_size = int(cfg.tp_rank), int(cfg.tp_size)
        shard = [fmt.description, *shard_parts(cfg)]
        if self.is_mla:
            shard.append("mla")
        page = "sglang-page:v1:" + ":".join(shard)
        self.revision = f"{self.options.revision}|{page}" if self.options.revision else page
        self.fmt = fmt
        self.kv_space = Space(
            "", HostPages(mem_pool_host, fmt), self.revision, self.tp_rank, self.tp_size
        )
        logger.info(
            "kvstore HiCache backend: %s, namespace %s@%s tp%d/%d, %d-byte pages%s",
            self.options.address,
            self.model,
            self.revision,
            self.tp_rank,
            self.tp_size,
            fmt.page_bytes,
            "" if fmt.zero_copy else " (through flat page copies)",
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A hybrid model's host pool (SGLang registers every pool of its group here, the KV
        anchor too): each side pool gets its own namespace (``kvstore.integrations.
        sglang_side_pools``). One whose pages cannot be stored answers misses (a warning)."""
        try:
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
        except Exception:  # pragma: no cover - SGLang's bookkeeping only
            logger.debug("HiCacheStorage.register_mem_host_pool_v2 failed", exc_info=True)
        self.side.register(host_pool, host_pool_name)

    # ------------------------------------------------------------------ clients
    def _client(self, space: Space | None = None) -> KVStoreClient | None:
        """This thread's client of ``space`` (default: the KV pool's), opened on first use;
        None while the store is left alone."""
        space = space or self.kv_space
        if space is None or self._closed:
            self._warn("nopool", "kvstore HiCache backend has no host pool it can read: misses")
            return None
        held: dict[str, tuple[Space, KVStoreClient]] | None = getattr(self._local, "clients", None)
        if held is None:
            held = self._local.clients = {}
        entry = held.get(space.name)
        if entry is not None:
            if entry[0] is space:
                return entry[1]
            self._drop_client(entry[1])  # the pool was registered again
        if time.monotonic() < self._down_until:
            return None
        try:
            client = KVStoreClient(
                self.options.address,
                layout=space.fmt.layout,
                model=self.model,
                revision=space.revision,
                tenant=self.options.tenant,
                tp_rank=space.tp_rank,
                tp_size=space.tp_size,
                priority=self.options.priority,
                timeout_s=self.options.timeout_s,
                token=self.options.token,
            )
        except (KVStoreError, OSError, ValueError) as exc:
            self._failed("connect", exc)
            return None
        with self._lock:
            self._clients.append(client)
        held[space.name] = (space, client)
        if "down" in self._warned:
            logger.info("kvstore reachable again at %s", self.options.address)
            self._warned.discard("down")
        return client

    def _with_client(
        self,
        what: str,
        call: Callable[[KVStoreClient], T],
        default: T,
        space: Space | None = None,
    ) -> T:
        """``call(client)`` with this thread's client of ``space``, or ``default`` when the
        store is left alone or the call failed. A failure drops this thread's client (the next
        call opens a new one after ``retry_after_s``)."""
        client = self._client(space)
        if client is None:
            return default
        try:
            return call(client)
        except _DAEMON_DOWN as exc:  # never into SGLang's controller threads
            self._drop_client(client)
            self._failed(what, exc)
            return default
        except Exception as exc:
            # This batch failed (a tier full, a lease expired, pages it could not read): a
            # miss for it alone; the daemon is up and every other batch is served.
            self.stats.add(errors=1)
            self._warn("batch", "kvstore HiCache backend: a %s batch failed: %r", what, exc)
            return default

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats.add(errors=1)
        self._warn(
            "down",
            "kvstore HiCache backend: %s failed, pages are misses for %.1fs: %s",
            what,
            self.options.retry_after_s,
            exc,
        )
        self._down_until = time.monotonic() + self.options.retry_after_s

    def _warn(self, kind: str, message: str, *args: Any) -> None:
        """Log a warning once per kind (once per outage for ``down``)."""
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message, *args)

    def _drop_client(self, client: KVStoreClient) -> None:
        held = getattr(self._local, "clients", None) or {}
        for name, (_, mine) in list(held.items()):
            if mine is client:
                del held[name]
        with self._lock:
            if client in self._clients:
                self._clients.remove(client)
        try:
            client.close()
        except Exception:
            logger.debug("closing a kvstore client failed", exc_info=True)

    def _close_clients(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        self._local = threading.local()
        for client in clients:
            try:
                client.close()
            except Exception:
                logger.debug("closing a kvstore client failed", exc_info=True)

    # ------------------------------------------------------------------ keys
    def _keys(self, keys: Sequence[object]) -> list[bytes]:
        """The kvstore keys of the leading run of well-formed, distinct SGLang keys."""
        out: list[bytes] = []
        seen: set[bytes] = set()
        for key in keys:
            k = page_key(key)
            if k is None:
                self._warn(
                    "key", "kvstore HiCache backend: key %r is not 64 hex digits: a miss", key
                )
                break
            if k in seen:
                break
            seen.add(k)
            out.append(k)
        return out

    # ------------------------------------------------------------------ existence
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages are stored (in any tier of the daemon)."""
        kv = self._keys(keys)
        if not kv:
            return 0
        return int(self._with_client("lookup", lambda c: c.lookup(kv), 0))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ zero-copy (v1)
    def _host_pages(
        self, keys: Sequence[object], host_indices: Any, page_size: int
    ) -> list[int] | None:
        """The host index of each key's page, or None (with a warning) if the indices do not
        hold one page of ``page_size`` per key."""
        starts = page_starts(host_indices, len(keys), page_size)
        if starts is None:
            self._warn(
                "indices",
                "kvstore HiCache backend: %s host indices for %d pages of %d slots",
                getattr(host_indices, "numel", lambda: "no")(),
                len(keys),
                page_size,
            )
        return starts

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store page i (at ``host_indices[i * page_size]``) under ``keys[i]``, copied straight
        from the host pool into the daemon's shared memory. Per page: stored (or already
        there)."""
        return self.move_pages("write", None, keys, host_indices)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Fill page i (at ``host_indices[i * page_size]``) from ``keys[i]``, copied straight
        from the daemon's shared memory into the host pool. Per page: loaded intact. Only the
        target pages are written; a page after the first miss may hold partial bytes and is
        reported False."""
        return self.move_pages("read", None, keys, host_indices)

    def move_pages(
        self, what: str, space: Space | None, keys: list[str], host_indices: Any
    ) -> list[bool]:
        """Write (``what="write"``) or read (``"read"``) the pages of ``keys`` at
        ``host_indices`` in ``space`` (default: the KV pool's), one copy each way, in batches
        of at most ``MAX_BATCH_BYTES`` that go on while each moves all of its pages. Per page:
        moved. The v1 calls, and the v2 calls of every side pool."""
        space = space or self.kv_space
        results = [False] * len(keys)
        if space is None:
            self._warn("nopool", "kvstore HiCache backend has no host pool it can read: misses")
            return results
        fmt = space.fmt
        starts = self._host_pages(keys, host_indices, fmt.page_size)
        if starts is None or not keys:
            return results
        kv = self._keys(keys)
        began = time.perf_counter()
        side = "side_" if space.name else ""

        def run(client: KVStoreClient) -> int:
            done = 0
            for lo, hi in batch_bounds(len(kv), fmt.page_bytes):
                if what == "write":
                    w = write_pages(client, space.pages, kv[lo:hi], starts[lo:hi])
                    self.stats.add(
                        **{
                            f"{side}pages_written": w.committed,
                            f"{side}pages_present": w.present,
                            f"{side}bytes_written": w.committed * fmt.page_bytes,
                        }
                    )
                    done += w.stored
                else:
                    done += read_pages(client, space.pages, kv[lo:hi], starts[lo:hi])
                if done < hi:
                    break
            return done

        done = self._with_client(what, run, 0, space)
        results[:done] = [True] * done
        if what == "write":
            self._note_write(done, len(keys), began, space)
        else:
            self._note_read(done, len(keys), began, space)
        return results

    # ------------------------------------------------------------------ side pools (v2)
    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> Any:
        """The usable prefix of ``keys`` for the KV pool and every side pool of
        ``pool_transfers``, by each pool's hit policy: a ``PoolTransferResult``
        (``kvstore.integrations.sglang_side_pools``)."""
        return self.side.exists(keys, pool_transfers)

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Fill each transfer's host pages of its pool from its keys, one copy each way; per
        pool, per page: loaded intact (a leading run)."""
        return self.side.move("read", transfers)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Store each transfer's host pages of its pool under its keys, in the pool's own
        namespace; per pool, per page: stored (or already there)."""
        return self.side.move("write", transfers)

    # ------------------------------------------------------------------ flat pages
    def _rows_of(self, tensor: Any) -> torch.Tensor | None:
        """``tensor`` (one flat page) as one raw block ``[1, *block_shape]``, or None (with a
        warning) if it is not a contiguous CPU tensor of one page's bytes."""
        fmt = self.fmt
        if fmt is None or not isinstance(tensor, torch.Tensor):
            return None
        if (
            tensor.device.type != "cpu"
            or not tensor.is_contiguous()
            or tensor.numel() * tensor.element_size() != fmt.page_bytes
        ):
            self._warn(
                "size",
                "kvstore HiCache backend: a page of %s bytes (expected %d): a miss",
                tensor.numel() * tensor.element_size(),
                fmt.page_bytes,
            )
            return None
        return tensor.view(-1).view(torch.uint8).view(1, *fmt.layout.block_shape)

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """Fill ``target_location`` (a flat page, e.g. ``get_dummy_flat_data_page()``) with
        the page of ``key``; it, or None on a miss."""
        got = self.batch_get([key], [target_location])
        return got[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        results: list[torch.Tensor | None] = [None] * len(keys)
        targets = list(target_locations or [])
        kv = self._keys(keys)
        rows = []
        for k, target in zip(kv, targets, strict=False):
            row = self._rows_of(target)
            if row is None:
                break
            rows.append((k, target, row))
        if not rows:
            return results
        began = time.perf_counter()

        def read(client: KVStoreClient) -> int:
            got = 0
            for k, _, row in rows:
                if client.get([k], out=row).shape[0] != 1:
                    break
                got += 1
            return got

        done = self._with_client("read", read, 0)
        for i in range(done):
            results[i] = rows[i][1]
        self._note_read(done, len(keys), began)
        return results

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store ``value`` (one flat page, as ``get_data_page(index, flat=True)`` gives)."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store ``values[i]`` (flat pages) under ``keys[i]``; True if every one is stored."""
        values = list(values or [])
        if not keys or len(values) != len(keys):
            return False
        kv = self._keys(keys)
        rows = [self._rows_of(v) for v in values[: len(kv)]]
        good = [r for r in rows if r is not None]
        if len(kv) != len(keys) or len(good) != len(keys):
            return False
        fmt = self.fmt
        assert fmt is not None
        began = time.perf_counter()

        def write(client: KVStoreClient) -> int:
            stored = client.put(kv, torch.cat(good), priority=self.options.priority)
            self.stats.add(
                pages_written=int(stored),
                pages_present=len(kv) - int(stored),
                bytes_written=int(stored) * fmt.page_bytes,
            )
            return len(kv)

        done = self._with_client("write", write, 0)
        self._note_write(done, len(keys), began)
        return done == len(keys)

    # ------------------------------------------------------------------ housekeeping
    def _note_read(self, done: int, asked: int, began: float, space: Space | None = None) -> None:
        """Count a read; SGLang's metrics count the KV pool's pages (not side pools')."""
        fmt = space.fmt if space is not None else self.fmt
        nbytes = done * (fmt.page_bytes if fmt else 0)
        if space is not None and space.name:
            self.stats.add(side_hits=done, side_misses=asked - done, side_bytes_read=nbytes)
            return
        self.stats.add(hits=done, misses=asked - done, bytes_read=nbytes)
        if self.enable_metrics and done:
            with self.stats.lock:
                self.stats.prefetch_pgs.append(done)
                elapsed = max(time.perf_counter() - began, 1e-9)
                self.stats.prefetch_bandwidth.append(nbytes / elapsed / 1e9)

    def _note_write(self, done: int, asked: int, began: float, space: Space | None = None) -> None:
        fmt = space.fmt if space is not None else self.fmt
        if space is not None and space.name:
            self.stats.add(side_write_failures=asked - done)
            return
        self.stats.add(write_failures=asked - done)
        if self.enable_metrics and done:
            with self.stats.lock:
                self.stats.backup_pgs.append(done)
                elapsed = max(time.perf_counter() - began, 1e-9)
                nbytes = done * (fmt.page_bytes if fmt else 0)
                self.stats.backup_bandwidth.append(nbytes / elapsed / 1e9)

    def counters(self) -> dict[str, int]:
        """Totals since start: pages hit and missed by reads, bytes read and written, pages
        written (new) and found present, pages a write did not store, failed calls; the
        ``side_`` ones count the pages of side pools (the v2 calls)."""
        with self.stats.lock:
            return dict(self.stats.totals)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s per prefetch and backup call since the
        last call), as its metrics collector expects; None when metrics are off."""
        if not self.enable_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        s = self.stats
        with s.lock:
            metrics.prefetch_pgs.extend(s.prefetch_pgs)
            metrics.backup_pgs.extend(s.backup_pgs)
            metrics.prefetch_bandwidth.extend(s.prefetch_bandwidth)
            metrics.backup_bandwidth.extend(s.backup_bandwidth)
            s.prefetch_pgs.clear()
            s.backup_pgs.clear()
            s.prefetch_bandwidth.clear()
            s.backup_bandwidth.clear()
        return metrics

    def delete(self, keys: list[str]) -> int:
        """Delete the pages of ``keys`` from every tier; how many were there."""
        kv = [k for k in (page_key(key) for key in keys) if k is not None]
        if not kv:
            return 0
        return int(self._with_client("delete", lambda c: c.delete(list(dict.fromkeys(kv))), 0))

    def clear(self) -> None:
        """Delete every page of this backend's namespaces from the daemon (SGLang's "clear
        storage"): the KV pool's and every side pool's, whoever stored them, pages of earlier
        SGLang processes too. Copies in the daemon's shared Redis tier stay until they
        expire."""
        self._with_client("clear", lambda client: client.clear(), 0)
        self.side.clear()

    def close(self) -> None:
        self._closed = True
        self._close_clients()
