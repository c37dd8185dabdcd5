"""One optimizer step as the training thread leaves it, and its decoding on the sender thread.

The training thread keeps references, not results: the detached loss, GradScaler's own found_inf
tensor, the total norm `clip_grad_norm_` returned (or the per-parameter norms of one `_foreach_norm`).
It hands them over as one plain tuple per step (see `STEP_FIELDS` in ampwatch._protocol), the cheapest record Python can
build, holding the tensors themselves in the usual case (lists only where there are several), as every
object kept until the sender reads it is more work for the garbage collector on the training thread.
The sender thread copies them to the host and does all the arithmetic: sums, total and per-layer norms,
the unscaling, and the loss scale, which it shadows from found_inf with GradScaler's own update rule,
re-anchored from a copy of the device scale every `ANCHOR_EVERY` steps and whenever something outside
`update()` changed it.
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Any

from ampwatch._protocol import FOUND_AT, LEAN_LR_AT, MAX_NAME, STEP_AT

ANCHOR_EVERY = (
    200  # a multiple of the default layer and parameter intervals (50): anchors come on steps that do more anyway
)
Groups = list[tuple[list[Any], bool, "tuple[str, ...] | str | None"]]  # (per-parameter norms, of scaled grads, modules)
CLIP_TOTAL = "(clip total)"  # a group's modules: its one norm is the step's total (see Recorder.on_clipped)
Points = dict[str, tuple[list[int], list[float]]]  # series name -> (steps, values)

# The records decoded here are laid out in ampwatch._protocol (STEP_FIELDS, LEAN_FIELDS).


def step_tensors(records: list[tuple], out: list[Any]) -> None:
    """Append every tensor of the step records to `out`, in the order `StepDecoder.decode` consumes them."""
    append = out.append
    for _, _, loss, found, norm, _, anchor, _, _, params in records:
        if loss is not None:
            if loss.__class__ is list:
                out += loss
            else:
                append(loss)
        if found is not None:
            if found.__class__ is list:
                out += found
            else:
                append(found)
        if norm is not None:
            if norm.__class__ is list:
                for norms, _, _ in norm:
                    out += norms
            else:
                append(norm)
        if anchor is not None:
            out += anchor
        if params is not None:
            out += params


def lean_tensors(records: list[tuple], out: list[Any]) -> None:
    """Append the tensors of lean step records of one kind to `out`, in the order `StepDecoder.decode_lean`
    consumes them."""
    if records[0][FOUND_AT] is None:
        out += [t for _, _, loss, _, norm, _ in records for t in (loss, norm)]
    else:
        out += [t for _, _, loss, found, norm, _ in records for t in (loss, found, norm)]


def _f32(value: float) -> float:
    """Round to float32, as the device's `_amp_update_scale_` does."""
    return struct.unpack("f", struct.pack("f", value))[0] if math.isfinite(value) else value


