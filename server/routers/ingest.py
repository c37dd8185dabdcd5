"""Where agents write: register a run, then send batches."""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import APIRouter, HTTPException, Path, Request
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ampwatch.server import auth, db, ingestion, models
from ampwatch.server.deps import SessionDep, SettingsDep
from ampwatch.server.routers.read import run_out
from ampwatch.server.schemas import BatchIn, BatchOut, RunIn, RunOut

router = APIRouter(prefix="/api/v1", tags=["ingest"], dependencies=[auth.requires("ingest")])
RunId = Annotated[str, Path(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="Chosen by the agent.")]


@router.put("/runs/{run_id}", response_model=RunOut)
def register_run(run_id: RunId, body: RunIn, request: Request, session: SessionDep, settings: SettingsDep) -> RunOut:
    """Create or refresh a run; idempotent. The reply says the last step stored per rank (`stored_steps`)."""
    _check_project(request, session, run_id, body.project)
    run = db.retrying(session, lambda: ingestion.register_run(session, run_id=run_id, body=body))  # idempotent
    project = cast(models.Project, session.get(models.Project, run.project_id))  # (the run's row refers to it)
    out = run_out(run, project.name, settings)  # (a run keeps its first project)
    F = models.PointFeed  # (one row per stored batch with points: the last step stored per rank, for a relaunch)
    stored = session.execute(select(F.rank, func.max(F.last_step)).where(F.run_id == run_id).group_by(F.rank))
    out.stored_steps = {str(rank): int(step) for rank, step in stored}
    out.critical_id = run.critical_event_id
    return out


@router.post("/runs/{run_id}/batches", response_model=BatchOut, response_model_exclude_none=True)
def post_batch(run_id: RunId, batch: BatchIn, request: Request, session: SessionDep, settings: SettingsDep) -> BatchOut:
    """Store a batch of points and events; acknowledged only after commit, stored once per (rank, seq). The reply
    carries `stop` while a stop asked of the run waits, and `critical` once the run has a critical event."""
    _check_project(request, session, run_id)
    total = sum(len(s.steps) for s in batch.points.values())
    if total > settings.max_batch_points:
        raise HTTPException(413, f"batch has {total} points; the limit is {settings.max_batch_points}")
    try:
        return db.retrying(
            session, lambda: ingestion.ingest_batch(session, run_id=run_id, batch=batch)
        )  # stored once per (rank, seq)
    except ingestion.UnknownRun as error:
        raise HTTPException(404, f"unknown run {run_id!r}: register it with PUT /api/v1/runs/{run_id} first") from error


def _check_project(request: Request, session: Session, run_id: str, project: str | None = None) -> None:
    """An ingest token limited to a project writes only runs of that project."""
    allowed = auth.principal_of(request).project
    if allowed is None:
        return
    owner = select(models.Project.name).join(models.Run, models.Run.project_id == models.Project.id)
    for name in (project, session.scalar(owner.where(models.Run.id == run_id))):
        if name is not None and name != allowed:
            raise HTTPException(403, f"this token may only write runs of project {allowed!r}, not {name!r}")
