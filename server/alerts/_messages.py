"""Notifications as people read them: one text for every channel, plus the webhook and Slack bodies and the
e-mail. A message says what happened and its classification, where (origin), the loss scale, the recent
gradient-norm trend, and links to the run page at the step."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from email.message import EmailMessage
from typing import Any

from sqlalchemy.orm import Session

from ampwatch.server import models
from ampwatch.server.alerts._db import SEVERITY_RANK, pow2, steps, utc
from ampwatch.server.alerts._rules import project_of


@dataclass(frozen=True)
class Notice:
    """Everything a channel needs to render one notification."""

    status: str  # firing | resolved
    alert: dict[str, Any]
    run: dict[str, Any]
    reason: str
    reminder: bool = False
    test: bool = False
    details: dict[str, Any] = field(default_factory=dict)
    others: list[dict[str, Any]] = field(default_factory=list)  # the run's other alerts in this same message


def grouped(notices: list[Notice]) -> Notice:
    """One notice for several alerts of one run that are due together: the most severe leads, the rest are listed."""
    lead, *rest = sorted(notices, key=lambda n: -SEVERITY_RANK.get(n.alert["severity"], 0))  # stable: first flip first
    return replace(lead, others=[{**n.alert, "details": n.details} for n in rest]) if rest else lead


def notice_for_flip(session: Session, flip: models.AlertFlip, base_url: str) -> Notice:
    """The notice of one flip, read from the database."""
    alert = session.get(models.Alert, flip.alert_id)
    run = session.get(models.Run, alert.run_id) if alert else None
    assert alert is not None and run is not None
    run_url = f"{base_url}/runs/{run.id}"
    step = alert.step
    body = {
        "id": alert.id,
        "rule": alert.rule,
        "severity": alert.severity,
        "summary": alert.summary,
        "step": step,
        "state": flip.new_state,
        "started_at": _iso(alert.started_at),
        "resolved_at": _iso(alert.resolved_at),
        "count": alert.count,
        "last_step": alert.last_step,
        "rank": None if alert.rank < 0 else alert.rank,
        "url": f"{run_url}?step={step}" if step is not None else run_url,
    }
    run_doc = {
        "id": run.id,
        "project": project_of(session, run),
        "name": run.name,
        "url": run_url,
        "status": run.status,
    }
    status = "resolved" if flip.new_state == "resolved" else "firing"
    reminder = flip.old_state == "firing" and flip.new_state == "firing"
    details = dict(alert.details or {})
    if isinstance(details.get("plan"), dict):  # (links people and programs follow: absolute)
        path = details["plan"].get("path") or f"/api/v1/runs/{run.id}/plan"
        details["plan"] = {**details["plan"], "url": base_url + path, "page": f"{run_url}#run-plan"}
    return Notice(status, body, run_doc, flip.reason, reminder=reminder, details=details)


def test_notice(channel: models.AlertChannel, base_url: str) -> Notice:
    """A harmless notification that proves a channel works."""
    alert = {
        "id": 0,
        "rule": "test",
        "severity": "info",
        "summary": f"Test notification for channel {channel.name}",
        "step": None,
        "state": "firing",
        "url": base_url,
    }
    run = {"id": None, "project": None, "name": None, "url": base_url}
    return Notice("firing", alert, run, "a test sent from ampwatch", test=True)


def text(notice: Notice) -> str:
    """The plain-text message, first line a headline."""
    head = "RESOLVED" if notice.status == "resolved" else ("STILL FIRING" if notice.reminder else "FIRING")
    more = f" (+{len(notice.others)} more)" if notice.others else ""
    lines = [f"[{head} · {notice.alert['severity']}] {notice.alert['summary']}{more}"]
    d = notice.details
    if notice.status == "resolved":
        lines.append(notice.reason)
    elif d.get("message"):
        lines.append(d["message"])
        if d.get("latest_message") and d["latest_message"] != d["message"]:
            lines.append(f"Latest: {d['latest_message']}")
    lines += _context_lines(d, notice.alert)
    if notice.others:
        lines.append(f"Also {'resolved' if notice.status == 'resolved' else 'firing'}:")
        lines += [f"- [{a['severity']}] {a['summary']}" for a in notice.others]
    if notice.test:
        lines.append("This is a test from ampwatch: the channel works.")
    lines.append(f"Run page: {notice.alert['url']}")
    return "\n".join(lines)


def _context_lines(d: dict[str, Any], alert: dict[str, Any]) -> list[str]:
    out = []
    if d.get("origin"):
        origin = d["origin"]
        where = "the input batch itself (a data problem)" if origin == "(input batch)" else f"`{origin}`"
        out.append(f"Origin: {where}{' in the ' + d['phase'] if d.get('phase') else ''}.")
    if d.get("scale_before") is not None:
        after = f" → {pow2(d['scale_after'])}" if d.get("scale_after") is not None else ""
        out.append(f"Loss scale: {pow2(d['scale_before'])}{after}.")
    trend = d.get("grad_norm_trend")
    if trend and trend.get("median"):
        out.append(
            f"Grad norm over the {trend.get('steps', '?')} steps before: median {trend['median']:.3g}, last "
            f"{trend['last']:.3g} ({trend['last'] / trend['median']:.1f}× the median), max {trend['max']:.3g}."
        )
    elif trend and trend.get("max") is not None:
        out.append(
            f"Grad norm over the {trend.get('steps', '?')} steps before: min {trend.get('min', 0):.3g}, "
            f"last {trend.get('last', 0):.3g}, max {trend['max']:.3g}."
        )
    if alert.get("count", 1) > 1:
        out.append(f"Seen {alert['count']} times, last at step {steps(alert.get('last_step'))}.")
    rollback = d.get("plan")
    if isinstance(rollback, dict) and rollback.get("summary"):
        out.append(f"Rollback plan: {rollback['summary']}")
        if rollback.get("url"):
            out.append(f"Plan: {rollback.get('page') or rollback['url']} (JSON: {rollback['url']})")
    return out


def webhook_body(notice: Notice) -> dict[str, Any]:
    """The generic webhook JSON: status, alert, run (PRODUCT.md), plus the text and the diagnosis details;
    `alerts` lists every alert of the run in this message (the lead `alert` first)."""
    alert = {**notice.alert, "details": notice.details}
    return {
        "status": notice.status,
        "reminder": notice.reminder,
        "test": notice.test,
        "alert": alert,
        "alerts": [alert, *notice.others],
        "run": notice.run,
        "reason": notice.reason,
        "text": text(notice),
    }


def slack_body(notice: Notice) -> dict[str, Any]:
    """A Slack incoming-webhook message: `text` for notifications, blocks for the channel."""
    first, _, rest = text(notice).partition("\n")
    blocks: list[dict[str, Any]] = [{"type": "section", "text": {"type": "mrkdwn", "text": f"*{_slack(first)}*"}}]
    if rest:
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": _slack(rest)}})
    blocks.append(
        {
            "type": "context",
            "elements": [{"type": "mrkdwn", "text": f"<{notice.alert['url']}|Open the run at the step>"}],
        }
    )
    return {"text": first, "blocks": blocks}


def _slack(value: str) -> str:
    return value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def email_message(notice: Notice, *, sender: str, recipients: list[str]) -> EmailMessage:
    """A plain-text e-mail with the headline as the subject."""
    message = EmailMessage()
    message["Subject"] = " ".join(text(notice).partition("\n")[0].split())  # (a run name may hold any line break)
    message["From"] = sender
    message["To"] = ", ".join(recipients)
    message.set_content(text(notice) + "\n")
    return message


def _iso(value: datetime | None) -> str | None:
    return utc(value).isoformat() if value is not None else None
