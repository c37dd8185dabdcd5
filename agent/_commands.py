"""The client commands (`ampwatch runs`, `run`, `events`, `series`, `alerts`, `watch`, `plan`, `stop`, `runs
delete|prune`), standard library only, so `pip install ampwatch` alone runs them: each reads or changes the server
through `ampwatch._client` and prints with `ampwatch._format`; `watch` is `ampwatch._follow`.

People get aligned tables, programs get `--json` (one document; non-finite values spelled "NaN", "Infinity" as
the API does). Exit codes: 0 done, 1 failure (server unreachable, token refused, no such run), 2 usage,
and for `watch` 3 when a critical alert fires, 4 when the run crashed."""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from collections.abc import Callable
from typing import Any

from ampwatch._client import EVENTS_PAGE, Client, CommandError, client_of, list_events, list_runs, quoted
from ampwatch._follow import watch
from ampwatch._format import plan_text, print_json, table, timestamp

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
EVENTS_DEFAULT = 1000  # what the server answers without a `limit`
_MAX_ID = 2**63 - 1  # the largest id the server stores


def duration_s(text: str) -> float:
    """Seconds in a duration such as `90d`, `12h`, `30m`, `45s` or `2w` (an argparse type)."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 90d, 12h, 30m")
    return float(match[1]) * _UNITS[match[2]]


def events_limit(text: str) -> int:
    """A number of events the server answers at once, 1 to EVENTS_PAGE (an argparse type)."""
    if not text.strip().isdigit() or not 1 <= int(text) <= EVENTS_PAGE:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of events from 1 to {EVENTS_PAGE}")
    return int(text)


def event_id(text: str) -> int:
    """An event's id, 0 or more (an argparse type)."""
    if not text.strip().isdigit() or int(text) > _MAX_ID:
        raise argparse.ArgumentTypeError(f"{text!r} is not an event id (a whole number, 0 or more)")
    return int(text)


def run(args: argparse.Namespace) -> int:
    """Run one parsed client command; failures are one line on stderr and the exit code."""
    commands: dict[str, Callable[[Client, argparse.Namespace], int]] = {
        "runs": _runs,
        "run": _run,
        "events": _events,
        "series": _series,
        "alerts": _alerts,
        "watch": _watch,
        "plan": _plan,
        "stop": _stop,
    }
    try:
        return commands[args.command](client_of(args), args)
    except CommandError as error:
        print(f"ampwatch {args.command}: {error}", file=sys.stderr)
        return error.code
    except KeyboardInterrupt:
        return 130


def _runs(client: Client, args: argparse.Namespace) -> int:
    if args.runs_command == "delete":
        return _delete(client, args)
    if args.runs_command == "prune":
        return _prune(client, args)
    runs = list_runs(client, args.project)
    if args.json:
        print_json(runs)
        return 0
    rows = [
        [r["id"], r["project"], r["name"], r["status"], r["health"], r["last_step"], timestamp(r["last_seen_at"])]
        for r in runs
    ]
    print(table(["ID", "PROJECT", "NAME", "STATUS", "HEALTH", "STEP", "LAST SEEN (UTC)"], rows))
    return 0


def _run(client: Client, args: argparse.Namespace) -> int:
    found = client.get(f"/api/v1/runs/{quoted(args.id)}")
    if args.json:
        print_json(found)
        return 0
    fields = [
        ("id", found["id"]),
        ("project", found["project"]),
        ("name", found["name"]),
        ("status", found["status"]),
        ("health", found["health"]),
        ("last step", found["last_step"]),
        ("created", timestamp(found["created_at"])),
        ("last seen", timestamp(found["last_seen_at"])),
        ("finished", timestamp(found["finished_at"])),
        ("ranks", ", ".join(map(str, found["ranks"])) or None),
        ("series", ", ".join(found["series"]) or None),
        ("page", found["url"]),
    ]
    print(table(["FIELD", "VALUE"], [list(f) for f in fields]))
    return 0


def _events(client: Client, args: argparse.Namespace) -> int:
    """The newest events in step order; with `--after-id`, those stored after one; with `--all`, every one."""
    limit = args.limit or EVENTS_DEFAULT
    if args.all:
        events = list_events(client, args.id, args.after_id or 0)
    else:
        events = client.get(f"/api/v1/runs/{quoted(args.id)}/events", limit=limit, after_id=args.after_id)
    if args.json:
        print_json(events)
    else:
        plan = {
            e["id"]: f" Rollback plan: {e['plan']['summary']} (ampwatch plan {args.id})"
            for e in events
            if e.get("plan")
        }
        rows = [[e["step"], e["rank"], e["severity"], e["type"], e["message"] + plan.get(e["id"], "")] for e in events]
        print(table(["STEP", "RANK", "SEVERITY", "TYPE", "MESSAGE"], rows))
    if not args.all and len(events) == limit:  # a full page: say how to see the rest
        more = (
            f"the newest {limit} events are shown; the run may have more (--all prints every one)"
            if args.after_id is None
            else f"{limit} events are shown; more may follow (--after-id {events[-1]['id']} prints the next)"
        )
        print(f"ampwatch events: {more}", file=sys.stderr)
    return 0


