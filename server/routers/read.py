"""The read API: runs, series, events, alerts (docs/api.md)."""

from __future__ import annotations

import json
from typing import Annotated, Literal, cast

from fastapi import APIRouter, HTTPException, Query, Request, Response

from ampwatch.server import auth, models, plan, queries, runlist, stopping, vitals
from ampwatch.server.db import utc
from ampwatch.server.deps import SessionDep, SettingsDep
from ampwatch.server.schemas import MAX_BIGINT, MAX_INT, AlertOut, EventOut, Health, RunOut, RunStatus
from ampwatch.server.settings import Settings
from ampwatch.server.values import to_json

router = APIRouter(prefix="/api/v1", tags=["read"], dependencies=[auth.requires("read")])

_SERIES_EXAMPLE = {"loss": {"steps": [0, 1, 2], "values": [2.31, "NaN", "Infinity"]}}


def run_out(
    run: models.Run,
    project: str,
    settings: Settings,
    series: list[str] | None = None,
    ranks: list[int] | None = None,
    firing: dict[str, int] | None = None,
) -> RunOut:
    """A run as the API shows it; with `firing` (by severity), its firing alerts too."""
    counts = vitals.of(run, firing) if firing is not None else {"firing": None, "firing_by_severity": None}
    return RunOut(
        id=run.id,
        project=project,
        name=run.name,
        status=cast(RunStatus, run.status),
        health=cast(Health, run.health),
        created_at=utc(run.created_at),
        last_seen_at=utc(run.last_seen_at),
        finished_at=utc(run.finished_at) if run.finished_at else None,
        last_step=run.last_step,
        config=run.config,
        environment=run.environment,
        url=f"{settings.base_url}/runs/{run.id}",
        series=series or [],
        ranks=ranks or [],
        skip_rate=run.skip_rate,
        scale=cast("float | Literal['NaN', 'Infinity', '-Infinity'] | None", vitals.scale_json(run)),
        stop=stopping.of(run),
        firing=counts["firing"],
        firing_by_severity=counts["firing_by_severity"],
    )


def _get_run(session: SessionDep, run_id: str) -> tuple[models.Run, str]:
    found = queries.get_run(session, run_id=run_id)
    if found is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    return found


Text = Annotated[str | None, Query(max_length=200)]


@router.get("/runs", response_model=list[RunOut])
def list_runs(
    request: Request,
    response: Response,
    session: SessionDep,
    settings: SettingsDep,
    project: Text = None,
    status: Annotated[str | None, Query(pattern="^(running|finished|crashed|stalled)$")] = None,
    q: Annotated[str | None, Query(max_length=200, description="Part of the run's name.")] = None,
    sort: Annotated[str, Query(pattern=f"^({'|'.join(runlist.SORTS)})$")] = "started",
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
    limit: Annotated[int, Query(ge=1, le=runlist.MAX_LIMIT)] = runlist.DEFAULT_LIMIT,
    cursor: Annotated[str | None, Query(max_length=1000, description="The `X-Next-Cursor` of the page before.")] = None,
) -> list[RunOut]:
    """One page of runs, newest first unless `sort`/`order` say otherwise; `project`, `status`, `q` filter. When
    more runs follow, the `X-Next-Cursor` header holds the next page's `cursor` and `Link: <...>; rel="next"` its
    URL. Without `cursor`, the first `limit` runs (100 by default)."""
    where = runlist.RunFilter(project=project, status=status, search=q, sort=sort, descending=order == "desc")
    try:
        rows, after = runlist.page(session, where, after=cursor, limit=limit)
    except runlist.BadCursor as error:
        raise HTTPException(400, str(error)) from error
    if after is not None:
        response.headers["x-next-cursor"] = after
        response.headers["link"] = f'<{request.url.include_query_params(cursor=after)}>; rel="next"'
    firing = vitals.firing(session, [run.id for run, _ in rows])
    return [run_out(run, name, settings, firing=firing[run.id]) for run, name in rows]


@router.get("/runs/{run_id}", response_model=RunOut)
def get_run(run_id: str, session: SessionDep, settings: SettingsDep) -> RunOut:
    """One run, with the names of its series and the ranks it has heard from."""
    run, project = _get_run(session, run_id)
    return run_out(
        run, project, settings, queries.series_names(session, run_id=run_id), queries.run_ranks(session, run_id=run_id)
    )


