"""`ampwatch watch`: follow a run live from its SSE stream, printing each new step, event and firing alert, until
the run ends (exit 0, or CRASHED_EXIT) or a critical alert fires (CRITICAL_EXIT). Standard library only."""

from __future__ import annotations

import http.client
import json
import queue
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ampwatch._client import Client, CommandError, quoted
from ampwatch._format import number

CRITICAL_EXIT = 3
CRASHED_EXIT = 4
ALERT_POLL_S = 0.5  # `watch` looks at the run's firing alerts this often (alerts are not in the run's stream)
RECONNECT_S = 0.5  # after a dropped stream
FINISH_GRACE_S = 3.0  # alerts are evaluated in the background: after the run ends, `watch` waits this long for them
_ENDED = ("finished", "crashed", "stopped")


def watch(client: Client, run_id: str) -> int:
    """Follow the run until it ends or a critical alert fires; the exit code. Raises `CommandError`."""
    found = client.get(f"/api/v1/runs/{quoted(run_id)}")
    newest = client.get(f"/api/v1/runs/{quoted(run_id)}/events", limit=1)
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


def stream_messages(client: Client, run_id: str, start: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The run's SSE messages as (event, decoded data) from `start` (the stream's query), forever: the server ends
    each stream after a while and this reconnects from the last id it saw (`Last-Event-ID`), as a browser does."""
    last_id: str | None = None
    ids: list[str] = []
    while True:
        headers = {"Accept": "text/event-stream", **({"Last-Event-ID": last_id} if last_id else {})}
        path = f"/api/v1/runs/{quoted(run_id)}/stream"
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
            shown = "  ".join(f"{n}={number(v)}" for n, v in sorted(values.items()) if "/" not in n)
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
