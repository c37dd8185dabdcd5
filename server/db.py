"""Engines, sessions and migrations for SQLite (WAL) and Postgres."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, Table, create_engine, event, make_url, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

_MIGRATION_LOCK = 860_0001  # pg advisory lock key: replicas starting together migrate one at a time


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite gets WAL, a busy timeout and foreign keys."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded objects usable after commit."""
    return sessionmaker(engine, expire_on_commit=False)


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply Alembic migrations up to `revision`."""
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def alembic_config() -> Config:
    """Alembic configuration pointing at the packaged `ampwatch.migrations`."""
    config = Config()
    config.set_main_option("script_location", str(resources.files("ampwatch.migrations")))
    return config


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
