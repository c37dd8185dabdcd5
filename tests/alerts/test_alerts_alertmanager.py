"""The `alertmanager` channel against a real receiver on loopback that checks every request against the
Alertmanager v2 API's `postableAlerts` schema, as Alertmanager itself would (answering 400 otherwise), for a NaN
alert of a real watched torch loop that fires, then resolves."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from _runs import clipped_step

import ampwatch

# Alertmanager's api/v2/openapi.yaml: postableAlerts is an array of postableAlert, which is `alert` (labels: a
# labelSet, required; generatorURL: string, format uri) with startsAt and endsAt (string, format date-time) and
# annotations (a labelSet); a labelSet is an object whose values are strings. Alertmanager also refuses (400) an
# alert with no labels, a label name outside [a-zA-Z_][a-zA-Z0-9_]*, or an end before its start.
OPTIONAL = {"startsAt": "date-time", "endsAt": "date-time", "annotations": "labelSet", "generatorURL": "uri"}
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def schema_problems(body: Any) -> list[str]:
    """What makes `body` an invalid postableAlerts document (empty when valid)."""
    if not isinstance(body, list):
        return ["postableAlerts must be an array"]
    problems = []
    for i, alert in enumerate(body):
        if not isinstance(alert, dict):
            problems.append(f"[{i}] is not an object")
            continue
        if "labels" not in alert:
            problems.append(f"[{i}].labels is required")
        for field, kind in {"labels": "labelSet", **OPTIONAL}.items():
            if field in alert and not _is(alert[field], kind):
                problems.append(f"[{i}].{field} is not a {kind}: {alert[field]!r}")
        labels = alert.get("labels") or {}
        if not labels or not all(LABEL_NAME.fullmatch(name) for name in labels):
            problems.append(f"[{i}].labels: empty, or an invalid label name: {labels!r}")
        if _is(alert.get("startsAt"), "date-time") and _is(alert.get("endsAt"), "date-time"):
            if _time(alert["endsAt"]) < _time(alert["startsAt"]):
                problems.append(f"[{i}]: endsAt before startsAt")
    return problems


def _is(value: Any, kind: str) -> bool:
    if kind == "labelSet":
        return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    if kind == "uri":
        return isinstance(value, str) and re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://\S+$", value) is not None
    try:  # date-time: RFC 3339, with a time zone
        return isinstance(value, str) and "T" in value and _time(value).tzinfo is not None
    except ValueError:
        return False


def _time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


class Alertmanager:
    """A loopback stand-in for Alertmanager's `POST /api/v2/alerts` that validates what it receives."""

    def __init__(self) -> None:
        self.posts: list[tuple[Any, list[str]]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                try:
                    body = json.loads(raw)
                    problems = schema_problems(body)
                except ValueError as error:
                    body, problems = None, [f"not JSON: {error}"]
                if self.path != "/api/v2/alerts" or self.headers.get("content-type") != "application/json":
                    problems.append(f"posted to {self.path} as {self.headers.get('content-type')}")
                with outer.lock:
                    outer.posts.append((body, problems))
                reply = json.dumps(problems).encode() if problems else b""
                self.send_response(400 if problems else 200)
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, count: int, timeout_s: float = 20.0) -> list[dict[str, Any]]:
        """The first `count` alerts posted (each post's list, flattened), once there are that many."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                alerts = [a for body, _ in self.posts if isinstance(body, list) for a in body]
            if len(alerts) >= count:
                return alerts
            assert time.monotonic() < deadline, f"expected {count} alerts, got {self.posts}"
            time.sleep(0.02)


@pytest.fixture
def alertmanager() -> Iterator[Alertmanager]:
    receiver = Alertmanager()
    yield receiver
    receiver.server.shutdown()
    receiver.server.server_close()


def _train(run: ampwatch.Run, steps: int, nan_at: int, after_nan: Any = None) -> None:
    """A watched fp16 loop with a NaN batch at `nan_at`; `after_nan()` runs once, two steps after it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    run.watch(model=model, optimizer=optimizer, scaler=scaler)
    for step in range(steps):
        x = torch.randn(8, 4)
        if step == nan_at:
            x[0, 0] = float("nan")
        clipped_step(model, optimizer, scaler, x)
        if step == nan_at + 2 and after_nan is not None:
            after_nan()


