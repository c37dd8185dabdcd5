"""On a GPU, the agent adds no synchronizing call: torch.cuda.set_sync_debug_mode("error") turns any into
an exception; and its reads wait for the stream the loop runs on. Runs only where CUDA is present (the CPU suite
proves the first with a dispatch counter)."""

from __future__ import annotations

import pytest
import torch

import ampwatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_fused_amp_loop_with_the_agent_never_synchronizes(sqlite_server, monkeypatch) -> None:
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
    assert data["loss"]["values"] == pytest.approx(
        data["loss_tensor"]["values"][: len(data["loss"]["values"])], rel=1e-6
    )


def test_autocast_on_cuda_around_a_model_left_on_the_cpu_is_an_amp_config_warning(sqlite_server) -> None:
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


def test_a_loop_on_a_side_stream_is_read_after_its_own_work(sqlite_server) -> None:
    # The whole loop runs on a non-default stream (PyTorch's pool streams do not wait for the default one), with
    # ~20 ms of GPU sleep queued ahead of each step: the CPU runs far ahead, and a read on the sender's own stream
    # that did not wait for this one would copy the losses before they are written.
    torch.manual_seed(0)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scaler = torch.amp.GradScaler("cuda")
        losses = []
        with ampwatch.init("cuda", "side-stream", url=sqlite_server.url) as run:
            run.watch(model=model, optimizer=optimizer, scaler=scaler)
            for _ in range(40):
                torch.cuda._sleep(20_000_000)  # (cycles: about 10-20 ms)
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(torch.randn(32, 64, device="cuda")).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.detach())
        truth = [v.item() for v in losses]
    with sqlite_server.client() as http:
        data = http.get(f"/api/v1/runs/{run.id}/series", params={"name": ["loss"]}).json()
    assert data["loss"]["steps"] == list(range(40))
    assert data["loss"]["values"] == pytest.approx(truth, rel=1e-6)
