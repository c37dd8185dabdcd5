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
    assert series["steps"][:3] == [10, 20, 30]  # one value per interval step (not step 0: see ampwatch._indicators)


def test_under_bf16_the_range_is_recorded_without_an_fp16_warning(memory) -> None:
    model, optimizer = _growing()
    run_id = _train(memory, model, optimizer, 500, _positive, _towards_1e5, dtype=torch.bfloat16)
    values = memory.series(run_id, "fp16_range/2")["fp16_range/2"]["values"]
    assert max(values) > 1.0  # past 65 504: bf16 holds it
    assert not _warnings(memory, run_id, "fp16_range"), _warnings(memory, run_id, "fp16_range")


def _first_failure(memory: Any, run_id: str) -> int:
    """The step of the run's first sign of trouble the diagnosis reports: a spike, a non-finite value, a skip that is
    more than calibration, a collapse."""
    return next(e["step"] for e in memory.events(run_id) if e["severity"] != "info" and "indicator" not in e["details"])


# -- update-to-weight ratio ----------------------------------------------------------------------------------------


def test_update_ratio_warns_of_a_learning_rate_that_runs_away_before_the_divergence(memory) -> None:
    """A schedule gone wrong at step 400 (a restart at 30 times the learning rate, which then keeps growing 1% a
    step): the update ratio is an order of magnitude above its usual well before the updates diverge into spikes
    and NaN."""
    torch.manual_seed(0)
    teacher = torch.randn(8, 1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def lr(step: int) -> None:
        optimizer.param_groups[0]["lr"] = 1e-3 if step < 400 else 3e-2 * 1.01 ** (step - 400)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        x = torch.randn(32, 8)
        return x, x @ teacher + 0.3 * torch.randn(32, 1)

    run_id = _train(memory, model, optimizer, 650, batch, _mse, before=lr)
    failure = _first_failure(memory, run_id)
    warnings = _warnings(memory, run_id, "update_ratio")
    assert warnings and warnings[0]["type"] == "leading_indicator", memory.events(run_id)
    assert warnings[0]["step"] > 400  # (not before the learning rate began to run away)
    assert failure - warnings[0]["step"] >= LEAD, (failure, warnings[0]["message"])
    assert memory.series(run_id, "update_ratio/1")["update_ratio/1"]["steps"][0] == 10  # (no step before the first)


def _mse(out: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return ((out - inputs[1]) ** 2).mean()


def test_update_ratio_is_quiet_when_one_layer_of_several_starts_learning(memory) -> None:
    """An auxiliary head whose loss weight warms up from ~1e-13 (a sigmoid): its gradients leave Adam's eps and its
    update ratio jumps more than an order of magnitude against its own history, alone. A learning rate moves every
    layer's update; one layer alone is no warning."""
    torch.manual_seed(0)
    teacher = torch.randn(8, 1)

    class Heads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
            self.head, self.aux = torch.nn.Linear(16, 1), torch.nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.body(x)
            return torch.cat([self.head(hidden), self.aux(hidden)], 1)

    model = Heads()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    aux_weight = [0.0]

    def warm_up(step: int) -> None:
        aux_weight[0] = 1 / (1 + math.exp(-(step - 300) / 10))

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        x = torch.randn(32, 8)
        return x, x @ teacher + 0.3 * torch.randn(32, 1), (x[:, :1] > 0).float()

    def loss_of(out: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        aux = torch.nn.functional.binary_cross_entropy_with_logits(out[:, 1:], inputs[2])
        return ((out[:, :1] - inputs[1]) ** 2).mean() + aux_weight[0] * aux

    run_id = _train(memory, model, optimizer, 600, batch, loss_of, before=warm_up)
    ratios = memory.series(run_id, "update_ratio/aux")["update_ratio/aux"]["values"]
    assert max(ratios[15:]) > 10 * sorted(ratios[5:12])[3], ratios  # (the look-alike is there: one layer jumped)
    assert not _warnings(memory, run_id, "update_ratio"), [e["message"] for e in memory.events(run_id)]


def test_update_ratio_warns_when_most_layers_jump_together() -> None:
    """The same jump in one layer of four is no warning; in three of four it is, naming the largest."""
    from ampwatch._leading import Leading

    def warned(jumping: int) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        leading = Leading(
            lambda step, kind, severity, message, details: {"step": step, "message": message, "details": details}
        )
        for i in range(40):
            noise = 1.3 if i % 3 == 0 else 0.8 if i % 3 == 1 else 1.0
            columns = {
                f"update_ratio/l{n}": ([10 * i], [1e-4 * noise * ((20 + n) if n < jumping and i >= 20 else 1)])
                for n in range(4)
            }
            events += leading.observe_columns(columns)
        return events

    assert warned(1) == []
    events = warned(3)
    assert [e["step"] for e in events] == [210], events  # (two interval steps in a row)
    assert events[0]["details"]["layers"] == ["l2", "l1", "l0"] and "3 of 4 layers" in events[0]["message"]


def test_update_ratio_warns_of_a_steady_climb_its_rolling_median_follows() -> None:
    """A learning rate that grows a little each step (gamma 1.01 for 0.99): the ratio climbs 7 % an interval, so its
    rolling median climbs with it and never falls an order of magnitude behind; the climb is the warning. The same
    ratio held flat at its noise gets none."""
    from ampwatch._leading import Leading

    def warned(climb: float) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        leading = Leading(lambda step, kind, severity, message, details: {"step": step, "details": details})
        for i in range(150):
            ratio = 1e-4 * (1.0 if i < 60 else climb ** (i - 60)) * (1.3 if i % 3 == 0 else 0.8 if i % 3 == 1 else 1)
            events += leading.observe_columns({"update_ratio/conv1": ([10 * i], [ratio])})
        return events

    climbing = warned(1.07)
    assert climbing and climbing[0]["details"]["indicator"] == "update_ratio", climbing
    assert 60 * 10 < climbing[0]["step"] <= 110 * 10, climbing[0]  # (within 40-odd intervals of the climb's start)
    assert warned(1.0) == []


# -- Adam's second-moment lag --------------------------------------------------------------------------------------


class _TwoInputs(torch.nn.Module):
    """An MLP on the first 8 features plus a linear layer on 4 more (a second input stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.main = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.extra = torch.nn.Linear(4, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x[:, :8]) + self.extra(x[:, 8:])


def _waking_inputs(
    memory: Any, model: Callable[[], torch.nn.Module], inputs: int, waking: int
) -> tuple[str, dict[str, Any]]:
    """Adam on `inputs` standardized features followed by `waking` ones near 0 for 300 steps that then grow 5% a step
    (the target ignores them); returns the run's id and its first `adam_lag` warning, which must come `LEAD` steps or
    more before the failure."""
    torch.manual_seed(0)
    teacher = torch.randn(inputs, 1)
    watched = model()
    optimizer = torch.optim.Adam(watched.parameters(), lr=1e-2)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        x = torch.randn(32, inputs)
        extra = torch.randn(32, waking) * min(100.0, 1e-3 * 1.05 ** max(0, step - 300))
        return torch.cat([x, extra], 1), x @ teacher + 0.1 * torch.randn(32, 1)

    run_id = _train(memory, watched, optimizer, 550, batch, _mse)
    failure = _first_failure(memory, run_id)
    warnings = _warnings(memory, run_id, "adam_lag")
    assert warnings, memory.events(run_id)
    first = warnings[0]
    assert first["type"] == "leading_indicator" and 300 < first["step"], first["message"]
    assert failure - first["step"] >= LEAD, (failure, first["message"])
    return run_id, first


def test_adam_lag_warns_when_a_layers_gradients_outgrow_its_second_moment_before_the_spikes(memory) -> None:
    """The second input stream is near 0 for 300 steps, then grows 5% a step: its layer's gradients grow faster than
    Adam's exp_avg_sq can follow, long before the loss and gradient spikes that brings."""
    run_id, first = _waking_inputs(memory, _TwoInputs, 8, 4)
    assert first["details"]["layer"] == "extra", first["message"]
    lags = memory.series(run_id, "adam_lag/main.0")["adam_lag/main.0"]["values"]
    assert all(0 < v < 20 for v in lags[:30])  # (a layer whose moment keeps up: about 1 or below)


def test_adam_lag_warns_when_one_input_of_a_layer_wakes_before_the_spikes(memory) -> None:
    """One input of sixteen, near 0 for 300 steps, then growing 5% a step, into the same first layer as the others:
    summed over the layer its gradients are diluted by the fifteen whose moment keeps up, but its own column of the
    weight lags, and says so long before the spikes."""

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    _, first = _waking_inputs(memory, model, 15, 1)
    assert first["details"]["layer"] == "0", first["message"]


def test_adam_lag_warns_of_a_lag_that_lasts_not_of_a_burst() -> None:
    """Adam's lag at its limit at 3 of the last 4 interval steps warns, one step below it in between or not; two high
    steps that the moment then absorbs do not."""
    from ampwatch._leading import Leading

    def warned(highs: set[int]) -> list[int]:
        events: list[dict[str, Any]] = []
        leading = Leading(lambda step, kind, severity, message, details: {"step": step, "details": details})
        for i in range(40):
            events += leading.observe_columns({"adam_lag/fc": ([10 * i], [50.0 if i in highs else 1.0])})
        return [e["step"] for e in events]

    assert warned({20, 21}) == []  # (a burst of hard batches)
    assert warned({20, 21, 23}) == [230]  # (an input that keeps growing, near 0 in one batch)
    assert warned({20, 22, 24}) == []
    assert warned(set(range(20, 40))) == [220]


# -- healthy runs ---------------------------------------------------------------------------------------------------


def test_no_indicator_warns_over_thousands_of_healthy_fp16_steps(memory) -> None:
    """A classifier trained with Adam under fp16 autocast and GradScaler, with a warm-up and a cosine decay."""
    torch.manual_seed(1)
    centers = torch.randn(4, 16) * 2
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: min(1.0, (i + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(i, 3000) / 3000))
    )

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        labels = torch.randint(0, 4, (32,))
        return centers[labels] + torch.randn(32, 16), labels

    def loss_of(out: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out, inputs[1])

    run_id = _train(memory, model, optimizer, 3000, batch, loss_of, before=lambda step: step and schedule.step())
    series = memory.run(run_id)["series"]
    assert {"fp16_range/0", "fp16_range/3", "update_ratio/0", "adam_lag/3"} <= set(series)
    assert not _indicator_warnings(memory, run_id), [e["message"] for e in _indicator_warnings(memory, run_id)]


def test_adam_lag_is_quiet_when_a_dead_hidden_unit_revives(memory) -> None:
    """A hidden unit dead for 200 steps (no gradient reaches it or its column of the head) comes back to life: its
    column of the head wakes from a moment of 0 as an input would, but it is the model's own learning, and the head's
    lag over all its columns stays low."""
    torch.manual_seed(0)
    teacher = torch.randn(8, 1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    def revive(step: int) -> None:
        with torch.no_grad():
            if step == 0:
                model[0].weight[0], model[0].bias[0] = 0.0, -1.0
            elif step == 200:
                model[0].bias[0] = 1.0

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        x = torch.randn(32, 8)
        return x, x @ teacher + 0.3 * torch.randn(32, 1)

    run_id = _train(memory, model, optimizer, 400, batch, _mse, before=revive)
    assert len(memory.series(run_id, "adam_lag/2")["adam_lag/2"]["steps"]) >= 35
    assert not _indicator_warnings(memory, run_id), [e["message"] for e in _indicator_warnings(memory, run_id)]


def test_no_indicator_warns_over_thousands_of_healthy_bf16_steps(memory) -> None:
    """A regression trained with SGD and momentum under bf16 autocast (no GradScaler)."""
    torch.manual_seed(2)
    teacher = torch.randn(8, 1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=2e-2, momentum=0.9)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        x = torch.randn(32, 8)
        return x, torch.tanh(x @ teacher) + 0.1 * torch.randn(32, 1)

    run_id = _train(memory, model, optimizer, 2500, batch, _mse, dtype=torch.bfloat16)
    series = memory.run(run_id)["series"]
    assert {"fp16_range/0", "update_ratio/0", "update_ratio/2"} <= set(series)
    assert not any(name.startswith("adam_lag/") for name in series)  # (SGD has no second moment)
    assert not _indicator_warnings(memory, run_id), [e["message"] for e in _indicator_warnings(memory, run_id)]
