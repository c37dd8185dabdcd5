"""Data functions: everything the routers and pages read or write goes through here."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from ampwatch.server import alerts, fanout, models, rollups, series, vitals
from ampwatch.server.db import IDS_PER_QUERY, now
from ampwatch.server.db import insert as _insert
from ampwatch.server.schemas import BatchIn, BatchOut, RunIn
from ampwatch.server.values import to_db


class UnknownRun(LookupError):
    """The run id was never registered."""


def register_run(session: Session, *, run_id: str, body: RunIn) -> models.Run:
    """Create the run (and its project) or refresh its metadata; the same request twice is harmless, and so are
    the ranks of one launch sending it at once. A run stays in the project it was created in."""
    run = session.get(models.Run, run_id)
    if run is None:
        project_table = models.Project.__table__
        session.execute(
            _insert(session, project_table).values(name=body.project, created_at=now()).on_conflict_do_nothing()
        )
        project_id = session.scalar(select(models.Project.id).where(models.Project.name == body.project))
        stamp = now()
        row = dict(id=run_id, project_id=project_id, status="running", health="ok", created_at=stamp, last_seen_at=stamp,
                   name=body.name, config=body.config, environment=body.environment)  # fmt: skip
        # (another rank's insert may be under way: this one then waits for it and leaves its row alone)
        created = session.execute(
            _insert(session, models.Run.__table__).values(**row).on_conflict_do_nothing().returning(models.Run.id)
        )
        if created.first() is not None:
            run = session.get(models.Run, run_id)
            alerts.on_batch(session, run=run, events=[], new_step=None, status=None, stamp=stamp)  # its liveness row
            fanout.ingested(session, run_id)
            session.commit()
            return run  # type: ignore[return-value]
        run = session.get(models.Run, run_id)
    run.name, run.config, run.environment = body.name, body.config, body.environment  # type: ignore[union-attr]
    session.commit()
    return run  # type: ignore[return-value]


def ingest_batch(session: Session, *, run_id: str, batch: BatchIn) -> BatchOut:
    """Store one batch in one transaction. A batch seen before changes nothing."""
    run = session.get(models.Run, run_id)
    if run is None:
        raise UnknownRun(run_id)
    stamp = now()
    claim = _insert(session, models.Batch.__table__).values(
        run_id=run_id, rank=batch.rank, seq=batch.seq, received_at=stamp
    )
    if session.execute(claim.on_conflict_do_nothing().returning(models.Batch.seq)).first() is None:
        session.rollback()
        return BatchOut(stored=False, points=0)
    # The run as of now, locked until commit: read before the claim, it may predate a batch committed
    # meanwhile by another rank or server process, and would move last_step back or soften health.
    # FOR NO KEY UPDATE: compatible with the key-share lock the batch's foreign key took, so two batches of a
    # run queue here instead of deadlocking. The lock also orders the point feed (see _append_feed).
    session.refresh(run, with_for_update={"key_share": True})
    count, series_ids = _store_points(session, run_id, batch)
    events = _store_events(session, run_id, batch, stamp)
    steps = [max(s.steps) for s in batch.points.values() if s.steps] + [e.step for e in batch.events]
    if steps:
        run.last_step = max(steps + ([run.last_step] if run.last_step is not None else []))
    run.health = vitals.worse_health(run.health, [e.severity for e in batch.events])
    vitals.on_points(session, run, rank=batch.rank, points=batch.points, series_ids=series_ids)
    run.last_seen_at = stamp
    if batch.status is not None:
        run.status = batch.status
        run.finished_at = stamp if batch.status != "running" else None
    if count:
        _append_feed(session, run_id, batch)
    skipped = batch.points.get("skipped")
    world = (run.environment or {}).get("world_size")
    if skipped is not None and skipped.steps and isinstance(world, int) and world > 1:  # (ranks must skip alike)
        alerts.compare_ranks(session, run=run, rank=batch.rank, world=world, skipped=(skipped.steps, skipped.values),
                             series_id=series_ids["skipped"], stamp=stamp)  # fmt: skip
    # Event rules fire in this transaction: the alert and its queued notifications commit with the batch.
    alerts.on_batch(
        session, run=run, events=events, new_step=max(steps) if steps else None, status=batch.status, stamp=stamp
    )
    fanout.ingested(session, run_id)
    session.commit()
    return BatchOut(stored=True, points=count)


def _store_points(session: Session, run_id: str, batch: BatchIn) -> tuple[int, dict[str, int]]:
    """Upsert the batch's points in one statement and keep their blocks' rollups right. The same
    (series, rank, step) sent again replaces the value: a user's log overrides the agent's. Written below
    the ORM, whose per-row work would cost more than the database's (bench/ingest.py)."""
    if not batch.points:
        return 0, {}
    ids = _series_ids(session, run_id, list(batch.points))
    written = {ids[name]: (points.steps, [to_db(v) for v in points.values]) for name, points in batch.points.items()}
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        columns: tuple[list[Any], ...] = ([], [], [])
        for sid, (steps, values) in written.items():
            if len(set(steps)) < len(steps):  # one statement may touch a row once: the last value wins
                last = dict(zip(steps, values))
                steps, values = list(last), list(last.values())
            columns[0].extend([sid] * len(steps))
            columns[1].extend(steps)
            columns[2].extend(values)
        connection.exec_driver_sql(_PG_UPSERT, (columns[0], [batch.rank] * len(columns[0]), columns[1], columns[2]))
        count = len(columns[0])
    else:
        rank = batch.rank
        rows = [
            (sid, rank, step, value) for sid, (steps, values) in written.items() for step, value in zip(steps, values)
        ]
        if rows:  # (sqlite3 runs an executemany of no rows once, without parameters)
            connection.exec_driver_sql(_SQLITE_UPSERT, rows)
        count = len(rows)
    rollups.update_blocks(session, rank=batch.rank, written=written)
    return count, ids


