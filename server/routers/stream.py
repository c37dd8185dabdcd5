"""Live updates over Server-Sent Events, polled from the database (replicas share nothing else) by one
poller per topic in each process, shared by every open stream of it (see `ampwatch.server.fanout`; the wire
format, pings and the response are `ampwatch.server.sse`).

Points follow the run's point feed (`point_feed`): every stored batch with points gets the run's next
position, taken under the run row's lock just before commit, so positions become visible in order and a
stream that has read up to position p has seen every batch up to p. For each new batch of its rank the
stream sends the points of the batch's step range, whatever the steps: a spool replayed after an outage or
a slow rank arrives as it is written. Events follow their ids; since on Postgres a lower id may commit
after a higher one, the stream looks again at the last RESCAN_S seconds of ids and sends what it had not.

The SSE id is `"<feed position>/<event id>"`; a reconnecting browser sends it back as `Last-Event-ID`
and the stream resumes there (the client merges points by step and events by id, so a repeat is harmless).
More than RESET_STEPS steps (or MAX_ROWS points) to send at once, the client gets `reset`: read the series again.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request
from fastapi.sse import ServerSentEvent
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from ampwatch.server import auth, fanout, models, plan, queries, series, vitals
from ampwatch.server.db import utc
from ampwatch.server.routers.read import run_out
from ampwatch.server.schemas import MAX_BIGINT, MAX_INT, EventOut
from ampwatch.server.settings import Settings
from ampwatch.server.sse import RETRY_MS, SSE_DOC, SSEResponse, encode, shared, sse_id
from ampwatch.server.values import to_json

router = APIRouter(prefix="/api/v1", tags=["stream"], dependencies=[auth.requires("read")])

RESET_STEPS = 20_000  # more steps than this to send at once, the client re-reads the downsampled series instead
MAX_ROWS = 50_000  # more points than this to send at once: the same
RESCAN_S = 10.0  # event ids are looked at again for this long: a transaction commits well within it
FEED_ROWS = 1000  # feed rows read per look; more are read at once in the next


@dataclass
class RunCursor:
    """What one connection has sent: the feed position, pending step ranges, and events (every id up to
    `event_floor`, and `events_sent` above it)."""

    position: int
    event_floor: int
    pending: list[tuple[int, int]] = field(default_factory=list)
    events_sent: set[int] = field(default_factory=set)
    marks: deque[tuple[float, int]] = field(default_factory=deque)  # (when, highest event id seen then)
    seen: tuple[Any, ...] | None = None

    @property
    def id(self) -> str:
        return f"{self.position}/{self.event_floor}"


def _existing_run(run_id: str, request: Request) -> models.Run:
    # A short session of its own: a request-scoped one would hold a pooled connection for the stream's
    # whole life, and a few open pages would starve ingest.
    with request.app.state.sessions() as session:
        found = queries.get_run(session, run_id=run_id)
    if found is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    return found[0]


def _parse_id(last_event_id: str | None) -> tuple[int, int] | None:
    try:
        position, event_id = (last_event_id or "").split("/")
        return int(position), int(event_id)
    except ValueError:
        return None


@router.get("/runs/{run_id}/stream", response_class=SSEResponse, status_code=200, responses=SSE_DOC)
async def stream_run(
    request: Request,
    run: Annotated[models.Run, Depends(_existing_run)],
    after_position: Annotated[
        int | None,
        Query(
            ge=0,
            le=MAX_BIGINT,
            description="Send batches stored after this point-feed position (a page shows it as `data-feed`).",
        ),
    ] = None,
    after_step: Annotated[
        int | None,
        Query(
            ge=-1,
            le=MAX_BIGINT,
            description="Without `after_position`: also send the points after this step stored so far.",
        ),
    ] = None,
    after_event: Annotated[
        int | None, Query(ge=0, le=MAX_BIGINT, description="Send events with a larger id; the newest when absent.")
    ] = None,
    rank: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
    last_event_id: Annotated[str | None, Header()] = None,
) -> SSEResponse:
    """`update` events `{run, points, events, reset}`: the run's state, new (or late) points as
    `{name: {steps, values}}` (non-finite spelled out), new events. Resumes from `Last-Event-ID`."""
    return SSEResponse(_run_messages(request, run, after_position, after_step, after_event, rank, last_event_id))


async def _run_messages(
    request: Request,
    run: models.Run,
    after_position: int | None,
    after_step: int | None,
    after_event: int | None,
    rank: int,
    last_event_id: str | None,
) -> AsyncIterator[ServerSentEvent | bytes]:
    sessions: sessionmaker[Session] = request.app.state.sessions
    settings: Settings = request.app.state.settings
    hub: fanout.Hub = request.app.state.streams

    async def start() -> fanout.Poll:  # the topic's poller: from the feed position when it starts
        shared = await _run_sync(partial(_start, sessions, run, None, None, None))

        async def poll() -> tuple[list[tuple[int, dict[str, Any], bytes]], bool]:
            update, more = await _run_sync(partial(_poll_run, sessions, run.id, rank, shared))
            return ([] if update is None else [(shared.position, update, encode(_update(update, shared.id)))]), more

        return poll

    yield ServerSentEvent(comment="ampwatch run stream", retry=RETRY_MS)
    deadline = time.monotonic() + settings.stream_lifetime_s
    async with hub.subscribe(("run", run.id, rank), run.id, start, settings.stream_poll_s) as subscription:
        resumed = _parse_id(last_event_id)
        if resumed is not None:
            cursor = RunCursor(position=resumed[0], event_floor=resumed[1])
        else:
            cursor = await _run_sync(partial(_start, sessions, run, after_position, after_step, after_event))
        more, sent = True, set[int]()
        while more:  # this client's own catch-up, to where the shared poller takes over
            update, more = await _run_sync(partial(_poll_run, sessions, run.id, rank, cursor))
            if update is not None:
                sent.update(e["id"] for e in update["events"])
                yield _update(update, cursor.id)
        async for position, update, message in shared(subscription, deadline):
            repeated = (
                position <= cursor.position and update["points"] or any(e["id"] in sent for e in update["events"])
            )
            if repeated:  # (sent by the catch-up already: right after it, the poller may send them again)
                events = [e for e in update["events"] if e["id"] not in sent]
                points = {} if position <= cursor.position else update["points"]
                message = encode(_update({**update, "points": points, "events": events}, sse_id(message)))
            yield message


def _update(update: dict[str, Any], cursor_id: str) -> ServerSentEvent:
    return ServerSentEvent(event="update", raw_data=json.dumps(update, separators=(",", ":")), id=cursor_id)


async def _run_sync(fn: Callable[[], Any]) -> Any:
    return await anyio.to_thread.run_sync(fn)


def _start(
    sessions: sessionmaker[Session],
    run: models.Run,
    after_position: int | None,
    after_step: int | None,
    after_event: int | None,
) -> RunCursor:
    """A new stream's cursor: the feed position (now, unless given) and the steps after `after_step` stored so far."""
    with sessions() as session:
        position = after_position if after_position is not None else queries.feed_position(session, run_id=run.id)
        event_floor = after_event if after_event is not None else queries.last_event_id(session, run_id=run.id)
        # Read after the position (not the run loaded with the request): a batch committed in between is then
        # in this range, or after the position, never in neither.
        last_step = session.scalar(select(models.Run.last_step).where(models.Run.id == run.id))
    cursor = RunCursor(position=position, event_floor=event_floor)
    if after_position is None and after_step is not None and last_step is not None and last_step > after_step:
        cursor.pending.append((after_step + 1, last_step))
    return cursor


