"""`Run.flush()` and `ampwatch.init(transport=...)`: the seams that let a script (and the agent's tests) wait for
what was recorded instead of sleeping."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import _memory
import _runs
import pytest

import ampwatch


def test_flush_returns_once_everything_recorded_so_far_is_delivered() -> None:
    memory = _memory.MemoryTransport()
    run = ampwatch.init("flush", "mid-run", transport=memory)
    _runs.train(run, range(5))
    run.log({"marker": 1.0}, step=4)
    assert run.flush(10.0) is True
    assert memory.series(run.id, ["step_seen", "marker"]) == {
        "step_seen": {"steps": [0, 1, 2, 3, 4], "values": [0.0, 1.0, 2.0, 3.0, 4.0]},
        "marker": {"steps": [4], "values": [1.0]},
    }
    assert memory.run(run.id)["status"] == "running"  # (flushed, not finished)
    run.finish()
    assert memory.run(run.id)["status"] == "finished"
    assert run.flush() is True  # nothing left after finish()


def test_flush_of_a_run_that_recorded_nothing_yet_returns_once_the_server_knows_the_run() -> None:
    """A script may flush right after init() to act on the run (stop it, link to it): the registration counts."""

    class SlowToRegister(_memory.MemoryTransport):
        def send(self, method: str, path: str, body: bytes) -> ampwatch.Response:
            if method == "PUT":
                time.sleep(0.3)  # (a loaded server: without the wait, flush() would return before this)
            return super().send(method, path, body)

    memory = SlowToRegister()
    with ampwatch.init("flush", "empty", transport=memory) as run:
        assert run.flush(10.0) is True
        assert memory.run(run.id)["status"] == "running"


class _Unavailable:
    """A server that answers 503 to everything (overloaded): the agent keeps its batches and retries."""

    def __init__(self) -> None:
        self.requests = 0

    def send(self, method: str, path: str, body: bytes) -> ampwatch.Response:
        self.requests += 1
        return ampwatch.Response(503, "busy")

    def close(self) -> None:
        pass


def test_flush_returns_once_what_the_server_did_not_take_is_in_the_spool(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AMPWATCH_SPOOL_DIR", str(tmp_path))
    monkeypatch.setenv("AMPWATCH_FINISH_TIMEOUT_S", "0.2")
    transport = _Unavailable()
    run = ampwatch.init("flush", "spooled", transport=transport)
    run.log({"x": 1.0}, step=0)
    started = time.monotonic()
    assert run.flush(10.0) is True
    assert time.monotonic() - started < 5.0  # (not the timeout: it returned once the batch was on disk)
    assert transport.requests >= 1
    [folder] = [p for p in tmp_path.iterdir() if p.name.startswith(run.id)]
    spooled = [json.loads(p.read_text()) for p in folder.glob("*.json") if p.name != "run.json"]
    assert {"x"} <= {name for batch in spooled for name in batch["points"]}
    run.finish()


def test_flush_says_false_when_nothing_took_the_batches_in_time(monkeypatch, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("AMPWATCH_SPOOL_DIR", str(blocker))  # no spool: the batches are held in memory only
    monkeypatch.setenv("AMPWATCH_FINISH_TIMEOUT_S", "0.2")
    run = ampwatch.init("flush", "held", transport=_Unavailable())
    run.log({"x": 1.0}, step=0)
    assert run.flush(0.5) is False
    assert run.flush("soon") is False  # type: ignore[arg-type]  # (never raises)
    run.finish()


def test_a_disabled_run_has_nothing_to_flush(monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_MODE", "disabled")
    run = ampwatch.init("flush", "disabled", transport=_memory.MemoryTransport())
    run.log({"x": 1.0})
    assert run.flush(0.0) is True


def test_the_memory_transport_stores_each_batch_once_as_the_server_does() -> None:
    """A reply lost after the batch was stored makes the agent send it again: stored once."""

    class LosesFirstReply(_memory.MemoryTransport):
        lost = False

        def send(self, method: str, path: str, body: bytes) -> ampwatch.Response:
            reply = super().send(method, path, body)
            if path.endswith("/batches") and not self.lost:
                self.lost = True
                return ampwatch.Response(0, "connection reset")
            return reply

    memory = LosesFirstReply()
    with ampwatch.init("flush", "resent", transport=memory) as run:
        run.log({"x": 1.0}, step=0)
        assert run.flush(10.0)
    assert memory.series(run.id) == {"x": {"steps": [0], "values": [1.0]}}
    assert memory.run(run.id)["status"] == "finished"


def test_flush_from_another_thread_while_training_goes_on() -> None:
    memory = _memory.MemoryTransport()
    run = ampwatch.init("flush", "threads", transport=memory)
    results: list[bool] = []
    flusher = threading.Thread(target=lambda: results.append(run.flush(10.0)))
    _runs.train(run, range(3))
    flusher.start()
    _runs.train(run, range(3, 6))
    flusher.join()
    assert results == [True]
    run.finish()
    assert memory.series(run.id, "step_seen")["step_seen"]["steps"] == list(range(6))


@pytest.mark.parametrize("reply", [400, 422])
def test_a_batch_the_server_refuses_is_not_waited_for(reply: int) -> None:
    class Refuses(_memory.MemoryTransport):
        def send(self, method: str, path: str, body: bytes) -> ampwatch.Response:
            return ampwatch.Response(reply, "no") if path.endswith("/batches") else super().send(method, path, body)

    run = ampwatch.init("flush", "refused", transport=Refuses())
    run.log({"x": 1.0}, step=0)
    assert run.flush(10.0) is True  # (dropped and counted: there is nothing left to wait for)
    run.finish()
