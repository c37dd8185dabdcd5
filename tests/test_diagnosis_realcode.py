"""Patterns of public training code (nanoGPT's LR from the iteration number, GradScaler's start-up skips, an LR
blow-up, a clip that only measures, a loop that records no loss) in real CPU loops: the events say what happened,
and healthy runs get no warning."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ampwatch


def _events(server: Any, run_id: str) -> list[dict[str, Any]]:
    with server.client() as http:
        return http.get(f"/api/v1/runs/{run_id}/events").json()


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))


def nanogpt_lr(it: int, lr: float = 1e-3, warmup: int = 10, decay: int = 200) -> float:
    """nanoGPT's get_lr: linear warm-up, then cosine decay, from the iteration number (no scheduler object)."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = min(1.0, (it - warmup) / (decay - warmup))
    return lr / 10 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - lr / 10)


def _fp16_loop(
    server: Any,
    steps: int,
    *,
    scaler: torch.amp.GradScaler | None = None,
    lr_at: Callable[[int], float] | None = None,
    scheduler: bool = False,
    overflow_at: frozenset[int] = frozenset(),
) -> list[dict[str, Any]]:
    """A plain fp16 AMP loop; `lr_at` sets the LR from the iteration number as nanoGPT does, `scheduler` steps a
    LambdaLR every iteration (skipped or not), `overflow_at` scales a step's gradients past what fp16 holds."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = scaler or torch.amp.GradScaler("cpu")
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 0.99**i) if scheduler else None
    with ampwatch.init("realcode", url=server.url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for it in range(steps):
            if lr_at is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(it)
            with torch.autocast("cpu", dtype=torch.float16):
                y = model(torch.randn(16, 8)).float()
            if it in overflow_at:  # (gradients past fp16's range under a finite loss: an ordinary overflow)
                y.register_hook(lambda grad: grad * 1e30)
            loss = torch.nn.functional.mse_loss(y, torch.zeros(16, 1))
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if sched is not None:
                sched.step()
            optimizer.zero_grad(set_to_none=True)
    return _events(server, run.id)


def _warnings(events: list[dict[str, Any]]) -> list[tuple[str, int, str]]:
    return [(e["type"], e["step"], e["message"]) for e in events if e["severity"] != "info"]


def test_a_scheduler_stepped_through_start_up_calibration_skips_is_no_warning(sqlite_server) -> None:
    calibrating = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # (the first steps overflow until the scale is low)
    events = _fp16_loop(sqlite_server, 60, scaler=calibrating, scheduler=True)
    assert any(e["details"].get("calibration") for e in events)  # (the start-up skips did happen)
    assert _warnings(events) == []


def test_an_lr_set_from_the_iteration_number_is_no_scheduler_warning_after_a_skip(sqlite_server) -> None:
    events = _fp16_loop(sqlite_server, 60, lr_at=nanogpt_lr, overflow_at=frozenset({30}))
    assert [e["step"] for e in events if e["type"] == "skipped_step"] == [30]
    assert _warnings(events) == []


def test_a_scheduler_stepped_on_a_skip_after_calibration_is_still_a_warning(sqlite_server) -> None:
    calibrating = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    events = _fp16_loop(sqlite_server, 80, scaler=calibrating, scheduler=True, overflow_at=frozenset({65}))
    [(kind, step, message)] = _warnings(events)
    assert (kind, step) == ("amp_config", 66) and "scheduler advances on skipped steps" in message


def test_a_scheduler_stepped_on_an_occasional_skip_is_no_warning(sqlite_server) -> None:
    # Lightning steps its schedulers on the steps GradScaler skips: a healthy fp16 fit's first overflow skip (step 306
    # of a 2000-step fit) was a warning, one step ahead in hundreds. Said once the schedule is > 1% of the steps ahead.
    calibrating = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    events = _fp16_loop(sqlite_server, 320, scaler=calibrating, scheduler=True, overflow_at=frozenset({150, 300}))
    assert [e["step"] for e in events if e["type"] == "skipped_step" and not e["details"].get("calibration")] == [
        150,
        300,
    ]
    assert _warnings(events) == []


class SqrtAt(torch.nn.Module):
    """Adds sqrt(relu(x) * 0) from step `at` on: zero in the forward, NaN in the backward."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.step = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(torch.relu(x) * 0.0) if self.step >= self.at else x


def test_a_loop_that_records_no_loss_is_never_told_its_loss_was_finite(sqlite_server) -> None:
    torch.manual_seed(0)
    bad = SqrtAt(110)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), bad, torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampwatch.init("realcode", url=sqlite_server.url) as run:
        run.watch(model=model, optimizer=optimizer)  # (fp32, no scaler, and the loop logs no loss)
        for it in range(170):
            bad.step = it
            loss = model(torch.randn(16, 8)).pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    events = _events(sqlite_server, run.id)
    assert [e["details"].get("check") for e in events if e["type"] == "amp_config"] == ["no_loss"]
    bad_ones = [e for e in events if e["type"].startswith("nonfinite")]
    assert bad_ones and bad_ones[0]["step"] == 110
    for event in bad_ones:
        assert "finite loss" not in event["message"], event["message"]


