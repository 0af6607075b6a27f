"""Block checksums: xxh3-64 of the block's bytes. Every tier stores it; every move verifies it."""

from __future__ import annotations

from typing import Any

import xxhash


def block_checksum(data: Any) -> int:
    """``data``: any object exposing a contiguous buffer (bytes, memoryview, numpy array)."""
    return xxhash.xxh3_64_intdigest(data)
