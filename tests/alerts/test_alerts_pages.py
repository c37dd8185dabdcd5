"""The alerts pages render from the database with JavaScript off, and their forms work (post/redirect/get)."""

from __future__ import annotations

import re


def test_the_alerts_page_lists_open_alerts_and_silences_a_run_from_a_form(alert_server, receiver) -> None:  # type: ignore[no-untyped-def]
    server = alert_server()
    with server.client() as http:
        http.put("/api/v1/runs/bad", json={"project": "p", "name": "bad"}).raise_for_status()
        event = {"step": 9, "type": "nonfinite_loss", "severity": "critical", "message": "NaN", "details": {"loss": "NaN", "origin": "blocks.3.mlp.fc2"}}
        http.post("/api/v1/runs/bad/batches", json={"seq": 1, "events": [event]}).raise_for_status()
        receiver.wait(1)
        page = http.get("/alerts").text
        assert 'href="/runs/bad?step=9">NaN loss in p/bad at step 9</a>' in page
        assert "origin <code>blocks.3.mlp.fc2</code>" in page and "AMPWATCH_ALERT_WEBHOOK_URL: delivered" in page
        done = http.post("/alerts/silences", data={"run_id": "bad", "hours": "4", "comment": "on it"}, follow_redirects=True)
        assert done.status_code == 200 and "silenced bad for 4 h" in done.text
        assert re.search(r"<td>run bad</td><td>all</td>", done.text)
        assert http.get("/api/v1/silences", params={"active": "true"}).json()[0]["run_id"] == "bad"
        assert http.get("/static/alerts.js").status_code == 200


def test_the_rules_page_shows_rules_in_words_toggles_them_and_tests_a_channel(alert_server, receiver) -> None:  # type: ignore[no-untyped-def]
    server = alert_server(alert_webhook_url="")
    with server.client() as http:
        page = http.get("/alerts/rules").text
        assert "mean of skipped over the last 200 steps &gt; 0.05, from step 50" in page
        assert "a scaler_misuse event (warning or worse)" in page and "No channel yet" in page
        added = http.post("/alerts/channels", data={"name": "team", "kind": "webhook", "url": f"{receiver.url}/team"}, follow_redirects=True)
        assert "channel team added" in added.text
        channel_id = http.get("/api/v1/alert-channels").json()[0]["id"]
        tested = http.post(f"/alerts/channels/{channel_id}/test", follow_redirects=True)
        assert "test to team: delivered" in tested.text and receiver.bodies("/team")[0]["test"] is True
        rule_id = next(r["id"] for r in http.get("/api/v1/alert-rules").json() if r["name"] == "loss_spike")
        toggled = http.post(f"/alerts/rules/{rule_id}/toggle", follow_redirects=True)
        assert "rule loss_spike disabled" in toggled.text
        assert http.get(f"/api/v1/alert-rules/{rule_id}").json()["enabled"] is False
