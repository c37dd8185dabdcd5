"""The server side of the `ampwatch` command: `server`, `db upgrade`, `token`, `demo`."""

from __future__ import annotations

import argparse
import sys

import uvicorn
from sqlalchemy import exc
from sqlalchemy.engine import make_url

from ampwatch.server import auth, db
from ampwatch.server.alerts import ConfigError
from ampwatch.server.app import create_app
from ampwatch.server.settings import Settings


def settings_from(args: argparse.Namespace) -> Settings:
    """Environment settings with the CLI flags on top."""
    flags = {
        "host": getattr(args, "host", None),
        "port": getattr(args, "port", None),
        "database_url": args.db,
        "insecure": getattr(args, "insecure", None),
    }
    return Settings(**{k: v for k, v in flags.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    """Dispatch a parsed command line; a database out of reach or a broken rules file is one line, exit 2."""
    try:
        return _run(args)
    except ConfigError as error:
        print(f"ampwatch {args.command}: AMPWATCH_ALERT_RULES_FILE: {error}", file=sys.stderr)
    except exc.OperationalError as error:  # (the driver's reason is its first line; the rest is SQL and a link)
        reason = str(error.orig or error).strip().splitlines()[0]
        print(
            f"ampwatch {args.command}: cannot use the database {_safe_url(settings_from(args).database_url)}: {reason}",
            file=sys.stderr,
        )
    return 2


def _run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    if args.command == "db":
        db.upgrade(db.make_engine(settings.database_url))
        print(f"database {_safe_url(settings.database_url)} is at the latest schema")
        return 0
    if args.command == "token":
        return _token(args, settings)
    if args.command == "demo":
        from ampwatch.server.demo import run_demo

        return run_demo(settings, steps=args.steps, step_delay_s=args.step_delay, serve_after=not args.exit)
    app = create_app(settings)
    problem = auth.exposure_problem(settings, app.state.tokens)
    if problem:
        print(f"ampwatch server: {problem}", file=sys.stderr)
        return 2
    print(f"ampwatch server on {settings.base_url} (database {_safe_url(settings.database_url)})", file=sys.stderr)
    uvicorn.run(
        app, host=settings.host, port=settings.port, log_level="info", timeout_graceful_shutdown=3
    )  # open live streams must not hold up Ctrl-C
    return 0


def _token(args: argparse.Namespace, settings: Settings) -> int:
    engine = db.make_engine(settings.database_url)
    db.upgrade(engine)
    with db.session_factory(engine)() as session:
        if args.token_command == "create":
            try:
                secret = auth.create_token(session, name=args.name, role=args.role, project=args.project)
            except ValueError as error:
                print(f"ampwatch token create: {error}", file=sys.stderr)
                return 2
            scope = f" for project {args.project!r}" if args.project else ""
            print(f"created a {args.role} token{scope}; it is shown only this once:", file=sys.stderr)
            print(secret)
            return 0
        if args.token_command == "revoke":
            if auth.revoke_token(session, args.id):
                print(f"token {args.id} revoked (servers stop accepting it within {Settings().token_refresh_s:g} s)")
                return 0
            print(f"ampwatch token revoke: no active token with id {args.id}", file=sys.stderr)
            return 1
        rows = auth.list_tokens(session)
        if not rows:
            print("no tokens: a server on loopback is open to everyone on this machine")
        elif all(row.revoked_at for row in rows):
            print("every token is revoked: the server lets nobody in until one is created", file=sys.stderr)
        for row in rows:
            state = f"revoked {row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "active"
            print(f"{row.id:>4}  {row.role:<6}  {row.project or '(all projects)':<20}  {state:<22}  {row.name}")
        return 0


def _safe_url(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)
