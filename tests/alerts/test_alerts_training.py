"""Real CPU training loops with the agent → real server → a real webhook receiver: what fires, once, and
what it says; what resolves; and what stays quiet."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from sqlalchemy import select

import ampwatch
from ampwatch.server import models


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _train(
    url: str,
    name: str,
    steps: int,
    *,
    scaler: torch.amp.GradScaler | None = None,
    batch: Callable[[int, torch.Tensor], torch.Tensor] = lambda s, x: x,
    after: Callable[[int], None] = lambda s: None,
) -> str:
    """A standard fp16 AMP loop with the agent attached; returns the run id."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = scaler or torch.amp.GradScaler("cpu")
    with ampwatch.init("alerts", name, url=url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(batch(step, torch.randn(16, 8))).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            after(step)
    return run.id


def _alerts(server: Any, run_id: str) -> list[dict[str, Any]]:
    with server.client() as http:
        return http.get("/api/v1/alerts", params={"run_id": run_id}).json()


def _evaluated(server: Any, run_id: str) -> bool:
    """The background evaluator has seen everything the run sent."""
    with server.app.state.sessions() as session:
        row = session.execute(
            select(models.RunLiveness.evaluated_at, models.Run.last_seen_at)
            .join(models.Run)
            .where(models.Run.id == run_id)
        ).first()
    return row is not None and row[0] is not None and row[0] >= row[1]


def test_a_nan_loss_fires_one_notification_with_a_diagnosis_and_resolves_when_the_loss_is_finite(
    alert_server, receiver, wait_for
) -> None:
    server = alert_server()

    def corrupt(step: int, x: torch.Tensor) -> torch.Tensor:
        if step in (30, 33):
            x[0, 0] = float("nan")
        return x

    def pause(step: int) -> None:
        if step == 30:  # let the first NaN reach the server (and arm the agent's origin probe) before step 33
            receiver.wait(1, status="firing")

    run_id = _train(server.url, "nan-run", 60, batch=corrupt, after=pause)
    firing, resolved = receiver.wait(2)[:2]
    assert firing["status"] == "firing" and resolved["status"] == "resolved"
    alert = firing["alert"]
    assert (alert["rule"], alert["severity"], alert["step"]) == ("nonfinite_loss", "critical", 30)
    assert alert["summary"] == "NaN loss in alerts/nan-run at step 30"
    assert firing["run"] == {
        "id": run_id,
        "project": "alerts",
        "name": "nan-run",
        "url": f"{server.url}/runs/{run_id}",
        "status": firing["run"]["status"],
    }
    assert alert["url"] == f"{server.url}/runs/{run_id}?step=30"
    text = firing["text"]
    assert "the forward pass produced a non-finite value" in text and "GradScaler skipped the step" in text
    assert "Loss scale: 2^16 → 2^15." in text
    assert "Grad norm over the 30 steps before: median" in text
    assert resolved["alert"]["id"] == alert["id"]
    assert "The loss is finite again since step 34" in resolved["text"]

    [row] = _alerts(server, run_id)
    assert (row["id"], row["state"], row["rule"]) == (alert["id"], "resolved", "nonfinite_loss")
    with server.client() as http:
        detail = http.get(f"/api/v1/alerts/{alert['id']}").json()
    # The second NaN (and the origin the agent found for it) updated the firing alert instead of notifying again.
    assert detail["count"] >= 2 and detail["details"]["origin"] == "(input batch)"
    assert [(f["old_state"], f["new_state"]) for f in detail["flips"]] == [(None, "firing"), ("firing", "resolved")]
    assert [[d["status"] for d in f["deliveries"]] for f in detail["flips"]] == [["delivered"], ["delivered"]]
    assert len(receiver.bodies()) == 2


def test_a_healthy_fp16_run_with_startup_calibration_skips_raises_no_alert(alert_server, receiver, wait_for) -> None:
    server = alert_server()
    run_id = _train(server.url, "healthy", 2000, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**24))
    with server.client() as http:
        events = http.get(f"/api/v1/runs/{run_id}/events").json()
    [calibration] = [e for e in events if e["details"].get("calibration")]
    assert calibration["details"]["skips"] >= 2  # the scale did calibrate down, with skipped steps
    wait_for(lambda: _evaluated(server, run_id), what="the evaluator to catch up with the run")
    assert _alerts(server, run_id) == []
    assert receiver.bodies() == []


def test_frequent_overflow_skips_after_calibration_fire_the_skip_rate_warning(alert_server, receiver) -> None:
    server = alert_server()
    # The scale grows every 10 steps into overflow again: about one step in ten is thrown away.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10)
    run_id = _train(server.url, "skippy", 400, scaler=scaler, batch=lambda s, x: x * 300)
    [body] = receiver.wait(1, alert__rule="skip_rate")
    assert body["status"] == "firing" and body["alert"]["severity"] == "warning"
    assert (
        body["alert"]["summary"].startswith("Skip rate ")
        and "over 200 steps in alerts/skippy" in body["alert"]["summary"]
    )
    assert [a["rule"] for a in _alerts(server, run_id)] == ["skip_rate"]
