"""The alerting API: alert details (flips and delivery attempts), rules, channels (with a test send), silences.
The alert list itself, `GET /api/v1/alerts`, is in the read router (the documented API)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, Response
from sqlalchemy.exc import IntegrityError

from ampwatch.server import alerts, auth, models
from ampwatch.server.alerts.schemas import (
    AlertDetailOut,
    ChannelFields,
    ChannelIn,
    ChannelOut,
    RuleFields,
    RuleIn,
    RuleOut,
    SilenceIn,
    SilenceOut,
    TestResult,
)
from ampwatch.server.deps import SessionDep, SettingsDep
from ampwatch.server.schemas import MAX_INT

RowId = Annotated[int, Path(ge=1, le=MAX_INT)]  # larger ids cannot exist: 404 without a query

router = APIRouter(prefix="/api/v1", tags=["alerts"], dependencies=[auth.requires("read")])
ADMIN = [auth.requires("admin")]  # what changes rules, channels and silences


def _found(row: Any, what: str, key: int) -> Any:
    if row is None:
        raise HTTPException(404, f"no {what} with id {key}")
    return row


def _conflict(error: Exception) -> HTTPException:
    return HTTPException(409, str(error) if isinstance(error, alerts.Conflict) else "the name is taken")


@router.get("/alerts/{alert_id}", response_model=AlertDetailOut)
def get_alert(alert_id: RowId, session: SessionDep) -> AlertDetailOut:
    """One alert with its flips (state changes) and every delivery attempt with its error."""
    return _found(alerts.alert_detail(session, alert_id=alert_id), "alert", alert_id)


# -- rules --------------------------------------------------------------------------------
@router.get("/alert-rules", response_model=list[RuleOut])
def list_rules(session: SessionDep) -> list[RuleOut]:
    """Every rule: the built-in defaults, the config file's and the API's."""
    return [alerts.rule_out(r) for r in alerts.list_rules(session)]


@router.post("/alert-rules", dependencies=ADMIN, response_model=RuleOut, status_code=201)
def create_rule(body: RuleIn, session: SessionDep) -> RuleOut:
    """Add a rule (409 when the name is taken)."""
    try:
        return alerts.rule_out(alerts.save_rule(session, body=body))
    except (alerts.Conflict, IntegrityError) as error:
        raise _conflict(error) from error


@router.get("/alert-rules/{rule_id}", response_model=RuleOut)
def get_rule(rule_id: RowId, session: SessionDep) -> RuleOut:
    """One rule."""
    return alerts.rule_out(_found(session.get(models.AlertRule, rule_id), "rule", rule_id))


@router.patch("/alert-rules/{rule_id}", dependencies=ADMIN, response_model=RuleOut)
def update_rule(rule_id: RowId, body: RuleFields, session: SessionDep) -> RuleOut:
    """Change a rule, built-in ones included (e.g. `{"enabled": false}` or a new threshold)."""
    rule = _found(session.get(models.AlertRule, rule_id), "rule", rule_id)
    try:
        return alerts.rule_out(alerts.update_rule(session, rule=rule, body=body))
    except ValueError as error:
        raise HTTPException(422, str(error)) from error


@router.delete("/alert-rules/{rule_id}", dependencies=ADMIN, status_code=204)
def delete_rule(rule_id: RowId, session: SessionDep) -> Response:
    """Delete a rule; its open alerts resolve. Built-in rules can only be disabled (409)."""
    try:
        alerts.delete_rule(session, rule=_found(session.get(models.AlertRule, rule_id), "rule", rule_id))
    except alerts.Conflict as error:
        raise _conflict(error) from error
    return Response(status_code=204)


# -- channels -----------------------------------------------------------------------------
@router.get("/alert-channels", response_model=list[ChannelOut])
def list_channels(session: SessionDep) -> list[ChannelOut]:
    """Every channel, with its latest delivery (and its error); passwords are never shown."""
    return [alerts.channel_out(session, c) for c in alerts.list_channels(session)]


@router.post("/alert-channels", dependencies=ADMIN, response_model=ChannelOut, status_code=201)
def create_channel(body: ChannelIn, session: SessionDep, settings: SettingsDep) -> ChannelOut:
    """Add a webhook, Slack or e-mail channel (409 when the name is taken; 422 for a destination that
    `AMPWATCH_ALERT_URL_SCOPE` does not allow). Secrets are write-only."""
    _allowed(body, settings)
    try:
        return alerts.channel_out(session, alerts.save_channel(session, body=body))
    except (alerts.Conflict, IntegrityError) as error:
        raise _conflict(error) from error


@router.get("/alert-channels/{channel_id}", response_model=ChannelOut)
def get_channel(channel_id: RowId, session: SessionDep) -> ChannelOut:
    """One channel."""
    return alerts.channel_out(session, _found(session.get(models.AlertChannel, channel_id), "channel", channel_id))


@router.patch("/alert-channels/{channel_id}", dependencies=ADMIN, response_model=ChannelOut)
def update_channel(channel_id: RowId, body: ChannelFields, session: SessionDep, settings: SettingsDep) -> ChannelOut:
    """Change a channel; an SMTP password is kept unless a new one is given."""
    _allowed(body, settings)
    channel = _found(session.get(models.AlertChannel, channel_id), "channel", channel_id)
    try:
        return alerts.channel_out(session, alerts.update_channel(session, channel=channel, body=body))
    except ValueError as error:
        raise HTTPException(422, str(error)) from None


@router.delete("/alert-channels/{channel_id}", dependencies=ADMIN, status_code=204)
def delete_channel(channel_id: RowId, session: SessionDep) -> Response:
    """Delete a channel and its delivery history."""
    session.delete(_found(session.get(models.AlertChannel, channel_id), "channel", channel_id))
    session.commit()
    return Response(status_code=204)


@router.post("/alert-channels/{channel_id}/test", dependencies=ADMIN, response_model=TestResult)
def test_channel(channel_id: RowId, session: SessionDep, settings: SettingsDep) -> TestResult:
    """Send a test notification now and say whether it arrived (and why not)."""
    channel = _found(session.get(models.AlertChannel, channel_id), "channel", channel_id)
    delivery, _ = alerts.send_test(
        session,
        channel,
        base_url=settings.base_url,
        timeout_s=settings.alert_delivery_timeout_s,
        scope=alerts.scope_of(settings),
    )
    return TestResult(
        ok=delivery.status == "delivered",
        error=delivery.error,
        response_status=delivery.response_status,
        delivery_id=delivery.id,
    )


def _allowed(body: ChannelFields, settings: Any) -> None:
    try:
        alerts.check_destination(body, alerts.scope_of(settings))
    except alerts.TargetError as error:
        raise HTTPException(422, str(error)) from error


# -- silences -----------------------------------------------------------------------------
@router.get("/silences", response_model=list[SilenceOut])
def list_silences(session: SessionDep, active: Annotated[bool | None, Query()] = None) -> list[SilenceOut]:
    """Silences, newest first; `active=true` for those in force."""
    return [alerts.silence_out(s) for s in alerts.list_silences(session, active=active)]


@router.post("/silences", dependencies=ADMIN, response_model=SilenceOut, status_code=201)
def create_silence(body: SilenceIn, session: SessionDep) -> SilenceOut:
    """Mute notifications for a run or a project (optionally one rule) until a time."""
    return alerts.silence_out(alerts.create_silence(session, body=body))


@router.delete("/silences/{silence_id}", dependencies=ADMIN, response_model=SilenceOut)
def expire_silence(silence_id: RowId, session: SessionDep) -> SilenceOut:
    """End a silence now."""
    silence = _found(session.get(models.AlertSilence, silence_id), "silence", silence_id)
    return alerts.silence_out(alerts.expire_silence(session, silence=silence))
