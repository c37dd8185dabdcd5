"""Live updates over Server-Sent Events, polled from the database (replicas share nothing else).

A run's stream sends what is new since its cursor: points by step, events by id. The SSE id is
`"<step>:<event id>"`; a reconnecting browser sends it back as `Last-Event-ID` and the stream resumes
there, re-reading the cursor's own step so that a late point at that step is not lost (the client keeps
the points it already has). A run that fell too far behind gets `reset`: read the series again.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent
from sqlalchemy.orm import Session, sessionmaker

from ampwatch.server.db import utc
from ampwatch.server.schemas import MAX_BIGINT, MAX_INT
from ampwatch.server import models, series, store
from ampwatch.server.routers.read import run_out
from ampwatch.server.schemas import EventOut
from ampwatch.server.values import to_json

router = APIRouter(prefix="/api/v1", tags=["stream"])

POLL_S = 0.2  # how often a stream looks at the database: most of the send-to-screen latency
LIFETIME_S = 30.0  # then the stream ends and the browser reconnects from its Last-Event-ID (shutdown never waits long)
RESET_STEPS = 20_000  # further behind than this, the client re-reads the downsampled series instead
MAX_ROWS = 50_000  # points per message; more are sent in the next message at once
RETRY_MS = 500


@dataclass
class RunCursor:
    """What one connection has sent: the highest step, the last step per series, the last event id."""

    step: int
    event_id: int
    sent: dict[str, int] = field(default_factory=dict)
    seen: tuple[Any, ...] | None = None

    @property
    def id(self) -> str:
        return f"{self.step}:{self.event_id}"


def _existing_run(run_id: str, request: Request) -> models.Run:
    # A short session of its own: a request-scoped one would hold a pooled connection for the stream's
    # whole life, and a few open pages would starve ingest.
    with request.app.state.sessions() as session:
        found = store.get_run(session, run_id=run_id)
    if found is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    return found[0]


def _parse_id(last_event_id: str | None) -> tuple[int, int] | None:
    try:
        step, event_id = (last_event_id or "").split(":")
        return int(step), int(event_id)
    except ValueError:
        return None


@router.get("/runs/{run_id}/stream", response_class=EventSourceResponse)
async def stream_run(
    request: Request,
    run: Annotated[models.Run, Depends(_existing_run)],
    after_step: Annotated[int | None, Query(ge=-1, le=MAX_BIGINT, description="Send points after this step; the run's end when absent.")] = None,
    after_event: Annotated[int | None, Query(ge=0, le=MAX_BIGINT, description="Send events with a larger id; the newest when absent.")] = None,
    rank: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
    last_event_id: Annotated[str | None, Header()] = None,
) -> AsyncIterator[ServerSentEvent]:
    """`update` events `{run, points, events, reset}`: the run's state, new points as
    `{name: {steps, values}}` (non-finite spelled out), new events. Resumes from `Last-Event-ID`."""
    sessions: sessionmaker[Session] = request.app.state.sessions
    resumed = _parse_id(last_event_id)
    if resumed is not None:
        cursor = RunCursor(step=resumed[0], event_id=resumed[1])
    else:
        start = after_step if after_step is not None else (run.last_step if run.last_step is not None else -1)
        events = after_event if after_event is not None else await _run_sync(partial(_last_event_id, sessions, run.id))
        cursor = RunCursor(step=start, event_id=events)
    yield ServerSentEvent(comment="ampwatch run stream", retry=RETRY_MS)
    deadline = time.monotonic() + LIFETIME_S
    while time.monotonic() < deadline:
        update, more = await _run_sync(partial(_poll_run, sessions, run.id, rank, cursor))
        if update is not None:
            yield ServerSentEvent(event="update", raw_data=json.dumps(update, separators=(",", ":")), id=cursor.id)
        if not more:
            await anyio.sleep(POLL_S)


async def _run_sync(fn: Callable[[], Any]) -> Any:
    return await anyio.to_thread.run_sync(fn)


def _last_event_id(sessions: sessionmaker[Session], run_id: str) -> int:
    with sessions() as session:
        return store.last_event_id(session, run_id=run_id)


def _poll_run(sessions: sessionmaker[Session], run_id: str, rank: int, cursor: RunCursor) -> tuple[dict[str, Any] | None, bool]:
    """One look at the database: (the message to send or None, whether more is waiting)."""
    with sessions() as session:
        run = session.get(models.Run, run_id)
        if run is None:
            return None, False
        state = (run.status, run.health, run.last_step, run.last_seen_at)
        events = store.list_events(session, run_id=run_id, after_id=cursor.event_id, limit=1000)
        if state == cursor.seen and not events:
            return None, False
        cursor.seen = state
        message: dict[str, Any] = {"run": _run_state(run), "points": {}, "events": [_event(e) for e in events], "reset": False}
        if events:
            cursor.event_id = events[-1].id
        more = False
        if run.last_step is not None and run.last_step - cursor.step > RESET_STEPS:
            message["reset"], cursor.step, cursor.sent = True, run.last_step, {}
        else:
            message["points"], more = _new_points(session, run_id, rank, cursor)
        return message, more or len(events) == 1000


def _new_points(session: Session, run_id: str, rank: int, cursor: RunCursor) -> tuple[dict[str, Any], bool]:
    """Points from the cursor's step on (inclusive: a late point at that step still arrives), less those
    this connection already sent; the client ignores the few it had from its first read."""
    rows = series.points_from(session, run_id=run_id, rank=rank, step=max(0, cursor.step), limit=MAX_ROWS)
    points: dict[str, dict[str, list[Any]]] = {}
    for name, step, value in rows:
        if step <= cursor.sent.get(name, -1):
            continue
        one = points.setdefault(name, {"steps": [], "values": []})
        one["steps"].append(step)
        one["values"].append(value)
        cursor.sent[name] = step
    for one in points.values():
        one["values"] = to_json(one["values"])
    if rows:
        cursor.step = max(cursor.step, rows[-1][1])
    more = len(rows) == MAX_ROWS
    if more:
        cursor.seen = None  # look again at once, whatever the run row says
    return points, more


def _run_state(run: models.Run) -> dict[str, Any]:
    return {"status": run.status, "health": run.health, "last_step": run.last_step,
            "last_seen_at": utc(run.last_seen_at).isoformat()}  # fmt: skip


def _event(e: models.Event) -> dict[str, Any]:
    out = EventOut(id=e.id, step=e.step, rank=e.rank, type=e.type, severity=e.severity, message=e.message,
                   details=e.details, time=utc(e.time))  # fmt: skip
    return out.model_dump(mode="json")


RUNS_POLL_S = 0.5


@router.get("/stream/runs", response_class=EventSourceResponse)
async def stream_runs(
    request: Request,
    project: str | None = None,
    status: Annotated[str | None, Query(pattern="^(running|finished|crashed|stalled)$")] = None,
    q: Annotated[str | None, Query(description="Part of the run's name.")] = None,
    since: Annotated[datetime | None, Query(description="Also send runs heard from after this time.")] = None,
    last_event_id: Annotated[str | None, Header()] = None,
) -> AsyncIterator[ServerSentEvent]:
    """`runs` events: the runs (as `GET /runs` shows them, plus `skip_rate`, `scale`, `firing`) that changed
    since the last message; the first message has those heard from after `since` (or `Last-Event-ID`)."""
    sessions: sessionmaker[Session] = request.app.state.sessions
    settings = request.app.state.settings
    resume = _parse_time(last_event_id) or (utc(since) if since else None)
    filters = {"project": project, "status": status, "search": q}
    snapshot: dict[str, tuple[Any, ...]] | None = None
    yield ServerSentEvent(comment="ampwatch runs stream", retry=RETRY_MS)
    deadline = time.monotonic() + LIFETIME_S
    while time.monotonic() < deadline:
        changed, snapshot, newest = await _run_sync(partial(_poll_runs, sessions, settings, filters, snapshot, resume))
        resume = max(resume, newest) if resume and newest else (newest or resume)
        if changed:
            yield ServerSentEvent(event="runs", raw_data=json.dumps(changed, separators=(",", ":")), id=resume.isoformat() if resume else None)
        await anyio.sleep(RUNS_POLL_S)


def _parse_time(value: str | None) -> datetime | None:
    try:
        return utc(datetime.fromisoformat(value)) if value else None
    except ValueError:
        return None


def _poll_runs(
    sessions: sessionmaker[Session], settings: Any, filters: dict[str, Any],
    snapshot: dict[str, tuple[Any, ...]] | None, since: datetime | None,
) -> tuple[list[dict[str, Any]], dict[str, tuple[Any, ...]], datetime | None]:  # fmt: skip
    """Runs whose row (or firing-alert count) differs from `snapshot`; on the first call, those seen after `since`."""
    with sessions() as session:
        rows = store.list_runs(session, **filters)
        firing = store.firing_counts(session)
        now = {run.id: (run.status, run.health, run.last_step, utc(run.last_seen_at), firing.get(run.id, 0)) for run, _ in rows}
        if snapshot is None:
            changed = [(r, p) for r, p in rows if since is not None and now[r.id][3] > since]
        else:
            changed = [(r, p) for r, p in rows if snapshot.get(r.id) != now[r.id]]
        vitals = store.run_vitals(session, run_ids=[r.id for r, _ in changed])
        out = [{**run_out(r, p, settings).model_dump(mode="json"), **vitals[r.id]} for r, p in changed]
    newest = max((now[r.id][3] for r, _ in changed), default=None)
    return out, now, newest
