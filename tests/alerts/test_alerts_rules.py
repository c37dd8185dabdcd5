"""Rules and lifecycle through the HTTP API, fed with agent-shaped batches: built-in defaults, user rules
with `for` and `keep_firing_for`, reminders, inhibition, silences, and the config file."""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from ampwatch.server import Settings, create_app
from ampwatch.server.alerts import ConfigError

BUILTINS = {
    "nonfinite_loss",
    "nonfinite_param",
    "nonfinite_grad",
    "scale_collapse",
    "scaler_misuse",
    "run_crashed",
    "skip_rate",
    "grad_spike",
    "loss_spike",
    "run_stalled",
    "ranks_desync",
}


class Feed:
    """Registers runs and sends numbered batches, as the agent would."""

    def __init__(self, http: Any) -> None:
        self.http, self.seq = http, 0

    def run(self, run_id: str, project: str = "p") -> str:
        self.http.put(f"/api/v1/runs/{run_id}", json={"project": project, "name": run_id}).raise_for_status()
        return run_id

    def send(
        self, run_id: str, *, events: list[tuple[str, str, int]] = (), rank: int = 0, **series: tuple[range, float]
    ) -> None:
        self.seq += 1
        points = {
            name: {"steps": list(steps), "values": [value] * len(steps)} for name, (steps, value) in series.items()
        }
        body = {
            "seq": self.seq,
            "rank": rank,
            "points": points,
            "events": [{"step": s, "type": t, "severity": sev, "message": f"{t} at {s}"} for t, sev, s in events],
        }
        self.http.post(f"/api/v1/runs/{run_id}/batches", json=body).raise_for_status()

    def alerts(self, run_id: str) -> dict[str, dict[str, Any]]:
        # Pending first: an alert that starts firing between the two requests is then in the second list, not in
        # neither.
        listed = [
            *self.http.get("/api/v1/alerts", params={"run_id": run_id, "state": "pending"}).json(),
            *self.http.get("/api/v1/alerts", params={"run_id": run_id}).json(),
        ]  # firing and resolved (docs/alerts.md)
        return {
            a["rule"]: self.http.get(f"/api/v1/alerts/{a['id']}").json() for a in {a["id"]: a for a in listed}.values()
        }


@pytest.fixture
def feed(alert_server) -> Any:
    server = alert_server()
    with server.client() as http:
        yield Feed(http)


def test_builtin_rules_work_with_zero_configuration_and_can_be_disabled_but_not_deleted(feed) -> None:
    rules = {r["name"]: r for r in feed.http.get("/api/v1/alert-rules").json()}
    assert BUILTINS <= set(rules) and {rules[n]["source"] for n in BUILTINS} == {"builtin"}
    assert (rules["nonfinite_loss"]["severity"], rules["run_stalled"]["severity"]) == ("critical", "warning")
    assert feed.http.delete(f"/api/v1/alert-rules/{rules['grad_spike']['id']}").status_code == 409
    off = feed.http.patch(f"/api/v1/alert-rules/{rules['grad_spike']['id']}", json={"enabled": False})
    assert off.status_code == 200 and off.json()["enabled"] is False
    feed.send(feed.run("r"), events=[("grad_spike", "warning", 5), ("loss_spike", "warning", 5)])
    assert set(feed.alerts("r")) == {"loss_spike"}


