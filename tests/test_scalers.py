"""The scaler variants and shapes of loop the agent must not break: several optimizers, the legacy
torch.cuda.amp.GradScaler, a disabled scaler, state_dict round trips mid-run."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _runs import clipped_step

import ampwatch


def test_two_optimizers_with_one_scaler_record_one_step_per_update(memory) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    first = torch.optim.AdamW(model[0].parameters())
    second = torch.optim.SGD(model[2].parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    expected = []
    with ampwatch.init("scalers", "two-optimizers", transport=memory) as run:
        run.watch(model=model, optimizer=[first, second], scaler=scaler)
        for _ in range(6):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            grads = [p.grad for p in model.parameters()]
            expected.append((torch.nn.utils.get_total_norm(grads) / scaler.get_scale()).item())
            scaler.step(first)
            scaler.step(second)
            scaler.update()
            first.zero_grad()
            second.zero_grad()
    data = memory.series(run.id, ["grad_norm", "skipped"])
    assert data["grad_norm"]["steps"] == list(range(6))
    assert data["grad_norm"]["values"] == pytest.approx(expected, rel=1e-5)  # one norm over both optimizers


@pytest.mark.skipif(torch.cuda.is_available(), reason="covers the disabled legacy scaler a machine without CUDA builds")
def test_the_legacy_cuda_scaler_is_watched_without_breaking(memory) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated, and disabled without CUDA
        scaler = torch.cuda.amp.GradScaler()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampwatch.init("scalers", "legacy", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        assert isinstance(scaler, torch.cuda.amp.GradScaler)
        for _ in range(3):
            scaler.scale(model(torch.randn(2, 4)).pow(2).mean()).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    assert type(scaler) is torch.cuda.amp.GradScaler
    data = memory.series(run.id, ["loss", "grad_norm"])
    assert not scaler.is_enabled()  # so steps were counted through the optimizer
    assert data["loss"]["steps"] == data["grad_norm"]["steps"] == [0, 1, 2]


def test_state_dict_round_trip_mid_run_keeps_scaling_and_recording(memory) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    with ampwatch.init("scalers", "checkpoint", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(6):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(2, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if step == 2:
                saved = scaler.state_dict()
                scaler.load_state_dict({**saved, "scale": 64.0})  # resume from a checkpoint with another scale
    data = memory.series(run.id, "scale")
    assert data["scale"]["values"] == [512.0, 512.0, 512.0, 64.0, 64.0, 64.0]


def _scale_loop(
    run: ampwatch.Run, scaler: torch.amp.GradScaler, steps: int, before: Callable[[int, Any], Any]
) -> list[float]:
    """An fp16 AMP loop on a linear model; `before(step, scaler)` runs first at each step and returns the scaler
    to go on with. Returns the scale each step ran with (read after scale(): the test may sync)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.watch(model=model, optimizer=optimizer, scaler=scaler)
    used = []
    for step in range(steps):
        scaler = before(step, scaler)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(2, 4)).float().pow(2).mean()
        scaler.scale(loss).backward()
        used.append(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return used


def test_a_growth_rule_changed_mid_run_keeps_the_scale_series_exact(memory) -> None:
    def before(step: int, scaler: Any) -> Any:
        if step == 3:  # the agent copies the rule only along with a scale anchor: these setters must re-anchor
            scaler.set_growth_factor(4.0)
        return scaler

    with ampwatch.init("scalers", "growth-rule", transport=memory) as run:
        used = _scale_loop(run, torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2), 8, before)
    data = memory.series(run.id, "scale")
    assert used == [8.0, 8.0, 16.0, 16.0, 64.0, 64.0, 256.0, 256.0]
    assert data["scale"]["values"] == used


def test_a_new_scaler_watched_mid_run_is_shadowed_from_its_own_scale(memory) -> None:
    # (e.g. a training script that rebuilds its scaler when it resumes from a checkpoint without one)
    def before(step: int, scaler: Any) -> Any:
        if step == 4:
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
            run.watch(scaler=scaler)
        return scaler

    with ampwatch.init("scalers", "new-scaler", transport=memory) as run:
        used = _scale_loop(run, torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2), 8, before)
    data = memory.series(run.id, ["scale", "lr"])
    assert used == [8.0, 8.0, 16.0, 16.0, 1024.0, 1024.0, 1024.0, 2048.0]
    assert data["scale"]["steps"] == list(range(8))
    assert data["scale"]["values"] == used
    assert data["lr"]["steps"] == list(range(8))  # the optimizer watched first is still watched


