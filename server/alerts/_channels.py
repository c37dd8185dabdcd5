"""Sending one notification to one channel: webhook and Slack over HTTP (httpx), e-mail over SMTP (smtplib).

One predicate decides temporary (retry with backoff) versus permanent (give up and say why), as
healthchecks' transports do. Errors are returned, never raised, and never contain the SMTP password."""

from __future__ import annotations

import email.utils
import smtplib
import ssl
from dataclasses import dataclass
from datetime import datetime, timezone

import httpx

from ampwatch import __version__
from ampwatch.server import models
from ampwatch.server.alerts._messages import Notice, email_message, slack_body, webhook_body

KINDS = ("webhook", "slack", "email")
_TEMPORARY_HTTP = {408, 425, 429}
_MAX_RETRY_AFTER_S = 3600.0


@dataclass(frozen=True)
class Outcome:
    """What one attempt achieved."""

    ok: bool
    temporary: bool = False
    status: int | None = None
    error: str | None = None
    retry_after_s: float | None = None


def send(channel: models.AlertChannel, notice: Notice, *, timeout_s: float, http: httpx.Client | None = None) -> Outcome:
    """Deliver `notice` to `channel` once; `http` is a shared client (keeps connections, saves TLS setup)."""
    try:
        if channel.kind == "email":
            return _email(channel, notice, timeout_s)
        body = slack_body(notice) if channel.kind == "slack" else webhook_body(notice)
        if http is None:
            with httpx.Client() as client:
                return _post(client, channel.target, body, timeout_s)
        return _post(http, channel.target, body, timeout_s)
    except Exception as error:  # a bug or a surprise in one channel must not take the dispatcher down
        return Outcome(False, error=f"{type(error).__name__}: {error}")


def _post(http: httpx.Client, url: str, body: dict, timeout_s: float) -> Outcome:
    headers = {"User-Agent": f"ampwatch/{__version__}"}
    try:
        reply = http.post(url, json=body, headers=headers, timeout=timeout_s)
    except httpx.TimeoutException:
        return Outcome(False, temporary=True, error=f"timed out after {timeout_s:g} s")
    except httpx.TransportError as error:
        return Outcome(False, temporary=True, error=f"connection failed: {type(error).__name__}: {error}")
    if reply.is_success:
        return Outcome(True, status=reply.status_code)
    temporary = reply.status_code >= 500 or reply.status_code in _TEMPORARY_HTTP
    detail = reply.text[:300].strip()
    problem = f"HTTP {reply.status_code}" + (f": {detail}" if detail else "")
    return Outcome(False, temporary=temporary, status=reply.status_code, error=problem,
                   retry_after_s=retry_after(reply.headers.get("retry-after")) if temporary else None)  # fmt: skip


def retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), capped at an hour."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), _MAX_RETRY_AFTER_S)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return min(max(0.0, (when - datetime.now(timezone.utc)).total_seconds()), _MAX_RETRY_AFTER_S)


def _email(channel: models.AlertChannel, notice: Notice, timeout_s: float) -> Outcome:
    config = channel.config or {}
    host = str(config.get("host") or "localhost")
    use_ssl, starttls = bool(config.get("ssl", False)), bool(config.get("starttls", True))
    port = int(config.get("port") or (465 if use_ssl else 587 if starttls else 25))
    recipients = [a.strip() for a in channel.target.split(",") if a.strip()]
    message = email_message(notice, sender=str(config.get("from") or f"ampwatch@{host}"), recipients=recipients)
    try:
        tls = ssl.create_default_context(cafile=config.get("ca_file") or None)  # a private CA for an internal relay
    except OSError as error:
        return Outcome(False, error=f"cannot load ca_file: {error}")
    try:
        client = smtplib.SMTP_SSL(host, port, timeout=timeout_s, context=tls) if use_ssl \
            else smtplib.SMTP(host, port, timeout=timeout_s)  # fmt: skip
        with client as smtp:
            if starttls and not use_ssl:
                smtp.starttls(context=tls)
            if config.get("username"):
                smtp.login(str(config["username"]), channel.secret or "")
            refused = smtp.send_message(message)
    except smtplib.SMTPRecipientsRefused as error:
        codes = {code for code, _ in error.recipients.values()}
        return Outcome(False, temporary=all(400 <= c < 500 for c in codes), error=f"all recipients refused: {sorted(codes)}")
    except smtplib.SMTPResponseException as error:
        return Outcome(False, temporary=400 <= error.smtp_code < 500, status=error.smtp_code,
                       error=f"SMTP {error.smtp_code}: {_decode(error.smtp_error)}")  # fmt: skip
    except smtplib.SMTPServerDisconnected as error:
        return Outcome(False, temporary=True, error=f"{type(error).__name__}: {error}")
    except (ssl.SSLError, smtplib.SMTPException) as error:  # a certificate or a server without STARTTLS: fix the config
        return Outcome(False, error=f"{type(error).__name__}: {error}")
    except OSError as error:  # refused, unreachable, timed out, DNS: may work later
        return Outcome(False, temporary=True, error=f"{type(error).__name__}: {error}")
    if refused:
        return Outcome(True, error=f"some recipients refused: {', '.join(sorted(refused))}")
    return Outcome(True, status=250)


def _decode(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
