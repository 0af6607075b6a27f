"""``RecordReader``: the NVMe tier's read path (``NvmeTier.read_into_checked``,
``read_payload_into``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvstore.ratelog import RateLimitedLog
from kvstore.tiers.nvme.ondisk import PAGE, round_up
from kvstore.tiers.nvme.recordio import RecordIO
from kvstore.tiers.nvme.records import LIVE, Ident, RecordTable

log = logging.getLogger(__name__)
_io_log = RateLimitedLog(log)  # a failing disk fails every read

MISS_COUNTER = {
    "torn": "checksum_failures",
    "corrupt": "checksum_failures",
    "mismatch": "header_mismatches",
    "short": "short_reads",
    "io_error": "io_errors",
}
"""The counter a miss of each reason (``RecordIO``'s) counts in, besides ``misses``."""

T = TypeVar("T")


class RecordReader:
    """The tier's reads: whether a slot holds the block asked for (the record table says,
    before any IO), the read itself on the tier's read threads (``RecordIO`` verifies it there),
    and the count of reads, bytes read and misses by reason.

    Owns no state: the record tables (``record_table``: a slot's table and index, ValueError
    for a slot of no carved slab), the read pool and the counters are the tier's, and each read
    is given the open file's ``RecordIO``. Loop-only; the IO runs on ``pool``.
    """

    def __init__(
        self,
        record_table: Callable[[int], tuple[RecordTable, int]],
        pool: ThreadPoolExecutor,
        counters: dict[str, int],
    ) -> None:
        self._record_table = record_table
        self._pool = pool
        self._counters = counters

    async def read_into_checked(
        self, io: RecordIO, slot: int, key: bytes, namespace: bytes, checksum: int, out: Any
    ) -> int | None:
        """See ``NvmeTier.read_into_checked``."""
        table, i = self._committed(slot)
        view = memoryview(out).cast("B")
        if view.readonly:
            raise TypeError("out must be a writable buffer")
        c = self._counters
        want = self._asked(table, i, key, namespace, checksum, view.nbytes)
        if want is None:
            return None
        try:
            reason = await self._run(io.read_record, slot, want, view)
        except OSError as exc:
            _io_log.warning("read", f"read of slot {slot} failed: {exc}")
            reason = "io_error"
        if reason is None:
            c["read_bytes"] += PAGE + round_up(want.stored_length)
            return want.checksum
        c["misses"] += 1
        c[MISS_COUNTER[reason]] += 1
        return None

    async def read_payload_into(
        self, io: RecordIO, slot: int, key: bytes, namespace: bytes, checksum: int, out: Any
    ) -> tuple[int, int] | None:
        """See ``NvmeTier.read_payload_into``."""
        table, i = self._committed(slot)
        view = memoryview(out).cast("B")
        c = self._counters
        want = self._asked(table, i, key, namespace, checksum, None)
        if want is None:
            return None
        try:
            got = await self._run(io.read_payload, slot, want, view)
        except OSError as exc:
            _io_log.warning("read", f"read of slot {slot} failed: {exc}")
            got = "io_error"
        if isinstance(got, str):
            c["misses"] += 1
            c[MISS_COUNTER[got]] += 1
            return None
        c["read_bytes"] += PAGE + round_up(want.stored_length)
        return want.checksum, got

    def codec_of(self, slot: int) -> int | None:
        """The codec id of the committed record in ``slot``; None when it holds none."""
        try:
            table, i = self._record_table(slot)
        except ValueError:
            return None
        return table.ident(i).codec if table.state[i] == LIVE else None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _committed(self, slot: int) -> tuple[Any, int]:
        """(record table, index) of the committed record in ``slot``; ValueError if none."""
        try:
            table, i = self._record_table(slot)
        except ValueError:
            table, i = None, -1
        if table is None or table.state[i] != LIVE:
            raise ValueError(f"read of slot {slot}, which holds no committed record")
        return table, i

    def _asked(
        self,
        table: Any,
        i: int,
        key: bytes,
        namespace: bytes,
        checksum: int,
        length: int | None,
    ) -> Ident | None:
        """A read counted, and the record's identity (a snapshot: the slot may be freed while
        the IO runs) when it is the block asked for (key, namespace, ``length`` unless None,
        committed or record checksum); None, a header mismatch counted as a miss, if not."""
        c = self._counters
        c["reads"] += 1
        want = table.ident(i)
        if (
            (key, namespace) != (want.key, want.namespace)
            or (length is not None and length != want.length)
            or checksum not in (want.checksum, table.committed[i])
        ):
            c["misses"] += 1
            c["header_mismatches"] += 1
            return None
        return want
