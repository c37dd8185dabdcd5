"""Defects a review found, each reproduced and now prevented."""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import _runs
import pytest
import torch

import ampwatch


def _series(memory, run_id: str, name: str) -> dict:
    return memory.series(run_id, name)[name]


def _server_series(server, run_id: str, name: str) -> dict:
    """For the tests whose subject needs a real server (`ampwatch sync`, another process)."""
    with server.client() as http:
        return http.get(f"/api/v1/runs/{run_id}/series", params={"name": name}).json()[name]


def test_a_relaunch_under_the_same_run_id_keeps_both_processes_data(memory, monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_RUN_ID", "resumed-run")
    statuses = []
    for steps in (range(0, 5), range(100, 105)):  # two processes, one after the other
        with ampwatch.init("review", "resume", transport=memory) as run:
            for step in steps:
                run.log({"x": float(step)}, step=step)
            assert run.flush(10)
            statuses.append(memory.run("resumed-run")["status"])
    assert _series(memory, "resumed-run", "x")["steps"] == [0, 1, 2, 3, 4, 100, 101, 102, 103, 104]
    # The second process runs again (it read "finished", and the server's crash check skipped it, while it trained).
    assert statuses + [memory.run("resumed-run")["status"]] == ["running", "running", "finished"]


def test_one_bad_metric_is_dropped_alone_and_the_run_still_finishes(memory) -> None:
    with ampwatch.init("review", "n" * 500, transport=memory) as run:
        run.log({"loss": 1.0, "eval/" + "x" * 300: 0.5}, step=0)
        run.log({"loss": 2.0}, step=-1)
        run.log({"loss": 3.0}, step=1)
    doc = memory.run(run.id)
    assert (doc["status"], len(doc["name"]), doc["series"]) == ("finished", 200, ["loss"])
    assert _series(memory, run.id, "loss") == {"steps": [0, 1], "values": [1.0, 3.0]}


def test_ranks_of_one_slurm_job_share_a_run_id_and_two_jobs_with_the_same_address_do_not() -> None:
    """srun starts the ranks itself (no torchrun run id), and job scripts often fix MASTER_PORT: the job id tells
    launches apart."""
    import subprocess
    import sys

    def derived(job: str) -> str:
        env = {
            "PATH": os.environ["PATH"],
            "RANK": "0",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "node1",
            "MASTER_PORT": "29500",
            "SLURM_JOB_ID": job,
            "SLURM_STEP_ID": "0",
        }
        code = "from ampwatch._run import _run_id; print(_run_id('p', 'n', 2))"
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        ).stdout.strip()

    assert derived("1001") == derived("1001") != derived("1002")


@pytest.mark.parametrize(("variable", "value"), [("AMPWATCH_RUN_ID", "not valid!"), ("RANK", "abc")])
def test_init_never_raises_on_a_bad_environment(monkeypatch, variable: str, value: str) -> None:
    monkeypatch.setenv(variable, value)
    monkeypatch.setenv("AMPWATCH_MODE", "disabled")
    run = ampwatch.init("review")
    assert isinstance(run, ampwatch.Run)
    run.finish()


def test_a_logged_accumulator_is_recorded_as_it_was_when_logged(memory) -> None:
    total = torch.zeros(())
    with ampwatch.init("review", "accumulator", transport=memory) as run:
        for step in range(4):
            total += 5.0
            run.log({"total": total}, step=step)
            total.zero_()  # as HF Trainer does with its loss accumulator
    assert _series(memory, run.id, "total")["values"] == [5.0, 5.0, 5.0, 5.0]


