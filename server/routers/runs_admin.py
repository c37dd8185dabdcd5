"""Admin actions on runs: stop a run, delete a run, prune runs by age (admin tokens only)."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, HTTPException, Path, Request

from ampwatch.server import auth, queries, retention, stopping
from ampwatch.server.deps import SessionDep, SettingsDep
from ampwatch.server.routers.read import run_out
from ampwatch.server.schemas import PruneIn, RunOut, RunsRemoved, StopIn

router = APIRouter(prefix="/api/v1", tags=["admin"], dependencies=[auth.requires("admin")])
RunId = Annotated[str, Path(max_length=64)]


@router.post("/runs/{run_id}/stop", response_model=RunOut)
def stop_run(
    run_id: RunId, request: Request, session: SessionDep, settings: SettingsDep, body: StopIn | None = None
) -> RunOut:
    """Ask a running run to stop: its agent learns it from the reply to its next batch (every rank, each at its
    own), `run.should_stop` turns true and, where `ampwatch.init(stop_on="request")` asked for it, the agent raises
    `ampwatch.StopRequested` at the next step boundary. The run then ends `stopped`, with who asked and why
    (`stop` in the reply and in `GET /runs/{id}`). Asked again, the first request stands; 409 if the run already
    ended, 404 if there is none."""
    found = queries.get_run(session, run_id=run_id)
    if found is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    run, project = found
    try:
        stopping.request(
            session, run, by=stopping.who(session, auth.principal_of(request)), reason=body.reason if body else None
        )
    except stopping.RunEnded as error:
        raise HTTPException(409, str(error)) from error
    return run_out(run, project, settings)


@router.delete("/runs/{run_id}", response_model=RunsRemoved)
async def delete_run(run_id: RunId, request: Request) -> RunsRemoved:
    """Remove the run with its points, rollups, events, alerts and notifications, in short transactions
    (ingest of other runs goes on meanwhile). `{"runs": [the run], "deleted": true}`; 404 if there is none."""
    sessions = request.app.state.sessions
    with sessions() as session:
        found = queries.get_run(session, run_id=run_id)
    if found is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    await anyio.to_thread.run_sync(retention.delete_run, sessions, run_id, request.app.state.settings.delete_chunk_rows)
    return RunsRemoved.model_validate({"runs": [retention.describe(*found)], "deleted": True})


@router.post("/runs/prune", response_model=RunsRemoved)
async def prune_runs(body: PruneIn, request: Request) -> RunsRemoved:
    """Remove every run not heard from for `older_than_s` seconds (of `project`, if given), oldest first, each
    like `DELETE /runs/{id}`; `dry_run` lists them and removes nothing."""
    sessions = request.app.state.sessions
    with sessions() as session:
        runs = retention.stale_runs(session, older_than_s=body.older_than_s, project=body.project)
    if not body.dry_run:
        for run, _ in runs:
            await anyio.to_thread.run_sync(
                retention.delete_run, sessions, run.id, request.app.state.settings.delete_chunk_rows
            )
        await anyio.to_thread.run_sync(retention.sweep, request.app.state.engine)
    return RunsRemoved.model_validate({"runs": [retention.describe(*r) for r in runs], "deleted": not body.dry_run})
