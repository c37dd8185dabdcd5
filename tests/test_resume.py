"""Resuming a run under its run id: a real save/resume loop against a real server. With `resume_step` the steps
continue the stored ones; a relaunch without it overwrites nothing and says what to pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ampwatch


def _launch(server: Any, checkpoint: Path, steps: range, **init: Any) -> str:
    """One launch of a fp16 training script that resumes from `checkpoint` when it exists, then saves it."""
    torch.manual_seed(len(steps))  # (a relaunch from scratch draws other batches than the first launch)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    if checkpoint.exists():
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
    with ampwatch.init("resume", "exp", url=server.url, **init) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for it in steps:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            run.log({"iter": float(it)}, step=it)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}
    torch.save(state, checkpoint)
    return run.id


def _stored(server: Any, run_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    with server.client() as http:
        series = http.get(f"/api/v1/runs/{run_id}/series", params={"name": ["loss", "iter"]}).json()
        return series, http.get(f"/api/v1/runs/{run_id}/events").json()


def test_a_resumed_run_continues_its_steps_and_a_relaunch_without_resume_step_overwrites_nothing(
    live_server, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AMPWATCH_RUN_ID", "nanogpt-resume")  # (as the docs say for a relaunch under the same run)
    checkpoint = tmp_path / "ckpt.pt"
    run_id = _launch(live_server, checkpoint, range(0, 30))
    first, _ = _stored(live_server, run_id)
    assert _launch(live_server, checkpoint, range(30, 50), resume_step=30) == run_id
    resumed, events = _stored(live_server, run_id)
    assert resumed["loss"]["steps"] == list(range(50)) and resumed["iter"]["steps"] == list(range(50))
    assert resumed["iter"]["values"] == [float(i) for i in range(50)]  # (the agent's steps and the loop's agree)
    assert resumed["loss"]["values"][:30] == first["loss"]["values"]
    [marker] = [e for e in events if e["details"].get("check") == "resumed"]
    assert (marker["step"], marker["severity"]) == (30, "info")

    checkpoint.unlink()  # a relaunch from scratch under the same id, without resume_step
    _launch(live_server, checkpoint, range(0, 10))
    after, events = _stored(live_server, run_id)
    assert after == resumed  # nothing overwritten
    [refusal] = [e for e in events if e["details"].get("check") == "relaunch_without_resume"]
    assert (
        refusal["severity"] == "critical"
        and "resume_step=N" in refusal["message"]
        and "(50 continues" in refusal["message"]
    )


def test_a_lightning_fit_resumed_from_its_checkpoint_continues_the_run_s_steps(
    sqlite_server, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_integrations import _lightning_module, _stack, _trainer

    L = _stack("lightning", "lightning")
    from ampwatch.lightning import AmpwatchCallback

    monkeypatch.setenv("AMPWATCH_RUN_ID", "lightning-resume")
    checkpoint = tmp_path / "fit.ckpt"
    first = _trainer(L, AmpwatchCallback(project="resume", name="fit", url=sqlite_server.url), 6, "16-mixed", 1)
    first.fit(_lightning_module(L))
    first.save_checkpoint(checkpoint)
    again = _trainer(L, AmpwatchCallback(project="resume", name="fit", url=sqlite_server.url), 10, "16-mixed", 1)
    again.fit(_lightning_module(L), ckpt_path=checkpoint)  # (no resume_step: the callback reads the global step)
    series, events = _stored(sqlite_server, "lightning-resume")
    assert series["loss"]["steps"] == list(range(10))
    assert [(e["step"], e["details"]["check"]) for e in events if e["type"] == "amp_config"] == [(6, "resumed")]
