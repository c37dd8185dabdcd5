"""What points partitioned by run cost: bytes per point on each backend, and ingest and reads as runs (on
Postgres: partitions) grow to 100, 1 000 and 10 000.

In this process through the whole app (Starlette's TestClient: routing, validation, SQL), on a scratch database.
Bytes per point: a run of 4 series x 50 000 steps ingested in batches of 20 000 points; Postgres counts
pg_total_relation_size over the partitions of points (heap, indexes, free space map), SQLite the pages of
points and its index in dbstat (or the file's growth where dbstat is missing); rollups (point_blocks) are given
apart. Growth: each new run sends one batch of 2 series x 10 steps (its first: on Postgres it makes the run's
partition); at each size, the median of that first batch, of a 500-point batch of an existing run, of the runs
page `/`, and of one series read `GET /api/v1/runs/{id}/series`.

    python bench/partitions.py
    python bench/partitions.py --backends postgres --runs 100 1000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_PG_ADMIN_URL, postgres_problem, scratch_database  # noqa: E402
from sqlalchemy import make_url, text  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from ampwatch.server.app import create_app  # noqa: E402
from ampwatch.server.settings import Settings  # noqa: E402


def _points_bytes(engine: object, db_url: str) -> tuple[int, int]:
    """(bytes of points and its indexes, bytes of point_blocks)"""
    with engine.connect() as connection:  # type: ignore[attr-defined]
        if connection.dialect.name == "postgresql":
            points = connection.scalar(
                text("SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree('points')")
            )
            return int(points), int(connection.scalar(text("SELECT pg_total_relation_size('point_blocks')")))
        try:
            sizes = dict(connection.execute(text("SELECT name, sum(pgsize) FROM dbstat GROUP BY name")).all())
            return sizes["points"] + sizes.get("ix_points_nonfinite", 0), sizes.get("point_blocks", 0)
        except Exception:  # (no dbstat in this build: the whole file)
            return Path(make_url(db_url).database or "").stat().st_size, 0


def bytes_per_point(backend: str, pg_admin: str, steps: int) -> None:
    with scratch_database(backend, pg_admin) as db_url:
        app = create_app(Settings(database_url=db_url, alert_eval_interval_s=3600))
        with TestClient(app, base_url="http://127.0.0.1") as client:
            client.put("/api/v1/runs/big", json={"project": "bench", "name": "big"}).raise_for_status()
            names = ("loss", "scale", "grad_norm", "lr")
            for seq, first in enumerate(range(0, steps, 5000), start=1):
                span = list(range(first, min(first + 5000, steps)))
                points = {
                    n: {"steps": span, "values": [float(s % 977) * 1.37 + i for s in span]} for i, n in enumerate(names)
                }
                client.post("/api/v1/runs/big/batches", json={"seq": seq, "points": points}).raise_for_status()
            engine = app.state.engine
            if backend == "postgres":
                with engine.connect() as connection:
                    connection.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("VACUUM ANALYZE")
            points, blocks = _points_bytes(engine, db_url)
            count = steps * len(names)
            print(f"| {backend} | {count:,} | {points / count:.1f} | {blocks / count:.1f} |", flush=True)
        app.state.engine.dispose()


def _median_ms(call, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def growth(backend: str, sizes: list[int], pg_admin: str, repeat: int) -> None:
    with scratch_database(backend, pg_admin) as db_url:
        app = create_app(Settings(database_url=db_url, alert_eval_interval_s=3600))
        with TestClient(app, base_url="http://127.0.0.1") as client:
            have, seq = 0, {"steady": 0}
            client.put("/api/v1/runs/steady", json={"project": "bench", "name": "steady"}).raise_for_status()

            def first_batch(i: int) -> None:
                client.put(f"/api/v1/runs/r{i}", json={"project": f"p{i % 10}", "name": f"r{i}"}).raise_for_status()
                span = list(range(10))
                points = {n: {"steps": span, "values": [1.0] * 10} for n in ("loss", "scale")}
                client.post(f"/api/v1/runs/r{i}/batches", json={"seq": 1, "points": points}).raise_for_status()

            def steady_batch() -> None:
                seq["steady"] += 1
                first = seq["steady"] * 250
                span = list(range(first, first + 250))
                points = {n: {"steps": span, "values": [1.0] * 250} for n in ("loss", "lr")}
                client.post(
                    "/api/v1/runs/steady/batches", json={"seq": seq["steady"], "points": points}
                ).raise_for_status()

            def get(path: str) -> None:
                client.get(path).raise_for_status()

            for size in sizes:
                firsts = []
                for i in range(have, size):
                    start = time.perf_counter()
                    first_batch(i)
                    firsts.append((time.perf_counter() - start) * 1000)
                have = size
                if backend == "postgres":
                    with app.state.engine.connect() as connection:
                        connection.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("ANALYZE")
                last = statistics.median(firsts[-min(len(firsts), 100) :])
                print(
                    f"| {backend} | {size:>6} | {last:.1f} ms | {_median_ms(steady_batch, repeat):.1f} ms"
                    f" | {_median_ms(lambda: get('/'), repeat):.1f} ms"
                    f" | {_median_ms(lambda: get('/api/v1/runs/steady/series?name=loss'), repeat):.1f} ms |",
                    flush=True,
                )
        app.state.engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["postgres", "sqlite"], choices=["sqlite", "postgres"])
    parser.add_argument("--runs", nargs="+", type=int, default=[100, 1000, 10000])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--steps", type=int, default=50_000, help="steps of the run whose bytes are measured (x 4)")
    parser.add_argument("--pg-admin-url", default=DEFAULT_PG_ADMIN_URL)
    args = parser.parse_args()
    backends = []
    for backend in args.backends:
        if backend == "postgres" and (problem := postgres_problem(args.pg_admin_url)):
            print(f"postgres skipped: {problem}")
            continue
        backends.append(backend)
    print("| backend | points | bytes per point (points + index) | rollups, bytes per point |")
    print("|---|---|---|---|")
    for backend in backends:
        bytes_per_point(backend, args.pg_admin_url, args.steps)
    print()
    print("| backend | runs | a new run's first batch (p50 of the last 100) | a 500-point batch | `/` | one series |")
    print("|---|---|---|---|---|---|")
    for backend in backends:
        growth(backend, sorted(args.runs), args.pg_admin_url, args.repeat)


if __name__ == "__main__":
    main()
