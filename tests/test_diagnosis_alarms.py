"""No false alarms on healthy runs, and no misses on unhealthy ones that look like them: start-up calibration from a
very high scale, NaN that comes back on single steps, inf gradients without a scaler, an evaluation pass before
training; and the NaN-origin probe: armed soon after a skip, for longer after a miss, never twice for one event.
Real CPU loops (the loop and its model: tests/test_diagnosis.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_diagnosis import _events, _loop, _of

import ampwatch


def test_a_long_startup_calibration_from_a_very_high_scale_is_no_scale_collapse(memory) -> None:
    # From 2^32 the fp16 backward overflows for a dozen steps in a row before the scale is low enough: healthy.
    events = _loop(memory, 60, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**32), batch=lambda s, x: x * 30)
    [calibration] = [e for e in events if e["details"].get("calibration")]
    assert calibration["details"]["skips"] >= 10  # (so the old streak rule would have called it a collapse)
    assert {e["severity"] for e in events} == {"info"}, [e["message"] for e in events if e["severity"] != "info"]


def test_nan_gradients_that_keep_coming_back_on_single_steps_are_reported_and_the_scale_below_1_is_a_collapse(
    memory,
) -> None:
    # A sqrt at 0 on some batches: each makes one NaN skip, the steps between are fine, and each skip halves the scale.
    def sometimes(step: int, model: torch.nn.Sequential) -> None:
        model[3].on = step in (60, 70, 80, 90)

    events = _loop(memory, 100, scaler=torch.amp.GradScaler("cpu", init_scale=8.0), before=sometimes)
    [grad] = [e for e in events if e["type"] == "nonfinite_grad" and "origin" not in e["details"]]
    assert (grad["severity"], grad["step"]) == ("warning", 80)
    assert "3 steps in the last 200 (60, 70, 80)" in grad["message"] and "came back" in grad["message"]
    [collapse] = [e for e in events if e["type"] == "scale_collapse"]
    assert (collapse["severity"], collapse["step"], collapse["details"]["scale_after"]) == ("critical", 90, 0.5)
    assert "below 1" in collapse["message"]


def test_inf_gradients_without_a_scaler_are_a_nonfinite_grad(memory) -> None:
    # bf16, no scaler: gradients 1e25 times too large are finite but their norm is inf, and Adam's state would be too.
    hooks = []

    def blow_up(step: int, model: torch.nn.Sequential) -> None:
        if step == 30:
            hooks.extend(p.register_hook(lambda g: g * 1e25) for p in model.parameters())

    disabled = torch.amp.GradScaler("cpu", enabled=False)
    events = _loop(memory, 40, dtype=torch.bfloat16, scaler=disabled, before=blow_up)
    grads = [e for e in events if e["type"] == "nonfinite_grad" and "origin" not in e["details"]]
    assert [(e["severity"], e["step"]) for e in grads][:1] == [("critical", 30)]
    assert grads[0]["message"].startswith("Inf gradients at step 30 with a finite loss")


def test_an_evaluation_pass_without_autocast_before_training_is_no_amp_config_warning(memory) -> None:
    def evaluate_first(step: int, model: torch.nn.Sequential) -> None:
        if step == 0:
            with torch.no_grad():
                model(torch.randn(4, 8))  # a baseline validation, in fp32

    assert not _of(_loop(memory, 3, before=evaluate_first), "amp_config")
    assert _of(_loop(memory, 3, before=evaluate_first, autocast=False), "amp_config")  # training without it still is


def _small_fp16_trainer() -> tuple[torch.nn.Sequential, torch.optim.SGD, torch.amp.GradScaler]:
    """The same small model every time (seeded), its SGD optimizer and a fresh GradScaler."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")


def _step(model: torch.nn.Module, optimizer: Any, scaler: Any, x: torch.Tensor, clip: bool = False) -> None:
    """One fp16 AMP step on batch `x`; `clip`: unscale_ and clip_grad_norm_, the loop of the agent's lean path."""
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    if clip:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()