def test_a_nan_alert_reaches_alertmanager_firing_then_resolved(alert_server, alertmanager) -> None:
    server = alert_server(alert_webhook_url="")
    with server.client() as http:
        created = http.post(
            "/api/v1/alert-channels", json={"name": "am", "kind": "alertmanager", "url": alertmanager.url}
        )
        assert created.status_code == 201, created.text
        assert created.json()["kind"] == "alertmanager"
        before = datetime.now(timezone.utc)
        with ampwatch.init("vision", name="resnet", url=server.url) as run:
            # The firing notice is out before the steps that resolve the alert are trained (a loop that ran them all
            # in one batch would resolve it before its firing notice is sent: then only the resolve goes out).
            _train(run, 30, nan_at=10, after_nan=lambda: (run.flush(), alertmanager.wait(1)))
        firing, resolved = alertmanager.wait(2)
        # (the server marks a delivery delivered once the receiver has answered: a moment after the post arrived)
        counted = 'ampwatch_alert_deliveries_total{outcome="delivered"} 2.0'
        deadline = time.monotonic() + 20
        while counted not in (delivered := http.get("/metrics").text) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert all(problems == [] for _, problems in alertmanager.posts), alertmanager.posts

    labels = {
        "alertname": "ampwatch_nonfinite_loss",
        "severity": "critical",
        "rule": "nonfinite_loss",
        "project": "vision",
        "run": run.id,
        "run_name": "resnet",
        "source": "ampwatch",
    }
    assert {k: firing["labels"][k] for k in labels} == labels
    assert resolved["labels"] == firing["labels"]  # Alertmanager matches the resolve to the alert by its labels
    notes = firing["annotations"]
    assert notes["summary"] == "NaN loss in vision/resnet at step 10" and notes["step"] == "10"
    assert "GradScaler skipped the step" in notes["description"]  # the diagnosis, as the other channels tell it
    assert notes["run_url"].endswith(f"/runs/{run.id}?step=10") and firing["generatorURL"] == notes["run_url"]
    assert before <= _time(firing["startsAt"]) <= datetime.now(timezone.utc) < _time(firing["endsAt"])
    assert _time(resolved["startsAt"]) == _time(firing["startsAt"])
    assert _time(firing["startsAt"]) <= _time(resolved["endsAt"]) <= datetime.now(timezone.utc)  # ended: resolved
    assert counted in delivered


def test_the_receiver_refuses_what_alertmanager_would() -> None:
    # The check above can fail: these are the mistakes a hand-made payload makes.
    assert schema_problems({"labels": {"a": "b"}}) == ["postableAlerts must be an array"]
    assert schema_problems([{"annotations": {"step": 10}}])[:2] == [
        "[0].labels is required",
        "[0].annotations is not a labelSet: {'step': 10}",
    ]
    assert schema_problems([{"labels": {"run-id": "x"}, "startsAt": "2026-01-01T00:00:00Z", "endsAt": "yesterday"}])
    assert schema_problems(
        [{"labels": {"a": "b"}, "startsAt": "2026-01-02T00:00:00Z", "endsAt": "2026-01-01T00:00:00Z"}]
    )
    assert schema_problems([{"labels": {"a": "b"}, "generatorURL": "/runs/x", "startsAt": "2026-01-01T00:00:00"}])
    assert not schema_problems(
        [{"labels": {"a": "b"}, "generatorURL": "http://h/runs/x", "endsAt": "2026-01-01T00:00:00Z"}]
    )


def test_a_grouped_notice_posts_one_alert_each_with_its_origin() -> None:
    # Pure formatting (no server needed): a diagnosis that names the origin, and two alerts of a run in one message.
    from ampwatch.server.alerts._alertmanager import alertmanager_body, alertmanager_url
    from ampwatch.server.alerts._messages import Notice

    url = "http://h:8600/runs/r1?step=7"
    alert = {
        "id": 3,
        "rule": "nonfinite_grad",
        "severity": "critical",
        "summary": "NaN gradients in p/n at step 7",
        "step": 7,
        "rank": 1,
        "url": url,
        "started_at": "2026-01-01T00:00:00+00:00",
        "resolved_at": None,
    }
    other = {**alert, "id": 4, "rule": "grad_spike", "severity": "warning", "summary": "spike", "rank": None}
    notice = Notice(
        "firing",
        alert,
        {"id": "r1", "project": "p", "name": "n", "url": url},
        "fired",
        details={"origin": "encoder.layers.3.mlp", "phase": "backward"},
        others=[other],
    )
    lead, second = alertmanager_body(notice)
    assert schema_problems([lead, second]) == []
    assert (lead["annotations"]["origin"], lead["labels"]["rank"], lead["labels"]["alert_id"]) == (
        "encoder.layers.3.mlp",
        "1",
        "3",
    )
    assert "Origin: `encoder.layers.3.mlp` in the backward." in lead["annotations"]["description"]
    assert (second["labels"]["alertname"], second["labels"]["alert_id"], "rank" in second["labels"]) == (
        "ampwatch_grad_spike",
        "4",
        False,
    )
    assert alertmanager_url("http://am:9093/") == alertmanager_url("http://am:9093/api/v2/alerts")


def test_the_documented_config_file_example_makes_an_alertmanager_channel(alert_server, tmp_path) -> None:
    page = (Path(__file__).parents[2] / "docs" / "prometheus.md").read_text()
    example = re.search(r"<!-- alertmanager-config -->\s*```yaml\n(.+?)\n```", page, re.S)
    assert example, "docs/prometheus.md marks its config example"
    (tmp_path / "alerts.yaml").write_text(example.group(1))
    server = alert_server(alert_webhook_url="", alert_rules_file=str(tmp_path / "alerts.yaml"))
    with server.client() as http:
        [channel] = http.get("/api/v1/alert-channels").json()
    assert (channel["name"], channel["kind"], channel["min_severity"]) == ("alertmanager", "alertmanager", "warning")
