"""When an event-triggered alert's condition has cleared, and how to say so ("skips stopped at step 12 340;
scale back to 2^13"). The agent reports an episode once, so clearing is read from the series that follow it."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import and_, func, not_, select
from sqlalchemy.orm import Session

from ampwatch.server import models
from ampwatch.server.alerts._context import series_id, series_tail
from ampwatch.server.alerts._db import pow2, steps

# event type → (series that shows the cure, what a cured value looks like, how many cured points in a row)
_CURES = {
    "nonfinite_loss": ("loss", "finite", 10),
    "nonfinite_grad": ("grad_norm", "finite", 10),
    "nonfinite_param": ("param_norm", "finite", 1),
    "scale_collapse": ("skipped", "zero", 10),
}
QUIET_STEPS = 100  # other events (spikes, misuse) clear after this many steps without a new one
NEVER = ("run_crashed", "run_stalled")  # these resolve when the run reports again (see _ingest)
# Misuses that raise nothing and recur at every step (a mistake in the loop or the launch), which the agent and the
# server say once: no quiet clears them, only the run's end.
LASTING = ("unscaled_backward", "clip_before_unscale", "direct_step", "ranks_disagree")
LASTING_TYPES = ("ranks_desync",)  # said once; the ranks do not agree again by themselves: cleared at the run's end


def cleared(session: Session, *, alert: models.Alert, event_type: str, run: models.Run) -> str | None:
    """Why the condition is over, or None while it holds."""
    if event_type in NEVER:
        return None
    after = alert.last_step if alert.last_step is not None else -1
    rank = alert.rank if alert.rank >= 0 else int(alert.details.get("rank", 0))
    if event_type in LASTING_TYPES or (event_type == "scaler_misuse" and (alert.details or {}).get("cause") in LASTING):
        return (
            None
            if run.status in ("running", "stalled")
            else f"The run ended ({run.status}); the mistake is in its code."
            if event_type == "scaler_misuse"
            else f"The run ended ({run.status})."
        )
    if event_type not in _CURES:
        if run.last_step is not None and run.last_step - after >= QUIET_STEPS:
            return f"No new {event_type} for {QUIET_STEPS} steps (through step {steps(run.last_step)})."
        return None
    name, cure, need = _CURES[event_type]
    series = series_id(session, run_id=run.id, name=name)
    tail = series_tail(session, series, rank=rank, after=after, limit=need) if series is not None else []
    if series is None or len(tail) < need or not all(_cured(v, cure) for _, v in tail):
        return None
    first = _first_cured(session, series, rank, after, cure) or tail[-1][0]
    scale_series = series_id(session, run_id=run.id, name="scale")
    scale = series_tail(session, scale_series, rank=rank, after=-1, limit=1) if scale_series is not None else []
    scale_text = pow2(scale[0][1]) if scale else None
    return _say(event_type, first, tail[0][0], scale_text)


def cleared_before(session: Session, *, alert: models.Alert, event_type: str, run: models.Run, step: int) -> str | None:
    """Why the condition of an active alert was over, counted in steps, before a new occurrence at `step` (None if it
    held): then that occurrence is a new alert, whether or not the evaluator, which runs on a clock, saw the gap in
    between (a slow loop and a fast one with the same bad batches get the same alerts)."""
    after = alert.last_step
    lasting = event_type == "scaler_misuse" and (alert.details or {}).get("cause") in LASTING
    if event_type in NEVER or lasting or after is None or step <= after:
        return None
    if event_type not in _CURES:
        return (
            f"No new {event_type} for {QUIET_STEPS} steps (through step {steps(step - 1)})."
            if step - after > QUIET_STEPS
            else None
        )
    name, cure, need = _CURES[event_type]
    series = series_id(session, run_id=run.id, name=name)
    if series is None:
        return None
    P = models.Point
    rank = alert.rank if alert.rank >= 0 else int(alert.details.get("rank", 0))
    base = (P.series_id == series, P.rank == rank, P.step < step)
    good = _good(cure)
    last_bad = session.scalar(select(func.max(P.step)).where(*base, P.step > after, not_(good) | P.value.is_(None)))
    start = after if last_bad is None else last_bad
    cured = session.scalars(select(P.step).where(*base, P.step > start, good).order_by(P.step).limit(need)).all()
    return _say(event_type, cured[0], cured[-1], None) if len(cured) == need else None


def _good(cure: str) -> Any:
    """A cured point, as SQL (NaN is stored as NULL)."""
    P = models.Point
    return P.value == 0 if cure == "zero" else and_(P.value.is_not(None), P.value < math.inf, P.value > -math.inf)


def _say(event_type: str, first: int, last: int, scale: str | None) -> str:
    if event_type == "scale_collapse":
        return (
            f"Skips stopped at step {steps(first)}; scale back to {scale}."
            if scale
            else f"Skips stopped at step {steps(first)}."
        )
    if event_type == "nonfinite_param":
        return f"The parameters are finite again at step {steps(first)}."
    what = "loss" if event_type == "nonfinite_loss" else "gradient norm"
    tail = f"; loss scale {scale}" if scale else ""
    return f"The {what} is finite again since step {steps(first)} (checked through step {steps(last)}){tail}."


def _cured(value: float | None, cure: str) -> bool:
    if cure == "zero":
        return value == 0
    return value is not None and math.isfinite(value)


def _first_cured(session: Session, series: int, rank: int, after: int, cure: str) -> int | None:
    """The first cured step of a series (by id) after the last uncured one (after `after`): where the episode really
    ended."""
    P = models.Point
    base = (P.series_id == series, P.rank == rank)
    good = _good(cure)
    last_bad = session.scalar(select(func.max(P.step)).where(*base, P.step > after, not_(good) | P.value.is_(None)))
    start = after if last_bad is None else last_bad
    return session.scalar(select(func.min(P.step)).where(*base, P.step > start, good))