class Functional(torch.nn.Module):
    """A sqrt at 0 in the parent's own forward, between two leaf modules: no hook sees it run."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.act, self.l2 = torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.l1(x))
        return self.l2(h + torch.sqrt(torch.relu(h) * 0.0) if self.on else h)


def test_a_backward_nan_made_between_two_modules_is_placed_between_them(memory) -> None:
    model = Functional()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("diag", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(90):
            model.on = step >= 60
            _step(model, optimizer, scaler, torch.randn(16, 8))
            if step == 61:
                assert run.flush()  # let the sender see the NaN and arm the probe
    [origin] = [e for e in _events(memory, run.id) if "origin" in e["details"]]
    assert origin["details"]["phase"] == "backward" and origin["details"]["origin"] == "l2"
    assert "or of an operation outside any module between `act` and `l2`" in origin["message"]


def test_a_learning_rate_past_the_stability_limit_diverges_into_a_grad_spike(memory) -> None:
    # Linear regression, SGD: at step 300 the learning rate goes just past 2 / the largest curvature, and the run
    # diverges a few % per step, which a rolling high end keeps up with: caught by the steps in a row above 10x the
    # median.
    torch.manual_seed(0)
    x = torch.randn(4096, 16) * torch.linspace(0.2, 1.0, 16)
    y = x @ torch.randn(16, 1) + 0.3 * torch.randn(4096, 1)
    curvature = torch.linalg.eigvalsh(2 * x.T @ x / len(x)).max().item()
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3 / curvature)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("diag", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(420):
            if step == 300:
                optimizer.param_groups[0]["lr"] = 1.04 * 2 / curvature
            batch = torch.randint(0, len(x), (512,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x[batch]).float(), y[batch])
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    events = _events(memory, run.id)
    [spike] = [e for e in events if e["type"] == "grad_spike"]
    assert 300 < spike["step"] < 420 and "steps in a row" in spike["message"]
    assert not [e for e in events if e["step"] < 300 and e["severity"] != "info"]  # the steady part before it is quiet


@pytest.mark.parametrize("clip", [True, False], ids=["lean path", "full path"])
def test_in_a_fast_loop_a_skipped_step_is_read_at_once_so_the_probe_names_the_next_bad_batch(
    memory, monkeypatch, clip
) -> None:
    # Sub-millisecond steps and a 60 s flush interval: the whole loop ends long before the sender's next timed read. A
    # skipped step wakes it (the optimizer's post-step hook says the step did not run: no host read), so the diagnosis
    # sees the first bad batch at once, arms the probe, and the probe names the input batch as the origin of a later
    # one.
    # The loop that clips after unscale_ runs on the agent's lean path (ampwatch._step_end), the other on the full one.
    monkeypatch.setenv("AMPWATCH_FLUSH_INTERVAL_S", "60")
    model, optimizer, scaler = _small_fp16_trainer()
    with ampwatch.init("diag", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        started = time.monotonic()
        for step in range(400):
            x = torch.randn(16, 8)
            if step >= 200 and step % 10 == 0:  # a bad batch now and then
                x[0, 0] = float("nan")
            _step(model, optimizer, scaler, x, clip=clip)
        took = time.monotonic() - started
    assert took < 60  # (the loop itself was quicker than one flush interval, even on a loaded machine)
    origins = [e for e in _events(memory, run.id) if "origin" in e["details"]]
    assert origins and origins[0]["details"]["origin"] == "(input batch)" and 210 <= origins[0]["step"] < 400


def test_a_bad_batch_that_comes_back_less_often_than_the_probe_stays_armed_is_still_named(memory) -> None:
    # Every 60 steps: each arming of the probe that ends without a hit lasts twice as long as the one before (20, 40,
    # 80 steps), so the third one, armed after step 140, is still armed at step 200 and names the input batch.
    def corrupt(step: int, x: torch.Tensor) -> torch.Tensor:
        if step % 60 == 20:
            x[2, 3] = float("nan")
        return x

    events = _loop(memory, 220, batch=corrupt, pause_after={20, 80, 140})
    assert [e["step"] for e in events if e["type"] == "nonfinite_loss" and "origin" not in e["details"]] == [
        20,
        80,
        140,
        200,
    ]
    [origin] = [e for e in events if "origin" in e["details"]]
    assert (origin["step"], origin["details"]["origin"]) == (200, "(input batch)")


def test_the_probe_window_doubles_after_a_miss_up_to_its_cap_and_resets_after_a_hit() -> None:
    from ampwatch._origin import ARM_STEPS, MAX_ARM_STEPS, OriginProbe

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())
    probe = OriginProbe(model)
    windows = []
    for missed in (False,) + (True,) * 6 + (False,):
        probe.arm(missed=missed)
        windows.append(probe.steps_left)
        assert probe.armed and model[0]._forward_hooks
        probe.disarm()
        assert not probe.armed and not model[0]._forward_hooks
    assert (
        windows
        == [ARM_STEPS * 2**k for k in range(5)] + [MAX_ARM_STEPS] * 2 + [ARM_STEPS]
        == [20, 40, 80, 160, 320, 320, 320, 20]
    )


def _by_hand(server: Any, steps: int, each: Callable[[int, Any, bool], None]) -> None:
    """A small fp16 loop whose recorder (private) `each(step, recorder, done)` drives by hand: before each step (done
    False), as the sender's diagnosis would, and after it (done True), to look at the probe."""
    model, optimizer, scaler = _small_fp16_trainer()
    with ampwatch.init("diag", transport=server) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(steps):
            each(step, run._recorder, False)
            _step(model, optimizer, scaler, torch.randn(16, 8))
            each(step, run._recorder, True)


