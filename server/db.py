"""Engines, sessions and migrations for SQLite (WAL) and Postgres.

SQLite allows one writer at a time. Writers of one process queue on a lock instead of polling SQLite's busy
handler (which sleeps up to 100 ms between tries, so waiters starve under load); writers of other processes
still wait on the busy timeout. Postgres connections dropped by the server are replaced: the pool pings each
connection on checkout, and `retrying` repeats a transaction that lost its connection.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, Table, create_engine, event, exc, make_url, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

_MIGRATION_LOCK = 860_0001  # pg advisory lock key: replicas starting together migrate one at a time
BUSY_TIMEOUT_S = 30.0  # how long a SQLite writer waits for another process's transaction
_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLAC", "BEGIN ")  # statements that start pysqlite's write transaction
_HOLDS_LOCK = "ampwatch.write_lock"
T = TypeVar("T")
IDS_PER_QUERY = 10_000  # names or ids bound in one IN (...): Postgres takes at most 65 535 parameters a statement


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite gets WAL, a busy timeout, foreign keys and one writer at a time per process."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_S})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection, _record) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a commit survives a killed process
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    _serialize_writers(engine)
    return engine


def _serialize_writers(engine: Engine) -> None:
    """Take a process-wide lock before a transaction's first write; give it back when the connection returns
    to the pool (after commit or rollback). pysqlite begins a transaction only at the first write, so reads
    never wait. The lock only orders this process's writers: SQLite's own locking still guarantees correctness,
    so a writer that waited `BUSY_TIMEOUT_S` for it goes on without it rather than fail."""
    lock = threading.Lock()

    @event.listens_for(engine, "before_cursor_execute")
    def _before_write(conn, _cursor, statement: str, *_: object) -> None:
        info = conn.connection.info
        if _HOLDS_LOCK not in info and statement.lstrip()[:6].upper().startswith(_WRITES):
            info[_HOLDS_LOCK] = lock.acquire(timeout=BUSY_TIMEOUT_S)  # False: waited long enough, go on without

    @event.listens_for(engine.pool, "checkin")
    def _release(_dbapi_connection, record) -> None:
        if record.info.pop(_HOLDS_LOCK, False):
            lock.release()


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded objects usable after commit."""
    return sessionmaker(engine, expire_on_commit=False)


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply Alembic migrations up to `revision`."""
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
        elif engine.dialect.name == "sqlite":  # the others wait for this commit, then find nothing to do
            connection.exec_driver_sql("BEGIN IMMEDIATE")
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def alembic_config() -> Config:
    """Alembic configuration pointing at the packaged `ampwatch.migrations`."""
    config = Config()
    config.set_main_option("script_location", str(resources.files("ampwatch.migrations")))
    return config


def retrying(session: Session, work: Callable[[], T], attempts: int = 3) -> T:
    """`work()`, one transaction that is safe to repeat, run again on a fresh connection when the database
    dropped the one it had (a restarted or failed-over Postgres, an administrator's pg_terminate_backend)."""
    for _ in range(attempts - 1):
        try:
            return work()
        except exc.DBAPIError as error:
            if not error.connection_invalidated:
                raise
            session.rollback()  # forgets the dead connection; the next statement checks out a live one
    return work()


def iter_session(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One session per request, closed afterwards."""
    with factory() as session:
        yield session


def now() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(timezone.utc)


def utc(value: datetime) -> datetime:
    """SQLite hands back naive datetimes: they are UTC."""
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def insert(session: Session, table: Table) -> Any:
    """An INSERT that knows ON CONFLICT on this session's database."""
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    return dialect.insert(table)
