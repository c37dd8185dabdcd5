"""The dashboard: `/` lists runs, `/runs/{id}` charts one run, `/compare` overlays runs. Tables render on
the server (they work with JavaScript off); scripts add charts and live updates over SSE."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlencode

import anyio
import plotly
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates

from ampwatch.server import auth, plan, queries, retention, runlist, stopping, vitals
from ampwatch.server.deps import SessionDep
from ampwatch.server.schemas import MAX_INT
from ampwatch.web import formats

router = APIRouter(include_in_schema=False, dependencies=[auth.requires("read")])
_HERE = resources.files("ampwatch.web")
templates = Jinja2Templates(directory=str(_HERE / "templates"))
templates.env.filters.update(
    scale=formats.scale, rate=formats.rate, stamp=formats.stamp, clock=formats.clock, plain=formats.plain
)
_OWN = ("app.js", "run.js", "runs.js", "compare.js", "app.css")
_STATIC = {
    **{
        name: (Path(str(_HERE / "static" / name)), "text/css" if name.endswith(".css") else "text/javascript")
        for name in _OWN
    },
    "plotly.min.js": (Path(plotly.__file__).parent / "package_data" / "plotly.min.js", "text/javascript"),
}
STATUSES = runlist.STATUSES
COLUMNS = (  # (sort key or None, heading, numeric)
    (None, "", False),
    ("project", "Project", False),
    ("name", "Run", False),
    ("status", "Status", False),
    ("health", "Health", False),
    (None, "Alerts", True),
    ("step", "Last step", True),
    (None, "Skipped (last 1k)", True),
    (None, "Scale", True),
    ("started", "Started (UTC)", False),
    ("seen", "Last seen (UTC)", False),
)
COMPARE_RUNS = 20  # runs on one chart
COMPARE_PICK = 200  # the newest runs offered to pick from
DELETERS = ("admin", "open")  # who sees the Delete button: admins, and anyone on a server without tokens
RUN_ALERTS = 50  # the run page lists the newest; /alerts has the rest
Text = Annotated[str | None, Query(max_length=200)]


@router.get("/", response_class=HTMLResponse)
def runs_page(
    request: Request,
    session: SessionDep,
    project: Text = None,
    status: Text = None,
    q: Text = None,
    sort: str = "started",
    order: str = "desc",
    cursor: Annotated[str | None, Query(max_length=1000)] = None,
    msg: Text = None,
) -> Any:
    """A page of runs, filtered (project, status, part of the name) and sorted by the column headers; newest
    first; "Next page" follows a cursor kept in the URL with the filters."""
    project, status, q = project or None, status if status in STATUSES else None, q or None
    sort, descending = sort if sort in runlist.SORTS else "started", order != "asc"
    where = runlist.RunFilter(project=project, status=status, search=q, sort=sort, descending=descending)
    try:
        runs, after = runlist.page(session, where, after=cursor, limit=runlist.DEFAULT_LIMIT)
    except runlist.BadCursor:
        runs, after = runlist.page(session, where, limit=runlist.DEFAULT_LIMIT)  # (a stale link: the first page)
        cursor = None
    firing = vitals.firing(session, [r.id for r, _ in runs])
    kept = {k: v for k, v in {"project": project, "status": status, "q": q}.items() if v}
    paging = {"sort": sort, "order": "desc" if descending else "asc"}
    context = {
        "runs": runs,
        "vitals": {r.id: vitals.of(r, firing[r.id]) for r, _ in runs},
        "projects": queries.project_names(session),
        "statuses": STATUSES,
        "columns": COLUMNS,
        "filters": {"project": project, "status": status, "q": q},
        "sort": sort,
        "descending": descending,
        "since": queries.now().isoformat(),
        "nav": "runs",
        "sort_links": _sort_links(kept, sort, descending),
        "next_link": "?" + urlencode({**kept, **paging, "cursor": after}) if after else None,
        "first_link": "?" + urlencode({**kept, **paging}) if cursor else None,
        "msg": msg,
    }
    return templates.TemplateResponse(request, "runs.html", context)


def _sort_links(kept: dict[str, str], sort: str, descending: bool) -> dict[str, str]:
    """Each sortable column's link: the same filters, that column, the other direction when it is the current one."""
    return {
        key: "?" + urlencode({**kept, "sort": key, "order": "asc" if key == sort and descending else "desc"})
        for key, _, _ in COLUMNS
        if key
    }


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(
    request: Request, run_id: str, session: SessionDep, rank: Annotated[int, Query(ge=0, le=MAX_INT)] = 0
) -> Any:
    """One run: header, runtime, charts of one rank (drawn by run.js), the event timeline, alerts, configuration,
    environment."""
    found = queries.get_run(session, run_id=run_id)
    if found is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    run, project = found
    events = queries.list_events(session, run_id=run_id, limit=500)
    context = {
        "run": run,
        "project": project,
        "events": events,
        "counts": queries.count_events(session, run_id=run_id),
        "series": queries.series_names(session, run_id=run_id),
        "runtime": formats.runtime(run.environment, run.config),
        # Read before run.js reads the series: the stream sends every batch stored after this, none is missed.
        "feed": queries.feed_position(session, run_id=run_id),
        "last_event_id": queries.last_event_id(session, run_id=run_id),
        "rank": rank,
        "resumes": queries.resume_steps(session, run_id=run_id, rank=rank),  # (all of them: the timeline has 500)
        "ranks": sorted(set(queries.run_ranks(session, run_id=run_id)) | {rank}),
        "alerts": queries.list_alerts(session, run_id=run_id)[:RUN_ALERTS],
        "plan": plan.compute(run_id, *plan.load(session, run_id)),
        "can_delete": auth.principal_of(request).role in DELETERS,
        "stop": stopping.of(run),
        "can_stop": auth.principal_of(request).role in DELETERS and run.status not in stopping.ENDED,
    }
    return templates.TemplateResponse(request, "run.html", context)


