"""Deleting a run of 1 000 000 points while other runs keep ingesting: how long the DELETE takes, and what the
other runs' ingest saw meanwhile.

A real `ampwatch server` on a scratch database. The big run is ingested through the API (4 series x 250 000
steps by default, in batches of 20 000 points: its rollups, feed and events are those ingest leaves). Then two
other runs send a 500-point batch each in a loop (one client thread each) while an admin's
`DELETE /api/v1/runs/big` runs; the report gives the DELETE's wall time, and for the other runs the batches
sent and the slowest batch in the 2 s before the DELETE, during it, and after it.

On Postgres the run's points are partitions of their own, truncated and then dropped (see
ampwatch.server.partitions); on SQLite they go in chunked transactions (`Settings.delete_chunk_rows`).

    python bench/delete_run.py                         # Postgres and SQLite, 1 000 000 points
    python bench/delete_run.py --backends postgres --steps 50000

Target: < 2 s on Postgres, with ingest of other runs continuing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import httpx  # noqa: E402
from _common import DEFAULT_PG_ADMIN_URL, Server, postgres_problem, scratch_database  # noqa: E402

SERIES = ("loss", "scale", "grad_norm", "lr")
BATCH_STEPS = 5000  # x 4 series: 20 000 points a batch


def fill_big(client: httpx.Client, steps: int) -> int:
    client.put("/api/v1/runs/big", json={"project": "bench", "name": "big"}).raise_for_status()
    seq = 0
    for first in range(0, steps, BATCH_STEPS):
        span = list(range(first, min(first + BATCH_STEPS, steps)))
        seq += 1
        points = {n: {"steps": span, "values": [float(s % 977) + i for s in span]} for i, n in enumerate(SERIES)}
        reply = client.post("/api/v1/runs/big/batches", json={"seq": seq, "points": points}, timeout=120)
        reply.raise_for_status()
    return steps * len(SERIES)


def other_runs(url: str, stop: threading.Event, log: list[tuple[float, float]], failed: list[str], run_id: str) -> None:
    """Send 500-point batches to `run_id` until `stop`; log (start, seconds) of each."""
    with httpx.Client(base_url=url, timeout=60) as client:
        client.put(f"/api/v1/runs/{run_id}", json={"project": "bench", "name": run_id}).raise_for_status()
        seq, step = 0, 0
        while not stop.is_set():
            seq += 1
            span = list(range(step, step + 250))
            step += 250
            body = {
                "seq": seq,
                "points": {
                    "loss": {"steps": span, "values": [1.0] * 250},
                    "lr": {"steps": span, "values": [0.1] * 250},
                },
            }
            start = time.perf_counter()
            reply = client.post(f"/api/v1/runs/{run_id}/batches", json=body)
            if reply.status_code != 200:
                failed.append(f"{run_id} batch {seq}: {reply.status_code} at {start:.2f}")
            log.append((start, time.perf_counter() - start))


def window(log: list[tuple[float, float]], lo: float, hi: float) -> str:
    inside = [d for t, d in log if lo <= t < hi or (t < lo and t + d > lo)]
    if not inside:
        return "0 batches"
    return f"{len(inside)} batches, slowest {max(inside) * 1000:.0f} ms"


def bench(backend: str, steps: int, pg_admin: str) -> None:
    with scratch_database(backend, pg_admin) as db_url, tempfile.TemporaryDirectory() as tmp:
        server = Server(db_url, Path(tmp) / "server.log")
        try:
            server.wait_ready()
            with httpx.Client(base_url=server.url, timeout=60) as client:
                start = time.perf_counter()
                points = fill_big(client, steps)
                filled = time.perf_counter() - start
                stop = threading.Event()
                log: list[tuple[float, float]] = []
                failed: list[str] = []
                threads = [
                    threading.Thread(target=other_runs, args=(server.url, stop, log, failed, f"other-{i}"))
                    for i in (1, 2)
                ]
                for thread in threads:
                    thread.start()
                time.sleep(3.0)  # (the other runs registered and sending)
                t0 = time.perf_counter()
                reply = client.delete("/api/v1/runs/big", timeout=600)
                t1 = time.perf_counter()
                reply.raise_for_status()
                time.sleep(2.0)
                stop.set()
                for thread in threads:
                    thread.join()
            print(
                f"| {backend} | {points:,} | {t1 - t0:.2f} s | {window(log, t0 - 2, t0)} | {window(log, t0, t1)}"
                f" | {window(log, t1, t1 + 2)} | (filled in {filled:.0f} s) |",
                flush=True,
            )
            if failed:
                print(
                    f"{len(failed)} batches of the other runs failed (DELETE from {t0:.2f} to {t1:.2f}): {failed[:5]}"
                )
                print(server.log_tail(80))
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["postgres", "sqlite"], choices=["sqlite", "postgres"])
    parser.add_argument("--steps", type=int, default=250_000, help="steps of the big run (x 4 series)")
    parser.add_argument("--pg-admin-url", default=DEFAULT_PG_ADMIN_URL)
    args = parser.parse_args()
    print("| backend | points deleted | DELETE wall time | other runs, 2 s before | during | 2 s after | |")
    print("|---|---|---|---|---|---|---|")
    for backend in args.backends:
        if backend == "postgres" and (problem := postgres_problem(args.pg_admin_url)):
            print(f"| postgres | – | skipped: {problem} | | | | |")
            continue
        bench(backend, args.steps, args.pg_admin_url)


if __name__ == "__main__":
    main()
