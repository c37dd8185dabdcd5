"""The alert evaluator's cost: one pass over runs that all have new data, on SQLite and on Postgres.

Runs are made by real agents through a real `ampwatch server` (its own evaluator held off), each logging the
standard series for `--steps` steps; then this process times `AlertService.evaluate_once` against the same
database, every run made fresh before each pass (its last_seen_at moved to now, as a new batch does). The
evaluator runs every `AMPWATCH_ALERT_EVAL_INTERVAL_S` (1 s) in each server process: the CPU per run and pass
bounds how many active runs one server process keeps evaluated.

    python bench/alert_eval.py                         # 1, 10 and 50 runs, SQLite then Postgres
    python bench/alert_eval.py --backends sqlite --runs 5 --passes 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_PG_ADMIN_URL, Server, postgres_problem, scratch_database  # noqa: E402


def _make_runs(url: str, count: int, steps: int, offset: int) -> None:
    import ampwatch

    for r in range(offset, count):
        run = ampwatch.init("alert-eval", f"run-{r}", url=url)
        for step in range(steps):
            run.log(
                {"loss": 1.0 / (step + 1), "scale": 65536.0, "skipped": 0.0, "grad_norm": 1.0, "lr": 1e-3}, step=step
            )
        run.finish()


def _measure(db_url: str, passes: int) -> tuple[float, float, int]:
    """Median and minimum wall time of a pass (s), and the SQL statements of one pass."""
    from sqlalchemy import event, update

    from ampwatch.server import db, models
    from ampwatch.server.alerts import AlertService
    from ampwatch.server.settings import Settings

    engine = db.make_engine(db_url)
    sessions = db.session_factory(engine)
    service = AlertService(Settings(database_url=db_url), sessions)
    counted = [0]
    event.listen(engine, "before_cursor_execute", lambda *_: counted.__setitem__(0, counted[0] + 1))
    times, statements = [], 0
    for _ in range(passes + 1):
        with sessions() as session:
            session.execute(update(models.Run).values(last_seen_at=db.now()))
            session.commit()
        counted[0] = 0
        started = time.perf_counter()
        service.evaluate_once()
        times.append(time.perf_counter() - started)
        statements = counted[0]
    engine.dispose()
    times = times[1:]  # (the first pass warms the statement caches)
    return statistics.median(times), min(times), statements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="sqlite,postgres", help="comma-separated: sqlite, postgres")
    parser.add_argument("--runs", default="1,10,50", help="comma-separated run counts, ascending (runs are added)")
    parser.add_argument("--steps", type=int, default=1000, help="steps each run logs (default 1000)")
    parser.add_argument("--passes", type=int, default=20, help="timed passes per run count (default 20)")
    parser.add_argument("--pg-url", default=DEFAULT_PG_ADMIN_URL, help="Postgres admin URL for a scratch database")
    args = parser.parse_args()
    counts = [int(c) for c in args.runs.split(",")]
    os.environ["AMPWATCH_ALERT_EVAL_INTERVAL_S"] = "3600"  # (the server's own evaluator must not take the runs' leases)
    print(f"{'backend':<9} {'runs':>5} {'ms / pass':>10} {'(min)':>7} {'ms / run':>9} {'SQL / run':>10}")
    for backend in args.backends.split(","):
        if backend == "postgres" and (problem := postgres_problem(args.pg_url)):
            print(f"postgres: skipped, not reachable at {args.pg_url}: {problem}")
            continue
        with scratch_database(backend, args.pg_url) as db_url, tempfile.TemporaryDirectory() as tmp:
            with Server(db_url, Path(tmp) / "server.log") as server:
                server.wait_ready()
                made = 0
                for count in counts:
                    _make_runs(server.url, count, args.steps, made)
                    made = count
                    median, low, statements = _measure(db_url, args.passes)
                    print(
                        f"{backend:<9} {count:>5} {median * 1e3:>10.2f} {low * 1e3:>7.2f} {median * 1e3 / count:>9.2f} "
                        f"{statements / count:>10.1f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
