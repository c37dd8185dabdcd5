"""Per-step cost of the agent on a ~1 ms CPU mixed-precision training step, and the host reads it adds.

The step: a small MLP under `torch.autocast("cpu", float16)`, AdamW, `torch.amp.GradScaler("cpu")` with
scale/backward, unscale_, clip_grad_norm_, step, update, zero_grad. The MLP width is calibrated so one
step takes about `--target-ms` here. Conditions:

  none          the plain loop
  ampwatch      `ampwatch.init(...)` + `run.watch(model, optimizer, scaler)`, sending to a real
                `ampwatch server` started by this script (SQLite in a temporary folder); one run per
                condition for the whole benchmark, as a training run lasts, flushed at the end of each
                block (its one-time costs, init and finish, are printed apart)
                (the loop clips with `torch.nn.utils.clip_grad_norm_`, so the agent records the norm
                that call returns instead of computing a second one)
  ampwatch-own-norm  the same, with a `clip_grad_norm_` imported before `watch()`: the agent cannot
                see the clip and takes its own `_foreach_norm` after `unscale_` (as for a loop that
                does not clip)
  ampwatch+log  the same as `ampwatch` plus `run.log({"loss": loss})` with the loss tensor every step
  ampwatch-off  AMPWATCH_MODE=disabled + `run.watch(...)`: what the hooks cost with nothing sent
  tensorboard   `SummaryWriter.add_scalar` of loss, scale, skipped, grad_norm (if tensorboard is installed)
  wandb         `wandb.log` of the same values, offline (if wandb is installed)

Measurements (all on one model and optimizer, so no condition gets a luckier memory layout):

  paired        steps alternate between `none` and the condition (a second GradScaler is the watched
                one), in random order within each pair. overhead = mean(t_cond - t_none) / median(t_none)
                over thousands of adjacent pairs, the top and bottom 1 % left out: drift and other processes
                cancel, so this is the training thread's own cost to about 0.1 %, even on a busy 2-core
                machine, including what the agent does only every so many steps (the median, printed too,
                leaves that out).
                (Hooks the agent puts on the model itself would run in both halves of a pair and
                cancel out here; the sustained column still sees them. The `clip_grad_norm_` wrapper
                it installs while watching does not: the `none` half calls the original function.)
  background    CPU time of the threads the condition started (the agent's sender, the tensorboard writer)
                per step of the sustained blocks (steps at the loop's own pace), final flush included.
                On a spare core it competes with training only for the GIL, so on-thread + background
                estimates the real cost where a GIL hand-over is cheap (sender_phases.py: where it is not).
  sustained     whole blocks of `--sustained-steps` steps per condition, interleaved in shuffled rounds:
                end-to-end wall time with the background at work (noisier; a cross-check).
  host reads    counted on the training thread with a TorchFunctionMode (`item`, `tolist`, `__bool__`,
                `__float__`, `cpu`, `numpy`, ...) and a TorchDispatchMode (`aten._local_scalar_dense`).

Target (the product's, docs/benchmarks.md): <= 2 % on a ~1 ms step and 0 added host-device syncs per step.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Server, on_cpus, percentile, process_cpu_seconds, scratch_database, threads_cpu_s  # noqa: E402
from _conditions import Ampwatch, Condition, make_conditions  # noqa: E402
from _step import Trainer, build, calibrate, time_steps  # noqa: E402

TARGET_OVERHEAD = 0.02
TRIM = 0.01  # of the pair differences left out at each end of the on-thread mean
HOST_READ_METHODS = frozenset(
    {
        "item",
        "tolist",
        "__bool__",
        "__float__",
        "__int__",
        "__index__",
        "__complex__",
        "cpu",
        "numpy",
        "__array__",
    }
)


# -- measuring ------------------------------------------------------------------------------
@dataclass
class Result:
    name: str
    base_s: list[float] = field(default_factory=list)  # paired: the `none` step of each pair
    diff_s: list[float] = field(default_factory=list)  # paired: condition step - `none` step
    background_s: list[float] = field(default_factory=list)  # per step, per sustained block
    server_s: list[float] = field(default_factory=list)  # the local server's CPU per step, per sustained block
    sustained_ratios: list[float] = field(default_factory=list)
    sustained_s: list[float] = field(default_factory=list)
    reads: float = float("nan")
    dense: float = float("nan")
    by_name: dict[str, int] = field(default_factory=dict)


def paired_block(
    trainer: Trainer, condition: Condition, pairs: int, warm: int, rng: random.Random, result: Result
) -> None:
    """Alternate `none` and `condition` step by step; record each pair's difference."""
    clock = time.perf_counter
    variant = condition.start(trainer)
    plain = trainer.plain
    for _ in range(warm):
        trainer.step(variant)
        trainer.step(plain)
    for _ in range(pairs):
        first_plain = rng.random() < 0.5
        t0 = clock()
        trainer.step(plain if first_plain else variant)
        t1 = clock()
        trainer.step(variant if first_plain else plain)
        t2 = clock()
        t_plain, t_cond = (t1 - t0, t2 - t1) if first_plain else (t2 - t1, t1 - t0)
        result.base_s.append(t_plain)
        result.diff_s.append(t_cond - t_plain)
    condition.stop()


