"""Every cause of "No inf checks were recorded for this optimizer." (and its siblings) is recorded with
its likely cause and fix, and GradScaler's exception reaches the training loop unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import ampwatch


def _setup(
    server: Any, fused: bool = False
) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu")
    run = ampwatch.init("misuse", transport=server)
    run.watch(model=model, optimizer=optimizer, scaler=scaler)
    return run, model, optimizer, scaler


def _loss(model: torch.nn.Module) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        return model(torch.randn(4, 8)).float().pow(2).mean()


def _good_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
    scaler.scale(_loss(model)).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()


def _misuse_events(server: Any, run: Any) -> list[dict[str, Any]]:
    run.finish()
    return [e for e in server.events(run.id) if e["type"] == "scaler_misuse"]


def _raises_unchanged(action: Callable[[], object], message: str) -> BaseException:
    with pytest.raises((AssertionError, RuntimeError, AttributeError, ValueError)) as raised:
        action()
    assert message in str(raised.value)
    return raised.value


def test_zero_grad_between_backward_and_step(memory) -> None:
    run, model, optimizer, scaler = _setup(memory)
    _good_step(model, optimizer, scaler)
    scaler.scale(_loss(model)).backward()
    optimizer.zero_grad(set_to_none=True)  # misplaced
    error = _raises_unchanged(lambda: scaler.step(optimizer), "No inf checks were recorded for this optimizer.")
    assert type(error) is AssertionError
    [event] = _misuse_events(memory, run)
    assert (event["severity"], event["step"], event["details"]["cause"]) == ("critical", 1, "gradients_missing")
    assert "zero_grad() ran between backward and step" in event["message"] and "Fix:" in event["message"]


def test_leftover_step_after_gradient_accumulation_as_in_the_seed_reports(memory) -> None:
    run, model, optimizer, scaler = _setup(memory)
    accumulation = 4
    for i in range(10):  # 10 micro-batches, a step every 4: two left over
        scaler.scale(_loss(model) / accumulation).backward()
        if (i + 1) % accumulation == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    optimizer.zero_grad()  # the seeds' "cleanup", then a final leftover step
    _raises_unchanged(lambda: scaler.step(optimizer), "No inf checks were recorded")
    [event] = _misuse_events(memory, run)
    assert (event["step"], event["details"]["cause"]) == (2, "gradients_missing")


def test_a_step_with_no_backward_since_update_is_a_leftover_step(memory) -> None:
    run, model, optimizer, scaler = _setup(memory)
    _good_step(model, optimizer, scaler)
    _raises_unchanged(lambda: scaler.step(optimizer), "No inf checks were recorded")
    [event] = _misuse_events(memory, run)
    assert event["details"]["cause"] == "leftover_step" and "gradient-accumulation" in event["message"]


def test_a_detached_loss(memory) -> None:
    run, model, optimizer, scaler = _setup(memory)
    loss = _loss(model).detach().requires_grad_()
    scaler.scale(loss).backward()
    _raises_unchanged(lambda: scaler.step(optimizer), "No inf checks were recorded")
    [event] = _misuse_events(memory, run)
    assert event["details"]["cause"] == "gradients_missing" and "detached" in event["message"]


def test_stepping_the_wrong_optimizer_or_frozen_parameters(memory) -> None:
    run, model, optimizer, scaler = _setup(memory)
    other = torch.nn.Linear(3, 3)  # a GAN's other network: the loss never reaches it
    wrong = torch.optim.SGD(other.parameters(), lr=0.1)
    scaler.scale(_loss(model)).backward()
    _raises_unchanged(lambda: scaler.step(wrong), "No inf checks were recorded")
    [event] = _misuse_events(memory, run)
    assert event["details"]["cause"] == "wrong_optimizer_or_frozen"
    assert "frozen or unused" in event["message"]


@pytest.mark.parametrize("fused", [False, True])
def test_unscale_before_backward(memory, fused: bool) -> None:
    run, model, optimizer, scaler = _setup(memory, fused=fused)
    _good_step(model, optimizer, scaler)
    loss = _loss(model)
    scaler.unscale_(optimizer)  # too early: there are no gradients yet
    scaler.scale(loss).backward()
    # (a fused optimizer fails on the 0 GradScaler hands it for the found_inf it never computed)
    _raises_unchanged(
        lambda: scaler.step(optimizer),
        "'int' object has no attribute 'device'" if fused else "No inf checks were recorded",
    )
    [event] = _misuse_events(memory, run)
    assert (event["details"]["cause"], event["details"]["stage"]) == ("unscale_before_backward", "UNSCALED")


def test_unscale_before_any_scaled_backward(memory) -> None:
    run, model, optimizer, scaler = _setup(memory)
    _raises_unchanged(lambda: scaler.unscale_(optimizer), "_scale is None")
    [event] = _misuse_events(memory, run)
    assert (event["step"], event["details"]["cause"]) == (0, "no_scale_yet")


def test_parameters_replaced_after_the_optimizer_was_built(memory) -> None:
    run, model, optimizer, scaler = _setup(memory)
    _good_step(model, optimizer, scaler)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    scaler.scale(_loss(model)).backward()
    _raises_unchanged(lambda: scaler.step(optimizer), "No inf checks were recorded")
    [event] = _misuse_events(memory, run)
    assert (event["details"]["cause"], event["details"]["replaced_params"]) == ("parameters_replaced", 4)


def test_with_a_fused_optimizer_the_mistake_surfaces_in_update(memory) -> None:
    run, model, optimizer, scaler = _setup(memory, fused=True)
    _good_step(model, optimizer, scaler)
    scaler.scale(_loss(model)).backward()
    optimizer.zero_grad(set_to_none=True)
    scaler.step(optimizer)
    _raises_unchanged(scaler.update, "No inf checks were recorded prior to update.")
    [event] = _misuse_events(memory, run)
    assert event["details"]["cause"] == "gradients_missing"


def test_step_twice_before_update(memory) -> None:
    run, model, optimizer, scaler = _setup(memory)
    scaler.scale(_loss(model)).backward()
    scaler.step(optimizer)
    error = _raises_unchanged(lambda: scaler.step(optimizer), "step() has already been called since the last update()")
    assert type(error) is RuntimeError
    [event] = _misuse_events(memory, run)
    assert event["details"]["cause"] == "step_twice"


def test_a_gan_stepping_the_other_optimizer_is_told_so(memory) -> None:
    """G's loss, then scaler.step(optD): D's parameters have G's shapes, but another watched optimizer holds G's, so
    nothing was replaced (it said `parameters_replaced`)."""
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    discriminator = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt_g, opt_d = torch.optim.Adam(generator.parameters()), torch.optim.Adam(discriminator.parameters())
    scaler = torch.amp.GradScaler("cpu")
    run = ampwatch.init("misuse", transport=memory)
    run.watch(model=generator, optimizer=[opt_g, opt_d], scaler=scaler)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = generator(torch.randn(8, 16)).float().pow(2).mean()
    scaler.scale(loss).backward()
    _raises_unchanged(lambda: scaler.step(opt_d), "No inf checks were recorded")
    [event] = _misuse_events(memory, run)
    assert event["details"]["cause"] == "wrong_optimizer_or_frozen"


def test_unscale_twice_before_update(memory) -> None:
    """GradScaler says "unscale_() has already been called on this optimizer since the last update()"."""
    run, model, optimizer, scaler = _setup(memory)
    scaler.scale(_loss(model)).backward()
    scaler.unscale_(optimizer)
    _raises_unchanged(lambda: scaler.unscale_(optimizer), "unscale_() has already been called on this optimizer")
    [event] = _misuse_events(memory, run)
    assert event["details"]["cause"] == "unscale_twice"


def test_a_silent_unscaled_backward_is_reported_once_without_raising(memory) -> None:
    run, model, optimizer, scaler = _setup(memory)
    _good_step(model, optimizer, scaler)
    for _ in range(3):
        _loss(model).backward()  # forgot scaler.scale(): gradients end up divided by the scale
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    [event] = _misuse_events(memory, run)
    assert (event["severity"], event["step"], event["details"]["cause"]) == ("warning", 1, "unscaled_backward")
    assert "stops learning" in event["message"]


def test_a_correct_loop_has_no_misuse(memory) -> None:
    run, model, optimizer, scaler = _setup(memory)
    for _ in range(5):
        _good_step(model, optimizer, scaler)
    assert _misuse_events(memory, run) == []


def _clipped_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    max_norm: float,
    unscale_first: bool,
) -> None:
    scaler.scale(_loss(model)).backward()
    if unscale_first:
        scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()


@pytest.mark.parametrize("fused", [False, True])
def test_clipping_before_unscale_is_reported_once_without_raising(memory, fused: bool) -> None:
    run, model, optimizer, scaler = _setup(memory, fused=fused)
    _good_step(model, optimizer, scaler)
    for _ in range(3):
        _clipped_step(model, optimizer, scaler, 1.0, unscale_first=False)  # clips the gradients times 2^16
    [event] = _misuse_events(memory, run)
    assert (event["severity"], event["step"], event["details"]["cause"]) == ("warning", 1, "clip_before_unscale")
    assert "barely learns" in event["message"] and event["details"]["max_norm"] == "1.0"


def test_a_norm_taken_by_clipping_before_unscale_is_said_to_be_scaled(memory) -> None:
    run, model, optimizer, scaler = _setup(memory)
    _clipped_step(model, optimizer, scaler, float("inf"), unscale_first=False)  # clips nothing: only the norm is off
    [event] = _misuse_events(memory, run)
    assert event["details"] == {"cause": "clip_before_unscale", "max_norm": "inf"}
    assert "multiplied by the loss scale" in event["message"] and "barely learns" not in event["message"]


def test_clipping_after_unscale_has_no_misuse(memory) -> None:
    run, model, optimizer, scaler = _setup(memory)
    for _ in range(60):  # (past the first plan: the lean hooks of the lean path too)
        _clipped_step(model, optimizer, scaler, 1.0, unscale_first=True)
    assert _misuse_events(memory, run) == []


@pytest.mark.parametrize("unscale_first", [False, True])
def test_fp16_parameters_under_a_scaler(memory, unscale_first: bool) -> None:
    run, model, optimizer, scaler = _setup(memory)
    model.half()  # (the classic: the whole model in fp16 instead of autocast)
    scaler.scale(model(torch.randn(4, 8).half()).float().pow(2).mean()).backward()
    _raises_unchanged(
        lambda: scaler.unscale_(optimizer) if unscale_first else scaler.step(optimizer), "unscale FP16 gradients"
    )
    [event] = _misuse_events(memory, run)
    assert (event["severity"], event["details"]["cause"]) == ("critical", "fp16_parameters")
    assert "torch.autocast" in event["message"]


def test_optimizer_step_on_scaled_gradients_is_reported_once_without_raising(memory) -> None:
    run, model, optimizer, scaler = _setup(memory)
    _good_step(model, optimizer, scaler)
    for _ in range(3):
        scaler.scale(_loss(model)).backward()
        optimizer.step()  # the scaled gradients applied as they are; no scaler.update() either
        optimizer.zero_grad()
    [event] = _misuse_events(memory, run)
    assert (event["severity"], event["step"], event["details"]["cause"]) == ("critical", 1, "direct_step")
    assert (
        "multiplied by the loss scale" in event["message"] and "scaler.step(optimizer) in place of" in event["message"]
    )


def test_update_after_an_optimizer_step_outside_the_scaler(memory) -> None:
    run, model, optimizer, scaler = _setup(memory)
    _good_step(model, optimizer, scaler)  # (a step() of an earlier iteration must not be taken for this one's)
    scaler.scale(_loss(model)).backward()
    optimizer.step()
    _raises_unchanged(scaler.update, "No inf checks were recorded prior to update")
    events = _misuse_events(memory, run)
    assert [e["details"]["cause"] for e in events] == ["direct_step", "no_scaler_step"]
    assert "or calls update() after every micro-batch" in events[1]["message"]


def test_a_clip_that_raises_at_an_overflow_under_a_scaler_is_told_so(memory) -> None:
    run, model, optimizer, scaler = _setup(memory)
    scaler.scale(_loss(model)).backward()
    scaler.step(optimizer)
    scaler.update(2.0**40)  # the fp16 backward overflows at this scale: GradScaler would skip the step
    optimizer.zero_grad()
    scaler.scale(_loss(model)).backward()
    scaler.unscale_(optimizer)
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)  # noqa: E731
    error = _raises_unchanged(clip, "is non-finite, so it cannot be clipped")
    assert type(error) is RuntimeError
    [event] = _misuse_events(memory, run)
    assert (event["severity"], event["step"], event["details"]["cause"]) == ("critical", 1, "clip_nonfinite")
    assert "Fix: drop error_if_nonfinite=True" in event["message"]
