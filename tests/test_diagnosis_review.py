"""Fixes from a review of the diagnosis, each in a real CPU loop: values the user logs next to the agent's own, a
converged small-batch classifier, NaN that an operation makes (not calibration, not overflow, not fixed by bf16), a bad
batch without a scaler, a gradient spike in a loop that clips, and a NaN made between two modules. (The loop and its
model: tests/test_diagnosis.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_diagnosis import _events, _loop, _model

import ampwatch


def _regression(
    server: Any, steps: int, log: Any, bad: int, delay_after: int = -1, overflow: bool = False
) -> list[dict[str, Any]]:
    """An fp16 loop that clips and learns y = x @ W (the loss falls ~20x); `log(run, step, loss, norm)` after update();
    at step `bad` a NaN input, or with `overflow` one 1000 times too large (a finite loss, gradients that overflow
    fp16); a pause after step `delay_after` (the skip woke the sender: it reads that step alone)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    w = torch.randn(16, 4)
    with ampwatch.init("diag", transport=server) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(steps):
            x = torch.randn(32, 16)
            y = x @ w
            if step == bad and overflow:
                x = x * 1000
            elif step == bad:
                x[0, 0] = float("nan")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if step == delay_after:
                assert run.flush()
            log(run, step, loss, norm)
    return _events(server, run.id)


def test_a_grad_norm_the_user_logs_for_a_skipped_step_after_its_record_is_no_nonfinite_grad(memory) -> None:
    # README: log clip_grad_norm_'s value as grad_norm. After update(): the overflow skip woke the sender, which judged
    # the step from its own record; the user's inf for it comes in the next batch, without the scale. It was judged as
    # a run without a scaler: "Inf gradients ... No GradScaler skipped it", critical.
    log = lambda run, step, loss, norm: run.log({"grad_norm": norm}, step=step)  # noqa: E731
    events = _regression(memory, 120, log, bad=80, delay_after=80, overflow=True)
    assert not [e for e in events if e["type"] == "nonfinite_grad"], [e["message"] for e in events]
    assert ("skipped_step", "info", 80) in [(e["type"], e["severity"], e["step"]) for e in events]


def test_a_resumed_run_logging_its_global_step_is_judged_as_a_run_with_a_scaler(memory) -> None:
    # The loop logs its loss at 10000 + step, steps the agent never records: they were taken for a run without a
    # scaler ("There is no GradScaler to skip the step"), and fed to the rolling median after the agent's later, lower
    # losses of the same batch (false loss spikes).
    events = _regression(
        memory,
        400,
        lambda run, step, loss, norm: run.log({"loss": loss, "grad_norm": norm}, step=10000 + step),
        bad=150,
    )
    assert not [e for e in events if "no GradScaler" in e["message"]], [e["message"] for e in events]
    assert not [e for e in events if e["type"] == "loss_spike"], [e["message"] for e in events]
    assert 150 in [e["step"] for e in events if e["type"] == "nonfinite_loss"]


def test_a_converged_small_batch_classifier_has_no_loss_spikes(memory) -> None:
    # Cross-entropy, 16 examples a batch, converging to ~1e-4: a single hard example makes a batch's loss hundreds of
    # times its median and several times its 90th percentile, again and again (23 loss_spike warnings before).
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(2048, 16)
    y = (x[:, 0] + 0.3 * x[:, 1] > 0).long()
    with ampwatch.init("diag", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for _ in range(3000):
            batch = torch.randint(0, len(x), (16,))
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x[batch]).float()
            loss = torch.nn.functional.cross_entropy(out, y[batch])
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    assert loss.item() < 0.01  # (converged)
    events = _events(memory, run.id)
    assert not [e for e in events if e["type"] == "loss_spike"], [
        e["message"] for e in events if e["type"] == "loss_spike"
    ]


