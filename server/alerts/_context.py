"""What an alert says: a one-line summary, and the context a person needs to act (taken once, when it opens)."""

from __future__ import annotations

import statistics
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ampwatch.server import models, plan
from ampwatch.server.alerts._db import steps

_TITLES = {
    "nonfinite_loss": "{loss} loss",
    "nonfinite_param": "Non-finite parameters",
    "nonfinite_grad": "{grad} gradients",
    "scale_collapse": "Loss-scale collapse",
    "scaler_misuse": "GradScaler misuse",
    "run_crashed": "Run crashed",
    "run_stalled": "Run stalled",
    "grad_spike": "Gradient spike",
    "loss_spike": "Loss spike",
    "skipped_step": "Skipped steps",
    "amp_config": "AMP configuration problem",
    "ranks_desync": "Ranks hold different parameters",
    "leading_indicator": "Trouble ahead",
}
TREND_STEPS = 30


def summary(kind: str, details: dict[str, Any], project: str, run_name: str, step: int | None) -> str:
    """'NaN loss in llm/exp-12 at step 4 812'."""
    # (dict.get with a value that may not be a string: a miss gives the default)
    named = {"NaN": "NaN", "Infinity": "Inf", "-Infinity": "Inf"}
    grad = named.get(details.get("grad_norm"), "Non-finite")  # type: ignore[arg-type]
    title = _TITLES.get(kind, kind.replace("_", " ").capitalize()).format(
        loss=details.get("loss") or "Non-finite", grad=grad
    )
    return f"{title} in {project}/{run_name} at step {steps(step)}"


def event_context(session: Session, *, run_id: str, rank: int, event: models.Event) -> dict[str, Any]:
    """The event's classification and origin, the loss scale before and after, and the recent grad-norm trend."""
    details = event.details or {}
    context: dict[str, Any] = {
        "type": event.type,
        "event_severity": event.severity,
        "message": event.message,
        "latest_message": event.message,
        "rank": rank,
    }
    for key in ("origin", "phase", "loss", "grad_norm", "cause", "streak"):
        if details.get(key) is not None:
            context[key] = details[key]
    context.update(_scale(session, run_id, rank, event.step, details))
    trend = _trend(session, run_id, rank, event.step) or details.get("grad_norm_trend")
    if trend:
        context["grad_norm_trend"] = trend
    if plan.is_trigger(event):  # (a run it cannot train past: what to do next)
        rollback = plan.brief(plan.compute(run_id, *plan.load(session, run_id)))
        if rollback is not None:
            context["plan"] = rollback
    return context


def _scale(session: Session, run_id: str, rank: int, step: int, details: dict[str, Any]) -> dict[str, float]:
    if "scale_before" in details and "scale_after" in details:
        return {"scale_before": details["scale_before"], "scale_after": details["scale_after"]}
    if isinstance(details.get("scale"), (int, float)) and "skipped" in details:
        scale = float(details["scale"])
        return {"scale_before": scale, "scale_after": scale / 2 if details["skipped"] else scale}
    values = dict(_points(session, run_id, "scale", rank, step_from=step, limit=2))
    before, after = values.get(step), values.get(step + 1)
    found = {"scale_before": before, "scale_after": after if before is not None else None}
    return {k: v for k, v in found.items() if v is not None}


def _trend(session: Session, run_id: str, rank: int, step: int) -> dict[str, float] | None:
    """Median, last and max of the finite gradient norms of the steps just before `step`."""
    recent = [
        v for _, v in _points(session, run_id, "grad_norm", rank, step_before=step, limit=TREND_STEPS) if v is not None
    ]
    recent = [v for v in recent if v == v and abs(v) != float("inf")]
    if not recent:
        return None
    return {"median": statistics.median(recent), "last": recent[0], "max": max(recent), "steps": len(recent)}


def _points(
    session: Session,
    run_id: str,
    name: str,
    rank: int,
    *,
    step_from: int | None = None,
    step_before: int | None = None,
    limit: int,
) -> list[tuple[int, float | None]]:
    series = series_id(session, run_id=run_id, name=name)
    if series is None:
        return []
    P = models.Point
    query = select(P.step, P.value).where(P.series_id == series, P.rank == rank)
    if step_from is not None:
        query = query.where(P.step >= step_from).order_by(P.step)
    if step_before is not None:
        query = query.where(P.step < step_before).order_by(P.step.desc())
    return [(s, v) for s, v in session.execute(query.limit(limit))]


def series_id(session: Session, *, run_id: str, name: str) -> int | None:
    """The id of the run's series `name`, None if it has none."""
    return session.scalar(select(models.Series.id).where(models.Series.run_id == run_id, models.Series.name == name))


def series_tail(session: Session, series: int, *, rank: int, after: int, limit: int) -> list[tuple[int, float | None]]:
    """The latest `limit` points of a series (by id) after step `after`, newest first (NaN is None)."""
    P = models.Point
    query = select(P.step, P.value).where(P.series_id == series, P.rank == rank, P.step > after)
    return [(s, v) for s, v in session.execute(query.order_by(P.step.desc()).limit(limit))]


def series_ranks(session: Session, series: int, *, limit: int = 1024) -> list[int]:
    """The ranks that have points in a series (by id): one index seek per rank (no scan of a long series)."""
    ranks: list[int] = []
    P = models.Point
    while len(ranks) < limit:
        rank = session.scalar(
            select(func.min(P.rank)).where(P.series_id == series, P.rank > (ranks[-1] if ranks else -1))
        )
        if rank is None:
            break
        ranks.append(rank)
    return ranks