@router.get(
    "/runs/{run_id}/series",
    responses={200: {"content": {"application/json": {"example": _SERIES_EXAMPLE}}}},
)
def get_series(
    run_id: str,
    session: SessionDep,
    name: Annotated[list[str] | None, Query(description="Series to return; all when absent.")] = None,
    max_points: Annotated[int | None, Query(ge=4, le=1_000_000)] = None,
    rank: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
    start_step: Annotated[
        int | None, Query(ge=0, le=MAX_BIGINT, description="First step to return (a zoomed chart).")
    ] = None,
    end_step: Annotated[int | None, Query(ge=0, le=MAX_BIGINT, description="Last step to return.")] = None,
) -> Response:
    """`{name: {"steps": [...], "values": [...]}}`; non-finite values are "NaN", "Infinity", "-Infinity".
    With `max_points`, downsampled keeping spikes (per-bucket min and max) and every non-finite point;
    `start_step`/`end_step` narrow the range, so a zoomed chart gets full resolution."""
    _get_run(session, run_id)
    names = name or queries.series_names(session, run_id=run_id)
    data = queries.read_series(
        session, run_id=run_id, names=names, rank=rank, max_points=max_points, start=start_step, end=end_step
    )
    body = {n: {"steps": steps, "values": to_json(values)} for n, (steps, values) in data.items()}
    return Response(json.dumps(body, separators=(",", ":")), media_type="application/json")


@router.get("/runs/{run_id}/heatmap")
def get_heatmap(
    run_id: str,
    session: SessionDep,
    prefix: Annotated[str, Query(min_length=1, description="Series name prefix; one row per series.")] = "grad_norm/",
    columns: Annotated[int, Query(ge=1, le=5000, description="About this many step buckets.")] = 300,
    rank: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
    start_step: Annotated[int | None, Query(ge=0, le=MAX_BIGINT)] = None,
    end_step: Annotated[int | None, Query(ge=0, le=MAX_BIGINT)] = None,
) -> Response:
    """Per-layer series (`grad_norm/<module>`) as a grid: `{layers, steps, width, values}`, `values[layer][bucket]`
    the bucket's largest value, or "NaN"/"Infinity"/"-Infinity" when it holds one, null when empty."""
    _get_run(session, run_id)
    grid = queries.layer_heatmap(
        session, run_id=run_id, prefix=prefix, rank=rank, columns=columns, start=start_step, end=end_step
    )
    return Response(json.dumps(grid, separators=(",", ":")), media_type="application/json")


@router.get("/runs/{run_id}/events", response_model=list[EventOut], response_model_exclude_unset=True)
def get_events(
    run_id: str,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=10_000, description="At most this many events.")] = 1000,
    after_id: Annotated[
        int | None,
        Query(
            ge=0,
            le=MAX_BIGINT,
            description="Page through all events: those stored "
            "after the event with this id, in stored order (0: from the first).",
        ),
    ] = None,
) -> list[EventOut]:
    """The run's newest `limit` events (step, rank, type, severity, message, details, time) in step order; with
    `after_id`, the first `limit` stored after that event. A plan trigger also carries `plan`, the run's rollback
    plan in brief."""
    _get_run(session, run_id)
    return plan.events_out(session, run_id, queries.list_events(session, run_id=run_id, limit=limit, after_id=after_id))


@router.get("/alerts", response_model=list[AlertOut])
def list_alerts(
    session: SessionDep,
    run_id: str | None = None,
    state: Annotated[str | None, Query(pattern="^(pending|firing|resolved)$")] = None,
) -> list[AlertOut]:
    """Alerts, newest first: firing and resolved; `state=pending` lists those still waiting out a rule's `for`."""
    return [
        AlertOut(
            id=a.id,
            run_id=a.run_id,
            rule=a.rule,
            severity=a.severity,
            state=cast(Literal["pending", "firing", "resolved"], a.state),
            started_at=utc(a.started_at),
            resolved_at=utc(a.resolved_at) if a.resolved_at else None,
            summary=a.summary,
        )
        for a in queries.list_alerts(session, run_id=run_id, state=state)
    ]
