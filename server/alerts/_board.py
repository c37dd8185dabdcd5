"""What the alerts pages show: alerts with their run and latest notification outcome, rules as sentences."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import cast

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from ampwatch.server import models
from ampwatch.server.alerts._db import ACTIVE, utc


@dataclass(frozen=True)
class AlertRow:
    """One alert as a table row."""

    alert: models.Alert
    project: str
    run_name: str
    notified: str  # the latest notification's outcome, or why nobody was notified


def alert_rows(session: Session, *, active: bool, limit: int = 200) -> list[AlertRow]:
    """Open (pending and firing) alerts, most severe and newest first; or the latest resolved ones."""
    A, R, P = models.Alert, models.Run, models.Project
    query = select(A, P.name, R.name).join(R, R.id == A.run_id).join(P, P.id == R.project_id)
    if active:
        worst_first = case(
            {"critical": 0, "warning": 1}, value=A.severity, else_=2
        )  # (as text, info came before warning)
        query = query.where(A.state.in_(ACTIVE)).order_by(worst_first, A.started_at.desc())
    else:
        query = query.where(A.state == "resolved").order_by(A.resolved_at.desc())
    rows = session.execute(query.limit(limit)).all()
    notified = _notified(session, [alert.id for alert, _, _ in rows])
    return [AlertRow(alert, project, run_name, notified.get(alert.id, "")) for alert, project, run_name in rows]


def _notified(session: Session, alert_ids: list[int]) -> dict[int, str]:
    """Per alert: its latest flip's notification outcome, or why nobody was notified; two statements for any
    number of alerts."""
    F, D, C = models.AlertFlip, models.AlertDelivery, models.AlertChannel
    if not alert_ids:
        return {}
    latest_ids = select(func.max(F.id)).where(F.alert_id.in_(alert_ids)).group_by(F.alert_id)
    flips = list(session.scalars(select(F).where(F.id.in_(latest_ids))))
    outcomes: dict[int, list[tuple[str, str, str | None]]] = {f.id: [] for f in flips}
    query = select(D.flip_id, C.name, D.status, D.error).join(C, C.id == D.channel_id)
    for flip_id, name, status, error in session.execute(query.where(D.flip_id.in_(list(outcomes))).order_by(D.id)):
        outcomes[cast(int, flip_id)].append((name, status, error))  # (not None: the query selects by it)
    return {flip.alert_id: _outcome(flip, outcomes[flip.id]) for flip in flips}


def _outcome(flip: models.AlertFlip, outcomes: list[tuple[str, str, str | None]]) -> str:
    if flip.suppressed:
        return f"not sent: {flip.suppressed}"
    if not outcomes:
        return "no channel configured" if flip.new_state == "firing" else ""
    latest: dict[str, tuple[str, str | None]] = {}
    for name, status, error in outcomes:  # attempts in order: the last status, and the last error seen
        latest[name] = (status, error or latest.get(name, (status, None))[1])
    parts = []
    for name, (status, error) in latest.items():
        said = "retrying" if status == "queued" and error else status
        parts.append(f"{name}: {said}" + (f" ({error})" if error and status != "delivered" else ""))
    return "; ".join(parts)


def condition(rule: models.AlertRule) -> str:
    """A rule's condition as a sentence."""
    scope = f" in project {rule.project}" if rule.project else ""
    if rule.kind == "event":
        floor = f" ({rule.min_event_severity} or worse)" if rule.min_event_severity != "info" else ""
        text = f"a {rule.event_type} event{floor}"
    elif rule.kind == "event_rate":
        text = f"{rule.event_type} events in the last {rule.window_steps} steps {rule.op} {rule.threshold:g}"
    else:
        text = (
            f"{rule.aggregation} of {rule.series} over the last {rule.window_steps} steps {rule.op} {rule.threshold:g}"
        )
        if rule.ignore_steps:
            text += f", from step {rule.ignore_steps}"
    holds = []
    if rule.for_steps:
        holds.append(f"{rule.for_steps} steps")
    if rule.for_s:
        holds.append(f"{rule.for_s:g} s")
    return text + (f" for {' and '.join(holds)}" if holds else "") + scope


def since(value: datetime | None, now: datetime) -> str:
    """How long ago, briefly: 42 s, 5 min, 3 h, 2 d."""
    if value is None:
        return "–"
    seconds = max(0.0, (now - utc(value)).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"
