"""The runs list, keyset-paginated: a page costs the same whatever the number of runs.

A page is ordered by one sort key, then the run id; the cursor of the next page holds the last row's key and id
(with the sort and direction it belongs to), and the next page starts strictly after it, by the same index
the order uses. Runs with no value for the key (no step yet) come last in either direction.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import SQLColumnExpression, and_, case, func, or_, select
from sqlalchemy.orm import Session

from ampwatch.server import models
from ampwatch.server.db import utc
from ampwatch.server.vitals import HEALTH

SORTS = ("started", "seen", "step", "name", "status", "health", "project")
STATUSES = ("running", "finished", "crashed", "stalled", "stopped")
DEFAULT_LIMIT = 100  # what a client that does not page gets
MAX_LIMIT = 1000
_NO_STEP = {True: -1, False: 2**63 - 1}  # where a run without a step sorts: last, descending or ascending
_TIMES = ("started", "seen")


class BadCursor(ValueError):
    """A cursor this server did not hand out, or one of another sort."""


@dataclass(frozen=True)
class RunFilter:
    """What the runs list shows: filters, sort key and direction."""

    project: str | None = None
    status: str | None = None
    search: str | None = None  # part of the run's name
    sort: str = "started"
    descending: bool = True


def _key(sort: str, descending: bool) -> SQLColumnExpression[Any]:
    R = models.Run
    columns: dict[str, SQLColumnExpression[Any]] = {
        "started": R.created_at,
        "seen": R.last_seen_at,
        "name": R.name,
        "status": R.status,
        "project": models.Project.name,
        "step": func.coalesce(R.last_step, _NO_STEP[descending]),
        "health": case({h: rank for rank, h in HEALTH.items()}, value=R.health),  # by severity, not spelling
    }
    return columns[sort]


def page(
    session: Session, where: RunFilter, *, after: str | None = None, limit: int = DEFAULT_LIMIT
) -> tuple[list[tuple[models.Run, str]], str | None]:
    """Up to `limit` runs (with their project's name) after the cursor `after`, and the next page's cursor (None
    on the last page). One statement."""
    sort = where.sort if where.sort in SORTS else "started"
    key = _key(sort, where.descending)
    R = models.Run
    query = select(R, models.Project.name).join(models.Project)
    if where.project is not None:
        query = query.where(models.Project.name == where.project)
    if where.status is not None:
        query = query.where(R.status == where.status)
    if where.search:
        query = query.where(R.name.contains(where.search, autoescape=True))
    if after:
        value, run_id = _decode(after, sort, where.descending)
        beyond = key < value if where.descending else key > value
        query = query.where(or_(beyond, and_(key == value, R.id > run_id)))
    order = (key.desc() if where.descending else key.asc(), R.id.asc())  # (ties by id, either direction)
    rows = [(run, name) for run, name in session.execute(query.order_by(*order).limit(limit + 1))]
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    return rows, _encode(sort, where.descending, _value(rows[-1], sort, where.descending), rows[-1][0].id)


def _value(row: tuple[models.Run, str], sort: str, descending: bool) -> Any:
    run, project = row
    return {
        "started": lambda: utc(run.created_at).isoformat(),
        "seen": lambda: utc(run.last_seen_at).isoformat(),
        "step": lambda: run.last_step if run.last_step is not None else _NO_STEP[descending],
        "name": lambda: run.name,
        "status": lambda: run.status,
        "project": lambda: project,
        "health": lambda: {h: rank for rank, h in HEALTH.items()}[run.health],
    }[sort]()


def _encode(sort: str, descending: bool, value: Any, run_id: str) -> str:
    raw = json.dumps([sort, "desc" if descending else "asc", value, run_id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode(cursor: str, sort: str, descending: bool) -> tuple[Any, str]:
    try:
        raw = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        cursor_sort, order, value, run_id = raw
        if sort in _TIMES:
            value = utc(datetime.fromisoformat(value))
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError) as error:
        raise BadCursor("not a cursor of this list (take `next` from the previous page)") from error
    if (cursor_sort, order) != (sort, "desc" if descending else "asc") or not isinstance(run_id, str):
        raise BadCursor(f"this cursor belongs to another sort ({cursor_sort} {order}); start again without one")
    if sort not in _TIMES and not isinstance(value, (int, str)):
        raise BadCursor("not a cursor of this list (take `next` from the previous page)")
    return value, run_id
