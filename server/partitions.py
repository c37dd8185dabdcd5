"""Points partitioned by run on Postgres, so that deleting a run truncates and drops its partitions.

`points` is partitioned by RANGE of `series_id`. A run's series take their ids from blocks of SERIES_BLOCK
consecutive ids that belong to that run alone, and each block is one partition, `points_p<block>`, made when
the run's first series of that block is created (in the ingest transaction, under the run row's lock, so two
batches of a run never pick the same id). Every read of points names its series ids, so the planner opens the
run's partitions only, whatever the number of runs. The partition key being the series id adds nothing to a
point's size; SQLite keeps one `points` table, and its series ids are its own.

A database from before partitioning keeps its points table as the partition `points_legacy` (for the series
ids then in use); those runs' points are deleted row by row, and the table is dropped once it is empty.

A partition is attached (SHARE UPDATE EXCLUSIVE on `points`: ingest and reads of other runs go on) rather than
created `PARTITION OF` (ACCESS EXCLUSIVE). Dropping one detaches it CONCURRENTLY first, for the same reason.
"""

from __future__ import annotations

import logging

from sqlalchemy import Connection, Engine, exc, func, select, text
from sqlalchemy.orm import Session

from ampwatch.server import models

SERIES_BLOCK = 256  # series ids per block, one partition each; a run with more series gets more blocks
BLOCK_SEQUENCE = "points_partition_seq"  # hands out block numbers (made by migration 0007)
LEGACY = "points_legacy"  # a database's points from before partitioning: one partition, deleted from row by row
_log = logging.getLogger("ampwatch.server.partitions")


def partitioned(bind: Connection | Engine | Session) -> bool:
    """Whether points are partitioned here (Postgres); SQLite keeps one table."""
    engine = bind.get_bind() if isinstance(bind, Session) else bind
    return engine.dialect.name == "postgresql"


def name(block: int) -> str:
    return f"points_p{block}"


def new_series_ids(session: Session, run_id: str, count: int) -> list[int]:
    """Ids for `count` new series of the run: the next free ones of its last block, then new blocks (each made
    a partition). The caller holds the run row's lock, which orders the run's series creation."""
    top = session.scalar(select(func.max(models.Series.id)).where(models.Series.run_id == run_id))
    ids: list[int] = []
    following = None
    if top is not None and (top + 1) % SERIES_BLOCK and _exists(session.connection(), top // SERIES_BLOCK):
        following = top + 1  # (a run older than partitioning has its series in the legacy table: never continued)
    while len(ids) < count:
        if following is None:
            block = int(session.scalar(text(f"SELECT nextval('{BLOCK_SEQUENCE}')")) or 0)
            create(session.connection(), block)
            following = block * SERIES_BLOCK
        ids.append(following)
        following += 1
        if following % SERIES_BLOCK == 0:
            following = None
    return ids


def create(connection: Connection, block: int) -> None:
    """Make block `block`'s partition: a table shaped like points, attached for its range of series ids (its
    primary key, partial index and foreign key come with the attach)."""
    lo, hi = block * SERIES_BLOCK, (block + 1) * SERIES_BLOCK
    table = name(block)
    connection.execute(text(f"CREATE TABLE {table} (LIKE points INCLUDING DEFAULTS)"))
    # The check spares the attach a scan for rows outside the range (the table is empty anyway).
    connection.execute(
        text(f"ALTER TABLE {table} ADD CONSTRAINT {table}_range CHECK (series_id >= {lo} AND series_id < {hi})")
    )
    connection.execute(text(f"ALTER TABLE points ATTACH PARTITION {table} FOR VALUES FROM ({lo}) TO ({hi})"))
    connection.execute(text(f"ALTER TABLE {table} DROP CONSTRAINT {table}_range"))


def _exists(connection: Connection, block: int) -> bool:
    return connection.scalar(text("SELECT to_regclass(:t) IS NOT NULL"), {"t": name(block)}) is True


def run_blocks(session: Session, run_id: str) -> list[int]:
    """The blocks of the run's series that are partitions of their own (not the legacy table's)."""
    query = select((models.Series.id // SERIES_BLOCK).label("b")).where(models.Series.run_id == run_id).distinct()
    connection = session.connection()
    return sorted(int(b) for b in session.scalars(query) if _exists(connection, int(b)))


def truncate(engine: Engine, blocks: list[int]) -> None:
    """Empty the partitions at once (ACCESS EXCLUSIVE on those partitions only: other runs' ingest goes on)."""
    if blocks:
        with engine.begin() as connection:
            connection.execute(text("TRUNCATE " + ", ".join(name(b) for b in blocks)))


def drop(engine: Engine, blocks: list[int], lock_timeout_ms: int = 2000) -> int:
    """Detach (CONCURRENTLY: outside a transaction, without blocking ingest) and drop each partition; one that
    cannot be had within `lock_timeout_ms` is left for `drop_orphans`. The number dropped."""
    return sum(_drop_table(engine, name(block), lock_timeout_ms) for block in blocks)


def _drop_table(engine: Engine, table: str, lock_timeout_ms: int = 2000) -> int:
    try:
        with engine.connect() as connection:
            connection = connection.execution_options(isolation_level="AUTOCOMMIT")
            connection.execute(text(f"SET lock_timeout = {int(lock_timeout_ms)}"))
            attached = connection.scalar(
                text("SELECT count(*) FROM pg_inherits WHERE inhrelid = to_regclass(:t)"), {"t": table}
            )
            if attached:
                connection.execute(text(f"ALTER TABLE points DETACH PARTITION {table} CONCURRENTLY"))
            connection.execute(text(f"DROP TABLE IF EXISTS {table}"))
            connection.execute(text("RESET lock_timeout"))
        return 1
    except exc.DBAPIError as error:  # (a lock wait that timed out, a detach interrupted earlier)
        _log.warning("left partition %s for later: %s", table, str(error.orig).strip().splitlines()[0])
        return 0


def orphans(engine: Engine) -> list[int]:
    """Blocks whose partition exists but whose ids no series has (their run was deleted, the drop did not happen)."""
    with engine.connect() as connection:
        tables = connection.scalars(
            text(
                "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = current_schema() AND c.relkind = 'r' AND c.relname ~ '^points_p[0-9]+$'"
            )
        ).all()
        blocks = [int(t[len("points_p") :]) for t in tables]
        used = set(
            connection.scalars(
                text("SELECT DISTINCT id / :n FROM series WHERE id / :n = ANY(:b)"), {"n": SERIES_BLOCK, "b": blocks}
            )
        )
    return sorted(b for b in blocks if b not in used)


def drop_orphans(engine: Engine) -> int:
    """Drop the partitions no run owns any more, and the legacy table once it is empty; the number dropped."""
    dropped = drop(engine, orphans(engine))
    with engine.connect() as connection:
        empty = connection.scalar(text(f"SELECT to_regclass('{LEGACY}') IS NOT NULL")) and not connection.scalar(
            text(f"SELECT EXISTS (SELECT 1 FROM {LEGACY})")
        )
    return dropped + (_drop_table(engine, LEGACY) if empty else 0)
