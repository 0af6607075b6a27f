"""Block checksums, bound to the block's namespace and key.

A block's checksum is the xxh3-64 of its bytes, seeded by its namespace fingerprint and key:
``block_checksum(data, namespace, key)``. Every tier stores it; every move and every read
verifies it against the key and namespace the bytes are served for. Because the seed binds both,
a block's bytes served under another key (a reused slot, a recycled entry id, a record of
another namespace) never match the checksum the reader expects, even when the bytes themselves
are intact: there is no way to compute an unbound checksum, so no path can forget the binding.

Device checksums (``kvstore.kernels.device_checksums``, computed on the GPU, where the kernels
know nothing of keys) are bound the same way by ``bind_device_checksum``.
"""

from __future__ import annotations

from typing import Any

import xxhash


def checksum_seed(namespace: bytes, key: bytes) -> int:
    """The 64-bit seed of a block's checksum: namespace fingerprint (16 bytes) and key."""
    return xxhash.xxh3_64_intdigest(bytes(namespace) + bytes(key))


def block_checksum(data: Any, namespace: bytes, key: bytes) -> int:
    """xxh3-64 of ``data`` (any object exposing a contiguous buffer) seeded by
    ``checksum_seed(namespace, key)``. Seeding costs nothing per byte: the speed is xxh3's."""
    return xxhash.xxh3_64_intdigest(data, seed=checksum_seed(namespace, key))


def seeded_checksum(data: Any, seed: int) -> int:
    """``block_checksum`` with the seed computed once (hot loops over one key's chunks)."""
    return xxhash.xxh3_64_intdigest(data, seed=seed)


def bind_device_checksum(raw: int, namespace: bytes, key: bytes) -> int:
    """A device checksum (order-free sum over the block's words) bound to namespace and key."""
    return raw ^ checksum_seed(namespace, key)
