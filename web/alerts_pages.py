"""The alerts pages: `/alerts` (firing and pending alerts, recent resolutions, silences) and `/alerts/rules`
(rules and channels: add, enable/disable, delete, "send test"). Plain HTML forms that redirect back
(post/redirect/get), so the pages work with JavaScript off; a refused form is shown again with what was
typed and why. `/static/alerts.js` is the run page's browser notification."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, get_args
from urllib.parse import parse_qsl, urlencode

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse
from pydantic import ValidationError

from ampwatch.server import alerts, auth, models
from ampwatch.server.alerts.schemas import Aggregation, ChannelIn, Op, RuleIn, SilenceIn, explain
from ampwatch.server.db import now
from ampwatch.server.deps import SessionDep, SettingsDep
from ampwatch.server.schemas import MAX_INT, EventType
from ampwatch.web.pages import templates

RowId = Annotated[int, PathParam(ge=1, le=MAX_INT)]  # larger ids cannot exist: 404 without a query

router = APIRouter(include_in_schema=False, dependencies=[auth.requires("read")])
ADMIN = [auth.requires("admin")]  # the forms that change rules, channels and silences
_SCRIPT = Path(str(resources.files("ampwatch.web") / "static" / "alerts.js"))


async def _form(request: Request) -> dict[str, str]:
    # Parsed here rather than with FastAPI's Form(), which needs python-multipart for plain urlencoded forms.
    try:
        return dict(parse_qsl((await request.body()).decode(errors="replace"), max_num_fields=30))
    except ValueError as error:  # more fields than any of these forms has
        raise HTTPException(422, str(error)) from error


Fields = Annotated[dict[str, str], Depends(_form)]


def _back(path: str, message: str) -> RedirectResponse:
    return RedirectResponse(f"{path}?{urlencode({'msg': message})}", status_code=303)


@router.get("/alerts", response_class=HTMLResponse)
def alerts_page(request: Request, session: SessionDep, msg: str | None = None) -> Any:
    """Open alerts (most severe first) with where their notifications went, recent resolutions, silences."""
    open_rows = alerts.alert_rows(session, active=True)
    shown = {row.alert.id for row in open_rows}  # (one that resolved between the two reads is shown once, as open)
    context = {
        "open": open_rows,
        "resolved": [row for row in alerts.alert_rows(session, active=False, limit=50) if row.alert.id not in shown],
        "silences": alerts.list_silences(session, active=True),
        "now": now(),
        "since": alerts.since,
        "msg": msg,
        "nav": "alerts",
    }
    return templates.TemplateResponse(request, "alerts.html", context)


@router.post("/alerts/silences", dependencies=ADMIN)
def silence_form(session: SessionDep, form: Fields) -> RedirectResponse:
    """Silence a run or a project for some hours."""
    try:
        hours = float(form.get("hours", "0"))
        body = SilenceIn(
            run_id=form.get("run_id") or None,
            project=form.get("project") or None,
            duration_s=hours * 3600,
            comment=form.get("comment", ""),
        )
    except (ValueError, ValidationError) as error:
        reason = error.errors()[0]["msg"] if isinstance(error, ValidationError) else "hours must be a number"
        return _back("/alerts", f"not silenced: {reason}")
    silence = alerts.create_silence(session, body=body)
    return _back("/alerts", f"silenced {body.run_id or body.project} for {hours:g} h (silence #{silence.id})")


@router.post("/alerts/silences/{silence_id}/end", dependencies=ADMIN)
def end_silence_form(silence_id: RowId, session: SessionDep) -> RedirectResponse:
    """End a silence now."""
    silence = _get(session, models.AlertSilence, silence_id)
    alerts.expire_silence(session, silence=silence)
    return _back("/alerts", f"silence #{silence_id} ended")


# -- rules and channels -------------------------------------------------------------------
# Fresh forms; a refused form comes back with what was typed (never a password) and the reason.
_BLANK: dict[str, dict[str, str]] = {
    "threshold": {"severity": "warning", "aggregation": "mean", "op": ">", "window_steps": "50"},
    "event_rate": {"severity": "warning", "event_type": "skipped_step", "op": ">=", "window_steps": "100"},
    "hook": {"kind": "webhook", "min_severity": "warning"},
    "email": {"smtp_starttls": "on", "min_severity": "warning"},
}
_RULE_FIELDS = {
    "threshold": ("series", "aggregation", "op", "threshold", "window_steps", "ignore_steps"),
    "event_rate": ("event_type", "op", "threshold", "window_steps"),
}


def _rules_page(
    request: Request,
    session: Any,
    *,
    msg: str | None = None,
    failed: str | None = None,
    typed: dict[str, str] | None = None,
    error: str | None = None,
) -> Any:
    forms = {**_BLANK, **({failed: typed or {}} if failed else {})}
    context = {
        "rules": [(r, alerts.condition(r)) for r in alerts.list_rules(session)],
        "channels": [alerts.channel_out(session, c) for c in alerts.list_channels(session)],
        "msg": msg,
        "forms": forms,
        "failed": failed,
        "error": error,
        "nav": "alerts",
        "event_types": get_args(EventType),
        "aggregations": get_args(Aggregation),
        "ops": get_args(Op),
    }
    return templates.TemplateResponse(request, "alert_rules.html", context, status_code=422 if failed else 200)


@router.get("/alerts/rules", response_class=HTMLResponse)
def rules_page(request: Request, session: SessionDep, msg: str | None = None) -> Any:
    """Rules in plain words and channels with their latest delivery, with forms to add, change and remove them."""
    return _rules_page(request, session, msg=msg)


@router.post("/alerts/rules", dependencies=ADMIN)
def add_rule_form(request: Request, session: SessionDep, form: Fields) -> Any:
    """Add a series-threshold or event-rate rule; a refused one comes back filled in, with the reason."""
    kind = form.get("kind", "")
    if kind not in _RULE_FIELDS:
        return _back("/alerts/rules", "rule not added: the page adds threshold and event_rate rules")
    wanted = ("name", "severity", "project", "for", *_RULE_FIELDS[kind])
    data: dict[str, Any] = {k: form[k].strip() for k in wanted if form.get(k, "").strip()}
    try:
        rule = alerts.save_rule(
            session, body=RuleIn.model_validate({**data, "kind": kind, "per_rank": "per_rank" in form})
        )
    except (ValidationError, alerts.Conflict) as error:
        return _rules_page(request, session, failed=kind, typed=form, error=f"Rule not added. {explain(error)}")
    return _back("/alerts/rules", f"rule {rule.name} added: {alerts.condition(rule)}")


@router.post("/alerts/rules/{rule_id}/toggle", dependencies=ADMIN)
def toggle_rule_form(rule_id: RowId, session: SessionDep) -> RedirectResponse:
    """Enable a disabled rule, disable an enabled one."""
    return _toggle(session, _get(session, models.AlertRule, rule_id), "rule")


def _toggle(session: Any, row: models.AlertRule | models.AlertChannel, what: str) -> RedirectResponse:
    row.enabled = not row.enabled
    row.updated_at = now()
    session.commit()
    return _back("/alerts/rules", f"{what} {row.name} {'enabled' if row.enabled else 'disabled'}")


@router.post("/alerts/rules/{rule_id}/delete", dependencies=ADMIN)
def delete_rule_form(rule_id: RowId, session: SessionDep) -> RedirectResponse:
    """Delete a user rule; built-in rules can only be disabled."""
    rule = _get(session, models.AlertRule, rule_id)
    try:
        alerts.delete_rule(session, rule=rule)
    except alerts.Conflict:
        return _back("/alerts/rules", f"rule {rule.name} is built in: it can be disabled, not deleted")
    return _back("/alerts/rules", f"rule {rule.name} deleted")


@router.post("/alerts/channels", dependencies=ADMIN)
def add_channel_form(request: Request, session: SessionDep, settings: SettingsDep, form: Fields) -> Any:
    """Add a webhook, Slack or e-mail channel; a refused one comes back filled in (but for the password)."""
    which = "email" if form.get("kind") == "email" else "hook"
    common = {k: form[k].strip() for k in ("name", "project", "min_severity") if form.get(k, "").strip()}
    if which == "email":
        smtp: dict[str, str | bool | None] = {
            k: form[f"smtp_{k}"].strip()
            for k in ("host", "port", "username", "from")
            if form.get(f"smtp_{k}", "").strip()
        }
        smtp |= {
            "password": form.get("smtp_password") or None,
            "starttls": "smtp_starttls" in form,
            "ssl": "smtp_ssl" in form,
        }
        data = {
            **common,
            "kind": "email",
            "to": [a for a in re.split(r"[\s,;]+", form.get("to", "")) if a],
            "smtp": smtp,
        }
    else:
        data = {**common, "kind": form.get("kind", ""), "url": form.get("url", "").strip()}
    try:
        body = ChannelIn.model_validate(data)
        alerts.check_destination(body, alerts.scope_of(settings))
        channel = alerts.save_channel(session, body=body)
    except (ValidationError, alerts.TargetError, alerts.Conflict) as error:
        typed = {k: v for k, v in form.items() if k != "smtp_password"}
        again = " (enter the password again)" if form.get("smtp_password") else ""
        return _rules_page(
            request, session, failed=which, typed=typed, error=f"Channel not added{again}. {explain(error)}"
        )
    return _back("/alerts/rules", f"channel {channel.name} added")


@router.post("/alerts/channels/{channel_id}/toggle", dependencies=ADMIN)
def toggle_channel_form(channel_id: RowId, session: SessionDep) -> RedirectResponse:
    """Disable a channel (it gets no notifications, nothing queued for it is sent), or enable it again."""
    return _toggle(session, _get(session, models.AlertChannel, channel_id), "channel")


@router.post("/alerts/channels/{channel_id}/delete", dependencies=ADMIN)
def delete_channel_form(channel_id: RowId, session: SessionDep) -> RedirectResponse:
    """Delete a channel and its delivery history."""
    channel = _get(session, models.AlertChannel, channel_id)
    name = channel.name
    session.delete(channel)
    session.commit()
    return _back("/alerts/rules", f"channel {name} deleted")


@router.post("/alerts/channels/{channel_id}/test", dependencies=ADMIN)
def test_channel_form(channel_id: RowId, session: SessionDep, settings: SettingsDep) -> RedirectResponse:
    """Send a test notification and say how it went."""
    channel = _get(session, models.AlertChannel, channel_id)
    delivery, _ = alerts.send_test(
        session,
        channel,
        base_url=settings.base_url,
        timeout_s=settings.alert_delivery_timeout_s,
        scope=alerts.scope_of(settings),
    )
    outcome = "delivered" if delivery.status == "delivered" else f"failed: {delivery.error}"
    return _back("/alerts/rules", f"test to {channel.name}: {outcome}")


def _get(session: Any, model: Any, row_id: int) -> Any:
    row = session.get(model, row_id)
    if row is None:
        raise HTTPException(404, f"no {model.__tablename__.removeprefix('alert_').rstrip('s')} with id {row_id}")
    return row


@router.get("/static/alerts.js", dependencies=[auth.requires(None)])
def alerts_script() -> FileResponse:
    """The run page's firing-alert banner and browser notification."""
    return FileResponse(_SCRIPT, media_type="text/javascript", headers={"Cache-Control": "public, max-age=3600"})