def _poll_run(
    sessions: sessionmaker[Session], run_id: str, rank: int, cursor: RunCursor
) -> tuple[dict[str, Any] | None, bool]:
    """One look at the database: (the message to send or None, whether more is waiting)."""
    with sessions() as session:
        run = session.get(models.Run, run_id)
        if run is None:
            return None, False
        state = (run.status, run.health, run.last_step, run.last_seen_at)
        events = _new_events(session, run_id, cursor)
        more = _read_feed(session, run_id, rank, cursor)
        if state == cursor.seen and not events and not cursor.pending:
            return None, more
        cursor.seen = state
        message: dict[str, Any] = {
            "run": _run_state(run),
            "points": {},
            "events": [_event(e) for e in plan.events_out(session, run_id, events)],
            "reset": False,
        }
        if sum(hi - lo + 1 for lo, hi in cursor.pending) > RESET_STEPS:
            message["reset"] = True
        else:
            message["points"], message["reset"] = _pending_points(session, run_id, rank, cursor.pending)
        cursor.pending = []
        return message, more


def _new_events(session: Session, run_id: str, cursor: RunCursor) -> list[models.Event]:
    """Events above the floor not sent yet; the floor rises to what was seen RESCAN_S ago."""
    found = queries.list_events(
        session, run_id=run_id, after_id=cursor.event_floor, limit=len(cursor.events_sent) + 1000
    )
    new = [e for e in found if e.id not in cursor.events_sent]
    cursor.events_sent.update(e.id for e in new)
    now = time.monotonic()
    cursor.marks.append((now, max(cursor.events_sent, default=cursor.event_floor)))
    while cursor.marks and cursor.marks[0][0] <= now - RESCAN_S:
        cursor.event_floor = max(cursor.event_floor, cursor.marks.popleft()[1])
    cursor.events_sent = {i for i in cursor.events_sent if i > cursor.event_floor}
    return new


