"""Each failure signature of mixed-precision training (docs/diagnosis.md), produced by a real CPU training loop,
becomes the right event at the right step (and the benign ones do not warn)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import ampwatch

Hook = Callable[[int, torch.Tensor], torch.Tensor]


class Explode(torch.nn.Module):
    """Passes its input through; at the steps in `at` it turns one value into -inf (log of 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.at: set[int] = set()
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step in self.at:
            x = x.clone()
            x[0, 0] = torch.log(torch.zeros(()))
        return x


class SqrtOfZero(torch.nn.Module):
    """Adds sqrt(relu(x) * 0): zero in the forward, NaN in the backward (d sqrt/dx at 0 is inf, times 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(torch.relu(x) * 0.0) if self.on else x


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), Explode(), SqrtOfZero(), torch.nn.Linear(16, 1))


def _events(server, run_id: str) -> list[dict[str, Any]]:
    return server.events(run_id)


def _loop(
    server: Any,
    steps: int,
    *,
    dtype: torch.dtype = torch.float16,
    scaler: torch.amp.GradScaler | None = None,
    before: Callable[[int, torch.nn.Sequential], None] | None = None,
    batch: Hook | None = None,
    target: Callable[[int], float] = lambda step: 0.0,
    pause_after: set[int] = frozenset(),  # type: ignore[assignment]  # steps after which the loop flushes
    lr: float = 1e-3,
    scheduler: bool = False,
    autocast: bool = True,
    new_scale: dict[int, float] | None = None,  # step -> the scale that step's update() sets
) -> list[dict[str, Any]]:
    """A standard AMP loop with the agent attached; returns the run's events as the server has them."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = scaler if scaler is not None else torch.amp.GradScaler("cpu")
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 0.99**i) if scheduler else None
    with ampwatch.init("diag", transport=server) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(steps):
            model[2].step = step
            if before:
                before(step, model)
            x = torch.randn(16, 8)
            x = batch(step, x) if batch else x
            with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                loss = torch.nn.functional.mse_loss(model(x).float(), torch.full((16, 1), target(step)))
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update((new_scale or {}).get(step))
            if sched:
                sched.step()
            optimizer.zero_grad()
            if step in pause_after:
                assert run.flush()  # the sender sees this step before the loop goes on
    return _events(server, run.id)


def _of(events: list[dict[str, Any]], *types: str) -> list[tuple[str, str, int]]:
    return [(e["type"], e["severity"], e["step"]) for e in events if e["type"] in types]


def test_startup_calibration_is_one_info_event_and_no_warning(memory) -> None:
    events = _loop(memory, 60, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**22))
    assert [e["severity"] for e in events] and all(e["severity"] == "info" for e in events)
    [calibration] = [e for e in events if e["details"].get("calibration")]
    assert calibration["type"] == "skipped_step" and "normal" in calibration["message"]
    assert calibration["details"]["skips"] >= 2


def test_healthy_occasional_skips_are_info_only(memory) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10)
    events = _loop(memory, 120, scaler=scaler, batch=lambda s, x: x * 300)
    skips = [e for e in events if e["type"] == "skipped_step" and not e["details"].get("calibration")]
    assert skips, "the scale grew into overflow at least once"
    assert {e["severity"] for e in events} == {"info"}


def test_a_skip_streak_with_a_falling_scale_is_a_scale_collapse(memory) -> None:
    # From step 20 every gradient overflows at any scale: 1e38 in the loss.
    events = _loop(memory, 45, batch=lambda s, x: x * (3e37 if s >= 20 else 1.0))
    [collapse] = [e for e in events if e["type"] == "scale_collapse"]
    assert collapse["severity"] == "critical" and 21 <= collapse["step"] <= 30
    assert "consecutive skipped steps" in collapse["message"]
    assert collapse["details"]["scale_after"] < collapse["details"]["scale_before"]


def test_a_bad_batch_is_a_nonfinite_loss_and_its_next_occurrence_names_the_input(memory) -> None:
    def corrupt(step: int, x: torch.Tensor) -> torch.Tensor:
        if step in (5, 15):
            x[2, 3] = float("nan")
        return x

    events = _loop(memory, 25, batch=corrupt, pause_after={5})
    losses = [e for e in events if e["type"] == "nonfinite_loss"]
    assert (losses[0]["severity"], losses[0]["step"]) == ("critical", 5)
    assert (
        "GradScaler skipped the step" in losses[0]["message"]
        and "did not change the parameters" in losses[0]["message"]
    )
    [origin] = [e for e in losses if "origin" in e["details"]]
    assert (origin["step"], origin["details"]["origin"], origin["details"]["phase"]) == (15, "(input batch)", "forward")
    assert "data problem" in origin["message"]


