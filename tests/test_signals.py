"""A training process stopped by a signal: the run is marked truthfully, what was queued arrives, and
the process still ends the way it would have without ampwatch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

import ampwatch

# A real training loop that prints each finished step and trains until it is stopped. The long flush
# interval keeps the steps queued in the agent, so only the shutdown path can deliver them.
SCRIPT = """
import signal, sys, time
import torch
import ampwatch

{prelude}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cpu")
run = ampwatch.init("signals", "{name}", url="{url}")
run.watch(model=model, optimizer=optimizer, scaler=scaler)
{loop}
"""

LOOP = """
step = 0
while True:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    print(step, flush=True)
    step += 1
    time.sleep(0.002)
"""


def _start(tmp_path: Path, url: str, name: str, prelude: str = "", loop: str = LOOP) -> subprocess.Popen[str]:
    script = tmp_path / f"{name}.py"
    script.write_text(SCRIPT.format(prelude=textwrap.dedent(prelude), name=name, url=url, loop=textwrap.dedent(loop)))
    env = {**os.environ, "AMPWATCH_FLUSH_INTERVAL_S": "60", "AMPWATCH_FINISH_TIMEOUT_S": "10"}
    return subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _stop_after(process: subprocess.Popen[str], steps: int, signum: int) -> tuple[int, int, str]:
    """Send `signum` once `steps` steps were printed; (exit status, last printed step, stderr)."""
    last = -1
    assert process.stdout is not None
    for line in process.stdout:
        last = int(line)
        if last + 1 == steps:
            process.send_signal(signum)
            break
    out, err = process.communicate(timeout=60)
    printed = [int(x) for x in out.split()]
    return process.returncode, printed[-1] if printed else last, err


def _run_state(server: Any) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    with server.client() as http:
        [run] = http.get("/api/v1/runs").json()
        events = http.get(f"/api/v1/runs/{run['id']}/events").json()
        series = http.get(f"/api/v1/runs/{run['id']}/series", params={"name": ["loss", "grad_norm"]}).json()
    return run, events, series


def test_sigterm_marks_the_run_crashed_delivers_every_queued_step_and_still_kills_the_process(
    sqlite_server, tmp_path
) -> None:
    process = _start(tmp_path, sqlite_server.url, "sigterm")
    status, last, err = _stop_after(process, 40, signal.SIGTERM)
    assert status == -signal.SIGTERM, err  # died by the signal, exactly as without ampwatch
    run, events, series = _run_state(sqlite_server)
    assert run["status"] == "crashed"
    [crash] = [e for e in events if e["type"] == "run_crashed"]
    assert "SIGTERM" in crash["message"] and crash["details"]["signal"] == "SIGTERM"
    # Every finished step was queued behind a 60 s flush interval, and all of them arrived.
    assert series["loss"]["steps"] == series["grad_norm"]["steps"] == list(range(crash["step"]))
    assert crash["step"] >= last + 1 >= 40


@pytest.mark.parametrize("inside_with", [True, False])
def test_a_users_own_sigterm_handler_is_chained_and_decides_how_the_process_ends(
    sqlite_server, tmp_path, inside_with: bool
) -> None:
    marker = tmp_path / "handler-ran"
    prelude = f"""
    def checkpoint_and_exit(signum, frame):
        open({str(marker)!r}, "w").write(str(signum))
        sys.exit(3)

    signal.signal(signal.SIGTERM, checkpoint_and_exit)
    """
    loop = "with run:\n" + textwrap.indent(textwrap.dedent(LOOP), "    ") if inside_with else LOOP
    process = _start(tmp_path, sqlite_server.url, "chained", prelude, loop)
    status, last, err = _stop_after(process, 30, signal.SIGTERM)
    assert status == 3, err  # the user's handler ran and chose the exit code
    assert marker.read_text() == str(int(signal.SIGTERM))
    run, events, series = _run_state(sqlite_server)
    assert run["status"] == "crashed"  # sys.exit(3) escaped the loop: not a clean end
    [crash] = [e for e in events if e["type"] == "run_crashed"]
    assert crash["details"]["exception"] == "SystemExit"
    assert series["loss"]["steps"] == list(range(crash["step"])) and crash["step"] >= 30


def test_ctrl_c_ends_the_run_as_crashed_with_its_reason_and_loses_nothing(sqlite_server, tmp_path) -> None:
    process = _start(tmp_path, sqlite_server.url, "sigint")  # no `with`, no finish(): the interpreter's exit path
    status, last, err = _stop_after(process, 30, signal.SIGINT)
    assert "KeyboardInterrupt" in err
    assert status in (-signal.SIGINT, 1), err  # Python re-raises an uncaught Ctrl-C as SIGINT on exit
    run, events, series = _run_state(sqlite_server)
    assert run["status"] == "crashed"
    [crash] = [e for e in events if e["type"] == "run_crashed"]
    assert "KeyboardInterrupt" in crash["message"] and crash["details"]["signal"] == "SIGINT"
    assert series["loss"]["steps"] == list(range(crash["step"])) and crash["step"] >= last + 1 >= 30


def test_the_handler_is_installed_only_from_the_main_thread(memory) -> None:
    before = signal.getsignal(signal.SIGTERM)
    if before is not signal.SIG_DFL:  # an earlier test of this process installed it: start from the default
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from ampwatch import _ending

    saved = dict(_ending._sigterm)
    _ending._sigterm.update(previous=None, pid=0)
    try:
        runs: list[ampwatch.Run] = []
        thread = threading.Thread(target=lambda: runs.append(ampwatch.init("signals", transport=memory)))
        thread.start()
        thread.join()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # not from a worker thread (it would raise there)
        runs[0].finish()
        run = ampwatch.init("signals", transport=memory)
        assert signal.getsignal(signal.SIGTERM) is _ending._on_sigterm
        run.finish()
    finally:
        signal.signal(signal.SIGTERM, before)
        _ending._sigterm.update(saved)


def test_as_a_containers_init_the_default_ignore_of_sigterm_is_kept(memory, monkeypatch) -> None:
    """PID 1 (a container without an init): the kernel ignores SIGTERM's default action there, so a handler
    that marks the run crashed and re-sends the signal would leave training running, recorded as crashed.
    (A real PID 1 needs a PID namespace, which CI may not allow; the process id is what the agent checks.)"""
    from ampwatch import _ending

    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    saved = dict(_ending._sigterm)
    _ending._sigterm.update(previous=None, pid=0)
    monkeypatch.setattr(_ending.os, "getpid", lambda: 1)
    try:
        run = ampwatch.init("signals", transport=memory)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        monkeypatch.undo()
        run.finish()
    finally:
        signal.signal(signal.SIGTERM, before)
        _ending._sigterm.update(saved)