def test_a_threshold_rule_goes_pending_then_fires_after_for_steps_and_resolves_after_keep_firing_for(
    feed, receiver, wait_for
) -> None:
    rule = {
        "name": "loss_high",
        "kind": "threshold",
        "series": "loss",
        "aggregation": "mean",
        "window_steps": 5,
        "op": ">",
        "threshold": 10,
        "for": "20 steps",
        "keep_firing_for_s": 0.5,
        "project": "p",
    }
    assert feed.http.post("/api/v1/alert-rules", json=rule).status_code == 201
    assert feed.http.post("/api/v1/alert-rules", json=rule).status_code == 409
    run, other = feed.run("hot"), feed.run("hot-elsewhere", project="q")
    feed.send(run, loss=(range(0, 10), 50.0))
    feed.send(other, loss=(range(0, 40), 50.0))  # another project: the rule does not watch it
    wait_for(lambda: feed.alerts(run).get("loss_high", {}).get("state") == "pending", what="a pending alert")
    feed.send(run, loss=(range(10, 30), 50.0))
    [firing] = receiver.wait(1, alert__rule="loss_high")
    assert "mean of loss over the last 5 steps is 50 (threshold > 10)" in firing["text"]
    cleared_at = time.monotonic()
    feed.send(run, loss=(range(30, 40), 1.0))
    [resolved] = receiver.wait(1, status="resolved", alert__rule="loss_high")
    assert time.monotonic() - cleared_at >= 0.5  # keep_firing_for
    assert "no longer > 10" in resolved["reason"]
    flips = [(f["old_state"], f["new_state"]) for f in feed.alerts(run)["loss_high"]["flips"]]
    assert flips == [(None, "pending"), ("pending", "firing"), ("firing", "resolved")]
    assert feed.alerts(other) == {}


def _by_rank(feed: Feed, run_id: str, rule: str) -> dict[int | None, dict[str, Any]]:
    listed = [a for a in feed.http.get("/api/v1/alerts", params={"run_id": run_id}).json() if a["rule"] == rule]
    details = [feed.http.get(f"/api/v1/alerts/{a['id']}").json() for a in listed]
    return {d["rank"]: d for d in details}


def test_a_threshold_rule_watches_every_rank_of_a_two_rank_run(feed, receiver, wait_for) -> None:
    common = {
        "kind": "threshold",
        "series": "loss",
        "aggregation": "max",
        "window_steps": 5,
        "op": ">",
        "threshold": 10,
    }
    feed.http.post("/api/v1/alert-rules", json={"name": "loss_any_rank", **common}).raise_for_status()
    feed.http.post("/api/v1/alert-rules", json={"name": "loss_per_rank", "per_rank": True, **common}).raise_for_status()
    run = feed.run("ddp")
    feed.send(run, rank=0, loss=(range(0, 10), 1.0))
    feed.send(run, rank=1, loss=(range(0, 10), 50.0))  # only rank 1 goes bad
    wait_for(
        lambda: _by_rank(feed, run, "loss_per_rank").keys() == {1} and _by_rank(feed, run, "loss_any_rank"),
        what="alerts",
    )
    [any_rank] = _by_rank(feed, run, "loss_any_rank").values()
    assert any_rank["rank"] is None and "in p/ddp (rank 1) at step 9" in any_rank["summary"], any_rank
    feed.send(run, rank=0, loss=(range(10, 20), 60.0))  # now rank 0 as well: its own alert
    wait_for(lambda: _by_rank(feed, run, "loss_per_rank").keys() == {0, 1}, what="an alert for rank 0")
    feed.send(run, rank=1, loss=(range(10, 20), 1.0))  # rank 1 recovers: only its alert resolves
    wait_for(lambda: _by_rank(feed, run, "loss_per_rank")[1]["state"] == "resolved", what="rank 1 resolved")
    per_rank = _by_rank(feed, run, "loss_per_rank")
    assert per_rank[0]["state"] == "firing" and "(rank 0)" in per_rank[0]["summary"]
    assert _by_rank(feed, run, "loss_any_rank")[None]["state"] == "firing"  # rank 0 still breaks it
    feed.send(run, rank=0, loss=(range(20, 30), 1.0))
    wait_for(
        lambda: _by_rank(feed, run, "loss_any_rank")[None]["state"] == "resolved", what="the any-rank alert resolved"
    )
    wait_for(lambda: _by_rank(feed, run, "loss_per_rank")[0]["state"] == "resolved", what="rank 0 resolved")
    sent = sorted((status, rule) for status, _, rule in receiver.notified(6))
    assert sent == [
        ("firing", "loss_any_rank"),
        ("firing", "loss_per_rank"),
        ("firing", "loss_per_rank"),
        ("resolved", "loss_any_rank"),
        ("resolved", "loss_per_rank"),
        ("resolved", "loss_per_rank"),
    ], sent