def test_an_unreadable_spooled_batch_is_set_aside_and_the_rest_is_uploaded(sqlite_server, monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    with ampwatch.init("review", "torn", url=sqlite_server.url) as run:
        for step in range(3):
            run.log({"x": float(step)}, step=step)
            assert run.flush(5)  # one batch per step
    spool = Path(os.environ["AMPWATCH_SPOOL_DIR"])
    first = sorted(spool.rglob("[0-9]*.json"))[0]
    first.write_text("")  # a crash between write and rename
    done = subprocess.run(
        [shutil.which("ampwatch") or "ampwatch", "sync", str(spool), "--url", sqlite_server.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert _server_series(sqlite_server, run.id, "x")["steps"] == [1, 2]
    assert [p.name for p in spool.rglob("*.bad")] == [first.with_suffix(".bad").name]  # kept for a person
    assert "unreadable" in done.stderr  # and the loss was said out loud


def test_a_pickled_watched_scaler_loads_without_ampwatch(memory) -> None:
    run = ampwatch.init("review", transport=memory)
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    run.watch(scaler=scaler)
    data = pickle.dumps(scaler)
    run.finish()
    assert b"ampwatch" not in data
    assert pickle.loads(data).state_dict()["scale"] == 128.0


def test_a_batch_that_read_the_run_before_another_committed_does_not_move_it_back(live_server) -> None:
    """Batch A (step 100, a warning) reads the run, then is held up just before it writes; meanwhile batch B
    of another rank (step 399, critical) commits. A must not put last_step back to 100 or health to warning."""
    import threading
    import time

    from sqlalchemy import event

    held = threading.Event()

    def hold_first_claim(_conn, _cursor, statement: str, *_args) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO BATCHES") and not held.is_set():
            held.set()
            time.sleep(1.0)  # the real interleaving of two ranks' requests, made certain

    engine = live_server.app.state.engine
    event.listen(engine, "before_cursor_execute", hold_first_claim)

    def post(client, rank: int, step: int, severity: str) -> int:
        body = {
            "rank": rank,
            "seq": 1,
            "points": {"loss": {"steps": [step], "values": [1.0]}},
            "events": [{"step": step, "type": "grad_spike", "severity": severity, "message": "x"}],
        }
        return client.post("/api/v1/runs/race/batches", json=body).status_code

    try:
        with live_server.client() as client, live_server.client() as other:
            assert client.put("/api/v1/runs/race", json={"project": "p", "name": "race"}).status_code == 200
            statuses: list[int] = []
            first = threading.Thread(target=lambda: statuses.append(post(client, 0, 100, "warning")))
            first.start()
            assert held.wait(10)
            assert post(other, 1, 399, "critical") == 200
            first.join(30)
            final = other.get("/api/v1/runs/race").json()
            assert statuses == [200]
    finally:
        event.remove(engine, "before_cursor_execute", hold_first_claim)
    assert (final["last_step"], final["health"]) == (399, "critical")


def test_watching_a_model_again_leaves_no_hooks_of_the_first_watch(memory) -> None:
    """A second watch(model=...) (here to add the scaler) replaces the first's hooks: none is left on the model after
    finish(), and the configuration check (a scaler without autocast) speaks once, not at every forward."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("review", "watched-twice", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer)
        run._recorder._probe.arm()  # (private: armed, as after a non-finite value, when the model is watched again)
        run.watch(model=model, scaler=scaler)
        for _ in range(30):
            scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()  # (no autocast: an amp_config event)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    assert not model._forward_pre_hooks and not any(m._forward_hooks for m in model.modules())
    events = memory.events(run.id)
    assert [e["type"] for e in events].count("amp_config") == 1


def test_a_loop_without_a_watched_model_stays_lean_after_a_non_finite_loss(memory, monkeypatch) -> None:
    """The diagnosis asks for the NaN-origin probe after an inf loss; without a model there is none to arm, and the
    request must not take every later step off the lean path (and back on: once per plan, every 50 steps)."""
    from ampwatch._step_end import StepEnd

    entered = []
    enter = StepEnd._enter_lean
    monkeypatch.setattr(StepEnd, "_enter_lean", lambda rec: entered.append(rec.step) or enter(rec))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    lean = []
    with ampwatch.init("review", "no-model", transport=memory) as run:
        run.watch(optimizer=optimizer, scaler=scaler)
        for step in range(400):
            lean.append(run._recorder._lean_optimizer is not None)  # (private: which path this step begins on)
            _runs.clipped_step(model, optimizer, scaler, torch.full((8, 4), float("inf")) if step == 100 else None)
            if step == 100:
                assert run._worker.flush(10)  # (private: the diagnosis has seen it)
    assert sum(lean[200:]) > 180 and len([s for s in entered if s > 200]) <= 5
    assert "nonfinite_loss" in [e["type"] for e in memory.events(run.id)]


def test_a_standard_name_logged_for_the_next_step_wins_there(memory) -> None:
    """`run.log({"loss": v}, step=k + 1)` during step k: at step k + 1 the user's loss is recorded, not the agent's
    (the lean path, which does not look at what the user logged, must not take that step). Logging ahead at
    every step is not covered: the agent remembers one step's names."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("review", "logged-ahead", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(120):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            if step == 100:  # (a step that does more: the lean path was planned from the next one on)
                run.log({"loss": 123.0}, step=101)
            scaler.update()
            optimizer.zero_grad()
    losses = _series(memory, run.id, "loss")
    assert losses["steps"] == list(range(120)) and losses["values"][101] == 123.0


def test_a_deeply_nested_module_gets_a_layer_series_within_the_servers_limit(memory, monkeypatch) -> None:
    """A module path of 250 characters would make `grad_norm/<module>` too long a name, and the server refuses a
    whole batch for one bad name (and with it every step's loss there); the series keeps the path's end instead."""
    monkeypatch.setenv("AMPWATCH_LAYER_NORM_INTERVAL", "10")
    inner = torch.nn.Linear(4, 1)
    model = torch.nn.Sequential()
    parent = model
    for depth in range(5):  # five levels of 49-character names
        child = torch.nn.Sequential() if depth < 4 else inner
        parent.add_module(f"level{depth}_" + "x" * 42, child)
        parent = child
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("review", "deep", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for _ in range(30):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    assert _series(memory, run.id, "loss")["steps"] == list(range(30))
    module = next(n for n, _ in model.named_modules() if n.endswith("level4_" + "x" * 42))
    layer = "grad_norm/…" + module[-189:]
    assert len(module) > 240 and _series(memory, run.id, layer)["steps"] == [0, 10, 20]


@dataclasses.dataclass
class _Config:
    lr: float = 3e-4
    layers: int = 12


@pytest.mark.parametrize("config", [argparse.Namespace(lr=3e-4, layers=12), _Config()], ids=["namespace", "dataclass"])
def test_a_config_that_is_not_a_dict_is_recorded_as_one(memory, config) -> None:
    """init(config=args), as many scripts pass argparse's result: it became a string, which the server refused as
    a config, so the run was never registered and nothing of it arrived."""
    with ampwatch.init("review", "config", transport=memory, config=config) as run:
        run.log({"x": 1.0}, step=0)
    assert memory.run(run.id)["config"] == {"lr": 3e-4, "layers": 12}
    assert _series(memory, run.id, "x")["steps"] == [0]


class _ListConfig(collections.abc.Sequence):
    """A sequence that is not a list or a tuple, as OmegaConf's ListConfig is (OmegaConf is not a test dependency)."""

    def __init__(self, *items: float) -> None:
        self._items = items

    def __getitem__(self, i: Any) -> Any:
        return self._items[i]

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return repr(list(self._items))


def test_a_config_sequence_that_is_not_a_list_is_recorded_as_a_list(memory) -> None:
    # (an OmegaConf config's lists were stored as strings: "[0.9, 0.95]")
    config = {"optim": {"lr": 3e-4, "betas": _ListConfig(0.9, 0.95)}}
    with ampwatch.init("review", "config-list", transport=memory, config=config) as run:
        run.log({"x": 1.0}, step=0)
    assert memory.run(run.id)["config"] == {"optim": {"lr": 3e-4, "betas": [0.9, 0.95]}}


_FORGOTTEN_RUN_SCRIPT = """
import sys, ampwatch
def main():
    run = ampwatch.init("review", "forgotten", url=sys.argv[1])
    run.log({"x": 1.0}, step=0)
    print(run.id)
main()  # the run is no longer referred to once main() returns
"""


def test_a_run_the_script_no_longer_refers_to_is_finished_at_exit(sqlite_server) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FORGOTTEN_RUN_SCRIPT, sqlite_server.url], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.split()[-1]
    with sqlite_server.client() as http:
        assert http.get(f"/api/v1/runs/{run_id}").json()["status"] == "finished"
    assert _server_series(sqlite_server, run_id, "x")["steps"] == [0]


def test_the_runs_of_a_sweep_in_one_distributed_launch_get_ids_of_their_own(monkeypatch) -> None:
    """Ranks derive a shared run id from the launch; a second init() in the same processes (a sweep) is another run."""
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    ids = {}
    for rank in ("0", "1"):  # each rank's process counts its own init() calls: one counter per "process" here
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setattr("ampwatch._run._LAUNCHES", __import__("itertools").count())
        runs = [ampwatch.init("review", "sweep", config={"trial": trial}) for trial in range(2)]
        for run in runs:
            run.finish()
        ids[rank] = [run.id for run in runs]
    assert ids["0"] == ids["1"] and ids["0"][0] != ids["0"][1]


def test_an_autocast_inside_the_models_forward_is_seen(memory) -> None:
    """Accelerate's fp16 wraps the model's forward in autocast: the forward runs under autocast, and a scaler with it
    is no configuration mistake (the check ran before that forward, and said there was no autocast)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model.forward = torch.autocast("cpu", dtype=torch.float16)(model.forward)  # (as Accelerate does)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("review", "autocast-inside", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for _ in range(3):
            scaler.scale(model(torch.randn(8, 4)).float().pow(2).mean()).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    assert "amp_config" not in [e["type"] for e in memory.events(run.id)]


def test_log_and_watch_after_finish_are_ignored(memory, caplog) -> None:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    run = ampwatch.init("review", "after-finish", transport=memory)
    run.finish()
    with caplog.at_level("WARNING", logger="ampwatch"):
        run.watch(model=model, optimizer=optimizer)
        run.log({"x": 1.0}, step=0)
    assert not run._worker.buffer and not optimizer._optimizer_step_pre_hooks  # (private: nothing buffered or hooked)
    assert "log() after finish()" in caplog.text and "watch() after finish()" in caplog.text


def test_a_logged_view_of_a_parameter_is_recorded_as_it_was_when_logged(memory) -> None:
    """`p[0]` has a grad_fn on the CPU, like a forward's result, but it is a view of a parameter that the optimizer
    then changes in place: the value logged is the value at log() time."""
    weight = torch.nn.Parameter(torch.tensor([1.0, 5.0]))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    with ampwatch.init("review", "view", transport=memory) as run:
        for step in range(3):
            run.log({"w0": weight[0]}, step=step)
            weight.sum().backward()
            optimizer.step()  # w0 falls by 1 each step
            optimizer.zero_grad()
    assert _series(memory, run.id, "w0")["values"] == [1.0, 0.0, -1.0]


def test_an_exception_that_cannot_be_printed_still_ends_the_run_crashed(memory) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise ValueError("no")

    with pytest.raises(Unprintable):
        with ampwatch.init("review", "unprintable", transport=memory) as run:
            run.log({"x": 1.0}, step=0)
            raise Unprintable()
    assert memory.run(run.id)["status"] == "crashed"