def test_a_bad_batch_in_the_first_steps_is_not_told_as_start_up_calibration(memory) -> None:
    def corrupt(step: int, x: torch.Tensor) -> torch.Tensor:
        if step == 20:
            x[2, 3] = float("nan")
        return x

    events = _loop(memory, 60, batch=corrupt, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))
    assert [(e["type"], e["step"]) for e in events if e["type"] == "nonfinite_loss"][:1] == [("nonfinite_loss", 20)]
    calibration = [e for e in events if e["details"].get("calibration")]
    assert calibration == [], calibration  # ("Start-up calibration: 1 skipped step(s) ... This is normal.")


def test_the_origin_probe_names_the_first_layer_whose_output_went_nonfinite(memory) -> None:
    def explode(step: int, model: torch.nn.Sequential) -> None:
        model[2].at = {4, 12}

    events = _loop(memory, 20, before=explode, pause_after={4})
    assert _of(events, "nonfinite_loss")[0] == ("nonfinite_loss", "critical", 4)
    [origin] = [e for e in events if "origin" in e["details"]]
    assert (origin["step"], origin["details"]["origin"]) == (12, "2")
    assert "first non-finite output: `2` (forward, module 3 of 5 in call order)" in origin["message"]


def test_nan_gradients_with_a_finite_loss_are_a_backward_nonfinite_grad(memory) -> None:
    def sqrt_at_zero(step: int, model: torch.nn.Sequential) -> None:
        model[3].on = step >= 60  # after start-up calibration, where overflow may make NaN too

    events = _loop(memory, 80, before=sqrt_at_zero, pause_after={61})
    grads = _of(events, "nonfinite_grad")
    # One NaN skip can be an overflow; NaN that survives the halved scale is the backward's own.
    assert grads[:2] == [("nonfinite_grad", "warning", 61), ("nonfinite_grad", "critical", 62)]
    assert [
        e["details"]["grad_norm"] for e in events if e["type"] == "nonfinite_grad" and "origin" not in e["details"]
    ][:2] == ["NaN", "NaN"]  # (alerts name it)
    assert not _of(events, "nonfinite_loss")
    origin = next(e for e in events if "origin" in e["details"])
    assert origin["details"]["phase"] == "backward" and origin["details"]["origin"] == "3"
    assert "in the backward of `3`" in origin["message"]
    # While the probe is armed, per-layer norms are taken every step: the heatmap shows where NaN entered
    # (the layer before the sqrt: its gradient flows through it), and that the layer after it stayed finite.
    run_id = memory.runs(project="diag")[0]["id"]
    layers = memory.series(run_id, ["grad_norm/0", "grad_norm/4"])
    armed = [s for s in layers["grad_norm/0"]["steps"] if s > 62]
    assert len(armed) >= 10 and armed == list(range(armed[0], armed[0] + len(armed)))  # consecutive steps
    first, before = layers["grad_norm/0"], layers["grad_norm/4"]
    assert all(v == "NaN" for s, v in zip(first["steps"], first["values"]) if s in armed)
    assert all(isinstance(v, float) for s, v in zip(before["steps"], before["values"]) if s in armed)


def test_nan_gradients_that_stop_at_a_lower_scale_are_called_fp16_overflow_once_the_steps_come_back(
    memory,
) -> None:
    # After calibration the scale is set to 2^24: the fp16 backward overflows, and in the last layer's weight
    # gradient inf - inf is NaN. Real arithmetic, no NaN put in: it lasts until GradScaler has halved the scale
    # enough. While it lasts the agent cannot tell it from an operation that makes NaN; once steps come back it can.
    events = _loop(memory, 80, new_scale={59: 2.0**24})
    grads = [e for e in events if e["type"] == "nonfinite_grad" and "origin" not in e["details"]]
    assert [(e["severity"], e["step"]) for e in grads[:2]] == [("warning", 61), ("critical", 62)]
    assert "overflows fp16" in grads[1]["message"] and "sqrt" in grads[1]["message"]
    [back] = [e for e in events if e["details"].get("overflow")]
    assert (
        back["type"] == "skipped_step" and back["severity"] == "info" and back["details"]["nonfinite_grad_step"] == 61
    )
    assert 64 <= back["step"] <= 75 and "fp16 overflow" in back["message"]
    assert not [e for e in events if e["type"] == "nonfinite_loss"]


