"""The client commands (`ampwatch runs`, `run`, `events`, `series`, `alerts`, `watch`, `plan`, `stop`, `runs
delete|prune`): an
HTTP client of the server's API, standard library only, so `pip install ampwatch` alone runs them.

People get aligned tables, programs get `--json` (one document; non-finite values spelled "NaN", "Infinity" as
the API does). Exit codes: 0 done, 1 failure (server unreachable, token refused, no such run), 2 usage,
and for `watch` 3 when a critical alert fires, 4 when the run crashed."""

from __future__ import annotations

import argparse
import csv
import http.client
import json
import os
import queue
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from ampwatch import __version__

DEFAULT_URL = "http://127.0.0.1:8600"
CRITICAL_EXIT = 3
CRASHED_EXIT = 4
ALERT_POLL_S = 0.5  # `watch` looks at the run's firing alerts this often (alerts are not in the run's stream)
RECONNECT_S = 0.5  # after a dropped stream
FINISH_GRACE_S = 3.0  # alerts are evaluated in the background: after the run ends, `watch` waits this long for them
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_ENDED = ("finished", "crashed", "stopped")


class CommandError(Exception):
    """A failure to report on one line of stderr, with the exit code to leave with."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def duration_s(text: str) -> float:
    """Seconds in a duration such as `90d`, `12h`, `30m`, `45s` or `2w` (an argparse type)."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 90d, 12h, 30m")
    return float(match[1]) * _UNITS[match[2]]


