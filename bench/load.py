"""Load: many concurrent agents against one server, on SQLite and on Postgres.

Each agent is a real `ampwatch.Run` (its own sender thread, spool and retries) in a training-like loop that
logs `--scalars` values per step, `--step-ms` apart, for `--steps` steps. The agents run as threads spread
over `--procs` client processes against one `ampwatch server` process. Ingest latency is the time of each
batch request as the agent sees it: the agent's transport is wrapped with a timer in the client processes
(nothing else about the agent changes). At the end every run is read back through the API (every step, every
value) and the points table is counted in the database, so a point stored twice or lost fails the check.

    python bench/load.py                                  # 50 agents x 2000 steps, SQLite then Postgres
    python bench/load.py --agents 10 --steps 300          # a quick run
    python bench/load.py --backends sqlite --step-ms 0    # agents log as fast as they can
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    DEFAULT_PG_ADMIN_URL,
    Server,
    cpu_count,
    percentile,
    postgres_problem,
    process_cpu_seconds,
    scratch_database,
)  # noqa: E402

NAMES = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "aux_loss", "z_loss", "acc")


def value(agent: int, name: int, step: int) -> float:
    """What agent `agent` logs for series `name` at `step`: exact in float64, different everywhere."""
    return agent * 1_000_003.0 + name * 100_003.0 + step / 8


def client_main(url: str, agents: list[int], args: dict[str, Any], start: Any, results: Any) -> None:
    """One client process: its agents as threads, each a real Run; the transport timed."""
    from ampwatch import _transport

    timings: list[tuple[float, int, int]] = []  # (seconds, status, points) per batch request
    send = _transport.HttpTransport.send

    def timed(self: Any, method: str, path: str, body: bytes) -> Any:
        started = time.perf_counter()
        reply = send(self, method, path, body)
        if path.endswith("/batches"):
            points = sum(len(s["steps"]) for s in json.loads(body).get("points", {}).values())
            timings.append((time.perf_counter() - started, reply.status, points))
        return reply

    _transport.HttpTransport.send = timed  # type: ignore[method-assign]
    import ampwatch

    spans: dict[int, tuple[float, float, str]] = {}

    def agent(index: int) -> None:
        run = ampwatch.init("load", f"agent-{index}", url=url, config={"agent": index})
        names = NAMES[: args["scalars"]]
        start.wait()  # every agent of every process has registered its run
        started = time.time()
        for step in range(args["steps"]):
            run.log({n: value(index, k, step) for k, n in enumerate(names)}, step=step)
            if args["step_ms"]:
                time.sleep(args["step_ms"] / 1000)
        run.finish()
        spans[index] = (started, time.time(), run.id)

    threads = [threading.Thread(target=agent, args=(i,)) for i in agents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results.put({"spans": spans, "timings": timings})


def verify(url: str, db_url: str, spans: dict[int, tuple[float, float, str]], args: argparse.Namespace) -> list[str]:
    """Every run's every step and value through the read API, and the database's point count."""
    from sqlalchemy import create_engine, text

    problems = []
    names = NAMES[: args.scalars]
    expected_steps = list(range(args.steps))
    for index, (_, _, run_id) in spans.items():
        query = "&".join(f"name={n}" for n in names)
        with urllib.request.urlopen(f"{url}/api/v1/runs/{run_id}/series?{query}", timeout=120) as reply:
            series = json.load(reply)
        for k, name in enumerate(names):
            got = series[name]
            if got["steps"] != expected_steps or got["values"] != [value(index, k, s) for s in expected_steps]:
                problems.append(f"agent {index}: series {name} has {len(got['steps'])} points, or wrong values")
    engine = create_engine(db_url)
    with engine.connect() as connection:
        stored = connection.execute(text("SELECT count(*) FROM points")).scalar_one()
    engine.dispose()
    if stored != len(spans) * args.steps * args.scalars:
        problems.append(f"the database holds {stored} points, not {len(spans) * args.steps * args.scalars}")
    return problems


def run_backend(backend: str, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """One server, `args.agents` agents; the numbers and the check."""
    ctx = mp.get_context("spawn")
    with scratch_database(backend, args.pg_url) as db_url, Server(db_url, logs / f"server-{backend}.log") as server:
        server.wait_ready()
        start, results = ctx.Barrier(args.agents + 1), ctx.Queue()
        shares = [list(range(p, args.agents, args.procs)) for p in range(args.procs)]
        knobs = {"steps": args.steps, "step_ms": args.step_ms, "scalars": args.scalars}
        procs = [
            ctx.Process(target=client_main, args=(server.url, share, knobs, start, results))
            for share in shares
            if share
        ]
        for proc in procs:
            proc.start()
        start.wait(timeout=args.timeout_s)
        cpu0 = process_cpu_seconds(server.pid)
        outs = [results.get(timeout=args.timeout_s) for _ in procs]
        cpu1 = process_cpu_seconds(server.pid)
        for proc in procs:
            proc.join(30)
        spans = {i: span for out in outs for i, span in out["spans"].items()}
        timings = [t for out in outs for t in out["timings"]]
        problems = (
            verify(server.url, db_url, spans, args)
            if len(spans) == args.agents
            else [f"only {len(spans)} agents finished"]
        )
    wall = max(end for _, end, _ in spans.values()) - min(start for start, _, _ in spans.values())
    latencies = [seconds for seconds, _, _ in timings]
    failed = [status for _, status, _ in timings if status != 200]
    points = args.agents * args.steps * args.scalars
    return {
        "backend": backend,
        "agents": args.agents,
        "steps": args.steps,
        "points": points,
        "wall_s": wall,
        "points_s": points / wall,
        "requests": len(timings),
        "failed_requests": len(failed),
        "statuses": sorted(set(failed)),
        "points_per_request": sum(p for _, _, p in timings) / max(1, len(timings)),
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "max_ms": max(latencies, default=math.nan) * 1e3,
        "server_cpu": (cpu1 - cpu0) / wall,
        "problems": problems,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backends", default="sqlite,postgres", help="comma-separated: sqlite, postgres (default both)"
    )
    parser.add_argument("--agents", type=int, default=50, help="concurrent agents, one run each (default 50)")
    parser.add_argument("--steps", type=int, default=2000, help="steps per agent (default 2000)")
    parser.add_argument(
        "--scalars", type=int, default=4, choices=range(1, len(NAMES) + 1), help="values logged per step (default 4)"
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        default=5.0,
        help="training step time each agent sleeps (default 5; 0: as fast as it can)",
    )
    parser.add_argument("--procs", type=int, default=5, help="client processes the agents are spread over (default 5)")
    parser.add_argument(
        "--timeout-s", type=float, default=900.0, help="give up on a backend after this long (default 900)"
    )
    parser.add_argument(
        "--pg-url",
        default=DEFAULT_PG_ADMIN_URL,
        help="Postgres admin URL; a scratch database is created there and dropped",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    offered = args.agents * args.scalars * 1000 / args.step_ms if args.step_ms else math.inf
    print(
        f"ampwatch load benchmark: {args.agents} agents x {args.steps} steps x {args.scalars} scalars, "
        f"step {args.step_ms:g} ms "
        f"(offered {offered:,.0f} points/s), {args.procs} client processes, {cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    logs = Path(tempfile.mkdtemp(prefix="ampwatch-load-"))
    os.environ["AMPWATCH_SPOOL_DIR"] = str(logs / "spool")  # inherited by the client processes
    os.environ.setdefault("AMPWATCH_FINISH_TIMEOUT_S", str(args.timeout_s))
    rows = []
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        problem = postgres_problem(args.pg_url) if backend == "postgres" else None
        if problem:
            print(f"postgres skipped: {problem}")
            continue
        rows.append(run_backend(backend, args, logs))
        r = rows[-1]
        check = "every point once" if not r["problems"] else "; ".join(r["problems"][:5])
        print(
            f"{r['backend']:<9} {r['points']:>10,} points in {r['wall_s']:6.1f} s: "
            f"{r['points_s']:>9,.0f} points/s sustained, "
            f"{r['requests']:,} requests ({r['points_per_request']:.0f} points each), latency p50 {r['p50_ms']:.1f} ms "
            f"p99 {r['p99_ms']:.1f} ms max {r['max_ms']:.0f} ms, {r['failed_requests']} failed {r['statuses']}, "
            f"server CPU {r['server_cpu']:.0%}: {check}",
            flush=True,
        )
    print(
        "sustained = all points / (first agent's first step .. last agent's finish() returning, "
        "i.e. all acknowledged);\n"
        "latency = one batch request as the agent's transport sees it; server CPU 100% = one core."
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 1 if any(r["problems"] or r["failed_requests"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
