"""kvstore: a multi-tier KV-cache store for LLM inference.

The faces (``KVStoreClient``, ``AsyncKVStoreClient``, ``PagedKVCache``) load on first use, so
the daemon, which imports ``kvstore.*`` modules, never pulls in the client or the paged cache
(the layer rule: the daemon and the client share only the protocol and the core types).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.keys import BlockKey, Namespace, block_hashes
from kvstore.layout import KVLayout
from kvstore.version import __version__

if TYPE_CHECKING:
    from kvstore.client import AsyncKVStoreClient, KVStoreClient
    from kvstore.paged import PagedKVCache

__all__ = [
    "AsyncKVStoreClient",
    "BlockKey",
    "KVLayout",
    "KVStoreClient",
    "Namespace",
    "PagedKVCache",
    "__version__",
    "block_hashes",
]

_LAZY = {
    "AsyncKVStoreClient": "kvstore.client",
    "KVStoreClient": "kvstore.client",
    "PagedKVCache": "kvstore.paged",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
