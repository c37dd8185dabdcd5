"""`GET /api/v1/runs/{id}/plan`: the rollback plan, as JSON or as the file a trainer takes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Response

from ampwatch.server import auth, plan, queries
from ampwatch.server.deps import SessionDep, SettingsDep

router = APIRouter(prefix="/api/v1", tags=["read"], dependencies=[auth.requires("read")])

_EXAMPLE = {
    "run_id": "3f2a9c1d0e4b5a67",
    "trouble": {"first_step": 65, "critical_step": 72, "signs": 3, "first_sign": {}, "critical": [{}]},
    "checkpoint": {"step": 60, "rank": 0, "path": "ckpt/step-60.pt"},
    "skip": {"from": 65, "to": 77, "steps": [65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77]},
    "margin": 5,
    "episode_gap": 100,
    "summary": "Trouble began at step 65 ...",
    "files": {"lightning": "/api/v1/runs/3f2a9c1d0e4b5a67/plan?format=lightning", "megatron": "..."},
}


@router.get(
    "/runs/{run_id}/plan",
    responses={
        200: {
            "content": {
                "application/json": {"example": _EXAMPLE},
                "text/plain": {"example": "65 66 67 68 69 70 71 72 73 74 75 76 77\n"},
            }
        }
    },
)
def get_plan(
    run_id: str,
    session: SessionDep,
    settings: SettingsDep,
    format: Annotated[  # noqa: A002 - the query parameter's name
        Literal["json", "lightning", "megatron"],
        Query(description="json: the plan; lightning: skip_batches.json; megatron: the --iterations-to-skip list."),
    ] = "json",
) -> Any:
    """The rollback plan for the run's first critical numerics event: the trouble (its first leading sign and its
    critical events), the last checkpoint saved before it and the steps to skip; `"trouble": null` when none."""
    if queries.get_run(session, run_id=run_id) is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    doc = plan.compute(run_id, *plan.load(session, run_id))
    if format == "lightning":
        return Response(
            plan.lightning_file(doc), media_type="application/json", headers=_attachment("skip_batches.json")
        )
    if format == "megatron":
        return Response(plan.megatron_file(doc), media_type="text/plain", headers=_attachment("iterations_to_skip.txt"))
    base = f"/api/v1/runs/{run_id}/plan?format="
    doc["files"] = {kind: base + kind for kind in ("lightning", "megatron")}
    return doc


def _attachment(name: str) -> dict[str, str]:
    return {"Content-Disposition": f'attachment; filename="{name}"'}
