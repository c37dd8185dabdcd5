"""Runs that stop talking: a killed training process becomes `crashed`, a hung one `stalled`; both alert,
and a hung run that steps again resolves."""

from __future__ import annotations

import signal
from typing import Any


def _run(server: Any, run_id: str) -> dict[str, Any]:
    with server.client() as http:
        return http.get(f"/api/v1/runs/{run_id}").json()


def _events(server: Any, run_id: str, kind: str) -> list[dict[str, Any]]:
    with server.client() as http:
        return [e for e in http.get(f"/api/v1/runs/{run_id}/events").json() if e["type"] == kind]


def test_a_killed_training_process_is_marked_crashed_and_alerts(alert_server, receiver, training, wait_for) -> None:
    server = alert_server(heartbeat_timeout_s=1.5)
    process, run_id = training(server.url)
    wait_for(lambda: (_run(server, run_id).get("last_step") or 0) >= 20, what="training to make progress")
    process.send_signal(signal.SIGKILL)  # no finish(), no atexit: the process is simply gone
    process.wait(10)
    [body] = receiver.wait(1, alert__rule="run_crashed")
    assert body["status"] == "firing" and body["alert"]["severity"] == "critical"
    assert body["alert"]["summary"].startswith("Run crashed in alerts/subprocess at step ")
    assert "No heartbeat for" in body["text"] and "never called finish()" in body["text"]
    assert _run(server, run_id)["status"] == "crashed"
    [event] = _events(server, run_id, "run_crashed")
    assert event["severity"] == "critical" and event["details"]["detected_by"] == "server"


def test_a_hung_process_that_keeps_heartbeating_is_stalled_and_resolves_when_it_steps_again(
    alert_server, receiver, training, wait_for, tmp_path
) -> None:
    server = alert_server(heartbeat_timeout_s=3.0, stall_min_s=1.0)
    flag = tmp_path / "go-on"
    process, run_id = training(server.url, str(flag))
    [body] = receiver.wait(1, timeout_s=30, alert__rule="run_stalled")
    assert body["status"] == "firing" and body["alert"]["severity"] == "warning"
    assert "keeps sending heartbeats: it is alive but hung" in body["text"]
    run = _run(server, run_id)
    assert run["status"] == "stalled" and run["last_step"] < 45  # it stopped stepping at 40
    assert process.poll() is None  # still alive: hung, not crashed
    flag.touch()  # the hang ends
    [resolved] = receiver.wait(1, status="resolved", alert__rule="run_stalled")
    assert resolved["alert"]["id"] == body["alert"]["id"] and "Steps advance again" in resolved["text"]
    assert wait_for(lambda: _run(server, run_id)["status"] == "running", what="the run to be running again")
    assert receiver.bodies(alert__rule="run_crashed") == []