def test_after_a_collapse_from_a_named_backward_nan_skips_are_not_normal_and_bf16_is_not_the_advice(
    memory,
) -> None:
    # A sqrt at 0 every 10 steps from 60: the probe names its backward at 90, the scale falls below 1 at 120. The
    # collapse advised "use bf16" (which does not fix sqrt(0)), and each later skip was "Occasional skips are normal".
    def sometimes(step: int, model: torch.nn.Sequential) -> None:
        model[3].on = step >= 60 and step % 10 == 0

    events = _loop(
        memory, 150, scaler=torch.amp.GradScaler("cpu", init_scale=64.0), before=sometimes, pause_after={80, 90}
    )
    origin = next(e for e in events if "origin" in e["details"])
    assert (origin["step"], origin["details"]["phase"]) == (90, "backward")
    [collapse] = [e for e in events if e["type"] == "scale_collapse"]
    assert collapse["step"] == 120 and "bf16" in collapse["message"] and "use bf16" not in collapse["message"]
    assert "backward of `3`" in collapse["message"]
    assert not [e for e in events if e["step"] > 120 and "normal" in e["message"]], [e["message"] for e in events]


def test_nan_from_an_operation_on_two_steps_at_the_scale_steps_were_applied_at_is_not_called_overflow(
    memory,
) -> None:
    def twice(step: int, model: torch.nn.Sequential) -> None:
        model[3].on = step in (60, 61)

    events = _loop(memory, 80, before=twice, pause_after={61})
    [back] = [e for e in events if e["details"].get("recovered")]
    assert back["step"] == 62 and back["details"]["overflow"] is False and back["details"]["nonfinite_grad_step"] == 61
    assert "most likely fp16 overflow" not in back["message"] and "sqrt" in back["message"]


def test_nan_skips_between_applied_steps_in_the_first_50_steps_are_not_start_up_calibration(memory) -> None:
    def sometimes(step: int, model: torch.nn.Sequential) -> None:
        model[3].on = step in (5, 15, 25, 35, 45)

    events = _loop(memory, 60, before=sometimes)
    assert not [e for e in events if e["details"].get("calibration")], [e["message"] for e in events]
    grads = [e for e in events if e["type"] == "nonfinite_grad" and "origin" not in e["details"]]
    assert [(e["severity"], e["step"]) for e in grads][:1] == [("warning", 25)]


def test_a_bad_batch_without_a_scaler_at_a_parameter_check_is_not_blamed_on_the_parameters(memory, monkeypatch) -> None:
    # The parameters are checked after the optimizer step, which wrote the bad batch's NaN into them: the loss event
    # said "(the parameters are non-finite)" of the loss that made them so.
    monkeypatch.setenv("AMPWATCH_PARAM_CHECK_INTERVAL", "5")
    disabled = torch.amp.GradScaler("cpu", enabled=False)

    def corrupt(step: int, x: torch.Tensor) -> torch.Tensor:
        if step == 10:
            x[2, 3] = float("nan")
        return x

    events = _loop(memory, 20, dtype=torch.bfloat16, scaler=disabled, batch=corrupt)
    [loss] = [e for e in events if e["type"] == "nonfinite_loss" and "origin" not in e["details"]]
    assert (
        loss["step"] == 10 and "a bad batch" in loss["message"] and "parameters are non-finite" not in loss["message"]
    )
    [param] = [e for e in events if e["type"] == "nonfinite_param"]
    assert (
        param["step"] == 10 and "Step 10's non-finite loss (the forward pass made it: a bad batch" in param["message"]
    )


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_a_gradient_spike_in_a_loop_that_clips_does_not_say_to_clip(memory, amp: str) -> None:
    """fp16 with a scaler, or bf16 without one: the spike is seen in the norm before the clip, and the loop is not
    told to clip."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=10**6)  # (low: the spike must not overflow)
    with ampwatch.init("diag", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler if amp == "fp16" else None)
        for step in range(80):
            with torch.autocast("cpu", dtype=torch.float16 if amp == "fp16" else torch.bfloat16):
                out = model(torch.randn(16, 8)).float()
            loss = torch.nn.functional.mse_loss(out, torch.full((16, 1), 300.0 if step == 60 else 0.0))
            if amp == "fp16":
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
            else:
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if amp == "fp16":
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
    [spike] = [e for e in _events(memory, run.id) if e["type"] == "grad_spike"]
    assert spike["step"] == 60 and "Clip gradients" not in spike["message"] and "clip_grad_norm_" in spike["message"]


class _Attention(torch.nn.Module):
    """A softmax over a fully masked row makes NaN in the parent's forward, between two leaf modules."""

    def __init__(self) -> None:
        super().__init__()
        self.v, self.proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        v = self.v(x)
        weights = torch.softmax((v @ v.transpose(1, 2)).float().masked_fill(~mask[:, None, :], float("-inf")), -1)
        return self.proj(weights.to(v.dtype) @ v).mean(1)


