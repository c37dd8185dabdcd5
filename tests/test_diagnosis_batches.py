"""The analyzer reads a whole batch at once and absorbs calm stretches in bulk: it must reach exactly the
events and the state that judging every step one by one reaches, whatever the batch boundaries."""

from __future__ import annotations

import copy
import math
import random
from collections import deque
from typing import Any

import pytest

from ampwatch._diagnose import Analyzer, Columns, Thresholds
from ampwatch._median import RollingMedian


def _series(rng: random.Random, steps: int) -> list[dict[str, float]]:
    """One run's standard values per step: drifting loss and norm, growth and backoff of the scale, and now
    and then a skip streak, a NaN or inf, a spike, a schedule step, or a negative loss."""
    out, loss, norm, scale, lr, good = [], 2.0, 1.0, 65536.0, 1e-3, 0
    streak = 0
    for step in range(steps):
        loss = max(1e-3, loss * rng.uniform(0.97, 1.02))
        norm = max(1e-3, norm * rng.uniform(0.9, 1.1))
        values = {"loss": loss, "grad_norm": norm, "lr": lr}
        event = rng.random()
        if streak or event < 0.01:
            streak = streak + 1 if streak < rng.choice([1, 3, 12]) else 0
        skipped = streak > 0 or step < 4
        if event < 0.004:
            values["loss"] = rng.choice([math.nan, math.inf, -math.inf])
        elif event < 0.008:
            values["grad_norm"] = rng.choice([math.nan, math.inf])
        elif event < 0.014:
            values["grad_norm"] = norm * rng.uniform(5, 40)
        elif event < 0.018:
            values["loss"] = loss * rng.uniform(3, 20)
        elif event < 0.020:
            values["loss"] = -loss
        if rng.random() < 0.01:
            lr *= 0.5
        if scale_present := rng.random() > 0.002:
            values["scale"], values["skipped"] = scale, float(skipped)
        if step % 50 == 0:
            values["param_norm"] = math.nan if event > 0.998 else 30.0
        out.append(values)
        if scale_present:
            if skipped:
                scale, good = scale / 2, 0
            else:
                good += 1
                scale, good = (scale * 2, 0) if good == 20 else (scale, good)
    return out


def _columns(rows: list[tuple[int, dict[str, float]]]) -> Columns:
    columns: Columns = {}
    for step, values in rows:
        for name, value in values.items():
            series = columns.setdefault(name, ([], []))
            series[0].append(step)
            series[1].append(value)
    return columns


def _comparable(events: list[dict[str, Any]]) -> list[tuple]:
    return [(e["step"], e["type"], e["severity"], e["message"]) for e in events]


PARTS = ("context", "trends", "skips", "nonfinite", "schedule", "leading")
REFERENCES = ("_context", "_trends", "_skips", "_event", "event")  # (another part, or the analyzer's event maker)


def _plain(value: Any) -> Any:
    """A part's state as plain values that compare equal when the state is the same."""
    if isinstance(value, RollingMedian):
        return list(value._order), list(value._sorted)
    if isinstance(value, deque):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if hasattr(value, "__dict__") and not isinstance(value, Thresholds):
        return {key: _plain(item) for key, item in vars(value).items() if key not in REFERENCES}
    return copy.deepcopy(value)


def _state(analyzer: Analyzer) -> dict[str, Any]:
    state = {name: _plain(getattr(analyzer, name)) for name in PARTS}
    assert set(vars(analyzer)) == {*PARTS, "rank"}  # (a part added here is compared too)
    skipped_at = state["schedule"]["_skipped_at"]  # (the scheduler check reads the last two steps only)
    state["schedule"]["_skipped_at"] = {k: v for k, v in skipped_at.items() if k >= max(skipped_at, default=0) - 1}
    return state


@pytest.mark.parametrize("seed", range(40))
def test_batches_reach_the_same_events_and_state_as_step_by_step(seed: int) -> None:
    rng = random.Random(seed)
    rows = list(enumerate(_series(rng, 1500)))
    one_by_one, batched = Analyzer(), Analyzer()
    expected = [e for step, values in rows for e in one_by_one.observe(step, values)]
    got, at = [], 0
    while at < len(rows):
        size = rng.choice([1, 7, 50, 200, 400])
        got.extend(batched.observe_columns(_columns(rows[at : at + size])))
        at += size
    assert _comparable(got) == _comparable(expected)
    assert _state(batched) == _state(one_by_one)


def test_a_calm_batch_is_absorbed_in_bulk() -> None:
    analyzer = Analyzer()
    rows = [
        (s, {"loss": 1.0 + 0.001 * s, "grad_norm": 0.5, "scale": 65536.0, "skipped": 0.0, "lr": 1e-3})
        for s in range(60)
    ]
    analyzer.observe_columns(_columns(rows))  # through start-up calibration, one by one
    assert not analyzer.skips.calibrating
    calm = _columns(
        [(s, {"loss": 1.1, "grad_norm": 0.6, "scale": 65536.0, "skipped": 0.0, "lr": 1e-3}) for s in range(60, 260)]
    )
    assert analyzer._absorb_calm(calm)
    spiky = _columns([(260, {"loss": 1.1, "grad_norm": 60.0, "scale": 65536.0, "skipped": 0.0})])
    assert not analyzer._absorb_calm(spiky)
    assert [e["type"] for e in analyzer.observe_columns(spiky)] == ["grad_spike"]