def _clipping_loop(
    run: ampwatch.Run, steps: int, clip: Any, params_to_clip: Callable[[torch.nn.Module], Any], amp: str
) -> list[float]:
    """A loop that clips every step: after unscale_ under fp16; under bf16 with no scaler; in fp32 with a disabled
    scaler it never calls (nothing but the clip says when its gradients are final). Returns the true (pre-clip)
    gradient norm of every step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=amp == "fp16")
    run.watch(model=model, optimizer=optimizer, scaler=None if amp == "bf16" else scaler)
    norms = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16 if amp == "bf16" else torch.float16, enabled=amp != "fp32"):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward() if amp == "fp16" else loss.backward()
        if amp == "fp16":
            scaler.unscale_(optimizer)
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        clip(params_to_clip(model), 1e-3)  # clips every step: a norm read after it would be 1e-3
        if amp == "fp16":
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    return norms


@pytest.mark.parametrize("amp", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("how", ["module attribute", "imported before watch", "a subset"])
def test_grad_norm_is_the_true_norm_whether_or_not_the_clip_can_be_reused(
    memory, monkeypatch, how: str, amp: str
) -> None:
    """`torch.nn.utils.clip_grad_norm_(model.parameters())` hands its result to the agent, which then skips its
    own norm; a function imported earlier, or a clip of some parameters only, leaves the agent to compute it:
    after unscale_ with a scaler, just before the clip changes the gradients without one."""
    calls = []
    foreach_norm = torch._foreach_norm
    monkeypatch.setattr(
        torch, "_foreach_norm", lambda *a, **k: calls.append(1) or foreach_norm(*a, **k)
    )  # counts clip's and ours
    original, inner = torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad._clip_grads_with_norm_
    clip = (
        (lambda params, max_norm: torch.nn.utils.clip_grad_norm_(params, max_norm))
        if how != "imported before watch"
        else original
    )
    subset = how == "a subset"
    with ampwatch.init("scalers", f"clip-{how}-{amp}", transport=memory) as run:
        expected = _clipping_loop(
            run, 60, clip, (lambda m: m[2].parameters()) if subset else (lambda m: m.parameters()), amp
        )
        reused = torch.nn.utils.clip_grad_norm_ is not original
        hooked = torch.nn.utils.clip_grad._clip_grads_with_norm_ is not inner
    assert reused and hooked == (amp != "fp16")  # the wrappers are in place while the run watches...
    assert (
        torch.nn.utils.clip_grad_norm_ is original and torch.nn.utils.clip_grad._clip_grads_with_norm_ is inner
    )  # ...and gone after
    data = memory.series(run.id, "grad_norm")
    assert data["grad_norm"]["steps"] == list(range(60))
    assert data["grad_norm"]["values"] == pytest.approx(expected, rel=1e-5)
    assert min(expected) > 1e-2  # so a norm of the clipped gradients would fail the comparison
    # Per step, one norm is this test's and one the clip's; the agent adds its own only where it cannot reuse the
    # clip's, and on its per-layer and parameter-check steps (0, 50 and 0, 50 here) whatever happens, where the
    # leading indicators take three more (the update's and the weights' norms, the sums of Adam's moments).
    assert len(calls) == 2 * 60 + (4 if how == "module attribute" else 60 + 2) + 2 * 3


def test_a_param_group_added_mid_run_that_the_clip_does_not_cover_loses_no_norm(memory) -> None:
    """Layers unfrozen into a new parameter group while the loop still clips only the old ones: from that step the
    clip's result is no longer the optimizer's norm, and the agent takes its own, before the clip, at that very step."""
    torch.manual_seed(0)
    body, head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    model = torch.nn.Sequential(body, torch.nn.ReLU(), head)
    head.requires_grad_(False)
    optimizer = torch.optim.SGD(body.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    expected = []
    with ampwatch.init("scalers", "add-param-group", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(160):
            if step == 120:  # between the agent's planned steps (multiples of 50): on its lean path
                head.requires_grad_(True)
                optimizer.add_param_group({"params": head.parameters()})
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            expected.append(torch.nn.utils.get_total_norm(grads).item())
            torch.nn.utils.clip_grad_norm_(body.parameters(), 1e-3)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    data = memory.series(run.id, "grad_norm")
    assert data["grad_norm"]["steps"] == list(range(160))  # step 120's was lost before
    assert data["grad_norm"]["values"] == pytest.approx(expected, rel=1e-5)


def _series_of(server: Any, run_id: str, *names: str) -> dict[str, Any]:
    return server.series(run_id, list(names))


def test_a_two_step_clip_without_a_scaler_records_the_norm_before_it(memory) -> None:
    """torchtitan's clip: `get_total_norm`, then `torch.nn.utils.clip_grads_with_norm_` (a generator of parameters)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    expected, clipped = [], []
    with ampwatch.init("scalers", "two-step-clip", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer)
        for _ in range(8):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean() * 100
            loss.backward()
            total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            expected.append(total.item())
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1e-3, total)
            clipped.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
            optimizer.step()
            optimizer.zero_grad()
    assert max(clipped) < 1.1e-3 < min(expected)  # the clip still clipped (the generator reached it whole)
    assert _series_of(memory, run.id, "grad_norm")["grad_norm"]["values"] == pytest.approx(expected, rel=1e-5)


