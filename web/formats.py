"""How the dashboard writes numbers and times; static/runs.js writes live updates the same way."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from typing import Any

_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


NONFINITE = {"NaN": "NaN", "Infinity": "+Inf", "-Infinity": "-Inf"}  # values as the API spells them -> as shown


def scale(value: float | str | None) -> str:
    """A loss scale: powers of two as 2¹⁶, anything else with three significant digits, a non-finite one as the
    charts write it; '–' when unknown."""
    if value is None:
        return "–"
    if isinstance(value, str):
        return NONFINITE.get(value, value)
    if value > 0 and math.isfinite(value) and math.log2(value).is_integer():
        return "2" + str(int(math.log2(value))).translate(_SUPERSCRIPT)
    return f"{value:.3g}"


def rate(value: float | None) -> str:
    """A share as a percentage with one decimal; '–' when unknown."""
    return "–" if value is None else f"{value * 100:.1f} %"


def stamp(value: datetime) -> str:
    """A UTC date and time, to the second."""
    return _utc(value).strftime("%Y-%m-%d %H:%M:%S")


def clock(value: datetime) -> str:
    """A UTC time of day, to the second."""
    return _utc(value).strftime("%H:%M:%S")


def plain(value: Any) -> str:
    """A config or environment value as people read it: strings as they are, anything else as compact JSON
    (escaped by the template like any text, so no `\\u003c` noise)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def runtime(environment: dict[str, Any], config: dict[str, Any]) -> list[tuple[str, str]]:
    """The facts a reader looks for first (torch, device, dtype, world size): from the run's environment,
    the dtype from its config when the environment does not say."""
    cuda = environment.get("cuda")
    device = environment.get("device") or ("CUDA" if cuda else "CPU" if cuda is False else None)
    facts = [
        ("torch", environment.get("torch")),
        ("device", device),
        ("dtype", environment.get("dtype") or environment.get("autocast_dtype") or config.get("dtype")),
        ("world size", environment.get("world_size")),
        ("python", environment.get("python")),
        ("host", environment.get("host")),
    ]
    return [(k, "–" if v is None else str(v)) for k, v in facts]
