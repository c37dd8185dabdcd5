"""Stopping a run on request: an admin asks (`POST /api/v1/runs/{id}/stop`, `ampwatch stop`), the agent learns it from
the reply to its next batch, `run.should_stop` turns true, and with `init(stop_on=...)` the agent raises
`ampwatch.StopRequested` at a step's end; the run ends `stopped`, with who and why. Real uvicorn servers and real
CPU torch loops; the stop on the agent's own critical event uses the in-memory ingest."""

from __future__ import annotations

import copy
import time
from typing import Any

import httpx
import pytest
import torch
from _runs import clipped_step

import ampwatch
from ampwatch import _cli
from ampwatch.server import auth

MAX_STEPS = 5000  # a loop that never learns of the stop fails at this many steps rather than hang
ASK_AT = 10  # the step at which the test asks the run to stop


def _tokens(server: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """An admin, a read and an ingest token on `server` (which re-reads its tokens on every request)."""
    monkeypatch.setattr(server.app.state.tokens, "refresh_s", 0.0)
    with server.app.state.sessions() as session:
        return {role: auth.create_token(session, name=f"{role}-person", role=role) for role in auth.ROLES}


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _step(kind: str, model: Any, optimizer: Any, scaler: Any, x: torch.Tensor) -> None:
    """One training step of a loop of this kind: `clipped` (fp16, unscale_ and clip: the agent's lean path), `plain`
    (fp16, no clip: its full path) or `fp32` (no GradScaler: steps counted by the optimizer's hooks)."""
    if kind == "clipped":
        clipped_step(model, optimizer, scaler, x)
        return
    if kind == "plain":
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        model(x).pow(2).mean().backward()
        optimizer.step()
    optimizer.zero_grad()


def test_an_admin_stops_a_run_whose_loop_checks_should_stop_and_it_ends_stopped_with_who_and_why(
    live_server, monkeypatch
) -> None:
    tokens = _tokens(live_server, monkeypatch)
    model, optimizer = _model()
    scaler = torch.amp.GradScaler("cpu")
    http = httpx.Client(base_url=live_server.url, timeout=30)
    with ampwatch.init("stop", name="doomed", url=live_server.url, token=tokens["ingest"]) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        step = 0
        while not run.should_stop:
            assert step < MAX_STEPS, "the agent never learned of the stop"
            _step("clipped", model, optimizer, scaler, torch.randn(8, 4))
            if step == ASK_AT:
                assert run.flush()  # (the run is registered)
                for refused in ("read", "ingest"):  # the admin role only, declared on the route
                    answer = http.post(f"/api/v1/runs/{run.id}/stop", headers=_bearer(tokens[refused]), json={})
                    assert answer.status_code == 403, answer.text
                assert http.post(f"/api/v1/runs/{run.id}/stop", json={}).status_code == 401
                assert http.get(f"/api/v1/runs/{run.id}", headers=_bearer(tokens["read"])).json()["stop"] is None
                answer = http.post(
                    f"/api/v1/runs/{run.id}/stop", headers=_bearer(tokens["admin"]), json={"reason": "loss diverges"}
                )
                assert answer.status_code == 200, answer.text
                assert answer.json()["status"] == "running"
                assert answer.json()["stop"]["by"] == f"token 'admin-person' (#{_id(tokens['admin'])})"
                again = http.post(f"/api/v1/runs/{run.id}/stop", headers=_bearer(tokens["admin"]), json={"reason": "x"})
                assert again.json()["stop"]["reason"] == "loss diverges"  # (the first request stands)
            step += 1
        learned_at = step
        assert learned_at > ASK_AT
        for _ in range(20):  # without stop_on the agent never raises: the loop decides, and may go on a while
            _step("clipped", model, optimizer, scaler, torch.randn(8, 4))
            step += 1
    shown = http.get(f"/api/v1/runs/{run.id}", headers=_bearer(tokens["read"])).json()
    assert shown["status"] == "stopped"
    assert shown["stop"]["by"] == f"token 'admin-person' (#{_id(tokens['admin'])})"
    assert shown["stop"]["reason"] == "loss diverges" and shown["stop"]["requested_at"]
    loss = http.get(f"/api/v1/runs/{run.id}/series", params={"name": "loss"}, headers=_bearer(tokens["read"])).json()
    assert loss["loss"]["steps"] == list(range(step))  # (every step the loop ran, the ones after the stop too)
    events = http.get(f"/api/v1/runs/{run.id}/events", headers=_bearer(tokens["read"])).json()
    stopped = [e for e in events if e["type"] == "run_stopped"]
    assert len(stopped) == 1 and stopped[0]["step"] == step and "loss diverges" in stopped[0]["message"]
    finished = http.post(f"/api/v1/runs/{run.id}/stop", headers=_bearer(tokens["admin"]), json={})
    assert finished.status_code == 409 and "already ended (stopped)" in finished.text
    assert http.post("/api/v1/runs/nope/stop", headers=_bearer(tokens["admin"]), json={}).status_code == 404
    http.close()


def _id(token: str) -> int:
    return int(token.split("_")[1])


@pytest.mark.parametrize("kind", ["clipped", "plain", "fp32"])
def test_stop_on_request_raises_at_a_step_boundary_with_the_update_complete(sqlite_server, kind) -> None:
    """The parameters (and the GradScaler's scale and state) of the watched loop when StopRequested comes are those of
    an unwatched copy after as many whole steps, bit for bit: nothing is half-updated."""
    model, optimizer = _model()
    twin = copy.deepcopy(model)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)  # (the scale moves: a missed update() would show)
    twin_scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    torch.manual_seed(1)
    batches = [torch.randn(8, 4) for _ in range(64)]
    raised = None
    with ampwatch.init("stop", name=f"raise-{kind}", url=sqlite_server.url, stop_on="request") as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler if kind != "fp32" else None)
        done = 0
        try:
            while done < MAX_STEPS:
                if done == ASK_AT:
                    httpx.post(f"{sqlite_server.url}/api/v1/runs/{run.id}/stop", json={"reason": "enough"}, timeout=30)
                _step(kind, model, optimizer, scaler, batches[done % len(batches)])
                done += 1
                time.sleep(0.001)  # (a step of a real model takes longer than this one's few microseconds)
        except ampwatch.StopRequested as error:
            raised = error
            assert isinstance(error, BaseException) and not isinstance(error, Exception)
        assert raised is not None, "StopRequested never came"
        assert run.should_stop
    assert raised.by == "anyone (a server without tokens)" and raised.reason == "enough"
    # The step that raised ran whole (it raised from its end): `done` steps before it, and it.
    assert raised.step == done
    for i in range(done + 1):
        _step(kind, twin, twin_optimizer, twin_scaler, batches[i % len(batches)])
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        assert torch.equal(mine, theirs)
    if kind != "fp32":
        assert scaler.get_scale() == twin_scaler.get_scale() and scaler.state_dict() == twin_scaler.state_dict()
        assert not scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]  # update() reset it
    shown = httpx.get(f"{sqlite_server.url}/api/v1/runs/{run.id}", timeout=30).json()
    assert shown["status"] == "stopped" and shown["stop"]["reason"] == "enough"


