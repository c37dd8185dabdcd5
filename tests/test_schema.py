"""Alembic migrations and the SQLAlchemy models describe the same schema, on SQLite and Postgres."""

from __future__ import annotations

import shutil
import subprocess

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from ampwatch.server import db
from ampwatch.server.models import Base


def test_migrations_and_models_agree(db_url: str) -> None:
    engine = db.make_engine(db_url)
    db.upgrade(engine)
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    engine.dispose()
    assert diff == []


def test_upgrading_twice_is_harmless_and_records_the_head(db_url: str) -> None:
    engine = db.make_engine(db_url)
    db.upgrade(engine)
    db.upgrade(engine)
    with engine.connect() as connection:
        head = ScriptDirectory.from_config(db.alembic_config()).get_current_head()
        assert head is not None and MigrationContext.configure(connection).get_current_revision() == head
    engine.dispose()


def test_db_upgrade_command_creates_the_schema(db_url: str) -> None:
    command = shutil.which("ampwatch")
    assert command, "the ampwatch console script is installed"
    done = subprocess.run([command, "db", "upgrade", "--db", db_url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "latest schema" in done.stdout
    engine = db.make_engine(db_url)
    assert {"runs", "points", "series", "events", "batches", "alerts", "projects"} <= set(inspect(engine).get_table_names())
    engine.dispose()