def test_an_event_the_last_arming_saw_or_was_armed_after_does_not_arm_the_probe_again(memory) -> None:
    # The sender reads steps late: an event it reports after the probe was armed for it (or at a step the probe was
    # armed through) would make a second arming find the same origin again.
    requests = {10: 9, 35: 20, 40: 30, 50: 5, 100: 95}  # step -> the step of the event the diagnosis asks an arming for
    armed = []

    def each(step: int, recorder: Any, done: bool) -> None:
        if done:
            armed.append(recorder._probe.armed)
        elif step in requests:
            recorder.mailbox.arm_step, recorder.mailbox.arm_request = requests[step], True

    _by_hand(memory, 120, each)
    # Armed after step 10 through step 30 (20 steps), not for the events at 20 and 30 it covered; for the one at 5
    # (before the arming's own event: a step numbered otherwise) for 40 steps after a miss; for the one at 95 for 80.
    assert [step for step, on in enumerate(armed) if on] == [*range(10, 30), *range(50, 90), *range(100, 120)]


@pytest.mark.parametrize("order", ["skipped first", "skipped second"])
def test_a_skip_of_one_of_two_optimizers_wakes_the_sender_whichever_steps_first(memory, monkeypatch, order) -> None:
    # One scaler, two models and optimizers (the AMP docs' loop): NaN in model 0's batch only, so its step is skipped
    # and the other's runs. The skip must wake the sender (5 s flush interval: the loop is over long before) also when
    # the skipped optimizer steps first and the other's post-step hook fires after it.
    monkeypatch.setenv("AMPWATCH_FLUSH_INTERVAL_S", "60")
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)) for _ in range(2)]
    optimizers = [torch.optim.SGD(model.parameters(), lr=1e-3) for model in models]
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("diag", transport=memory) as run:
        run.watch(model=models[0], optimizer=optimizers, scaler=scaler)
        started = time.monotonic()
        for step in range(400):
            x = torch.randn(16, 8)
            bad = x.clone()
            if step >= 200 and step % 10 == 0:
                bad[0, 0] = float("nan")
            with torch.autocast("cpu", dtype=torch.float16):
                losses = [models[0](bad).float().pow(2).mean(), models[1](x).float().pow(2).mean()]
            for loss in losses:
                scaler.scale(loss).backward()
            for optimizer in optimizers if order == "skipped first" else optimizers[::-1]:
                scaler.step(optimizer)
            scaler.update()
            for optimizer in optimizers:
                optimizer.zero_grad()
        took = time.monotonic() - started
    assert took < 60  # (quicker than one flush interval)
    origins = [e for e in _events(memory, run.id) if "origin" in e["details"]]
    assert origins and origins[0]["details"]["origin"] == "(input batch)" and 210 <= origins[0]["step"] < 400


def test_a_hit_the_sender_reports_after_the_arming_ended_still_resets_the_next_window(memory) -> None:
    # In a fast loop the sender may read the probe's hit only after its window ended; the next arming must still take
    # the short window (a hit), not twice the last (a miss).
    windows = []

    def each(step: int, recorder: Any, done: bool) -> None:
        if step in (10, 40, 100):  # events the diagnosis asks an arming for (the last two after a window ended)
            if done:
                windows.append(recorder._probe.window)
            else:
                recorder.mailbox.arm_step, recorder.mailbox.arm_request = step - 1, True
        if step == 35:
            recorder.mailbox.origin_found = 1  # the first arming's hit, read after its window (steps 11 to 30) ended

    _by_hand(memory, 140, each)
    assert windows == [20, 20, 40]  # the second arming missed (no hit reported for it): the third lasts twice as long


def test_once_an_origin_is_named_the_same_bad_batch_does_not_arm_the_probe_again_for_a_while(memory) -> None:
    # A bad batch every 20 steps from step 100: without a quiet period every event past a window re-armed the probe
    # (each arming costs its steps time) and named the same origin again, every 40 steps. (tests/test_demo.py: after a
    # first naming the probe arms again, for the next problem.)
    model, optimizer, scaler = _small_fp16_trainer()
    armed = 0
    with ampwatch.init("diag", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(500):
            x = torch.randn(16, 8)
            bad = step >= 100 and step % 20 == 0
            if bad:
                x[0, 0] = float("nan")
            _step(model, optimizer, scaler, x)
            armed += run._recorder._probe.armed  # (private: whether the probe is armed)
            if bad:
                assert run.flush()  # the skip woke the sender: let it read the step before the loop goes on
    origins = [e["step"] for e in _events(memory, run.id) if "origin" in e["details"]]
    # Armed after step 100, named at 120; armed after 140, named again at 160: the events of steps 160 to 359 arm
    # nothing; armed after 360, named at 380 a third time: the events of the next 400 steps (to the end) arm nothing.
    assert origins == [120, 160, 380]
    assert armed == 60