@router.post("/runs/{run_id}/stop", dependencies=[auth.requires("admin")])
async def stop_run_form(request: Request, run_id: str) -> RedirectResponse:
    """The run page's "Stop run" (admins; the guard refuses cross-site posts): asked as with
    `POST /api/v1/runs/{id}/stop`, then back to the run page, which says the stop is pending."""
    try:  # (a plain urlencoded form: parsed here, as the alerts pages do, without python-multipart)
        form = dict(parse_qsl((await request.body()).decode(errors="replace"), max_num_fields=5))
    except ValueError as error:
        raise HTTPException(400, "too many form fields") from error
    reason = form.get("reason", "").strip().replace("\x00", "\ufffd")[:2000] or None
    principal = auth.principal_of(request)
    await anyio.to_thread.run_sync(_stop, request.app.state.sessions, run_id, principal, reason)
    return RedirectResponse(f"/runs/{run_id}", status_code=303)


def _stop(sessions: Any, run_id: str, principal: auth.Principal, reason: str | None) -> None:
    with sessions() as session:
        found = queries.get_run(session, run_id=run_id)
        if found is None:
            raise HTTPException(404, f"no run with id {run_id!r}")
        try:
            stopping.request(session, found[0], by=stopping.who(session, principal), reason=reason)
        except stopping.RunEnded as error:
            raise HTTPException(409, str(error)) from error


@router.post("/runs/{run_id}/delete", dependencies=[auth.requires("admin")])
async def delete_run_form(request: Request, run_id: str) -> RedirectResponse:
    """The run page's "Delete run" (admins; the guard refuses cross-site posts): the run goes as with
    `DELETE /api/v1/runs/{id}`, then back to the runs list."""
    sessions = request.app.state.sessions
    with sessions() as session:
        found = queries.get_run(session, run_id=run_id)
    if found is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    await anyio.to_thread.run_sync(retention.delete_run, sessions, run_id, request.app.state.settings.delete_chunk_rows)
    run, project = found
    message = f"deleted run {run.name} ({run.id}) of {project}"
    return RedirectResponse("/?" + urlencode({"project": project, "msg": message}), status_code=303)


@router.get("/compare", response_class=HTMLResponse)
def compare_page(
    request: Request, session: SessionDep, run: Annotated[list[str] | None, Query()] = None, series: Text = None
) -> Any:
    """One series of several runs on one chart; the form picks the runs and the series."""
    chosen = queries.get_runs(session, run_ids=list(dict.fromkeys(run or []))[:COMPARE_RUNS])
    names = queries.series_names_of(session, run_ids=[r.id for r, _ in chosen])
    recent, _ = runlist.page(session, runlist.RunFilter(), limit=COMPARE_PICK)
    context = {
        "runs": recent,
        "chosen": chosen,
        "chosen_ids": {r.id for r, _ in chosen},
        "nav": "compare",
        "names": names,
        "series": series or ("loss" if "loss" in names or not names else names[0]),
    }
    return templates.TemplateResponse(request, "compare.html", context)


@router.get("/static/{name}", dependencies=[auth.requires(None)])
def static(name: str) -> FileResponse:
    """The dashboard's own scripts and style, and Plotly.js from the installed package (no CDN)."""
    if name not in _STATIC:
        raise HTTPException(404, "no such file")
    path, media_type = _STATIC[name]
    cache = "public, max-age=3600" if name == "plotly.min.js" else "no-cache"  # our own files change with releases
    return FileResponse(path, media_type=media_type, headers={"Cache-Control": cache})
