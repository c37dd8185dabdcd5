"""Deleting runs, one or by age (retention), in short transactions.

A run's rows go chunk by chunk, each chunk its own transaction of about `Settings.delete_chunk_rows` rows,
so ingest of other runs waits at most one chunk for the database (SQLite has one writer; Postgres locks only
the rows deleted). On Postgres a run's points are partitions of their own (see `partitions`): they are
truncated at once, and dropped once the run's row is gone. The run's row goes last, with what is left (cascading
foreign keys): ingest of the run itself waits for that transaction, then finds no run (404).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, select, text
from sqlalchemy.orm import Session, sessionmaker

from ampwatch.server import models, partitions, queries
from ampwatch.server.db import now, utc

# (table, the key it is deleted in order of) for the rows a series owns; then the rows the run owns by id
_SERIES_TABLES = (("points", "step"), ("point_blocks", "block"))
_RUN_TABLES = (("events", "step"), ("point_feed", "position"))


def describe(run: models.Run, project: str) -> dict[str, Any]:
    """A deleted (or to be deleted) run as the API shows it."""
    return {"id": run.id, "project": project, "name": run.name, "created_at": utc(run.created_at).isoformat()}


def stale_runs(session: Session, *, older_than_s: float, project: str | None) -> list[tuple[models.Run, str]]:
    """Runs not heard from for `older_than_s` seconds (of `project`, else of every project), oldest first."""
    cutoff: datetime = now() - timedelta(seconds=older_than_s)
    query = select(models.Run, models.Project.name).join(models.Project).where(models.Run.last_seen_at < cutoff)
    if project is not None:
        query = query.where(models.Project.name == project)
    return [(run, name) for run, name in session.execute(query.order_by(models.Run.last_seen_at, models.Run.id))]


def delete_run(sessions: sessionmaker[Session], run_id: str, chunk_rows: int) -> bool:
    """Remove the run and everything it has (points, rollups, series, events, batches, alerts and their
    notifications, liveness); False when there was no such run."""
    with sessions() as session:
        series_ids = list(session.scalars(select(models.Series.id).where(models.Series.run_id == run_id)))
        ranks = queries.run_ranks(session, run_id=run_id)
        engine = session.get_bind()
        blocks = partitions.run_blocks(session, run_id) if partitions.partitioned(session) else []
    assert isinstance(engine, Engine)
    # Postgres: the run's points are its own partitions, emptied at once; the rows in shared tables go in chunks.
    partitions.truncate(engine, blocks)
    in_partitions = {sid for sid in series_ids if sid // partitions.SERIES_BLOCK in blocks}
    for rank in ranks:
        for sid in series_ids:
            for table, key in _SERIES_TABLES:
                if table == "points" and sid in in_partitions:
                    continue
                _delete_in_chunks(engine, chunk_rows, table, key, "series_id = :s AND rank = :k", {"s": sid, "k": rank})
        _delete_in_chunks(engine, chunk_rows, "batches", "seq", "run_id = :r AND rank = :k", {"r": run_id, "k": rank})
    for table, key in _RUN_TABLES:
        _delete_in_chunks(engine, chunk_rows, table, key, "run_id = :r", {"r": run_id})
    with engine.begin() as connection:  # the rest (series, alerts, feed, liveness) cascades from the run's row
        deleted = connection.execute(text("DELETE FROM runs WHERE id = :r"), {"r": run_id}).rowcount == 1
    partitions.drop(engine, blocks)
    return deleted


def _delete_in_chunks(
    engine: Engine, chunk_rows: int, table: str, key: str, where: str, params: dict[str, Any]
) -> None:
    """Delete the rows of `table` matching `where`, about `chunk_rows` at a time in order of `key` (which follows
    `where`'s columns in an index), each chunk its own transaction."""
    cut = text(f"SELECT {key} FROM {table} WHERE {where} ORDER BY {key} LIMIT 1 OFFSET :n")
    while True:
        with engine.begin() as connection:
            edge = connection.scalar(cut, {**params, "n": chunk_rows - 1})
            bound = f" AND {key} <= :edge" if edge is not None else ""
            connection.execute(text(f"DELETE FROM {table} WHERE {where}{bound}"), {**params, "edge": edge})
        if edge is None:
            return


def sweep(engine: Engine) -> int:
    """Drop the partitions of points left by deletes whose drop did not happen (Postgres); the number dropped."""
    return partitions.drop_orphans(engine) if partitions.partitioned(engine) else 0