class StepDecoder:
    """Host values for one run's steps, in order; holds the shadow of the loss scale."""

    def __init__(self) -> None:
        self._scale: float | None = None
        self._tracker = 0
        self._rule: tuple[float, float, int] = (2.0, 0.5, 2000)

    def decode(self, records: list[tuple], host: list[Any], at: int, points: Points) -> int:
        """Append the standard series of consecutive step records to `points`, from their tensors' host values
        (from `host[at]` on); return where the next record's values start. Column by column: this runs on
        the sender thread for every step, holding the GIL the training thread wants."""
        loss, scale, skipped, grad_norm, lr_series = (
            _series(points, n) for n in ("loss", "scale", "skipped", "grad_norm", "lr")
        )
        for _, step, losses, found, norm, total, anchor, rule, lr, params in records:
            if losses is not None:
                n = len(losses) if losses.__class__ is list else 1
                loss[0].append(step)
                loss[1].append(
                    float(host[at]) if n == 1 else float(sum(host[at : at + n]))
                )  # not fsum: inf + -inf is NaN
                at += n
            skip = False
            if found is not None:
                n = len(found) if found.__class__ is list else 1
                skip = any(host[at : at + n])
                at += n
            norms_at = at
            if norm.__class__ is list:
                for norms, _, _ in norm:
                    at += len(norms)
            elif norm is not None:
                at += 1
            if anchor is not None:
                self._scale, self._tracker = float(host[at]), int(host[at + 1])
                at += 2
            if rule is not None:
                self._rule = rule
            current = self._scale if found is not None else None
            if current is not None:
                scale[0].append(step)
                scale[1].append(current)
                skipped[0].append(step)
                skipped[1].append(1 if skip else 0)  # an int: JSON writes it faster than a float
                self._advance(skip)
            if norm.__class__ is list:
                _norms(norm, host, norms_at, current, total, step, points)
            elif norm is not None and total:  # one norm, already the total (clip_grad_norm_'s): the usual step
                grad_norm[0].append(step)
                grad_norm[1].append(abs(host[norms_at]))
            if lr is not None:
                lr_series[0].append(step)
                lr_series[1].append(lr)
            if params is not None:
                n = len(params)
                series = _series(points, "param_norm")
                series[0].append(step)
                series[1].append(math.sqrt(sum(p * p for p in host[at : at + n])))
                at += n
        return at

    def decode_lean(self, records: list[tuple], host: list[Any], at: int, points: Points) -> int:
        """`decode` for lean step records of one kind (see LEAN_FIELDS): the same series, a column at a time."""
        n = len(records)
        found = records[0][FOUND_AT] is not None
        width = 3 if found else 2
        end = at + width * n
        steps = [r[STEP_AT] for r in records]
        series = _series(points, "loss")
        series[0].extend(steps)
        series[1].extend(map(float, host[at:end:width]))
        if self._scale is not None:
            flags = [1 if flag else 0 for flag in host[at + 1 : end : 3]] if found else [0] * n
            if 1 not in flags and self._tracker + n < self._rule[2]:  # the usual stretch: no skip, no growth
                scales = [self._scale] * n
                self._tracker += n
            else:
                scales = []
                for flag in flags:
                    scales.append(self._scale)
                    self._advance(flag == 1)
            for name, values in (("scale", scales), ("skipped", flags)):
                series = _series(points, name)
                series[0].extend(steps)
                series[1].extend(values)
        series = _series(points, "grad_norm")
        series[0].extend(steps)
        series[1].extend(map(abs, host[at + width - 1 : end : width]))
        lrs = [r[LEAN_LR_AT] for r in records]
        series = _series(points, "lr")
        if None in lrs:
            steps, lrs = [s for s, lr in zip(steps, lrs) if lr is not None], [lr for lr in lrs if lr is not None]
        series[0].extend(steps)
        series[1].extend(lrs)
        return end

    def _advance(self, skipped: bool) -> None:
        growth, backoff, interval = self._rule
        if skipped:
            # (the scale is set by an anchor before any step advances it)
            self._scale, self._tracker = _f32(self._scale * backoff), 0  # type: ignore[operator]
        else:
            self._tracker += 1
            if self._tracker == interval:
                # (the scale is set by an anchor before any step advances it)
                self._scale, self._tracker = _f32(self._scale * growth), 0  # type: ignore[operator]


def _series(points: Points, name: str) -> tuple[list[int], list[float]]:
    series = points.get(name)
    if series is None:
        series = points[name] = ([], [])
    return series


def _norms(
    groups: Groups, host: list[Any], at: int, scale: float | None, total_wanted: bool, step: int, points: Points
) -> None:
    """Total unscaled gradient norm, and per-module norms where the record asked for them."""
    total = 0.0
    layers: dict[str, float] = {}
    clipped = None
    for norms, scaled, modules in groups:
        n = len(norms)
        values = host[at : at + n]
        at += n
        if scaled and scale:
            values = [v / scale for v in values]
        if modules == CLIP_TOTAL:  # (recorded as the clip returned it, not squared and rooted again)
            clipped = values[0]
            continue
        squares = [v * v for v in values]  # never raises: overflow is inf
        total += sum(squares)
        if modules is not None:
            for module, square in zip(modules, squares):
                layers[module] = layers.get(module, 0.0) + square
    named = {"grad_norm": total} if total_wanted and clipped is None else {}
    named.update((_layer_series(module), square) for module, square in layers.items())
    if total_wanted and clipped is not None:
        series = _series(points, "grad_norm")
        series[0].append(step)
        series[1].append(abs(clipped))  # (as the usual step records it)
    for name, square in named.items():
        series = _series(points, name)
        series[0].append(step)
        series[1].append(math.sqrt(square) if square == square else math.nan)


@functools.lru_cache(maxsize=4096)
def _layer_series(module: str) -> str:
    """`grad_norm/<module>`; past the server's limit on names (a deeply nested module), its end after a `…` (the layer
    and its index are at the end: the server would refuse the whole batch for one name too long)."""
    name = "grad_norm/" + module
    return name if len(name) <= MAX_NAME else "grad_norm/…" + module[len(name) - MAX_NAME + 1 :]
