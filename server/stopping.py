"""Stopping a run on request: an admin asks (`POST /api/v1/runs/{id}/stop`, the run page's "Stop run", `ampwatch
stop`), the agent learns it from the reply to its next batch, and the run ends with the status `stopped`.

The request is a mark on the run's row (`stop_requested_at`, `stop_by`, `stop_reason`); every batch reply of a run
with a pending request carries it (`BatchOut.stop`), so each rank learns it at its next exchange. A run that
ends `stopped` keeps who and why; a run that ends otherwise, or a relaunch under the same run id, lets go of the
request. A batch reply also names the run's latest critical numerics event (`BatchOut.critical`), for agents
started with `stop_on=("critical",)`: a rank then stops on what another rank, or the server, diagnosed.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.server import models
from ampwatch.server.auth.tokens import Principal
from ampwatch.server.db import now, utc
from ampwatch.server.schemas import CriticalOut, StopOut

ENDED = ("finished", "crashed", "stopped")
NOT_NUMERICS = ("run_crashed", "run_stalled", "run_stopped")  # critical, but no reason to stop a run that lives


class RunEnded(ValueError):
    """The run already ended: there is nothing to stop."""


def who(session: Session, principal: Principal) -> str:
    """How a stop names the person who asked: their token's name, or the open server's anyone."""
    if principal.token_id is None:
        return "anyone (a server without tokens)"
    name = session.scalar(select(models.ApiToken.name).where(models.ApiToken.id == principal.token_id))
    return f"token {name!r} (#{principal.token_id})" if name else f"token #{principal.token_id}"


def request(session: Session, run: models.Run, *, by: str, reason: str | None) -> None:
    """Mark the run to stop (asked again, the first request stands); RunEnded if it already ended."""
    session.refresh(run, with_for_update={"key_share": True})  # (ingest moves the status under the same lock)
    if run.status in ENDED:
        raise RunEnded(f"the run already ended ({run.status})")
    if run.stop_requested_at is None:
        run.stop_requested_at, run.stop_by, run.stop_reason = now(), by, reason
    session.commit()


def of(run: models.Run) -> StopOut | None:
    """The stop pending for a run, or the one it ended `stopped` with."""
    if run.stop_by is None or (run.stop_requested_at is None and run.status != "stopped"):
        return None
    at = utc(run.stop_requested_at) if run.stop_requested_at is not None else None
    return StopOut(by=run.stop_by, reason=run.stop_reason, requested_at=at)


def pending(run: models.Run) -> StopOut | None:
    """What a batch reply says of a stop: the request, while the run has not ended."""
    return of(run) if run.stop_requested_at is not None and run.status not in ENDED else None


def on_relaunch(run: models.Run) -> None:
    """A run id registered again after the run ended: a new launch, which no earlier stop request concerns."""
    if run.status in ENDED:
        run.stop_requested_at = None


def on_status(run: models.Run, status: str, events: list[Any]) -> None:
    """A batch said how the run ended. `stopped` without a request (the agent stopped on a critical event, as
    `stop_on` asked): who and why from the batch's `run_stopped` event. Any other end lets go of a request."""
    if status == "stopped":
        if run.stop_requested_at is None:
            said = next((e for e in events if e.type == "run_stopped"), None)
            details = (said.details or {}) if said is not None else {}
            run.stop_by = str(details.get("by") or "the agent")[:200]
            run.stop_reason = str(details.get("reason")) if details.get("reason") is not None else None
    elif status in ENDED:
        run.stop_requested_at = None


def on_events(session: Session, run: models.Run, events: list[models.Event]) -> None:
    """Keep `runs.critical_event_id` at the run's latest critical numerics event (flushing for the ids, only when
    there is one: rare)."""
    critical = [e for e in events if e.severity == "critical" and e.type not in NOT_NUMERICS]
    if critical:
        session.flush()
        run.critical_event_id = max([e.id for e in critical] + [run.critical_event_id or 0])


def latest_critical(session: Session, run: models.Run) -> CriticalOut | None:
    """The run's latest critical numerics event, for a batch reply (one lookup by id, only once there is one)."""
    if run.critical_event_id is None:
        return None
    event = session.get(models.Event, run.critical_event_id)
    if event is None:
        return None
    return CriticalOut(id=event.id, step=event.step, rank=event.rank, type=event.type, message=event.message[:2000])