def test_the_norm_of_fp16_gradients_does_not_overflow_where_none_of_them_does(memory) -> None:
    """`model.half()` without a scaler: 65 536 gradients of 400 have a norm of 102 400, past fp16's 65 504."""
    weight = torch.nn.Parameter(torch.zeros(65536, dtype=torch.float16))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    with ampwatch.init("scalers", "half-norm", transport=memory) as run:
        run.watch(optimizer=optimizer)
        for _ in range(3):
            (weight * 400).float().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert _series_of(memory, run.id, "grad_norm")["grad_norm"]["values"] == [102400.0] * 3


@pytest.mark.parametrize("enabled", [True, False])
def test_a_learning_rate_that_is_an_int_or_a_numpy_scalar_is_recorded(memory, enabled: bool) -> None:
    import numpy

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1)  # (an int, as written)
    scaler = torch.amp.GradScaler("cpu", enabled=enabled)  # (disabled: steps through the optimizer's hooks)
    lrs = []
    with ampwatch.init("scalers", f"lr-types-{enabled}", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(120):  # (past step 100: the lean path's lean steps too)
            if step >= 60:
                optimizer.param_groups[0]["lr"] = numpy.float32(1e-5 * step)  # a schedule read from a NumPy array
            lrs.append(float(optimizer.param_groups[0]["lr"]))
            clipped_step(model, optimizer, scaler)
    data = _series_of(memory, run.id, "lr")["lr"]
    assert data["steps"] == list(range(120)) and data["values"] == pytest.approx(lrs)


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_an_iteration_the_loop_drops_leaves_nothing_in_the_next_step(memory, amp: str) -> None:
    """A guard that skips non-finite updates (`zero_grad(); continue`, no step): with a scaler after backward, on the
    loss; without one after clip_grad_norm_, on its norm. The next step's loss and norm are its own."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if amp == "fp16" else None
    losses, norms = [], []
    with ampwatch.init("scalers", f"dropped-{amp}", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for iteration in range(12):
            x = torch.randn(4, 8) * (float("nan") if iteration in (3, 7) else 1.0)
            with torch.autocast("cpu", dtype=torch.float16 if scaler else torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            if scaler is not None:
                scaler.scale(loss).backward()
                if not torch.isfinite(loss):
                    optimizer.zero_grad()
                    continue
                scaler.unscale_(optimizer)
            else:
                loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            if scaler is None and not torch.isfinite(norm):  # (after unscale_, GradScaler wants its update(): it skips)
                optimizer.zero_grad()
                continue
            losses.append(loss.item())
            norms.append(norm.item())
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                run.log({"loss": loss})
                optimizer.step()
            optimizer.zero_grad()
    data = _series_of(memory, run.id, "loss", "grad_norm")
    assert data["loss"] == {"steps": list(range(10)), "values": pytest.approx(losses, rel=1e-6)}
    assert data["grad_norm"]["steps"] == list(range(10))  # (an overflow the scaler skipped reads "Infinity")
    assert [float(v) for v in data["grad_norm"]["values"]] == pytest.approx(norms, rel=1e-5)


@pytest.mark.parametrize("how", ["value", "norm on every micro-batch"])
def test_clipping_without_a_scaler_by_value_or_on_every_micro_batch_records_the_norm_before_the_last_clip(
    memory, how: str
) -> None:
    """`clip_grad_value_` (Accelerate's too) changes the gradients as clip_grad_norm_ does; a clip called on every
    micro-batch (Accelerate's, unguarded by sync_gradients) clips gradients a backward has added to since."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    expected = []
    with ampwatch.init("scalers", f"clip-{how}", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer)
        for _ in range(6):
            for _micro in range(3):
                model(torch.randn(4, 8)).pow(2).mean().mul(100).backward()
                if how == "value":
                    continue
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).item()
            if how == "value":
                norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
                torch.nn.utils.clip_grad_value_(model.parameters(), 1e-4)
            expected.append(norm)
            optimizer.step()
            optimizer.zero_grad()
    assert min(expected) > 1e-2
    assert _series_of(memory, run.id, "grad_norm")["grad_norm"]["values"] == pytest.approx(expected, rel=1e-4)
