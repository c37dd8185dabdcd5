"""The `alertmanager` channel: notifications as Prometheus Alertmanager v2 `postableAlert`s, posted to
`<url>/api/v2/alerts`, so teams that page through Alertmanager route ampwatch's diagnosis like any other alert.

Alertmanager matches a resolve to its firing alert by the label set, so both carry the same labels, and each
ampwatch alert (one episode) has its own (`alert_id`). Alertmanager resolves a firing alert by itself once its
`endsAt` passes: a firing notice sets it FIRING_TTL ahead, and ampwatch's reminders (every 4 h by default)
move it on."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Any

from ampwatch.server.alerts._messages import Notice, text

FIRING_TTL = timedelta(hours=24)
API_PATH = "/api/v2/alerts"
TEST_TTL = timedelta(minutes=5)  # a test alert shows in Alertmanager, then resolves by itself


def alertmanager_url(url: str) -> str:
    """The alerts endpoint of an Alertmanager given by its base URL (or by the endpoint itself)."""
    base = url.rstrip("/")
    return base if base.endswith(API_PATH) else base + API_PATH


def alertmanager_body(notice: Notice, now: datetime | None = None) -> list[dict[str, Any]]:
    """A list of postableAlerts: the notice's alert and the run's others grouped with it, in one request."""
    now = now or datetime.now(timezone.utc)
    lead = {**notice.alert, "details": notice.details}
    return [_postable(notice, alert, now) for alert in (lead, *notice.others)]


def _postable(notice: Notice, alert: dict[str, Any], now: datetime) -> dict[str, Any]:
    run, details = notice.run, alert.get("details") or {}
    labels = {
        "alertname": f"ampwatch_{alert['rule']}",
        "severity": alert["severity"],
        "rule": alert["rule"],
        "project": run.get("project"),
        "run": run.get("id"),
        "run_name": run.get("name"),
        "rank": alert.get("rank"),
        "alert_id": alert.get("id"),
        "source": "ampwatch",
    }
    description = (
        text(notice) if alert.get("id") == notice.alert.get("id") else alert["summary"]
    )  # the lead's diagnosis
    annotations = {
        "summary": alert["summary"],
        "description": description,
        "step": alert.get("step"),
        "origin": details.get("origin"),
        "run_url": alert.get("url"),
    }
    started = _time(alert.get("started_at")) or now
    if notice.test:
        ends = now + TEST_TTL
    elif notice.status == "resolved":
        ends = _time(alert.get("resolved_at")) or now
    else:
        ends = now + FIRING_TTL
    postable: dict[str, Any] = {
        "labels": _label_set(labels),
        "annotations": _label_set(annotations),
        "startsAt": _iso(started),
        "endsAt": _iso(max(ends, started)),
    }
    if alert.get("url"):
        postable["generatorURL"] = alert["url"]
    return postable


def _label_set(values: dict[str, Any]) -> dict[str, str]:
    """A LabelSet: string values only, empty ones left out (Alertmanager treats an empty label as absent)."""
    return {_name(k): str(v) for k, v in values.items() if v is not None and str(v) != ""}


def _name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def _iso(value: datetime) -> str:
    return value.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
