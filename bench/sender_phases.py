"""Where the agent's sender thread spends its CPU, per training step, and what its bursts cost the training thread.

The benchmark step of `agent_overhead.py` (~1 ms on the CPU) runs for `--seconds` on the first CPU, watched by a
run that sends to a real `ampwatch server` (SQLite); the sender thread and the server get the other CPU. The
sender's phases are timed with the thread's CPU clock by wrapping the agent's own functions (private names: this
is a profiling tool, not an API): reading the records' tensors, decoding them into series, diagnosis, packing,
JSON, delivery (HTTP), and freeing the records (now ~0: the training thread frees them, see Worker.free_read_records).

stall = what the steps that overlap a burst (or end within 4 ms after it) took beyond the mean step outside the
bursts, per step of the whole run, in two parts: while the sender works on its records (it holds the GIL; the
training thread waits for it, and then for its own wake-up), and while it waits on the server's reply (the GIL
is free, but the local server's work on the other CPU slows the training thread too: a cost of the server
sharing the machine, not of the agent). On a spare core, the first part should read about the sender's CPU for
it; on the shared 2-core VMs it reads 1.5-2x as much (each hand-over of the GIL costs the waiting thread its
wake-up).
wake-ups = the training thread's voluntary context switches per step (Linux): each is a wait for the GIL, and
each costs the thread its wake-up (tens of µs of CPU, and up to a millisecond of wall time, on some VMs): these
count how often the sender's bursts interrupt the training thread.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import Server
from _conditions import Ampwatch
from _step import build, calibrate


def _timed(totals: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.thread_time() - started

    return wrapper


def _wakeups() -> int | None:
    """This thread's voluntary context switches so far (None where /proc does not say)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))
    except (OSError, StopIteration, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=40.0, help="training time measured (default 40)")
    parser.add_argument("--hidden", type=int, help="MLP width (default: calibrated to a ~1 ms step)")
    args = parser.parse_args()

    import torch

    from ampwatch import _batcher, _origin, _outbox, _protocol, _steps, _worker

    torch.set_num_threads(1)
    totals: dict[str, float] = collections.defaultdict(float)
    for module, name, label in (
        (_batcher, "to_host", "read"),
        (_batcher, "_tensors", "list tensors"),
        (_protocol, "packed", "pack"),
        (_outbox, "encode", "JSON"),
        (_steps.StepDecoder, "decode_lean", "decode"),
        (_steps.StepDecoder, "decode", "decode"),
        (_origin.Diagnosis, "observe_columns", "diagnose"),
        (_outbox.Outbox, "deliver", "deliver (HTTP)"),
    ):
        setattr(module, name, _timed(totals, label, getattr(module, name)))
    bursts: list[
        tuple[float, float, float, float]
    ] = []  # (start, delivery start, end, CPU) of each pass of the sender's loop

    def loop(self: Any) -> None:  # Worker._loop, with its phases timed
        while True:
            self._wake.wait(self._settings.flush_interval_s)
            self._wake.clear()
            start, cpu = time.perf_counter(), time.thread_time()
            entries = self.buffer.drain()
            self._absorb(entries)
            freeing = time.thread_time()
            self.buffer.keep_read(entries)  # (as Worker._loop: the training thread frees them)
            del entries
            totals["free records"] += time.thread_time() - freeing
            self._release_waiters()
            self._heartbeat()
            delivering = time.perf_counter()
            self._deliver()
            bursts.append((start, delivering, time.perf_counter(), time.thread_time() - cpu))
            if self._stop and not self.buffer:
                return

    _worker.Worker._loop = loop
    hidden = args.hidden or calibrate(1e-3, 64)[0]
    pin = len(os.sched_getaffinity(0)) > 1
    steps: list[tuple[float, float]] = []  # (end, duration)
    with (
        tempfile.TemporaryDirectory() as tmp,
        Server(
            f"sqlite:///{tmp}/db.sqlite", Path(tmp) / "server.log", cpus={1} if pin else None, nice=19 if pin else 0
        ) as server,
    ):
        server.wait_ready()
        trainer = build(hidden, 64)
        condition = Ampwatch("ampwatch", server.url)
        if pin:  # the sender thread (started by init) on the helper CPU, the training thread on the first
            os.sched_setaffinity(0, {1})
        variant = condition.start(trainer)
        if pin:
            os.sched_setaffinity(0, {0})
        for _ in range(300):  # warm-up
            trainer.step(variant)
        totals.clear()
        bursts.clear()
        clock = time.perf_counter
        wakeups = _wakeups()
        end = clock() + args.seconds
        while True:
            started = clock()
            trainer.step(variant)
            done = clock()
            steps.append((done, done - started))
            if done > end:
                break
        measured = dict(totals)
        woken = _wakeups()
        measured_bursts = [b for b in bursts if b[0] <= end]
        condition.stop()
        condition.close()
    # Each step is charged to the first part of a burst it overlaps: the pass (the sender holds the GIL), or the
    # wait on the server's reply (up to 4 ms after it: the training thread's wake-up once the sender is done).
    part = [0] * len(steps)  # 0: outside the bursts, 1: during a pass, 2: during a delivery
    ends = [t for t, _ in steps]
    for start, delivering, stop, _ in measured_bursts:
        for i in range(bisect.bisect_left(ends, start), bisect.bisect_left(ends, stop + 0.004)):
            began = ends[i] - steps[i][1]
            part[i] = part[i] or (1 if began < delivering else 2)
    outside = [d for (_, d), p in zip(steps, part) if not p]
    baseline = sum(outside) / len(outside)
    stall = [sum(d - baseline for (_, d), p in zip(steps, part) if p == which) for which in (1, 2)]
    n = len(steps)
    print(
        f"hidden {hidden}: {n} steps in {args.seconds:.0f} s, mean step outside the bursts {baseline * 1e6:.1f} us, "
        f"{len(measured_bursts)} bursts"
    )
    print(f"sender CPU per step   {sum(b[3] for b in measured_bursts) / n * 1e6:6.2f} us")
    for name, seconds in measured.items():
        print(f"  {name:19s} {seconds / n * 1e6:6.2f} us")
    print(f"stall per step        {sum(stall) / n * 1e6:6.2f} us (training thread, during the bursts)")
    print(
        f"  during the passes   {stall[0] / n * 1e6:6.2f} us (sender CPU for them "
        f"{(sum(b[3] for b in measured_bursts) - measured.get('deliver (HTTP)', 0.0)) / n * 1e6:.2f} us)"
    )
    print(f"  awaiting the server {stall[1] / n * 1e6:6.2f} us")
    if wakeups is not None and woken is not None:
        print(
            f"wake-ups per step     {(woken - wakeups) / n:6.3f}    "
            f"(training thread; {(woken - wakeups) / max(1, len(measured_bursts)):.1f} per burst)"
        )


if __name__ == "__main__":
    main()