def _spike_message(server: Any, max_norm: float) -> str:
    """A bf16 loop (no scaler) that calls clip_grad_norm_(max_norm) every step; its target jumps at step 60."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampwatch.init("realcode", url=server.url) as run:
        run.watch(model=model, optimizer=optimizer)
        for it in range(70):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(torch.randn(16, 8)).float()
            loss = torch.nn.functional.mse_loss(out, torch.full((16, 1), 300.0 if it == 60 else 0.0))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad()
    [spike] = [e for e in _events(server, run.id) if e["type"] == "grad_spike"]
    assert spike["step"] == 60
    return str(spike["message"])


def test_a_clip_that_only_measures_the_norm_is_not_said_to_cut_the_update_down(sqlite_server) -> None:
    measured = _spike_message(sqlite_server, math.inf)  # (HF's Trainer measures the norm so for its logs)
    assert "cut down" not in measured and "only measured" in measured
    clipped = _spike_message(sqlite_server, 1.0)
    assert "was cut down to 1;" in clipped


@pytest.mark.parametrize("fp16", [False, True])
def test_an_lr_blow_up_is_told_as_a_divergence_at_that_learning_rate_not_a_nan_operation(sqlite_server, fp16) -> None:
    # nanoGPT's warm-up towards lr=50 (on the CPU it trains in fp32: see the amp_config tests); in fp16 the growing
    # gradients overflow first, so GradScaler skips and the NaN gradients come under a finite loss.
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=50)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    with ampwatch.init("realcode", url=sqlite_server.url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for it in range(40):
            for group in optimizer.param_groups:
                group["lr"] = 50 * (it + 1) / 101
            x = torch.randn(16, 8) * 0.3
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                loss = torch.nn.functional.mse_loss(model(x).float(), x[:, :1])
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)  # (measured, as nanoGPT logs it)
            if not fp16:
                run.log({"loss": loss})  # (without an enabled scaler the agent sees the loss where it is logged)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    events = _events(sqlite_server, run.id)
    bad = [e for e in events if e["type"] in ("nonfinite_loss", "nonfinite_grad", "scale_collapse")]
    spikes = [e for e in events if e["type"] in ("grad_spike", "loss_spike")]
    assert bad and spikes and spikes[0]["step"] < bad[0]["step"] < 25  # (judged in the first steps, before the NaN)
    for event in spikes[:1] + bad:
        assert "too high a learning rate" in event["message"] and "grew" in event["message"], event["message"]
        assert "sqrt" not in event["message"] and "bad batch" not in event["message"], event["message"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_healthy_runs_get_no_warning_and_no_alert(sqlite_server, dtype) -> None:
    """The false-warning budget: zero. A few thousand steps of a healthy plain loop, noisy small batches, nanoGPT's
    warm-up and cosine LR, clipping; fp16 with GradScaler (start-up calibration included), bf16 without."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, enabled=dtype == torch.float16)  # (calibrates first)
    steps = 3000
    with ampwatch.init("realcode", url=sqlite_server.url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for it in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = nanogpt_lr(it, decay=steps)
            x = torch.randn(4, 8)
            with torch.autocast("cpu", dtype=dtype):
                loss = torch.nn.functional.mse_loss(model(x).float(), x[:, :1].sin())
            if dtype == torch.bfloat16:
                run.log({"loss": loss})
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    with sqlite_server.client() as http:
        stored = http.get(f"/api/v1/runs/{run.id}").json()
        alerts = http.get("/api/v1/alerts", params={"run_id": run.id}).json()
    events = _events(sqlite_server, run.id)
    assert stored["last_step"] == steps - 1
    assert any(e["details"].get("calibration") for e in events) == (dtype == torch.float16)
    assert _warnings(events) == [] and alerts == [] and stored["health"] == "ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the pattern is a CUDA script run where there is no CUDA")
def test_nanogpt_fp16_on_the_cpu_trains_in_fp32_and_is_flagged(sqlite_server) -> None:
    # nanoGPT, dtype='float16', device='cpu': ctx = nullcontext() on the CPU; GradScaler(enabled=(dtype == 'float16'))
    # built for CUDA, which torch turns off (with a warning) on a machine without it.
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = torch.amp.GradScaler("cuda", enabled=True)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with ampwatch.init("realcode", url=sqlite_server.url, config={"dtype": "float16"}) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for _ in range(5):
            with contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 1))
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    [flag] = _warnings(_events(sqlite_server, run.id))
    assert flag[0] == "amp_config" and "trains in full fp32 precision" in flag[2]