@pytest.mark.parametrize(("change", "status"), [("delete", "finished"), ("disable", "crashed")])
def test_deleting_or_disabling_a_rule_resolves_its_alert_on_a_run_that_already_ended(
    feed, receiver, wait_for, change, status
) -> None:
    # (only running runs were evaluated again: the alert of a finished or crashed run stayed firing for good)
    rule = {"name": "val_high", "kind": "threshold", "series": "val", "aggregation": "last", "op": ">", "threshold": 5}
    rule_id = feed.http.post("/api/v1/alert-rules", json=rule).json()["id"]
    run = feed.run("ended")
    feed.send(run, val=(range(0, 3), 9.0))
    receiver.wait(1, alert__rule="val_high")
    feed.http.post(f"/api/v1/runs/{run}/batches", json={"seq": 99, "status": status}).raise_for_status()
    wait_for(lambda: feed.http.get(f"/api/v1/runs/{run}").json()["status"] == status, what=f"the run {status}")
    time.sleep(1.0)  # ten evaluation passes: the run's last data has been evaluated, so nothing new wakes it
    if change == "delete":
        assert feed.http.delete(f"/api/v1/alert-rules/{rule_id}").status_code == 204
    else:
        feed.http.patch(f"/api/v1/alert-rules/{rule_id}", json={"enabled": False}).raise_for_status()
    [resolved] = receiver.wait(1, status="resolved", alert__rule="val_high")
    assert resolved["reason"] == "The rule was disabled or deleted."
    assert feed.alerts(run)["val_high"]["state"] == "resolved"


def test_a_firing_alert_sends_reminders_every_repeat_interval(feed, receiver) -> None:
    rule_id = next(r["id"] for r in feed.http.get("/api/v1/alert-rules").json() if r["name"] == "nonfinite_param")
    feed.http.patch(f"/api/v1/alert-rules/{rule_id}", json={"repeat_interval_s": 0.5}).raise_for_status()
    feed.send(feed.run("nag"), events=[("nonfinite_param", "critical", 3)])
    first, reminder = receiver.wait(2, alert__rule="nonfinite_param")[:2]
    assert (first["reminder"], reminder["reminder"], reminder["status"]) == (False, True, "firing")
    assert reminder["text"].startswith("[STILL FIRING · critical] Non-finite parameters in p/nag at step 3")


def test_a_firing_scale_collapse_inhibits_the_lesser_alerts_of_its_run(feed, receiver) -> None:
    run = feed.run("collapsing")
    feed.send(run, events=[("grad_spike", "warning", 12), ("scale_collapse", "critical", 12)])
    feed.send(feed.run("spiky"), events=[("grad_spike", "warning", 12)])
    alerts = feed.alerts(run)
    assert alerts["grad_spike"]["flips"][0]["suppressed"].startswith("inhibited by the firing scale_collapse alert")
    assert alerts["grad_spike"]["flips"][0]["deliveries"] == []
    receiver.wait(2)
    assert sorted((b["run"]["id"], b["alert"]["rule"]) for b in receiver.bodies()) == [
        ("collapsing", "scale_collapse"),
        ("spiky", "grad_spike"),
    ]


def test_a_silence_mutes_its_run_until_it_ends(feed, receiver) -> None:
    quiet, loud = feed.run("quiet"), feed.run("loud")
    made = feed.http.post("/api/v1/silences", json={"run_id": quiet, "duration_s": 3600, "comment": "known bad data"})
    assert made.status_code == 201 and made.json()["active"] is True
    feed.send(quiet, events=[("nonfinite_loss", "critical", 7)])
    feed.send(loud, events=[("nonfinite_loss", "critical", 7)])
    assert feed.alerts(quiet)["nonfinite_loss"]["flips"][0]["suppressed"].startswith(
        f"silenced by silence #{made.json()['id']}"
    )
    assert feed.http.delete(f"/api/v1/silences/{made.json()['id']}").json()["active"] is False
    feed.send(quiet, events=[("loss_spike", "warning", 8)])  # the silence ended: the run is heard again, and its
    receiver.wait(3)  # alert that is still firing is told once, now that nothing holds it back (as Alertmanager does)
    assert sorted((b["run"]["id"], b["alert"]["rule"]) for b in receiver.bodies()) == [
        ("loud", "nonfinite_loss"),
        ("quiet", "loss_spike"),
        ("quiet", "nonfinite_loss"),
    ]
    [late] = receiver.bodies(run__id="quiet", alert__rule="nonfinite_loss")
    assert late["reason"] == "no longer silenced or inhibited: still firing"


