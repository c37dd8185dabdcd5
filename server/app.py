"""`create_app(settings)`: the one place that wires the database, routers, pages and limits."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from ampwatch import __version__
from ampwatch.server import alerts, auth, db, fanout, metrics
from ampwatch.server.errors import database_unavailable, validation_error
from ampwatch.server.limits import BodyLimit
from ampwatch.server.routers import alerts as alerts_api
from ampwatch.server.routers import ingest, read, runs_admin, stream
from ampwatch.server.routers import plan as plan_api
from ampwatch.server.settings import Settings


def create_app(settings: Settings | None = None) -> FastAPI:
    """A ready app on `settings.database_url`, migrated to the latest schema."""
    from ampwatch import web  # pages import the server's modules; wire them last
    from ampwatch.web import alerts_pages

    settings = settings or Settings()
    engine = db.make_engine(settings.database_url)
    db.upgrade(engine)
    sessions = db.session_factory(engine)
    with sessions() as session:
        alerts.prepare(session, settings)
    service = alerts.AlertService(settings, sessions)
    event.listen(sessions, "after_commit", service.after_commit)
    streams = fanout.Hub(queue=settings.stream_queue)
    fanout.wire(sessions, streams)  # a commit of this process wakes its live streams
    listener = fanout.PgListener(engine, streams) if engine.dialect.name == "postgresql" else None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        service.start()  # background evaluation and delivery: never on the request path
        if listener is not None:
            # Other replicas' commits wake this one's live streams: listening before the server takes requests.
            await anyio.to_thread.run_sync(listener.start)
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(service.stop)
            if listener is not None:
                await anyio.to_thread.run_sync(listener.stop)

    app = FastAPI(
        title="ampwatch", version=__version__, description="Mixed-precision training telemetry.", lifespan=lifespan
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = sessions
    app.state.alerts = service
    app.state.streams = streams
    app.state.listener = listener  # (None on SQLite)
    app.state.tokens = auth.Tokens(sessions, settings.token_refresh_s)
    # -- routers: the one place they are included. Each route declares the role it needs with
    # `dependencies=[auth.requires(...)]`; tests/test_roles.py lists them and fails on one that declares none.
    app.include_router(ingest.router)
    app.include_router(read.router)
    app.include_router(runs_admin.router)
    app.include_router(stream.router)
    app.include_router(alerts_api.router)
    app.include_router(plan_api.router)
    app.include_router(auth.router)
    app.include_router(alerts_pages.router)  # before web.router: its /static/{name} would shadow /static/alerts.js
    app.include_router(web.router)
    metrics.install(app, sessions)  # GET /metrics, and its middleware innermost: counts what passed the guard
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(
        auth.Guard, tokens=app.state.tokens, settings=settings, routes=app.router.routes
    )  # outermost: refuse before reading bodies
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(
        OperationalError, database_unavailable
    )  # a lost connection or held lock: 503, agents retry
    auth.document(app)

    @app.get("/healthz", tags=["health"], dependencies=[auth.requires(None)])
    def healthz() -> dict[str, str]:
        """Liveness and database reachability."""
        with engine.connect() as connection:
            connection.exec_driver_sql("SELECT 1")
        return {"status": "ok"}

    return app