def _read_feed(session: Session, run_id: str, rank: int, cursor: RunCursor) -> bool:
    """Add the step ranges of this rank's batches stored after the cursor's position; whether more wait."""
    query = (
        select(
            models.PointFeed.position, models.PointFeed.rank, models.PointFeed.first_step, models.PointFeed.last_step
        )
        .where(models.PointFeed.run_id == run_id, models.PointFeed.position > cursor.position)
        .order_by(models.PointFeed.position)
        .limit(FEED_ROWS)
    )
    rows = session.execute(query).all()
    for position, row_rank, first, last in rows:
        if row_rank == rank:
            cursor.pending.append((first, last))
        cursor.position = position
    cursor.pending = _merged(cursor.pending)
    return len(rows) == FEED_ROWS


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _pending_points(
    session: Session, run_id: str, rank: int, ranges: list[tuple[int, int]]
) -> tuple[dict[str, Any], bool]:
    """({name: {steps, values}} of every point in the ranges, False), or ({}, True) when there are too many."""
    points: dict[str, dict[str, list[Any]]] = {}
    budget = MAX_ROWS
    for lo, hi in ranges:
        rows = series.points_between(session, run_id=run_id, rank=rank, lo=lo, hi=hi, limit=budget + 1)
        budget -= len(rows)
        if budget < 0:
            return {}, True
        for name, step, value in rows:
            one = points.setdefault(name, {"steps": [], "values": []})
            one["steps"].append(step)
            one["values"].append(value)
    for one in points.values():
        one["values"] = to_json(one["values"])
    return points, False


def _run_state(run: models.Run) -> dict[str, Any]:
    return {
        "status": run.status,
        "health": run.health,
        "last_step": run.last_step,
        "last_seen_at": utc(run.last_seen_at).isoformat(),
    }


def _event(e: EventOut) -> dict[str, Any]:
    return e.model_dump(mode="json", exclude_unset=True)  # (a plan trigger's `plan`; none on other events)


@router.get("/stream/runs", response_class=SSEResponse, status_code=200, responses=SSE_DOC)
async def stream_runs(
    request: Request,
    project: str | None = None,
    status: Annotated[str | None, Query(pattern="^(running|finished|crashed|stalled|stopped)$")] = None,
    q: Annotated[str | None, Query(description="Part of the run's name.")] = None,
    since: Annotated[datetime | None, Query(description="Also send runs heard from after this time.")] = None,
    last_event_id: Annotated[str | None, Header()] = None,
) -> SSEResponse:
    """`runs` events: the runs (as `GET /runs` shows them, plus `skip_rate`, `scale`, `firing`, `in_filter`) that
    changed since the last message, a run that no longer matches the filters once with `in_filter` false; the
    first message has those heard from after `since` (or `Last-Event-ID`)."""
    return SSEResponse(_runs_messages(request, project, status, q, since, last_event_id))


async def _runs_messages(
    request: Request,
    project: str | None,
    status: str | None,
    q: str | None,
    since: datetime | None,
    last_event_id: str | None,
) -> AsyncIterator[ServerSentEvent | bytes]:
    sessions: sessionmaker[Session] = request.app.state.sessions
    settings: Settings = request.app.state.settings
    hub: fanout.Hub = request.app.state.streams
    resume = _parse_time(last_event_id) or (utc(since) if since else None)
    filters = {"project": project, "status": status, "search": q}

    async def start() -> fanout.Poll:  # the topic's poller: changes after its first look
        recent = RecentRuns(filters)
        await _run_sync(partial(recent.look, sessions, settings))  # (what was there already is not news)

        async def poll() -> tuple[list[bytes], bool]:
            changed, newest = await _run_sync(partial(recent.look, sessions, settings))
            recent.resume = max(recent.resume, newest) if recent.resume and newest else newest or recent.resume
            return ([encode(_runs(changed, recent.resume))] if changed else []), False

        return poll

    yield ServerSentEvent(comment="ampwatch runs stream", retry=RETRY_MS)
    deadline = time.monotonic() + settings.stream_lifetime_s
    key = ("runs", project, status, q)
    async with hub.subscribe(key, None, start, settings.stream_runs_poll_s) as subscription:
        if resume is not None:  # this client's own first message: what it missed since
            changed, newest = await _run_sync(partial(_missed_runs, sessions, settings, filters, resume))
            if changed:
                yield _runs(changed, max(resume, newest) if newest else resume)
        async for message in shared(subscription, deadline):
            yield message


