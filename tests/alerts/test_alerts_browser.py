"""The rules page in a real headless Chromium: a rule made with its form fires on a real training run; a
channel disabled with its button gets nothing more, not even the retry that was already queued; an e-mail
channel made with its form sends through a real SMTP server and its password is never shown."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult

from ampwatch.server.demo import train

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
PASSWORD = "page-typed-secret-9"
pytestmark = pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")


def _flash(page: Any) -> str:
    return page.locator("#flash").inner_text()


def _shot(page: Any, name: str) -> None:
    """A full-page screenshot for a person to look at (test-artifacts/ is uploaded by CI, ignored by git)."""
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def test_a_rule_made_on_the_page_fires_on_a_real_training_run(alert_server, receiver, page) -> None:
    server = alert_server()
    page.goto(f"{server.url}/alerts/rules")
    form = page.locator("#add-threshold-rule")
    form.locator("[name=name]").fill("loss_seen")
    form.locator("[name=series]").fill("loss")
    form.locator("[name=aggregation]").select_option("max")
    form.locator("[name=window_steps]").fill("5")
    form.locator("[name=op]").select_option(">")
    form.locator("[name=threshold]").fill("zero")  # a mistake: the page says so and keeps the rest
    form.locator("[name=project]").fill("demo")
    form.locator("[name=severity]").select_option("critical")
    form.locator("button[type=submit]").click()
    error = page.locator("#error-threshold")
    assert "threshold: Input should be a valid number" in error.inner_text()
    form = page.locator("#add-threshold-rule")
    assert (form.locator("[name=name]").input_value(), form.locator("[name=aggregation]").input_value()) == (
        "loss_seen",
        "max",
    )
    assert (form.locator("[name=project]").input_value(), form.locator("[name=severity]").input_value()) == (
        "demo",
        "critical",
    )
    form.locator("[name=threshold]").fill("0")
    form.locator("button[type=submit]").click()
    assert _flash(page) == "rule loss_seen added: max of loss over the last 5 steps > 0 in project demo"
    assert page.locator("tr[data-rule=loss_seen]").count() == 1
    _shot(page, "alerts-rules.png")

    # A real fp16 CPU training loop with the agent attached, paced so that its batches arrive over ~2 s: one batch of
    # all 40 steps (a loaded machine's) ends in the demo's NaN steps, which no max exceeds.
    run_url = train(server.url, steps=40, step_delay_s=0.05)
    assert run_url is not None
    run_id = run_url.rsplit("/", 1)[1]
    fired = receiver.wait(1, alert__rule="loss_seen", status="firing")[0]
    assert (fired["run"]["id"], fired["alert"]["severity"]) == (run_id, "critical")
    assert "max of loss over the last 5 steps" in fired["alert"]["summary"]
    page.goto(f"{server.url}/alerts")  # open, or resolved already: the demo's loss ends all NaN, which no max exceeds
    assert page.locator("tr[data-alert-id]", has_text=fired["alert"]["summary"]).count() == 1
    _shot(page, "alerts.png")


def _nan(http: httpx.Client, run_id: str) -> int:
    http.put(f"/api/v1/runs/{run_id}", json={"project": "p", "name": run_id}).raise_for_status()
    event = {
        "step": 5,
        "type": "nonfinite_loss",
        "severity": "critical",
        "message": "NaN loss",
        "details": {"loss": "NaN"},
    }
    http.post(f"/api/v1/runs/{run_id}/batches", json={"seq": 1, "events": [event]}).raise_for_status()
    return http.get("/api/v1/alerts", params={"run_id": run_id}).json()[0]["id"]


def _deliveries(http: httpx.Client, alert_id: int) -> list[dict[str, Any]]:
    return http.get(f"/api/v1/alerts/{alert_id}").json()["flips"][0]["deliveries"]


def test_a_channel_disabled_on_the_page_gets_no_more_notifications(alert_server, receiver, page, wait_for) -> None:
    server = alert_server(alert_webhook_url="")
    page.goto(f"{server.url}/alerts/rules")
    form = page.locator("#add-channel")
    form.locator("[name=name]").fill("team")
    form.locator("[name=url]").fill(f"{receiver.url}/team")
    form.locator("button[type=submit]").click()
    assert _flash(page) == "channel team added"
    receiver.replies = [(503, {"Retry-After": "2"}, 0.0)]  # the first notification fails; its retry is due in 2 s
    with server.client() as http:
        first = _nan(http, "r1")
        receiver.wait(1, path="/team")
        page.locator("tr[data-channel=team] button", has_text="Disable").click()
        assert _flash(page) == "channel team disabled"
        assert "disabled" in page.locator("tr[data-channel=team]").inner_text()
        second = _nan(http, "r2")
        retry = wait_for(
            lambda: [d for d in _deliveries(http, first) if d["attempt"] == 2 and d["finished_at"]], what="the retry"
        )
        assert (retry[0]["status"], retry[0]["error"]) == ("failed", "not sent: the channel is disabled")
        assert _deliveries(http, second) == []  # nothing queued for a disabled channel
        time.sleep(0.5)
        assert len(receiver.bodies("/team")) == 1  # only the first attempt, before the channel was disabled

        page.locator("tr[data-channel=team] button", has_text="Enable").click()
        assert _flash(page) == "channel team enabled"
        _nan(http, "r3")
        assert receiver.wait(2, path="/team")[1]["run"]["id"] == "r3"


def test_an_email_channel_added_on_the_page_sends_through_real_smtp_and_never_shows_its_password(
    alert_server, page
) -> None:
    received: list[Any] = []

    class Inbox:
        async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802
            received.append(envelope)
            return "250 OK"

    def login(server: Any, session: Any, envelope: Any, mechanism: str, auth_data: Any) -> AuthResult:
        return AuthResult(success=(auth_data.login, auth_data.password) == (b"bot", PASSWORD.encode()), handled=False)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    smtp = Controller(
        Inbox(), hostname="127.0.0.1", port=port, authenticator=login, auth_required=True, auth_require_tls=False
    )
    smtp.start()
    try:
        server = alert_server(alert_webhook_url="")
        page.goto(f"{server.url}/alerts/rules")
        form = page.locator("#add-email-channel")
        for name, value in {
            "name": "oncall",
            "to": "oncall@example.com",
            "smtp_from": "ampwatch@example.com",
            "smtp_host": "127.0.0.1",
            "smtp_port": str(port),
            "smtp_username": "bot",
            "smtp_password": PASSWORD,
        }.items():
            form.locator(f"[name={name}]").fill(value)
        form.locator("[name=smtp_starttls]").uncheck()  # aiosmtpd here offers no TLS: loopback only
        form.locator("button[type=submit]").click()
        assert _flash(page) == "channel oncall added"
        page.locator("tr[data-channel=oncall] button", has_text="Send test").click()
        assert _flash(page) == "test to oncall: delivered"
        assert f"via 127.0.0.1:{port} as bot, password set" in page.locator("tr[data-channel=oncall]").inner_text()
        assert PASSWORD not in page.content()
    finally:
        smtp.stop()
    assert [r.rcpt_tos for r in received] == [["oncall@example.com"]] and received[
        0
    ].mail_from == "ampwatch@example.com"