def sustained_rounds(
    trainer: Trainer,
    conditions: list[Condition],
    rounds: int,
    steps: int,
    warm: int,
    rng: random.Random,
    results: dict[str, Result],
    server_pid: int,
) -> None:
    """Whole blocks per condition, shuffled within each round; ratios against the round's `none` block. The
    background and server CPU per step are taken here, where steps come at the loop's own pace (in a pair
    they come half as often, and a sender's per-batch cost would count twice per step)."""
    for _ in range(rounds):
        order = conditions[:]
        rng.shuffle(order)
        per_step: dict[str, float] = {}
        for condition in order:
            variant = condition.start(trainer)
            for _ in range(warm):
                trainer.step(variant)
            threads0, server0 = threads_cpu_s(condition.threads), process_cpu_seconds(server_pid)
            per_step[condition.name] = time_steps(trainer, variant, steps)
            condition.stop()  # the final flush counts: it delivers this block's last steps
            results[condition.name].background_s.append(max(0.0, threads_cpu_s(condition.threads) - threads0) / steps)
            results[condition.name].server_s.append((process_cpu_seconds(server_pid) - server0) / steps)
            time.sleep(0.2)
        for name, step_s in per_step.items():
            results[name].sustained_s.append(step_s)
            results[name].sustained_ratios.append(step_s / per_step["none"])


