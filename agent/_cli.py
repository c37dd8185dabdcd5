"""The `ampwatch` command. Server commands need the `server` extra and are imported only when used."""

from __future__ import annotations

import argparse
import sys

CLIENT_COMMANDS = ("runs", "run", "events", "series", "alerts", "watch", "plan", "stop")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampwatch", description="Watch the numerics of PyTorch training.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    server = commands.add_parser("server", help="run the server and dashboard")
    server.add_argument("--host", help="address to bind (default 127.0.0.1, or AMPWATCH_HOST)")
    server.add_argument("--port", type=int, help="port (default 8600, or AMPWATCH_PORT)")
    server.add_argument(
        "--db", metavar="URL", help="database URL (default sqlite:///ampwatch.db, or AMPWATCH_DATABASE_URL)"
    )
    server.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="allow a non-loopback address without any access token (or AMPWATCH_INSECURE=1)",
    )

    demo = commands.add_parser("demo", help="start a server and a small CPU training that goes unstable on purpose")
    demo.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    demo.add_argument("--port", type=int, default=8600, help="port (default 8600)")
    demo.add_argument(
        "--db",
        metavar="URL",
        default="sqlite:///ampwatch-demo.db",
        help="database URL (default sqlite:///ampwatch-demo.db)",
    )
    demo.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    demo.add_argument(
        "--step-delay", type=float, default=0.02, help="seconds to pause per step, to watch it live (default 0.02)"
    )
    demo.add_argument("--exit", action="store_true", help="stop the server when training ends instead of serving on")

    db = commands.add_parser("db", help="database maintenance")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="DB_COMMAND")
    upgrade = db_commands.add_parser("upgrade", help="apply migrations to the latest schema")
    upgrade.add_argument(
        "--db", metavar="URL", help="database URL (default sqlite:///ampwatch.db, or AMPWATCH_DATABASE_URL)"
    )

    token = commands.add_parser("token", help="manage access tokens (stored hashed in the database)")
    token_commands = token.add_subparsers(dest="token_command", required=True, metavar="TOKEN_COMMAND")
    create = token_commands.add_parser("create", help="create a token and print it (it is shown only once)")
    create.add_argument(
        "--role",
        choices=("ingest", "read", "admin"),
        required=True,
        help="ingest: agents send data; read: dashboard and read API; admin: everything",
    )
    create.add_argument("--project", help="limit an ingest token to one project")
    create.add_argument("--name", default="", help="a label to recognise it by")
    token_commands.add_parser("list", help="list tokens (never their secrets)")
    revoke = token_commands.add_parser("revoke", help="revoke a token by its id")
    revoke.add_argument("id", type=int, help="the token's id, as `ampwatch token list` shows it")
    for sub in (create, token_commands.choices["list"], revoke):
        sub.add_argument(
            "--db", metavar="URL", help="database URL (default sqlite:///ampwatch.db, or AMPWATCH_DATABASE_URL)"
        )

    sync = commands.add_parser("sync", help="upload runs left in the spool by offline mode or an unreachable server")
    sync.add_argument("dir", nargs="?", help="spool folder (default AMPWATCH_SPOOL_DIR, or ~/.cache/ampwatch/spool)")
    sync.add_argument("--url", help="server to upload to (default: the one each run was started with)")
    sync.add_argument("--token", help="ingest token (default AMPWATCH_TOKEN)")

    commands.add_parser("version", help="print the version")
    _client_commands(commands)
    return parser