_UPSERT = "ON CONFLICT (series_id, rank, step) DO UPDATE SET value = excluded.value"
_SQLITE_UPSERT = f"INSERT INTO points (series_id, rank, step, value) VALUES (?, ?, ?, ?) {_UPSERT}"
_PG_UPSERT = (
    "INSERT INTO points (series_id, rank, step, value) "
    f"SELECT * FROM unnest(%s::integer[], %s::integer[], %s::bigint[], %s::float8[]) {_UPSERT}"
)


def _append_feed(session: Session, run_id: str, batch: BatchIn) -> None:
    """Number the batch in the run's point feed under the run row's lock (ingest_batch holds it until commit;
    SQLite has one writer anyway), so another batch of this run takes the next number only after this one
    committed, and a live stream reading the feed in order misses nothing (see routers/stream.py)."""
    steps = [s for p in batch.points.values() for s in (min(p.steps), max(p.steps)) if p.steps]
    session.execute(_FEED, {"run": run_id, "rank": batch.rank, "first": min(steps), "last": max(steps)})


_FEED = text(
    "INSERT INTO point_feed (run_id, position, rank, first_step, last_step)"
    " SELECT CAST(:run AS VARCHAR(64)), coalesce(max(position), 0) + 1, :rank, :first, :last FROM point_feed WHERE run_id = :run"
)


def run_ranks(session: Session, *, run_id: str) -> list[int]:
    """The ranks the run has sent batches from, in order: one primary-key seek per rank."""
    rows = session.execute(text(
        "WITH RECURSIVE r(rank) AS (SELECT min(rank) FROM batches WHERE run_id = :run"
        " UNION ALL SELECT (SELECT min(rank) FROM batches WHERE run_id = :run AND rank > r.rank) FROM r WHERE r.rank IS NOT NULL)"
        " SELECT rank FROM r WHERE rank IS NOT NULL"
    ), {"run": run_id})  # fmt: skip
    return [r[0] for r in rows]


def feed_position(session: Session, *, run_id: str) -> int:
    """The run's last point-feed position, 0 before its first points (where a live stream starts)."""
    return session.scalar(select(func.max(models.PointFeed.position)).where(models.PointFeed.run_id == run_id)) or 0


def _series_ids(session: Session, run_id: str, names: list[str]) -> dict[str, int]:
    ids = _known_series(session, run_id, names)
    missing = [n for n in names if n not in ids]
    if missing:
        session.execute(
            _insert(session, models.Series.__table__).on_conflict_do_nothing(),
            [{"run_id": run_id, "name": n} for n in missing],
        )
        ids.update(_known_series(session, run_id, missing))
    return ids


def _known_series(session: Session, run_id: str, names: list[str]) -> dict[str, int]:
    """The ids of those of `names` the run has (looked up in chunks: see IDS_PER_QUERY)."""
    ids: dict[str, int] = {}
    for i in range(0, len(names), IDS_PER_QUERY):
        chunk = models.Series.name.in_(names[i : i + IDS_PER_QUERY])
        ids.update(
            session.execute(
                select(models.Series.name, models.Series.id).where(models.Series.run_id == run_id, chunk)
            ).all()
        )
    return ids


def _store_events(session: Session, run_id: str, batch: BatchIn, stamp: datetime) -> list[models.Event]:
    rows = []
    for e in batch.events:
        time = datetime.fromtimestamp(e.time, timezone.utc) if e.time is not None else stamp
        rows.append(models.Event(
            run_id=run_id, step=e.step, rank=batch.rank if e.rank is None else e.rank, type=e.type,
            severity=e.severity, message=e.message, details=e.details, time=time,
        ))  # fmt: skip
    session.add_all(rows)
    return rows


def list_runs(
    session: Session, *, project: str | None = None, status: str | None = None, search: str | None = None,
    seen_after: datetime | None = None,
) -> list[tuple[models.Run, str]]:  # fmt: skip
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
    session: Session, *, run_id: str, names: list[str], rank: int = 0, max_points: int | None = None,
    start: int | None = None, end: int | None = None,
) -> dict[str, tuple[list[int], list[float | None]]]:  # fmt: skip
    """Each named series as (steps, values) in step order, within [start, end]; NaN is None. Unknown names
    are empty. With `max_points`, downsampled in SQL keeping per-bucket extremes and every non-finite point."""
    ids = _series_ids_of(session, run_id, names)
    return {
        name: series.read_series(session, series_id=ids[name], rank=rank, start=start, end=end, max_points=max_points)
        if name in ids else ([], [])
        for name in names
    }  # fmt: skip


def _series_ids_of(session: Session, run_id: str, names: list[str]) -> dict[str, int]:
    query = select(models.Series.name, models.Series.id).where(
        models.Series.run_id == run_id, models.Series.name.in_(names)
    )
    return dict(session.execute(query).all())  # type: ignore[arg-type]


def layer_heatmap(
    session: Session, *, run_id: str, prefix: str, rank: int = 0, columns: int = 300,
    start: int | None = None, end: int | None = None,
) -> dict[str, Any]:  # fmt: skip
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
    # PRODUCT.md's alerts are firing or resolved; pending ones (waiting out a rule's `for`) only when asked for.
    query = (
        query.where(models.Alert.state == state) if state is not None else query.where(models.Alert.state != "pending")
    )
    return list(session.scalars(query))
