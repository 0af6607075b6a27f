"""A lazily opened kvstore client that steps aside for a while after any failure."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from kvstore.client.sync import KVStoreClient
from kvstore.errors import KVStoreError, PermissionDeniedError
from kvstore.integrations.vllm.identity import StoreIdentity
from kvstore.integrations.vllm.options import ConnectorConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

REFUSED_RETRY_S = 300.0
"""A namespace the daemon refused to open (the policy does not let this engine's caller read
that tenant) is left alone this long: a policy changes only with a daemon restart."""


class _Store:
    """A lazily opened client that steps aside for ``retry_after_s`` after any failure: the
    daemon being down must cost a request nothing but the first deadline. Not thread-safe:
    one per thread (as the client itself)."""

    def __init__(self, ident: StoreIdentity, cfg: ConnectorConfig, timeout_s: float) -> None:
        self.ident = ident
        self.cfg = cfg
        self.timeout_s = timeout_s
        self.token = cfg.token_of(ident.tenant)
        self._client: KVStoreClient | None = None
        self._down_until = 0.0
        self._warned = False
        self.reused = False
        self.refused = False
        """The daemon refused to open this tenant's namespace (``PermissionDeniedError``): a
        configuration error, logged once, and the store left alone for ``REFUSED_RETRY_S``."""

    def client(self) -> KVStoreClient | None:
        """The client, or None while the store is left alone after a failure. ``reused`` says
        whether it was opened before this call: a failure on a reused client earns one retry on
        a new one (a restarted daemon leaves the old channel in reconnect backoff)."""
        self.reused = self._client is not None
        if self._client is not None:
            return self._client
        if time.monotonic() < self._down_until:
            return None
        try:
            self._client = self.new_client()
        except PermissionDeniedError as exc:
            if not self.refused:
                logger.error(
                    "kvstore refused to open tenant %r's namespace for this engine (%s): lookups "
                    "there are misses; the daemon's policy must let the engine's caller read it "
                    "(for a shared tenant, name the caller's tenant in [shared.%s] readers)",
                    self.ident.tenant,
                    exc,
                    self.ident.tenant,
                )
            self.refused = True
            self._down_until = time.monotonic() + max(REFUSED_RETRY_S, self.cfg.retry_after_s)
            return None
        except (KVStoreError, OSError) as exc:
            self.failed("connect", exc)
            return None
        self.refused = False
        if self._warned:
            logger.info("kvstore reachable again at %s", self._client.address)
            self._warned = False
        return self._client

    def new_client(self) -> KVStoreClient:
        """A new client of this store's namespace (one per thread: ``client`` is this
        thread's)."""
        ident = self.ident
        return KVStoreClient(
            self.cfg.address,
            layout=ident.layout,
            model=ident.model,
            revision=ident.revision,
            tenant=ident.tenant,
            tp_rank=ident.tp_rank,
            tp_size=ident.tp_size,
            timeout_s=self.timeout_s,
            token=self.token,
        )

    def with_client(
        self,
        what: str,
        call: Callable[[KVStoreClient], T],
        on_failure: Callable[[], None] | None = None,
    ) -> T | None:
        """``call(client)``'s result, or None if the store is left alone or ``call`` failed.
        A failure on a reused client is retried once on a new one (a restarted daemon leaves
        the old channel in reconnect backoff): ``call`` must resume from what it already did.
        Any other failure calls ``on_failure`` and leaves the store alone for a while."""
        for attempt in range(2):
            client = self.client()
            if client is None:
                return None
            try:
                return call(client)
            except KVStoreError as exc:
                if self.reused and attempt == 0:
                    self.close()
                    continue
                if on_failure is not None:
                    on_failure()
                self.failed(what, exc)
        return None

    def failed(self, what: str, exc: BaseException) -> None:
        # Warn once per outage, not once per request.
        if not self._warned:
            logger.warning("kvstore %s failed, computing without the store: %s", what, exc)
            self._warned = True
        self._down_until = time.monotonic() + self.cfg.retry_after_s
        self.close()

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                logger.debug("closing the kvstore client failed", exc_info=True)


class _Stores:
    """One ``_Store`` per tenant the engine's requests use (the engine's own, and those its
    ``salt_tenants`` map salts to): each tenant's blocks live in that tenant's namespace,
    opened with that tenant's credential. Not thread-safe, like ``_Store``."""

    def __init__(self, ident: StoreIdentity, cfg: ConnectorConfig, timeout_s: float) -> None:
        self.ident = ident
        self.cfg = cfg
        self.timeout_s = timeout_s
        self._stores: dict[str, _Store] = {}

    def of(self, tenant: str | None) -> _Store:
        """The store of ``tenant`` (None: the engine's own tenant)."""
        name = self.cfg.tenant if tenant is None else tenant
        store = self._stores.get(name)
        if store is None:
            ident = dataclasses.replace(self.ident, tenant=name)
            store = _Store(ident, self.cfg, self.timeout_s)
            self._stores[name] = store
        return store

    def close(self) -> None:
        for store in self._stores.values():
            store.close()
