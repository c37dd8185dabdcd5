"""The read model: what the API, the pages and the live streams read (runs, series, events, alerts)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from ampwatch.server import models, series
from ampwatch.server.db import IDS_PER_QUERY, now  # noqa: F401  (now: the pages' clock)


def run_ranks(session: Session, *, run_id: str) -> list[int]:
    """The ranks the run has sent batches from, in order: one primary-key seek per rank."""
    rows = session.execute(
        text(
            "WITH RECURSIVE r(rank) AS (SELECT min(rank) FROM batches WHERE run_id = :run"
            " UNION ALL SELECT (SELECT min(rank) FROM batches WHERE run_id = :run AND rank > r.rank)"
            " FROM r WHERE r.rank IS NOT NULL)"
            " SELECT rank FROM r WHERE rank IS NOT NULL"
        ),
        {"run": run_id},
    )
    return [r[0] for r in rows]


def feed_position(session: Session, *, run_id: str) -> int:
    """The run's last point-feed position, 0 before its first points (where a live stream starts)."""
    return session.scalar(select(func.max(models.PointFeed.position)).where(models.PointFeed.run_id == run_id)) or 0


def list_runs(
    session: Session,
    *,
    project: str | None = None,
    status: str | None = None,
    search: str | None = None,
    seen_after: datetime | None = None,
) -> list[tuple[models.Run, str]]:
    """Every matching run with its project's name, newest first (the runs stream's look; pages use
    `ampwatch.server.runlist`); `search` matches part of the run's name, `seen_after` keeps runs heard from since."""
    query = select(models.Run, models.Project.name).join(models.Project)
    query = query.order_by(models.Run.created_at.desc(), models.Run.id.desc())
    if project is not None:
        query = query.where(models.Project.name == project)
    if status is not None:
        query = query.where(models.Run.status == status)
    if search:
        query = query.where(models.Run.name.contains(search, autoescape=True))
    if seen_after is not None:
        query = query.where(models.Run.last_seen_at > seen_after)
    return [(run, name) for run, name in session.execute(query)]


def runs_alerted_after(session: Session, *, after: datetime) -> list[str]:
    """The runs with an alert that changed after `after` (by the `updated_at` index)."""
    query = select(models.Alert.run_id).where(models.Alert.updated_at > after).distinct()
    return list(session.scalars(query))


def project_names(session: Session) -> list[str]:
    """Every project's name, sorted."""
    return list(session.scalars(select(models.Project.name).order_by(models.Project.name)))


def get_run(session: Session, *, run_id: str) -> tuple[models.Run, str] | None:
    """One run and its project's name, or None."""
    query = select(models.Run, models.Project.name).join(models.Project).where(models.Run.id == run_id)
    row = session.execute(query).first()
    return (row[0], row[1]) if row else None


def get_runs(session: Session, *, run_ids: list[str]) -> list[tuple[models.Run, str]]:
    """The runs of `run_ids` that exist, with their project's name, in the order asked; one statement."""
    query = select(models.Run, models.Project.name).join(models.Project).where(models.Run.id.in_(run_ids))
    found = {run.id: (run, name) for run, name in session.execute(query)}
    return [found[r] for r in run_ids if r in found]


def series_names_of(session: Session, *, run_ids: list[str]) -> list[str]:
    """The names of the series any of these runs has, sorted, once each; one statement."""
    query = select(models.Series.name).where(models.Series.run_id.in_(run_ids)).distinct()
    return sorted(session.scalars(query))


def series_names(session: Session, *, run_id: str) -> list[str]:
    """Names of every series the run has, sorted."""
    return list(
        session.scalars(select(models.Series.name).where(models.Series.run_id == run_id).order_by(models.Series.name))
    )