def test_stop_on_critical_raises_after_the_agents_own_critical_event_and_default_init_never_raises(memory) -> None:
    """A NaN batch makes a critical `nonfinite_loss`: a run started with stop_on=("critical",) raises at a step's end
    soon after; one started without stop_on trains on, and neither its should_stop turns true."""
    outcomes = {}
    for stop_on in (("critical",), None):
        model, optimizer = _model()
        scaler = torch.amp.GradScaler("cpu")
        raised = None
        with ampwatch.init("stop", name=f"critical-{stop_on}", transport=memory, stop_on=stop_on) as run:
            run.watch(model=model, optimizer=optimizer, scaler=scaler)
            step = 0
            try:
                for step in range(400):
                    x = torch.randn(8, 4)
                    if step == 20:
                        x[0, 0] = float("nan")
                    _step("clipped", model, optimizer, scaler, x)
                    if step == 21:
                        run.flush()  # (the diagnosis has read the NaN step: the stop is due at the next step's end)
            except ampwatch.StopRequested as error:
                raised = error
            outcomes[stop_on] = (raised, step, run.should_stop, run.id)
    raised, step, should_stop, run_id = outcomes[("critical",)]
    assert raised is not None and should_stop and raised.by == "ampwatch"
    assert "critical nonfinite_loss at step 20" in (raised.reason or "")
    assert 20 < step <= 23
    assert memory.run(run_id)["status"] == "stopped"
    raised, step, should_stop, run_id = outcomes[None]
    assert (raised, step, should_stop) == (None, 399, False)
    assert memory.run(run_id)["status"] == "finished"


