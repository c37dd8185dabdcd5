"""Inside the ingest transaction: step bookkeeping for hang detection, and event-triggered rules.

Evaluating event rules here, before the batch commits, is what makes a NaN alert fast: the alert and its
queued notifications commit with the event. Sending happens elsewhere, so a slow channel costs ingest nothing.
"""

from __future__ import annotations

from datetime import datetime
from typing import cast

from sqlalchemy import Table, select
from sqlalchemy.orm import Session

from ampwatch.server import models, stopping, vitals
from ampwatch.server.alerts import _state
from ampwatch.server.alerts._clearing import cleared_before
from ampwatch.server.alerts._context import event_context, summary
from ampwatch.server.alerts._db import ACTIVE, SEVERITY_RANK, at_least, insert, steps, utc
from ampwatch.server.alerts._rules import applies, enabled_rules, project_of

LIVENESS_TYPES = ("run_crashed", "run_stalled")


def on_batch(
    session: Session,
    *,
    run: models.Run,
    events: list[models.Event],
    new_step: int | None,
    status: str | None,
    stamp: datetime,
) -> None:
    """Track step progress, resume a run the server had declared crashed or stalled, apply event rules."""
    liveness = ensure_liveness(session, run.id)
    detected = liveness.detected
    advanced = _track_steps(liveness, new_step, stamp, sample=detected != "stalled")
    for event in events:
        if event.type == "skipped_step" and (event.details or {}).get("calibration"):
            liveness.calibrated_step = max(event.step, liveness.calibrated_step or 0)
    if detected == "crashed" or (detected == "stalled" and (advanced or status is not None)):
        _resume(session, run, liveness, status=status, advanced=advanced, stamp=stamp)
    if events:
        apply_event_rules(session, run=run, events=events, stamp=stamp)


def ensure_liveness(session: Session, run_id: str) -> models.RunLiveness:
    """The run's liveness row, created if missing (safe when two processes race to create it)."""
    row = session.get(models.RunLiveness, run_id)
    if row is None:
        session.execute(
            insert(session, cast(Table, models.RunLiveness.__table__)).values(run_id=run_id).on_conflict_do_nothing()
        )
        row = session.get(models.RunLiveness, run_id)
    assert row is not None
    return row


def _track_steps(liveness: models.RunLiveness, new_step: int | None, stamp: datetime, *, sample: bool) -> bool:
    if new_step is None or (liveness.last_step is not None and new_step <= liveness.last_step):
        return False
    if sample and liveness.last_step is not None and liveness.last_step_at is not None:
        per_step = (stamp - utc(liveness.last_step_at)).total_seconds() / (new_step - liveness.last_step)
        old = liveness.step_time_s
        liveness.step_time_s = per_step if old is None else 0.8 * old + 0.2 * per_step
    liveness.last_step, liveness.last_step_at = new_step, stamp
    return True


def _resume(
    session: Session,
    run: models.Run,
    liveness: models.RunLiveness,
    *,
    status: str | None,
    advanced: bool,
    stamp: datetime,
) -> None:
    kind, liveness.detected = liveness.detected, None
    if status is None:
        run.status, run.finished_at = "running", None
    if kind == "crashed":
        reason = f"The run is reporting again (last step {steps(run.last_step)})."
    elif advanced:
        reason = f"Steps advance again: step {steps(run.last_step)}."
    else:
        reason = f"The run ended ({status}) at step {steps(run.last_step)}."
    R, A = models.AlertRule, models.Alert
    query = (
        select(A)
        .join(R, A.rule_id == R.id)
        .where(A.run_id == run.id, A.state.in_(ACTIVE), R.event_type.in_(LIVENESS_TYPES))
    )
    for alert in session.scalars(query).all():
        if alert.state == "pending":
            _state.drop_pending(session, alert)
        else:
            _state.resolve(session, alert, step=run.last_step, reason=reason, stamp=stamp)


def apply_event_rules(session: Session, *, run: models.Run, events: list[models.Event], stamp: datetime) -> None:
    """Open or update the alert of every enabled event rule an event matches."""
    rules = enabled_rules(session, kinds=("event",))
    wanted = {r.event_type for r in rules}
    events = [e for e in events if e.type in wanted]
    if not events:
        return
    project = project_of(session, run)
    session.flush()  # the batch's points are visible to the context queries
    # Critical events first, so an inhibiting alert (a collapse) is open before the lesser ones it suppresses.
    for event in sorted(events, key=lambda e: (-SEVERITY_RANK[e.severity], e.step)):
        for rule in rules:
            if (
                rule.event_type == event.type
                and at_least(event.severity, rule.min_event_severity)
                and applies(rule, project)
            ):
                _open(session, rule, run, project, event, stamp)


def _open(
    session: Session, rule: models.AlertRule, run: models.Run, project: str, event: models.Event, stamp: datetime
) -> None:
    details = event_context(session, run_id=run.id, rank=event.rank, event=event)
    text = summary(event.type, details, project, run.name, event.step)
    A = models.Alert
    key_rank = event.rank if rule.per_rank else -1
    active = session.scalars(
        select(A).where(A.rule == rule.name, A.run_id == run.id, A.rank == key_rank, A.state.in_(ACTIVE))
    ).first()
    severity = min(rule.severity, event.severity, key=SEVERITY_RANK.__getitem__)  # (a warning event: no critical alert)
    over = active and cleared_before(session, alert=active, event_type=event.type, run=run, step=event.step)
    if active and over:  # (its condition cleared before this event, counted in steps: this is a new alert)
        _state.clear(session, active, rule, step=event.step, reason=over, stamp=stamp)
    elif active and SEVERITY_RANK[severity] > SEVERITY_RANK[active.severity]:  # (told at the higher severity: anew)
        reason = f"Superseded by a {severity} {event.type} event at step {steps(event.step)}."
        if active.state == "pending":
            _state.drop_pending(session, active)
        else:
            _state.resolve(session, active, step=event.step, reason=reason, stamp=stamp)
    _state.open_or_recur(
        session,
        rule=rule,
        run_id=run.id,
        rank=event.rank,
        step=event.step,
        summary=text,
        details=details,
        stamp=stamp,
        reason=f"{event.type} event at step {steps(event.step)}",
        severity=severity,
    )


def raise_event(
    session: Session,
    *,
    run: models.Run,
    kind: str,
    severity: str,
    message: str,
    details: dict,
    stamp: datetime,
    step: int | None = None,
    rank: int = 0,
) -> None:
    """An event the server itself diagnosed (a crash, a hang, ranks out of step): stored like the agent's, then rules
    apply; at `step`, else at the run's last step; of `rank` when it is about one."""
    event = models.Event(
        run_id=run.id,
        step=step if step is not None else run.last_step or 0,
        rank=rank,
        type=kind,
        severity=severity,
        message=message,
        details=details,
        time=stamp,
    )
    session.add(event)
    run.health = vitals.worse_health(run.health, [severity])
    stopping.on_events(session, run, [event])  # (a critical the server diagnosed: agents may stop on it)
    apply_event_rules(session, run=run, events=[event], stamp=stamp)
