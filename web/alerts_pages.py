"""The alerts pages: `/alerts` (firing and pending alerts, recent resolutions, silences) and `/alerts/rules`
(rules and channels, with enable/disable, a "send test" button and a form for a new channel). Plain HTML
forms that redirect back (post/redirect/get), so the pages work with JavaScript off; `/static/alerts.js`
is the run page's browser notification."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlencode

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse
from pydantic import ValidationError

from ampwatch.server import models
from ampwatch.server.alerts import _admin, _board
from ampwatch.server.alerts._db import now
from ampwatch.server.alerts._deliver import send_test
from ampwatch.server.alerts.schemas import ChannelIn, SilenceIn
from ampwatch.server.deps import SessionDep, SettingsDep
from ampwatch.server.schemas import MAX_INT
from ampwatch.web.pages import templates

RowId = Annotated[int, PathParam(ge=1, le=MAX_INT)]  # larger ids cannot exist: 404 without a query

router = APIRouter(include_in_schema=False)
_SCRIPT = Path(str(resources.files("ampwatch.web") / "static" / "alerts.js"))


async def _form(request: Request) -> dict[str, str]:
    # Parsed here rather than with FastAPI's Form(), which needs python-multipart for plain urlencoded forms.
    return dict(parse_qsl((await request.body()).decode(errors="replace"), max_num_fields=20))


Fields = Annotated[dict[str, str], Depends(_form)]


def _back(path: str, message: str) -> RedirectResponse:
    return RedirectResponse(f"{path}?{urlencode({'msg': message})}", status_code=303)


@router.get("/alerts", response_class=HTMLResponse)
def alerts_page(request: Request, session: SessionDep, msg: str | None = None) -> Any:
    """Open alerts (most severe first) with where their notifications went, recent resolutions, silences."""
    context = {
        "open": _board.alert_rows(session, active=True), "resolved": _board.alert_rows(session, active=False, limit=50),
        "silences": _admin.list_silences(session, active=True), "now": now(), "since": _board.since, "msg": msg,
    }  # fmt: skip
    return templates.TemplateResponse(request, "alerts.html", context)


@router.post("/alerts/silences")
def silence_form(session: SessionDep, form: Fields) -> RedirectResponse:
    """Silence a run or a project for some hours."""
    try:
        hours = float(form.get("hours", "0"))
        body = SilenceIn(run_id=form.get("run_id") or None, project=form.get("project") or None,
                         duration_s=hours * 3600, comment=form.get("comment", ""))  # fmt: skip
    except (ValueError, ValidationError) as error:
        reason = error.errors()[0]["msg"] if isinstance(error, ValidationError) else "hours must be a number"
        return _back("/alerts", f"not silenced: {reason}")
    silence = _admin.create_silence(session, body=body)
    return _back("/alerts", f"silenced {body.run_id or body.project} for {hours:g} h (silence #{silence.id})")


@router.post("/alerts/silences/{silence_id}/end")
def end_silence_form(silence_id: RowId, session: SessionDep) -> RedirectResponse:
    """End a silence now."""
    silence = session.get(models.AlertSilence, silence_id)
    if silence is None:
        raise HTTPException(404, f"no silence with id {silence_id}")
    _admin.expire_silence(session, silence=silence)
    return _back("/alerts", f"silence #{silence_id} ended")


@router.get("/alerts/rules", response_class=HTMLResponse)
def rules_page(request: Request, session: SessionDep, msg: str | None = None) -> Any:
    """Rules in plain words and channels with their latest delivery."""
    rules = [(r, _board.condition(r)) for r in _admin.list_rules(session)]
    channels = [_admin.channel_out(session, c) for c in _admin.list_channels(session)]
    return templates.TemplateResponse(request, "alert_rules.html", {"rules": rules, "channels": channels, "msg": msg})


@router.post("/alerts/rules/{rule_id}/toggle")
def toggle_rule_form(rule_id: RowId, session: SessionDep) -> RedirectResponse:
    """Enable a disabled rule, disable an enabled one."""
    rule = session.get(models.AlertRule, rule_id)
    if rule is None:
        raise HTTPException(404, f"no rule with id {rule_id}")
    rule.enabled = not rule.enabled
    rule.updated_at = now()
    session.commit()
    return _back("/alerts/rules", f"rule {rule.name} {'enabled' if rule.enabled else 'disabled'}")


@router.post("/alerts/channels")
def add_channel_form(session: SessionDep, form: Fields) -> RedirectResponse:
    """Add a webhook or Slack channel (e-mail channels need SMTP settings: use the API or the config file)."""
    name = form.get("name", "")
    if form.get("kind") not in ("webhook", "slack"):
        return _back("/alerts/rules", "channel not added: the page adds webhook and slack channels")
    try:
        _admin.save_channel(session, body=ChannelIn.model_validate(
            {"name": name, "kind": form["kind"], "url": form.get("url"), "min_severity": form.get("min_severity", "warning")}))  # fmt: skip
    except ValidationError as error:
        return _back("/alerts/rules", f"channel not added: {error.errors()[0]['msg']}")
    except _admin.Conflict as error:
        return _back("/alerts/rules", f"channel not added: {error}")
    return _back("/alerts/rules", f"channel {name} added")


@router.post("/alerts/channels/{channel_id}/test")
def test_channel_form(channel_id: RowId, session: SessionDep, settings: SettingsDep) -> RedirectResponse:
    """Send a test notification and say how it went."""
    channel = session.get(models.AlertChannel, channel_id)
    if channel is None:
        raise HTTPException(404, f"no channel with id {channel_id}")
    delivery, _ = send_test(session, channel, base_url=settings.base_url, timeout_s=settings.alert_delivery_timeout_s)
    outcome = "delivered" if delivery.status == "delivered" else f"failed: {delivery.error}"
    return _back("/alerts/rules", f"test to {channel.name}: {outcome}")


@router.get("/static/alerts.js")
def alerts_script() -> FileResponse:
    """The run page's firing-alert banner and browser notification."""
    return FileResponse(_SCRIPT, media_type="text/javascript", headers={"Cache-Control": "public, max-age=3600"})