def test_parameters_gone_nonfinite_without_a_scaler_are_reported(memory, monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_PARAM_CHECK_INTERVAL", "1")
    disabled = torch.amp.GradScaler("cpu", enabled=False)  # bf16: nothing skips a bad step
    events = _loop(
        memory, 12, dtype=torch.bfloat16, scaler=disabled, batch=lambda s, x: x * (float("inf") if s == 6 else 1)
    )
    params = _of(events, "nonfinite_param")
    assert params == [("nonfinite_param", "critical", 6)]
    assert "cannot recover" in next(e for e in events if e["type"] == "nonfinite_param")["message"]


def test_a_gradient_explosion_without_a_skip_is_a_grad_spike_and_a_loss_spike(memory) -> None:
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    events = _loop(memory, 80, dtype=torch.bfloat16, scaler=disabled, target=lambda s: 300.0 if s == 60 else 0.0)
    assert _of(events, "grad_spike") == [("grad_spike", "warning", 60)]
    assert _of(events, "loss_spike") == [("loss_spike", "warning", 60)]
    message = next(e for e in events if e["type"] == "grad_spike")["message"]
    assert "fp16" not in message and "Clip gradients" in message  # (bf16: no overflow to tell it from)


def test_a_scheduler_stepping_on_skipped_steps_is_an_amp_config_warning(memory) -> None:
    # (after start-up calibration, the first calibration_steps steps, whose skips are no schedule's problem)
    events = _loop(memory, 70, scheduler=True, batch=lambda s, x: x * (3e37 if s == 58 else 1))
    [config] = [e for e in events if e["type"] == "amp_config"]
    assert config["step"] == 59 and "scheduler" in config["message"]


def test_gradscaler_with_bf16_autocast_is_an_amp_config_warning(memory) -> None:
    events = _loop(memory, 3, dtype=torch.bfloat16)
    assert [e["details"]["check"] for e in events if e["type"] == "amp_config"] == ["scaler_with_bf16"]


def test_anomaly_detection_left_on_is_an_amp_config_warning(memory) -> None:
    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        events = _loop(memory, 2)
    assert "anomaly_mode" in [e["details"]["check"] for e in events if e["type"] == "amp_config"]


def test_a_healthy_run_has_per_layer_gradient_norms_grouped_by_module(memory, monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_LAYER_NORM_INTERVAL", "5")
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    expected: dict[int, dict[str, float]] = {}
    with ampwatch.init("diag", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(12):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            expected[step] = {
                m: torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model[int(m)].parameters()])).item()
                for m in ("0", "4")
            }
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    names = memory.run(run.id)["series"]
    data = memory.series(run.id, ["grad_norm/0", "grad_norm/4"])
    assert sorted(n for n in names if n.startswith("grad_norm/")) == ["grad_norm/0", "grad_norm/4"]  # one per module
    for module in ("0", "4"):
        assert data[f"grad_norm/{module}"]["steps"] == [0, 5, 10]
        assert data[f"grad_norm/{module}"]["values"] == pytest.approx(
            [expected[s][module] for s in (0, 5, 10)], rel=1e-5
        )
    assert _events(memory, run.id) == []  # healthy: nothing to say


def test_steps_between_the_due_ones_skip_no_per_layer_check_logged_value_or_scale_change(memory, monkeypatch) -> None:
    # Most steps take the agent's short path; each step something is due on must still take the full one:
    # per-layer norms, parameter checks, a standard name the user logs, a scale or growth rule changed by hand
    # (at steps 12, 22 and 31 here, which are none of the others: multiples of 5 or 7 or one before a 5).
    monkeypatch.setenv("AMPWATCH_LAYER_NORM_INTERVAL", "5")
    monkeypatch.setenv("AMPWATCH_PARAM_CHECK_INTERVAL", "7")
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    scales = []
    with ampwatch.init("diag", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(40):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            scales.append(scaler.get_scale())  # the scale this step's backward uses
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            if step == 12:
                run.log({"grad_norm": 123.0}, step=12)
            scaler.update(64.0 if step == 22 else None)
            if step == 31:
                scaler.set_growth_factor(4.0)
            optimizer.zero_grad()
    data = memory.series(run.id, ["grad_norm/0", "param_norm", "grad_norm", "scale"])
    assert data["grad_norm/0"]["steps"] == list(range(0, 40, 5))
    assert data["param_norm"]["steps"] == list(range(0, 40, 7))
    assert data["grad_norm"]["steps"] == list(range(40))
    assert data["grad_norm"]["values"][12] == 123.0
    assert data["scale"]["values"] == scales  # set by hand at 22, growing by 4 after 31
    assert scales[23] == 64.0 and any(b == 4 * a for a, b in zip(scales[32:], scales[33:]))


def test_without_a_scaler_the_due_steps_still_take_per_layer_norms_and_parameter_checks(memory, monkeypatch) -> None:
    # (bf16: steps are counted through the optimizer, and the steps between the due ones take the short path too)
    monkeypatch.setenv("AMPWATCH_LAYER_NORM_INTERVAL", "5")
    monkeypatch.setenv("AMPWATCH_PARAM_CHECK_INTERVAL", "7")
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampwatch.init("diag", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer)
        for _ in range(30):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    data = memory.series(run.id, ["grad_norm/0", "param_norm", "grad_norm"])
    assert data["grad_norm/0"]["steps"] == list(range(0, 30, 5))
    assert data["param_norm"]["steps"] == list(range(0, 30, 7))
    assert data["grad_norm"]["steps"] == list(range(30))
    assert run._recorder._plain_until > 0  # (private: the short path was in use)


def test_a_gradscaler_without_autocast_is_an_amp_config_warning(memory) -> None:
    events = _loop(memory, 3, autocast=False)
    [config] = [e for e in events if e["type"] == "amp_config"]
    assert (config["step"], config["severity"], config["details"]["check"]) == (0, "warning", "scaler_without_autocast")
    assert "without autocast" in config["message"]