def test_ampwatch_stop_asks_a_running_run_to_stop(sqlite_server, monkeypatch, capsys) -> None:
    tokens = _tokens(sqlite_server, monkeypatch)
    monkeypatch.setenv("AMPWATCH_URL", sqlite_server.url)
    model, optimizer = _model()
    run = ampwatch.init("stop", name="cli", url=sqlite_server.url, token=tokens["ingest"])
    run.watch(model=model, optimizer=optimizer)
    _step("fp32", model, optimizer, None, torch.randn(8, 4))
    assert run.flush()
    code, out, err = _cli_run(capsys, "stop", run.id, "--reason", "bad data", "--token", tokens["read"])
    assert code == 1 and "forbidden" in err
    code, out, err = _cli_run(capsys, "stop", run.id, "--reason", "bad data", "--token", tokens["admin"])
    assert code == 0, err
    assert out.startswith(f"asked run {run.id} (stop/cli) to stop, as token 'admin-person'") and ": bad data" in out
    for _ in range(MAX_STEPS):
        if run.should_stop:
            break
        _step("fp32", model, optimizer, None, torch.randn(8, 4))
        time.sleep(0.001)
    assert run.should_stop
    run.finish()
    code, out, err = _cli_run(capsys, "run", run.id, "--json", "--token", tokens["read"])
    assert code == 0, err
    assert '"status": "stopped"' in out and '"reason": "bad data"' in out
    code, out, err = _cli_run(capsys, "stop", run.id, "--token", tokens["admin"])
    assert code == 1 and "409" in err and "already ended" in err