def test_rules_and_channels_from_the_config_file_and_the_env_webhook(alert_server, receiver, tmp_path) -> None:
    path = tmp_path / "alerts.yaml"
    path.write_text(f"""
rules:
  - {{name: spiky, kind: event_rate, event_type: grad_spike, window_steps: 100, op: ">=", threshold: 3,
      severity: critical}}
channels:
  - {{name: team, kind: webhook, url: "{receiver.url}/team", min_severity: critical}}
""")
    server = alert_server(alert_rules_file=str(path))
    with server.client() as http:
        rules = {r["name"]: r for r in http.get("/api/v1/alert-rules").json()}
        assert rules["spiky"]["source"] == "file"
        channels = {c["name"]: c for c in http.get("/api/v1/alert-channels").json()}
        assert channels["AMPWATCH_ALERT_WEBHOOK_URL"]["source"] == "env" and channels["team"]["source"] == "file"
        feed = Feed(http)
        feed.send(
            feed.run("bursty"),
            events=[("grad_spike", "warning", s) for s in (100, 120, 150)],
            loss=(range(0, 160), 1.0),
        )
    [team] = receiver.wait(1, path="/team")
    assert team["alert"]["rule"] == "spiky" and "grad_spike events in the last 100 steps is 3" in team["text"]
    server.stop()
    again = alert_server(alert_webhook_url="")  # the same database, without the environment variable
    with again.client() as http:
        assert "AMPWATCH_ALERT_WEBHOOK_URL" not in {c["name"] for c in http.get("/api/v1/alert-channels").json()}


def test_a_broken_config_file_stops_the_server_from_starting_with_the_reason(tmp_path, sqlite_url) -> None:
    path = tmp_path / "alerts.json"
    path.write_text(json.dumps({"rules": [{"name": "x", "kind": "threshold", "series": "loss"}]}))
    with pytest.raises(ConfigError, match="a threshold rule needs op, threshold"):
        create_app(Settings(database_url=sqlite_url, alert_rules_file=str(path)))


def test_alerts_of_one_run_firing_within_group_wait_go_out_as_one_message(alert_server, receiver) -> None:
    server = alert_server(alert_group_wait_s=3.0)  # (long enough for the third send to join on a loaded machine)
    with server.client() as http:
        feed = Feed(http)
        burst, other = feed.run("burst"), feed.run("other")
        started = time.monotonic()
        feed.send(burst, events=[("loss_spike", "warning", 5), ("nonfinite_loss", "critical", 5)])
        feed.send(other, events=[("nonfinite_loss", "critical", 5)])
        time.sleep(0.3)
        feed.send(burst, events=[("nonfinite_param", "critical", 6)])  # within the group's wait: joins its message
        receiver.wait(2)
        assert time.monotonic() - started >= 3.0  # the group waited
        time.sleep(0.5)
    by_run = {b["run"]["id"]: b for b in receiver.bodies()}
    assert len(receiver.bodies()) == 2 and set(by_run) == {"burst", "other"}
    grouped = by_run["burst"]
    assert [a["rule"] for a in grouped["alerts"]] == ["nonfinite_param", "nonfinite_loss", "loss_spike"]
    # The most severe leads (the webhook's `alert`), and of those the one with a rollback plan: the NaN parameters
    assert grouped["alert"]["rule"] == "nonfinite_param" and "plan" in grouped["alert"]["details"]
    assert grouped["text"].startswith("[FIRING · critical] Non-finite parameters in p/burst at step 6 (+2 more)")
    assert (
        "Also firing:\n- [critical] Non-finite loss in p/burst at step 5\n- [warning] Loss spike in p/burst at step 5"
        in grouped["text"]
    )
    assert [a["rule"] for a in by_run["other"]["alerts"]] == ["nonfinite_loss"]