def count_host_reads(trainer: Trainer, condition: Condition, steps: int) -> tuple[float, float, dict[str, int]]:
    """(python-level host reads, aten._local_scalar_dense calls) per step on this thread, and reads by name."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class FunctionReads(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: collections.Counter[str] = collections.Counter()

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = getattr(func, "__name__", "")
            if name in HOST_READ_METHODS:
                self.counts[name] += 1
            return func(*args, **(kwargs or {}))

    class DispatchReads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.ops.aten._local_scalar_dense.default:
                self.count += 1
            return func(*args, **(kwargs or {}))

    variant = condition.start(trainer)
    trainer.step(variant)  # first-step work (thread start) is not per-step
    functions, dispatch = FunctionReads(), DispatchReads()
    try:
        with functions, dispatch:
            for _ in range(steps):
                trainer.step(variant)
    finally:
        condition.stop()
    return sum(functions.counts.values()) / steps, dispatch.count / steps, dict(functions.counts)


def ampwatch_check(server_url: str, run_id: str) -> str:
    """What the server holds for an ampwatch run: its series and how many `loss` points."""
    try:
        with urllib.request.urlopen(f"{server_url}/api/v1/runs/{run_id}", timeout=10) as reply:
            run = json.load(reply)
        with urllib.request.urlopen(f"{server_url}/api/v1/runs/{run_id}/series?name=loss", timeout=30) as reply:
            loss = json.load(reply)["loss"]
        return f"series {run.get('series')}, {len(loss['steps'])} loss points, last_step {run.get('last_step')}"
    except Exception as error:  # a report line, never a crash
        return f"could not read the run back: {error!r}"


# -- reporting ------------------------------------------------------------------------------
@dataclass
class Summary:
    step_s: float
    on_thread: float  # fraction of a step (trimmed mean)
    on_thread_median: float
    on_thread_iqr: tuple[float, float]
    background: float  # fraction of a step
    ceiling: float
    sustained: float
    sustained_iqr: tuple[float, float]


def summarize(r: Result) -> Summary:
    step = statistics.median(r.base_s) if r.base_s else float("nan")
    if r.diff_s:
        ordered, k = sorted(r.diff_s), int(len(r.diff_s) * TRIM)
        on_thread, median = statistics.fmean(ordered[k : len(ordered) - k]) / step, statistics.median(ordered) / step
        iqr = (percentile(r.diff_s, 25) / step, percentile(r.diff_s, 75) / step)
    else:
        on_thread, median, iqr = 0.0, 0.0, (0.0, 0.0)
    background = statistics.fmean(r.background_s) / step if r.background_s else 0.0
    if r.sustained_ratios:
        sustained = statistics.median(r.sustained_ratios) - 1
        s_iqr = (percentile(r.sustained_ratios, 25) - 1, percentile(r.sustained_ratios, 75) - 1)
    else:
        sustained, s_iqr = float("nan"), (float("nan"), float("nan"))
    return Summary(step, on_thread, median, iqr, background, on_thread + background, sustained, s_iqr)


def print_tables(results: dict[str, Result], base_step_s: float, count_steps: int) -> dict[str, Summary]:
    """The timing table and the host-read table."""
    summaries = {}
    print("Timing: overhead as a fraction of the baseline step")
    header = (
        f"{'condition':<13} {'on-thread':>9} {'median':>7} {'IQR of pairs':>16} {'background':>10} {'= us':>7} "
        f"{'ceiling':>8} {'sustained':>9} {'IQR of rounds':>16} {'median step':>11} {'server us':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        s = summaries[name] = summarize(r)
        step = base_step_s * (1 + (s.sustained if s.sustained == s.sustained else s.on_thread))
        print(
            f"{name:<13} {s.on_thread:>+9.2%} {s.on_thread_median:>+7.2%} "
            f"{s.on_thread_iqr[0]:>+7.1%}..{s.on_thread_iqr[1]:>+7.1%} "
            f"{s.background:>+10.2%} {s.background * base_step_s * 1e6:>7.1f} {s.ceiling:>+8.2%} "
            f"{s.sustained:>+9.1%} {s.sustained_iqr[0]:>+7.1%}..{s.sustained_iqr[1]:>+7.1%} {step * 1e3:>8.3f} ms "
            f"{statistics.fmean(r.server_s) * 1e6 if r.server_s else float('nan'):>9.1f}"
        )
    print()
    print(f"Host reads on the training thread, per step ({count_steps} steps each)")
    print(f"{'condition':<13} {'python reads':>12} {'added':>6} {'_local_scalar_dense':>19} {'added':>6}  by name")
    base = results["none"]
    for name, r in results.items():
        names = ", ".join(f"{k} {v / count_steps:g}" for k, v in sorted(r.by_name.items())) or "-"
        print(
            f"{name:<13} {r.reads:>12.2f} {r.reads - base.reads:>+6.2f} {r.dense:>19.2f} "
            f"{r.dense - base.dense:>+6.2f}  {names}"
        )
    return summaries


LEGEND = """\
on-thread = mean over adjacent pairs of (condition step - none step) / median none step, the top and bottom 1 %
of pairs left out (one-off preemptions; what the agent does every 50 steps stays in, which the median of
the pairs, printed next to it, leaves out); IQR of pairs shows the per-step spread. background = CPU of the
threads the condition started (sender, writer) per step of the sustained blocks, final flush included.
ceiling = on-thread + background: what the agent itself costs the training thread when a spare core runs its
sender and a hand-over of the GIL is cheap (on VMs with slow wake-ups the thread loses 1.5-2x the sender's CPU
while it holds the GIL: sender_phases.py measures it). sustained = median over shuffled rounds of
a whole block of the condition / the round's `none` block: end-to-end wall time, which here also pays for the
local server's work on the helper CPU (it slows the training thread too) and for whatever else runs on the
machine (noisy). median step =
the baseline step scaled by the sustained (or on-thread) overhead. server us = CPU of the local ampwatch
server per logged step. Baseline host reads: GradScaler.step's found_inf .item() and AdamW's per-parameter
CPU step counters (no device sync on a GPU)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--conditions",
        default="none,ampwatch,ampwatch-own-norm,ampwatch+log,ampwatch-off,tensorboard,wandb",
        help="comma-separated (default: all; missing packages are skipped with a note)",
    )
    parser.add_argument(
        "--target-ms", type=float, default=1.0, help="calibrate the MLP width to this step time (default 1.0)"
    )
    parser.add_argument("--hidden", type=int, help="MLP width; skips calibration")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: the other core "
        "is left to background threads and the server, like a GPU host's spare cores)",
    )
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="do not pin the training thread to the first "
        "CPU and the server, sender threads and logger processes to the others",
    )
    parser.add_argument("--rounds", type=int, default=6, help="paired blocks per condition, interleaved (default 6)")
    parser.add_argument("--pairs", type=int, default=400, help="step pairs per paired block (default 400)")
    parser.add_argument("--warm", type=int, default=3, help="untimed steps after starting a condition (default 3)")
    parser.add_argument(
        "--sustained-rounds",
        type=int,
        default=8,
        help="rounds of whole blocks, 0 to skip (and the background with them) (default 8)",
    )
    parser.add_argument(
        "--sustained-steps", type=int, default=2000, help="steps per sustained block (default 2000: several flushes)"
    )
    parser.add_argument(
        "--count-steps", type=int, default=50, help="steps per condition for host-read counting (default 50)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed for orders (default 0)")
    parser.add_argument(
        "--profile", metavar="PATH", help="also cProfile the ampwatch condition (`--profile-steps`) into PATH"
    )
    parser.add_argument("--profile-steps", type=int, default=3000, help="steps to profile (default 3000)")
    parser.add_argument("--json", metavar="PATH", help="also write the raw results as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    cpus = sorted(os.sched_getaffinity(0))
    helpers = set(cpus[1:]) if args.pin and len(cpus) >= 2 else None
    if helpers:  # the training thread alone on the first CPU; what it starts under `on_cpus(helpers)` on the others
        os.sched_setaffinity(0, cpus[:1])
    if args.hidden:
        hidden = args.hidden
        trainer = build(hidden, args.batch)
        step_s = statistics.median(time_steps(trainer, trainer.plain, 100) for _ in range(3))
    else:
        hidden, step_s = calibrate(args.target_ms / 1e3, args.batch)
    print(
        f"ampwatch agent overhead: torch {torch.__version__}, {len(cpus)} CPUs, {args.threads} torch thread(s), "
        f"load average {os.getloadavg()[0]:.2f}\nstep: MLP 64-{hidden}-{hidden}-10, batch {args.batch}, fp16 autocast, "
        f"AdamW, GradScaler('cpu'), clip_grad_norm_: {step_s * 1e3:.3f} ms at calibration (fastest of 5 blocks)\n"
        f"paired: {args.rounds} blocks x {args.pairs} pairs per condition; sustained: {args.sustained_rounds} rounds x "
        f"{args.sustained_steps} steps\n"
        + (
            f"CPUs: the training thread on CPU {cpus[0]}; the agent's sender thread and the loggers' threads and "
            f"processes on CPU(s) {sorted(helpers)} (a GPU host's spare cores), with the local server at nice 19 "
            "(as if on another machine: it takes the spare CPU only when the senders leave it)"
            if helpers
            else "CPUs: not pinned"
        ),
        flush=True,
    )
    names = [c.strip() for c in args.conditions.split(",") if c.strip()]
    rng = random.Random(args.seed)
    with (
        tempfile.TemporaryDirectory(prefix="ampwatch-overhead-") as tmp,
        scratch_database("sqlite") as db_url,
        Server(db_url, Path(tmp) / "server.log", cpus=helpers, nice=19 if helpers else 0) as server,
    ):
        server.wait_ready()
        with on_cpus(helpers):
            conditions, notes = make_conditions(names, server.url, tmp)
        trainer = build(hidden, args.batch)
        results = {c.name: Result(c.name) for c in conditions}
        try:
            for condition in conditions:  # warm-up: allocator, autocast, first run (its sender thread) and connection
                with on_cpus(helpers):
                    variant = condition.start(trainer)
                time_steps(trainer, variant, 100)
                condition.stop()
            others = [c for c in conditions if c.name != "none"]
            for _ in range(args.rounds):
                rng.shuffle(others)
                for condition in others:
                    paired_block(trainer, condition, args.pairs, args.warm, rng, results[condition.name])
            # the baseline against itself: what the method reads when nothing differs
            for _ in range(max(1, args.rounds // 2)):
                paired_block(trainer, conditions[0], args.pairs, args.warm, rng, results["none"])
            sustained_rounds(
                trainer, conditions, args.sustained_rounds, args.sustained_steps, args.warm, rng, results, server.pid
            )
            # Every condition counts the same steps from the same state: a step GradScaler skips reads less (AdamW's
            # step counters are not read), and this loop's fp16 gradients overflow now and then.
            state = copy.deepcopy(
                (trainer.model.state_dict(), trainer.optimizer.state_dict(), trainer.scaler.state_dict())
            )
            for condition in conditions:
                trainer.model.load_state_dict(state[0])
                trainer.optimizer.load_state_dict(state[1])
                trainer.scaler.load_state_dict(state[2])
                r = results[condition.name]
                r.reads, r.dense, r.by_name = count_host_reads(trainer, condition, args.count_steps)
            if args.profile:
                profile(trainer, conditions, args)
        finally:
            for condition in conditions:
                condition.close()
        base_step_s = statistics.median(x for r in results.values() for x in r.base_s)
        print(f"\nbaseline step (median `none` step of all pairs): {base_step_s * 1e3:.3f} ms\n")
        summaries = print_tables(results, base_step_s, args.count_steps)
        print()
        print(LEGEND)
        if "ampwatch" in summaries:
            s, r, base = summaries["ampwatch"], results["ampwatch"], results["none"]
            added = (r.reads - base.reads) + (r.dense - base.dense)
            if (
                added == 0 and s.ceiling <= TARGET_OVERHEAD
            ):  # what the agent itself can cost; sustained adds the machine's noise
                verdict = "met" if s.sustained <= TARGET_OVERHEAD else "met by the ceiling, not end to end in this run"
            elif added == 0 and s.sustained <= TARGET_OVERHEAD:
                verdict = "met end to end in this run, not by the ceiling"
            else:
                verdict = "MISSED"
            print(
                f"\ntarget: ampwatch <= {TARGET_OVERHEAD:.0%} of a step and 0 added host reads -> {verdict} "
                f"(on-thread {s.on_thread:+.2%}, ceiling with background {s.ceiling:+.2%}, sustained "
                f"{s.sustained:+.1%}, {added:+.2f} reads/step)"
            )
        for condition in conditions:
            if isinstance(condition, Ampwatch) and not condition.disabled and condition.run_ids:
                print(f"server check {condition.name}: {ampwatch_check(server.url, condition.run_ids[-1])}")
                print(
                    f"one-time cost of the {condition.name} run (not per step): "
                    f"init + watch {condition.setup_s * 1e3:.1f} ms, "
                    f"finish {condition.finish_s * 1e3:.1f} ms"
                )
        for condition in conditions:
            if condition.note:
                notes.append(f"{condition.name}: {condition.note}")
        for note in notes:
            print("note:", note)
        if args.json:
            Path(args.json).write_text(json.dumps({n: r.__dict__ for n, r in results.items()}, indent=1))
    return 0


def profile(trainer: Trainer, conditions: list[Condition], args: argparse.Namespace) -> None:
    """cProfile the training thread with ampwatch attached."""
    import cProfile

    condition = next((c for c in conditions if c.name == "ampwatch"), None)
    if condition is None:
        return
    variant = condition.start(trainer)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.profile_steps):
        trainer.step(variant)
    profiler.disable()
    condition.stop()
    profiler.dump_stats(args.profile)
    print(f"cProfile of {args.profile_steps} ampwatch steps written to {args.profile}")


if __name__ == "__main__":
    sys.exit(main())
