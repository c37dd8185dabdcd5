"""Postgres connection loss: an administrator (or a failover) kills the server's connections mid-run. The server
reconnects, agents retry what failed, and every step is stored once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import _runs
import psycopg
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, exc, text
from sqlalchemy.exc import OperationalError

import ampwatch
from ampwatch.server import Settings, db
from ampwatch.server.errors import database_unavailable


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


class BackendKiller:
    """Terminates every connection to one database from a separate connection, as `pg_terminate_backend` in psql."""

    def __init__(self, pg_url: str, admin_url: str) -> None:
        self.database = pg_url.rsplit("/", 1)[1]
        self.admin = psycopg.connect(_libpq(admin_url), autocommit=True)
        self.killed = 0

    def kill(self, pid: int | None = None) -> int:
        query = (
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid() AND (%s::int IS NULL OR pid = %s::int)"
        )
        row = self.admin.execute(query, (self.database, pid, pid)).fetchone()
        self.killed += row[0] if row else 0
        return row[0] if row else 0


@pytest.fixture
def killer(pg_url: str, pg_admin: str) -> Iterator[BackendKiller]:
    killer = BackendKiller(pg_url, pg_admin)
    yield killer
    killer.admin.close()


def test_an_agent_training_through_killed_postgres_connections_has_every_step_once(
    pg_url, killer, live_server_factory, monkeypatch
) -> None:
    monkeypatch.setenv("AMPWATCH_FINISH_TIMEOUT_S", "60")
    server = live_server_factory(Settings(database_url=pg_url, alert_eval_interval_s=0.05))
    run = ampwatch.init("robust", "pg-kill", url=server.url)
    done = threading.Event()

    def kill_repeatedly() -> None:  # the server's pooled and in-use connections, every 100 ms
        while not done.wait(0.1):
            killer.kill()

    thread = threading.Thread(target=kill_repeatedly, daemon=True)
    thread.start()
    _runs.train(run, range(200), lambda step: time.sleep(0.005))  # a second or more: ten rounds of kills or more
    done.set()
    thread.join()
    run.finish()
    assert killer.killed > 0
    _runs.assert_every_step_once(server.url, run.id, 200)


def test_a_transaction_that_lost_its_connection_is_retried_on_a_fresh_one(pg_url, killer) -> None:
    engine = db.make_engine(pg_url)
    sessions = db.session_factory(engine)
    calls: list[int] = []

    def work() -> int:
        calls.append(1)
        return int(session.scalar(text("SELECT pg_backend_pid()")))

    with sessions() as session:
        first = work()
        assert killer.kill(first) == 1
        again = db.retrying(session, work)
    assert again != first and len(calls) == 3

    def divide_by_zero() -> None:
        calls.append(1)
        session.execute(text("SELECT 1/0"))

    with sessions() as session:  # a failure that is not a lost connection is not repeated
        with pytest.raises(exc.DataError):
            db.retrying(session, divide_by_zero)
    assert len(calls) == 4
    engine.dispose()


def _app_failing_with(make_error) -> TestClient:
    # An app of one endpoint, only to see how the handler answers real database errors; create_app's wiring of
    # the handler is the composition root's business.
    app = FastAPI()
    app.add_exception_handler(OperationalError, database_unavailable)
    app.get("/fail")(make_error)
    return TestClient(app, raise_server_exceptions=False)


def test_a_lost_postgres_connection_answers_503_with_retry_after(pg_url, killer) -> None:
    engine = db.make_engine(pg_url)

    def lost_connection() -> None:
        with engine.connect() as connection:
            killer.kill(connection.exec_driver_sql("SELECT pg_backend_pid()").scalar())
            connection.exec_driver_sql("SELECT 1")

    reply = _app_failing_with(lost_connection).get("/fail")
    assert (reply.status_code, reply.headers.get("retry-after")) == (503, "1"), reply.text
    engine.dispose()


def test_a_sqlite_lock_held_too_long_answers_503_and_a_missing_table_500(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'locked.db'}"
    holder = create_engine(url).connect()
    holder.exec_driver_sql("CREATE TABLE t (x INTEGER)")
    holder.exec_driver_sql("BEGIN IMMEDIATE")  # another process's long write transaction
    impatient = create_engine(url, connect_args={"timeout": 0})  # no busy timeout: "database is locked" at once

    def locked() -> None:
        with impatient.begin() as connection:
            connection.exec_driver_sql("INSERT INTO t VALUES (1)")

    def broken() -> None:
        with impatient.connect() as connection:
            connection.exec_driver_sql("SELECT * FROM no_such_table")

    reply = _app_failing_with(locked).get("/fail")
    assert (reply.status_code, reply.headers.get("retry-after")) == (503, "1"), reply.text
    assert _app_failing_with(broken).get("/fail").status_code == 500  # a bug stays a 500
    holder.close()
