"""Agent → real uvicorn → SQLite / Postgres → read API, with real CPU training loops."""

from __future__ import annotations

import pytest
import torch

import ampwatch
from ampwatch.server import Settings


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))


def _series(server, run_id: str, *names: str) -> dict:
    with server.client() as http:
        reply = http.get(f"/api/v1/runs/{run_id}/series", params=[("name", n) for n in names])
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_amp_training_reads_back_every_step_with_nan_as_string(live_server) -> None:
    steps, nan_step = 40, 25
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    losses, norms, scales = [], [], []
    with ampwatch.init("e2e", "amp-loop", url=live_server.url, config={"lr": 1e-3}) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(steps):
            x = torch.randn(8, 16)
            if step == nan_step:
                x[0, 0] = float("nan")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scales.append(scaler.get_scale())  # the test may sync; the agent must not
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            losses.append(loss.item())
            norms.append(norm.item())

    with live_server.client() as http:
        runs = http.get("/api/v1/runs", params={"project": "e2e"}).json()
    assert [(r["id"], r["name"], r["status"], r["last_step"]) for r in runs] == [
        (run.id, "amp-loop", "finished", steps - 1)
    ]
    assert runs[0]["health"] in ("ok", "warning", "critical") and runs[0]["created_at"]
    data = _series(live_server, run.id, "loss", "scale", "skipped", "grad_norm")
    for name in ("loss", "scale", "skipped", "grad_norm"):
        assert data[name]["steps"] == list(range(steps)), name
    assert data["loss"]["values"][nan_step] == "NaN"
    assert data["grad_norm"]["values"][nan_step] == "NaN"
    assert data["skipped"]["values"][nan_step] == 1
    finite = [i for i in range(steps) if i != nan_step]
    assert [data["loss"]["values"][i] for i in finite] == pytest.approx([losses[i] for i in finite], rel=1e-6)
    # The agent's norm is the unscaled one, taken before clipping: what clip_grad_norm_ returned.
    assert [data["grad_norm"]["values"][i] for i in finite] == pytest.approx([norms[i] for i in finite], rel=1e-5)
    assert data["scale"]["values"] == scales
    skipped = [i for i, v in enumerate(data["skipped"]["values"]) if v == 1]
    assert skipped == [i for i in range(steps - 1) if scales[i + 1] < scales[i]] + (
        [steps - 1] if scaler.get_scale() < scales[-1] else []
    )


def test_accumulated_micro_batches_add_up_and_fused_adamw_norm_is_unscaled(sqlite_server) -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    expected_loss, expected_norm = [], []
    with ampwatch.init("e2e", "accumulate", url=sqlite_server.url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for _ in range(6):
            total = 0.0
            for _ in range(3):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(torch.randn(4, 16)).float().pow(2).mean()
                scaler.scale(loss).backward()
                total += loss.item()
            grads = [p.grad for p in model.parameters()]
            expected_norm.append((torch.nn.utils.get_total_norm(grads) / scaler.get_scale()).item())
            expected_loss.append(total)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    data = _series(sqlite_server, run.id, "loss", "grad_norm", "skipped")
    assert data["loss"]["steps"] == list(range(6))
    assert data["loss"]["values"] == pytest.approx(expected_loss, rel=1e-6)
    assert data["grad_norm"]["values"] == pytest.approx(expected_norm, rel=1e-5)
    assert data["skipped"]["values"] == [0] * 6


def test_without_a_scaler_steps_are_counted_by_the_optimizer(sqlite_server) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    disabled = torch.amp.GradScaler("cpu", enabled=False)  # what nanoGPT builds under bf16
    with ampwatch.init("e2e", "bf16", url=sqlite_server.url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=disabled)
        for step in range(5):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 16)).float().pow(2).mean()
            disabled.scale(loss).backward()
            disabled.step(optimizer)
            disabled.update()
            optimizer.zero_grad()
            run.log({"loss_seen": loss}, step=step)
    data = _series(sqlite_server, run.id, "loss", "grad_norm", "loss_seen", "scale")
    assert data["loss"]["steps"] == data["grad_norm"]["steps"] == data["loss_seen"]["steps"] == list(range(5))
    assert data["loss"]["values"] == pytest.approx(data["loss_seen"]["values"])
    assert data["scale"] == {"steps": [], "values": []}  # no scale to report: it does not exist


