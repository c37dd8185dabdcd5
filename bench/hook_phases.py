"""Where the agent's cost on the training thread goes: each phase of the step, timed in place.

The benchmark step of `agent_overhead.py` (~1 ms on the CPU), split at the calls the agent hooks: scale,
unscale_, clip_grad_norm_, step, update (and the whole step). Steps alternate between a plain scaler and a
watched one on the same model, in random order within each pair, and each phase's added cost is the mean of
the pair differences with the top and bottom 1 % left out (the median beside it). Steps the agent begins on
its lean path ("lean", see ampwatch/_step_end.py) and the others are also shown apart.

Timed like this, in place, a hook costs several times what it costs in a tight loop: between the training
step's own work, most of its cost is the memory it touches.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import Server
from _step import ORIGINAL_CLIP_GRAD_NORM, build, calibrate

PHASES = ("scale", "unscale_", "clip", "step", "update", "whole")


def _step(trainer: Any, scaler: Any, clip: Any, out: list[tuple[int, ...]]) -> None:
    import torch

    clock = time.perf_counter_ns
    model, optimizer = trainer.model, trainer.optimizer
    t0 = clock()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(trainer.x), trainer.y)
    t1 = clock()
    scaled = scaler.scale(loss)
    t2 = clock()
    scaled.backward()
    t3 = clock()
    scaler.unscale_(optimizer)
    t4 = clock()
    (clip or torch.nn.utils.clip_grad_norm_)(model.parameters(), 1.0)
    t5 = clock()
    scaler.step(optimizer)
    t6 = clock()
    scaler.update()
    t7 = clock()
    optimizer.zero_grad(set_to_none=True)
    t8 = clock()
    out.append((t2 - t1, t4 - t3, t5 - t4, t6 - t5, t7 - t6, t8 - t0))


def _trimmed_mean(values: list[float]) -> float:
    cut = len(values) // 100
    return statistics.fmean(sorted(values)[cut : len(values) - cut])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=10_000, help="step pairs (default 10000)")
    parser.add_argument("--hidden", type=int, help="MLP width (default: calibrated to a ~1 ms step)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    import ampwatch

    torch.set_num_threads(1)
    hidden = args.hidden or calibrate(1e-3, 64)[0]
    pin = len(os.sched_getaffinity(0)) > 1
    with (
        tempfile.TemporaryDirectory() as tmp,
        Server(f"sqlite:///{tmp}/db.sqlite", Path(tmp) / "server.log", cpus={1} if pin else None) as server,
    ):
        server.wait_ready()
        trainer = build(hidden, 64)
        watched = torch.amp.GradScaler("cpu")
        if pin:  # the sender thread (started by init) on the helper CPU, the training thread on the first
            os.sched_setaffinity(0, {1})
        run = ampwatch.init(project="hook-phases", url=server.url)
        if pin:
            os.sched_setaffinity(0, {0})
        run.watch(trainer.model, trainer.optimizer, watched)
        plain: list[tuple[int, ...]] = []
        agent: list[tuple[int, ...]] = []
        lean: list[bool] = []
        order = random.Random(args.seed)
        for _ in range(args.pairs):
            lean.append(run._recorder._lean_optimizer is not None)  # (private: which path the watched step begins on)
            halves = [(trainer.scaler, ORIGINAL_CLIP_GRAD_NORM, plain), (watched, None, agent)]
            order.shuffle(halves)
            for scaler, clip, out in halves:
                _step(trainer, scaler, clip, out)
        run.finish()
    skip = min(200, args.pairs // 10)  # warm-up
    pairs = list(zip(plain, agent, lean))[skip:]
    print(
        f"hidden {hidden}, {len(pairs)} pairs; "
        f"plain step median {statistics.median(p[5] for p, _, _ in pairs) / 1e3:.1f} us"
    )
    print(f"{'phase':9s} {'added (trimmed mean)':>21s} {'median':>8s} {'lean steps':>11s} {'other steps':>12s}")
    for k, name in enumerate(PHASES):
        added = [(a[k] - p[k]) / 1e3 for p, a, _ in pairs]
        on_lean = [d for d, (_, _, is_lean) in zip(added, pairs) if is_lean]
        other = [d for d, (_, _, is_lean) in zip(added, pairs) if not is_lean]
        print(
            f"{name:9s} {_trimmed_mean(added):18.2f} us {statistics.median(added):5.2f} us "
            f"{statistics.median(on_lean) if on_lean else float('nan'):8.2f} us "
            f"{statistics.fmean(other) if other else float('nan'):9.2f} us"
        )
    print(f"lean steps: {sum(lean[skip:]) / len(pairs):.1%} (median per phase); other steps: mean per phase")


if __name__ == "__main__":
    main()
