"""The alert lifecycle: open, recur, fire, resolve, remind.

Every change is a guarded INSERT (one active alert per (rule, run, rank), by a unique partial index) or a
conditional UPDATE (`WHERE state = <the state we saw>`), so with several server processes on one database
each change happens exactly once. Each change is a flip row; the notifications it causes are delivery rows
queued in the same transaction.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, Table, delete, or_, select, update
from sqlalchemy.orm import Session

from ampwatch.server import models
from ampwatch.server.alerts._db import ACTIVE, SEVERITY_RANK, WAKE, at_least, insert, utc
from ampwatch.server.models import Alert


def open_or_recur(
    session: Session,
    *,
    rule: models.AlertRule,
    run_id: str,
    rank: int,
    step: int | None,
    summary: str,
    details: dict[str, Any],
    stamp: datetime,
    reason: str,
    occurrence: bool = True,
    severity: str | None = None,
) -> tuple[Alert, bool]:
    """The active alert of (rule, run, rank): opened now (True), or the one already active with this
    occurrence counted again (False) — repeated NaNs update one alert instead of flooding. A windowed rule's
    re-evaluation is not a new `occurrence`. A new alert has `severity`, else the rule's."""
    key_rank = rank if rule.per_rank else -1
    for _ in range(3):  # the active alert can resolve between our INSERT and SELECT: try again
        alert = _try_open(session, rule, run_id, key_rank, step, summary, details, stamp, severity or rule.severity)
        if alert is not None:
            flip(session, alert, None, alert.state, step=step, reason=reason, stamp=stamp)
            return alert, True
        query = select(Alert).where(
            Alert.rule == rule.name, Alert.run_id == run_id, Alert.rank == key_rank, Alert.state.in_(ACTIVE)
        )
        alert = session.scalars(query.with_for_update().execution_options(populate_existing=True)).first()
        if alert is not None:
            recur(alert, step=step, details=details, stamp=stamp, occurrence=occurrence)
            return alert, False
    raise RuntimeError(f"could not open or find the active {rule.name} alert of run {run_id}")


def _try_open(
    session: Session,
    rule: models.AlertRule,
    run_id: str,
    rank: int,
    step: int | None,
    summary: str,
    details: dict[str, Any],
    stamp: datetime,
    severity: str,
) -> Alert | None:
    state = "pending" if rule.for_s > 0 or rule.for_steps > 0 else "firing"
    values = dict(
        run_id=run_id,
        rule=rule.name,
        rule_id=rule.id,
        severity=severity,
        state=state,
        started_at=stamp,
        resolved_at=None,
        summary=summary,
        rank=rank,
        step=step,
        last_step=step,
        count=1,
        fired_at=stamp if state == "firing" else None,
        cleared_at=None,
        last_notified_at=None,
        updated_at=stamp,
        details=details,
    )
    stmt = (
        insert(session, cast(Table, Alert.__table__))
        .values(**values)
        .on_conflict_do_nothing(index_elements=["rule", "run_id", "rank"], index_where=models.ACTIVE_ALERT)
    )
    new_id = session.execute(stmt.returning(Alert.id)).scalar()
    return session.get(Alert, new_id) if new_id is not None else None


def recur(alert: Alert, *, step: int | None, details: dict[str, Any], stamp: datetime, occurrence: bool = True) -> None:
    """The condition of an active alert holds again: count the occurrence, keep what is new (e.g. the origin)."""
    alert.count += 1 if occurrence else 0
    if step is not None and (alert.last_step is None or step > alert.last_step):
        alert.last_step = step
    alert.cleared_at = None
    alert.updated_at = stamp
    merged = dict(alert.details)
    for key, value in details.items():
        if key not in merged or key in ("latest_message", "value"):
            merged[key] = value
    alert.details = merged


def fire(session: Session, alert: Alert, *, step: int | None, reason: str, stamp: datetime) -> bool:
    """pending → firing, once."""
    return transition(session, alert, "firing", step=step, reason=reason, stamp=stamp, fired_at=stamp)


def resolve(session: Session, alert: Alert, *, step: int | None, reason: str, stamp: datetime) -> bool:
    """firing → resolved, once; people who were told it fired are told it resolved."""
    return transition(session, alert, "resolved", step=step, reason=reason, stamp=stamp, resolved_at=stamp)


def transition(
    session: Session, alert: Alert, new: str, *, step: int | None, reason: str, stamp: datetime, **values: Any
) -> bool:
    """Move `alert` from the state we saw to `new` unless another process already moved it; flip on success."""
    old = alert.state
    done = session.execute(
        update(Alert)
        .where(Alert.id == alert.id, Alert.state == old)
        .values(state=new, updated_at=stamp, **values)
        .execution_options(synchronize_session=False)
    )
    if cast(CursorResult[Any], done).rowcount != 1:
        session.expire(alert)
        return False
    session.expire(alert)
    flip(session, alert, old, new, step=step, reason=reason, stamp=stamp)
    return True


def drop_pending(session: Session, alert: Alert) -> None:
    """A pending alert whose condition went away never existed for anyone: remove it (as Prometheus does)."""
    session.execute(
        delete(Alert).where(Alert.id == alert.id, Alert.state == "pending").execution_options(synchronize_session=False)
    )
    session.expire(alert)


def clear(
    session: Session, alert: Alert, rule: models.AlertRule | None, *, step: int | None, reason: str, stamp: datetime
) -> bool:
    """The condition is false now: drop a pending alert; resolve a firing one after `keep_firing_for`."""
    if alert.state == "pending":
        drop_pending(session, alert)
        return True
    if alert.cleared_at is None:
        alert.cleared_at = stamp
    keep_s = rule.keep_firing_for_s if rule is not None else 0.0
    if (stamp - utc(alert.cleared_at)).total_seconds() < keep_s:
        return False
    return resolve(session, alert, step=step, reason=reason, stamp=stamp)


