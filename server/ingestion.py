"""The ingest service: registering a run and storing an agent's batch, each one transaction (points, rollups,
events, the run's vitals, the point feed, and the event rules' alerts commit together)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, cast

from sqlalchemy import Table, select, text
from sqlalchemy.orm import Session

from ampwatch.server import alerts, fanout, models, partitions, rollups, stopping, vitals
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
        project_table = cast(Table, models.Project.__table__)
        session.execute(
            _insert(session, project_table).values(name=body.project, created_at=now()).on_conflict_do_nothing()
        )
        project_id = session.scalar(select(models.Project.id).where(models.Project.name == body.project))
        stamp = now()
        row = dict(
            id=run_id,
            project_id=project_id,
            status="running",
            health="ok",
            created_at=stamp,
            last_seen_at=stamp,
            name=body.name,
            config=body.config,
            environment=body.environment,
        )
        # (another rank's insert may be under way: this one then waits for it and leaves its row alone)
        created = session.execute(
            _insert(session, cast(Table, models.Run.__table__))
            .values(**row)
            .on_conflict_do_nothing()
            .returning(models.Run.id)
        )
        if created.first() is not None:
            run = cast(models.Run, session.get(models.Run, run_id))  # (just inserted)
            alerts.on_batch(session, run=run, events=[], new_step=None, status=None, stamp=stamp)  # its liveness row
            fanout.ingested(session, run_id)
            session.commit()
            return run
        run = cast(models.Run, session.get(models.Run, run_id))  # (another rank's insert: the row is there)
    run.name, run.config, run.environment = body.name, body.config, body.environment
    stopping.on_relaunch(run)
    session.commit()
    return run


def ingest_batch(session: Session, *, run_id: str, batch: BatchIn) -> BatchOut:
    """Store one batch in one transaction. A batch seen before changes nothing."""
    run = session.get(models.Run, run_id)
    if run is None:
        raise UnknownRun(run_id)
    stamp = now()
    claim = _insert(session, cast(Table, models.Batch.__table__)).values(
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
    stopping.on_events(session, run, events)
    steps = [max(s.steps) for s in batch.points.values() if s.steps] + [e.step for e in batch.events]
    if steps:
        run.last_step = max(steps + ([run.last_step] if run.last_step is not None else []))
    run.health = vitals.worse_health(run.health, [e.severity for e in batch.events])
    vitals.on_points(session, run, rank=batch.rank, points=batch.points, series_ids=series_ids)
    stopping.on_batch(run, batch.points, stamp)  # (before last_seen_at moves: the step rate's time)
    run.last_seen_at = stamp
    if batch.status is not None:
        stopping.on_status(run, batch.status, events)
        run.status = batch.status
        run.finished_at = stamp if batch.status != "running" else None
    if count:
        _append_feed(session, run_id, batch)
    skipped = batch.points.get("skipped")
    world = (run.environment or {}).get("world_size")
    if skipped is not None and skipped.steps and isinstance(world, int) and world > 1:  # (ranks must skip alike)
        alerts.compare_ranks(
            session,
            run=run,
            rank=batch.rank,
            world=world,
            skipped=(skipped.steps, skipped.values),
            series_id=series_ids["skipped"],
            stamp=stamp,
        )
    alerts.compare_params(  # (DDP's replicated parameters must be the same on every rank)
        session, run=run, rank=batch.rank, points=batch.points, series_ids=series_ids, stamp=stamp
    )
    # Event rules fire in this transaction: the alert and its queued notifications commit with the batch.
    alerts.on_batch(
        session, run=run, events=events, new_step=max(steps) if steps else None, status=batch.status, stamp=stamp
    )
    fanout.ingested(session, run_id)
    stop, critical = stopping.pending(run), stopping.latest_critical(session, run)  # (for the agent: see stopping)
    session.commit()
    return BatchOut(stored=True, points=count, stop=stop, critical=critical)


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
    " SELECT CAST(:run AS VARCHAR(64)), coalesce(max(position), 0) + 1, :rank, :first, :last"
    " FROM point_feed WHERE run_id = :run"
)


def _series_ids(session: Session, run_id: str, names: list[str]) -> dict[str, int]:
    ids = _known_series(session, run_id, names)
    missing = [n for n in names if n not in ids]
    if missing:
        rows: list[dict[str, Any]] = [{"run_id": run_id, "name": n} for n in missing]
        if partitions.partitioned(session):  # ids in the run's own partitions of points
            for row, sid in zip(rows, partitions.new_series_ids(session, run_id, len(rows))):
                row["id"] = sid
        session.execute(_insert(session, cast(Table, models.Series.__table__)).on_conflict_do_nothing(), rows)
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
        rows.append(
            models.Event(
                run_id=run_id,
                step=e.step,
                rank=batch.rank if e.rank is None else e.rank,
                type=e.type,
                severity=e.severity,
                message=e.message,
                details=e.details,
                time=time,
            )
        )
    session.add_all(rows)
    return rows