def _client_commands(commands: argparse._SubParsersAction) -> None:
    """The commands that read (and prune) the server's runs over HTTP: standard library only."""
    from ampwatch._client import add_connection_flags
    from ampwatch._commands import duration_s, event_id, events_limit

    runs = commands.add_parser("runs", help="list runs (or delete and prune them)")
    runs.add_argument("--project", help="only this project's runs")
    runs.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    runs_commands = runs.add_subparsers(dest="runs_command", metavar="RUNS_COMMAND")
    delete = runs_commands.add_parser("delete", help="delete a run and all its data (admin token)")
    delete.add_argument("id", help="the run's id")
    delete.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    prune = runs_commands.add_parser("prune", help="delete runs created longer ago than a duration (admin token)")
    prune.add_argument(
        "--older-than",
        type=duration_s,
        required=True,
        metavar="DURATION",
        help="age such as 90d, 12h, 30m (s, m, h, d, w)",
    )
    prune.add_argument("--project", help="only this project's runs")
    prune.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    prune.add_argument("--json", action="store_true", help="one JSON document instead of a table")

    one = commands.add_parser("run", help="show one run")
    one.add_argument("id", help="the run's id")
    one.add_argument("--json", action="store_true", help="one JSON document instead of a table")

    events = commands.add_parser("events", help="list a run's events (the newest 1000, in step order)")
    events.add_argument("id", help="the run's id")
    amount = events.add_mutually_exclusive_group()
    amount.add_argument("--limit", type=events_limit, metavar="N", help="at most N events, 1 to 10000 (default 1000)")
    amount.add_argument("--all", action="store_true", help="every event, in stored order, read page by page")
    events.add_argument(
        "--after-id", type=event_id, metavar="ID", help="only events stored after the event ID, in stored order"
    )
    events.add_argument("--json", action="store_true", help="one JSON document instead of a table")

    series = commands.add_parser("series", help="print series of a run, one row per step")
    series.add_argument("id", help="the run's id")
    series.add_argument("names", nargs="+", metavar="NAME", help="series names, e.g. loss scale grad_norm")
    output = series.add_mutually_exclusive_group()
    output.add_argument("--csv", action="store_true", help="CSV: step, then one column per series")
    output.add_argument("--json", action="store_true", help="the API's {name: {steps, values}} document")
    series.add_argument(
        "--max-points", type=int, metavar="N", help="about N points per series, keeping spikes and non-finite values"
    )

    alerts = commands.add_parser("alerts", help="list alerts, newest first")
    alerts.add_argument("--run", metavar="ID", help="only this run's alerts")
    alerts.add_argument("--state", choices=("firing", "resolved"), help="only alerts in this state")
    alerts.add_argument("--json", action="store_true", help="one JSON document instead of a table")

    watch = commands.add_parser(
        "watch", help="follow a run live; exit 3 when a critical alert fires, 0 when the run finishes"
    )
    watch.add_argument("id", help="the run's id")

    plan = commands.add_parser("plan", help="the rollback plan: the checkpoint to restore and the steps to skip")
    plan.add_argument("id", help="the run's id")
    plan_output = plan.add_mutually_exclusive_group()
    plan_output.add_argument(
        "--format",
        choices=("json", "lightning", "megatron"),
        help="json: the plan; lightning: skip_batches.json; megatron: the --iterations-to-skip "
        "list (default: a summary for people)",
    )
    plan_output.add_argument("--json", action="store_true", help="the plan as one JSON document (--format json)")
    plan.add_argument("--output", "-o", metavar="FILE", help="write it to FILE instead of stdout")
    stop = commands.add_parser(
        "stop", help="ask a run to stop (admin token): its agent learns it at its next batch, the run ends stopped"
    )
    stop.add_argument("id", help="the run's id")
    stop.add_argument("--reason", metavar="TEXT", help="why, shown with the run and told to the agent")
    stop.add_argument("--json", action="store_true", help="the run as one JSON document")
    for sub in (runs, delete, prune, one, events, series, alerts, watch, plan, stop):
        add_connection_flags(sub)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `ampwatch` console script."""
    args = _parser().parse_args(argv)
    if args.command == "sync":
        import os
        from pathlib import Path

        from ampwatch._spool import default_root
        from ampwatch._sync import sync

        return sync(
            Path(args.dir) if args.dir else default_root(), args.url, args.token or os.environ.get("AMPWATCH_TOKEN")
        )
    if args.command in CLIENT_COMMANDS:
        from ampwatch import _commands

        return _commands.run(args)
    if args.command == "version":
        from ampwatch import __version__

        print(__version__)
        return 0
    try:
        from ampwatch.server import cli
    except ImportError as error:
        print(f'ampwatch {args.command} needs the server: pip install "ampwatch[server]" ({error})', file=sys.stderr)
        return 2
    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
