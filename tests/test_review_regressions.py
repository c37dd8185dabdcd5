"""Defects a review found, each reproduced and now prevented."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import ampwatch


def _series(server, run_id: str, name: str) -> dict:  # type: ignore[no-untyped-def]
    with server.client() as http:
        return http.get(f"/api/v1/runs/{run_id}/series", params={"name": name}).json()[name]


def test_a_relaunch_under_the_same_run_id_keeps_both_processes_data(sqlite_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AMPWATCH_RUN_ID", "resumed-run")
    for steps in (range(0, 5), range(100, 105)):  # two processes, one after the other
        with ampwatch.init("review", "resume", url=sqlite_server.url) as run:
            for step in steps:
                run.log({"x": float(step)}, step=step)
    assert _series(sqlite_server, "resumed-run", "x")["steps"] == [0, 1, 2, 3, 4, 100, 101, 102, 103, 104]


def test_one_bad_metric_is_dropped_alone_and_the_run_still_finishes(sqlite_server) -> None:  # type: ignore[no-untyped-def]
    with ampwatch.init("review", "n" * 500, url=sqlite_server.url) as run:
        run.log({"loss": 1.0, "eval/" + "x" * 300: 0.5}, step=0)
        run.log({"loss": 2.0}, step=-1)
        run.log({"loss": 3.0}, step=1)
    with sqlite_server.client() as http:
        doc = http.get(f"/api/v1/runs/{run.id}").json()
    assert (doc["status"], len(doc["name"]), doc["series"]) == ("finished", 200, ["loss"])
    assert _series(sqlite_server, run.id, "loss") == {"steps": [0, 1], "values": [1.0, 3.0]}


@pytest.mark.parametrize(("variable", "value"), [("AMPWATCH_RUN_ID", "not valid!"), ("RANK", "abc")])
def test_init_never_raises_on_a_bad_environment(monkeypatch, variable: str, value: str) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(variable, value)
    monkeypatch.setenv("AMPWATCH_MODE", "disabled")
    run = ampwatch.init("review")
    assert isinstance(run, ampwatch.Run)
    run.finish()


def test_a_logged_accumulator_is_recorded_as_it_was_when_logged(sqlite_server) -> None:  # type: ignore[no-untyped-def]
    total = torch.zeros(())
    with ampwatch.init("review", "accumulator", url=sqlite_server.url) as run:
        for step in range(4):
            total += 5.0
            run.log({"total": total}, step=step)
            total.zero_()  # as HF Trainer does with its loss accumulator
    assert _series(sqlite_server, run.id, "total")["values"] == [5.0, 5.0, 5.0, 5.0]


def test_an_unreadable_spooled_batch_is_set_aside_and_the_rest_is_uploaded(sqlite_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    with ampwatch.init("review", "torn", url=sqlite_server.url) as run:
        for step in range(3):
            run.log({"x": float(step)}, step=step)
            run._worker.flush(5)  # one batch per step
    spool = Path(os.environ["AMPWATCH_SPOOL_DIR"])
    first = sorted(spool.rglob("[0-9]*.json"))[0]
    first.write_text("")  # a crash between write and rename
    done = subprocess.run([shutil.which("ampwatch") or "ampwatch", "sync", str(spool), "--url", sqlite_server.url],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert _series(sqlite_server, run.id, "x")["steps"] == [1, 2]
    assert [p.name for p in spool.rglob("*.bad")] == [first.with_suffix(".bad").name]  # kept for a person
    assert "unreadable" in done.stderr  # and the loss was said out loud


def test_a_pickled_watched_scaler_loads_without_ampwatch() -> None:
    run = ampwatch.init("review", url="http://127.0.0.1:9")
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    run.watch(scaler=scaler)
    data = pickle.dumps(scaler)
    run.finish()
    assert b"ampwatch" not in data
    assert pickle.loads(data).state_dict()["scale"] == 128.0



def test_a_batch_that_read_the_run_before_another_committed_does_not_move_it_back(live_server) -> None:  # type: ignore[no-untyped-def]
    """Batch A (step 100, a warning) reads the run, then is held up just before it writes; meanwhile batch B
    of another rank (step 399, critical) commits. A must not put last_step back to 100 or health to warning."""
    import threading
    import time

    from sqlalchemy import event

    held = threading.Event()

    def hold_first_claim(_conn, _cursor, statement: str, *_args) -> None:  # type: ignore[no-untyped-def]
        if statement.lstrip().upper().startswith("INSERT INTO BATCHES") and not held.is_set():
            held.set()
            time.sleep(1.0)  # the real interleaving of two ranks' requests, made certain

    engine = live_server.app.state.engine
    event.listen(engine, "before_cursor_execute", hold_first_claim)

    def post(client, rank: int, step: int, severity: str) -> int:  # type: ignore[no-untyped-def]
        body = {"rank": rank, "seq": 1, "points": {"loss": {"steps": [step], "values": [1.0]}},
                "events": [{"step": step, "type": "grad_spike", "severity": severity, "message": "x"}]}  # fmt: skip
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
