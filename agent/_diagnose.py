"""Diagnosis on the host, on the sender thread: per-step values in, events a person can act on out.

The Analyzer owns no judgement of its own: it routes each step's values (or a calm batch, in bulk) to its parts, each
owning its state (`_trends`, `_skips`, `_nonfinite`, `_schedule`, `_leading`), and writes the facts they share
(`ampwatch._context.Context`). Nothing here touches a tensor, so none of it costs the training thread anything.
"""

from __future__ import annotations

import math
from typing import Any

from ampwatch._context import Columns, Context, Event, Thresholds
from ampwatch._leading import Leading
from ampwatch._nonfinite import NonFinite
from ampwatch._protocol import event as protocol_event
from ampwatch._schedule import Schedule
from ampwatch._skips import Skips
from ampwatch._trends import Trends

OBSERVED = ("loss", "scale", "skipped", "grad_norm", "lr", "param_norm")  # what the analyzer reads


class Analyzer:
    """Classifies each step from its standard series and emits events once per episode. Its parts are public for
    what they answer (`ampwatch._origin.Diagnosis` asks `nonfinite.applied`, `trends.recent_divergence` and
    `context.scaled`, and writes the mailbox's facts into `context`); only the Analyzer feeds them values."""

    def __init__(self, rank: int = 0, thresholds: Thresholds | None = None) -> None:
        self.rank = rank
        self.context = Context(thresholds or Thresholds(), self.event)
        self.trends = Trends(self.context)
        self.skips = Skips(self.context, self.trends)
        self.nonfinite = NonFinite(self.context, self.trends, self.skips)
        self.schedule = Schedule(self.context)
        self.leading = Leading(self.event)  # the leading indicators' rules (see ampwatch._leading)

    def observe_columns(self, columns: Columns) -> list[Event]:
        """Events for a batch's series. A calm stretch (every value finite, no skipped step, nothing near a spike)
        only moves the state, in bulk; anything else is judged step by step, in step order."""
        standard = {name: columns[name] for name in OBSERVED if name in columns}
        events: list[Event] = self.leading.observe_columns(columns)
        self.nonfinite.check_loss_recorded(standard, events)
        if not standard or self._absorb_calm(standard):
            return events
        by_step: dict[int, dict[str, float]] = {}
        for name, (steps, values) in standard.items():
            for step, value in zip(steps, values):
                by_step.setdefault(step, {})[name] = value
        for step in sorted(by_step):
            events.extend(self.observe(step, by_step[step]))
        return events

    def _absorb_calm(self, c: Columns) -> bool:
        """If nothing in these series can raise an event, update the state as `observe` would and say so."""
        skipped, loss, norm, lr = c.get("skipped"), c.get("loss"), c.get("grad_norm"), c.get("lr")
        if not self.skips.calm(skipped):
            return False
        for name in ("loss", "scale", "grad_norm", "param_norm"):  # a sum is finite only if every value is
            if name in c and not math.isfinite(sum(c[name][1])):
                return False
        if (skipped or self.context.scaled) and not all(  # values the user logged at steps without GradScaler's record
            _within(c[name][0], skipped[0] if skipped else []) for name in ("loss", "grad_norm") if name in c
        ):
            return False
        if lr and not self.schedule.calm():  # a schedule step right after a skipped step: judged one by one
            return False
        if not self.trends.calm(loss, norm):
            return False
        self.trends.absorb(loss, norm)
        self.nonfinite.absorb(loss, norm is not None, "param_norm" in c)
        if skipped:
            self.skips.absorb(c.get("scale"))
            self.context.scaled = True
        self.schedule.absorb(skipped[0] if skipped else None, lr[1][-1] if lr else None)
        if lr:
            self.context.lr = lr[1][-1]
        return True

    def observe(self, step: int, values: dict[str, float]) -> list[Event]:
        """Events for one step's values (any subset of loss, scale, skipped, grad_norm, lr, param_norm). Finite
        losses, and finite norms of applied steps, feed the trends."""
        events: list[Event] = []
        loss, scale, norm = values.get("loss"), values.get("scale"), values.get("grad_norm")
        skipped = values.get("skipped")
        context = self.context
        context.lr = values.get("lr", context.lr)
        if skipped is None and context.scaled:
            self._logged(step, loss, events)
            loss = norm = None
        if loss is not None:
            self.nonfinite.loss(step, loss, scale, skipped, events)
            if math.isfinite(loss):
                self.trends.loss(step, loss, events)
        if skipped is not None and scale is not None:
            self.skips.observe(step, bool(skipped), scale, loss, norm, self.nonfinite.params_bad, events)
        if norm is not None:
            self.nonfinite.grad(step, norm, loss, scale, events)
            if not skipped and math.isfinite(norm):
                self.trends.norm(step, norm, events)
        if "param_norm" in values:  # (taken after the optimizer step: the loss and gradients above came before it)
            self.nonfinite.params(step, values["param_norm"], events)
        if skipped is not None:
            context.scaled = True
            self.schedule.skipped(step, bool(skipped) and not self.skips.calibrating)
        if "lr" in values:
            self.schedule.check(step, values["lr"], events)
        return events

    def _logged(self, step: int, loss: float | None, out: list[Event]) -> None:
        """Values the user logged at a step of a scaler run without GradScaler's record of that step: a copy of what the
        agent recorded itself, arriving after its step was judged (a skip wakes the sender) or at a step numbered
        otherwise (a resumed run's global step), or a loss logged before its optimizer step, arriving a batch early.
        Only a non-finite loss at a step not known to be skipped is judged (GradScaler skips such a step, whatever its
        number); feeding the rest to the medians would mix two orders of steps."""
        if loss is not None and not self.skips.was_skipped(step):  # (a skipped step was judged with its record)
            self.nonfinite.logged_loss(step, loss, out)

    def event(self, step: int, kind: str, severity: str, message: str, details: dict[str, Any]) -> Event:
        """An event as the server takes it; every part's events are made here. (The NaN-origin probe's events are
        made here too: a later collapse says what its origin means.)"""
        if "origin" in details:
            self.context.origin = (details["origin"], details["phase"])
        return protocol_event(step, self.rank, kind, severity, message, details)


def _within(steps: list[int], known: list[int]) -> bool:
    """Whether every step of `steps` is one of `known` (usually the very same list)."""
    return steps == known or set(steps) <= set(known)
