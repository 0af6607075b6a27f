"""The write-back picker every tier pair shares: which blocks to copy down next.

A tier with a tier below keeps at least ``1 - high_watermark`` of its capacity free or clean
(a clean block has a copy below, so evicting it is only dropping it), writing its coldest dirty
blocks down in the background; a tier below that writes through wants every new block at once.
The GPU pool over the CPU tier and the CPU tier over the NVMe tier both pick the same way:

1. the eager queue first (blocks committed while a tier below writes through), in order, each
   once and only while it still needs the write;
2. then, if the tier is past its watermark, its coldest dirty blocks until the bytes they
   would clean bring it back under it.

A batch is at most ``limit`` blocks. The tiers say what "dirty", "in flight" and "bytes" mean
for them; the picker holds no state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable


def bytes_to_clean(capacity: int, free_or_clean: int, high_watermark: float) -> float:
    """How many bytes must be made clean to keep ``1 - high_watermark`` of ``capacity`` free or
    clean (0 or less: none)."""
    return (1.0 - high_watermark) * capacity - free_or_clean


def pick_writeback(
    *,
    eager: deque[int],
    needs_write: Callable[[int], bool],
    limit: int,
    eager_only: bool = False,
    wanted: Callable[[], float] = lambda: 0.0,
    coldest: Callable[[], Iterable[int]] = tuple,
    bytes_of: Callable[[int], int] = lambda eid: 0,
) -> list[int]:
    """The next batch to write down (see the module docstring).

    ``eager``: blocks to write at once, consumed; ``needs_write(eid)``: still dirty, committed,
    and no write of it in flight; ``eager_only``: the tier below writes through, so nothing
    else is picked; ``wanted()``: the bytes to make clean (``bytes_to_clean``), asked only when
    the eager queue gave nothing; ``coldest()``: the tier's blocks, coldest first;
    ``bytes_of(eid)``: what making ``eid`` clean frees."""
    batch: list[int] = []
    seen: set[int] = set()
    while eager and len(batch) < limit:
        eid = eager.popleft()
        if eid not in seen and needs_write(eid):
            batch.append(eid)
            seen.add(eid)
    if batch or eager_only:
        return batch
    want = wanted()
    if want <= 0:
        return batch
    for eid in coldest():
        if needs_write(eid):
            batch.append(eid)
            want -= bytes_of(eid)
            if want <= 0 or len(batch) >= limit:
                break
    return batch
