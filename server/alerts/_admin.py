"""Data functions behind the alerting API and the config file: rules, channels, silences, alert details."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal, cast
from urllib.parse import urlsplit

from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.server import models
from ampwatch.server.alerts._db import now, utc
from ampwatch.server.alerts._rules import DEFAULTS
from ampwatch.server.alerts._targets import check_host, mask_url
from ampwatch.server.alerts.schemas import (
    AlertDetailOut,
    ChannelFields,
    ChannelIn,
    ChannelOut,
    DeliveryOut,
    FlipOut,
    RuleFields,
    RuleIn,
    RuleOut,
    SilenceIn,
    SilenceOut,
)

ENV_CHANNEL = "AMPWATCH_ALERT_WEBHOOK_URL"


class Conflict(ValueError):
    """The change is not allowed as asked (a name taken, a built-in rule deleted)."""


# -- rules --------------------------------------------------------------------------------
def list_rules(session: Session) -> list[models.AlertRule]:
    """Every rule, built-ins first."""
    return list(session.scalars(select(models.AlertRule).order_by(models.AlertRule.id)))


def save_rule(session: Session, *, body: RuleIn, source: str = "api") -> models.AlertRule:
    """Create the rule, or (for the config file) replace the one of that name."""
    rule = session.scalar(select(models.AlertRule).where(models.AlertRule.name == body.name))
    if rule is not None and source == "api":
        raise Conflict(f"a rule named {body.name!r} exists")
    values = {
        **DEFAULTS,
        "aggregation": "mean" if body.kind == "threshold" else None,
        "window_steps": 1 if body.kind == "threshold" else None,
        **body.values(),
        "source": source,
    }
    stamp = now()
    if rule is None:
        rule = models.AlertRule(created_at=stamp, **values)
        session.add(rule)
    for key, value in values.items():
        setattr(rule, key, value)
    rule.updated_at = stamp
    session.commit()
    return rule


def update_rule(session: Session, *, rule: models.AlertRule, body: RuleFields) -> models.AlertRule:
    """Change some fields of a rule; the result must still be a complete rule."""
    columns = models.AlertRule.__table__.c
    nulls = [k for k, v in body.values().items() if v is None and k in columns and not columns[k].nullable]
    if nulls:
        raise ValueError(f"{', '.join(sorted(nulls))} cannot be null")
    merged = {c: getattr(rule, c) for c in RuleIn.model_fields if hasattr(rule, c) and c != "for_"} | body.values()
    RuleIn.model_validate({k: v for k, v in merged.items() if v is not None})
    for key, value in body.values().items():
        setattr(rule, key, value)
    rule.updated_at = now()
    session.commit()
    return rule


def delete_rule(session: Session, *, rule: models.AlertRule) -> None:
    """Delete a rule (its alerts stay, detached); built-in rules can only be disabled."""
    if rule.source == "builtin":
        raise Conflict(f"{rule.name} is built in: disable it with PATCH {{'enabled': false}} instead")
    session.delete(rule)
    session.commit()


def rule_out(rule: models.AlertRule) -> RuleOut:
    """A rule as the API shows it."""
    return RuleOut.model_validate({c: getattr(rule, c) for c in RuleOut.model_fields})


# -- channels -----------------------------------------------------------------------------
def list_channels(session: Session) -> list[models.AlertChannel]:
    """Every channel."""
    return list(session.scalars(select(models.AlertChannel).order_by(models.AlertChannel.id)))


def save_channel(session: Session, *, body: ChannelIn, source: str = "api") -> models.AlertChannel:
    """Create the channel, or (config file, environment) replace the one of that name."""
    channel = session.scalar(select(models.AlertChannel).where(models.AlertChannel.name == body.name))
    if channel is not None and source == "api":
        raise Conflict(f"a channel named {body.name!r} exists")
    stamp = now()
    if channel is None:
        channel = models.AlertChannel(
            name=body.name, created_at=stamp, config={}, secret=None, project=None, min_severity="warning", enabled=True
        )
        session.add(channel)
    channel.kind, channel.source = body.kind, source
    _apply_channel(channel, body)
    session.commit()
    return channel


def check_destination(body: ChannelFields, scope: str) -> None:
    """Refuse (`TargetError`) a URL or SMTP host that `scope` rules out without a DNS lookup; names are
    checked again, resolved, at every send."""
    if body.url is not None:
        check_host(urlsplit(body.url).hostname or "", scope)
    if body.smtp is not None:
        check_host(body.smtp.host, scope)


def update_channel(session: Session, *, channel: models.AlertChannel, body: ChannelFields) -> models.AlertChannel:
    """Change some settings of a channel: the SMTP settings given replace those stored, the others (the password
    too) are kept. ValueError for a setting of another kind of channel (an address for a webhook, say)."""
    wrong = ["url"] if channel.kind == "email" else ["to", "smtp"]
    if given := [name for name in wrong if getattr(body, name) is not None]:
        raise ValueError(f"a {channel.kind} channel has no `{given[0]}`")
    _apply_channel(channel, body, merge=True)
    session.commit()
    return channel


def _apply_channel(channel: models.AlertChannel, body: ChannelFields, merge: bool = False) -> None:
    fields = body.model_fields_set
    if body.url is not None:
        channel.target = body.url
    if body.to is not None:
        channel.target = ",".join(body.to)
    if body.smtp is not None:
        given = body.smtp.model_fields_set if merge else set(type(body.smtp).model_fields)
        smtp = {"from" if name == "sender" else name: getattr(body.smtp, name) for name in given - {"password"}}
        channel.config = {**(channel.config or {}), **smtp} if merge else smtp
        if body.smtp.password is not None:
            channel.secret = body.smtp.password.get_secret_value()
    for name in ("project", "min_severity", "enabled"):
        if name in fields and (getattr(body, name) is not None or name == "project"):
            setattr(channel, name, getattr(body, name))
    channel.updated_at = now()


def channel_out(session: Session, channel: models.AlertChannel) -> ChannelOut:
    """A channel as the API shows it: no password, secrets in URLs masked, with its latest delivery."""
    D = models.AlertDelivery
    last = session.scalars(
        select(D).where(D.channel_id == channel.id, D.finished_at.is_not(None)).order_by(D.id.desc()).limit(1)
    ).first()
    smtp = None
    if channel.kind == "email":
        smtp = {k: v for k, v in (channel.config or {}).items() if k != "password"} | {
            "password_set": bool(channel.secret)
        }
    return ChannelOut(
        id=channel.id,
        name=channel.name,
        kind=channel.kind,
        project=channel.project,
        min_severity=channel.min_severity,
        url=mask_url(channel.target) if channel.kind != "email" else None,
        to=channel.target.split(",") if channel.kind == "email" else None,
        smtp=smtp,
        enabled=channel.enabled,
        source=channel.source,
        last_delivery={
            "status": last.status,
            "error": last.error,
            "response_status": last.response_status,
            "at": utc(last.finished_at),
        }
        if last and last.finished_at
        else None,
    )


def configure_env_webhook(session: Session, url: str) -> None:
    """`AMPWATCH_ALERT_WEBHOOK_URL` as a webhook channel with no other configuration; unset removes it."""
    existing = session.scalar(select(models.AlertChannel).where(models.AlertChannel.name == ENV_CHANNEL))
    if url:
        save_channel(session, body=ChannelIn(name=ENV_CHANNEL, kind="webhook", url=url), source="env")
    elif existing is not None and existing.source == "env":
        session.delete(existing)
        session.commit()


# -- silences -----------------------------------------------------------------------------
def create_silence(session: Session, *, body: SilenceIn) -> models.AlertSilence:
    """Mute matching notifications from now until the end."""
    stamp = now()
    ends = body.ends_at if body.ends_at is not None else stamp + timedelta(seconds=body.duration_s or 0)
    silence = models.AlertSilence(
        project=body.project,
        run_id=body.run_id,
        rule=body.rule,
        starts_at=stamp,
        ends_at=utc(ends),
        comment=body.comment,
        created_at=stamp,
    )
    session.add(silence)
    session.commit()
    return silence


def list_silences(session: Session, *, active: bool | None = None) -> list[models.AlertSilence]:
    """Silences, newest first; `active` filters by whether they are in force now."""
    S = models.AlertSilence
    query = select(S).order_by(S.id.desc())
    if active is not None:
        query = query.where(S.ends_at > now()) if active else query.where(S.ends_at <= now())
    return list(session.scalars(query))


def silence_out(silence: models.AlertSilence) -> SilenceOut:
    """A silence as the API shows it."""
    values: dict[str, Any] = {c: getattr(silence, c) for c in SilenceOut.model_fields if c != "active"}
    values["starts_at"], values["ends_at"] = utc(silence.starts_at), utc(silence.ends_at)
    return SilenceOut(**values, active=utc(silence.starts_at) <= now() < utc(silence.ends_at))


# -- alert details ------------------------------------------------------------------------
def alert_detail(session: Session, *, alert_id: int) -> AlertDetailOut | None:
    """An alert with every flip and every delivery attempt (and its error)."""
    alert = session.get(models.Alert, alert_id)
    if alert is None:
        return None
    F, D, C = models.AlertFlip, models.AlertDelivery, models.AlertChannel
    flips = list(session.scalars(select(F).where(F.alert_id == alert_id).order_by(F.id)))
    rows = session.execute(
        select(D, C.name).join(C, C.id == D.channel_id).where(D.flip_id.in_([f.id for f in flips])).order_by(D.id)
    ).all()
    by_flip: dict[int, list[DeliveryOut]] = {}
    for d, channel in rows:
        by_flip.setdefault(cast(int, d.flip_id), []).append(
            DeliveryOut(
                id=d.id,
                channel=channel,
                attempt=d.attempt,
                status=d.status,
                due_at=utc(d.due_at),
                finished_at=utc(d.finished_at) if d.finished_at else None,
                response_status=d.response_status,
                error=d.error,
            )
        )
    return AlertDetailOut(
        id=alert.id,
        run_id=alert.run_id,
        rule=alert.rule,
        severity=alert.severity,
        state=cast(Literal["pending", "firing", "resolved"], alert.state),
        started_at=utc(alert.started_at),
        resolved_at=utc(alert.resolved_at) if alert.resolved_at else None,
        summary=alert.summary,
        rank=None if alert.rank < 0 else alert.rank,
        step=alert.step,
        last_step=alert.last_step,
        count=alert.count,
        fired_at=utc(alert.fired_at) if alert.fired_at else None,
        details=alert.details,
        flips=[
            FlipOut(
                id=f.id,
                created_at=utc(f.created_at),
                old_state=f.old_state,
                new_state=f.new_state,
                step=f.step,
                reason=f.reason,
                suppressed=f.suppressed,
                deliveries=by_flip.get(f.id, []),
            )
            for f in flips
        ],
    )


def expire_silence(session: Session, *, silence: models.AlertSilence) -> models.AlertSilence:
    """End a silence now (kept for the record)."""
    stamp = now()
    if utc(silence.ends_at) > stamp:
        silence.ends_at = stamp
        session.commit()
    return silence
