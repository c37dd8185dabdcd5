"""The leading indicators on the sender's side: an INDICATORS record's tensors, read with the step's others, turned
into per-layer series (`fp16_range/`, `update_ratio/`, `adam_lag/<module>`). What each value is and how the training
thread reduces it: `ampwatch._indicators`."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from ampwatch._leading import FP16_MAX, LAG, RANGE, UPDATE
from ampwatch._protocol import MAX_NAME
from ampwatch._steps import Points, _series


def indicator_tensors(record: tuple, out: list[Any]) -> None:
    """Append an INDICATORS record's tensors to `out`, in the order `decode` consumes them."""
    for part in record[2]:
        out += part[2]


def decode(record: tuple, host: list[Any], at: int, points: Points) -> int:
    """Append an INDICATORS record's per-layer series to `points` from the host values at `host[at]` on; return where
    the next record's values start."""
    step = record[1]
    for prefix, names, _, count, extra in record[2]:
        values = host[at : at + count]
        at += count
        layers = _DECODERS[prefix](names, values, extra)
        for layer, value in layers.items():
            series = _series(points, layer_series(prefix, layer))
            series[0].append(step)
            series[1].append(value)
    return at


def _ranges(names: list[str], values: list[float], extra: Any) -> dict[str, float]:
    largest: dict[str, float] = {}
    for name, value in zip(names, values):
        value = float(value)
        held = largest.get(name)
        largest[name] = value if held is None or not value <= held else held  # (NaN wins: it is what went wrong)
    return {name: value / FP16_MAX for name, value in largest.items()}


def _updates(names: list[str], values: list[float], extra: Any) -> dict[str, float]:
    n = len(names)
    sums: dict[str, list[float]] = {}
    for name, delta, weight in zip(names, values[:n], values[n:]):
        held = sums.setdefault(name, [0.0, 0.0])
        held[0] += float(delta) ** 2
        held[1] += float(weight) ** 2
    return {name: math.sqrt(d) / math.sqrt(w) for name, (d, w) in sums.items() if w > 0}


def _lags(names: list[str], values: list[float], extra: Any) -> dict[str, float]:
    """Per layer, the interval's lag (`_interval_lag`) of the sum of its exp_avg_sq, or of one of its weights' columns
    that was silent (see `_column_growth`), the larger."""
    betas, counts, sliced = extra
    n, k = len(names), len(sliced)
    read = iter(values[2 * n + k :])
    steps = [float(next(read)) if c is None else c for c in counts]
    columns = dict(zip(sliced, values[2 * n : 2 * n + k]))
    sums: dict[str, list[float]] = {}
    for i, (name, now, then, (beta2, at_now, at_then)) in enumerate(zip(names, values[:n], values[n : 2 * n], betas)):
        held = sums.setdefault(name, [0.0, 0.0, beta2, steps[at_then], steps[at_now], 0.0])
        held[0] += float(now)
        held[1] += float(then)
        if i in columns:
            held[5] = max(held[5], _interval_lag(float(columns[i]), beta2, steps[at_then], steps[at_now]))
    lags: dict[str, float] = {}
    for name, (now, then, beta2, step_then, step_now, column) in sums.items():
        if step_now <= step_then or not 0.0 < beta2 < 1.0:  # (no step in between: nothing to tell)
            continue
        growth = now / then if then > 0 else math.inf if now > 0 else 0.0
        lags[name] = max(_interval_lag(growth, beta2, step_then, step_now), column)
    return lags


def _interval_lag(growth: float, beta2: float, then: float, now: float) -> float:
    """How far Adam's squared gradients ran ahead of the bias-corrected second moment they are divided by, on average
    over steps `then` + 1 … `now`, from how much the moment grew over them (`growth`: its sum after step `now` over
    that after step `then`). A step j with lag L multiplies the bias-corrected moment by
    (beta2 - beta2^j + (1 - beta2) L) / (1 - beta2^j); solved for L at the interval's geometric mean growth, with j
    its middle step. 1 for gradients of a steady size, ~1 + r / (1 - beta2) for squares that grow by r a step."""
    if growth != growth or growth == math.inf:
        return growth
    per_step = (growth * (1.0 - beta2**then) / (1.0 - beta2**now)) ** (1.0 / (now - then))
    middle = beta2 ** ((then + now + 1.0) / 2.0)
    return max(0.0, (per_step * (1.0 - middle) - beta2 + middle) / (1.0 - beta2))


_DECODERS: dict[str, Callable[[list[str], list[float], Any], dict[str, float]]] = {
    RANGE: _ranges,
    UPDATE: _updates,
    LAG: _lags,
}


@functools.lru_cache(maxsize=4096)
def layer_series(prefix: str, module: str) -> str:
    """`<prefix>/<module>`; past the server's limit on names, its end after a `…` (as `grad_norm/` series are)."""
    name = f"{prefix}/{module}"
    return name if len(name) <= MAX_NAME else f"{prefix}/…" + module[len(name) - MAX_NAME + 1 :]
