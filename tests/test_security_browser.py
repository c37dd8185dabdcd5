"""Real Chromium, with the pages' Content-Security-Policy enforced: signing in, every page working under
its CSP, and a form on another site that cannot change anything (CSRF)."""

from __future__ import annotations

import http.server
import threading
import time
from typing import Any

import httpx
import pytest

from ampwatch.server import auth
from ampwatch.server.demo import train


def _watched_page(browser: Any) -> tuple[Any, list[str]]:
    page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()  # the CSP is enforced
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(f"page error: {error}"))
    page.on(
        "console", lambda msg: msg.type == "error" and errors.append(f"console: {msg.text}")
    )  # CSP violations land here
    return page, errors


def test_sign_in_then_every_page_works_under_its_csp(
    browser: Any, sqlite_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_server.app.state.tokens, "refresh_s", 0.05)  # (the new tokens count at once)
    with sqlite_server.app.state.sessions() as session:
        admin = auth.create_token(session, name="browser", role="admin")
        monkeypatch.setenv("AMPWATCH_TOKEN", auth.create_token(session, name="agent", role="ingest"))
    time.sleep(0.2)
    run_id = train(sqlite_server.url, steps=60).rsplit("/", 1)[1]

    page, errors = _watched_page(browser)
    page.goto(f"{sqlite_server.url}/runs/{run_id}")
    assert "/login?next=" in page.url
    page.fill("input[name=token]", admin)
    page.click("button[type=submit]")
    page.wait_for_url(f"**/runs/{run_id}")
    for chart in ("chart-loss", "chart-scale", "chart-grad_norm", "chart-layers"):
        page.wait_for_selector(f"#{chart} .main-svg", timeout=15_000)  # Plotly drew it without eval or inline scripts
    assert page.locator("#chart-loss .point, #chart-loss path.js-line").count() > 0
    for path in ("/", "/alerts", "/alerts/rules", f"/compare?run={run_id}&series=loss"):
        page.goto(sqlite_server.url + path)
        page.wait_for_load_state("networkidle")
        assert page.locator("header.topbar").count() == 1, path
    page.click("form.signout button")
    page.wait_for_url("**/login")
    page.goto(f"{sqlite_server.url}/alerts")
    assert "/login?next=%2Falerts" in page.url  # signed out for real
    assert not errors, errors


class _Attacker(http.server.BaseHTTPRequestHandler):
    """Another site: its page posts a form to the ampwatch server as soon as it loads."""

    target = ""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = f"""<!doctype html><form id="f" method="post" action="{self.target}/alerts/silences">
            <input name="project" value="victim"><input name="hours" value="9999"></form>
            <script>document.getElementById("f").submit()</script>""".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_form_on_another_site_cannot_change_anything(browser: Any, sqlite_server) -> None:
    _Attacker.target = sqlite_server.url
    attacker = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Attacker)
    threading.Thread(target=attacker.serve_forever, daemon=True).start()
    try:
        page, _ = _watched_page(browser)
        reply = None
        with page.expect_response(lambda r: r.url.endswith("/alerts/silences")) as posted:
            page.goto(f"http://localhost:{attacker.server_address[1]}/")  # another site than 127.0.0.1
        reply = posted.value
        assert reply.status == 403
        assert httpx.get(f"{sqlite_server.url}/api/v1/silences").json() == []

        # The same form on ampwatch's own page goes through.
        page.goto(f"{sqlite_server.url}/alerts")
        page.fill("#silence-project input[name=project]", "mine")
        page.click("#silence-project button[type=submit]")
        page.wait_for_url("**/alerts?msg=*")
        assert [s["project"] for s in httpx.get(f"{sqlite_server.url}/api/v1/silences").json()] == ["mine"]
    finally:
        attacker.shutdown()