def _series(client: Client, args: argparse.Namespace) -> int:
    data = client.get(f"/api/v1/runs/{quoted(args.id)}/series", name=args.names, max_points=args.max_points)
    if args.json:
        print_json(data)
        return 0
    names = [n for n in args.names if (data.get(n) or {}).get("steps")]
    missing = [n for n in args.names if n not in names]
    if missing:
        print(f"ampwatch series: run {args.id} has no series {', '.join(missing)}", file=sys.stderr)
    by_step: dict[int, dict[str, Any]] = {}
    for name in names:
        for step, value in zip(data[name]["steps"], data[name]["values"]):
            by_step.setdefault(step, {})[name] = value
    rows = [[step] + [by_step[step].get(n, "") for n in names] for step in sorted(by_step)]
    if args.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(["step", *names])
        writer.writerows(rows)
    else:
        print(table(["STEP", *(n.upper() for n in names)], [[c if c != "" else None for c in r] for r in rows]))
    return 1 if missing else 0


def _alerts(client: Client, args: argparse.Namespace) -> int:
    alerts = client.get("/api/v1/alerts", run_id=args.run, state=args.state)
    if args.json:
        print_json(alerts)
        return 0
    rows = [
        [
            a["id"],
            a["run_id"],
            a["severity"],
            a["state"],
            a["rule"],
            timestamp(a["started_at"]),
            timestamp(a["resolved_at"]),
            a["summary"],
        ]
        for a in alerts
    ]
    print(table(["ID", "RUN", "SEVERITY", "STATE", "RULE", "STARTED (UTC)", "RESOLVED", "SUMMARY"], rows))
    return 0


def _delete(client: Client, args: argparse.Namespace) -> int:
    found = client.get(f"/api/v1/runs/{quoted(args.id)}")
    label = f"{found['id']} ({found['project']}/{found['name']}, {found['status']})"
    if not args.yes:
        if not sys.stdin.isatty():
            raise CommandError("refusing to delete without confirmation: pass --yes", code=2)
        if input(f"Delete run {label} and all its data? [y/N] ").strip().lower() not in ("y", "yes"):
            print("nothing deleted", file=sys.stderr)
            return 1
    client.json("DELETE", f"/api/v1/runs/{quoted(args.id)}")
    print(f"deleted run {label}")
    return 0


def _stop(client: Client, args: argparse.Namespace) -> int:
    """Ask a run to stop (an admin token): its agent learns it at its next batch; the run then ends `stopped`."""
    body = {"reason": args.reason} if args.reason else {}
    found, _ = client.json("POST", f"/api/v1/runs/{quoted(args.id)}/stop", body=body)
    if args.json:
        print_json(found)
        return 0
    stop = found.get("stop") or {}
    why = f": {stop['reason']}" if stop.get("reason") else ""
    print(
        f"asked run {found['id']} ({found['project']}/{found['name']}) to stop, as {stop.get('by')}{why}; its agent "
        "learns it at its next batch"
    )
    return 0


def _prune(client: Client, args: argparse.Namespace) -> int:
    body = {"older_than_s": args.older_than, "project": args.project, "dry_run": args.dry_run}
    result, _ = client.json("POST", "/api/v1/runs/prune", body=body)
    if args.json:
        print_json(result)
        return 0
    runs = result["runs"]
    rows = [[r["id"], r["project"], r["name"], timestamp(r["created_at"])] for r in runs]
    if rows:
        print(table(["ID", "PROJECT", "NAME", "CREATED (UTC)"], rows))
    verb = "deleted" if result.get("deleted") else "would delete (dry run)" if args.dry_run else "matched"
    print(f"{verb} {len(runs)} run{'s' if len(runs) != 1 else ''}", file=sys.stderr)
    return 0


def _plan(client: Client, args: argparse.Namespace) -> int:
    """The rollback plan as a summary, the JSON document, or the file a trainer takes (`--format`)."""
    fmt = "json" if args.json else args.format
    path = f"/api/v1/runs/{quoted(args.id)}/plan"
    if fmt in ("lightning", "megatron"):
        with client.open("GET", path, {"format": fmt}) as response:
            text = response.read().decode()
    else:
        doc = client.get(path)
        text = json.dumps(doc, indent=2, allow_nan=False) + "\n" if fmt == "json" else plan_text(doc)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        with open(args.output, "w", encoding="utf-8") as file:
            file.write(text)
    except OSError as error:
        raise CommandError(f"cannot write {args.output}: {error.strerror or error}") from None
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _watch(client: Client, args: argparse.Namespace) -> int:
    return watch(client, args.id)
