"""Diagnosis without an enabled GradScaler (bf16, fp32): nothing skips a step whose gradients are non-finite, so the
optimizer writes them into the parameters, and every later loss, gradient and module output is non-finite because of
that step. The events name that step and what went wrong there, not the batches or the first layer after it.
(The model and its NaN-making modules: tests/test_diagnosis.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_diagnosis import _events, _loop, _model, _of

import ampwatch


def _plain(
    server: Any, steps: int, *, sqrt_at: int = -1, nan_batch_at: int = -1, log_loss: bool = True, pause_after: int = -1
) -> list[dict[str, Any]]:
    """A bf16 loop with no scaler: backward, optimizer step; the loss logged before the step (or not at all)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampwatch.init("diag-bf16", transport=server) as run:
        run.watch(model=model, optimizer=optimizer)
        for step in range(steps):
            model[3].on = step == sqrt_at
            x = torch.randn(16, 8) * (float("nan") if step == nan_batch_at else 1.0)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(model(x).float(), torch.zeros(16, 1))
            loss.backward()
            if log_loss:
                run.log({"loss": loss})
            optimizer.step()
            optimizer.zero_grad()
            if step == pause_after:
                assert run.flush()  # the sender sees this step and arms the NaN-origin probe before the loop goes on
    return _events(server, run.id)


def test_nan_gradients_applied_without_a_scaler_are_named_as_the_cause_afterwards(memory, monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_PARAM_CHECK_INTERVAL", "1")
    events = _plain(memory, 30, sqrt_at=20)
    [grad] = [e for e in events if e["type"] == "nonfinite_grad" and "origin" not in e["details"]]
    assert grad["step"] == 20 and "The loss is finite, so the backward pass made the NaN" in grad["message"]
    [param] = [e for e in events if e["type"] == "nonfinite_param"]
    assert param["step"] == 20 and "Step 20's gradients were non-finite under a finite loss" in param["message"]
    [loss] = [e for e in events if e["type"] == "nonfinite_loss" and "origin" not in e["details"]]
    assert loss["step"] == 21 and "a bad batch" not in loss["message"]  # (the parameters make it now, not a batch)
    assert all("fp16" not in e["message"] for e in events)


def test_a_forward_origin_after_the_parameters_went_nan_names_the_step_that_wrote_them(memory) -> None:
    events = _plain(memory, 30, nan_batch_at=20, pause_after=20)
    [origin] = [e for e in events if e["details"].get("phase") == "forward"]
    assert origin["step"] > 20 and origin["details"]["origin"] == "0"
    assert "most likely because its parameters are non-finite" in origin["message"]
    assert "the optimizer applied step 20's non-finite gradients (from a non-finite loss)" in origin["message"]


def test_after_restoring_a_checkpoint_a_second_corruption_is_reported_again(memory) -> None:
    checkpoint: dict[str, Any] = {}

    def restore(step: int, model: torch.nn.Sequential) -> None:
        if step == 10:
            checkpoint.update({k: v.clone() for k, v in model.state_dict().items()})
        elif step == 60:  # (the parameters are NaN since step 20)
            model.load_state_dict(checkpoint)

    disabled = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT under bf16: scaler.scale() still shows the loss
    events = _loop(
        memory,
        110,
        dtype=torch.bfloat16,
        scaler=disabled,
        before=restore,
        batch=lambda s, x: x * (float("nan") if s in (20, 70) else 1.0),
    )
    params = [e["step"] for e in events if e["type"] == "nonfinite_param"]
    assert len(params) == 2 and 20 <= params[0] < 60 and 70 <= params[1], params
    [second] = [e for e in events if e["type"] == "nonfinite_loss" and e["step"] == 70 and "origin" not in e["details"]]
    assert "a bad batch" in second["message"] and "parameters are non-finite" not in second["message"]


@pytest.mark.parametrize("log_loss", [False, True])
def test_a_run_without_a_scaler_that_logs_no_loss_is_told_once(memory, log_loss: bool) -> None:
    events = _plain(memory, 150, log_loss=log_loss)
    told = [e for e in events if e["details"].get("check") == "no_loss"]
    if log_loss:
        assert not told
    else:
        assert _of(told, "amp_config") == [("amp_config", "info", told[0]["step"])] and told[0]["step"] >= 99
        assert "run.log" in told[0]["message"]
