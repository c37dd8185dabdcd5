"""The leading indicators (fp16 range, update-to-weight ratio, Adam's second-moment lag) on real CPU training loops:
each warns well before the failure it predicts, and none warns on healthy runs."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ampwatch

INTERVAL = 10  # AMPWATCH_LAYER_NORM_INTERVAL in these tests: the indicators are taken every 10 steps
LEAD = 50  # steps a warning comes before the failure it predicts, at least


@pytest.fixture(autouse=True)
def _interval(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("AMPWATCH_LAYER_NORM_INTERVAL", str(INTERVAL))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (tiny models: a second thread only adds contention)
    yield
    torch.set_num_threads(threads)


def _train(
    memory: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    batch: Callable[[int], tuple[torch.Tensor, ...]],
    loss_of: Callable[[torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor],
    *,
    dtype: torch.dtype | None = torch.float16,
    before: Callable[[int], None] | None = None,
) -> str:
    """A standard AMP loop (fp16 with GradScaler, bf16 or fp32 without), watched; returns the run's id."""
    scaler = torch.amp.GradScaler("cpu", enabled=dtype is torch.float16)
    with ampwatch.init("leading", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(steps):
            if before is not None:
                before(step)
            inputs = batch(step)
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                out = model(inputs[0])
            loss = loss_of(out.float(), inputs)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    return run.id


def _warnings(memory: Any, run_id: str, indicator: str) -> list[dict[str, Any]]:
    return [e for e in memory.events(run_id) if e["details"].get("indicator") == indicator]


def _indicator_warnings(memory: Any, run_id: str) -> list[dict[str, Any]]:
    return [e for e in memory.events(run_id) if "indicator" in e["details"]]


def _first_nonfinite_loss(memory: Any, run_id: str) -> int:
    loss = memory.series(run_id, "loss")["loss"]
    return next(s for s, v in zip(loss["steps"], loss["values"]) if isinstance(v, str) or not math.isfinite(v))


# -- fp16 range ---------------------------------------------------------------------------------------------------


def _growing(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Regression towards 100 000, past fp16's largest value: Adam grows the output layer's activations steadily
    until they overflow fp16 (an output head whose targets outgrow fp16)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=5e-2)


def _positive(step: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(32, 8).abs(),)


def _towards_1e5(out: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return ((out / 1e5 - 1.0) ** 2).mean()


def test_fp16_range_warns_of_an_overflow_well_before_it_happens(memory) -> None:
    model, optimizer = _growing()
    run_id = _train(memory, model, optimizer, 500, _positive, _towards_1e5)
    overflow = _first_nonfinite_loss(memory, run_id)
    warnings = _warnings(memory, run_id, "fp16_range")
    assert warnings, memory.events(run_id)
    first = warnings[0]
    assert first["type"] == "amp_config" and first["severity"] == "warning"
    assert first["details"]["layer"] == "2", first["message"]
    assert overflow - first["step"] >= LEAD, (overflow, first["message"])
    assert "`2`" in first["message"] and "steps" in first["message"]
    series = memory.series(run_id, "fp16_range/2")["fp16_range/2"]
    assert series["steps"][:3] == [0, 10, 20]  # one value per interval step


def test_under_bf16_the_range_is_recorded_without_an_fp16_warning(memory) -> None:
    model, optimizer = _growing()
    run_id = _train(memory, model, optimizer, 500, _positive, _towards_1e5, dtype=torch.bfloat16)
    values = memory.series(run_id, "fp16_range/2")["fp16_range/2"]["values"]
    assert max(values) > 1.0  # past 65 504: bf16 holds it
    assert not _warnings(memory, run_id, "fp16_range"), _warnings(memory, run_id, "fp16_range")
