"""What the nothing-lost tests share: a small watched fp16 training loop on the CPU, and the check that a run
arrived whole. Imported as `_runs` (pytest puts tests/ on the path)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx
import torch

import ampwatch


def train(run: ampwatch.Run, steps: Iterable[int], on_step: Callable[[int], None] | None = None) -> None:
    """A watched fp16 AMP loop; each step also logs its own number as `step_seen`. `on_step` runs before each step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    run.watch(model=model, optimizer=optimizer, scaler=scaler)
    for step in steps:
        if on_step:
            on_step(step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(2, 4)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        run.log({"step_seen": float(step)}, step=step)


def clipped_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor | None = None,
) -> torch.Tensor:
    """One fp16 step that unscales and clips, the pattern the agent's lean path takes (on `x`, else a random batch);
    its loss."""
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(8, 4) if x is None else x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss


def assert_every_step_once(url: str, run_id: str, steps: int) -> None:
    """The run is finished with each of its `steps` steps stored once, no batch twice, and nothing left in the spool."""
    with httpx.Client(base_url=url, timeout=30) as http:
        series = http.get(f"/api/v1/runs/{run_id}/series", params={"name": ["loss", "step_seen"]}).json()
        events = http.get(f"/api/v1/runs/{run_id}/events").json()
        status = http.get(f"/api/v1/runs/{run_id}").json()["status"]
    assert series["step_seen"]["steps"] == list(range(steps))
    assert series["step_seen"]["values"] == [float(s) for s in range(steps)]
    assert series["loss"]["steps"] == list(range(steps))
    assert len({(e["type"], e["step"], e["rank"], e["message"]) for e in events}) == len(events)  # no batch twice
    assert status == "finished"
    assert not any(Path(os.environ["AMPWATCH_SPOOL_DIR"]).iterdir())  # all acknowledged, nothing left to replay
