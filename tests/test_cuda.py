"""On a GPU, the agent adds no synchronizing call: torch.cuda.set_sync_debug_mode("error") turns any into
an exception. Runs only where CUDA is present (the CPU suite proves the same with a dispatch counter)."""

from __future__ import annotations

import pytest
import torch

import ampwatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_fused_amp_loop_with_the_agent_never_synchronizes(sqlite_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AMPWATCH_LAYER_NORM_INTERVAL", "3")
    monkeypatch.setenv("AMPWATCH_PARAM_CHECK_INTERVAL", "3")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).cuda()
    # Fused AdamW: the standard loop itself reads nothing on the host, so any sync would be the agent's.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")

    def step(run: ampwatch.Run) -> None:
        x = torch.randn(32, 64, device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        run.log({"loss_tensor": loss})

    with ampwatch.init("cuda", "no-sync", url=sqlite_server.url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        step(run)  # first step: lazy initializations (scale tensor, layer index) happen outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(30):
                step(run)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    with sqlite_server.client() as http:
        data = http.get(f"/api/v1/runs/{run.id}/series", params={"name": ["loss", "scale", "loss_tensor"]}).json()
    assert data["loss"]["steps"] == data["scale"]["steps"] == list(range(31))
    assert data["loss"]["values"] == pytest.approx(data["loss_tensor"]["values"][: len(data["loss"]["values"])], rel=1e-6)


def test_autocast_on_cuda_around_a_model_left_on_the_cpu_is_an_amp_config_warning(sqlite_server) -> None:  # type: ignore[no-untyped-def]
    model = torch.nn.Linear(8, 1)  # forgot .cuda(): autocast("cuda") does nothing for it
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampwatch.init("cuda", "wrong-device", url=sqlite_server.url) as run:
        run.watch(model=model, optimizer=optimizer)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        optimizer.step()
    with sqlite_server.client() as http:
        events = http.get(f"/api/v1/runs/{run.id}/events").json()
    assert [e["details"]["check"] for e in events if e["type"] == "amp_config"] == ["autocast_device"]
