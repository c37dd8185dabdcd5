"""The agent is a guest: it never raises into the loop, never blocks it, never changes its numerics,
and adds no host-device read to a training step."""

from __future__ import annotations

import base64
import copy
import json
import os
import pickle
import socket
import threading
import time
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import _runs
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import ampwatch
from ampwatch import _watch
from ampwatch._buffer import KEEP_READ
from ampwatch._protocol import APPLIED_STEP


def _train(run: Any, steps: int = 30, *, fused: bool = False, nan_step: int | None = 7) -> list[torch.Tensor]:
    """A standard fp16 AMP loop (unscale_, clip, step, update); returns the final parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = torch.amp.GradScaler("cpu", growth_interval=5)
    if run is not None:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
    for step in range(steps):
        x = torch.randn(8, 16) * (1e3 if step % 9 == 4 else 1.0)  # some steps overflow fp16
        if step == nan_step:
            x[1, 2] = float("nan")
        loss = _runs.clipped_step(model, optimizer, scaler, x)
        if run is not None:
            run.log({"loss_again": loss, "lr": 1e-2})
    return [p.detach().clone() for p in model.parameters()]


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))


@pytest.mark.parametrize("fused", [False, True])
def test_parameters_are_bitwise_identical_with_and_without_the_agent(memory, fused: bool) -> None:
    baseline = _train(None, fused=fused)
    with ampwatch.init("guest", "bitwise", transport=memory) as run:
        watched = _train(run, fused=fused)
    assert _bitwise_equal(baseline, watched)
    assert not torch.equal(baseline[0], _train(None, steps=29, fused=fused)[0])  # the comparison can fail


def test_training_finishes_and_stays_correct_when_the_server_is_unreachable(monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_FINISH_TIMEOUT_S", "1")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    baseline = _train(None)
    run = ampwatch.init("guest", "down", url=f"http://127.0.0.1:{port}")
    watched = _train(run)
    started = time.monotonic()
    run.finish()
    assert time.monotonic() - started < 5
    assert _bitwise_equal(baseline, watched)


def test_a_server_that_never_answers_does_not_hold_up_the_loop(monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_FINISH_TIMEOUT_S", "0.5")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # accepts connections (kernel backlog) and never answers a byte
    held: list[socket.socket] = []
    stop = threading.Event()

    def hold() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                pass

    threading.Thread(target=hold, daemon=True).start()
    try:
        run = ampwatch.init("guest", "hang", url=f"http://127.0.0.1:{listener.getsockname()[1]}")
        started = time.monotonic()
        _train(run, steps=60)
        run.finish()
        elapsed = time.monotonic() - started
        # Every request would wait its full 5 s timeout: a loop that waited on the network could not finish in time.
        assert elapsed < 4.5, elapsed
        assert held, "the agent did try to reach the server"
        # and what the sender, waiting on the server, had not taken in yet waits on disk: every step, and the run's end
        docs = [json.loads(f.read_text()) for f in Path(os.environ["AMPWATCH_SPOOL_DIR"]).rglob("[0-9]*.json")]
        assert "finished" in [d["status"] for d in docs]
        assert (
            sum(len(base64.b64decode(d["points"]["loss"]["steps"])) // 8 for d in docs if "loss" in d["points"]) == 60
        )  # (int64s)
    finally:
        stop.set()
        listener.close()
        for conn in held:
            conn.close()


class _HostReads(TorchFunctionMode):
    """Counts Python-level host reads of tensors on this thread."""

    NAMES = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "_local_scalar_dense"}

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class _DenseReads(TorchDispatchMode):
    """Counts the dispatcher-level reads every host read ends in."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fused", [False, True])
def test_the_agent_adds_zero_host_reads_per_step(memory, fused: bool) -> None:
    def count(run: Any) -> tuple[Counter[str], Counter[str]]:
        with _HostReads() as python_reads, _DenseReads() as dense_reads:
            _train(run, steps=20, fused=fused)
        return python_reads.counts, dense_reads.counts

    without = count(None)
    with ampwatch.init("guest", "syncs", transport=memory) as run:
        with_agent = count(run)
    assert with_agent == without
    # The counter works: the standard non-fused loop reads found_inf once per step inside scaler.step().
    assert sum(without[1].values()) >= (0 if fused else 20)


