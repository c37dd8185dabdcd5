"""Ingest throughput through the real HTTP API: points/s into SQLite and Postgres.

Starts `ampwatch server` (uvicorn) on a loopback port for each backend, registers one run per client,
then client processes POST agent-shaped batches (`loss`, `scale`, `skipped`, `grad_norm` and per-layer
`grad_norm/<module>` series, some values NaN or infinite; steps and values packed as base64 of
int64/float64 as the agent sends them, or with `--json-lists` as JSON lists) as fast as the server
acknowledges them. Bodies are built before the clock starts, so the numbers are the server's.

    python bench/ingest.py                       # SQLite and Postgres, batches of 5k, 20k and 50k points
    python bench/ingest.py --backends sqlite --batch-sizes 50000 --clients 1

Target (the product's, docs/benchmarks.md): >= 200 000 points/s on SQLite on a 2-core machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ampwatch._transport import packed as pack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_PG_ADMIN_URL,
    Server,
    cpu_count,
    percentile,
    postgres_problem,
    process_cpu_seconds,
    scratch_database,
)

TARGET_SQLITE_POINTS_S = 200_000
_NONFINITE = ("NaN", "Infinity", "-Infinity")


def series_names(layers: int) -> list[str]:
    """The standard series plus per-layer gradient norms of a `layers`-block transformer."""
    modules = ["embed"] + [
        f"blocks.{i}.{m}" for i in range(layers) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    ]
    return ["loss", "scale", "skipped", "grad_norm"] + [f"grad_norm/{m}" for m in modules + ["lm_head"]]


def make_body(
    seq: int, first_step: int, steps: int, names: list[str], rng: random.Random, nonfinite: float, packed: bool = True
) -> bytes:
    """One batch as the agent sends it: every series has `steps` consecutive steps, packed as base64 of
    int64/float64 (or, `packed=False`, as JSON lists with non-finite values spelled out, as other clients may)."""
    step_list = list(range(first_step, first_step + steps))
    points: dict[str, dict[str, list[Any]]] = {}
    for name in names:
        if name == "loss":
            values: list[Any] = [2.0 * math.exp(-s / 50_000) + rng.random() * 0.1 for s in step_list]
        elif name == "scale":
            values = [float(2 ** (16 - (s // 997) % 8)) for s in step_list]
        elif name == "skipped":
            values = [1.0 if rng.random() < 0.01 else 0.0 for _ in step_list]
        else:
            values = [rng.lognormvariate(0.0, 1.0) for _ in step_list]
        if name != "skipped":
            for i in range(steps):
                if rng.random() < nonfinite:
                    values[i] = rng.choice(_NONFINITE)
        if packed:
            points[name] = {"steps": pack(step_list, "q"), "values": pack([float(v) for v in values], "d")}
        else:
            points[name] = {"steps": step_list, "values": values}
    doc = {"rank": 0, "seq": seq, "points": points, "events": [], "status": None}
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()


@dataclass
class ClientJob:
    port: int
    run_id: str
    batch_points: int
    total_points: int
    layers: int
    nonfinite: float
    max_seconds: float
    seed: int
    packed: bool = True


def client_main(job: ClientJob, ready: Any, go: Any, results: Any) -> None:
    """One client process: build its bodies, wait for the start, send them in order over keep-alive."""
    names = series_names(job.layers)
    steps_per_batch = max(1, job.batch_points // len(names))
    n_batches = max(1, math.ceil(job.total_points / (steps_per_batch * len(names))))
    rng = random.Random(job.seed)
    bodies = [
        make_body(k + 1, k * steps_per_batch, steps_per_batch, names, rng, job.nonfinite, job.packed)
        for k in range(n_batches)
    ]
    points_per_batch = steps_per_batch * len(names)
    conn = http.client.HTTPConnection("127.0.0.1", job.port, timeout=120)
    headers = {"Content-Type": "application/json", "User-Agent": "ampwatch-bench"}
    path = f"/api/v1/runs/{job.run_id}/batches"
    ready.wait()
    go.wait()
    latencies: list[float] = []
    errors: list[str] = []
    points = steps_done = 0
    start = time.perf_counter()
    for body in bodies:
        t0 = time.perf_counter()
        try:
            conn.request("POST", path, body, headers)
            reply = conn.getresponse()
            text = reply.read()
        except OSError as error:
            errors.append(repr(error))
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", job.port, timeout=120)
            continue
        latencies.append(time.perf_counter() - t0)
        answer = json.loads(text) if reply.status == 200 else {}
        if reply.status != 200 or answer.get("points") != points_per_batch:
            errors.append(f"{reply.status}: {text[:200]!r}")
        else:
            points += points_per_batch
            steps_done += steps_per_batch
        if time.perf_counter() - start > job.max_seconds:
            break
    end = time.perf_counter()
    conn.close()
    results.put(
        {
            "run_id": job.run_id,
            "start": start,
            "end": end,
            "points": points,
            "steps": steps_done,
            "latencies": latencies,
            "errors": errors,
            "body_bytes": len(bodies[0]),
        }
    )


def _request(port: int, method: str, path: str, doc: dict[str, Any] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps(doc).encode() if doc is not None else None
    conn.request(method, path, body, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    data = reply.read()
    conn.close()
    return reply.status, data


def run_config(server: Server, backend: str, batch_points: int, args: argparse.Namespace) -> dict[str, Any]:
    """One (backend, batch size) measurement with `args.clients` concurrent client processes."""
    ctx = mp.get_context("spawn")
    ready = ctx.Barrier(args.clients + 1)
    go = ctx.Event()
    results = ctx.Queue()
    jobs = []
    for c in range(args.clients):
        run_id = f"bench-{backend}-{batch_points}-{c}-{os.getpid()}"
        status, data = _request(server.port, "PUT", f"/api/v1/runs/{run_id}", {"project": "bench", "name": run_id})
        if status != 200:
            raise RuntimeError(f"registering {run_id} failed ({status}): {data[:300]!r}")
        jobs.append(
            ClientJob(
                server.port,
                run_id,
                batch_points,
                args.points // args.clients,
                args.layers,
                args.nonfinite,
                args.max_seconds,
                seed=c + batch_points,
                packed=not args.json_lists,
            )
        )
    procs = [ctx.Process(target=client_main, args=(job, ready, go, results), daemon=True) for job in jobs]
    for p in procs:
        p.start()
    try:
        ready.wait(timeout=300)  # every client has built its bodies
        spy = _start_py_spy(server.pid, args.profile, f"server-{backend}-{batch_points}")
        cpu0 = process_cpu_seconds(server.pid)
        go.set()
        outs = [results.get(timeout=args.max_seconds + 300) for _ in procs]
        cpu1 = process_cpu_seconds(server.pid)
        _stop_py_spy(spy)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    wall = max(o["end"] for o in outs) - min(o["start"] for o in outs)
    points = sum(o["points"] for o in outs)
    latencies = [x for o in outs for x in o["latencies"]]
    errors = [e for o in outs for e in o["errors"]]
    verified = all(_stored_steps(server.port, o["run_id"]) == o["steps"] for o in outs)
    return {
        "backend": backend,
        "batch_points": batch_points,
        "clients": args.clients,
        "requests": len(latencies),
        "points": points,
        "wall_s": wall,
        "points_s": points / wall if wall > 0 else 0.0,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "server_cpu": (cpu1 - cpu0) / wall if wall > 0 else float("nan"),
        "points_per_cpu_s": points / (cpu1 - cpu0) if cpu1 > cpu0 else float("nan"),
        "body_kib": outs[0]["body_bytes"] / 1024,
        "errors": errors,
        "verified": verified,
    }


def _start_py_spy(pid: int, profile_dir: str | None, name: str) -> subprocess.Popen[bytes] | None:
    """Sample the server with py-spy while a row runs (collapsed stacks, one file per row)."""
    if not profile_dir:
        return None
    out = Path(profile_dir) / f"{name}.txt"
    command = ["py-spy", "record", "--pid", str(pid), "--rate", "200", "--format", "raw", "--output", str(out)]
    spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # let it attach before the clients start
    return spy


def _stop_py_spy(spy: subprocess.Popen[bytes] | None) -> None:
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
        try:
            spy.wait(30)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()


def _stored_steps(port: int, run_id: str) -> int:
    """How many `loss` points the server returns for the run: a check that acks were real."""
    status, data = _request(port, "GET", f"/api/v1/runs/{run_id}/series?name=loss")
    return len(json.loads(data)["loss"]["steps"]) if status == 200 else -1


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'backend':<9} {'batch pts':>9} {'body KiB':>8} {'clients':>7} {'requests':>8} {'points':>9} "
        f"{'points/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'server CPU':>10} {'pts/server CPU-s':>16}  check"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        check = (
            "ok" if r["verified"] and not r["errors"] else f"{len(r['errors'])} errors" if r["errors"] else "MISMATCH"
        )
        print(
            f"{r['backend']:<9} {r['batch_points']:>9,} {r['body_kib']:>8.0f} {r['clients']:>7} {r['requests']:>8} "
            f"{r['points']:>9,} {r['points_s']:>10,.0f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
            f"{r['server_cpu']:>9.0%} {r['points_per_cpu_s']:>16,.0f}  {check}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backends", default="sqlite,postgres", help="comma-separated: sqlite, postgres (default both)"
    )
    parser.add_argument(
        "--batch-sizes", default="5000,20000,50000", help="points per batch, comma-separated (default 5000,20000,50000)"
    )
    parser.add_argument("--clients", type=int, default=2, help="concurrent client processes, one run each (default 2)")
    parser.add_argument(
        "--points",
        type=int,
        default=2_000_000,
        help="points to send per configuration, all clients together (default 2000000)",
    )
    parser.add_argument(
        "--max-seconds", type=float, default=8.0, help="stop a configuration after this long (default 8)"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=12,
        help="transformer blocks: 4 per-layer grad-norm series each (default 12 -> 54 series)",
    )
    parser.add_argument(
        "--nonfinite",
        type=float,
        default=0.002,
        help="fraction of values sent as NaN/Infinity/-Infinity (default 0.002)",
    )
    parser.add_argument(
        "--json-lists",
        action="store_true",
        help="send steps and values as JSON lists (non-finite values "
        "spelled out) instead of packed as the agent sends them",
    )
    parser.add_argument(
        "--pg-url",
        default=DEFAULT_PG_ADMIN_URL,
        help="Postgres admin URL; a scratch database is created there and dropped",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--profile", metavar="DIR", help="attach py-spy to the server during each row; collapsed stacks go to DIR"
    )
    parser.add_argument("--keep-logs", action="store_true", help="print where the server logs are and keep them")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    print(
        f"ampwatch ingest benchmark: {cpu_count()} CPUs, {args.clients} client process(es), "
        f"{len(series_names(args.layers))} series per batch, "
        f"~{args.points:,} points or {args.max_seconds:g} s per row, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    if args.profile:
        if shutil.which("py-spy") is None:
            print("--profile needs py-spy on PATH (pip install py-spy)", file=sys.stderr)
            return 2
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    logs = Path(tempfile.mkdtemp(prefix="ampwatch-bench-logs-"))
    for backend in backends:
        if backend == "postgres":
            problem = postgres_problem(args.pg_url)
            if problem:
                notes.append(f"postgres skipped: {problem}")
                continue
        with scratch_database(backend, args.pg_url) as db_url, Server(db_url, logs / f"server-{backend}.log") as server:
            server.wait_ready()
            for size in sizes:
                row = run_config(server, backend, size, args)
                rows.append(row)
                print(f"  {backend:<8} {size:>6,} pts/batch: {row['points_s']:>10,.0f} points/s", flush=True)
                for error in row["errors"][:3]:
                    notes.append(f"{backend} {size}: {error}")
    print()
    print_table(rows)
    sqlite_best = max((r["points_s"] for r in rows if r["backend"] == "sqlite"), default=None)
    if sqlite_best is not None:
        verdict = "met" if sqlite_best >= TARGET_SQLITE_POINTS_S else "MISSED"
        print(f"\ntarget >= {TARGET_SQLITE_POINTS_S:,} points/s on SQLite: best {sqlite_best:,.0f} -> {verdict}")
    print(
        "server CPU = CPU time of the server process / wall time (100% = one core). pts/server CPU-s = points per\n"
        "CPU-second of the server process: its capacity per core, little affected by other load on the machine\n"
        "(the database's own processes are not in it: for Postgres they run beside it)."
    )
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {cpu_count()} CPUs")
    for note in notes:
        print("note:", note)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if args.profile:
        print(f"py-spy profiles (collapsed stacks) in {args.profile}")
    if args.keep_logs:
        print(f"server logs kept in {logs}")
    else:
        for f in logs.iterdir():
            f.unlink()
        logs.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
