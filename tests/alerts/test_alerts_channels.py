"""Channels against real receivers on loopback: Slack's format, e-mail through a real SMTP server with
authentication, retries that honour Retry-After, permanent failures, the test action, and secrets kept."""

from __future__ import annotations

import email
import email.policy
import logging
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult, LoginPassword

PASSWORD = "s3cret-pw-do-not-show"
# AUTH without TLS is what a loopback test server can offer; aiosmtpd warns about it, rightly, elsewhere.
pytestmark = pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")


class Inbox:
    """An aiosmtpd handler that keeps what it receives."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802
        self.messages.append(envelope)
        return "250 OK"

    def wait(self, count: int, timeout_s: float = 20.0) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        while len(self.messages) < count:
            assert time.monotonic() < deadline, f"expected {count} e-mails, got {len(self.messages)}"
            time.sleep(0.02)
        return self.messages


def _authenticate(server: Any, session: Any, envelope: Any, mechanism: str, auth_data: Any) -> AuthResult:
    ok = isinstance(auth_data, LoginPassword) and (auth_data.login, auth_data.password) == (
        b"ampwatch",
        PASSWORD.encode(),
    )
    return AuthResult(success=ok, handled=False)  # not handled: aiosmtpd answers 535 itself


@pytest.fixture
def smtp() -> Iterator[tuple[Inbox, int]]:
    """A real SMTP server on loopback that requires AUTH (over plain text: loopback only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inbox = Inbox()
    controller = Controller(
        inbox, hostname="127.0.0.1", port=port, authenticator=_authenticate, auth_required=True, auth_require_tls=False
    )
    controller.start()
    yield inbox, port
    controller.stop()


def _nan(http: Any, run_id: str, step: int = 10, severity: str = "critical", kind: str = "nonfinite_loss") -> None:
    http.put(f"/api/v1/runs/{run_id}", json={"project": "p", "name": run_id}).raise_for_status()
    event = {
        "step": step,
        "type": kind,
        "severity": severity,
        "message": f"NaN loss at step {step}.",
        "details": {"loss": "NaN"},
    }
    http.post(f"/api/v1/runs/{run_id}/batches", json={"seq": 1, "events": [event]}).raise_for_status()


def _deliveries(http: Any, run_id: str) -> list[dict[str, Any]]:
    [alert] = http.get("/api/v1/alerts", params={"run_id": run_id}).json()
    detail = http.get(f"/api/v1/alerts/{alert['id']}").json()
    return detail["flips"][0]["deliveries"]


def test_email_goes_through_smtp_with_auth_and_the_password_is_never_shown(alert_server, smtp, caplog) -> None:
    inbox, port = smtp
    server = alert_server(alert_webhook_url="")
    caplog.set_level(logging.DEBUG)
    channel = {
        "name": "oncall-mail",
        "kind": "email",
        "to": ["oncall@example.com"],
        "smtp": {
            "host": "127.0.0.1",
            "port": port,
            "starttls": False,
            "username": "ampwatch",
            "password": PASSWORD,
            "from": "ampwatch@example.com",
        },
    }
    with server.client() as http:
        created = http.post("/api/v1/alert-channels", json=channel)
        assert created.status_code == 201, created.text
        assert created.json()["smtp"]["password_set"] is True
        test = http.post(f"/api/v1/alert-channels/{created.json()['id']}/test").json()
        assert test["ok"] is True, test
        _nan(http, "mailed")
        [_, alert_mail] = inbox.wait(2)
        listing = http.get("/api/v1/alert-channels").text
    assert alert_mail.rcpt_tos == ["oncall@example.com"]
    message = email.message_from_bytes(alert_mail.content, policy=email.policy.default)
    assert message["Subject"] == "[FIRING · critical] NaN loss in p/mailed at step 10"
    with server.client() as http:  # a run name with a line break e-mail headers refuse (every e-mail for it failed)
        http.put("/api/v1/runs/formfeed", json={"project": "p", "name": "form\x0cfeed"}).raise_for_status()
        event = {
            "step": 3,
            "type": "nonfinite_loss",
            "severity": "critical",
            "message": "NaN",
            "details": {"loss": "NaN"},
        }
        http.post("/api/v1/runs/formfeed/batches", json={"seq": 1, "events": [event]}).raise_for_status()
        [*_, fed] = inbox.wait(3)
    assert (
        email.message_from_bytes(fed.content, policy=email.policy.default)["Subject"]
        == "[FIRING · critical] NaN loss in p/form feed at step 3"
    )
    assert f"{server.url}/runs/mailed?step=10" in message.get_content()
    assert (
        "test from ampwatch"
        in email.message_from_bytes(inbox.messages[0].content, policy=email.policy.default).get_content()
    )
    assert PASSWORD not in listing and PASSWORD not in caplog.text


def test_wrong_smtp_credentials_are_a_permanent_failure_with_the_servers_answer(alert_server, smtp) -> None:
    _, port = smtp
    server = alert_server(alert_webhook_url="")
    channel = {
        "name": "bad-mail",
        "kind": "email",
        "to": ["a@example.com"],
        "smtp": {"host": "127.0.0.1", "port": port, "starttls": False, "username": "ampwatch", "password": "wrong"},
    }
    with server.client() as http:
        channel_id = http.post("/api/v1/alert-channels", json=channel).json()["id"]
        test = http.post(f"/api/v1/alert-channels/{channel_id}/test").json()
        shown = http.get(f"/api/v1/alert-channels/{channel_id}").json()
    assert test["ok"] is False and test["error"].startswith("SMTP 535")
    assert shown["last_delivery"]["status"] == "failed" and shown["last_delivery"]["error"].startswith("SMTP 535")


def test_slack_gets_its_incoming_webhook_format_and_the_token_is_masked(alert_server, receiver) -> None:
    server = alert_server(alert_webhook_url="")
    with server.client() as http:
        made = http.post(
            "/api/v1/alert-channels",
            json={"name": "slack", "kind": "slack", "url": f"{receiver.url}/slack/T0/B0/token123"},
        )
        assert made.json()["url"] == f"{receiver.url}/***"  # the path may be the secret (Telegram, ntfy)
        _nan(http, "slacked")
    [body] = receiver.wait(1, path="/slack/T0/B0/token123")
    assert body["text"] == "[FIRING · critical] NaN loss in p/slacked at step 10"
    assert [b["type"] for b in body["blocks"]] == ["section", "section", "context"]
    assert f"<{server.url}/runs/slacked?step=10|" in body["blocks"][-1]["elements"][0]["text"]


def test_a_503_is_retried_after_retry_after_and_each_attempt_is_recorded(alert_server, receiver) -> None:
    server = alert_server()
    receiver.replies = [(503, {"Retry-After": "1"}, 0.0)]
    with server.client() as http:
        _nan(http, "flaky")
        receiver.wait(2)
        first, second = receiver.received[:2]
        assert second.at - first.at >= 0.9  # Retry-After: 1 was honoured
        deliveries = _wait_final(http, "flaky", 2)
    assert [(d["attempt"], d["status"], d["response_status"]) for d in deliveries] == [
        (1, "retried", 503),
        (2, "delivered", 200),
    ]
    assert deliveries[0]["error"].startswith("HTTP 503")
    keys = [r.headers.get("Idempotency-Key") for r in receiver.received[:2]]  # a receiver can drop a repeat
    assert keys[0] and keys[0] == keys[1], keys


def test_a_4xx_is_permanent_and_an_unreachable_channel_is_retried(alert_server, receiver) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nobody listens here once the socket is closed
    server = alert_server(alert_webhook_url=f"http://127.0.0.1:{closed}/hook")
    receiver.replies = [(404, {}, 0.0)]
    with server.client() as http:
        http.post("/api/v1/alert-channels", json={"name": "gone", "kind": "webhook", "url": f"{receiver.url}/gone"})
        _nan(http, "unlucky")
        deliveries = _wait_final(http, "unlucky", 2)
    by_channel = {d["channel"]: d for d in deliveries}
    assert (by_channel["gone"]["status"], by_channel["gone"]["error"]) == ("failed", "HTTP 404: ok")
    unreachable = by_channel["AMPWATCH_ALERT_WEBHOOK_URL"]
    assert unreachable["status"] == "retried" and unreachable["error"].startswith("connection failed")
    assert len(receiver.bodies("/gone")) == 1


def _wait_final(http: Any, run_id: str, count: int, timeout_s: float = 20.0) -> list[dict[str, Any]]:
    """The alert's first deliveries once `count` attempts have an outcome."""
    deadline = time.monotonic() + timeout_s
    while True:
        deliveries = _deliveries(http, run_id)
        done = [d for d in deliveries if d["finished_at"] is not None]
        if len(done) >= count:
            return done
        assert time.monotonic() < deadline, deliveries
        time.sleep(0.05)


@pytest.fixture
def tls_smtp(tmp_path) -> Iterator[tuple[Inbox, int, str]]:
    """A real SMTP server that requires STARTTLS before AUTH, with a self-signed certificate (made by openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inbox = Inbox()
    controller = Controller(
        inbox,
        hostname="127.0.0.1",
        port=port,
        authenticator=_authenticate,
        auth_required=True,
        tls_context=context,
        require_starttls=True,
    )
    controller.start()
    yield inbox, port, str(cert)
    controller.stop()


def test_starttls_verifies_the_servers_certificate_against_the_given_ca(alert_server, tls_smtp) -> None:
    inbox, port, cert = tls_smtp
    server = alert_server(alert_webhook_url="")
    smtp = {"host": "127.0.0.1", "port": port, "starttls": True, "username": "ampwatch", "password": PASSWORD}
    with server.client() as http:
        trusted = http.post(
            "/api/v1/alert-channels",
            json={"name": "tls", "kind": "email", "to": ["a@example.com"], "smtp": {**smtp, "ca_file": cert}},
        ).json()
        untrusted = http.post(
            "/api/v1/alert-channels",
            json={"name": "tls-unknown-ca", "kind": "email", "to": ["a@example.com"], "smtp": smtp},
        ).json()
        ok = http.post(f"/api/v1/alert-channels/{trusted['id']}/test").json()
        refused = http.post(f"/api/v1/alert-channels/{untrusted['id']}/test").json()
    assert ok["ok"] is True, ok
    assert len(inbox.wait(1)) == 1
    assert refused["ok"] is False and "CERTIFICATE_VERIFY_FAILED" in refused["error"]


def test_a_retried_firing_notice_never_arrives_after_the_resolved_one(alert_server, receiver) -> None:
    server = alert_server()
    receiver.replies = [(503, {"Retry-After": "3"}, 0.0)]  # the firing notice's first attempt fails
    with server.client() as http:
        _nan(http, "recovers", step=1)
        receiver.wait(1)
        # the run recovers before the retry is due: the alert resolves, and its notice goes out at once
        http.post(
            "/api/v1/runs/recovers/batches",
            json={"seq": 2, "points": {"loss": {"steps": list(range(2, 14)), "values": [1.0] * 12}}},
        )
        receiver.wait(2)
        deliveries = _wait_final(http, "recovers", 2)  # the first attempt, and the retry's outcome
    assert [b["status"] for b in receiver.bodies()] == ["firing", "resolved"]  # (the retry said "firing" last)
    retry = [d for d in deliveries if d["attempt"] == 2]
    assert retry and retry[0]["status"] == "superseded", deliveries


def test_an_alert_that_resolves_before_its_firing_notice_went_out_is_told_firing_then_resolved(
    alert_server, receiver
) -> None:
    # The firing notice waits out group_wait; the run recovers within it. A receiver that only ever saw the
    # resolve (Alertmanager drops it; a pager never rang) would never learn of the NaN.
    server = alert_server(alert_group_wait_s=1.5)
    with server.client() as http:
        _nan(http, "brief", step=1)
        http.post(
            "/api/v1/runs/brief/batches",
            json={"seq": 2, "points": {"loss": {"steps": list(range(2, 14)), "values": [1.0] * 12}}},
        ).raise_for_status()
        deadline = time.monotonic() + 20
        while http.get("/api/v1/alerts", params={"run_id": "brief"}).json()[0]["state"] != "resolved":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert receiver.bodies() == []  # it resolved while its firing notice still waited
        receiver.wait(2)
        deliveries = _wait_final(http, "brief", 1)
    assert [b["status"] for b in receiver.bodies()] == ["firing", "resolved"]
    assert [d["status"] for d in deliveries] == ["delivered"], deliveries


def test_a_notification_is_retried_for_a_day_then_given_up(alert_server, receiver) -> None:
    # It gave up after 8 attempts: ~2 minutes of a receiver's downtime lost the NaN alert for good.
    from ampwatch.server import models
    from ampwatch.server.alerts import _deliver
    from ampwatch.server.alerts._channels import Outcome

    server = alert_server()
    receiver.replies = [(200, {}, 0.0)]
    with server.client() as http:
        _nan(http, "down")
        _wait_final(http, "down", 1)
    sessions = server.app.state.sessions
    with sessions() as session:
        first = session.query(models.AlertDelivery).one()
        flip = session.get(models.AlertFlip, first.flip_id)
        failing = Outcome(False, status=503, error="HTTP 503", temporary=True)
        for hours, attempt in ((1.0, 9), (23.9, 150), (24.1, 151)):
            row = models.AlertDelivery(
                flip_id=flip.id,
                channel_id=first.channel_id,
                attempt=attempt,
                status="sending",
                due_at=flip.created_at,
                created_at=flip.created_at,
                claimed_at=flip.created_at,
            )
            session.add(row)
            session.commit()
            _deliver.record(session, row.id, failing, stamp=_deliver.utc(flip.created_at) + timedelta(hours=hours))
            session.commit()
            assert row.status == ("retried" if hours < 24 else "failed"), (hours, row.status, row.error)
    assert "gave up after 151 attempts over 24 h" in row.error


def test_an_alert_names_infinite_gradients_as_such(alert_server, receiver) -> None:
    server = alert_server()
    with server.client() as http:
        http.put("/api/v1/runs/inf", json={"project": "p", "name": "inf"}).raise_for_status()
        event = {
            "step": 20,
            "type": "nonfinite_grad",
            "severity": "critical",
            "message": "Inf gradients at step 20.",
            "details": {"grad_norm": "Infinity", "loss": 1.5},
        }
        http.post("/api/v1/runs/inf/batches", json={"seq": 1, "events": [event]}).raise_for_status()
        [body] = receiver.wait(1)
    assert body["alert"]["summary"] == "Inf gradients in p/inf at step 20"  # (was "NaN gradients", whatever the value)


def test_patching_a_channel_keeps_what_it_does_not_name_and_refuses_another_kinds_settings(alert_server, smtp) -> None:
    inbox, port = smtp
    server = alert_server(alert_webhook_url="")
    mail = {
        "name": "mail",
        "kind": "email",
        "to": ["oncall@example.com"],
        "smtp": {
            "host": "127.0.0.1",
            "port": port + 1,
            "starttls": False,
            "username": "ampwatch",
            "password": PASSWORD,
            "from": "ampwatch@example.com",
        },
    }
    with server.client() as http:
        hook = http.post(
            "/api/v1/alert-channels", json={"name": "hook", "kind": "webhook", "url": "http://127.0.0.1:9/h"}
        ).json()
        email_id = http.post("/api/v1/alert-channels", json=mail).json()["id"]
        # (the URL of a webhook was replaced by an address, an e-mail channel's recipients by a URL: both 200)
        for channel_id, body in ((hook["id"], {"to": ["a@example.com"]}), (email_id, {"url": "http://127.0.0.1:9/h"})):
            reply = http.patch(f"/api/v1/alert-channels/{channel_id}", json=body)
            assert reply.status_code == 422 and "channel has no" in reply.text, reply.text
        # a partial SMTP change turned STARTTLS back on and dropped the login and the sender
        patched = http.patch(f"/api/v1/alert-channels/{email_id}", json={"smtp": {"host": "127.0.0.1", "port": port}})
        assert patched.status_code == 200, patched.text
        assert http.post(f"/api/v1/alert-channels/{email_id}/test").json()["ok"] is True
        [sent] = inbox.wait(1)
        listed = {c["name"]: c for c in http.get("/api/v1/alert-channels").json()}
    assert sent.mail_from == "ampwatch@example.com"
    smtp_out = listed["mail"]["smtp"]
    assert (smtp_out["port"], smtp_out["starttls"], smtp_out["username"], smtp_out["password_set"]) == (
        port,
        False,
        "ampwatch",
        True,
    )
    assert listed["hook"]["url"].startswith("http://127.0.0.1:9")


def test_an_alert_that_fired_during_a_silence_is_notified_when_the_silence_ends(alert_server, receiver) -> None:
    server = alert_server()
    with server.client() as http:
        http.put("/api/v1/runs/hushed", json={"project": "p", "name": "hushed"}).raise_for_status()
        assert (
            http.post(
                "/api/v1/silences", json={"run_id": "hushed", "duration_s": 1.5, "comment": "node restart"}
            ).status_code
            == 201
        )
        _nan(http, "hushed", step=1)
        time.sleep(0.5)
        assert receiver.bodies() == []  # silenced
        for seq in range(2, 6):  # the run goes on (NaN still), past the silence's end
            http.post(
                "/api/v1/runs/hushed/batches",
                json={"seq": seq, "points": {"loss": {"steps": [seq], "values": ["NaN"]}}},
            )
            time.sleep(0.5)
        [body] = receiver.wait(1, timeout_s=5)  # (it waited for the 4 h reminder, or forever)
        [alert] = http.get("/api/v1/alerts", params={"run_id": "hushed"}).json()
        flips = http.get(f"/api/v1/alerts/{alert['id']}").json()["flips"]
    assert body["status"] == "firing" and body["alert"]["rule"] == alert["rule"]
    assert [f["reason"] for f in flips][-1] == "no longer silenced or inhibited: still firing" and flips[0][
        "suppressed"
    ]
