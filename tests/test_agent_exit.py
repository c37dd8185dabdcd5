"""How a training process ends with a run open: at exit without finish(), with forked children (DataLoader
workers, os.fork), and with thousands of steps still buffered. Each is a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import ampwatch


@pytest.mark.parametrize(
    ("ending", "status"), [("pass", "finished"), ("raise RuntimeError('late failure')", "crashed")]
)
def test_a_script_that_never_calls_finish_is_closed_truthfully_at_exit(
    sqlite_server, tmp_path, ending: str, status: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import ampwatch\n"
        f"run = ampwatch.init('guest', 'no-finish', url={sqlite_server.url!r})\n"
        "for step in range(50):\n"
        "    run.log({'x': float(step)}, step=step)\n"
        f"{ending}\n"
    )
    subprocess.run([sys.executable, str(script)], capture_output=True, timeout=60)
    with sqlite_server.client() as http:
        [run] = http.get("/api/v1/runs").json()
        events = http.get(f"/api/v1/runs/{run['id']}/events").json()
        series = http.get(f"/api/v1/runs/{run['id']}/series", params={"name": "x"}).json()
    assert run["status"] == status
    assert len(series["x"]["steps"]) == 50  # nothing left behind in the buffer
    assert [e["type"] for e in events] == ([] if status == "finished" else ["run_crashed"])


def test_dataloader_workers_forked_mid_run_start_no_sender_and_exit_cleanly(sqlite_server) -> None:
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 4))
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, num_workers=2, multiprocessing_context="fork")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("guest", "fork", url=sqlite_server.url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for _ in range(2):  # two epochs: the workers are forked twice while the sender runs
            for x, y in loader:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = (model(x).float() - y).pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
    senders = [t for t in threading.enumerate() if t.name == "ampwatch-sender" and t.is_alive()]
    assert len(senders) <= 1  # only this run's, finishing
    with sqlite_server.client() as http:
        run_doc = http.get(f"/api/v1/runs/{run.id}").json()
        data = http.get(f"/api/v1/runs/{run.id}/series", params={"name": "loss"}).json()
    assert run_doc["status"] == "finished"
    assert data["loss"]["steps"] == list(range(16))  # each step once: no child sent anything


_FORKING_SCRIPT = """
import os, sys, time, urllib.request, json
import ampwatch
run = ampwatch.init("guest", "forks", url=sys.argv[1])
run.log({"loss": 1.0}, step=0)
child = os.fork()
if child == 0:
    sys.exit(0)  # a child that ends normally: atexit hooks run here
os.waitpid(child, 0)
time.sleep(0.5)
status = json.load(urllib.request.urlopen(sys.argv[1] + "/api/v1/runs/" + run.id))["status"]
run.log({"loss": 0.5}, step=1)
run.finish()
print(status, run.id)
"""


def test_a_forked_child_that_exits_normally_does_not_finish_its_parents_run(sqlite_server) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FORKING_SCRIPT, sqlite_server.url], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    status_after_child_exit, run_id = done.stdout.split()
    assert status_after_child_exit == "running"
    with sqlite_server.client() as http:
        assert http.get(f"/api/v1/runs/{run_id}").json()["status"] == "finished"
        assert http.get(f"/api/v1/runs/{run_id}/series", params={"name": "loss"}).json()["loss"]["steps"] == [0, 1]


_CHILD_LOGS_SCRIPT = """
import os, sys, time, ampwatch
run = ampwatch.init("guest", "child-logs", url=sys.argv[1])
run.log({"x": 0.0}, step=0)
time.sleep(0.3)
child = os.fork()
if child == 0:  # a forked worker that logs something of its own, and sends it before the parent's next batch
    run.log({"from_child": 1.0}, step=0)
    time.sleep(0.5)
    os._exit(0)
time.sleep(0.2)
run.log({"x": 1.0}, step=1)
os.waitpid(child, 0)
run.finish()
print(run.id)
"""


def test_a_forked_child_that_logs_sends_under_its_own_numbers_and_the_parent_loses_nothing(sqlite_server) -> None:
    """The child once sent its batch under the parent's next sequence number, and the server then took the
    parent's own batch for a re-send of it: the parent's step 1 was lost."""
    env = {**os.environ, "AMPWATCH_FLUSH_INTERVAL_S": "0.05"}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD_LOGS_SCRIPT, sqlite_server.url],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.split()[-1]
    with sqlite_server.client() as http:
        series = http.get(f"/api/v1/runs/{run_id}/series", params={"name": ["x", "from_child"]}).json()
    assert series["x"]["steps"] == [0, 1] and series["from_child"]["steps"] == [0]


_DATALOADER_SCRIPT = """
import sys, torch, ampwatch
dataset = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 4))
loader = torch.utils.data.DataLoader(dataset, batch_size=8, num_workers=2, multiprocessing_context="fork")
model = torch.nn.Linear(16, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
run = ampwatch.init("guest", "fork-exit", url=sys.argv[1])
run.watch(model=model, optimizer=optimizer, scaler=scaler)
for x, y in loader:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (model(x).float() - y).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
print(run.id)
# no finish(): the process ends here, with forked workers having come and gone
"""


def test_a_real_process_with_forked_dataloader_workers_exits_without_hanging_and_its_run_is_finished(
    sqlite_server,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _DATALOADER_SCRIPT, sqlite_server.url], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.split()[-1]
    with sqlite_server.client() as http:
        assert http.get(f"/api/v1/runs/{run_id}").json()["status"] == "finished"
        assert http.get(f"/api/v1/runs/{run_id}/series", params={"name": "loss"}).json()["loss"]["steps"] == list(
            range(8)
        )


_BUFFERED_EXIT_SCRIPT = """
import sys, torch, ampwatch
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
run = ampwatch.init("guest", "buffered-exit")
run.watch(model=model, optimizer=optimizer, scaler=scaler)
for step in range(1500):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(8, 16)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
if sys.argv[1] == "finish":
    run.finish()
"""


@pytest.mark.parametrize("ending", ["finish", "exit"])
def test_a_process_ending_with_thousands_of_steps_still_buffered_exits_cleanly_and_keeps_them(
    sqlite_server, tmp_path, ending: str
) -> None:
    # Regression: the sender freed the last records' tensors after finish() had returned; a tensor's release lets
    # go of the GIL, and taking it back during interpreter shutdown aborted the process ("terminate called...").
    env = {
        **os.environ,
        "AMPWATCH_MODE": "offline",
        "AMPWATCH_SPOOL_DIR": str(tmp_path),
        "AMPWATCH_FLUSH_INTERVAL_S": "1000",
    }
    done = subprocess.run(
        [sys.executable, "-c", _BUFFERED_EXIT_SCRIPT, ending], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    synced = subprocess.run(
        [sys.executable, "-m", "ampwatch._cli", "sync", str(tmp_path), "--url", sqlite_server.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert synced.returncode == 0, synced.stderr
    with sqlite_server.client() as http:
        [run] = http.get("/api/v1/runs").json()
        series = http.get(f"/api/v1/runs/{run['id']}/series", params={"name": "loss", "max_points": 5000}).json()
    assert run["status"] == "finished"
    assert series["loss"]["steps"] == list(range(1500))
