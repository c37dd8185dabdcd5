"""The alerts pages render from the database with JavaScript off, and their forms work (post/redirect/get)."""

from __future__ import annotations

import re


def test_the_alerts_page_lists_open_alerts_and_silences_a_run_from_a_form(alert_server, receiver) -> None:
    server = alert_server()
    with server.client() as http:
        http.put("/api/v1/runs/bad", json={"project": "p", "name": "bad"}).raise_for_status()
        event = {
            "step": 9,
            "type": "nonfinite_loss",
            "severity": "critical",
            "message": "NaN",
            "details": {"loss": "NaN", "origin": "blocks.3.mlp.fc2"},
        }
        http.post("/api/v1/runs/bad/batches", json={"seq": 1, "events": [event]}).raise_for_status()
        receiver.wait(1)
        page = http.get("/alerts").text
        assert 'href="/runs/bad?step=9">NaN loss in p/bad at step 9</a>' in page
        assert "origin <code>blocks.3.mlp.fc2</code>" in page and "AMPWATCH_ALERT_WEBHOOK_URL: delivered" in page
        done = http.post(
            "/alerts/silences", data={"run_id": "bad", "hours": "4", "comment": "on it"}, follow_redirects=True
        )
        assert done.status_code == 200 and "silenced bad for 4 h" in done.text
        assert re.search(r"<td>run bad</td><td>all</td>", done.text)
        assert http.get("/api/v1/silences", params={"active": "true"}).json()[0]["run_id"] == "bad"
        assert http.get("/static/alerts.js").status_code == 200


def test_the_rules_page_shows_rules_in_words_toggles_them_and_tests_a_channel(alert_server, receiver) -> None:
    server = alert_server(alert_webhook_url="")
    with server.client() as http:
        page = http.get("/alerts/rules").text
        assert "mean of skipped over the last 200 steps &gt; 0.05, from step 50" in page
        assert "a scaler_misuse event (warning or worse)" in page and "No channel yet" in page
        added = http.post(
            "/alerts/channels",
            data={"name": "team", "kind": "webhook", "url": f"{receiver.url}/team"},
            follow_redirects=True,
        )
        assert "channel team added" in added.text
        channel_id = http.get("/api/v1/alert-channels").json()[0]["id"]
        tested = http.post(f"/alerts/channels/{channel_id}/test", follow_redirects=True)
        assert "test to team: delivered" in tested.text and receiver.bodies("/team")[0]["test"] is True
        rule_id = next(r["id"] for r in http.get("/api/v1/alert-rules").json() if r["name"] == "loss_spike")
        toggled = http.post(f"/alerts/rules/{rule_id}/toggle", follow_redirects=True)
        assert "rule loss_spike disabled" in toggled.text
        assert http.get(f"/api/v1/alert-rules/{rule_id}").json()["enabled"] is False


def test_the_rules_page_adds_an_alertmanager_channel_and_tests_it(alert_server, receiver) -> None:
    server = alert_server(alert_webhook_url="")
    with server.client() as http:
        assert '<option value="alertmanager"' in http.get("/alerts/rules").text
        added = http.post(
            "/alerts/channels", data={"name": "am", "kind": "alertmanager", "url": receiver.url}, follow_redirects=True
        )
        assert "channel am added" in added.text
        channel = http.get("/api/v1/alert-channels").json()[0]
        assert channel["kind"] == "alertmanager"
        tested = http.post(f"/alerts/channels/{channel['id']}/test", follow_redirects=True)
        assert "test to am: delivered" in tested.text
        [posted] = receiver.bodies("/api/v2/alerts")  # Alertmanager's API: a list of alerts with labels
        assert isinstance(posted, list) and posted[0]["labels"]["alertname"]


def _rule(**fields: str) -> dict[str, str]:
    return {
        "kind": "threshold",
        "name": "loss_high",
        "series": "loss",
        "aggregation": "mean",
        "window_steps": "5",
        "op": ">",
        "threshold": "10",
        "for": "3 steps",
        "project": "p",
        "severity": "critical",
        **fields,
    }


