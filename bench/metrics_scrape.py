"""The cost of a `GET /metrics` scrape as running runs grow, on SQLite and on Postgres.

Runs are registered and fed through a real `ampwatch server` (`--steps` steps of loss, scale and skipped each,
left running, so every one has per-run gauges); then this process times the scrape-time collector against the
same database, counting its SQL statements (the number must not grow with the runs), and times `GET /metrics`
over HTTP.

    python bench/metrics_scrape.py                         # 10 and 200 running runs, SQLite then Postgres
    python bench/metrics_scrape.py --backends sqlite --runs 5 --steps 100 --scrapes 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_PG_ADMIN_URL, Server, postgres_problem, scratch_database  # noqa: E402


def _make_runs(url: str, first: int, last: int, steps: int) -> None:
    import httpx

    with httpx.Client(base_url=url, timeout=120) as http:
        for r in range(first, last):
            run_id = f"scrape-{r}"
            http.put(f"/api/v1/runs/{run_id}", json={"project": "bench", "name": f"run {r}"}).raise_for_status()
            series = {
                "loss": [1.0 / (s + 1) for s in range(steps)],
                "scale": [65536.0] * steps,
                "skipped": [1.0 if s % 50 == 0 else 0.0 for s in range(steps)],
            }
            body = {"seq": 1, "points": {n: {"steps": list(range(steps)), "values": v} for n, v in series.items()}}
            http.post(f"/api/v1/runs/{run_id}/batches", json=body).raise_for_status()


def _measure(db_url: str, url: str, scrapes: int) -> tuple[float, float, int, float]:
    """Median and minimum collector time (s), its SQL statements, and the median `GET /metrics` time (s)."""
    import httpx
    from sqlalchemy import event

    from ampwatch.server import db
    from ampwatch.server.metrics import DatabaseCollector

    engine = db.make_engine(db_url)
    collector = DatabaseCollector(db.session_factory(engine))
    counted = [0]
    event.listen(engine, "before_cursor_execute", lambda *_: counted.__setitem__(0, counted[0] + 1))
    times, statements = [], 0
    for _ in range(scrapes + 1):
        counted[0] = 0
        started = time.perf_counter()
        families = list(collector.collect())
        times.append(time.perf_counter() - started)
        statements = counted[0]
        assert families
    engine.dispose()
    http_times = []
    with httpx.Client(base_url=url, timeout=60) as http:
        for _ in range(scrapes + 1):
            started = time.perf_counter()
            http.get("/metrics").raise_for_status()
            http_times.append(time.perf_counter() - started)
    times, http_times = times[1:], http_times[1:]  # (the first warms the statement caches)
    return statistics.median(times), min(times), statements, statistics.median(http_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="sqlite,postgres", help="comma-separated: sqlite, postgres")
    parser.add_argument("--runs", default="10,200", help="comma-separated running-run counts, ascending (added)")
    parser.add_argument("--steps", type=int, default=2000, help="steps each run has (default 2000)")
    parser.add_argument("--scrapes", type=int, default=10, help="timed scrapes per run count (default 10)")
    parser.add_argument("--pg-url", default=DEFAULT_PG_ADMIN_URL, help="Postgres admin URL for a scratch database")
    args = parser.parse_args()
    counts = [int(c) for c in args.runs.split(",")]
    print(f"{'backend':<9} {'runs':>5} {'steps':>6} {'collect ms':>11} {'(min)':>7} {'SQL':>4} {'GET ms':>7}")
    for backend in args.backends.split(","):
        if backend == "postgres" and (problem := postgres_problem(args.pg_url)):
            print(f"postgres: skipped, not reachable at {args.pg_url}: {problem}")
            continue
        with scratch_database(backend, args.pg_url) as db_url, tempfile.TemporaryDirectory() as tmp:
            with Server(db_url, Path(tmp) / "server.log") as server:
                server.wait_ready()
                made = 0
                for count in counts:
                    _make_runs(server.url, made, count, args.steps)
                    made = count
                    median, low, statements, get_s = _measure(db_url, server.url, args.scrapes)
                    print(
                        f"{backend:<9} {count:>5} {args.steps:>6} {median * 1e3:>11.2f} {low * 1e3:>7.2f} "
                        f"{statements:>4} {get_s * 1e3:>7.2f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
