"""Stopping a run on request: an admin asks (`POST /api/v1/runs/{id}/stop`, the run page's "Stop run", `ampwatch
stop`), the agent learns it from the reply to its next batch, and the run ends with the status `stopped`.

The request is a mark on the run's row (`stop_requested_at`, `stop_by`, `stop_reason`); every batch reply of a run
with a pending request carries it (`BatchOut.stop`), so each rank learns it at its next exchange. A run that
ends `stopped` keeps who and why; a run that ends otherwise, or a relaunch under the same run id, lets go of the
request. A batch reply also names the run's latest critical numerics event (`BatchOut.critical`), for agents
started with `stop_on=("critical",)`: a rank then stops on what another rank, or the server, diagnosed.

Ranks of one run learn a stop at different steps, and a rank that stops while the others train on leaves them
waiting in their next collective. So for a run of several ranks (`world_size` > 1) the first batch answered after the
request fixes `stop_at_step`, the step every rank stops after: the run's pace (`pace_step`, the highest agent step of
that batch, fresh) plus the steps the run makes, at its `step_rate`, in two of its agents' flush intervals (the
environment's `flush_interval_s`) and `SLACK_S`: by then every rank has had its next exchange. A rank that learns it
only after passing it shows that every rank passed it (each step's collectives wait for every rank, so none stopped
there): a batch reporting a step past `stop_at_step` fixes a later one, with twice the overshoot on top.

A critical numerics event stops the ranks whose agents have `stop_on=("critical",)`; in a run of several ranks they
stop together in the same way: the run's first critical event fixes `critical_at_step` (the run's pace or the event's
step, the later, plus the same margin), which every batch reply names with the event (`BatchOut.critical`).
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.server import models
from ampwatch.server.auth.tokens import Principal
from ampwatch.server.db import now, utc
from ampwatch.server.schemas import CriticalOut, StopOut

ENDED = ("finished", "crashed", "stopped")
NOT_NUMERICS = ("run_crashed", "run_stalled", "run_stopped")  # critical, but no reason to stop a run that lives
STEP_SERIES = ("loss", "scale", "skipped", "grad_norm", "lr", "param_norm")  # the agent's own series of each step
RATE_TAU_S = 10.0  # the step rate is a time-weighted average over about the last this many seconds
SLACK_S = 5.0  # beyond two flush intervals: what a rank's exchange with the server may take, on a loaded host too
FLUSH_INTERVAL_S = 0.5  # the agent's default AMPWATCH_FLUSH_INTERVAL_S, where a run's environment does not say


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
        run.stop_requested_at, run.stop_by, run.stop_reason, run.stop_at_step = now(), by, reason, None
    session.commit()


def of(run: models.Run) -> StopOut | None:
    """The stop pending for a run, or the one it ended `stopped` with."""
    if run.stop_by is None or (run.stop_requested_at is None and run.status != "stopped"):
        return None
    at = utc(run.stop_requested_at) if run.stop_requested_at is not None else None
    return StopOut(by=run.stop_by, reason=run.stop_reason, requested_at=at, at_step=run.stop_at_step)


def pending(run: models.Run) -> StopOut | None:
    """What a batch reply says of a stop: the request, while the run has not ended."""
    return of(run) if run.stop_requested_at is not None and run.status not in ENDED else None


def on_relaunch(run: models.Run) -> None:
    """A run id registered again after the run ended: a new launch, which no earlier stop request concerns."""
    if run.status in ENDED:
        run.stop_requested_at = run.stop_at_step = run.critical_at_step = None
        run.pace_step = run.step_rate = run.step_rate_weight = None  # (the new launch's pace is its own)


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
        run.stop_requested_at = run.stop_at_step = None


def on_batch(run: models.Run, points: dict[str, Any], stamp: datetime) -> None:
    """A batch (`{name: PointsIn}`) arrived, before the run's `last_seen_at` moves to `stamp`: keep the run's pace and,
    in a run of several ranks, the steps every rank stops after (on a pending request, on the first critical event)."""
    highest = max((max(points[n].steps) for n in STEP_SERIES if n in points and points[n].steps), default=None)
    previous = run.pace_step
    if highest is not None:
        run.pace_step = highest
    elapsed = (stamp - utc(run.last_seen_at)).total_seconds()
    if previous is not None and run.pace_step is not None and elapsed > 0:
        # An exponential average weighted by time, corrected for its start as Adam's moments are: the steps each
        # batch (of any rank) moved the pace by, over the time since the batch before, add up to the steps made
        # over the time passed, whatever the ranks' interleaving.
        weight, before = -math.expm1(-elapsed / RATE_TAU_S), run.step_rate_weight or 0.0
        total = before + weight * (1.0 - before)
        rate = run.step_rate or 0.0
        run.step_rate = rate + weight / total * ((run.pace_step - previous) / elapsed - rate)
        run.step_rate_weight = total
    if run.pace_step is None or not _several(run):
        return
    if pending(run) is not None:
        run.stop_at_step = _stop_after(run, run.stop_at_step, run.pace_step, highest)
    if run.critical_at_step is not None:
        run.critical_at_step = _stop_after(run, run.critical_at_step, run.pace_step, highest)


def _several(run: models.Run) -> bool:
    world = (run.environment or {}).get("world_size")
    return isinstance(world, int) and world >= 2


def _stop_after(run: models.Run, at: int | None, pace: int, highest: int | None) -> int:
    """The step every rank stops after: fixed past `pace` by the margin; once fixed, moved past a batch's `highest`
    step only when that ran past it (the ranks all passed it), with twice the overshoot on top."""
    if at is None:
        return pace + _margin(run)
    if highest is not None and highest > at:
        return highest + _margin(run) + 2 * (highest - at)
    return at


def _margin(run: models.Run) -> int:
    """The steps the run makes, at its rate, in two of its agents' flush intervals and SLACK_S; 2 more."""
    flush = (run.environment or {}).get("flush_interval_s")
    flush = flush if isinstance(flush, (int, float)) and 0 < flush < 3600 else FLUSH_INTERVAL_S
    return math.ceil(max(run.step_rate or 0.0, 0.0) * (2 * flush + SLACK_S)) + 2


def on_events(session: Session, run: models.Run, events: list[models.Event]) -> None:
    """Keep `runs.critical_event_id` at the run's latest critical numerics event (flushing for the ids, only when
    there is one: rare)."""
    critical = [e for e in events if e.severity == "critical" and e.type not in NOT_NUMERICS]
    if critical:
        session.flush()
        run.critical_event_id = max([e.id for e in critical] + [run.critical_event_id or 0])
        if run.critical_at_step is None and _several(run):  # (the first of the launch: every rank stops after it)
            run.critical_at_step = _stop_after(run, None, max([run.pace_step or 0] + [e.step for e in critical]), None)


def latest_critical(session: Session, run: models.Run) -> CriticalOut | None:
    """The run's latest critical numerics event, for a batch reply (one lookup by id, only once there is one)."""
    if run.critical_event_id is None:
        return None
    event = session.get(models.Event, run.critical_event_id)
    if event is None:
        return None
    return CriticalOut(
        id=event.id,
        step=event.step,
        rank=event.rank,
        type=event.type,
        message=event.message[:2000],
        at_step=run.critical_at_step,
    )
