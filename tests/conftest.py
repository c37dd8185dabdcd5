"""Shared fixtures: fresh real databases (SQLite file, Postgres database) and real uvicorn servers."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _schedule
import httpx
import pytest
import uvicorn
from _ports import free_port
from fastapi import FastAPI

from ampwatch import _guard
from ampwatch.server import Settings, create_app, db

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REQUIRE_BROWSER = bool(os.environ.get("AMPWATCH_REQUIRE_BROWSER"))  # read at import: `_agent_env` clears AMPWATCH_*
LEAKS = os.environ.get("AMPWATCH_TEST_LEAKS")  # a file to note the tests that leave a run open in (read at import)
PG_ADMIN_URL = os.environ.get("AMPWATCH_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread per xdist worker (and its subprocesses), unless OMP_NUM_THREADS is set: the tests' models are
    tiny, and four workers' OpenMP pools spinning on two cores made four parallel training loops ~5x slower."""
    if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        if "torch" in sys.modules:  # (imported already: its pool was sized when it loaded)
            sys.modules["torch"].set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, the slow tests lead each worker's part of the run (tests/_schedule.py says why and which)."""
    items[:] = _schedule.order(items, getattr(config, "workerinput", {}).get("workercount", 0))


def _pg_available() -> str | None:
    import psycopg

    try:
        with psycopg.connect(_libpq(PG_ADMIN_URL), connect_timeout=3):
            return None
    except psycopg.Error as error:
        return str(error).strip()


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture(scope="session")
def pg_admin() -> str:
    """The admin URL of a reachable Postgres; skips (or fails when CI requires it) otherwise."""
    problem = _pg_available()
    if problem:
        message = f"PostgreSQL is not reachable at {PG_ADMIN_URL} ({problem}); set AMPWATCH_TEST_PG_URL"
        if os.environ.get("AMPWATCH_REQUIRE_POSTGRES"):
            pytest.fail(message)
        pytest.skip(message)
    return PG_ADMIN_URL