def test_a_rule_with_for_in_seconds_stays_pending_until_that_time_has_passed_then_fires(
    feed, receiver, wait_for
) -> None:
    rule = {
        "name": "loss_high",
        "kind": "threshold",
        "series": "loss",
        "aggregation": "mean",
        "window_steps": 5,
        "op": ">",
        "threshold": 10,
        "for": "2s",
    }
    feed.http.post("/api/v1/alert-rules", json=rule).raise_for_status()
    run = feed.run("slow-burn")
    feed.send(run, loss=(range(0, 10), 50.0))
    wait_for(lambda: feed.alerts(run).get("loss_high", {}).get("state") == "pending", what="a pending alert")
    feed.send(run, loss=(range(10, 500), 50.0))  # many more steps: a `for` in seconds does not count them
    assert feed.alerts(run)["loss_high"]["state"] == "pending" and receiver.bodies(alert__rule="loss_high") == []
    [firing] = receiver.wait(1, alert__rule="loss_high")
    alert = feed.alerts(run)["loss_high"]
    held_s = (datetime.fromisoformat(alert["fired_at"]) - datetime.fromisoformat(alert["started_at"])).total_seconds()
    assert held_s >= 2 and firing["status"] == "firing"
    assert [(f["old_state"], f["new_state"], f["reason"]) for f in alert["flips"]][1:] == [
        ("pending", "firing", "held for 2 s")
    ]


def test_a_run_crashed_alert_inhibits_a_lesser_alert_of_its_run_that_fires_after_it(
    alert_server, receiver, wait_for
) -> None:
    server = alert_server(heartbeat_timeout_s=1.0)
    rule = {
        "name": "loss_high",
        "kind": "threshold",
        "series": "loss",
        "aggregation": "mean",
        "window_steps": 5,
        "op": ">",
        "threshold": 10,
        "for": "4s",
    }
    with server.client() as http:
        feed = Feed(http)
        http.post("/api/v1/alert-rules", json=rule).raise_for_status()
        dead = feed.run("dead")
        feed.send(dead, loss=(range(0, 10), 50.0))  # then silence: no heartbeat, no finish()
        [crashed] = receiver.wait(1, alert__rule="run_crashed")  # about 1 s later, while loss_high is still pending
        assert feed.alerts(dead)["loss_high"]["state"] == "pending"
        alert = wait_for(
            lambda: (a := feed.alerts(dead)["loss_high"])["state"] == "firing" and a, what="loss_high firing"
        )
    [_, fired] = alert["flips"]
    assert fired["suppressed"].startswith(f"inhibited by the firing run_crashed alert #{crashed['alert']['id']}")
    assert fired["deliveries"] == []
    assert [b["alert"]["rule"] for b in receiver.bodies()] == ["run_crashed"]


