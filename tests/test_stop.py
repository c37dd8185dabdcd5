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
NAN_AT = 150  # the step after which a DDP rank's weights turn NaN (past the run's first seconds: its pace is known)


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
                    assert run.flush()  # (the run is registered: the server stops only a run it knows)
                    asked = httpx.post(f"{sqlite_server.url}/api/v1/runs/{run.id}/stop", json={"reason": "enough"})
                    assert asked.status_code == 200, asked.text
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
    assert 20 <= step <= 23  # (the NaN step's own end may already see it: the sender runs while that step ends)
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


DDP_STOP = """
import json, os, time, urllib.request
from datetime import timedelta
import torch, torch.distributed as dist
import ampwatch

dist.init_process_group("gloo", timeout=timedelta(seconds=30))  # (a rank left waiting fails in 30 s, not hangs)
rank, server = dist.get_rank(), os.environ["SERVER"]
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
stop_on = os.environ["STOP_ON"]  # "request": rank 0 asks the server; "critical": rank 0's weights turn NaN
if stop_on == "critical" and rank == 1:
    os.environ["AMPWATCH_FLUSH_INTERVAL_S"] = "0.5"  # (its sender learns of the NaN later than rank 0's)
run = ampwatch.init("stop", "ddp-" + stop_on, url=server, stop_on=stop_on)
run.watch(model=model, optimizer=optimizer)
raised = None
try:
    for step in range(MAX_STEPS):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == NAN_AT and rank == 0 and stop_on == "critical":
            with torch.no_grad():
                model.module.weight.fill_(float("nan"))  # (the all-reduced gradients carry it to rank 1)
        elif step == ASK_AT and rank == 0 and stop_on == "request":
            run.flush()  # (registered, with its world size)
            asked = urllib.request.Request(f"{server}/api/v1/runs/{run.id}/stop", b"{}", method="POST")
            urllib.request.urlopen(asked.add_header("Content-Type", "application/json") or asked, timeout=30)
        time.sleep(0.005)  # (a step of a real model takes longer than this one's)
except ampwatch.StopRequested as stop:
    raised = stop.step
steps = torch.tensor([float(-1 if raised is None else raised)])
dist.all_reduce(steps)  # (every rank left its loop: none waits in a step's collective)
run.finish()
print(f"rank {rank} run {run.id} raised {raised} sum {int(steps.item())}\\n", end="", flush=True)  # (one write)
dist.destroy_process_group()
"""


def _ddp_stop(server: Any, tmp_path: Any, stop_on: str) -> tuple[list[list[str]], dict[str, Any]]:
    """DDP_STOP run by two gloo ranks under torchrun: what each rank printed, and the run."""
    import subprocess
    import sys

    script = tmp_path / "ddp_stop.py"
    text = DDP_STOP
    for name, value in (("MAX_STEPS", MAX_STEPS), ("ASK_AT", ASK_AT), ("NAN_AT", NAN_AT)):
        text = text.replace(name, str(value))
    script.write_text(text)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = {"SERVER": server.url, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "STOP_ON": stop_on}
    env["AMPWATCH_FLUSH_INTERVAL_S"] = "0.05"
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    said = [line for line in done.stderr.splitlines() if "ampwatch:" in line or "Error" in line]  # (each rank's own)
    assert done.returncode == 0, "\n".join(said[-30:]) + "\n" + done.stderr[-1500:]
    lines = sorted(line.split() for line in done.stdout.splitlines() if line.startswith("rank"))
    [run_id] = {line[3] for line in lines}
    assert len(lines) == 2 and "learned late" not in done.stderr and "waiting for the server" not in done.stderr
    assert "stops now" not in done.stderr, done.stderr[-3000:]
    return lines, httpx.get(f"{server.url}/api/v1/runs/{run_id}", timeout=30).json()


def test_every_ddp_rank_raises_stop_requested_after_the_same_step_the_server_fixed(sqlite_server, tmp_path) -> None:
    """Two gloo ranks under torchrun, asked to stop at step ASK_AT: each learns the stop at its own next exchange, but
    both raise after the step the server fixed (`stop.at_step`), so neither waits for the other in a collective."""
    lines, shown = _ddp_stop(sqlite_server, tmp_path, "request")
    raised = [int(line[5]) for line in lines]
    at = shown["stop"]["at_step"]
    assert raised == [at, at] and ASK_AT < at < MAX_STEPS - 1, (lines, shown["stop"])
    assert shown["status"] == "stopped" and [int(line[7]) for line in lines] == [2 * at, 2 * at]


def test_every_ddp_rank_stops_on_a_critical_event_after_the_same_step(sqlite_server, tmp_path) -> None:
    """The same ranks with `stop_on="critical"`, rank 0's weights turned NaN after step NAN_AT: both ranks see
    non-finite values, each diagnoses them and learns the step the server fixed for the run's first critical event at
    its own exchange, and both raise after it."""
    lines, shown = _ddp_stop(sqlite_server, tmp_path, "critical")
    raised = [int(line[5]) for line in lines]
    assert raised[0] == raised[1] and NAN_AT + 2 < raised[0] < MAX_STEPS - 1, lines
    assert [int(line[7]) for line in lines] == [2 * raised[0]] * 2
    assert shown["status"] == "stopped" and shown["stop"]["by"] == "ampwatch", shown["stop"]
    assert shown["stop"]["reason"].startswith("critical non"), shown["stop"]