class Client:
    """The server's HTTP API with the token as `Authorization: Bearer`; HTTP errors become `CommandError`s."""

    def __init__(self, url: str, token: str | None, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def open(
        self,
        method: str,
        path: str,
        query: dict[str, Any] | None = None,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """The open response (a context manager) of one request; `path` may be a full URL the server gave."""
        target = path if "://" in path else self.url + path
        if query:
            pairs = [(k, v) for k, v in query.items() if v is not None]
            target += ("&" if "?" in target else "?") + urllib.parse.urlencode(pairs, doseq=True)
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(target, data=data, method=method)
        request.add_header("User-Agent", f"ampwatch-cli/{__version__}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        try:
            return urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s)
        except urllib.error.HTTPError as error:
            raise self._refused(error) from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise CommandError(
                f"cannot reach the ampwatch server at {self.url} ({reason}); start it, or set AMPWATCH_URL (or --url)"
            ) from None

    def json(self, method: str, path: str, query: dict[str, Any] | None = None, body: Any = None) -> tuple[Any, Any]:
        """(the decoded JSON body or None when empty, the response headers)."""
        with self.open(method, path, query, body) as response:
            raw = response.read()
            return (json.loads(raw) if raw.strip() else None), response.headers

    def get(self, path: str, **query: Any) -> Any:
        return self.json("GET", path, query)[0]

    def _refused(self, error: urllib.error.HTTPError) -> CommandError:
        try:
            detail = json.loads(error.read() or b"{}").get("detail") or error.reason
        except (ValueError, AttributeError, OSError):
            detail = error.reason
        detail = detail if isinstance(detail, str) else json.dumps(detail)
        if error.code == 401:
            given = "the token was refused" if self.token else "this server needs a token"
            return CommandError(f"{given} ({detail}): set AMPWATCH_TOKEN (or --token) to a read or admin token")
        if error.code == 403:
            return CommandError(f"forbidden ({detail}): set AMPWATCH_TOKEN (or --token) to a token allowed to do this")
        if error.code == 404:
            return CommandError(str(detail))
        return CommandError(f"the server answered HTTP {error.code}: {detail}")


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """`--url` and `--token`; SUPPRESS keeps a subcommand from overwriting what its parent command parsed."""
    parser.add_argument("--url", default=argparse.SUPPRESS, help=f"the server (default AMPWATCH_URL, or {DEFAULT_URL})")
    parser.add_argument(
        "--token", default=argparse.SUPPRESS, help="a read token, admin to delete (default AMPWATCH_TOKEN)"
    )


def client_of(args: argparse.Namespace) -> Client:
    url = getattr(args, "url", None) or os.environ.get("AMPWATCH_URL") or DEFAULT_URL
    return Client(url, getattr(args, "token", None) or os.environ.get("AMPWATCH_TOKEN") or None)


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


def _print_json(document: Any) -> None:
    json.dump(document, sys.stdout, indent=2, allow_nan=False)  # the API already spells non-finite values out
    sys.stdout.write("\n")


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """Left-aligned columns, two spaces apart; None shows as `-`."""
    cells = [headers] + [["-" if c is None else str(c).replace("\n", " ") for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def _time(value: str | None) -> str | None:
    return value[:19].replace("T", " ") if value else None  # seconds are enough on screen; --json has it all


def list_runs(client: Client, project: str | None) -> list[dict[str, Any]]:
    """Every run (newest first), following the server's next-page cursor (`Link: rel="next"` or `X-Next-Cursor`)
    when it sends one."""
    runs: list[dict[str, Any]] = []
    path, query, seen = "/api/v1/runs", {"project": project}, set()
    while True:
        page, headers = client.json("GET", path, query)
        runs += page
        link = _next_link(headers.get("Link", ""))
        cursor = headers.get("X-Next-Cursor")
        if link and link not in seen:
            seen.add(link)
            path, query = urllib.parse.urljoin(client.url + "/", link), {}
        elif cursor and cursor not in seen:
            seen.add(cursor)
            path, query = "/api/v1/runs", {"project": project, "cursor": cursor}
        else:
            return runs


def _next_link(header: str) -> str | None:
    for part in header.split(","):
        target, _, params = part.partition(";")
        if re.search(r'rel="?next"?', params) and target.strip().startswith("<"):
            return target.strip()[1:-1]
    return None


def _runs(client: Client, args: argparse.Namespace) -> int:
    if args.runs_command == "delete":
        return _delete(client, args)
    if args.runs_command == "prune":
        return _prune(client, args)
    runs = list_runs(client, args.project)
    if args.json:
        _print_json(runs)
        return 0
    rows = [
        [r["id"], r["project"], r["name"], r["status"], r["health"], r["last_step"], _time(r["last_seen_at"])]
        for r in runs
    ]
    print(table(["ID", "PROJECT", "NAME", "STATUS", "HEALTH", "STEP", "LAST SEEN (UTC)"], rows))
    return 0


def _run(client: Client, args: argparse.Namespace) -> int:
    found = client.get(f"/api/v1/runs/{_quoted(args.id)}")
    if args.json:
        _print_json(found)
        return 0
    fields = [
        ("id", found["id"]),
        ("project", found["project"]),
        ("name", found["name"]),
        ("status", found["status"]),
        ("health", found["health"]),
        ("last step", found["last_step"]),
        ("created", _time(found["created_at"])),
        ("last seen", _time(found["last_seen_at"])),
        ("finished", _time(found["finished_at"])),
        ("ranks", ", ".join(map(str, found["ranks"])) or None),
        ("series", ", ".join(found["series"]) or None),
        ("page", found["url"]),
    ]
    print(table(["FIELD", "VALUE"], [list(f) for f in fields]))
    return 0


def _quoted(run_id: str) -> str:
    return urllib.parse.quote(run_id, safe="")


def _events(client: Client, args: argparse.Namespace) -> int:
    events = client.get(f"/api/v1/runs/{_quoted(args.id)}/events")
    if args.json:
        _print_json(events)
        return 0
    plan = {
        e["id"]: f" Rollback plan: {e['plan']['summary']} (ampwatch plan {args.id})" for e in events if e.get("plan")
    }
    rows = [[e["step"], e["rank"], e["severity"], e["type"], e["message"] + plan.get(e["id"], "")] for e in events]
    print(table(["STEP", "RANK", "SEVERITY", "TYPE", "MESSAGE"], rows))
    return 0


def _series(client: Client, args: argparse.Namespace) -> int:
    data = client.get(f"/api/v1/runs/{_quoted(args.id)}/series", name=args.names, max_points=args.max_points)
    if args.json:
        _print_json(data)
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
        _print_json(alerts)
        return 0
    rows = [
        [
            a["id"],
            a["run_id"],
            a["severity"],
            a["state"],
            a["rule"],
            _time(a["started_at"]),
            _time(a["resolved_at"]),
            a["summary"],
        ]
        for a in alerts
    ]
    print(table(["ID", "RUN", "SEVERITY", "STATE", "RULE", "STARTED (UTC)", "RESOLVED", "SUMMARY"], rows))
    return 0


def _delete(client: Client, args: argparse.Namespace) -> int:
    found = client.get(f"/api/v1/runs/{_quoted(args.id)}")
    label = f"{found['id']} ({found['project']}/{found['name']}, {found['status']})"
    if not args.yes:
        if not sys.stdin.isatty():
            raise CommandError("refusing to delete without confirmation: pass --yes", code=2)
        if input(f"Delete run {label} and all its data? [y/N] ").strip().lower() not in ("y", "yes"):
            print("nothing deleted", file=sys.stderr)
            return 1
    client.json("DELETE", f"/api/v1/runs/{_quoted(args.id)}")
    print(f"deleted run {label}")
    return 0


def _stop(client: Client, args: argparse.Namespace) -> int:
    """Ask a run to stop (an admin token): its agent learns it at its next batch; the run then ends `stopped`."""
    body = {"reason": args.reason} if args.reason else {}
    found, _ = client.json("POST", f"/api/v1/runs/{_quoted(args.id)}/stop", body=body)
    if args.json:
        _print_json(found)
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
        _print_json(result)
        return 0
    runs = result["runs"]
    rows = [[r["id"], r["project"], r["name"], _time(r["created_at"])] for r in runs]
    if rows:
        print(table(["ID", "PROJECT", "NAME", "CREATED (UTC)"], rows))
    verb = "deleted" if result.get("deleted") else "would delete (dry run)" if args.dry_run else "matched"
    print(f"{verb} {len(runs)} run{'s' if len(runs) != 1 else ''}", file=sys.stderr)
    return 0


def _plan(client: Client, args: argparse.Namespace) -> int:
    """The rollback plan as a summary, the JSON document, or the file a trainer takes (`--format`)."""
    fmt = "json" if args.json else args.format
    path = f"/api/v1/runs/{_quoted(args.id)}/plan"
    if fmt in ("lightning", "megatron"):
        with client.open("GET", path, {"format": fmt}) as response:
            text = response.read().decode()
    else:
        doc = client.get(path)
        text = json.dumps(doc, indent=2, allow_nan=False) + "\n" if fmt == "json" else _plan_text(doc)
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


def _plan_text(doc: dict[str, Any]) -> str:
    trouble, checkpoint, skip = doc["trouble"], doc["checkpoint"], doc["skip"]
    if trouble is None:
        return doc["summary"] + "\n"
    critical = ", ".join(f"{e['type']} at step {e['step']}" for e in trouble["critical"])
    restore = (
        "-"
        if checkpoint is None
        else f"step {checkpoint['step']}" + (f" ({checkpoint['path']})" if checkpoint["path"] else "")
    )
    fields = [
        ["trouble began", f"step {trouble['first_step']} ({trouble['first_sign']['type']})"],
        ["critical", critical],
        ["restore", restore if checkpoint else "none before the trouble: start over"],
        ["skip steps", f"{skip['from']}-{skip['to']} ({len(skip['steps'])} steps)"],
    ]
    return doc["summary"] + "\n\n" + table(["PLAN", "VALUE"], fields) + "\n"


def stream_messages(client: Client, run_id: str, start: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The run's SSE messages as (event, decoded data) from `start` (the stream's query), forever: the server ends
    each stream after a while and this reconnects from the last id it saw (`Last-Event-ID`), as a browser does."""
    last_id: str | None = None
    ids: list[str] = []
    while True:
        headers = {"Accept": "text/event-stream", **({"Last-Event-ID": last_id} if last_id else {})}
        path = f"/api/v1/runs/{_quoted(run_id)}/stream"
        with client.open("GET", path, None if last_id else start, headers=headers, timeout_s=90) as response:
            try:
                yield from _events_of(response, ids)
            except (OSError, http.client.HTTPException):  # a dropped connection: reconnect from the last id
                time.sleep(RECONNECT_S)
        last_id = ids[-1] if ids else last_id


def _events_of(response: Any, ids: list[str]) -> Iterator[tuple[str, Any]]:
    """The SSE messages of one response; `ids` keeps the last `id:` seen."""
    event, data = "message", list[str]()
    for raw in response:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)
            elif name == "id":
                ids[:] = [value]


def _watch(client: Client, args: argparse.Namespace) -> int:
    found = client.get(f"/api/v1/runs/{_quoted(args.id)}")
    newest = client.get(f"/api/v1/runs/{_quoted(args.id)}/events", limit=1)
    # The stream starts where these reads left off: what is stored while it connects is shown, nothing before.
    start = {
        "after_step": found["last_step"] if found["last_step"] is not None else -1,
        "after_event": newest[-1]["id"] if newest else 0,
    }
    print(
        f"watching run {found['id']} ({found['project']}/{found['name']}): {found['status']}, "
        f"step {found['last_step'] if found['last_step'] is not None else '-'}",
        flush=True,
    )
    messages: queue.Queue[tuple[str, Any] | BaseException] = queue.Queue()

    def follow() -> None:
        try:
            for message in stream_messages(client, found["id"], start):
                messages.put(message)
        except BaseException as error:  # handed to the main thread, which reports it
            messages.put(error)

    threading.Thread(target=follow, name="ampwatch-watch", daemon=True).start()
    watcher = _Watcher(client, found["id"])
    status = found["status"]
    # A run that had ended already: no alerts are on their way, one look at them is enough.
    ended_at = time.monotonic() - FINISH_GRACE_S if status in _ENDED else None
    while True:
        if (code := watcher.check_alerts()) is not None:
            _drain(messages, watcher, ALERT_POLL_S)  # the events behind the alert are usually a stream poll away
            return code
        if ended_at is not None and time.monotonic() - ended_at >= FINISH_GRACE_S:
            print(f"run {status}", flush=True)
            return 0 if status == "finished" else CRASHED_EXIT
        if status in _ENDED and ended_at is None:
            ended_at = time.monotonic()
        try:
            item = messages.get(timeout=ALERT_POLL_S)
        except queue.Empty:
            continue
        if isinstance(item, BaseException):
            raise item if isinstance(item, CommandError) else CommandError(f"lost the run's stream: {item}")
        if item[0] == "update":
            status = watcher.show(item[1]) or status


def _drain(messages: queue.Queue[Any], watcher: _Watcher, wait_s: float) -> None:
    """Show what the stream delivers within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            item = messages.get(timeout=left)
        except queue.Empty:
            return
        if not isinstance(item, BaseException) and item[0] == "update":
            watcher.show(item[1])


class _Watcher:
    """What `watch` has printed: the newest step's values, events, and the alerts seen firing."""

    def __init__(self, client: Client, run_id: str) -> None:
        self.client, self.run_id = client, run_id
        self.alerts: set[int] = set()
        self.polled_at: float | None = None

    def show(self, update: dict[str, Any]) -> str | None:
        """Print one stream update; the run's status."""
        points = update.get("points") or {}
        if points:
            last = max(max(p["steps"]) for p in points.values() if p["steps"])
            values = {n: p["values"][p["steps"].index(last)] for n, p in points.items() if last in p["steps"]}
            shown = "  ".join(f"{n}={_number(v)}" for n, v in sorted(values.items()) if "/" not in n)
            print(f"step {last}  {shown}", flush=True)
        for event in update.get("events") or []:
            print(f"event [{event['severity']}] step {event['step']} {event['type']}: {event['message']}", flush=True)
            if event.get("plan"):  # (a plan trigger)
                print(f"  rollback plan: {event['plan']['summary']} (ampwatch plan {self.run_id})", flush=True)
        return (update.get("run") or {}).get("status")

    def check_alerts(self) -> int | None:
        """Print alerts that fired since the last look (at most once per ALERT_POLL_S); CRITICAL_EXIT once a
        critical one has fired. All states are read: an alert may fire and resolve between two looks."""
        if self.polled_at is not None and time.monotonic() - self.polled_at < ALERT_POLL_S:
            return None
        first, self.polled_at = self.polled_at is None, time.monotonic()
        alerts = self.client.get("/api/v1/alerts", run_id=self.run_id)
        fired = [a for a in alerts if a["id"] not in self.alerts and not (first and a["state"] == "resolved")]
        self.alerts.update(a["id"] for a in alerts)  # (resolved before `watch` started: history, not news)
        for alert in reversed(fired):  # oldest first
            print(f"ALERT [{alert['severity']}] {alert['rule']}: {alert['summary']} ({alert['state']})", flush=True)
        if any(a["severity"] == "critical" for a in fired):
            print("a critical alert fired: exiting with status 3", file=sys.stderr)
            return CRITICAL_EXIT
        return None


def _number(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)
