"""One optimizer step as the training thread leaves it, and its decoding on the sender thread.

The training thread keeps references, not results: the detached loss, GradScaler's own found_inf
tensors, the per-parameter gradient norms of one `_foreach_norm`. The sender thread copies them to
the host and does all the arithmetic: sums, total and per-layer norms, the unscaling, and the loss
scale, which it shadows from found_inf with GradScaler's own update rule, re-anchored from a copy of
the device scale every `ANCHOR_EVERY` steps and whenever something outside `update()` changed it.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Iterator

ANCHOR_EVERY = 256


class StepRecord:
    """What the training thread saw during one iteration (tensors are read later, on the sender)."""

    __slots__ = ("losses", "found", "groups", "anchor", "rule", "lr", "params")

    def __init__(self) -> None:
        self.losses: list[Any] = []  # detached tensors passed to scaler.scale()
        self.found: list[Any] = []  # GradScaler's found_inf tensors (empty without a scaler)
        self.groups: list[tuple[list[Any], bool, tuple[str, ...] | None]] = []  # (norms, scaled, modules)
        self.anchor: tuple[Any, Any] | None = None  # copies of the scale and growth tracker before update()
        self.rule: tuple[float, float, int] = (2.0, 0.5, 2000)  # growth, backoff, interval
        self.lr: float | None = None
        self.params: list[Any] | None = None  # per-parameter norms of the parameters (periodic check)

    def tensors(self) -> Iterator[Any]:
        """Every tensor, in the order `StepDecoder.decode` consumes them."""
        yield from self.losses
        yield from self.found
        for norms, _, _ in self.groups:
            yield from norms
        if self.anchor is not None:
            yield from self.anchor
        if self.params is not None:
            yield from self.params


def _f32(value: float) -> float:
    """Round to float32, as the device's `_amp_update_scale_` does."""
    return struct.unpack("f", struct.pack("f", value))[0] if math.isfinite(value) else value


class StepDecoder:
    """Host values for one run's steps, in order; holds the shadow of the loss scale."""

    def __init__(self) -> None:
        self._scale: float | None = None
        self._tracker = 0

    def decode(self, record: StepRecord, host: Iterator[float]) -> dict[str, float]:
        """The standard series of one step from its record and its tensors' host values."""
        values: dict[str, float] = {}
        losses = [next(host) for _ in record.losses]
        found = [next(host) for _ in record.found]
        groups = [([next(host) for _ in norms], scaled, modules) for norms, scaled, modules in record.groups]
        if record.anchor is not None:
            self._scale, self._tracker = next(host), int(next(host))
        params = [next(host) for _ in record.params] if record.params is not None else None
        if losses:
            values["loss"] = sum(losses)  # not fsum: it raises on inf + -inf, where a sum is NaN
        scale = self._scale if found else None
        if scale is not None:
            values["scale"] = scale
            values["skipped"] = 1.0 if any(f != 0 for f in found) else 0.0
            self._advance(values["skipped"] == 1.0, record.rule)
        if groups:
            values.update(_norms(groups, scale))
        if record.lr is not None:
            values["lr"] = record.lr
        if params is not None:
            values["param_norm"] = math.sqrt(sum(p * p for p in params))
        return values

    def _advance(self, skipped: bool, rule: tuple[float, float, int]) -> None:
        growth, backoff, interval = rule
        if skipped:
            self._scale, self._tracker = _f32(self._scale * backoff), 0  # type: ignore[operator]
        else:
            self._tracker += 1
            if self._tracker == interval:
                self._scale, self._tracker = _f32(self._scale * growth), 0  # type: ignore[operator]


def _norms(groups: list[tuple[list[float], bool, tuple[str, ...] | None]], scale: float | None) -> dict[str, float]:
    """Total unscaled gradient norm, and per-module norms where the record asked for them."""
    out: dict[str, float] = {}
    total = 0.0
    layers: dict[str, float] = {}
    for norms, scaled, modules in groups:
        divisor = scale if scaled and scale else 1.0
        squares = [(n / divisor) * (n / divisor) for n in norms]  # never raises: overflow is inf
        total += sum(squares)
        for module, square in zip(modules or (), squares):
            layers[module] = layers.get(module, 0.0) + square
    out["grad_norm"] = math.sqrt(total) if total == total else math.nan
    out.update({f"grad_norm/{m}": math.sqrt(s) if s == s else math.nan for m, s in layers.items()})
    return out