def _runs(changed: list[dict[str, Any]], resume: datetime | None) -> ServerSentEvent:
    return ServerSentEvent(
        event="runs", raw_data=json.dumps(changed, separators=(",", ":")), id=resume.isoformat() if resume else None
    )


def _parse_time(value: str | None) -> datetime | None:
    try:
        return utc(datetime.fromisoformat(value)) if value else None
    except ValueError:
        return None


class RecentRuns:
    """The runs list topic's view: it looks only at runs heard from, or whose alerts changed, in the last
    RESCAN_S seconds before its previous look (by two indexes), so a look costs what changed, not every run."""

    def __init__(self, filters: dict[str, Any]) -> None:
        self.filters = filters
        self.known: dict[str, tuple[tuple[Any, ...], bool]] = {}  # run id -> (its state, whether in the filters)
        self.since: datetime | None = None
        self.resume: datetime | None = None

    def look(self, sessions: sessionmaker[Session], settings: Settings) -> tuple[list[dict[str, Any]], Any]:
        """(runs that changed since the last look, as `GET /runs` shows them with their vitals and `in_filter`,
        the newest `last_seen_at` among them); the first look only learns what is there."""
        started, first = queries.now(), self.since is None
        after = (self.since or started) - timedelta(seconds=RESCAN_S)
        with sessions() as session:
            project = self.filters["project"]
            rows = queries.list_runs(session, project=project, seen_after=after)
            more = set(queries.runs_alerted_after(session, after=after)) - {r.id for r, _ in rows}
            rows += [(r, p) for r, p in queries.get_runs(session, run_ids=sorted(more)) if project in (None, p)]
            firing = vitals.firing(session, [r.id for r, _ in rows])
            out, newest = [], None
            for run, name in rows:
                state = (
                    run.status,
                    run.health,
                    run.last_step,
                    utc(run.last_seen_at),
                    run.skip_rate,
                    run.scale,
                    run.scale_step,
                    tuple(sorted(firing[run.id].items())),
                )
                matches = self._matches(run)
                before = self.known.get(run.id)
                if before == (state, matches):
                    continue
                self.known[run.id] = (state, matches)
                if not first and (matches or before is None or before[1]):  # (changed, or it left the filters)
                    out.append(
                        {
                            **run_out(run, name, settings).model_dump(mode="json"),
                            **vitals.of(run, firing[run.id]),
                            "in_filter": matches,
                        }
                    )
                    newest = max(newest, state[3]) if newest else state[3]
        self.since = started
        return out, newest

    def _matches(self, run: models.Run) -> bool:
        status, search = self.filters["status"], self.filters["search"]
        return (status is None or run.status == status) and (not search or search in run.name)


def _missed_runs(
    sessions: sessionmaker[Session], settings: Any, filters: dict[str, Any], since: datetime
) -> tuple[list[dict[str, Any]], datetime | None]:
    """A stream's own first message: the runs heard from after `since` (what its page, or its browser before it
    reconnected, has not seen), and those that left the filters meanwhile (`in_filter` false); by the
    `last_seen_at` index."""
    with sessions() as session:
        rows = queries.list_runs(session, **filters, seen_after=since)
        matching = {run.id for run, _ in rows}
        # (a run may have left the filters while the browser reconnected; a run never leaves its project)
        heard = queries.list_runs(session, project=filters["project"], seen_after=since)
        rows += [(r, p) for r, p in heard if r.id not in matching]
        firing = vitals.firing(session, [r.id for r, _ in rows])
        out = [
            {
                **run_out(r, p, settings).model_dump(mode="json"),
                **vitals.of(r, firing[r.id]),
                "in_filter": r.id in matching,
            }
            for r, p in rows
        ]
    return out, max((utc(r.last_seen_at) for r, _ in rows), default=None)
