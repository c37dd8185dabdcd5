"""The dashboard: `/` lists runs, `/runs/{id}` charts one run. Tables render on the server."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import plotly
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.templating import Jinja2Templates

from ampwatch.server import store
from ampwatch.server.deps import SessionDep

router = APIRouter(include_in_schema=False)
_HERE = resources.files("ampwatch.web")
templates = Jinja2Templates(directory=str(_HERE / "templates"))
_STATIC = {
    "app.js": (Path(str(_HERE / "static" / "app.js")), "text/javascript"),
    "app.css": (Path(str(_HERE / "static" / "app.css")), "text/css"),
    "plotly.min.js": (Path(plotly.__file__).parent / "package_data" / "plotly.min.js", "text/javascript"),
}


@router.get("/", response_class=HTMLResponse)
def runs_page(request: Request, session: SessionDep, project: str | None = None) -> Any:
    """Every run (or one project's), newest first."""
    runs = store.list_runs(session, project=project)
    projects = sorted({name for _, name in runs})
    return templates.TemplateResponse(request, "runs.html", {"runs": runs, "project": project, "projects": projects})


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: str, session: SessionDep) -> Any:
    """One run: header, charts (filled by app.js), events and configuration."""
    found = store.get_run(session, run_id=run_id)
    if found is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    run, project = found
    context = {
        "run": run,
        "project": project,
        "events": store.list_events(session, run_id=run_id, limit=500),
        "counts": store.count_events(session, run_id=run_id),
        "series": store.series_names(session, run_id=run_id),
    }
    return templates.TemplateResponse(request, "run.html", context)


@router.get("/static/{name}")
def static(name: str) -> FileResponse:
    """The dashboard's own script and style, and Plotly.js from the installed package (no CDN)."""
    if name not in _STATIC:
        raise HTTPException(404, "no such file")
    path, media_type = _STATIC[name]
    return FileResponse(path, media_type=media_type, headers={"Cache-Control": "public, max-age=3600"})
