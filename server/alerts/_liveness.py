"""Runs that stop talking: `crashed` when batches (heartbeats included) stop without finish(), `stalled`
when heartbeats continue but the step does not advance for much longer than the run's usual step time.

Each decision is a conditional UPDATE on the run's own row, so one process makes it once."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, select, update
from sqlalchemy.orm import Session

from ampwatch.server import models
from ampwatch.server.alerts._db import steps, utc
from ampwatch.server.alerts._ingest import ensure_liveness, raise_event
from ampwatch.server.settings import Settings

Run, Liveness = models.Run, models.RunLiveness


def detect_crashed(session: Session, settings: Settings, stamp: datetime) -> int:
    """Mark running or stalled runs that sent nothing for `heartbeat_timeout_s` as crashed; how many."""
    cutoff = stamp - timedelta(seconds=settings.heartbeat_timeout_s)
    silent = session.scalars(
        select(Run.id).where(Run.status.in_(("running", "stalled")), Run.last_seen_at < cutoff).limit(500)
    ).all()
    for run_id in silent:
        claimed = cast(
            CursorResult[Any],
            session.execute(
                update(Run)
                .where(Run.id == run_id, Run.status.in_(("running", "stalled")), Run.last_seen_at < cutoff)
                .values(status="crashed")
                .execution_options(synchronize_session=False)
            ),
        ).rowcount
        if claimed == 1:
            _crashed(session, run_id, stamp)
        session.commit()
    return len(silent)


def _crashed(session: Session, run_id: str, stamp: datetime) -> None:
    run = session.get(Run, run_id)
    assert run is not None
    session.refresh(run)
    run.finished_at = run.last_seen_at
    liveness = ensure_liveness(session, run_id)
    liveness.detected = "crashed"
    liveness.evaluated_at = None  # evaluated once more: alerts that only the run's end resolves (see _clearing) resolve
    quiet_s = (stamp - utc(run.last_seen_at)).total_seconds()
    message = (
        f"No heartbeat for {quiet_s:.0f} s and the run never called finish(): the training process died (killed, out "
        f"of memory, node lost) or lost its network. Last step {steps(run.last_step)}, last seen "
        f"{utc(run.last_seen_at):%H:%M:%S} UTC. Restart from the last checkpoint; check the host's kernel log for the "
        "OOM killer."
    )
    raise_event(
        session,
        run=run,
        kind="run_crashed",
        severity="critical",
        message=message,
        details={"detected_by": "server", "silent_s": round(quiet_s, 1)},
        stamp=stamp,
    )


def detect_stalled(session: Session, settings: Settings, stamp: datetime) -> int:
    """Mark running runs whose heartbeats continue but whose step is stuck as stalled; how many."""
    alive_since = stamp - timedelta(seconds=settings.heartbeat_timeout_s)
    rows = session.execute(
        select(Run.id, Liveness.last_step_at, Liveness.step_time_s)
        .join(Liveness, Liveness.run_id == Run.id)
        .where(
            Run.status == "running",
            Run.last_seen_at >= alive_since,
            Liveness.detected.is_(None),
            Liveness.last_step_at.is_not(None),
            Liveness.step_time_s.is_not(None),
        )
    ).all()
    marked = 0
    # (the query leaves out rows whose last_step_at or step_time_s is None)
    for run_id, last_step_at, step_time_s in cast(Sequence[tuple[str, datetime, float]], rows):
        limit_s = max(settings.stall_min_s, settings.stall_factor * step_time_s)
        if (stamp - utc(last_step_at)).total_seconds() > limit_s and _mark_stalled(
            session, run_id, stamp, limit_s, step_time_s
        ):
            marked += 1
    return marked


def _mark_stalled(session: Session, run_id: str, stamp: datetime, limit_s: float, step_time_s: float) -> bool:
    cutoff = stamp - timedelta(seconds=limit_s)
    claimed = cast(
        CursorResult[Any],
        session.execute(
            update(Liveness)
            .where(Liveness.run_id == run_id, Liveness.detected.is_(None), Liveness.last_step_at < cutoff)
            .values(detected="stalled")
            .execution_options(synchronize_session=False)
        ),
    ).rowcount
    moved = (
        claimed == 1
        and cast(
            CursorResult[Any],
            session.execute(
                update(Run)
                .where(Run.id == run_id, Run.status == "running")
                .values(status="stalled")
                .execution_options(synchronize_session=False)
            ),
        ).rowcount
        == 1
    )
    if not moved:
        session.rollback()
        return False
    run = session.get(Run, run_id)
    liveness = session.get(Liveness, run_id)
    assert run is not None and liveness is not None and liveness.last_step_at is not None
    session.refresh(run)
    session.refresh(liveness)
    quiet_s = (stamp - utc(liveness.last_step_at)).total_seconds()
    message = (
        f"Step {steps(run.last_step)} was {quiet_s:.0f} s ago, about {quiet_s / step_time_s:.0f}× the usual step time "
        f"({step_time_s:.3g} s), and the process keeps sending heartbeats: it is alive but hung. Typical causes: a "
        "collective (NCCL all-reduce) waiting on a dead or slow rank, a stuck data loader worker, a deadlock. "
        "`py-spy dump --pid <pid>` shows where each thread waits."
    )
    raise_event(
        session,
        run=run,
        kind="run_stalled",
        severity="warning",
        message=message,
        details={"detected_by": "server", "silent_s": round(quiet_s, 1), "step_time_s": step_time_s},
        stamp=stamp,
    )
    session.commit()
    return True
