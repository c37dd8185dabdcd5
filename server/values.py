"""Exact non-finite values: the database stores NaN as NULL, JSON carries them as strings."""

from __future__ import annotations

import math
from collections.abc import Iterable

_SPELLING = {math.inf: "Infinity", -math.inf: "-Infinity"}


def to_db(value: float) -> float | None:
    """NaN becomes NULL (what SQLite would do anyway, now on purpose and on every database)."""
    return None if math.isnan(value) else value


def to_json(values: Iterable[float | None]) -> list[float | str]:
    """Database values as JSON-safe items: 'NaN', 'Infinity', '-Infinity' for non-finite ones."""
    return [v if v is not None and math.isfinite(v) else _spell(v) for v in values]


def _spell(value: float | None) -> str:
    return "NaN" if value is None or math.isnan(value) else _SPELLING[value]


def downsample(steps: list[int], values: list[float | None], max_points: int) -> tuple[list[int], list[float | None]]:
    """At most `max_points` finite points: per bucket the min and the max (spikes survive),
    plus the first and last point and every non-finite point (never dropped, never merged)."""
    n = len(steps)
    if n <= max_points:
        return steps, values
    keep = {0, n - 1}
    buckets = max(1, (max_points - 2) // 2)
    size = n / buckets
    for b in range(buckets):
        lo, hi = int(b * size), min(n, int((b + 1) * size))
        lo_i = hi_i = -1
        for i in range(lo, hi):
            v = values[i]
            if v is None or not math.isfinite(v):
                keep.add(i)
                continue
            # (the index is one this loop kept: a finite value, never None)
            if lo_i < 0 or v < values[lo_i]:  # type: ignore[operator]
                lo_i = i
            # (the index is one this loop kept: a finite value, never None)
            if hi_i < 0 or v > values[hi_i]:  # type: ignore[operator]
                hi_i = i
        keep.update(i for i in (lo_i, hi_i) if i >= 0)
    order = sorted(keep)
    return [steps[i] for i in order], [values[i] for i in order]


def to_json_cells(cells: Iterable[float | None]) -> list[float | str | None]:
    """Grid cells as JSON items: None (no point there) stays null, NaN and ±Infinity are spelled out."""
    return [None if c is None else c if math.isfinite(c) else _spell(c) for c in cells]
