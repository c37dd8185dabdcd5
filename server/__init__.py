"""The ampwatch server: `create_app(settings)` builds the FastAPI app (needs the `server` extra)."""

from ampwatch.server.app import create_app
from ampwatch.server.settings import Settings

__all__ = ["Settings", "create_app"]
