"""What the leading indicators cost on the training thread: on the interval steps that take them, and on the others.

The benchmark step of `agent_overhead.py` (an MLP under fp16 autocast, AdamW, GradScaler, unscale_/clip/step/update)
on two identical trainers, each watched by its own run (offline: spooled to a temporary folder, nothing sent); one
run's leading indicators are switched off after `watch()`. Steps alternate between the two in random order within
each pair, both at the same step number, so both take their per-layer norms, parameter check and anchor on the same
steps and the pair difference is the indicators' own cost: fp16_range's forward hooks and their `vector_norm`s, the
copy of the parameters before the optimizer step, the update norms and Adam's moments after it, and putting the
hooks in place and taking them away. Printed apart for the interval steps (every `--interval`) and the others, as
the mean of the pair differences with the top and bottom 1 % left out, and against the median plain step.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import statistics
import tempfile
import time
from typing import Any

from _step import build, calibrate


def _trimmed_mean(values: list[float]) -> float:
    values = sorted(values)
    cut = len(values) // 100
    return statistics.fmean(values[cut : len(values) - cut] if cut else values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=10_000, help="step pairs (default 10000)")
    parser.add_argument("--hidden", type=int, help="MLP width (default: calibrated to a ~1 ms step)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--interval", type=int, default=50, help="AMPWATCH_LAYER_NORM_INTERVAL (default 50)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    hidden = args.hidden or calibrate(1e-3, args.batch)[0]
    spool = tempfile.mkdtemp(prefix="ampwatch-bench-")
    os.environ.update(
        AMPWATCH_MODE="offline", AMPWATCH_SPOOL_DIR=spool, AMPWATCH_LAYER_NORM_INTERVAL=str(args.interval)
    )
    logging.getLogger("ampwatch").setLevel(logging.ERROR)  # (not the spool's "upload them with" at the end)
    import ampwatch

    trainers = [build(hidden, args.batch, args.seed), build(hidden, args.batch, args.seed)]
    runs = [ampwatch.init("bench", name=name) for name in ("indicators", "without")]
    for run, trainer in zip(runs, trainers):
        run.watch(model=trainer.model, optimizer=trainer.optimizer, scaler=trainer.scaler)
    recorder = runs[1]._recorder  # (the benchmark switches them off in one run: no setting does)
    recorder._indicators.disarm()
    recorder._indicators = None
    for trainer in trainers:  # warm-up
        for _ in range(2 * args.interval):
            trainer.step(_watched(trainer))
    rng = random.Random(args.seed)
    diffs: dict[bool, list[float]] = {True: [], False: []}
    plain: list[float] = []
    clock = time.perf_counter
    for _ in range(args.pairs):
        due = trainers[0].step_index % args.interval == 0
        assert trainers[1].step_index == trainers[0].step_index
        took = [0.0, 0.0]
        for which in rng.sample((0, 1), 2):
            trainer = trainers[which]
            start = clock()
            trainer.step(_watched(trainer))
            took[which] = clock() - start
        diffs[due].append(took[0] - took[1])
        plain.append(took[1])
    for run in runs:
        run.finish()
    shutil.rmtree(spool, ignore_errors=True)
    base = statistics.median(plain)
    print(f"MLP 64-{hidden}-{hidden}-10, batch {args.batch}, interval {args.interval}: {args.pairs} pairs")
    print(f"median step without the indicators: {base * 1e3:.3f} ms")
    print(f"{'steps':<16} {'pairs':>6} {'added (mean)':>14} {'median':>10} {'of a step':>10}")
    for due, label in ((True, "interval steps"), (False, "other steps")):
        values = diffs[due]
        if not values:
            continue
        mean = _trimmed_mean(values)
        print(
            f"{label:<16} {len(values):>6} {mean * 1e6:>11.1f} us {statistics.median(values) * 1e6:>7.1f} us "
            f"{mean / base:>+9.1%}"
        )
    per_step = _trimmed_mean(diffs[True]) / args.interval if diffs[True] else 0.0
    print(f"averaged over all steps: {per_step * 1e6:.2f} us per step ({per_step / base:+.2%})")


def _watched(trainer: Any) -> Any:
    """The trainer's own scaler, as the loop finds it (watched by its run)."""
    from _step import Variant

    return Variant(trainer.scaler)


if __name__ == "__main__":
    main()
