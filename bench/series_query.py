"""Series-query latency (10k / 100k / 1M points, SQLite and Postgres) and SSE end-to-end latency.

Series: one run with a 10k-, a 100k- and a 1M-step series (a noisy loss curve with a few NaN, ±Infinity and
spikes), loaded straight into a fresh database migrated by the server's own code, with the per-block
rollups (`point_blocks`) that ingest keeps built by the server's own `rollups.rebuild_blocks`. "Server time" is what
`GET /runs/{id}/series` spends in-process: the SQL downsampling (`store.read_series`) plus JSON encoding,
measured with the same functions the endpoint calls. Then the same requests over HTTP to a real
`ampwatch server`, for the wall time a browser sees.

SSE: a real `ampwatch server`, an SSE client on `/api/v1/runs/{id}/stream`, and single-step batches POSTed
as the agent sends them; latency is from the start of the POST to the moment the client has parsed the
update carrying that step. (The agent batches for up to `AMPWATCH_FLUSH_INTERVAL_S`, 0.5 s, before it sends.)

    python bench/series_query.py                   # both backends
    python bench/series_query.py --backends sqlite --repeat 5

Target (the product's, docs/benchmarks.md): a 1 000 000-step series charted in < 200 ms; < 1 s from send to screen.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parent))
# (after the path insert)
from _common import DEFAULT_PG_ADMIN_URL, Server, percentile, postgres_problem, scratch_database  # noqa: E402

SIZES = (10_000, 100_000, 1_000_000)
TARGET_MS = 200.0

_FILL = {  # n points 0..n-1 of one series: a decaying noisy curve; NaN every 97 001 steps, spikes every 250 013
    "sqlite": """
        WITH RECURSIVE g(s) AS (SELECT 0 UNION ALL SELECT s + 1 FROM g WHERE s + 1 < :n)
        INSERT INTO points (series_id, rank, step, value)
        SELECT :sid, 0, s, CASE WHEN s % 97001 = 5 THEN NULL WHEN s % 250013 = 7 THEN 1e6 WHEN s = :n - 3 THEN 9e999
                                ELSE 2.0 / (1 + s / 1000.0) + (abs(random()) % 1000) / 10000.0 END FROM g""",
    "postgres": """
        INSERT INTO points (series_id, rank, step, value)
        SELECT :sid, 0, s, CASE WHEN s % 97001 = 5 THEN NULL WHEN s % 250013 = 7 THEN 1e6
                                WHEN s = :n - 3 THEN 'Infinity'
                                ELSE 2.0 / (1 + s / 1000.0) + random() / 10 END FROM generate_series(0, :n - 1) AS s""",
}


def load(db_url: str, backend: str, sizes: tuple[int, ...] = SIZES) -> tuple[Any, str]:
    """A migrated database holding run `bench` with a series `s<n>` of n points for each of `sizes`."""
    from ampwatch.server import db, partitions, rollups, store
    from ampwatch.server.schemas import RunIn

    engine = db.make_engine(db_url)
    db.upgrade(engine)
    sessions = db.session_factory(engine)
    with sessions() as session:
        store.register_run(session, run_id="bench", body=RunIn(project="bench", name="series"))
        for n in sizes:
            # (Postgres: the id comes from the run's block, which is a partition of points of its own)
            given = partitions.new_series_ids(session, "bench", 1)[0] if partitions.partitioned(session) else None
            session.execute(
                text(
                    "INSERT INTO series (id, run_id, name)"
                    " VALUES (coalesce(:id, (SELECT max(id) + 1 FROM series), 1), 'bench', :name)"
                ),
                {"id": given, "name": f"s{n}"},
            )
            sid = session.execute(text("SELECT id FROM series WHERE name = :name"), {"name": f"s{n}"}).scalar()
            session.execute(text(_FILL[backend]), {"sid": sid, "n": n})
            rollups.rebuild_blocks(session, series_id=sid, rank=0)  # what ingest keeps up to date, batch by batch
        session.commit()
    if backend == "postgres":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE points"))
            conn.execute(text("VACUUM ANALYZE point_blocks"))
    return engine, "bench"


def in_process_ms(engine: Any, name: str, repeat: int, **query: Any) -> list[float]:
    """What the series endpoint spends inside the server: the downsampling query and the JSON body."""
    from ampwatch.server import db, store
    from ampwatch.server.values import to_json

    sessions = db.session_factory(engine)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        with sessions() as session:
            data = store.read_series(session, run_id="bench", names=[name], **query)
            json.dumps({n: {"steps": s, "values": to_json(v)} for n, (s, v) in data.items()}, separators=(",", ":"))
        times.append((time.perf_counter() - start) * 1000)
    return times


def http_ms(url: str, name: str, repeat: int, params: dict[str, Any]) -> list[float]:
    """Wall time of `GET /runs/bench/series` from a client on the same machine."""
    times = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(repeat):
            start = time.perf_counter()
            reply = client.get("/api/v1/runs/bench/series", params={"name": name, **params})
            reply.raise_for_status()
            times.append((time.perf_counter() - start) * 1000)
    return times


def series_table(backend: str, pg_admin: str, repeat: int, sizes: tuple[int, ...] = SIZES) -> list[dict[str, Any]]:
    """Latency rows for one backend."""
    rows = []
    cases = [("full, max_points=2000", {"max_points": 2000}), ("zoom 10 %, max_points=2000", None)]
    with scratch_database(backend, pg_admin) as db_url, tempfile.TemporaryDirectory() as tmp:
        engine, _ = load(db_url, backend, sizes)
        with Server(db_url, Path(tmp) / "server.log") as server:
            server.wait_ready()
            for n in sizes:
                for label, query in cases:
                    query = query or {"max_points": 2000, "start": n // 2, "end": n // 2 + n // 10}
                    params = {
                        "max_points": query["max_points"],
                        **({"start_step": query["start"], "end_step": query["end"]} if "start" in query else {}),
                    }
                    inside = in_process_ms(engine, f"s{n}", repeat + 1, **query)[1:]  # the first warms the caches
                    wire = http_ms(server.url, f"s{n}", repeat + 1, params)[1:]
                    rows.append(
                        {
                            "backend": backend,
                            "points": n,
                            "query": label,
                            "server_ms": statistics.median(inside),
                            "server_p90_ms": percentile(inside, 90),
                            "http_ms": statistics.median(wire),
                        }
                    )
        engine.dispose()
    return rows


def sse_latency(backend: str, pg_admin: str, sends: int) -> list[float]:
    """Seconds from the start of each POST to the parsed SSE update carrying its step."""
    with scratch_database(backend, pg_admin) as db_url, tempfile.TemporaryDirectory() as tmp:
        with (
            Server(db_url, Path(tmp) / "server.log") as server,
            httpx.Client(base_url=server.url, timeout=30) as client,
        ):
            server.wait_ready()
            client.put("/api/v1/runs/live", json={"project": "bench", "name": "sse"}).raise_for_status()
            received: dict[int, float] = {}
            ready = threading.Event()
            reader = threading.Thread(target=_read_stream, args=(server.url, received, ready, sends), daemon=True)
            reader.start()
            ready.wait(10)
            time.sleep(0.3)
            sent: dict[int, float] = {}
            for step in range(sends):
                sent[step] = time.perf_counter()
                body = {"seq": step + 1, "points": {"loss": {"steps": [step], "values": [1.0 / (step + 1)]}}}
                client.post("/api/v1/runs/live/batches", json=body).raise_for_status()
                time.sleep(0.15 + (step % 7) * 0.02)  # arrivals at varied phases of the stream's polling
            reader.join(10)
    return [received[s] - sent[s] for s in sent if s in received]


def _read_stream(url: str, received: dict[int, float], ready: threading.Event, sends: int) -> None:
    with (
        httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=30)) as client,
        client.stream("GET", "/api/v1/runs/live/stream", params={"after_step": -1}) as response,
    ):
        ready.set()
        for line in response.iter_lines():
            if line.startswith("data:"):
                data = json.loads(line[5:])
                for step in data.get("points", {}).get("loss", {}).get("steps", []):
                    received.setdefault(step, time.perf_counter())
                if len(received) >= sends:
                    return


def main() -> int:
    """Print both tables; the exit status is 0 when the 1M-point SQLite query meets the target."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgres"], choices=["sqlite", "postgres"])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--sends", type=int, default=40)
    parser.add_argument("--pg-admin-url", default=DEFAULT_PG_ADMIN_URL)
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=list(SIZES), help="points per series (default: 10 000, 100 000, 1M)"
    )
    args = parser.parse_args()
    backends = [b for b in args.backends if b == "sqlite" or not _skip_postgres(args.pg_admin_url)]
    print(f"{'backend':<9} {'points':>9}  {'query':<27} {'server ms':>9} {'p90':>7} {'HTTP ms':>8}")
    met: bool | None = None  # (None: the 1M-point SQLite series was not among --sizes)
    for backend in backends:
        for row in series_table(backend, args.pg_admin_url, args.repeat, tuple(args.sizes)):
            print(
                f"{row['backend']:<9} {row['points']:>9,}  {row['query']:<27} "
                f"{row['server_ms']:>9.1f} {row['server_p90_ms']:>7.1f} {row['http_ms']:>8.1f}"
            )
            if backend == "sqlite" and row["points"] == 1_000_000 and row["query"].startswith("full"):
                met = row["server_ms"] < TARGET_MS
    print(f"\nSSE end-to-end (POST start -> update parsed by an SSE client), {args.sends} sends:")
    for backend in backends:
        lat = sorted(x * 1000 for x in sse_latency(backend, args.pg_admin_url, args.sends))
        print(
            f"  {backend:<9} received {len(lat)}/{args.sends}  p50 {percentile(lat, 50):6.1f} ms  "
            f"p95 {percentile(lat, 95):6.1f} ms  max {max(lat or [float('nan')]):6.1f} ms"
        )
    if met is None:
        print("\n1M-point SQLite series: not measured (not among --sizes)")
    else:
        print(
            f"\n1M-point SQLite series in {'<' if met else '>='} {TARGET_MS:.0f} ms server time: "
            f"{'met' if met else 'NOT met'}"
        )
    return 1 if met is False else 0


def _skip_postgres(admin_url: str) -> bool:
    problem = postgres_problem(admin_url)
    if problem:
        print(f"(Postgres skipped: {problem})")
    return bool(problem)


if __name__ == "__main__":
    sys.exit(main())