def test_the_server_fixes_the_step_every_rank_stops_after_at_the_first_batch_after_the_request(live_server) -> None:
    """A run of several ranks: the first batch answered after the request fixes `at_step` past the highest step it
    reported, every reply then carries the same; a batch reporting a step past it (the ranks all ran past) fixes a
    later one. A single rank's stop has none: it stops at once. A relaunch lets go of it."""
    from ampwatch._protocol import batch_document

    def send(http: Any, run: str, rank: int, seq: int, steps: range, status: str | None = None) -> dict[str, Any]:
        points = {"loss": (list(steps), [1.0] * len(steps)), "tokens": ([10**9], [1.0])}  # (a user's own numbering)
        reply = http.post(f"/api/v1/runs/{run}/batches", json=batch_document(rank, seq, points, [], status))
        assert reply.status_code == 200, reply.text
        return reply.json()

    with live_server.client() as http:
        for run, world in (("two", 2), ("one", 1)):
            environment = {"world_size": world, "flush_interval_s": 0.05}
            assert http.put(f"/api/v1/runs/{run}", json={"project": "p", "name": run, "environment": environment})
            send(http, run, 0, 1, range(0, 10))
            asked = http.post(f"/api/v1/runs/{run}/stop", json={})
            assert asked.status_code == 200 and asked.json()["stop"]["at_step"] is None  # (fixed at the next batch)
        stop = send(http, "two", 1, 1, range(0, 12))["stop"]
        at = stop["at_step"]
        assert (
            11 + 2 <= at < 10**9
        )  # past the highest step of that batch, by the steps of about 5.1 s at the run's rate
        assert send(http, "two", 0, 2, range(10, 13))["stop"]["at_step"] == at  # (every rank is told the same)
        assert http.get("/api/v1/runs/two").json()["stop"]["at_step"] == at
        later = send(http, "two", 0, 3, range(13, at + 6))["stop"]["at_step"]  # the ranks all ran past it
        assert later >= at + 5 + 2 + 2 * 5
        assert send(http, "two", 1, 2, range(12, at + 1))["stop"]["at_step"] == later
        assert "at_step" not in send(http, "one", 0, 2, range(10, 20))["stop"]  # a single rank stops at once
        send(http, "two", 0, 4, range(at + 6, at + 7), status="stopped")
        shown = http.get("/api/v1/runs/two").json()
        assert (shown["status"], shown["stop"]["at_step"]) == ("stopped", later)
        assert http.put("/api/v1/runs/two", json={"project": "p", "name": "two", "environment": {"world_size": 2}})
        assert "stop" not in send(http, "two", 0, 5, range(0, 5))  # (a relaunch: the stop was the launch before's)


def test_the_first_critical_event_of_a_run_of_several_ranks_fixes_the_step_every_rank_stops_after(live_server) -> None:
    """As for a request: the batch bringing the run's first critical event fixes `critical.at_step` past the run's pace,
    every rank is told the same, a later critical keeps it, a batch past it moves it later; a single rank has none,
    and a relaunch lets go of it."""
    from ampwatch._protocol import batch_document

    nan = {"type": "nonfinite_param", "severity": "critical", "message": "NaN weights"}

    def send(http: Any, run: str, rank: int, seq: int, steps: range, events: list[dict[str, Any]] | None = None) -> Any:
        points = {"loss": (list(steps), [1.0] * len(steps))}
        reply = http.post(f"/api/v1/runs/{run}/batches", json=batch_document(rank, seq, points, events or [], None))
        assert reply.status_code == 200, reply.text
        return reply.json().get("critical")

    with live_server.client() as http:
        for run, world in (("two", 2), ("one", 1)):
            environment = {"world_size": world, "flush_interval_s": 0.05}
            assert http.put(f"/api/v1/runs/{run}", json={"project": "p", "name": run, "environment": environment})
            assert send(http, run, 0, 1, range(0, 10)) is None
        critical = send(http, "two", 1, 1, range(0, 12), [{**nan, "step": 11}])
        at = critical["at_step"]
        assert critical["type"] == "nonfinite_param" and critical["rank"] == 1 and 11 + 2 <= at < 10**6, critical
        assert send(http, "two", 0, 2, range(10, 13))["at_step"] == at  # (every rank is told the same)
        again = send(http, "two", 0, 3, range(13, 14), [{**nan, "step": 13, "message": "more"}])
        assert (again["message"], again["at_step"]) == ("more", at)  # (the latest event, the first one's step)
        later = send(http, "two", 1, 2, range(12, at + 6))["at_step"]  # the ranks all ran past it
        assert later >= at + 5 + 2 + 2 * 5
        assert "at_step" not in send(http, "one", 0, 2, range(10, 20), [{**nan, "step": 15}])  # (stops at once)
        send(http, "two", 0, 4, range(at + 6, at + 7))
        assert http.post("/api/v1/runs/two/batches", json=batch_document(0, 5, {}, [], "crashed")).status_code == 200
        assert http.put("/api/v1/runs/two", json={"project": "p", "name": "two", "environment": {"world_size": 2}})
        relaunched = send(http, "two", 0, 6, range(0, 5), [{**nan, "step": 3}])  # (a relaunch's first critical)
        assert 3 + 2 <= relaunched["at_step"] < later, relaunched


