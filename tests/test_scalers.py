"""The scaler variants and shapes of loop the agent must not break: several optimizers, the legacy
torch.cuda.amp.GradScaler, a disabled scaler, state_dict round trips mid-run."""

from __future__ import annotations

import warnings

import pytest
import torch

import ampwatch


def test_two_optimizers_with_one_scaler_record_one_step_per_update(sqlite_server) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    first = torch.optim.AdamW(model[0].parameters())
    second = torch.optim.SGD(model[2].parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    expected = []
    with ampwatch.init("scalers", "two-optimizers", url=sqlite_server.url) as run:
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
    with sqlite_server.client() as http:
        data = http.get(f"/api/v1/runs/{run.id}/series", params={"name": ["grad_norm", "skipped"]}).json()
    assert data["grad_norm"]["steps"] == list(range(6))
    assert data["grad_norm"]["values"] == pytest.approx(expected, rel=1e-5)  # one norm over both optimizers


@pytest.mark.skipif(torch.cuda.is_available(), reason="covers the disabled legacy scaler a machine without CUDA builds")
def test_the_legacy_cuda_scaler_is_watched_without_breaking(sqlite_server) -> None:  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated, and disabled without CUDA
        scaler = torch.cuda.amp.GradScaler()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampwatch.init("scalers", "legacy", url=sqlite_server.url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        assert isinstance(scaler, torch.cuda.amp.GradScaler)
        for _ in range(3):
            scaler.scale(model(torch.randn(2, 4)).pow(2).mean()).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    assert type(scaler) is torch.cuda.amp.GradScaler
    with sqlite_server.client() as http:
        data = http.get(f"/api/v1/runs/{run.id}/series", params={"name": ["loss", "grad_norm"]}).json()
    assert not scaler.is_enabled()  # so steps were counted through the optimizer
    assert data["loss"]["steps"] == data["grad_norm"]["steps"] == [0, 1, 2]


def test_state_dict_round_trip_mid_run_keeps_scaling_and_recording(sqlite_server) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    with ampwatch.init("scalers", "checkpoint", url=sqlite_server.url) as run:
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
    with sqlite_server.client() as http:
        data = http.get(f"/api/v1/runs/{run.id}/series", params={"name": "scale"}).json()
    assert data["scale"]["values"] == [512.0, 512.0, 512.0, 64.0, 64.0, 64.0]
