"""The server side of the `ampwatch` command: `server`, `db upgrade`, `demo`."""

from __future__ import annotations

import argparse
import sys

import uvicorn
from sqlalchemy.engine import make_url

from ampwatch.server import db
from ampwatch.server.app import create_app
from ampwatch.server.settings import Settings


def settings_from(args: argparse.Namespace) -> Settings:
    """Environment settings with the CLI flags on top."""
    flags = {"host": getattr(args, "host", None), "port": getattr(args, "port", None), "database_url": args.db}
    return Settings(**{k: v for k, v in flags.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    """Dispatch a parsed command line."""
    settings = settings_from(args)
    if args.command == "db":
        db.upgrade(db.make_engine(settings.database_url))
        print(f"database {_safe_url(settings.database_url)} is at the latest schema")
        return 0
    if args.command == "demo":
        from ampwatch.server.demo import run_demo

        return run_demo(settings, steps=args.steps, step_delay_s=args.step_delay, serve_after=not args.exit)
    print(f"ampwatch server on {settings.base_url} (database {_safe_url(settings.database_url)})", file=sys.stderr)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info", timeout_graceful_shutdown=3)  # open live streams must not hold up Ctrl-C
    return 0


def _safe_url(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)