def remind(session: Session, alert: Alert, rule: models.AlertRule | None, *, stamp: datetime) -> bool:
    """A reminder flip when a firing alert was last notified `repeat_interval` ago; once across processes."""
    if rule is None or not rule.repeat_interval_s or alert.state != "firing":
        return False
    due = stamp - timedelta(seconds=rule.repeat_interval_s)
    last = alert.last_notified_at or alert.fired_at
    if last is None or utc(last) > due:
        return False
    done = session.execute(
        update(Alert)
        .where(
            Alert.id == alert.id,
            Alert.state == "firing",
            or_(Alert.last_notified_at.is_(None), Alert.last_notified_at <= due),
        )
        .values(last_notified_at=stamp)
        .execution_options(synchronize_session=False)
    )
    session.expire(alert)
    if cast(CursorResult[Any], done).rowcount != 1:
        return False
    flip(session, alert, "firing", "firing", step=alert.last_step, reason="reminder: still firing", stamp=stamp)
    return True


def unsuppress(session: Session, alert: Alert, *, stamp: datetime) -> bool:
    """A firing alert nobody was notified of (a silence or a more important alert held it back) is notified once
    nothing holds it back any more (as Alertmanager does); once across processes."""
    if alert.state != "firing" or alert.last_notified_at is not None:
        return False
    F = models.AlertFlip
    last = session.scalars(select(F.suppressed).where(F.alert_id == alert.id).order_by(F.id.desc()).limit(1)).first()
    if last is None:  # (not held back: nobody was notified because no channel takes it)
        return False
    project = _project(session, alert.run_id)
    if _suppressed_by(session, alert, project, stamp) is not None:
        return False
    done = session.execute(
        update(Alert)
        .where(Alert.id == alert.id, Alert.state == "firing", Alert.last_notified_at.is_(None))
        .values(last_notified_at=stamp)
        .execution_options(synchronize_session=False)
    )
    session.expire(alert)
    if cast(CursorResult[Any], done).rowcount != 1:
        return False
    row = models.AlertFlip(
        alert_id=alert.id,
        created_at=stamp,
        old_state="firing",
        new_state="firing",
        step=alert.last_step,
        reason="no longer silenced or inhibited: still firing",
        suppressed=None,
    )
    session.add(row)
    session.flush()
    _queue(session, row, alert, project, stamp)
    return True


def flip(
    session: Session, alert: Alert, old: str | None, new: str, *, step: int | None, reason: str, stamp: datetime
) -> models.AlertFlip:
    """Record a state change; queue notifications for it unless a silence or a more important alert suppresses it."""
    row = models.AlertFlip(
        alert_id=alert.id, created_at=stamp, old_state=old, new_state=new, step=step, reason=reason, suppressed=None
    )
    session.add(row)
    session.flush()
    notify = new == "firing" or (new == "resolved" and old == "firing" and alert.last_notified_at is not None)
    if not notify:
        return row
    project = _project(session, alert.run_id)
    row.suppressed = _suppressed_by(session, alert, project, stamp) if new == "firing" else None
    if row.suppressed is None and _queue(session, row, alert, project, stamp) and new == "firing":
        alert.last_notified_at = stamp
    return row


def _suppressed_by(session: Session, alert: Alert, project: str, stamp: datetime) -> str | None:
    S = models.AlertSilence
    silence = session.scalars(
        select(S)
        .where(
            S.starts_at <= stamp,
            S.ends_at > stamp,
            or_(S.run_id.is_(None), S.run_id == alert.run_id),
            or_(S.project.is_(None), S.project == project),
            or_(S.rule.is_(None), S.rule == alert.rule),
        )
        .limit(1)
    ).first()
    if silence is not None:
        return f"silenced by silence #{silence.id} until {utc(silence.ends_at):%Y-%m-%d %H:%M} UTC"
    inhibitors = session.execute(
        select(Alert.id, Alert.rule, Alert.severity)
        .join(models.AlertRule, Alert.rule_id == models.AlertRule.id)
        .where(Alert.run_id == alert.run_id, Alert.state == "firing", Alert.id != alert.id, models.AlertRule.inhibits)
    ).all()
    for other_id, other_rule, severity in inhibitors:
        if SEVERITY_RANK[severity] > SEVERITY_RANK[alert.severity]:
            return f"inhibited by the firing {other_rule} alert #{other_id}"
    return None


def _queue(session: Session, row: models.AlertFlip, alert: Alert, project: str, stamp: datetime) -> int:
    C = models.AlertChannel
    channels = [
        c
        for c in session.scalars(select(C).where(C.enabled))
        if at_least(alert.severity, c.min_severity) and (c.project is None or c.project == project)
    ]
    for channel in channels:
        session.add(
            models.AlertDelivery(
                flip_id=row.id,
                channel_id=channel.id,
                attempt=1,
                status="queued",
                due_at=stamp,
                created_at=stamp,
                claimed_at=None,
                finished_at=None,
                response_status=None,
                error=None,
            )
        )
    if channels:
        session.info[WAKE] = True
    return len(channels)


def _project(session: Session, run_id: str) -> str:
    query = (
        select(models.Project.name)
        .join(models.Run, models.Run.project_id == models.Project.id)
        .where(models.Run.id == run_id)
    )
    return session.scalar(query) or ""
