"""Alembic migrations and the SQLAlchemy models describe the same schema, on SQLite and Postgres."""

from __future__ import annotations

import os
import shutil
import socket
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
    assert {"runs", "points", "series", "events", "batches", "alerts", "projects"} <= set(
        inspect(engine).get_table_names()
    )
    engine.dispose()


def test_upgrading_to_0005_fills_the_block_rollups_of_existing_points(db_url: str) -> None:
    from sqlalchemy import text

    engine = db.make_engine(db_url)
    db.upgrade(engine, "0004")
    values = {s: float((s * 37) % 101) for s in range(0, 300)} | {5: float("inf"), 7: None, 130: 1e6, 131: -2.0}
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO projects (id, name, created_at) VALUES (1, 'p', CURRENT_TIMESTAMP)"))
        connection.execute(
            text(
                "INSERT INTO runs (id, project_id, name, status, health, config, environment, created_at, last_seen_at)"
                " VALUES ('r', 1, 'n', 'running', 'ok', '{}', '{}', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
            )
        )
        connection.execute(text("INSERT INTO series (id, run_id, name) VALUES (1, 'r', 'loss')"))
        connection.execute(
            text("INSERT INTO points VALUES (1, 0, :s, :v)"), [{"s": s, "v": v} for s, v in values.items()]
        )
    db.upgrade(engine)
    with engine.connect() as connection:
        rows = connection.execute(
            text("SELECT block, min_step, min_value, max_step, max_value, last_step FROM point_blocks ORDER BY block")
        ).all()
    engine.dispose()
    expected = []
    for block in range(5):  # blocks of 64 steps: the least and the greatest finite value, earliest step first
        finite = [(v, s) for s, v in values.items() if s // 64 == block and v is not None and abs(v) != float("inf")]
        low, high = min(finite), min(finite, key=lambda p: (-p[0], p[1]))
        expected.append((block, low[1], low[0], high[1], high[0], max(s for _, s in finite)))
    assert [tuple(r) for r in rows] == expected
    assert expected[2][1:5] == (131, -2.0, 130, 1e6) and expected[0][4] == 100.0


def test_a_database_out_of_reach_or_a_broken_rules_file_is_one_line_and_exit_2(tmp_path) -> None:
    # (both were a traceback of 17 to 117 lines, the reason at its end)
    command = shutil.which("ampwatch") or "ampwatch"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nobody listens here once the socket is closed
    done = subprocess.run(
        [command, "db", "upgrade", "--db", f"postgresql+psycopg://ampwatch:secret@127.0.0.1:{closed}/x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "ampwatch db: cannot use the database" in done.stderr and "secret" not in done.stderr
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {name: r, kind: threshold, series: loss, keep_firing_for: 5m}\n")
    env = {**os.environ, "AMPWATCH_ALERT_RULES_FILE": str(rules)}
    done = subprocess.run(
        [command, "server", "--port", str(closed), "--db", f"sqlite:///{tmp_path / 'a.db'}"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"AMPWATCH_ALERT_RULES_FILE: {rules}" in done.stderr and "keep firing for" in done.stderr


def test_upgrading_to_0006_fills_the_run_vitals_from_existing_points(db_url: str) -> None:
    from sqlalchemy import text

    engine = db.make_engine(db_url)
    db.upgrade(engine, "0005")
    skipped = [{"s": s, "v": float(s % 10 == 0)} for s in range(1500)]  # the last 1000 steps: 1 in 10 skipped
    scale = [{"s": s, "v": v} for s, v in enumerate([65536.0, 32768.0, None])]  # the latest is NaN (NULL)
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO projects (id, name, created_at) VALUES (1, 'p', CURRENT_TIMESTAMP)"))
        for run in ("r", "empty"):
            connection.execute(
                text(
                    "INSERT INTO runs (id, project_id, name, status, health, config, environment, created_at,"
                    " last_seen_at)"
                    " VALUES (:r, 1, 'n', 'running', 'ok', '{}', '{}', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                ),
                {"r": run},
            )
        connection.execute(text("INSERT INTO series (id, run_id, name) VALUES (1, 'r', 'skipped'), (2, 'r', 'scale')"))
        connection.execute(text("INSERT INTO points VALUES (1, 0, :s, :v)"), skipped)
        connection.execute(text("INSERT INTO points VALUES (1, 1, :s, 1.0)"), skipped)  # rank 1 does not count
        connection.execute(text("INSERT INTO points VALUES (2, 0, :s, :v)"), scale)
    db.upgrade(engine)
    with engine.connect() as connection:
        found = connection.execute(text("SELECT id, skip_rate, scale, scale_step FROM runs")).all()
    rows = {r[0]: tuple(r[1:]) for r in found}
    engine.dispose()
    assert rows["empty"] == (None, None, None)
    assert rows["r"][0] == 0.1 and rows["r"][1:] == (None, 2)  # 100 of 1000; a NaN scale at step 2
