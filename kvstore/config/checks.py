"""A check the config dataclasses share."""

from __future__ import annotations

import math


def check_finite(where: str, value: float) -> None:
    """NaN passes every ``<= 0`` check and an infinite duration stops a timer (or overflows
    one): a duration or share must be a finite number."""
    if not math.isfinite(value):
        raise ValueError(f"{where}: must be a finite number (got {value!r})")
