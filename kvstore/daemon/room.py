"""Making room in a tier: the victim-picking loop every tier with slots shares.

A tier asks for ``n`` slots of one size. While its allocator has too few free, the tier's
eviction policy names the coldest unprotected blocks and the tier's own ``evict`` gets rid of
them (writing down the ones that exist nowhere else first). What "protected" means and what
evicting does differ per tier (``movement.Mover.alloc_cpu``, ``device.DeviceTier.alloc``); the
loop, the partial mode and the error do not. The caller holds its tier's room lock.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvstore.errors import CapacityError
from kvstore.policy import EvictionPolicy


async def make_room(
    tier: str,
    block_bytes: int,
    n: int,
    *,
    partial: bool,
    free_slots: Callable[[int], int],
    take_slot: Callable[[int], int],
    policy: EvictionPolicy,
    protected: Callable[[int], bool],
    evict: Callable[[list[int]], Awaitable[None]],
    busy: str,
) -> list[int]:
    """``n`` slots (offsets from ``take_slot``), evicting as needed. All or nothing:
    CapacityError when not enough blocks can go (``busy`` says why the rest cannot), unless
    ``partial``, which returns as many slots as could be had."""
    while True:
        free = free_slots(block_bytes)
        short = n - free
        if short <= 0:
            return [take_slot(block_bytes) for _ in range(n)]
        victims = policy.evict(short, protected)
        if victims is None and partial:
            victims = policy.evict(1, protected)
        if victims is None:
            if partial:
                return [take_slot(block_bytes) for _ in range(free)]
            raise CapacityError(
                f"{tier} tier full: {n} slots of {block_bytes} bytes needed, {free} free "
                f"and fewer than {short} evictable (the rest are {busy})"
            )
        await evict(victims)  # may leave some in place; the next round picks again
