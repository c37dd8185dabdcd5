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
    python bench/scale.py --tabs 1 50 200      # open tabs on one run instead (a real `ampwatch server`)
    python bench/scale.py --replicas 1 3       # ingest through 1 and 3 replicas on one Postgres, behind nginx

Tabs: N live streams of one run (the run page's), held by one asyncio client process, and a real
`ampwatch server` process; one single-step batch every 0.25 s. Server CPU is the server process's user+system
time over the sending window divided by its length; point-to-screen latency is from the start of the POST to
the moment a stream has parsed the update holding that step, over every stream and step.

Replicas: N `ampwatch server` processes on one scratch Postgres behind Debian's nginx (the shipped locations),
`--senders` client threads each sending 2 000-point batches (4 series x 500 steps) of a run of its own for
`--seconds`; points/s acknowledged, and the CPU each side used over the window (share of one core, from /proc:
the replicas together, nginx, every postgres process of the machine, this client), so the bound shows.

Target: the runs page and the first page of /api/v1/runs at 10 000 runs, p50 < 100 ms on both backends, with
statements per request independent of the number of runs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import httpx  # noqa: E402
from _common import (  # noqa: E402  (after the path insert)
    DEFAULT_PG_ADMIN_URL,
    Server,
    free_port,
    percentile,
    postgres_problem,
    scratch_database,
)
from sqlalchemy import event, insert  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from ampwatch.server import models  # noqa: E402
from ampwatch.server.app import create_app  # noqa: E402
from ampwatch.server.deploy import write_loopback_nginx  # noqa: E402
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
            connection.execute(
                insert(models.Run),
                [
                    {
                        "id": f"run-{i:06d}",
                        "project_id": i % 10 + 1,
                        "name": f"exp-{i}",
                        "status": "finished" if i % 3 else "running",
                        "health": ("ok", "warning", "critical")[i % 3],
                        "config": {"lr": 1e-3},
                        "environment": {"world_size": 1},
                        "created_at": now - timedelta(seconds=i),
                        "last_seen_at": now - timedelta(seconds=i),
                        "finished_at": None,
                        "last_step": 1000 + i,
                        "skip_rate": 0.01 * (i % 7),
                        "scale": 65536.0,
                        "scale_step": 1000 + i,
                    }
                    for i in ids
                ],
            )
            connection.execute(
                insert(models.Alert),
                [
                    {
                        "run_id": f"run-{i:06d}",
                        "rule": "nonfinite_loss",
                        "severity": "critical",
                        "state": "firing",
                        "started_at": now,
                        "resolved_at": None,
                        "summary": "NaN loss",
                        "rule_id": None,
                        "rank": -1,
                        "step": 5,
                        "last_step": 5,
                        "count": 1,
                        "fired_at": now,
                        "cleared_at": None,
                        "last_notified_at": None,
                        "updated_at": now,
                        "details": {},
                    }
                    for i in ids
                    if i % 10 == 0
                ],
            )


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


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _tabs_round(url: str, pid: int, tabs: int, first_step: int, sends: int) -> tuple[float, list[float], int]:
    """(server CPU share, latencies in s, updates missing) of one round of `tabs` open streams."""
    arrived: dict[int, list[float]] = collections.defaultdict(list)
    connected = 0
    limits = httpx.Limits(max_connections=tabs + 10, max_keepalive_connections=tabs + 10)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:

        async def tab() -> None:
            nonlocal connected
            async with client.stream("GET", "/api/v1/runs/tabs/stream") as reply:
                connected += 1
                async for line in reply.aiter_lines():
                    if line.startswith("data:"):
                        now = time.perf_counter()
                        for step in json.loads(line[5:])["points"].get("loss", {}).get("steps", []):
                            arrived[step].append(now)

        tasks = [asyncio.create_task(tab()) for _ in range(tabs)]
        while connected < tabs:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # (every stream past its own catch-up)
        sent: dict[int, float] = {}
        cpu, wall = _cpu_s(pid), time.perf_counter()
        for step in range(first_step, first_step + sends):
            sent[step] = time.perf_counter()
            body = {"seq": step + 1, "points": {"loss": {"steps": [step], "values": [1.0]}}}
            (await client.post("/api/v1/runs/tabs/batches", json=body)).raise_for_status()
            await asyncio.sleep(0.25)
        share = (_cpu_s(pid) - cpu) / (time.perf_counter() - wall)
        deadline = time.monotonic() + 10
        while sum(len(arrived[s]) for s in sent) < tabs * sends and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    latencies = [at - sent[step] for step in sent for at in arrived[step]]
    return share, latencies, tabs * sends - len(latencies)


def tabs_benchmark(counts: list[int], sends: int, backend: str, pg_admin: str) -> None:
    with scratch_database(backend, pg_admin) as db_url, tempfile.TemporaryDirectory() as tmp:
        server = Server(db_url, Path(tmp) / "server.log")
        try:
            server.wait_ready()
            httpx.put(f"{server.url}/api/v1/runs/tabs", json={"project": "bench", "name": "tabs"}).raise_for_status()
            for i, tabs in enumerate(counts):
                share, latencies, missing = asyncio.run(_tabs_round(server.url, server.pid, tabs, i * sends, sends))
                p50, p95 = percentile(latencies, 50) * 1000, percentile(latencies, 95) * 1000
                print(f"| {backend} | {tabs} | {share:.2f} | {p50:.0f} ms | {p95:.0f} ms | {missing} |", flush=True)
        finally:
            server.stop()


def _nginx(ports: list[int], folder: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """nginx on a loopback port balancing over `ports`, as `ampwatch.server.deploy` configures it."""
    port = free_port()
    config = write_loopback_nginx(folder, port, ports)
    command = [shutil.which("nginx") or "/usr/sbin/nginx", "-p", str(folder), "-c", str(config)]
    nginx = subprocess.Popen([*command, "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return url, nginx
        except httpx.TransportError:
            time.sleep(0.05)
    nginx.kill()
    raise RuntimeError("nginx did not start")


def _postgres_cpu_s() -> float:
    """CPU seconds of every postgres process on this machine (the shared server: others' load counts too)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if "(postgres)" in text:
            fields = text.rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _children_cpu_s(pid: int) -> float:
    """The process and its children (nginx's workers)."""
    total = _cpu_s(pid)
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        with contextlib.suppress(OSError):
            total += _cpu_s(int(child))
    return total


def _send(url: str, stop: threading.Event, sent: list[int], i: int) -> None:
    """Batches of 2 000 points to run r<i> until `stop`, counting what was acknowledged."""
    with httpx.Client(base_url=url, timeout=60) as client:
        client.put(f"/api/v1/runs/r{i}", json={"project": "bench", "name": f"r{i}"}).raise_for_status()
        seq = 0
        while not stop.is_set():
            seq += 1
            span = list(range(seq * 500, seq * 500 + 500))
            points = {n: {"steps": span, "values": [1.5] * 500} for n in ("loss", "scale", "lr", "gn")}
            client.post(f"/api/v1/runs/r{i}/batches", json={"seq": seq, "points": points}).raise_for_status()
            sent[i] += 2000


def replicas_benchmark(counts: list[int], senders: int, seconds: float, pg_admin: str) -> None:
    print("| replicas | points/s | replicas' CPU | nginx CPU | postgres CPU (all on the machine) | client CPU |")
    print("|---|---|---|---|---|---|")
    for count in counts:
        with scratch_database("postgres", pg_admin) as db_url, tempfile.TemporaryDirectory() as tmp:
            servers = [Server(db_url, Path(tmp) / f"server{i}.log") for i in range(count)]
            nginx = None
            try:
                for server in servers:
                    server.wait_ready()
                url, nginx = _nginx([s.port for s in servers], Path(tmp))
                stop, sent = threading.Event(), [0] * senders

                threads = [threading.Thread(target=_send, args=(url, stop, sent, i)) for i in range(senders)]
                for thread in threads:
                    thread.start()
                time.sleep(3.0)  # (registered, partitions made, warm)
                before = (sum(sent), [_cpu_s(s.pid) for s in servers], _children_cpu_s(nginx.pid), _postgres_cpu_s())
                client_before, wall = time.process_time(), time.perf_counter()
                time.sleep(seconds)
                elapsed = time.perf_counter() - wall
                points = sum(sent) - before[0]
                cpu = (
                    (sum(_cpu_s(s.pid) for s in servers) - sum(before[1])) / elapsed,
                    (_children_cpu_s(nginx.pid) - before[2]) / elapsed,
                    (_postgres_cpu_s() - before[3]) / elapsed,
                    (time.process_time() - client_before) / elapsed,
                )
                stop.set()
                for thread in threads:
                    thread.join()
                print(
                    f"| {count} | {points / elapsed:,.0f} | "
                    f"{cpu[0]:.2f} | {cpu[1]:.2f} | {cpu[2]:.2f} | {cpu[3]:.2f} |",
                    flush=True,
                )
            finally:
                if nginx is not None:
                    nginx.terminate()
                    nginx.wait(10)
                for server in servers:
                    server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgres"], choices=["sqlite", "postgres"])
    parser.add_argument("--runs", nargs="+", type=int, default=[100, 1000, 10000])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--pg-admin-url", default=DEFAULT_PG_ADMIN_URL)
    parser.add_argument("--tabs", nargs="+", type=int, help="measure this many open tabs on one run instead")
    parser.add_argument("--sends", type=int, default=20, help="batches sent per round of --tabs")
    parser.add_argument("--replicas", nargs="+", type=int, help="measure ingest through this many replicas instead")
    parser.add_argument("--senders", type=int, default=6, help="client threads of --replicas, a run each")
    parser.add_argument("--seconds", type=float, default=20.0, help="the measuring window of --replicas")
    args = parser.parse_args()
    if args.replicas:
        if problem := postgres_problem(args.pg_admin_url):
            print(f"postgres skipped: {problem}")
            return
        replicas_benchmark(args.replicas, args.senders, args.seconds, args.pg_admin_url)
        return
    if args.tabs:
        print("| backend | open tabs | server CPU (share of one core) | latency p50 | latency p95 | updates missing |")
        print("|---|---|---|---|---|---|")
        for backend in args.backends:
            if backend == "postgres" and (problem := postgres_problem(args.pg_admin_url)):
                print(f"| postgres | skipped: {problem} | | | | |")
                continue
            tabs_benchmark(args.tabs, args.sends, backend, args.pg_admin_url)
        return
    print("| backend | runs | request | p50 server time | SQL statements |")
    print("|---|---|---|---|---|")
    for backend in args.backends:
        if backend == "postgres" and (problem := postgres_problem(args.pg_admin_url)):
            print(f"| postgres | – | skipped: {problem} | | |")
            continue
        run(backend, sorted(args.runs), args.repeat, args.pg_admin_url)


if __name__ == "__main__":
    main()
