"""A rolling median of the analyzer's recent values (see `ampwatch._diagnose`)."""

from __future__ import annotations

import bisect
from collections import deque


class RollingMedian:
    """Rolling median over the last `size` finite values, kept sorted (O(log n) search, O(n) insert)."""

    def __init__(self, size: int) -> None:
        self._order: deque[float] = deque()
        self._sorted: list[float] = []
        self._size = size

    def __len__(self) -> int:
        return len(self._order)

    def add(self, value: float) -> None:
        if len(self._order) == self._size:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._order.append(value)
        bisect.insort(self._sorted, value)

    def value(self) -> float:
        return self._sorted[len(self._sorted) // 2]

    def lower(self) -> float:
        """The lower median (of an even count, the lower middle value): the warm-up's cautious baseline."""
        return self._sorted[(len(self._sorted) - 1) // 2]

    def extend(self, values: list[float]) -> None:
        """Add many values at once (rebuilding the sorted copy is cheaper than inserting them one by one)."""
        order = self._order
        order.extend(values)
        for _ in range(len(order) - self._size):
            order.popleft()
        self._sorted = sorted(order)

    def stays_below(self, values: list[float], factor: float) -> bool:
        """Whether each of `values`, added in order, is below `factor` times the median it is compared with.

        Conservative, without replaying: every window these values meet is a subset of the current window plus
        `values`, at least as large as the current one, so its median is at least the element at the current
        median's rank in that union. Below `factor` times that bound (and the bound positive) means no spike."""
        pooled = sorted(self._sorted + values)
        bound = pooled[len(self._order) // 2]
        return bound > 0 and max(values) < factor * bound

    def quantile(self, q: float) -> float:
        values = self._sorted
        return values[min(len(values) - 1, int(q * len(values)))]

    def spread(self) -> float:
        """The interquartile range: how far the values usually stray, whatever their sign."""
        values = self._sorted
        return values[(3 * len(values)) // 4] - values[len(values) // 4]
