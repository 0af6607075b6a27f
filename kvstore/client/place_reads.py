"""Reads with no call: copying blocks from the places a presence table gives
(``presence_link.PresenceLink.places``) into a caller's rows or paged caches, each block
verified against the checksum bound to its key as it is copied (always: nothing else vouches
for a place, which may have been reused since the table was read)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.client import paged_io
from kvstore.client._common import MappedArena, seeds_for
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace, unpack_keys
from kvstore.layout import KVLayout


def read_places(
    arena: MappedArena,
    namespace: Namespace,
    addresses: list[int],
    sums: list[int],
    packed: bytes,
    rows: torch.Tensor,
) -> int:
    """Copy the blocks at ``addresses`` into ``rows``; how many leading ones arrived intact
    (0 for a slab the daemon will not hand over: retired, so the caller calls)."""
    seeds = seeds_for(namespace, unpack_keys(packed))
    try:
        return arena.copy_out(addresses, sums, seeds, rows, verify=True)
    except KVStoreError:
        return 0


def scatter_places(
    arena: MappedArena,
    layout: KVLayout,
    namespace: Namespace,
    addresses: list[int],
    sums: list[int],
    packed: bytes,
    kv_caches: Sequence[torch.Tensor],
    ids: list[int],
) -> int:
    """``read_places`` into physical blocks ``ids`` of CPU caches."""
    nbytes = layout.block_bytes
    try:
        views = [
            arena.slot(a, nbytes).view(layout.dtype).view(layout.block_shape) for a in addresses
        ]
    except KVStoreError:
        return 0
    seeds = seeds_for(namespace, unpack_keys(packed))
    intact = paged_io.scatter_with_checksums(views, kv_caches, ids, sums, seeds)
    return intact or 0
