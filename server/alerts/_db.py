"""Small shared helpers: the clock, dialect-aware INSERT, severities, step formatting."""

from __future__ import annotations

import math

from ampwatch.server.db import insert, now, utc  # noqa: F401  (this package's helpers, re-exported)

SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}
ACTIVE = ("pending", "firing")
WAKE = "ampwatch.alerts.wake"  # session.info flag: deliveries were queued, wake the dispatcher after commit


def steps(value: int | None) -> str:
    """A step as people read it: 12 340."""
    return "?" if value is None else f"{value:,}".replace(",", " ")


def pow2(value: float | None) -> str:
    """A loss scale as people read it: 2^16, or the number when it is not a power of two."""
    if value is None or not math.isfinite(value):
        return "?"
    if value > 0 and math.log2(value).is_integer():
        return f"2^{int(math.log2(value))}"
    return f"{value:g}"


def at_least(severity: str, floor: str) -> bool:
    """Whether `severity` is `floor` or worse."""
    return SEVERITY_RANK.get(severity, 0) >= SEVERITY_RANK.get(floor, 0)
