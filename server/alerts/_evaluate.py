"""The background evaluation of one run: windowed rules (a series threshold, an event rate), the clearing,
`for` and `keep_firing_for` of open alerts, and reminders. Never on the request path.

A process evaluates a run only while it holds the run's lease (a conditional UPDATE), so replicas share the
work instead of repeating it; the state changes themselves are guarded again in `_state`."""

from __future__ import annotations

import math
import operator
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, func, or_, select, update
from sqlalchemy.orm import Session

from ampwatch.server import models
from ampwatch.server.alerts import _state
from ampwatch.server.alerts._clearing import cleared
from ampwatch.server.alerts._context import series_id, series_ranks, series_tail
from ampwatch.server.alerts._db import ACTIVE, steps, utc
from ampwatch.server.alerts._ingest import ensure_liveness
from ampwatch.server.alerts._rules import applies

L, R, A, Rule = models.RunLiveness, models.Run, models.Alert, models.AlertRule
LEASE_S = 30.0
_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
_REMIND_STATUSES = ("running", "stalled")  # a finished or dead run does not need reminding


def runs_to_evaluate(session: Session, *, limit: int = 200) -> list[str]:
    """Runs with data newer than their last evaluation, and runs with open alerts."""
    fresh = (
        select(L.run_id).join(R, R.id == L.run_id).where(or_(L.evaluated_at.is_(None), L.evaluated_at < R.last_seen_at))
    )
    # Open alerts of a finished or dead run change only with new data, unless a timer runs (for, keep_firing_for)
    # or their rule was disabled or deleted (they resolve).
    orphaned = or_(Rule.id.is_(None), Rule.enabled.is_(False))
    timed = or_(R.status.in_(_REMIND_STATUSES), A.state == "pending", A.cleared_at.is_not(None), orphaned)
    open_ = select(A.run_id).join(R, R.id == A.run_id).outerjoin(Rule, Rule.id == A.rule_id)
    open_ = open_.where(A.state.in_(ACTIVE), timed).distinct()
    return list(dict.fromkeys([*session.scalars(fresh.limit(limit)), *session.scalars(open_.limit(limit))]))


def claim(session: Session, run_id: str, stamp: datetime) -> bool:
    """Take the run's evaluation lease, committed so that other processes see it; False when one of them holds it."""
    taken = _take_lease(session, run_id, stamp)
    if not taken and session.get(L, run_id) is None:  # (a run whose liveness row is not there yet)
        ensure_liveness(session, run_id)
        taken = _take_lease(session, run_id, stamp)
    session.commit()
    return taken


def _take_lease(session: Session, run_id: str, stamp: datetime) -> bool:
    return (
        cast(
            CursorResult[Any],
            session.execute(
                update(L)
                .where(L.run_id == run_id, or_(L.lease_until.is_(None), L.lease_until < stamp))
                .values(lease_until=stamp + timedelta(seconds=LEASE_S))
                .execution_options(synchronize_session=False)
            ),
        ).rowcount
        == 1
    )


def release(session: Session, run_id: str, seen: datetime | None) -> None:
    """Give the lease back, recording what was evaluated (the run's last_seen_at as of the evaluation); the caller
    commits."""
    session.execute(
        update(L)
        .where(L.run_id == run_id)
        .values(lease_until=None, evaluated_at=seen)
        .execution_options(synchronize_session=False)
    )


def evaluate_run(session: Session, run_id: str, stamp: datetime, rules: list[models.AlertRule]) -> None:
    """Windowed rules, then the upkeep of every open alert of the run; then the lease is given back (the caller
    holds it, and commits). `rules`: every rule, read once per pass."""
    found = session.execute(
        select(R, models.Project.name).join(models.Project, models.Project.id == R.project_id).where(R.id == run_id)
    ).first()
    if found is None:
        release(session, run_id, None)
        return
    run, project = found
    liveness = ensure_liveness(session, run_id)
    active = session.scalars(select(A).where(A.run_id == run_id, A.state.in_(ACTIVE))).all()
    opened = False
    for rule in rules:
        if rule.enabled and rule.kind in ("threshold", "event_rate") and applies(rule, project):
            opened |= _window(session, rule, run, liveness, project, stamp, [a for a in active if a.rule == rule.name])
    if opened:  # (alerts the windows opened get their upkeep too)
        active = session.scalars(select(A).where(A.run_id == run_id, A.state.in_(ACTIVE))).all()
    by_id = {r.id: r for r in rules}
    for alert in active:
        _upkeep(session, alert, by_id.get(alert.rule_id) if alert.rule_id is not None else None, run, stamp)
    release(session, run_id, run.last_seen_at)


def _upkeep(
    session: Session, alert: models.Alert, rule: models.AlertRule | None, run: models.Run, stamp: datetime
) -> None:
    if alert.state not in ACTIVE:
        return
    if rule is None or not rule.enabled:
        _state.clear(session, alert, None, step=run.last_step, reason="The rule was disabled or deleted.", stamp=stamp)
        return
    if rule.kind == "event":
        reason = cleared(session, alert=alert, event_type=rule.event_type or "", run=run)
        if reason is not None:
            _state.clear(session, alert, rule, step=run.last_step, reason=reason, stamp=stamp)
            return
        alert.cleared_at = None
        if alert.state == "pending" and _for_met(rule, alert, run.last_step, stamp):
            _state.fire(session, alert, step=alert.last_step, reason=f"held for {_for_text(rule)}", stamp=stamp)
    if alert.state == "firing" and run.status in _REMIND_STATUSES:
        if not _state.unsuppress(session, alert, stamp=stamp):
            _state.remind(session, alert, rule, stamp=stamp)


