"""Sending one notification to one channel: webhook, Slack and Alertmanager over HTTP (httpx), e-mail over SMTP.

One predicate decides temporary (retry with backoff) versus permanent (give up and say why), as
healthchecks' transports do. Errors are returned, never raised, and never contain the SMTP password."""

from __future__ import annotations

import email.utils
import logging
import smtplib
import socket
import ssl
from contextlib import nullcontext
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit

import httpx

from ampwatch import __version__
from ampwatch.server import models
from ampwatch.server.alerts._alertmanager import alertmanager_body, alertmanager_url
from ampwatch.server.alerts._messages import Notice, email_message, slack_body, webhook_body
from ampwatch.server.alerts._targets import TargetError, check_url, mask_url, resolve

KINDS = ("webhook", "slack", "email", "alertmanager")
_TEMPORARY_HTTP = {408, 425, 429}
_MAX_RETRY_AFTER_S = 3600.0


class _MaskLoggedUrls(logging.Filter):
    """httpx logs every request's URL at INFO; a webhook's token must not reach the server's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(a, httpx.URL) for a in record.args):
            record.args = tuple(mask_url(str(a)) if isinstance(a, httpx.URL) else a for a in record.args)
        return True


logging.getLogger("httpx").addFilter(_MaskLoggedUrls())


@dataclass(frozen=True)
class Outcome:
    """What one attempt achieved."""

    ok: bool
    temporary: bool = False
    status: int | None = None
    error: str | None = None
    retry_after_s: float | None = None


def send(
    channel: models.AlertChannel,
    notice: Notice,
    *,
    timeout_s: float,
    scope: str = "private",
    http: httpx.Client | None = None,
    key: str | None = None,
) -> Outcome:
    """Deliver `notice` to `channel` once, if `scope` allows its destination; `http` is a shared client (keeps
    connections, saves TLS setup); `key` goes out as the webhook's `Idempotency-Key` (the same for every attempt at
    one notification: a receiver can drop a repeat). The outcome's error never contains the channel's secrets."""
    try:
        if channel.kind == "email":
            outcome = _email(channel, notice, timeout_s, scope)
        elif channel.kind == "alertmanager":
            with httpx.Client() if http is None else nullcontext(http) as client:
                outcome = _post(client, alertmanager_url(channel.target), alertmanager_body(notice), timeout_s, scope)
        else:
            body = slack_body(notice) if channel.kind == "slack" else webhook_body(notice)
            with httpx.Client() if http is None else nullcontext(http) as client:
                outcome = _post(client, channel.target, body, timeout_s, scope, key)
    except TargetError as error:
        outcome = Outcome(False, error=f"refused: {error}")
    except Exception as error:  # a bug or a surprise in one channel must not take the dispatcher down
        outcome = Outcome(False, error=f"{type(error).__name__}: {error}")
    return replace(outcome, error=redact(outcome.error, channel)) if outcome.error else outcome


def redact(text: str, channel: models.AlertChannel) -> str:
    """`text` without the SMTP password or the parts of the channel's URL the API masks (its path segments
    and query values): an error message is shown and logged."""
    secrets = [channel.secret or ""]
    if channel.kind != "email":
        parts = urlsplit(channel.target)
        secrets += parts.path.strip("/").split("/") + [p.partition("=")[2] for p in parts.query.split("&")]
    for secret in sorted({s for s in secrets if len(s) > 1}, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def _post(http: httpx.Client, url: str, body: Any, timeout_s: float, scope: str, key: str | None = None) -> Outcome:
    target = httpx.URL(check_url(url))
    headers = {"User-Agent": f"ampwatch/{__version__}", "Host": target.netloc.decode("ascii")}
    if key is not None:
        headers["Idempotency-Key"] = key
    try:
        address = resolve(target.host, target.port or (443 if target.scheme == "https" else 80), scope)
    except OSError as error:
        return Outcome(False, temporary=True, error=f"cannot resolve {target.host}: {error}")
    # Plain HTTP goes to the address that was checked, not to whatever the name resolves to a moment later.
    # HTTPS keeps the name: the certificate check already ties the connection to it (and pooled TLS
    # connections must not be shared between names on one address).
    pinned = target.copy_with(host=address) if target.scheme == "http" else target
    try:
        reply = http.post(pinned, json=body, headers=headers, timeout=timeout_s)
    except httpx.TimeoutException:
        return Outcome(False, temporary=True, error=f"timed out after {timeout_s:g} s")
    except httpx.TransportError as error:
        return Outcome(False, temporary=True, error=f"connection failed: {type(error).__name__}: {error}")
    if reply.is_success:
        return Outcome(True, status=reply.status_code)
    temporary = reply.status_code >= 500 or reply.status_code in _TEMPORARY_HTTP
    detail = reply.text[:300].strip()
    problem = f"HTTP {reply.status_code}" + (f": {detail}" if detail else "")
    return Outcome(
        False,
        temporary=temporary,
        status=reply.status_code,
        error=problem,
        retry_after_s=retry_after(reply.headers.get("retry-after")) if temporary else None,
    )


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


class _Pinned:
    """smtplib connecting to the address that was checked (a name could resolve elsewhere the second time),
    while keeping the name for TLS certificate checks (SMTP_SSL and starttls use `_host`)."""

    address = ""
    _host: str  # (smtplib sets it in __init__; its stubs leave it out)

    def _get_socket(self, host: str, port: int, timeout: float) -> socket.socket:
        # (smtplib's _get_socket is private and untyped in the stubs; it is what the pinned class overrides)
        return super()._get_socket(self.address, port, timeout)  # type: ignore[misc]


class _PinnedSMTP(_Pinned, smtplib.SMTP):
    pass


class _PinnedSSL(_Pinned, smtplib.SMTP_SSL):
    pass


def _email(channel: models.AlertChannel, notice: Notice, timeout_s: float, scope: str) -> Outcome:
    config = channel.config or {}
    host = str(config.get("host") or "localhost")
    use_ssl, starttls = bool(config.get("ssl", False)), bool(config.get("starttls", True))
    port = int(config.get("port") or (465 if use_ssl else 587 if starttls else 25))
    try:  # checked, then connected to that very address; TLS still verifies the name (see _Pinned)
        address = resolve(host, port, scope)
    except OSError as error:
        return Outcome(False, temporary=True, error=f"cannot resolve {host}: {error}")
    recipients = [a.strip() for a in channel.target.split(",") if a.strip()]
    message = email_message(notice, sender=str(config.get("from") or f"ampwatch@{host}"), recipients=recipients)
    try:
        tls = ssl.create_default_context(cafile=config.get("ca_file") or None)  # a private CA for an internal relay
    except OSError as error:
        return Outcome(False, error=f"cannot load ca_file: {error}")
    try:
        client = _PinnedSSL(timeout=timeout_s, context=tls) if use_ssl else _PinnedSMTP(timeout=timeout_s)
        client.address, client._host = address, host  # smtplib sets _host (the name TLS checks) only in __init__
        client.connect(host, port)
        with client as smtp:
            if starttls and not use_ssl:
                smtp.starttls(context=tls)
            if config.get("username"):
                smtp.login(str(config["username"]), channel.secret or "")
            refused = smtp.send_message(message)
    except smtplib.SMTPRecipientsRefused as error:
        codes = {code for code, _ in error.recipients.values()}
        return Outcome(
            False, temporary=all(400 <= c < 500 for c in codes), error=f"all recipients refused: {sorted(codes)}"
        )
    except smtplib.SMTPResponseException as error:
        return Outcome(
            False,
            temporary=400 <= error.smtp_code < 500,
            status=error.smtp_code,
            error=f"SMTP {error.smtp_code}: {_decode(error.smtp_error)}",
        )
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