def test_a_rank_that_learns_the_step_after_running_past_it_waits_for_a_later_one_or_stops_at_once(caplog) -> None:
    """The sender's side alone: past the step by two or more, a rank waits for the later step the server fixes (its
    collectives ran with every rank there, so none stopped at it); with none in `late_wait_s`, it stops at once."""
    from ampwatch._mailbox import Mailbox
    from ampwatch._stop import Stopper, due, triggers

    done = [50]
    mailbox = Mailbox()
    stopper = Stopper(mailbox, triggers("request"), lambda: done[0], late_wait_s=600.0)
    with caplog.at_level("WARNING", logger="ampwatch"):
        stopper.replied({"stop": {"by": "ops", "at_step": 48}})  # (steps 0-49 ran: 49 is past 48 by one more)
    assert (mailbox.stop, mailbox.stop_raise, due(mailbox, 50)) == (None, False, False)
    assert "learned of the stop after step 48" in caplog.text and "waiting for the server" in caplog.text
    stopper.replied({"stop": {"by": "ops", "at_step": 80}})
    assert (mailbox.stop_at, mailbox.stop_raise, mailbox.stop["by"]) == (80, True, "ops")
    assert not due(mailbox, 80) and due(mailbox, 81)
    stopper.replied({"stop": {"by": "ops", "at_step": 90}})  # a later step while not due: taken
    assert mailbox.stop_at == 90
    done[0] = 91
    stopper.replied({"stop": {"by": "ops", "at_step": 120}})  # due already: it stays
    assert mailbox.stop_at == 90 and due(mailbox, 91)

    in_time = Mailbox()
    Stopper(in_time, triggers("request"), lambda: 49).replied({"stop": {"by": "ops", "at_step": 48}})
    assert in_time.stop_at == 48  # (one past: it may not have passed the check at 48's end yet)
    never = Mailbox()
    caplog.clear()
    with caplog.at_level("WARNING", logger="ampwatch"):
        Stopper(never, triggers("request"), lambda: 50, late_wait_s=0.0).replied({"stop": {"by": "ops", "at_step": 40}})
    assert (never.stop_at, never.stop_raise, due(never, 50)) == (None, True, True)
    assert "this rank stops now" in caplog.text


def test_a_rank_of_several_waits_on_its_critical_event_for_the_step_the_server_fixes_or_stops_without_one(
    caplog,
) -> None:
    """The sender's side alone: a rank's own critical event, in a run of several ranks, stops it after the step the
    reply names (moved later while not due), not at once; with no reply naming one in `late_wait_s`, or a reply that
    names none (a server that fixes none), at once; a single rank stops at once as before."""
    from ampwatch._mailbox import Mailbox
    from ampwatch._stop import Stopper, due, triggers

    nan = {"type": "nonfinite_param", "step": 19, "rank": 0, "message": "NaN weights"}
    mailbox = Mailbox()
    stopper = Stopper(mailbox, triggers("critical"), lambda: 20, late_wait_s=600.0, several=True)
    stopper.critical(nan)
    stopper.waited()
    assert (mailbox.stop, mailbox.stop_raise) == (None, False)  # (its step is not known yet)
    stopper.replied({"critical": {**nan, "id": 5, "at_step": 40}})
    assert (mailbox.stop_at, mailbox.stop_raise, mailbox.stop["trigger"]) == (40, True, "critical")
    assert mailbox.stop["reason"] == "critical nonfinite_param at step 19: NaN weights"  # (its own, the first)
    assert not due(mailbox, 40) and due(mailbox, 41)
    stopper.replied({"critical": {**nan, "id": 5, "at_step": 60}})  # (the ranks all ran past 40: a later step)
    assert mailbox.stop_at == 60

    for reply in (None, {"critical": {**nan, "id": 5}}):
        alone = Mailbox()
        waiting = Stopper(alone, triggers("critical"), lambda: 20, late_wait_s=0.0, several=True)
        waiting.critical(nan)
        with caplog.at_level("WARNING", logger="ampwatch"):
            waiting.replied(reply) if reply else waiting.waited()
        assert (alone.stop_at, alone.stop_raise, due(alone, 20)) == (None, True, True), reply
    assert "no reply named the step every rank stops after" in caplog.text
    single = Mailbox()
    Stopper(single, triggers("critical"), lambda: 20).critical(nan)
    assert (single.stop_at, single.stop_raise) == (None, True)
