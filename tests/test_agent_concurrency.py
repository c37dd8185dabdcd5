"""Many runs in one process, and runs fed from several threads: every point arrives once, nothing leaks."""

from __future__ import annotations

import threading

import _memory

import ampwatch


def _steps(memory: _memory.MemoryTransport, run_id: str, name: str) -> list[int]:
    return memory.series(run_id, name)[name]["steps"]


def _senders() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ampwatch-sender"]


def test_a_sweep_of_runs_in_one_process_finishes_each_and_leaves_no_threads(memory, wait_for) -> None:
    before = _senders()
    ids = []
    for trial in range(12):  # a hyper-parameter sweep: init, train, finish, next
        run = ampwatch.init("sweep", name=f"trial-{trial}", transport=memory, config={"lr": 10.0**-trial})
        for step in range(50):
            run.log({"loss": trial + 1.0 / (step + 1)}, step=step)
        assert len(_senders()) == len(before) + 1
        run.finish()
        ids.append(run.id)
        wait_for(
            lambda: _senders() == before, timeout_s=5, what="the finished run's sender thread to end"
        )  # not one per run
    assert len(set(ids)) == 12
    runs = {r["id"]: r for r in memory.runs(project="sweep")}
    assert set(runs) == set(ids)
    assert {r["status"] for r in runs.values()} == {"finished"}
    for trial, run_id in enumerate(ids):
        assert _steps(memory, run_id, "loss") == list(range(50)), trial


def test_concurrent_runs_and_threads_sharing_one_run_lose_and_duplicate_nothing(memory) -> None:
    shared = ampwatch.init("threads", name="shared", transport=memory)
    own_runs: list[ampwatch.Run] = []
    lock = threading.Lock()
    start = threading.Barrier(6)

    def feed_shared(worker: int) -> None:
        start.wait()
        for step in range(400):
            shared.log({f"worker{worker}": float(step * worker)}, step=step)

    def own_run(worker: int) -> None:
        run = ampwatch.init("threads", name=f"own-{worker}", transport=memory)
        with lock:
            own_runs.append(run)
        start.wait()
        for step in range(400):
            run.log({"loss": 1.0 / (step + 1)}, step=step)
        run.finish()

    threads = [threading.Thread(target=feed_shared, args=(w,)) for w in (1, 2, 3)]
    threads += [threading.Thread(target=own_run, args=(w,)) for w in (1, 2, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    shared.finish()
    for worker in (1, 2, 3):
        series = memory.series(shared.id, f"worker{worker}")[f"worker{worker}"]
        assert series["steps"] == list(range(400))
        assert series["values"] == [float(step * worker) for step in range(400)]
    assert len(own_runs) == 3
    for run in own_runs:
        assert _steps(memory, run.id, "loss") == list(range(400))
        assert memory.run(run.id)["status"] == "finished"