def read_series(
    session: Session,
    *,
    run_id: str,
    names: list[str],
    rank: int = 0,
    max_points: int | None = None,
    start: int | None = None,
    end: int | None = None,
) -> dict[str, tuple[list[int], list[float | None]]]:
    """Each named series as (steps, values) in step order, within [start, end]; NaN is None. Unknown names
    are empty. With `max_points`, downsampled in SQL keeping per-bucket extremes and every non-finite point."""
    ids = _series_ids_of(session, run_id, names)
    return {
        name: series.read_series(session, series_id=ids[name], rank=rank, start=start, end=end, max_points=max_points)
        if name in ids
        else ([], [])
        for name in names
    }


def _series_ids_of(session: Session, run_id: str, names: list[str]) -> dict[str, int]:
    query = select(models.Series.name, models.Series.id).where(
        models.Series.run_id == run_id, models.Series.name.in_(names)
    )
    return dict(session.execute(query).all())


def layer_heatmap(
    session: Session,
    *,
    run_id: str,
    prefix: str,
    rank: int = 0,
    columns: int = 300,
    start: int | None = None,
    end: int | None = None,
) -> dict[str, Any]:
    """Series named `prefix…` (e.g. `grad_norm/`) as a layer × step grid, layers in natural order; see `series.grid`."""
    query = select(models.Series.name, models.Series.id).where(
        models.Series.run_id == run_id, models.Series.name.startswith(prefix, autoescape=True)
    )
    found = sorted(
        ((n[len(prefix) :], i) for n, i in session.execute(query)), key=lambda row: series.natural_key(row[0])
    )
    return series.grid(session, layers=found, rank=rank, columns=columns, start=start, end=end)


def list_events(session: Session, *, run_id: str, limit: int = 1000, after_id: int | None = None) -> list[models.Event]:
    """The run's newest `limit` events in step order; with `after_id`, the first `limit` stored after that
    event, in id order."""
    if (
        after_id is not None
    ):  # walk the primary key from `after_id` (run_id || '' keeps the planner off the run's index)
        query = (
            select(models.Event)
            .where((models.Event.run_id + "") == run_id, models.Event.id > after_id)
            .order_by(models.Event.id)
        )
        return list(session.scalars(query.limit(limit)))
    newest = (
        select(models.Event)
        .where(models.Event.run_id == run_id)
        .order_by(models.Event.step.desc(), models.Event.id.desc())
    )
    return list(reversed(session.scalars(newest.limit(limit)).all()))


def resume_steps(session: Session, *, run_id: str, rank: int) -> list[int]:
    """The steps at which launches of the run resumed on `rank` (the agent's `amp_config` info event with
    `details["check"] == "resumed"`, at the resumed launch's first step), ascending."""
    query = select(models.Event.step, models.Event.details).where(
        models.Event.run_id == run_id,
        models.Event.rank == rank,
        models.Event.type == "amp_config",
        models.Event.severity == "info",
    )
    return sorted({step for step, details in session.execute(query) if (details or {}).get("check") == "resumed"})


def last_event_id(session: Session, *, run_id: str) -> int:
    """The id of the run's newest event, 0 when it has none (where a live stream starts)."""
    return session.scalar(select(func.max(models.Event.id)).where(models.Event.run_id == run_id)) or 0


def count_events(session: Session, *, run_id: str) -> dict[str, int]:
    """How many events of each type the run has."""
    query = select(models.Event.type, func.count()).where(models.Event.run_id == run_id).group_by(models.Event.type)
    return dict(session.execute(query).all())


def list_alerts(session: Session, *, run_id: str | None = None, state: str | None = None) -> list[models.Alert]:
    """Alerts, newest first, optionally of one run and one state (without one: firing and resolved)."""
    query = select(models.Alert).order_by(models.Alert.started_at.desc())
    if run_id is not None:
        query = query.where(models.Alert.run_id == run_id)
    # The API's alerts are firing or resolved; pending ones (waiting out a rule's `for`) only when asked for.
    query = (
        query.where(models.Alert.state == state) if state is not None else query.where(models.Alert.state != "pending")
    )
    return list(session.scalars(query))
