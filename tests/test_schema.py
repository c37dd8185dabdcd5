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


def test_upgrading_to_0005_fills_the_block_rollups_of_existing_points(db_url: str) -> None:
    from sqlalchemy import text

    engine = db.make_engine(db_url)
    db.upgrade(engine, "0004")
    values = {s: float((s * 37) % 101) for s in range(0, 300)} | {5: float("inf"), 7: None, 130: 1e6, 131: -2.0}
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO projects (id, name, created_at) VALUES (1, 'p', CURRENT_TIMESTAMP)"))
        connection.execute(text(
            "INSERT INTO runs (id, project_id, name, status, health, config, environment, created_at, last_seen_at)"
            " VALUES ('r', 1, 'n', 'running', 'ok', '{}', '{}', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
        ))  # fmt: skip
        connection.execute(text("INSERT INTO series (id, run_id, name) VALUES (1, 'r', 'loss')"))
        connection.execute(text("INSERT INTO points VALUES (1, 0, :s, :v)"), [{"s": s, "v": v} for s, v in values.items()])
    db.upgrade(engine)
    with engine.connect() as connection:
        rows = connection.execute(text("SELECT block, min_step, min_value, max_step, max_value, last_step FROM point_blocks ORDER BY block")).all()
    engine.dispose()
    expected = []
    for block in range(5):  # blocks of 64 steps: the least and the greatest finite value, earliest step first
        finite = [(v, s) for s, v in values.items() if s // 64 == block and v is not None and abs(v) != float("inf")]
        low, high = min(finite), min(finite, key=lambda p: (-p[0], p[1]))
        expected.append((block, low[1], low[0], high[1], high[0], max(s for _, s in finite)))
    assert [tuple(r) for r in rows] == expected
    assert expected[2][1:5] == (131, -2.0, 130, 1e6) and expected[0][4] == 100.0