def _window(
    session: Session,
    rule: models.AlertRule,
    run: models.Run,
    liveness: models.RunLiveness,
    project: str,
    stamp: datetime,
    active: list[models.Alert],
) -> bool:
    """Measure every rank. A `per_rank` rule keeps one alert per (rule, run, rank); otherwise one alert per
    (rule, run) holds while any rank breaks the threshold (it names the rank). `active`: the rule's open alerts of
    the run. Whether an alert holds (opened, or kept open)."""
    measured = _measure(session, rule, run, liveness)  # {rank: (value, step)}, ranks with a full window only
    if not measured:
        return False  # not enough data to decide either way
    holding = {rank: m for rank, m in measured.items() if _holds(rule, m[0])}
    if rule.per_rank:
        keys = {rank: (rank, m) for rank, m in holding.items()}
    else:
        keys = {-1: min(holding.items())} if holding else {}
    for alert in active:  # clear what no longer holds (or was keyed before per_rank changed)
        if alert.rank not in keys and (not rule.per_rank or alert.rank in measured or alert.rank < 0):
            value, step = measured.get(alert.rank, min(measured.items())[1])
            reason = f"{_what(rule)} is {value:.4g} at step {steps(step)}, no longer {rule.op} {rule.threshold:g}."
            _state.clear(session, alert, rule, step=step, reason=reason, stamp=stamp)
    for rank, (value, step) in keys.values():
        where = f" (rank {rank})" if len(measured) > 1 or rank != 0 else ""
        message = f"{_what(rule)} is {value:.4g} (threshold {rule.op} {rule.threshold:g}) at step {steps(step)}{where}."
        details = {
            "value": value,
            "window_steps": rule.window_steps,
            "threshold": rule.threshold,
            "type": rule.name,
            "rank": rank,
            "message": message,
        }
        summary = f"{_title(rule, value)} in {project}/{run.name}{where} at step {steps(step)}"
        alert, _ = _state.open_or_recur(
            session,
            rule=rule,
            run_id=run.id,
            rank=rank,
            step=step,
            summary=summary,
            details=details,
            stamp=stamp,
            reason=message,
            occurrence=False,
        )
        if alert.state == "pending" and _for_met(rule, alert, step, stamp):
            _state.fire(session, alert, step=step, reason=f"held for {_for_text(rule)}", stamp=stamp)
    return bool(keys)


def _holds(rule: models.AlertRule, value: float) -> bool:
    return not math.isnan(value) and _OPS[rule.op or ">"](value, rule.threshold if rule.threshold is not None else 0.0)


def _measure(
    session: Session, rule: models.AlertRule, run: models.Run, liveness: models.RunLiveness
) -> dict[int, tuple[float, int]]:
    window = rule.window_steps or 1
    floor = rule.ignore_steps
    if rule.series in ("skipped", "scale") and liveness.calibrated_step is not None:
        floor = max(floor, liveness.calibrated_step)  # skips while the scale calibrates at start-up are normal
    if rule.kind == "event_rate":
        if run.last_step is None or run.last_step - floor + 1 < window:
            return {}
        E = models.Event
        counts = dict(
            session.execute(
                select(E.rank, func.count())
                .where(E.run_id == run.id, E.type == rule.event_type, E.step > run.last_step - window, E.step >= floor)
                .group_by(E.rank)
            ).all()
        )
        if not rule.per_rank:
            return {0: (float(sum(counts.values())), run.last_step)}  # the run's rate, every rank's events together
        return {rank: (float(counts.get(rank, 0)), run.last_step) for rank in {0, *counts}}
    measured: dict[int, tuple[float, int]] = {}
    series = series_id(session, run_id=run.id, name=rule.series or "")
    for rank in series_ranks(session, series) if series is not None else ():
        tail = series_tail(session, cast(int, series), rank=rank, after=floor - 1, limit=window)
        if len(tail) == window:
            measured[rank] = (aggregate(rule.aggregation or "mean", [v for _, v in tail]), tail[0][0])
    return measured


def aggregate(how: str, values: list[float | None]) -> float:
    """Aggregate a window, newest value first; NaN (None) only counts for `nonfinite` and `last`."""
    if how == "nonfinite":
        return float(sum(1 for v in values if v is None or math.isinf(v)))
    if how == "last":
        return math.nan if values[0] is None else values[0]
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return math.nan
    return {
        "mean": lambda: sum(finite) / len(finite),
        "max": lambda: max(finite),
        "min": lambda: min(finite),
        "sum": lambda: sum(finite),
    }[how]()


def _for_met(rule: models.AlertRule, alert: models.Alert, step: int | None, stamp: datetime) -> bool:
    held_s = (stamp - utc(alert.started_at)).total_seconds()
    held_steps = (step or 0) - (alert.step or 0)
    return held_s >= rule.for_s and held_steps >= rule.for_steps


def _for_text(rule: models.AlertRule) -> str:
    parts = [f"{rule.for_steps} steps"] if rule.for_steps else []
    return " and ".join(parts + ([f"{rule.for_s:g} s"] if rule.for_s else [])) or "0 s"


def _what(rule: models.AlertRule) -> str:
    if rule.kind == "event_rate":
        return f"{rule.event_type} events in the last {rule.window_steps} steps"
    return f"{rule.aggregation} of {rule.series} over the last {rule.window_steps} steps"


def _title(rule: models.AlertRule, value: float) -> str:
    if rule.name == "skip_rate":
        return f"Skip rate {value:.0%} over {rule.window_steps} steps"
    return f"{rule.name}: {_what(rule)} = {value:.4g}"