def _cli_run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`ampwatch ARGV` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = _cli.main(list(argv))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_run_pages_stop_button_stops_a_running_run(sqlite_server, page) -> None:
    """In a real Chromium: "Stop run…", a reason, the button; the page says the stop waits; the training loop learns
    it and ends; the page then shows the run stopped, by whom and why, and no button."""
    model, optimizer = _model()
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("stop", name="browser", url=sqlite_server.url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        step = 0
        while not run.should_stop:
            assert step < MAX_STEPS, "the agent never learned of the stop"
            _step("clipped", model, optimizer, scaler, torch.randn(8, 4))
            if step == ASK_AT:
                assert run.flush()
                page.goto(f"{sqlite_server.url}/runs/{run.id}")
                assert page.locator("#run-stop").count() == 0
                page.click("#stop-run summary")
                page.fill("#stop-reason", "the loss diverges")
                page.click("#stop-run-button")
                page.wait_for_url(f"{sqlite_server.url}/runs/{run.id}")
                note = page.locator("#run-stop").inner_text()
                assert note.startswith("Stop requested by anyone (a server without tokens) at ")
                assert "the loss diverges" in note and "learns it at its next batch" in note
                assert page.locator("#stop-run").count() == 0  # (asked once: no second button)
            step += 1
    page.goto(f"{sqlite_server.url}/runs/{run.id}")
    assert page.locator("#run-status").inner_text() == "stopped"
    note = page.locator("#run-stop").inner_text()
    assert note.startswith("Stopped by anyone (a server without tokens)") and note.endswith(": the loss diverges.")
    assert page.locator("#stop-run").count() == 0 and page.locator("#delete-run").count() == 1
    assert page.locator(".ev-msg", has_text="as asked by anyone").count() == 1  # the run_stopped event
    page.goto(f"{sqlite_server.url}/?status=stopped")  # the runs page filters on the new status, live
    page.wait_for_selector("#runs[data-live='open']", timeout=10_000)
    assert page.locator(f"tr[data-run-id='{run.id}'] .status-stopped").inner_text() == "stopped"


def test_a_relaunch_under_the_run_id_is_not_stopped_by_the_stop_or_the_critical_event_of_the_launch_before(
    sqlite_server, monkeypatch
) -> None:
    """The first launch has a critical NaN loss and is stopped; a relaunch under the same run id with
    stop_on=("request", "critical") trains healthy steps and finishes: neither is its own."""
    monkeypatch.setenv("AMPWATCH_RUN_ID", "relaunched")
    model, optimizer = _model()
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("stop", name="first", url=sqlite_server.url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(30):
            x = torch.randn(8, 4)
            if step == 20:
                x[0, 0] = float("nan")
            _step("clipped", model, optimizer, scaler, x)
        assert run.flush()
        httpx.post(f"{sqlite_server.url}/api/v1/runs/{run.id}/stop", json={}, timeout=30).raise_for_status()
        _step("clipped", model, optimizer, scaler, torch.randn(8, 4))
        assert run.flush() and run.should_stop
    first = httpx.get(f"{sqlite_server.url}/api/v1/runs/relaunched", timeout=30).json()
    assert (first["status"], first["health"]) == ("stopped", "critical")

    with ampwatch.init(
        "stop", name="again", url=sqlite_server.url, resume_step=31, stop_on=("request", "critical")
    ) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for _ in range(40):  # (each flush is an exchange that would have told a stop)
            _step("clipped", model, optimizer, scaler, torch.randn(8, 4))
            assert run.flush()
        assert not run.should_stop
    again = httpx.get(f"{sqlite_server.url}/api/v1/runs/relaunched", timeout=30).json()
    assert (again["status"], again["stop"], again["last_step"]) == ("finished", None, 70)


def test_the_first_stop_sets_should_stop_and_the_first_of_a_trigger_in_stop_on_arms_the_raise() -> None:
    """The sender's side alone: a request where only "critical" raises turns should_stop true without a raise; a
    critical event after it arms the raise, saying so; a server's critical an earlier launch left is not ours."""
    from ampwatch._mailbox import Mailbox
    from ampwatch._stop import Stopper, triggers

    mailbox = Mailbox()
    stopper = Stopper(mailbox, triggers("critical"))
    stopper.registered({"critical_id": 7})
    stopper.replied({"stored": True, "critical": {"id": 7, "step": 3, "rank": 0, "type": "scale_collapse"}})
    assert (mailbox.stop, mailbox.stop_raise) == (None, False)  # (the launch before's)
    stopper.replied({"stored": True, "stop": {"by": "token 'ops' (#2)", "reason": "queue"}})
    assert mailbox.stop == {"trigger": "request", "by": "token 'ops' (#2)", "reason": "queue"}
    assert not mailbox.stop_raise
    stopper.critical({"type": "run_crashed", "step": 9, "message": "no"})  # (not a numerics event)
    assert not mailbox.stop_raise
    stopper.replied({"critical": {"id": 8, "step": 12, "rank": 1, "type": "nonfinite_param", "message": "NaN weights"}})
    assert mailbox.stop_raise and mailbox.stop["trigger"] == "critical" and mailbox.stop["by"] == "ampwatch"
    assert mailbox.stop["reason"] == "critical nonfinite_param at step 12 (rank 1, told by the server): NaN weights"
    assert triggers(None) == frozenset() and triggers(("request", "critical")) == {"request", "critical"}
