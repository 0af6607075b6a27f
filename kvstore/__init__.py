"""kvstore: a multi-tier KV-cache store for LLM inference."""

from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.keys import BlockKey, Namespace, block_hashes
from kvstore.layout import KVLayout
from kvstore.paged import PagedKVCache

__version__ = "0.1.0"

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
