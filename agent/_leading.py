"""Part of the diagnosis: the leading indicators' series (see `ampwatch._indicators`) judged on the sender thread.

Three rules, each said once per layer and episode:
- fp16 range: a layer whose fp16 outputs' largest absolute value climbs steadily over the last `RISE_POINTS`
  interval steps (see `_projection`), now at `RANGE_FLOOR` of fp16's range or above, and whose climb, carried on at
  its rate, reaches 65 504 within `HORIZON_INTERVALS` intervals: an `amp_config` warning that names the layer and
  how many steps are left (only for outputs that are fp16: under bf16 or fp32 the series is recorded,
  and nothing overflows at 65 504);
- update ratio: ||Δθ||/||θ|| of a layer at `UPDATE_FACTOR` times its own median (an order of magnitude) or more,
  or grown `UPDATE_FACTOR`× along a steady climb over the last `CLIMB_POINTS` interval steps (see `_growth`);
- Adam's second-moment lag: a layer's squared gradients (or, where it reads the model's inputs, one silent input
  column's), over the interval, at `LAG_FACTOR` times its own usual lag and `LAG_FLOOR` times the second moment Adam
  divides them by (its updates are then ~sqrt of that larger than Adam's usual step), at `LAG_HIGH` of its last
  `LAG_RECENT` interval steps (an input that keeps growing stays ahead of the moment interval after interval; a
  burst of hard batches lifts one or two, then the moment absorbs them).
The update ratio must be high at two interval steps in a row (one hard batch moves a single step's update that
much), and at `UPDATE_SHARE` of the layers or more at once (what runs away is the learning rate, which every layer
follows).
The last two are `leading_indicator` warnings.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

from ampwatch._median import RollingMedian
from ampwatch._protocol import spell

Event = dict[str, Any]
Columns = dict[str, tuple[list[int], list[float]]]

FP16_MAX = 65504.0
RANGE, UPDATE, LAG = "fp16_range", "update_ratio", "adam_lag"  # the series' prefixes: `<prefix>/<module>`
PREFIXES = (RANGE, UPDATE, LAG)
RISE_POINTS = 8  # interval steps a climb is fitted over (350 steps at the default interval)
RISE_MIN = 1.25  # its growth over them, at least
STEADY = 0.8  # the share of the log fraction's variance over them that a steady climb explains, at least
# Of fp16's range (3 275): below it, an overflow is far off whatever the trend. A layer learning outputs in the
# thousands climbs as one that will overflow does until it levels off (bench/foresight.py).
RANGE_FLOOR = 0.05
HORIZON_INTERVALS = 20  # projected overflow at most this many intervals ahead (1000 steps at the default interval)
UPDATE_FACTOR = 10.0
LAG_FACTOR = 10.0
LAG_FLOOR = 20.0
LAG_HIGH, LAG_RECENT = 3, 4  # interval steps at or above the lag's limit, of the latest (bench/foresight.py)
# Interval steps a steady climb of a layer's update ratio is fitted over: one that grows `UPDATE_FACTOR`× along it
# counts as a jump (a learning rate growing a little each step is followed by the rolling median). Shorter windows
# also catch a benign warm-up of a loss's weight (bench/foresight.py).
CLIMB_POINTS = 40
WARMUP_POINTS = 5  # interval steps of a layer's history before its jumps are judged
WINDOW = 50  # interval steps in a layer's rolling median
# Of the layers whose update ratio is judged, the share that must be high at once: a learning rate moves every
# layer's update with it; one layer alone starts learning (an auxiliary head switched on, gradients that leave Adam's
# eps), whose ratio rises from almost nothing (bench/foresight.py: the look-alikes moved 1-2 layers of 10).
UPDATE_SHARE = 0.5


class Leading:
    """The leading indicators' per-layer history and rules. `event(step, type, severity, message, details)` makes
    an event (the analyzer's); `fp16` names the layers whose outputs are fp16 (from the mailbox)."""

    def __init__(self, event: Callable[[int, str, str, str, dict[str, Any]], Event]) -> None:
        self._event = event
        self.fp16: frozenset[str] = frozenset()
        self._ranges: dict[str, deque[tuple[int, float]]] = {}
        self._medians: dict[tuple[str, str], RollingMedian] = {}
        self._climbs: dict[str, deque[tuple[int, float]]] = {}  # update ratios' last `CLIMB_POINTS` values
        self._high: set[tuple[str, str]] = set()  # (prefix, layer) at or above its limit at its last interval step
        self._lag_highs: dict[str, deque[bool]] = {}  # per layer: its lag at or above its limit, latest interval steps
        self._seen: dict[tuple[str, str], int] = {}  # (prefix, layer) -> how many values were judged
        self._warned: dict[tuple[str, str], float] = {}  # (prefix, layer) -> the value it was warned at

    def observe_columns(self, columns: Columns) -> list[Event]:
        """Events for a batch's indicator series (the others are left alone)."""
        by_step: dict[int, dict[str, dict[str, float]]] = {}
        for name, (steps, values) in columns.items():
            prefix, _, layer = name.partition("/")
            if prefix in PREFIXES and layer:
                for step, value in zip(steps, values):
                    by_step.setdefault(step, {}).setdefault(prefix, {})[layer] = value
        events: list[Event] = []
        for step in sorted(by_step):
            found = by_step[step]
            if RANGE in found:
                events.extend(self._range(step, found[RANGE]))
            for prefix in (UPDATE, LAG):
                if prefix in found:
                    events.extend(self._jump(step, prefix, found[prefix]))
        return events

    # -- fp16 range -------------------------------------------------------------------------
    def _range(self, step: int, layers: dict[str, float]) -> list[Event]:
        ahead: list[tuple[float, str, deque[tuple[int, float]]]] = []
        for layer, value in layers.items():
            history = self._ranges.setdefault(layer, deque(maxlen=RISE_POINTS))
            history.append((step, value))
            warned = self._warned.get((RANGE, layer))
            if warned is not None:
                if math.isfinite(value) and value < warned / 2:  # (back down: a later climb is a new episode)
                    del self._warned[(RANGE, layer)]
                continue
            if layer not in self.fp16 or len(history) < RISE_POINTS:
                continue
            projected = _projection(history)
            if projected is not None and projected <= HORIZON_INTERVALS * (history[-1][0] - history[-2][0]):
                ahead.append((projected, layer, history))
        if not ahead:
            return []
        ahead.sort()
        left, layer, history = ahead[0]
        (since, first), (_, last) = history[0], history[-1]
        for _, other, held in ahead:
            self._warned[(RANGE, other)] = held[-1][1]
        steps_left = max(1, round(left))
        linear = max(steps_left, round(min(_linear(history), 1e12)))
        others = [other for _, other, _ in ahead[1:]]
        also = f" Also climbing: {_listed(others)}." if others else ""
        message = (
            f"fp16 overflow ahead in `{layer}`: its largest output grew from {first * FP16_MAX:.4g} to "
            f"{last * FP16_MAX:.4g} over steps {since}–{step} ({last:.1%} of fp16's range), a steady climb: it "
            f"passes 65 504 in about {steps_left} steps (around step {step + steps_left}) if it keeps multiplying at "
            f"its recent rate, {linear} if it only grows by its recent amount per step. GradScaler cannot help with "
            "an activation that overflows in the forward pass. Train in bf16 "
            "(torch.autocast(dtype=torch.bfloat16), which has fp32's range), or keep this layer's output in fp32, or "
            f"find why it grows (too high a learning rate, a missing normalization).{also}"
        )
        details = {
            "indicator": RANGE,
            "layer": layer,
            "fraction": last,
            "largest": last * FP16_MAX,
            "since_step": since,
            "since_fraction": first,
            "steps_to_overflow": steps_left,
            "steps_to_overflow_linear": linear,
            "overflow_step": step + steps_left,
            "layers": [layer, *others],
        }
        return [self._event(step, "amp_config", "warning", message, details)]

    # -- jumps against a layer's own history ---------------------------------------------------
    def _jump(self, step: int, prefix: str, layers: dict[str, float]) -> list[Event]:
        jumps: list[tuple[float, str, float, float]] = []
        judged = highs = 0
        for layer, value in layers.items():
            if value != value:  # (NaN: the step's own series tell what went wrong)
                continue
            key = (prefix, layer)
            median = self._medians.get(key)
            if median is None:
                median = self._medians[key] = RollingMedian(WINDOW)
            seen = self._seen[key] = self._seen.get(key, 0) + 1
            usual = median.value() if median else 0.0
            if prefix == UPDATE:  # (a layer never updated has no usual ratio: one that starts learning is no jump)
                limit = UPDATE_FACTOR * usual if usual > 0 else math.inf
            else:  # Adam's lag is about 1 where the moment keeps up; a layer with no gradient until now has none
                limit = max(LAG_FLOOR, LAG_FACTOR * usual)
            high = value >= limit
            if prefix == UPDATE and CLIMB_POINTS:
                climb = self._climbs.setdefault(layer, deque(maxlen=CLIMB_POINTS))
                climb.append((step, value))
                high = high or (len(climb) == CLIMB_POINTS and _growth(climb) >= UPDATE_FACTOR)
            if prefix == UPDATE and seen > WARMUP_POINTS and usual > 0:
                judged += 1
                highs += high
            if key in self._warned:
                if value < limit / 3 and not high:  # (back near its usual level: a later jump is a new episode)
                    del self._warned[key]
            elif seen > WARMUP_POINTS and high:
                if self._persists(prefix, layer, key):
                    jumps.append((value / usual if usual > 0 else math.inf, layer, value, usual))
                self._high.add(key)
            else:
                self._high.discard(key)
                if prefix == LAG:
                    self._lag_highs.setdefault(layer, deque(maxlen=LAG_RECENT)).append(False)
            if 0 < value < math.inf:  # (a layer not updated at a step says nothing of its usual)
                median.add(value)
        if not jumps or (prefix == UPDATE and highs < UPDATE_SHARE * judged):
            return []  # (the update ratio: too few layers moved for a learning rate's doing)
        jumps.sort(reverse=True)
        times, layer, value, usual = jumps[0]
        for _, other, other_value, _ in jumps:
            self._warned[(prefix, other)] = other_value
        others = [other for _, other, _, _ in jumps[1:]]
        also = f" Also: {_listed(others)}." if others else ""
        if prefix == UPDATE:
            message = (
                f"Update-to-weight ratio of `{layer}` jumped or climbed steadily to {value:.3g} at step {step}, "
                f"{times:.0f}× its usual {usual:.3g}: this step changed the layer's parameters by {value:.1%} of their "
                f"norm ({highs} of {judged} layers rose as much). An order of magnitude more than before in most "
                "layers at once, or along a steady climb, usually means a learning rate that is now too high (a "
                "schedule, a restart) or gradients that grew; a divergence or a loss spike tends to follow. "
                f"Check the learning rate and the gradient norm.{also}"
            )
        else:
            if usual > 0 and value < math.inf:
                how = (
                    f"over the last interval their squares averaged {value:.3g}× the exp_avg_sq Adam divides them by "
                    f"({times:.0f}× this layer's usual {usual:.3g}), so they are ~{math.sqrt(value):.0f}× the scale "
                    "Adam normalizes them to"
                )
            else:
                how = (
                    f"their squares are {value:.3g}× the exp_avg_sq Adam divides them by, which had (almost) nothing "
                    "in it: the layer (or one of its inputs) had no gradient before, so Adam's first updates to it are "
                    "several times the learning rate in every coordinate at once"
                )
            message = (
                f"Adam's second moment lags behind `{layer}`'s gradients at step {step}: {how}. This is the "
                "mechanism behind many loss spikes, which follow within a few steps. Lower the learning rate or "
                "beta2 (0.95 keeps up faster), clip the gradients, or look at what woke this layer (or one of its "
                "inputs) up. A loss term just switched on or reweighted changes the gradients' scale the same way "
                f"once; Adam's moment then catches up over ~1/(1 - beta2) steps, and no spike need follow.{also}"
            )
        details = {
            "indicator": prefix,
            "layer": layer,
            "value": spell(value),
            "usual": usual,
            "layers": [layer, *others],
        }
        return [self._event(step, "leading_indicator", "warning", message, details)]

    def _persists(self, prefix: str, layer: str, key: tuple[str, str]) -> bool:
        """A high value that is no single hard batch: the update ratio's at the interval step before too (a learning
        rate or gradients that ran away stay up), Adam's lag at `LAG_HIGH` of the last `LAG_RECENT` interval steps."""
        if prefix != LAG:
            return key in self._high
        highs = self._lag_highs.setdefault(layer, deque(maxlen=LAG_RECENT))
        highs.append(True)
        return sum(highs) >= LAG_HIGH


def _projection(history: deque[tuple[int, float]]) -> float | None:
    """In how many steps a steady climb of `history` (step, fraction of fp16's range) reaches 1, carried on at its
    rate: a least-squares line through log(fraction) over the steps, steady when it explains `STEADY` of their
    variance or more (batch-to-batch noise is not a climb), its growth over the window at least `RISE_MIN`, and the
    latest fraction at least `RANGE_FLOOR`. None when no such climb is under way."""
    steps = [s for s, _ in history]
    values = [v for _, v in history]
    if not all(0 < v < math.inf for v in values) or values[-1] < RANGE_FLOOR or values[-1] >= 1.0:
        return None
    logs = [math.log(v) for v in values]
    n = len(steps)
    mean_s, mean_l = sum(steps) / n, sum(logs) / n
    var_s = sum((s - mean_s) ** 2 for s in steps)
    var_l = sum((v - mean_l) ** 2 for v in logs)
    if var_s == 0 or var_l == 0:
        return None
    slope = sum((s - mean_s) * (v - mean_l) for s, v in zip(steps, logs)) / var_s
    if slope <= 0 or slope * slope * var_s < STEADY * var_l or math.exp(slope * (steps[-1] - steps[0])) < RISE_MIN:
        return None
    now = mean_l + slope * (steps[-1] - mean_s)  # (the line at the latest step: one batch's noise does not move it)
    return max(0.0, -now / slope)


def _growth(history: deque[tuple[int, float]]) -> float:
    """How many times over `history` (step, value) grew along a steady climb: exp of a least-squares line's rise
    through log(value), when the line explains `STEADY` of their variance or more; 1 when it does not."""
    steps = [s for s, _ in history]
    if not all(0 < v < math.inf for _, v in history):
        return 1.0
    logs = [math.log(v) for _, v in history]
    n = len(steps)
    mean_s, mean_l = sum(steps) / n, sum(logs) / n
    var_s = sum((s - mean_s) ** 2 for s in steps)
    var_l = sum((v - mean_l) ** 2 for v in logs)
    if var_s == 0 or var_l == 0:
        return 1.0
    slope = sum((s - mean_s) * (v - mean_l) for s, v in zip(steps, logs)) / var_s
    if slope <= 0 or slope * slope * var_s < STEADY * var_l:
        return 1.0
    return math.exp(slope * (steps[-1] - steps[0]))


def _linear(history: deque[tuple[int, float]]) -> float:
    """In how many steps `history` reaches 1 if it only grows by its average amount per step (a slower climb than
    the multiplying one `_projection` carries on: the two bound when it overflows)."""
    (first_step, first), (last_step, last) = history[0], history[-1]
    per_step = (last - first) / (last_step - first_step)
    return (1.0 - last) / per_step if per_step > 0 else math.inf


def _listed(layers: list[str], most: int = 5) -> str:
    shown = ", ".join(f"`{layer}`" for layer in layers[:most])
    return shown + (f" and {len(layers) - most} more" if len(layers) > most else "")
