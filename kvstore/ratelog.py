"""Warnings that can come in floods (a full disk fails every write, a hostile client sends
undecodable bytes in a loop), logged at most once per interval per kind, each line saying how
many like it were skipped since the last one: the log stays readable and its disk stays free,
and the counters in ``kvstore stat`` carry the totals."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """At most one line per ``interval_s`` per kind; the lines skipped are counted in the next."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warning(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -1e9) < self.interval_s:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return
        skipped = self._skipped.pop(kind, 0)
        self._last[kind] = now
        more = f" ({skipped} more like it since the last line)" if skipped else ""
        self.logger.warning("%s%s", message, more)