def test_a_project_silence_mutes_the_runs_of_that_project_only(feed, receiver) -> None:
    muted, elsewhere = feed.run("muted", project="noisy"), feed.run("elsewhere", project="calm")
    made = feed.http.post(
        "/api/v1/silences", json={"project": "noisy", "duration_s": 3600, "comment": "sweep in progress"}
    )
    assert made.status_code == 201 and (made.json()["project"], made.json()["run_id"]) == ("noisy", None)
    feed.send(muted, events=[("nonfinite_loss", "critical", 7)])
    feed.send(elsewhere, events=[("nonfinite_loss", "critical", 7)])
    flip = feed.alerts(muted)["nonfinite_loss"]["flips"][0]
    assert flip["suppressed"].startswith(f"silenced by silence #{made.json()['id']}") and flip["deliveries"] == []
    feed.http.delete(f"/api/v1/silences/{made.json()['id']}").raise_for_status()
    feed.send(muted, events=[("loss_spike", "warning", 8)])  # the silence ended: the project is heard again, and
    receiver.wait(
        3
    )  # its alert that is still firing is told once, now that nothing holds it back (as Alertmanager does)
    assert sorted((b["run"]["id"], b["alert"]["rule"]) for b in receiver.bodies()) == [
        ("elsewhere", "nonfinite_loss"),
        ("muted", "loss_spike"),
        ("muted", "nonfinite_loss"),
    ]
    [late] = receiver.bodies(run__id="muted", alert__rule="nonfinite_loss")
    assert late["reason"] == "no longer silenced or inhibited: still firing"


def test_a_scale_collapse_that_clears_sends_where_the_skips_stopped_and_the_scale_now(feed, receiver) -> None:
    run = feed.run("collapse")
    feed.send(run, skipped=(range(0, 13), 1.0), events=[("scale_collapse", "critical", 12)])  # every step skipped
    feed.send(run, scale=(range(0, 13), 2.0**4))
    [firing] = receiver.wait(1, alert__rule="scale_collapse")
    assert firing["text"].startswith("[FIRING · critical] Loss-scale collapse in p/collapse at step 12")
    feed.send(run, skipped=(range(13, 40), 0.0), scale=(range(13, 40), 2.0**13))  # the skips stop; the scale recovered
    [resolved] = receiver.wait(1, status="resolved", alert__rule="scale_collapse")
    said = "Skips stopped at step 13; scale back to 2^13."
    assert resolved["alert"]["id"] == firing["alert"]["id"] and resolved["reason"] == said
    assert resolved["text"].startswith(f"[RESOLVED · critical] Loss-scale collapse in p/collapse at step 12\n{said}\n")


def test_the_documented_rules_file_example_loads(alert_server, tmp_path) -> None:
    # (the docs once named fields the server refuses: a rules file written from them stopped the server)
    page = (Path(__file__).resolve().parents[2] / "docs" / "alerts.md").read_text()
    example = re.search(r"```yaml\n(rules:.+?)```", page, re.S)
    assert example, "docs/alerts.md shows a rules file"
    path = tmp_path / "alerts.yaml"
    path.write_text(example.group(1))
    server = alert_server(alert_rules_file=str(path), alert_url_scope="public")
    with server.client() as http:
        rules = {r["name"]: r for r in http.get("/api/v1/alert-rules").json()}
        channels = {c["name"] for c in http.get("/api/v1/alert-channels").json()}
    assert (rules["loss_high"]["keep_firing_for_s"], rules["loss_high"]["repeat_interval_s"]) == (60, 3600)
    assert rules["many_spikes"]["source"] == "file" and {"oncall", "mail"} <= channels


def test_a_misuse_that_recurs_unseen_is_not_cleared_by_quiet_steps_only_by_the_run_s_end(feed, receiver) -> None:
    def misuse(run: str, cause: str, step: int) -> None:
        feed.seq += 1
        event = {
            "step": step,
            "type": "scaler_misuse",
            "severity": "warning",
            "message": cause,
            "details": {"cause": cause},
        }
        feed.http.post(
            f"/api/v1/runs/{run}/batches", json={"seq": feed.seq, "rank": 0, "points": {}, "events": [event]}
        ).raise_for_status()

    lasting, passing = feed.run("clips-scaled"), feed.run("raised-once")
    misuse(lasting, "clip_before_unscale", 3)  # said once, though every step after repeats it
    misuse(passing, "gradients_missing", 3)  # GradScaler raised: the loop may have gone on without the mistake
    receiver.wait(2, alert__rule="scaler_misuse")
    for run in (lasting, passing):
        feed.send(run, loss=(range(4, 200), 1.0))
    [quiet] = receiver.wait(1, status="resolved", run__id=passing)
    assert quiet["reason"].startswith("No new scaler_misuse for 100 steps")
    time.sleep(0.5)  # (several evaluation passes: the alert_server's interval is 0.1 s)
    assert feed.alerts(lasting)["scaler_misuse"]["state"] == "firing"
    assert not receiver.bodies(status="resolved", run__id=lasting)
    feed.seq += 1
    feed.http.post(
        f"/api/v1/runs/{lasting}/batches",
        json={"seq": feed.seq, "rank": 0, "points": {}, "events": [], "status": "finished"},
    ).raise_for_status()
    [ended] = receiver.wait(1, status="resolved", run__id=lasting)
    assert ended["reason"] == "The run ended (finished); the mistake is in its code."