def test_a_nan_made_between_two_modules_is_not_blamed_on_the_second_alone(memory) -> None:
    torch.manual_seed(0)
    model = _Attention()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("review", "functional-nan", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(20):
            mask = torch.ones(4, 6, dtype=torch.bool)
            if step in (4, 12):
                mask[0] = False  # a sequence that is all padding
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 6, 8), mask).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if step == 4:
                assert run.flush()  # the sender reads the NaN and the probe arms for the next ones
    [origin] = [e for e in memory.events(run.id) if "origin" in e["details"]]
    assert (origin["step"], origin["details"]["origin"]) == (12, "proj")
    assert "or it received them from an operation outside any module between `v` and `proj`" in origin["message"]


def test_a_nan_made_in_the_loss_of_an_accumulated_micro_batch_is_traced_to_the_loss(memory) -> None:
    """Four micro-batches a step: each has its own forward and backward, and the probe tells them apart (it blamed
    the first layer, whose gradient came from the micro-batch before, just ahead in backward order)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    with ampwatch.init("diag", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(90):
            for micro in range(4):
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(torch.randn(16, 8)).float()
                loss = torch.nn.functional.mse_loss(out, torch.zeros(16, 1)) / 4
                if micro == 2 and step in (60, 61, 75):  # zero in the forward, NaN in the backward (d sqrt at 0)
                    loss = loss + torch.sqrt(torch.relu(out) * 0.0).sum()
                scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if step == 61:
                assert run.flush()  # the sender judges the streak and arms the probe before the loop goes on
    [origin] = [e for e in _events(memory, run.id) if "origin" in e["details"]]
    assert origin["step"] == 75 and origin["details"] == {**origin["details"], "origin": "(loss)", "phase": "backward"}
    assert "in the loss computation" in origin["message"]


class _Checkpointed(torch.nn.Module):
    """Runs `inner` under activation checkpointing: its forward runs again in the backward, to recompute activations."""

    def __init__(self, inner: torch.nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_modules_recomputed_by_activation_checkpointing_count_once_in_the_origin(memory, reentrant: bool) -> None:
    """The recomputation in the backward runs the forward hooks again: its outputs are not a second pass (they were
    counted: "module 3 of 7")."""
    torch.manual_seed(0)
    explode = _model()[2]  # (test_diagnosis.Explode: -inf at the steps in `at`)
    explode.at = {4, 12}
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.Tanh(),
        _Checkpointed(torch.nn.Sequential(explode, torch.nn.Linear(16, 16)), reentrant),
        torch.nn.Linear(16, 1),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("review", "checkpointed", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(20):
            explode.step = step
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if step == 4:
                assert run.flush()  # the sender reads the NaN and the probe arms for the next ones
    [origin] = [e for e in _events(memory, run.id) if "origin" in e["details"]]
    assert (origin["step"], origin["details"]["origin"]) == (12, "2.inner.0")
    assert origin["details"]["order"] == ["(input batch)", "0", "1", "2.inner.0", "2.inner.1", "3"]
    assert "(forward, module 3 of 5 in call order)" in origin["message"]
