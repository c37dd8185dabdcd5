"""Every route declares the role it needs, on the route itself; this is the list, and the guard enforces it."""

from __future__ import annotations

from pathlib import Path

import httpx
from conftest import start_server
from fastapi import APIRouter, FastAPI

from ampwatch.server import auth, db
from ampwatch.server.app import create_app
from ampwatch.server.settings import Settings

# (methods, path) -> role: "public" (anyone), "read", "ingest" or "admin".
EXPECTED = {
    ("PUT", "/api/v1/runs/{run_id}"): "ingest",
    ("POST", "/api/v1/runs/{run_id}/batches"): "ingest",
    ("GET", "/api/v1/runs"): "read",
    ("GET", "/api/v1/runs/{run_id}"): "read",
    ("GET", "/api/v1/runs/{run_id}/series"): "read",
    ("GET", "/api/v1/runs/{run_id}/heatmap"): "read",
    ("GET", "/api/v1/runs/{run_id}/events"): "read",
    ("GET", "/api/v1/alerts"): "read",
    ("DELETE", "/api/v1/runs/{run_id}"): "admin",
    ("POST", "/api/v1/runs/{run_id}/stop"): "admin",
    ("POST", "/api/v1/runs/prune"): "admin",
    ("GET", "/api/v1/runs/{run_id}/stream"): "read",
    ("GET", "/api/v1/stream/runs"): "read",
    ("GET", "/api/v1/alerts/{alert_id}"): "read",
    ("GET", "/api/v1/alert-rules"): "read",
    ("POST", "/api/v1/alert-rules"): "admin",
    ("GET", "/api/v1/alert-rules/{rule_id}"): "read",
    ("PATCH", "/api/v1/alert-rules/{rule_id}"): "admin",
    ("DELETE", "/api/v1/alert-rules/{rule_id}"): "admin",
    ("GET", "/api/v1/alert-channels"): "read",
    ("POST", "/api/v1/alert-channels"): "admin",
    ("GET", "/api/v1/alert-channels/{channel_id}"): "read",
    ("PATCH", "/api/v1/alert-channels/{channel_id}"): "admin",
    ("DELETE", "/api/v1/alert-channels/{channel_id}"): "admin",
    ("POST", "/api/v1/alert-channels/{channel_id}/test"): "admin",
    ("GET", "/api/v1/silences"): "read",
    ("POST", "/api/v1/silences"): "admin",
    ("DELETE", "/api/v1/silences/{silence_id}"): "admin",
    ("GET", "/login"): "public",
    ("POST", "/login"): "public",
    ("POST", "/logout"): "public",
    ("GET", "/alerts"): "read",
    ("POST", "/alerts/silences"): "admin",
    ("POST", "/alerts/silences/{silence_id}/end"): "admin",
    ("GET", "/alerts/rules"): "read",
    ("POST", "/alerts/rules"): "admin",
    ("POST", "/alerts/rules/{rule_id}/toggle"): "admin",
    ("POST", "/alerts/rules/{rule_id}/delete"): "admin",
    ("POST", "/alerts/channels"): "admin",
    ("POST", "/alerts/channels/{channel_id}/toggle"): "admin",
    ("POST", "/alerts/channels/{channel_id}/delete"): "admin",
    ("POST", "/alerts/channels/{channel_id}/test"): "admin",
    ("GET", "/static/alerts.js"): "public",
    ("GET", "/"): "read",
    ("GET", "/runs/{run_id}"): "read",
    ("POST", "/runs/{run_id}/delete"): "admin",
    ("POST", "/runs/{run_id}/stop"): "admin",
    ("GET", "/api/v1/runs/{run_id}/plan"): "read",
    ("GET", "/metrics"): "read",
    ("GET", "/compare"): "read",
    ("GET", "/static/{name}"): "public",
    ("GET", "/healthz"): "public",
    ("GET", "/openapi.json"): "read",
    ("GET", "/docs"): "read",
    ("GET", "/docs/oauth2-redirect"): "read",
    ("GET", "/redoc"): "read",
}


def _app(tmp_path: Path) -> FastAPI:
    return create_app(Settings(database_url=f"sqlite:///{tmp_path / 'roles.db'}"))


def test_every_route_declares_its_role_and_this_is_the_list(tmp_path: Path) -> None:
    app = _app(tmp_path)
    assert auth.undeclared(app) == [], "declare them with dependencies=[auth.requires(...)]"
    declared = {
        (method, route.path): auth.route_role(route)
        for route in auth.flat_routes(app.routes)
        for method in sorted(getattr(route, "methods", None) or ["GET"])
        if method != "HEAD"
    }
    for key in sorted(declared.keys() - EXPECTED.keys()):  # a new route: its role, to add above
        print(f"{key}: {declared[key]!r},")
    assert declared == EXPECTED
    app.state.engine.dispose()


def test_a_route_that_declares_nothing_is_listed(tmp_path: Path) -> None:
    app = _app(tmp_path)
    forgetful = APIRouter()

    @forgetful.get("/api/v1/forgotten")
    def forgotten() -> dict[str, str]:
        return {}

    app.include_router(forgetful)
    assert auth.undeclared(app) == ["GET /api/v1/forgotten"]
    app.state.engine.dispose()


def test_the_guard_enforces_the_declared_roles(sqlite_url: str) -> None:
    engine = db.make_engine(sqlite_url)
    db.upgrade(engine)
    with db.session_factory(engine)() as session:
        tokens = {role: auth.create_token(session, name=role, role=role) for role in auth.ROLES}
    engine.dispose()
    server = start_server(Settings(database_url=sqlite_url))
    try:
        for (method, path), role in EXPECTED.items():
            concrete = path.replace("{run_id}", "r1").replace("{name}", "app.css")
            for id_name in ("alert_id", "rule_id", "channel_id", "silence_id"):
                concrete = concrete.replace(f"{{{id_name}}}", "999")
            for who, token in (("nobody", None), *tokens.items()):
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                # (streamed: a live stream the guard lets through is left at once)
                with httpx.stream(method, server.url + concrete, headers=headers, timeout=30, json={}) as reply:
                    body = reply.read().decode() if reply.status_code in (401, 403) else ""
                allowed = (
                    role == "public"
                    or who in ({"read": ("read", "admin"), "ingest": ("ingest", "admin"), "admin": ("admin",)}[role])
                )
                refused = reply.status_code in (401, 403) and body.startswith('{"detail"') and "token" in body
                assert refused != allowed, (method, path, who, reply.status_code, body[:200])
    finally:
        server.stop()