@pytest.mark.parametrize("split", ["optimizer, then scaler", "scaler, then optimizer", "all, then a new optimizer"])
def test_watch_split_over_calls_records_each_step_once(sqlite_server, split: str) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("e2e", "split", url=sqlite_server.url) as run:
        if split == "optimizer, then scaler":
            run.watch(model=model, optimizer=optimizer).watch(scaler=scaler)
        elif split == "scaler, then optimizer":
            run.watch(model=model, scaler=scaler).watch(optimizer=optimizer)
        else:
            run.watch(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
            run.watch(optimizer=optimizer)  # the one the loop steps
        for _ in range(12):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 16)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    data = _series(sqlite_server, run.id, "loss", "scale", "lr")
    assert data["loss"]["steps"] == data["scale"]["steps"] == data["lr"]["steps"] == list(range(12))
    assert data["lr"]["values"] == [0.01] * 12


@pytest.mark.parametrize("every", [1, 3])
def test_a_norm_the_user_logs_replaces_the_agents_and_leaves_no_gap_between(sqlite_server, every: int) -> None:
    """Logged at every step, the user's norm is the series; logged every third step, the agent's own fills in."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("e2e", f"override-{every}", url=sqlite_server.url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(10):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 16)).float().pow(2).mean()
            scaler.scale(loss).backward()
            if step % every == 0:
                run.log({"grad_norm": 1000.0 + step})
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    data = _series(sqlite_server, run.id, "grad_norm", "loss")
    norms = dict(zip(data["grad_norm"]["steps"], data["grad_norm"]["values"]))
    assert list(norms) == list(range(10)) and len(data["loss"]["values"]) == 10
    assert [norms[s] for s in range(0, 10, every)] == [1000.0 + s for s in range(0, 10, every)]
    assert all(norms[s] < 1000 for s in range(10) if s % every)  # the agent's own norm on the other steps


def test_standard_names_the_user_logs_win_with_other_values_logged_at_other_steps_between(sqlite_server) -> None:
    """`loss` and `param_norm` logged at the current step replace the agent's, though a sample count is logged at
    its own step in between (the agent's parameter check runs at steps 0 and 50 here)."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("e2e", "override-names", url=sqlite_server.url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(60):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 16)).float().pow(2).mean()
            scaler.scale(loss).backward()
            run.log({"loss": 1000.0 + step, "param_norm": 123.0})
            run.log({"samples_seen": 4.0 * step}, step=4 * step)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    data = _series(sqlite_server, run.id, "loss", "param_norm")
    assert data["loss"] == {"steps": list(range(60)), "values": [1000.0 + s for s in range(60)]}
    assert data["param_norm"] == {"steps": list(range(60)), "values": [123.0] * 60}


def test_nonfinite_and_exact_floats_round_trip_through_the_database(live_server) -> None:
    values = [0.1 + 0.2, "NaN", "Infinity", "-Infinity", -2.5e-310, 5e-324, 1.7976931348623157e308]
    with live_server.client() as http:
        assert http.put("/api/v1/runs/exact1", json={"project": "p", "name": "n"}).status_code == 200
        reply = http.post(
            "/api/v1/runs/exact1/batches", json={"seq": 1, "points": {"v": {"steps": list(range(7)), "values": values}}}
        )
        assert reply.status_code == 200, reply.text
        data = http.get("/api/v1/runs/exact1/series", params={"name": "v"}).json()
    assert data["v"]["steps"] == list(range(7))
    assert data["v"]["values"][1:4] == ["NaN", "Infinity", "-Infinity"]
    got = [data["v"]["values"][i] for i in (0, 4, 5, 6)]
    assert got == [0.1 + 0.2, -2.5e-310, 5e-324, 1.7976931348623157e308]  # bit-exact float64, subnormals too


def test_a_run_appears_before_its_first_step_and_heartbeats_while_idle(sqlite_server, monkeypatch, wait_for) -> None:
    monkeypatch.setenv("AMPWATCH_HEARTBEAT_INTERVAL_S", "0.2")
    run = ampwatch.init("e2e", "idle", url=sqlite_server.url)

    def seen() -> str | None:
        with sqlite_server.client() as http:
            reply = http.get(f"/api/v1/runs/{run.id}")
        return reply.json()["last_seen_at"] if reply.status_code == 200 else None

    first = wait_for(seen, what="the run to register with no step recorded")
    wait_for(lambda: seen() not in (None, first), what="a heartbeat while the loop records nothing")
    run.finish()
    with sqlite_server.client() as http:
        assert http.get(f"/api/v1/runs/{run.id}").json()["status"] == "finished"


def test_run_url_is_the_servers_public_link_once_registered(live_server_factory, sqlite_url) -> None:
    # (behind a proxy the agent's own AMPWATCH_URL is an internal address; Run.url is the dashboard page)
    server = live_server_factory(Settings(database_url=sqlite_url, public_url="http://dash.example.com:9000"))
    with ampwatch.init("e2e", "public", url=server.url) as run:
        run.log({"x": 1.0}, step=0)
    assert run.url == f"http://dash.example.com:9000/runs/{run.id}"