def test_a_run_whose_evaluation_fails_gives_its_lease_back_and_the_other_runs_are_evaluated(
    alert_server, caplog
) -> None:
    """A rule row no version of the API writes (an operator typed into the database: `!=`) makes one project's
    evaluation raise: logged, the lease given back, the run counted as evaluated (not retried every second), and
    another project's run still gets its skip_rate alert in the same pass."""
    from sqlalchemy import select

    from ampwatch.server import models
    from ampwatch.server.alerts import _evaluate
    from ampwatch.server.db import now

    server = alert_server(alert_eval_interval_s=3600)  # (the passes are run here, one at a time)
    service, sessions = server.app.state.alerts, server.app.state.sessions
    with server.client() as http:
        feed = Feed(http)
        bad, good = feed.run("bad", project="hand-edited"), feed.run("good")
        feed.send(bad, loss=(range(0, 300), 1.0))
        feed.send(good, skipped=(range(0, 300), 1.0))
        stamp = now()
        with sessions() as session:
            session.add(
                models.AlertRule(
                    name="typed_in",
                    kind="threshold",
                    severity="warning",
                    min_event_severity="info",
                    series="loss",
                    aggregation="mean",
                    op="!=",
                    threshold=1.0,
                    window_steps=10,
                    ignore_steps=0,
                    for_steps=0,
                    for_s=0.0,
                    keep_firing_for_s=0.0,
                    repeat_interval_s=None,
                    per_rank=False,
                    inhibits=False,
                    project="hand-edited",
                    enabled=True,
                    source="api",
                    description="",
                    created_at=stamp,
                    updated_at=stamp,
                )
            )
            session.commit()
        with caplog.at_level("ERROR", logger="ampwatch.alerts"):
            service.evaluate_once()
        assert "evaluation of run bad failed" in caplog.text
        assert set(feed.alerts(good)) == {"skip_rate"} and feed.alerts(bad) == {}
        with sessions() as session:
            liveness, seen = session.execute(
                select(models.RunLiveness, models.Run.last_seen_at)
                .join(models.Run, models.Run.id == models.RunLiveness.run_id)
                .where(models.Run.id == bad)
            ).one()
            assert liveness.lease_until is None and liveness.evaluated_at == seen
            assert bad not in _evaluate.runs_to_evaluate(session)


def test_a_misuse_alert_that_only_the_run_s_end_resolves_resolves_when_the_server_finds_the_run_crashed(
    alert_server, receiver
) -> None:
    server = alert_server(heartbeat_timeout_s=1.0)
    with server.client() as http:
        feed = Feed(http)
        run = feed.run("clips-scaled-then-dies")
        feed.seq += 1
        event = {
            "step": 3,
            "type": "scaler_misuse",
            "severity": "warning",
            "message": "clips scaled gradients",
            "details": {"cause": "clip_before_unscale"},
        }
        http.post(
            f"/api/v1/runs/{run}/batches", json={"seq": feed.seq, "rank": 0, "points": {}, "events": [event]}
        ).raise_for_status()
        receiver.wait(1, alert__rule="scaler_misuse")  # then silence: no heartbeat, no finish()
        receiver.wait(1, alert__rule="run_crashed")
        [ended] = receiver.wait(1, status="resolved", run__id=run, alert__rule="scaler_misuse")
    assert ended["reason"] == "The run ended (crashed); the mistake is in its code."