@pytest.mark.internal_errors
def test_an_internal_agent_error_never_reaches_the_training_loop(memory, monkeypatch, caplog) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("agent bug")

    # Fault injection: the agent's own hooks fail at every step.
    monkeypatch.setattr(_watch.Recorder, "before_update", broken)
    monkeypatch.setattr(_watch.Recorder, "on_scale", broken)
    baseline = _train(None)
    with ampwatch.init("guest", "faulty", transport=memory) as run:
        watched = _train(run)
    assert _bitwise_equal(baseline, watched)
    assert "agent bug" in caplog.text


@pytest.mark.internal_errors
def test_a_record_the_sender_cannot_read_costs_only_itself_and_the_run_still_ends(memory, monkeypatch, caplog) -> None:
    monkeypatch.setenv(
        "AMPWATCH_FLUSH_INTERVAL_S", "60"
    )  # one pass at finish(): the bad record shares its chunk with the end
    with ampwatch.init("guest", "bad-record", transport=memory) as run:
        for step in range(20):
            run.log({"x": float(step)}, step=step)
        # Fault injection: a step record holding what is not a tensor, as a bug of the agent's could leave one.
        run._worker.record((APPLIED_STEP, 20, object(), None, object(), None))
        run.log({"x": 21.0}, step=21)
    status = memory.run(run.id)["status"]
    series = memory.series(run.id, ["x", "dropped_records", "dropped_records/unreadable"])
    assert status == "finished"
    assert series["x"]["steps"] == [*range(20), 21]
    assert series["dropped_records"]["values"] == series["dropped_records/unreadable"]["values"] == [1.0]
    assert "internal error in Batcher._readable" in caplog.text