def test_a_refused_rule_comes_back_filled_in_with_the_reason_and_a_good_one_is_added(alert_server) -> None:
    server = alert_server(alert_webhook_url="")
    with server.client() as http:
        bad = http.post("/alerts/rules", data=_rule(window_steps="five", threshold=""))
        assert bad.status_code == 422
        assert "Rule not added. window steps: Input should be a valid integer" in bad.text
        form = re.search(
            r'<form method="post" action="/alerts/rules" id="add-threshold-rule">.*?</form>', bad.text, re.S
        ).group(0)
        for typed in (
            'name="name" value="loss_high"',
            'name="window_steps" value="five"',
            'name="for" value="3 steps"',
            'name="project" value="p"',
            '<option value="critical" selected>',
        ):
            assert typed in form, typed
        assert "a threshold rule needs threshold" in http.post("/alerts/rules", data=_rule(threshold="")).text
        assert "is not like &#39;500 steps&#39;" in http.post("/alerts/rules", data=_rule(**{"for": "soon"})).text
        assert (
            "&#39;loss high&#39;: use letters, digits" in http.post("/alerts/rules", data=_rule(name="loss high")).text
        )
        added = http.post("/alerts/rules", data=_rule(per_rank="on"), follow_redirects=True)
        assert "rule loss_high added: mean of loss over the last 5 steps &gt; 10 for 3 steps in project p" in added.text
        again = http.post("/alerts/rules", data=_rule())
        assert again.status_code == 422 and "a rule named &#39;loss_high&#39; exists" in again.text
        rate = {
            "kind": "event_rate",
            "name": "skips",
            "event_type": "skipped_step",
            "window_steps": "100",
            "op": ">=",
            "threshold": "20",
        }
        assert "rule skips added" in http.post("/alerts/rules", data=rate, follow_redirects=True).text
        rules = {r["name"]: r for r in http.get("/api/v1/alert-rules").json()}
    made = rules["loss_high"]
    assert (made["severity"], made["for_steps"], made["per_rank"], made["project"], made["source"]) == (
        "critical",
        3,
        True,
        "p",
        "api",
    )
    assert (rules["skips"]["kind"], rules["skips"]["threshold"], rules["skips"]["project"]) == (
        "event_rate",
        20.0,
        None,
    )


def test_user_rules_can_be_deleted_from_the_page_and_built_in_ones_only_disabled(alert_server) -> None:
    server = alert_server(alert_webhook_url="")
    with server.client() as http:
        assert http.post("/alerts/rules", data=_rule()).status_code == 303
        rules = {r["name"]: r["id"] for r in http.get("/api/v1/alert-rules").json()}
        page = http.get("/alerts/rules").text
        assert f'action="/alerts/rules/{rules["loss_high"]}/delete"' in page
        assert f'action="/alerts/rules/{rules["nonfinite_loss"]}/delete"' not in page  # no button for a built-in rule
        kept = http.post(f"/alerts/rules/{rules['nonfinite_loss']}/delete", follow_redirects=True)
        assert "rule nonfinite_loss is built in: it can be disabled, not deleted" in kept.text
        gone = http.post(f"/alerts/rules/{rules['loss_high']}/delete", follow_redirects=True)
        assert "rule loss_high deleted" in gone.text
        assert {r["name"] for r in http.get("/api/v1/alert-rules").json()} == set(rules) - {"loss_high"}
        assert http.post(f"/alerts/rules/{rules['loss_high']}/delete").status_code == 404


def test_a_refused_channel_comes_back_filled_in_without_its_password(alert_server) -> None:
    server = alert_server(alert_webhook_url="")
    mail = {
        "kind": "email",
        "name": "mail",
        "to": "a@example.com, nobody",
        "smtp_host": "127.0.0.1",
        "smtp_port": "2525",
        "smtp_username": "u",
        "smtp_password": "hunter2-secret",
        "smtp_starttls": "on",
    }
    with server.client() as http:
        bad = http.post("/alerts/channels", data=mail)
        assert bad.status_code == 422
        assert (
            "Channel not added (enter the password again). to: &#39;nobody&#39;: is not an e-mail address" in bad.text
        )
        assert 'value="a@example.com, nobody"' in bad.text and 'name="smtp_port" value="2525"' in bad.text
        assert "hunter2-secret" not in bad.text
        hook = http.post(
            "/alerts/channels", data={"kind": "webhook", "name": "meta", "url": "http://169.254.169.254/latest"}
        )
        assert (
            hook.status_code == 422
            and "link-local" in hook.text
            and 'value="http://169.254.169.254/latest"' in hook.text
        )
        ftp = http.post("/alerts/channels", data={"kind": "slack", "name": "s", "url": "ftp://127.0.0.1/x"})
        assert "must start with http:// or https://" in ftp.text
        added = http.post(
            "/alerts/channels", data={**mail, "to": "a@example.com; b@example.com"}, follow_redirects=True
        )
        assert "channel mail added" in added.text and "hunter2-secret" not in added.text
        assert "as u, password set" in added.text
        [channel] = http.get("/api/v1/alert-channels").json()
    assert channel["to"] == ["a@example.com", "b@example.com"]
    assert channel["smtp"] | {"password_set": True} == channel["smtp"] and "password" not in channel["smtp"]
    assert (channel["smtp"]["port"], channel["smtp"]["starttls"], channel["smtp"]["ssl"]) == (2525, True, False)