def test_state_stays_small_when_steps_are_not_contiguous() -> None:
    analyzer = Analyzer()
    for step in range(0, 50_000, 10):  # a loop that counts samples, say
        analyzer.observe(step, {"scale": 1024.0, "skipped": 0.0, "lr": 1e-3})
    assert len(analyzer.schedule._skipped_at) <= 2


def test_noisy_losses_are_no_spikes_and_a_jump_from_a_negative_loss_is() -> None:
    rng = random.Random(0)
    noisy = Analyzer()  # batch size 1: squared errors (median ~0.45, 14x it now and then), norms as noisy
    events = [
        e
        for step in range(2000)
        for e in noisy.observe(step, {"loss": rng.gauss(0, 1) ** 2, "grad_norm": rng.expovariate(1)})
    ]
    assert not events, [e["message"] for e in events]
    steady = Analyzer()  # ... while a steady loss still spikes at 5x its median
    events = [e for step in range(100) for e in steady.observe(step, {"loss": 2.0 + rng.gauss(0, 0.01)})]
    assert not events and [e["type"] for e in steady.observe(100, {"loss": 10.5})] == ["loss_spike"]
    nll = Analyzer()  # a negative log-likelihood, noisy around -1.7
    events = [e for step in range(300) for e in nll.observe(step, {"loss": -1.7 + rng.gauss(0, 0.05)})]
    assert not events
    [spike] = nll.observe(300, {"loss": 1474638.0})
    assert spike["type"] == "loss_spike" and "interquartile ranges above its median" in spike["message"]


def test_a_loss_logged_before_its_optimizer_step_arrives_a_batch_early_and_still_counts() -> None:
    # run.log({"loss": loss}) before the optimizer step (as with Accelerate): the NaN loss of step 7 can be in one batch
    # and step 7's gradient norm in the next. No "NaN gradients with a finite loss" then.
    analyzer = Analyzer()
    assert [e["type"] for e in analyzer.observe_columns({"loss": ([7], [math.nan])})] == ["nonfinite_loss"]
    assert analyzer.observe_columns({"grad_norm": ([7], [math.nan]), "lr": ([7], [1e-3])}) == []
    unknown = Analyzer()  # a NaN norm where no loss was recorded at all does not claim the loss was finite
    [grad] = unknown.observe_columns({"grad_norm": ([3], [math.nan])})
    assert (
        grad["type"] == "nonfinite_grad"
        and "(no loss recorded)" in grad["message"]
        and "finite loss" not in grad["message"]
    )


def test_nan_skips_each_right_after_the_scale_grew_are_overflow_not_a_recurring_nan() -> None:
    # growth_interval 10: every 10 applied steps the scale doubles, and the next step overflows to NaN (inf - inf) and
    # is skipped back down. NaN that comes back at a scale steps were applied at would be reported (see
    # test_diagnosis_alarms.py); at a higher one, it is the scale's healthy oscillation.
    analyzer, scale, good, events = Analyzer(), 1024.0, 0, []
    for step in range(300):
        overflow = scale >= 2048  # fp16 overflows above 2^10 here
        values = {"loss": 1.0, "grad_norm": math.nan if overflow else 0.5, "scale": scale, "skipped": float(overflow)}
        events += analyzer.observe(step, values)
        scale, good = (scale / 2, 0) if overflow else (scale * 2, 0) if good == 9 else (scale, good + 1)
    assert sum(e["details"].get("streak") == 1 and e["type"] == "nonfinite_grad" for e in events) == 0, [
        e["message"] for e in events
    ]
    assert {e["severity"] for e in events} <= {"info"}


def test_isolated_overflows_that_take_the_scale_below_1_are_no_collapse() -> None:
    # Gradients near fp16's limit (a sum-reduced loss): the scale settles at 1, and two overflows 200 steps apart take
    # it to 0.5 and back. Skips that keep coming back there would be a collapse.
    def run(skips: set[int]) -> list[str]:
        analyzer, scale, events = Analyzer(), 1.0, []
        for step in range(600):
            events += analyzer.observe(
                step,
                {
                    "loss": 1e7,
                    "grad_norm": math.inf if step in skips else 1e4,
                    "scale": scale,
                    "skipped": float(step in skips),
                },
            )
            scale = scale / 2 if step in skips else scale
        return [e["type"] for e in events if e["severity"] != "info"]

    assert run({190, 390}) == []
    assert run({190, 250, 300}) == ["scale_collapse"]


def test_nan_from_the_first_step_on_is_a_collapse_and_no_miscounted_streak_after_calibration() -> None:
    analyzer, scale, events = Analyzer(), 65536.0, []
    for step in range(70):  # every step NaN and skipped, past the calibration window
        events += analyzer.observe(step, {"loss": 1.0, "grad_norm": math.nan, "scale": scale, "skipped": 1.0})
        scale /= 2
    assert [e["type"] for e in events if e["severity"] != "info"] == ["scale_collapse"]