def test_bad_arguments_never_raise_and_each_is_named_in_a_warning(caplog, monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_FINISH_TIMEOUT_S", "0.5")  # (nothing can be delivered to that URL: no need to wait)
    run = ampwatch.init("guest", url="not a url at all")
    run.watch(model=object(), optimizer=[object()], scaler="fp16")
    run.log({"ok": 1.0, "none": None, 3: 1.0, "vector": torch.ones(3), "text": "x"})
    run.log("not a dict")
    run.log({"x": 1.0}, step="seven")
    run.finish()
    run.finish()
    for said in (
        "watch(model=...) takes a torch.nn.Module, got object",
        "watch(optimizer=...) takes a torch.optim",
        "watch(scaler=...) takes a GradScaler, got str",
        "'none' is not a real number",
        "got 3",
        "log() takes a dict of names to values, got str",
        "step must be an integer, got 'seven'",
    ):
        assert said in caplog.text, said


def test_an_unknown_mode_gives_a_run_that_records_nothing(monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_MODE", "sideways")
    run = ampwatch.init("guest")
    assert isinstance(run, ampwatch.Run) and run.url is None
    _train(run, steps=3)
    run.finish()


def test_disabled_mode_sends_nothing(memory, monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_MODE", "disabled")
    with ampwatch.init("guest", "off", transport=memory) as run:
        _train(run, steps=5)
    assert run.url is None
    assert memory.runs() == []


def test_an_exception_in_the_loop_marks_the_run_crashed_and_propagates_unchanged(memory) -> None:
    error = ValueError("data loader exploded")
    with pytest.raises(ValueError) as raised:
        with ampwatch.init("guest", "crash", transport=memory) as run:
            _train(run, steps=3, nan_step=None)
            raise error
    assert raised.value is error
    assert memory.run(run.id)["status"] == "crashed"
    events = memory.events(run.id)
    assert [(e["type"], e["severity"], e["step"]) for e in events] == [("run_crashed", "critical", 3)]
    assert "data loader exploded" in events[0]["message"] and "Traceback" in events[0]["details"]["traceback"]


def test_a_watched_scaler_still_pickles_deep_copies_and_saves_state(memory) -> None:
    run = ampwatch.init("guest", transport=memory)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    run.watch(scaler=scaler)
    assert isinstance(scaler, torch.amp.GradScaler)
    assert type(scaler) is torch.amp.GradScaler and scaler.scale.__wrapped__ is torch.amp.GradScaler.scale
    for clone in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler), copy.copy(scaler)):
        assert type(clone) is torch.amp.GradScaler
        assert not set(vars(clone)) & {"_ampwatch_recorder", "scale", "step"}  # a plain, unwatched scaler
        assert clone.state_dict() == scaler.state_dict()
    assert scaler.state_dict()["scale"] == 256.0
    run.finish()
    assert not set(vars(scaler)) & {
        "_ampwatch_recorder",
        "scale",
        "unscale_",
        "step",
        "update",
        "__reduce_ex__",
    }  # unhooked
    assert scaler.scale.__func__ is torch.amp.GradScaler.scale


def test_records_dropped_past_the_buffer_cap_are_counted_reported_and_the_run_still_ends(
    memory, monkeypatch, caplog
) -> None:
    monkeypatch.setenv("AMPWATCH_MAX_PENDING_RECORDS", "10")
    monkeypatch.setenv("AMPWATCH_FLUSH_INTERVAL_S", "60")  # the sender sleeps through the loop: the buffer fills
    caplog.set_level("WARNING", logger="ampwatch")
    run = ampwatch.init("guest", "drops", transport=memory)
    for step in range(50):
        run.log({"x": float(step)}, step=step)
    started = time.monotonic()
    run.finish()  # the flush marker and the status are never dropped: finish() does not wait out its timeout
    assert time.monotonic() - started < 5
    doc = memory.run(run.id)
    data = memory.series(run.id)
    assert doc["status"] == "finished"
    assert data["x"]["steps"] == list(range(10))
    assert data["dropped_records"] == data["dropped_records/buffer_full"] == {"steps": [9], "values": [40.0]}
    assert set(data) == {"x", "dropped_records", "dropped_records/buffer_full"}  # (no other reason)
    assert "dropped 40 record(s)" in caplog.text and "buffer_full: 40" in caplog.text


def test_critical_detections_are_also_logged_locally(monkeypatch, caplog) -> None:
    monkeypatch.setenv("AMPWATCH_MODE", "offline")  # no server at all: the person still sees it in the terminal
    caplog.set_level("WARNING", logger="ampwatch")
    with ampwatch.init("guest", "local") as run:
        _train(run, steps=12, nan_step=7)
    critical = [r.getMessage() for r in caplog.records if r.name == "ampwatch" and r.levelname == "ERROR"]
    assert any(m.startswith("ampwatch: NaN loss at step 7:") for m in critical), caplog.text


def test_the_sender_reads_the_step_tensors_and_the_training_thread_frees_them(memory, monkeypatch) -> None:
    """A tensor's release lets go of the GIL: freed on the sender, each one handed the GIL to the training thread and
    waited to have it back. The norms clip_grad_norm_ returned (kept until the sender read them) are freed on the
    training thread, every few dozen steps and the rest at finish(); where nothing steps (a run that only logs
    tensors), the sender keeps a few passes' records at most."""
    monkeypatch.setenv("AMPWATCH_FLUSH_INTERVAL_S", "0.05")  # the sender reads many times during the loop
    freed_on: list[str] = []
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("guest", "frees", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for _ in range(200):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            weakref.finalize(norm, lambda: freed_on.append(threading.current_thread().name))
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            time.sleep(0.002)
        during = len(freed_on)
    del norm
    assert during > 100 and len(freed_on) == 200  # (freed as the loop went, not only at its end)
    assert set(freed_on) == {threading.current_thread().name}
    assert len(memory.series(run.id, "grad_norm")["grad_norm"]["steps"]) == 200

    only_logs = ampwatch.init("guest", "logs only", transport=memory)
    for step in range(40):
        only_logs.log({"x": torch.tensor(float(step))}, step=step)
        time.sleep(0.03)
    assert (
        0 < len(only_logs._worker.buffer.read) <= KEEP_READ
    )  # (private: the records kept for the training thread to free)
    only_logs.finish()
    assert not only_logs._worker.buffer.read


@pytest.mark.parametrize("scaled", [True, False], ids=["fp16-gradscaler", "bf16-no-scaler"])
def test_grad_norm_is_the_clips_own_value_on_every_step(memory, scaled: bool) -> None:
    """A loop that clips: the recorded grad_norm is what clip_grad_norm_ returned, to the last bit, on every step,
    the first one and those that take per-layer norms (every 50th) included; the per-layer norms are still there."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    totals = []
    with ampwatch.init("guest", "clip value", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for _ in range(120):
            with torch.autocast("cpu", dtype=torch.float16 if scaled else torch.bfloat16):
                loss = model(torch.randn(8, 16)).float().pow(2).mean()
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
            else:
                loss.backward()
            totals.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
    recorded = memory.series(run.id)
    assert recorded["grad_norm"]["steps"] == list(range(120))
    assert [v.hex() for v in recorded["grad_norm"]["values"]] == [float(t).hex() for t in totals]
    assert recorded["grad_norm/0"]["steps"] == [0, 50, 100]  # (the first Linear's per-layer norms, as before)
