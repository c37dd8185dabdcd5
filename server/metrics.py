"""`GET /metrics` in the Prometheus text format (prometheus-client), one `CollectorRegistry` per app.

Two kinds of numbers. This process's own traffic, counted by an ASGI middleware as requests pass (each replica
counts its own: sum them): ingested batches by outcome, points, batch latency, open live streams. And what the
database holds, read at scrape time in six queries whatever the number of runs (identical on every replica: take
one, not the sum): runs by status, the alert delivery queue and deliveries by outcome, and per-run gauges.

Per-run gauges (`ampwatch_run_*`) cover RUNNING runs only, at most MAX_RUNS of them (those heard from most
recently), so label cardinality stays bounded by what trains now: a run's series disappear when it ends."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ampwatch.server import auth, models

MAX_RUNS = 200  # per-run gauges for at most this many running runs
SKIP_WINDOW_STEPS = 1000  # the skip rate is the share of skipped steps among the last this many steps
_SEVERITIES = ("info", "warning", "critical")
_RUN_LABELS = ("run", "project", "name")
_BATCH_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Per series (named by its id, so that Postgres opens only that series' partition of points, see partitions):
# its last point by one seek of the (series_id, rank, step) primary key; value NULL is NaN (see models).
_LAST = (
    "SELECT * FROM (SELECT {0} AS sid, step, value FROM points WHERE series_id = {0} AND rank = 0"
    " ORDER BY step DESC LIMIT 1) AS last_{0}"
)
_SKIPS = (
    "SELECT {0}, count(step), sum(CASE WHEN value IS NULL OR value <> 0 THEN 1 ELSE 0 END) FROM points"
    " WHERE series_id = {0} AND rank = 0"
    f" AND step > (SELECT max(step) FROM points WHERE series_id = {{0}} AND rank = 0) - {SKIP_WINDOW_STEPS}"
)


class Metrics:
    """The app's registry and the instruments its middleware updates."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.batches = Counter(
            "ampwatch_ingest_batches",
            "Agent batches received by this process, by outcome: "
            "stored, duplicate (a re-send, stored before) or rejected (an error answer).",
            ["outcome"],
            registry=self.registry,
        )
        self.points = Counter(
            "ampwatch_ingest_points", "Points stored by this process (re-sends not counted).", registry=self.registry
        )
        self.latency = Histogram(
            "ampwatch_ingest_batch_seconds",
            "Time to store one agent batch and answer.",
            buckets=_BATCH_SECONDS,
            registry=self.registry,
        )
        self.streams = Gauge(
            "ampwatch_streams_open",
            "Live update streams (SSE) open on this process: stream=run (a run page) or runs (the runs list).",
            ["stream"],
            registry=self.registry,
        )
        for outcome in ("stored", "duplicate", "rejected"):
            self.batches.labels(outcome)
        for stream in ("run", "runs"):
            self.streams.labels(stream)
        self.registry.register(DatabaseCollector(sessions))

    def exposition(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class DatabaseCollector(Collector):
    """What the database holds, read at each scrape in a fixed number of queries."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def describe(self) -> Iterable[Metric]:
        return []  # read at scrape time only: registering must not query the database

    def collect(self) -> Iterator[Metric]:
        with self.sessions() as session:
            yield from _runs_by_status(session)
            yield from _deliveries(session)
            yield from _per_run(session)


def _runs_by_status(session: Session) -> Iterator[Metric]:
    family = GaugeMetricFamily("ampwatch_runs", "Runs stored, by status.", labels=["status"])
    query = select(models.Run.status, func.count()).group_by(models.Run.status)
    counts: dict[str, int] = dict(session.execute(query).all())
    for status in ("running", "finished", "crashed", "stalled", "stopped"):
        family.add_metric([status], counts.get(status, 0))
    yield family


def _deliveries(session: Session) -> Iterator[Metric]:
    D = models.AlertDelivery
    counts: dict[str, int] = dict(session.execute(select(D.status, func.count()).group_by(D.status)).all())
    queue = GaugeMetricFamily(
        "ampwatch_alert_delivery_queue",
        "Alert notifications waiting to be sent (queued, including retries not yet due) or being sent.",
        labels=["status"],
    )
    for status in ("queued", "sending"):
        queue.add_metric([status], counts.get(status, 0))
    yield queue
    done = CounterMetricFamily(
        "ampwatch_alert_deliveries",
        "Alert delivery attempts finished, by outcome: "
        "delivered, retried (failed for now, tried again), failed, superseded.",
        labels=["outcome"],
    )
    for outcome in ("delivered", "retried", "failed", "superseded"):
        done.add_metric([outcome], counts.get(outcome, 0))
    yield done


def _per_run(session: Session) -> Iterator[Metric]:
    R, P, A = models.Run, models.Project, models.Alert
    query = (
        select(R.id, P.name, R.name, R.last_step)
        .join(P, P.id == R.project_id)
        .where(R.status == "running")
        .order_by(R.last_seen_at.desc())
        .limit(MAX_RUNS)
    )
    rows = session.execute(query).all()
    runs = {run_id: [run_id, project, name] for run_id, project, name, _ in rows}
    families = {
        "step": GaugeMetricFamily("ampwatch_run_last_step", "The run's last step.", labels=_RUN_LABELS),
        "loss": GaugeMetricFamily(
            "ampwatch_run_loss", "The run's last loss (rank 0); NaN and +Inf as they are.", labels=_RUN_LABELS
        ),
        "scale": GaugeMetricFamily(
            "ampwatch_run_loss_scale", "The run's last GradScaler loss scale (rank 0).", labels=_RUN_LABELS
        ),
        "skip": GaugeMetricFamily(
            "ampwatch_run_skip_rate",
            f"Share of skipped optimizer steps among the run's last {SKIP_WINDOW_STEPS} steps (rank 0).",
            labels=_RUN_LABELS,
        ),
        "firing": GaugeMetricFamily(
            "ampwatch_run_alerts_firing", "Alerts firing on the run, by severity.", labels=[*_RUN_LABELS, "severity"]
        ),
    }
    if runs:
        for run_id, _, _, last_step in rows:
            if last_step is not None:
                families["step"].add_metric(runs[run_id], last_step)
        S = models.Series
        named = session.execute(
            select(S.id, S.run_id, S.name).where(S.run_id.in_(list(runs)), S.name.in_(("loss", "scale", "skipped")))
        ).all()
        owner = {sid: (run_id, name) for sid, run_id, name in named}
        last = [int(sid) for sid, _, name in named if name != "skipped"]
        if last:  # (a series without points has no row; a NULL value is a NaN)
            for sid, _step, value in session.execute(text(" UNION ALL ".join(_LAST.format(i) for i in last))):
                run_id, name = owner[sid]
                families[name if name == "loss" else "scale"].add_metric(runs[run_id], _float(value))
        skips = [int(sid) for sid, _, name in named if name == "skipped"]
        if skips:
            for sid, steps, skipped in session.execute(text(" UNION ALL ".join(_SKIPS.format(i) for i in skips))):
                if steps:
                    families["skip"].add_metric(runs[owner[sid][0]], skipped / steps)
        firing = session.execute(
            select(A.run_id, A.severity, func.count())
            .where(A.state == "firing", A.run_id.in_(list(runs)))
            .group_by(A.run_id, A.severity)
        ).all()
        counts = {(run_id, severity): count for run_id, severity, count in firing}
        for run_id, labels in runs.items():
            for severity in _SEVERITIES:
                families["firing"].add_metric([*labels, severity], counts.get((run_id, severity), 0))
    yield from families.values()


def _float(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def _route(scope: Scope) -> str | None:
    """Which instrumented request this is: `batch`, `run` or `runs` (a stream), or None."""
    path, method = scope["path"], scope["method"]
    if method == "POST" and path.startswith("/api/v1/runs/") and path.endswith("/batches"):
        return "batch"
    if method == "GET" and path == "/api/v1/stream/runs":
        return "runs"
    if method == "GET" and path.startswith("/api/v1/runs/") and path.endswith("/stream"):
        return "run"
    return None


class Instrument:
    """ASGI middleware: counts agent batches (outcome and points, read from the answer) and open streams."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = _route(scope) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
        elif route == "batch":
            await self._batch(scope, receive, send)
        else:
            gauge = self.metrics.streams.labels(route)
            gauge.inc()
            try:
                await self.app(scope, receive, send)
            finally:
                gauge.dec()

    async def _batch(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        answer: dict[str, Any] = {"status": 500, "body": b""}

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
            elif message["type"] == "http.response.body":
                answer["body"] += message.get("body", b"")  # a small JSON answer: {"stored": ..., "points": ...}
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self.metrics.latency.observe(time.perf_counter() - started)
            self._count(answer["status"], answer["body"])

    def _count(self, status: int, body: bytes) -> None:
        try:
            reply = json.loads(body) if status == 200 else None
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            self.metrics.batches.labels("rejected").inc()
        elif reply.get("stored"):
            self.metrics.batches.labels("stored").inc()
            self.metrics.points.inc(int(reply.get("points") or 0))
        else:
            self.metrics.batches.labels("duplicate").inc()


def install(app: FastAPI, sessions: sessionmaker[Session]) -> None:
    """Add `GET /metrics` (a read route: with tokens configured it needs a read or admin token) and the middleware."""
    metrics = Metrics(sessions)
    app.state.metrics = metrics

    @app.get("/metrics", tags=["health"], response_class=Response, dependencies=[auth.requires("read")])
    def prometheus_metrics(request: Request) -> Response:
        """The Prometheus text exposition format: this process's ingest and streams, and running runs' gauges."""
        return request.app.state.metrics.exposition()

    app.add_middleware(Instrument, metrics=metrics)
