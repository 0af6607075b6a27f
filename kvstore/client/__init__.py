"""The client library: ``KVStoreClient`` (blocking) and ``AsyncKVStoreClient`` (asyncio)."""

from kvstore.client.aio import AsyncKVStoreClient
from kvstore.client.leases import AsyncReadLease, AsyncWriteReservation, ReadLease, WriteReservation
from kvstore.client.sync import KVStoreClient

__all__ = [
    "AsyncKVStoreClient",
    "AsyncReadLease",
    "AsyncWriteReservation",
    "KVStoreClient",
    "ReadLease",
    "WriteReservation",
]
