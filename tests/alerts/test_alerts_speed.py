"""Alerts count steps, not seconds: the same recurring bad batch gives the same alerts in a slow loop (the evaluator,
which runs on a clock, sees each episode end) and in a fast one (it sees none), and an event's severity caps its
alert's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ampwatch

BAD = (20, 60, 100)  # a bad batch that comes back every 40 steps, more than the 10 finite losses that clear it


def _train(url: str, name: str, after: Any = lambda run, step: None) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("alerts", name, url=url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(130):
            x = torch.randn(16, 8)
            if step in BAD:
                x[0, 0] = float("nan")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            after(run, step)
    return run.id


def _alerts(server: Any, run_id: str) -> list[tuple[str, str, str]]:
    with server.client() as http:
        rows = http.get("/api/v1/alerts", params={"run_id": run_id}).json()
    return sorted((a["rule"], a["severity"], a["state"]) for a in rows)


def test_a_recurring_bad_batch_gives_the_same_alerts_in_a_slow_loop_and_a_fast_one(alert_server, receiver) -> None:
    slow_server = alert_server()  # (evaluates every 0.1 s)
    fast_server = alert_server(alert_eval_interval_s=3600.0)  # (never evaluates during the run: as if it ran fast)

    def slow(run: ampwatch.Run, step: int) -> None:
        if step - 15 in BAD:  # the episode is over: let the evaluator see it (a slow loop)
            receiver.wait(BAD.index(step - 15) + 1, status="resolved", run__id=run.id)

    slow_run = _train(slow_server.url, "slow", slow)
    fast_run = _train(fast_server.url, "fast")
    slow_alerts, fast_alerts = _alerts(slow_server, slow_run), _alerts(fast_server, fast_run)
    assert [rule for rule, _, _ in slow_alerts] == [rule for rule, _, _ in fast_alerts] == ["nonfinite_loss"] * 3


def test_a_warning_level_misuse_raises_a_warning_alert_not_a_critical_one(alert_server, receiver) -> None:
    server = alert_server()
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("alerts", "clips-scaled", url=server.url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # (before unscale_: it clips scaled gradients)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        [firing] = receiver.wait(1, alert__rule="scaler_misuse", run__id=run.id)
        assert firing["alert"]["severity"] == "warning"
        assert _alerts(server, run.id) == [("scaler_misuse", "warning", "firing")]
        with torch.autocast("cpu", dtype=torch.float16):  # then a crash: zero_grad() between backward and step
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        optimizer.zero_grad()
        with pytest.raises(AssertionError, match="No inf checks"):
            scaler.step(optimizer)
    # (a critical misuse is told at its severity: the warning alert gives way to a critical one)
    receiver.wait(1, status="resolved", alert__rule="scaler_misuse", run__id=run.id)
    assert _alerts(server, run.id) == [
        ("scaler_misuse", "critical", "firing"),
        ("scaler_misuse", "warning", "resolved"),
    ]
