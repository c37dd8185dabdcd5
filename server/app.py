"""`create_app(settings)`: the one place that wires the database, routers, pages and limits."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from ampwatch import __version__
from ampwatch.server import db
from ampwatch.server.errors import validation_error
from ampwatch.server.limits import BodyLimit
from ampwatch.server.routers import ingest, read
from ampwatch.server.settings import Settings


def create_app(settings: Settings | None = None) -> FastAPI:
    """A ready app on `settings.database_url`, migrated to the latest schema."""
    from ampwatch import web  # pages import the server's modules; wire them last

    settings = settings or Settings()
    engine = db.make_engine(settings.database_url)
    db.upgrade(engine)
    app = FastAPI(title="ampwatch", version=__version__, description="Mixed-precision training telemetry.")
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = db.session_factory(engine)
    app.include_router(ingest.router)
    app.include_router(read.router)
    app.include_router(web.router)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_exception_handler(RequestValidationError, validation_error)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        """Liveness and database reachability."""
        with engine.connect() as connection:
            connection.exec_driver_sql("SELECT 1")
        return {"status": "ok"}

    return app