def test_a_form_post_with_too_many_fields_is_a_422_not_a_500(alert_server) -> None:
    server = alert_server(alert_webhook_url="")
    with server.client() as http:
        crowded = http.post(
            "/alerts/rules",
            content="&".join(f"f{i}=1" for i in range(100)),
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
    assert crowded.status_code == 422 and "Max number of fields exceeded" in crowded.text


def _alert_rows(page: str) -> dict[str, list[str]]:
    """The run page's alerts table: {rule: [severity, rule, state, started, resolved, summary]} as text."""
    table = re.search(r'<section class="card run-alerts" id="run-alerts">.*?</section>', page, re.S).group(0)
    rows = re.findall(r"<tr data-alert-id=.*?</tr>", table, re.S)
    cells = [[re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td>(.*?)</td>", row, re.S)] for row in rows]
    return {c[1]: c for c in cells}


def test_the_run_page_lists_the_runs_firing_and_resolved_alerts_with_javascript_off(alert_server, receiver) -> None:
    server = alert_server()
    with server.client() as http:
        for run in ("bad", "other", "quiet"):
            http.put(f"/api/v1/runs/{run}", json={"project": "p", "name": run}).raise_for_status()
        events = [
            {"step": 9, "type": "nonfinite_loss", "severity": "critical", "message": "NaN", "details": {"loss": "NaN"}},
            {"step": 9, "type": "nonfinite_param", "severity": "critical", "message": "NaN weights"},
        ]
        # One finite parameter norm after the event clears nonfinite_param; the loss stays unknown, so its alert fires
        # on.
        batch = {"seq": 1, "events": events, "points": {"param_norm": {"steps": [10], "values": [1.0]}}}
        http.post("/api/v1/runs/bad/batches", json=batch).raise_for_status()
        spike = {"step": 3, "type": "loss_spike", "severity": "warning", "message": "spike"}
        http.post("/api/v1/runs/other/batches", json={"seq": 1, "events": [spike]}).raise_for_status()
        receiver.wait(1, status="resolved", alert__rule="nonfinite_param")
        page = http.get("/runs/bad").text
        other, quiet = http.get("/runs/other").text, http.get("/runs/quiet").text
    rows = _alert_rows(page)
    assert set(rows) == {"nonfinite_loss", "nonfinite_param"}, rows  # not the other run's loss_spike
    severity, _, state, started, resolved, summary = rows["nonfinite_loss"]
    assert (severity, state, resolved, summary) == ("critical", "firing", "–", "NaN loss in p/bad at step 9")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", started)
    assert rows["nonfinite_param"][2] == "resolved" and re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", rows["nonfinite_param"][4]
    )
    assert '<a href="#run-alerts" class="badge health-critical" id="run-firing">1 firing alert</a>' in page
    assert '<a href="/alerts" class="aside">' in page
    assert set(_alert_rows(other)) == {"loss_spike"} and 'id="run-firing"' in other
    assert (
        _alert_rows(quiet) == {}
        and "No alerts: no rule has fired for this run." in quiet
        and 'id="run-firing"' not in quiet
    )


def test_the_alerts_page_lists_the_most_severe_first(alert_server) -> None:
    server = alert_server()
    with server.client() as http:
        rule = {"name": "amp_cfg", "kind": "event", "event_type": "amp_config", "severity": "info"}
        assert http.post("/api/v1/alert-rules", json=rule).status_code == 201
        http.put("/api/v1/runs/mixed", json={"project": "p", "name": "mixed"}).raise_for_status()
        events = [
            {"step": 0, "type": "amp_config", "severity": "warning", "message": "no autocast"},
            {"step": 1, "type": "grad_spike", "severity": "warning", "message": "spike"},
            {"step": 2, "type": "nonfinite_loss", "severity": "critical", "message": "nan", "details": {"loss": "NaN"}},
        ]
        http.post("/api/v1/runs/mixed/batches", json={"seq": 1, "events": events}).raise_for_status()
        table = http.get("/alerts").text.split('id="open-alerts"')[1].split("</table>")[0]
    assert re.findall(r"sev-badge sev-(\w+)", table) == [
        "critical",
        "warning",
        "info",
    ]  # (as text: critical, info, warning)
