"""One optimizer step as the training thread leaves it, and its decoding on the sender thread.

The training thread keeps references, not results: the detached loss, GradScaler's own found_inf
tensors, the per-parameter gradient norms of one `_foreach_norm`. It hands them over as one plain
tuple per step (see `STEP_FIELDS`), the cheapest record Python can build. The sender thread copies
them to the host and does all the arithmetic: sums, total and per-layer norms, the unscaling, and the
loss scale, which it shadows from found_inf with GradScaler's own update rule, re-anchored from a copy
of the device scale every `ANCHOR_EVERY` steps and whenever something outside `update()` changed it.
"""

from __future__ import annotations

import math
import struct
from typing import Any

ANCHOR_EVERY = 256
Groups = list[tuple[list[Any], bool, "tuple[str, ...] | None"]]  # (per-parameter norms, of scaled grads, modules)

# A step record: (kind, step, losses, found, groups, total, anchor, rule, lr, params)
#   losses  detached tensors passed to scaler.scale() (summed), or None when the user logged `loss`
#   found   GradScaler's found_inf tensors (empty without a scaler)
#   groups  per optimizer: the `_foreach_norm` of its gradients, whether they were still scaled, and
#           the module of each parameter on per-layer steps (else None)
#   total   False when the user logged `grad_norm` at this step (their value wins; layers are still ours)
#   anchor  copies of the scale and growth tracker before update(), or None
#   rule    (growth factor, backoff factor, growth interval) of the scaler along with an anchor, else None
#   lr      the first parameter group's float learning rate, or None
#   params  per-parameter norms of the parameters (a periodic finiteness check), or None
STEP_FIELDS = ("kind", "step", "losses", "found", "groups", "total", "anchor", "rule", "lr", "params")


def step_tensors(record: tuple, out: list[Any]) -> None:
    """Append every tensor of a step record to `out`, in the order `StepDecoder.decode` consumes them."""
    _, _, losses, found, groups, _, anchor, _, _, params = record
    if losses:
        out.extend(losses)
    out.extend(found)
    for norms, _, _ in groups:
        out.extend(norms)
    if anchor is not None:
        out.extend(anchor)
    if params is not None:
        out.extend(params)


def _f32(value: float) -> float:
    """Round to float32, as the device's `_amp_update_scale_` does."""
    return struct.unpack("f", struct.pack("f", value))[0] if math.isfinite(value) else value


class StepDecoder:
    """Host values for one run's steps, in order; holds the shadow of the loss scale."""

    def __init__(self) -> None:
        self._scale: float | None = None
        self._tracker = 0
        self._rule: tuple[float, float, int] = (2.0, 0.5, 2000)

    def decode(self, record: tuple, host: list[Any], at: int) -> tuple[dict[str, float], int]:
        """The standard series of one step, from its record and its tensors' host values from `host[at]` on;
        and where the next record's values start."""
        _, _, losses, found, groups, total, anchor, rule, lr, params = record
        values: dict[str, float] = {}
        if losses:
            n = len(losses)
            values["loss"] = float(host[at]) if n == 1 else float(sum(host[at : at + n]))  # not fsum: inf + -inf is NaN
            at += n
        skipped = False
        if found:
            n = len(found)
            skipped = any(host[at : at + n])
            at += n
        norms_at = at
        for norms, _, _ in groups:
            at += len(norms)
        if anchor is not None:
            self._scale, self._tracker = float(host[at]), int(host[at + 1])
            at += 2
        if rule is not None:
            self._rule = rule
        scale = self._scale if found else None
        if scale is not None:
            values["scale"] = scale
            values["skipped"] = 1.0 if skipped else 0.0
            self._advance(skipped)
        if groups:
            _norms(groups, host, norms_at, scale, total, values)
        if lr is not None:
            values["lr"] = lr
        if params is not None:
            n = len(params)
            values["param_norm"] = math.sqrt(sum(p * p for p in host[at : at + n]))
            at += n
        return values, at

    def _advance(self, skipped: bool) -> None:
        growth, backoff, interval = self._rule
        if skipped:
            self._scale, self._tracker = _f32(self._scale * backoff), 0  # type: ignore[operator]
        else:
            self._tracker += 1
            if self._tracker == interval:
                self._scale, self._tracker = _f32(self._scale * growth), 0  # type: ignore[operator]


def _norms(groups: Groups, host: list[Any], at: int, scale: float | None, total_wanted: bool, out: dict[str, float]) -> None:
    """Total unscaled gradient norm, and per-module norms where the record asked for them."""
    total = 0.0
    layers: dict[str, float] = {}
    for norms, scaled, modules in groups:
        n = len(norms)
        values = host[at : at + n]
        at += n
        if scaled and scale:
            values = [v / scale for v in values]
        squares = [v * v for v in values]  # never raises: overflow is inf
        total += sum(squares)
        if modules is not None:
            for module, square in zip(modules, squares):
                layers[module] = layers.get(module, 0.0) + square
    if total_wanted:
        out["grad_norm"] = math.sqrt(total) if total == total else math.nan
    for module, square in layers.items():
        out["grad_norm/" + module] = math.sqrt(square) if square == square else math.nan
