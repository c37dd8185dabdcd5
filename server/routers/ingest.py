"""Where agents write: register a run, then send batches."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path

from ampwatch.server import store
from ampwatch.server.deps import SessionDep, SettingsDep
from ampwatch.server.routers.read import run_out
from ampwatch.server.schemas import BatchIn, BatchOut, RunIn, RunOut

router = APIRouter(prefix="/api/v1", tags=["ingest"])
RunId = Annotated[str, Path(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="Chosen by the agent.")]


@router.put("/runs/{run_id}", response_model=RunOut)
def register_run(run_id: RunId, body: RunIn, session: SessionDep, settings: SettingsDep) -> RunOut:
    """Create or refresh a run; idempotent."""
    run = store.register_run(session, run_id=run_id, body=body)
    return run_out(run, body.project, settings)


@router.post("/runs/{run_id}/batches", response_model=BatchOut)
def post_batch(run_id: RunId, batch: BatchIn, session: SessionDep, settings: SettingsDep) -> BatchOut:
    """Store a batch of points and events; acknowledged only after commit, stored once per (rank, seq)."""
    total = sum(len(s.steps) for s in batch.points.values())
    if total > settings.max_batch_points:
        raise HTTPException(413, f"batch has {total} points; the limit is {settings.max_batch_points}")
    try:
        return store.ingest_batch(session, run_id=run_id, batch=batch)
    except store.UnknownRun:
        raise HTTPException(404, f"unknown run {run_id!r}: register it with PUT /api/v1/runs/{run_id} first")
