"""The runs list at team scale: the runs page `/` and the first page of `GET /api/v1/runs` at 100, 1 000 and
10 000 runs, on SQLite and Postgres: median server time and SQL statements per request.

Runs are written straight into a database migrated by the server's own code: a run row with its vitals (as
ingest keeps them), one series with a point, and a firing alert on every tenth run (the list reads the runs
table and the page's alerts; the points behind the vitals are not read by it). "Server time" is a request
through the whole app in this process (Starlette's TestClient: routing, guard, SQL, templates or JSON), without
the network. Statements are counted with SQLAlchemy's `before_cursor_execute`, leaving out the background
alert threads and the access-token cache.

    python bench/scale.py                      # both backends, 100 / 1 000 / 10 000 runs
    python bench/scale.py --backends sqlite --runs 100 1000 --repeat 9

Target: the runs page and the first page of /api/v1/runs at 10 000 runs, p50 < 100 ms on both backends, with
statements per request independent of the number of runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_PG_ADMIN_URL, postgres_problem, scratch_database  # noqa: E402  (after the path insert)
from sqlalchemy import event, insert  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from ampwatch.server import models  # noqa: E402
from ampwatch.server.app import create_app  # noqa: E402
from ampwatch.server.settings import Settings  # noqa: E402

PATHS = ("/", "/api/v1/runs", "/?sort=step&order=asc", "/alerts")


def fill(app: object, first: int, count: int) -> None:
    """Runs `first`..`first + count - 1` in projects p0..p9, as ingest would have left them."""
    engine = app.state.engine  # type: ignore[attr-defined]
    now = datetime.now(timezone.utc)
    with engine.begin() as connection:
        if first == 0:
            connection.execute(
                insert(models.Project), [{"id": i + 1, "name": f"p{i}", "created_at": now} for i in range(10)]
            )
        for lo in range(first, first + count, 2000):
            ids = range(lo, min(lo + 2000, first + count))
            connection.execute(insert(models.Run), [{
                "id": f"run-{i:06d}", "project_id": i % 10 + 1, "name": f"exp-{i}", "status": "finished" if i % 3 else "running",
                "health": ("ok", "warning", "critical")[i % 3], "config": {"lr": 1e-3}, "environment": {"world_size": 1},
                "created_at": now - timedelta(seconds=i), "last_seen_at": now - timedelta(seconds=i), "finished_at": None,
                "last_step": 1000 + i, "skip_rate": 0.01 * (i % 7), "scale": 65536.0, "scale_step": 1000 + i,
            } for i in ids])  # fmt: skip
            connection.execute(insert(models.Alert), [{
                "run_id": f"run-{i:06d}", "rule": "nonfinite_loss", "severity": "critical", "state": "firing",
                "started_at": now, "resolved_at": None, "summary": "NaN loss", "rule_id": None, "rank": -1, "step": 5,
                "last_step": 5, "count": 1, "fired_at": now, "cleared_at": None, "last_notified_at": None,
                "updated_at": now, "details": {},
            } for i in ids if i % 10 == 0])  # fmt: skip


def measure(client: TestClient, engine: object, path: str, repeat: int) -> tuple[float, int]:
    """(median ms, statements) of `repeat` GETs of `path`."""
    counted: list[int] = []
    times: list[float] = []

    def count(*_: object) -> None:
        if not threading.current_thread().name.startswith("ampwatch-"):
            counted.append(1)

    for _ in range(repeat):
        counted.clear()
        event.listen(engine, "before_cursor_execute", count)
        start = time.perf_counter()
        reply = client.get(path)
        times.append((time.perf_counter() - start) * 1000)
        event.remove(engine, "before_cursor_execute", count)
        assert reply.status_code == 200, (path, reply.status_code)
    return statistics.median(times), len(counted)


def run(backend: str, sizes: list[int], repeat: int, pg_admin: str) -> None:
    with scratch_database(backend, pg_admin) as db_url:
        app = create_app(Settings(database_url=db_url, alert_eval_interval_s=3600))
        with TestClient(app, base_url="http://127.0.0.1") as client:  # (an open server answers loopback names)
            have = 0
            for size in sizes:
                fill(app, have, size - have)
                have = size
                if backend == "postgres":
                    with app.state.engine.begin() as connection:
                        connection.exec_driver_sql("ANALYZE")
                client.get("/")  # (warm: rules, tokens, templates)
                for path in PATHS:
                    ms, statements = measure(client, app.state.engine, path, repeat)
                    print(f"| {backend} | {size:>6} | `{path}` | {ms:7.1f} ms | {statements} |", flush=True)
        app.state.engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgres"], choices=["sqlite", "postgres"])
    parser.add_argument("--runs", nargs="+", type=int, default=[100, 1000, 10000])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--pg-admin-url", default=DEFAULT_PG_ADMIN_URL)
    args = parser.parse_args()
    print("| backend | runs | request | p50 server time | SQL statements |")
    print("|---|---|---|---|---|")
    for backend in args.backends:
        if backend == "postgres" and (problem := postgres_problem(args.pg_admin_url)):
            print(f"| postgres | – | skipped: {problem} | | |")
            continue
        run(backend, sorted(args.runs), args.repeat, args.pg_admin_url)


if __name__ == "__main__":
    main()