@pytest.fixture
def pg_url(pg_admin: str) -> Iterator[str]:
    """A fresh, empty Postgres database for one test, dropped afterwards."""
    import psycopg

    name = f"ampwatch_test_{secrets.token_hex(6)}"
    with psycopg.connect(_libpq(pg_admin), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base, _, _ = pg_admin.rpartition("/")
    yield f"{base}/{name}"
    with psycopg.connect(_libpq(pg_admin), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    """A fresh SQLite file for one test."""
    return f"sqlite:///{tmp_path / 'ampwatch.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Each test that takes this runs once on SQLite and once on Postgres."""
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


# Databases at the latest schema, for tests whose subject is not migrating: each is a copy of one migrated once per
# worker, by the same migrations (migrating a fresh database costs ~0.15 s of CPU on SQLite and ~0.4 s on Postgres,
# at every server start). A server started on one still runs the migrations, and finds nothing to do. Tests of the
# migrations themselves, and servers started on `sqlite_url`/`pg_url`, migrate an empty database.


@pytest.fixture(scope="session")
def _latest_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("latest-schema") / "latest.db"
    engine = db.make_engine(f"sqlite:///{path}")
    db.upgrade(engine)
    engine.dispose()  # (the last connection to close folds the WAL into the file: one file to copy)
    return path


@pytest.fixture(scope="session")
def _latest_pg(pg_admin: str) -> Iterator[str]:
    """A Postgres database at the latest schema, only ever used as a template (nothing stays connected to it)."""
    import psycopg

    name = f"ampwatch_latest_{secrets.token_hex(6)}"
    with psycopg.connect(_libpq(pg_admin), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    engine = db.make_engine(f"{pg_admin.rpartition('/')[0]}/{name}")
    db.upgrade(engine)
    engine.dispose()
    yield name
    with psycopg.connect(_libpq(pg_admin), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def migrated_sqlite_url(tmp_path: Path, _latest_sqlite: Path) -> str:
    """A fresh SQLite file for one test, already at the latest schema."""
    path = tmp_path / "migrated.db"
    shutil.copyfile(_latest_sqlite, path)
    return f"sqlite:///{path}"


@pytest.fixture
def migrated_pg_url(pg_admin: str, _latest_pg: str) -> Iterator[str]:
    """A fresh Postgres database for one test, already at the latest schema; dropped afterwards."""
    import psycopg

    name = f"ampwatch_test_{secrets.token_hex(6)}"
    with psycopg.connect(_libpq(pg_admin), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{_latest_pg}"')
    yield f"{pg_admin.rpartition('/')[0]}/{name}"
    with psycopg.connect(_libpq(pg_admin), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgres"])
def migrated_db_url(request: pytest.FixtureRequest) -> str:
    """`db_url` at the latest schema: once on SQLite, once on Postgres."""
    return request.getfixturevalue("migrated_sqlite_url" if request.param == "sqlite" else "migrated_pg_url")


@dataclass
class LiveServer:
    url: str
    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.app.state.engine.dispose()


def start_server(settings: Settings, port: int | None = None) -> LiveServer:
    """A real uvicorn serving `create_app(settings)` on a loopback port, in a thread."""
    port = port or free_port()
    settings = settings.model_copy(update={"host": "127.0.0.1", "port": port})
    app = create_app(settings)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=3)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", app, server, thread)


@pytest.fixture
def live_server(migrated_db_url: str) -> Iterator[LiveServer]:
    """A real server on SQLite, then on Postgres."""
    server = start_server(Settings(database_url=migrated_db_url))
    yield server
    server.stop()


@pytest.fixture
def live_server_factory() -> Iterator[Callable[..., LiveServer]]:
    """Start servers at will (to stop and restart them mid-test); all are stopped at the end."""
    started: list[LiveServer] = []

    def start(settings: Settings, port: int | None = None) -> LiveServer:
        started.append(start_server(settings, port))
        return started[-1]

    yield start
    for server in started:
        if server.thread.is_alive():
            server.stop()


@pytest.fixture
def sqlite_server(migrated_sqlite_url: str) -> Iterator[LiveServer]:
    """A real server on SQLite only, for tests whose subject is not the database."""
    server = start_server(Settings(database_url=migrated_sqlite_url))
    yield server
    server.stop()


@pytest.fixture
def memory() -> Any:
    """An in-memory ingest (tests/_memory.py) for tests of the agent's own logic: `ampwatch.init(transport=memory)`."""
    import _memory

    return _memory.MemoryTransport()


class _InternalErrors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("ampwatch: internal error"):
            self.messages.append(self.format(record))


@pytest.fixture(autouse=True)
def _no_internal_agent_errors(request: pytest.FixtureRequest) -> Iterator[None]:
    """An agent error is caught and logged so training goes on, which also hides it from a test that only checks
    the data: every test fails on one, unless marked `internal_errors` (the tests that inject them)."""
    _guard._reported.clear()  # (the agent says each error and warning once per process: once per test here)
    handler = _InternalErrors()
    agent_log = logging.getLogger("ampwatch")
    agent_log.addHandler(handler)
    try:
        yield
    finally:
        agent_log.removeHandler(handler)
    if handler.messages and request.node.get_closest_marker("internal_errors") is None:
        pytest.fail("the agent logged an internal error:\n" + "\n".join(handler.messages), pytrace=False)


@pytest.fixture(autouse=True)
def _no_run_left_watching(request: pytest.FixtureRequest) -> Iterator[None]:
    """A run a test leaves open keeps its hooks on torch (`clip_grad_norm_` wrapped) for the tests after it: take
    them off at the end of each test (its run still ends at exit), and note which test left it open."""
    from ampwatch import _ending

    yield
    for run in list(_ending.UNFINISHED):
        run._recorder.unwatch()
        if LEAKS:
            with open(LEAKS, "a") as out:
                out.write(f"{request.node.nodeid}\n")


@pytest.fixture(autouse=True)
def _agent_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Agent settings from the developer's shell must not leak into tests."""
    for name in list(os.environ):
        if name.startswith("AMPWATCH_") and name not in (
            "AMPWATCH_TEST_PG_URL",
            "AMPWATCH_REQUIRE_POSTGRES",
            "AMPWATCH_REQUIRE_BROWSER",
            "AMPWATCH_REQUIRE_INTEGRATIONS",
        ):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AMPWATCH_FLUSH_INTERVAL_S", "0.05")
    monkeypatch.setenv(
        "AMPWATCH_FINISH_TIMEOUT_S", "5"
    )  # (time to deliver on a loaded 2-core machine; tests of the timeout set theirs)
    monkeypatch.setenv("AMPWATCH_SPOOL_DIR", str(tmp_path_factory.mktemp("spool")))


@pytest.fixture
def wait_for() -> Callable[..., object]:
    """Poll `predicate` until it returns something truthy (or fail after `timeout_s`)."""

    def wait(predicate: Callable[[], object], timeout_s: float = 15.0, what: str = "condition") -> object:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = predicate()
            if result:
                return result
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    return wait


class ServerProcess:
    """`ampwatch server` as a real process (the CLI), for tests that kill, restart or run several servers."""

    def __init__(self, db_url: str, log: Path, port: int | None = None, env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [sys.executable, "-m", "ampwatch._cli", "server", "--port", str(self.port), "--db", db_url]
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                command, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT
            )

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the server exited:\n{self.log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"the server did not start:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, open transactions die with the process."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def server_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """Start `ampwatch server` processes (`port=` to restart one where it was, settings as AMPWATCH_* keywords);
    whatever still runs is stopped at the end."""
    started: list[ServerProcess] = []
    logs = tmp_path_factory.mktemp("server-logs")

    def start(db_url: str, port: int | None = None, **env: str) -> ServerProcess:
        started.append(ServerProcess(db_url, logs / f"server-{len(started)}.log", port, env))
        started[-1].wait_ready()
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium per test module: Debian's `chromium` (Playwright cannot download its own here).
    Without it the test skips, or fails when AMPWATCH_REQUIRE_BROWSER is set (CI)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if sync_playwright is None or not os.path.exists(CHROMIUM):
        message = (
            f"needs Python Playwright and Chromium at {CHROMIUM} (pip install playwright; apt-get install -y chromium)"
        )
        pytest.fail(f"{message} (AMPWATCH_REQUIRE_BROWSER is set)") if REQUIRE_BROWSER else pytest.skip(message)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page in `browser`; any script error or failed request on it fails the test."""
    import _browser

    with _browser.context_page(browser) as fresh:
        yield fresh
