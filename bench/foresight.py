"""Foresight: how many steps ahead each leading indicator warns of the failure it predicts, on failing CPU runs.

Each run is a real CPU training loop (fp16 autocast, GradScaler, unscale_/clip/step/update, one thread) watched by
ampwatch, whose batches go to the tests' in-memory transport (the server's own request schemas, no network). A
failing scenario carries the fault its indicator is meant to see coming, from its onset step on; its healthy
counterpart is the same model, optimizer, data and interval with the fault fixed:

- fp16_range: a regression head that outputs raw targets of ~1e5 (the loss is on the standardized error, so only the
  head's outputs are large), which overflow fp16 once it fits them; fixed: the head predicts standardized targets.
- update_ratio: a learning-rate schedule gone wrong, a restart at 30x the peak that keeps growing 1 % a step (fixed:
  a warm restart at the peak, after the same cosine decay), or an exponential schedule with gamma 1.01 where 0.99
  was meant (fixed: 0.99).
- adam_lag: an input near 0 (1e-3 of a standardized one) that grows 3-5 % a step, so its gradients outgrow Adam's
  second moment: a second input stream, image channel or set of per-token covariates (fixed: standardized from the
  start).

Healthy look-alikes add a benign change like a fault, with no failing counterpart: raw targets of ~1e3 (a climb
that fits fp16), an auxiliary loss switched on with a sigmoid warm-up of its weight.

The failure is the first event of the agent's own diagnosis, at warning or critical severity, of the kind the
indicator predicts: for fp16_range an overflow (a non-finite loss, the forward's inf, on a step GradScaler skips; NaN
gradients; a scale collapse), for update_ratio and adam_lag a divergence (those, or a gradient or loss spike, or a
streak of skipped steps). The warning is the indicator's first at or after the onset; the lead is the failure's step
minus the warning's. A false warning is any indicator's warning on a healthy run, or before the onset of a failing
one. Target (issue "foresight"): every lead >= 50 steps, no false warning; the script exits 1 when it is not met.
Runs are seeded: the table repeats on one machine.

    python bench/foresight.py            # the documented table: 6 seeds per scenario (~10 min)
    python bench/foresight.py --quick    # the first scenario of each indicator, one seed (a smoke test)

The models, data, faults and scenarios are in bench/_scenarios.py.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _scenarios import LAG, RANGE, SCENARIOS, UPDATE, Scenario, Setup

import ampwatch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _memory import MemoryTransport  # noqa: E402

TARGET_LEAD = 50
# What each indicator predicts, as the agent's own events at warning or critical severity: an fp16 overflow (the
# forward's inf makes the loss non-finite and GradScaler skips the step; or NaN gradients, a scale collapse), and a
# divergence (a loss or gradient spike, a streak of skipped steps, non-finite values).
OVERFLOWS = frozenset({"nonfinite_loss", "nonfinite_grad", "nonfinite_param", "scale_collapse"})
FAILURES = {
    "fp16_range": OVERFLOWS,
    "update_ratio": OVERFLOWS | {"grad_spike", "loss_spike", "skipped_step"},
    "adam_lag": OVERFLOWS | {"grad_spike", "loss_spike", "skipped_step"},
}


@dataclass
class Outcome:
    scenario: Scenario
    seed: int
    healthy: bool
    warning: int | None  # the indicator's first warning at or after the onset
    warned_layer: str | None
    failure: int | None
    failure_type: str | None
    false_warnings: list[str]  # "indicator@step" of each false warning
    seconds: float

    @property
    def lead(self) -> int | None:
        if self.warning is None or self.failure is None:
            return None
        return self.failure - self.warning


def train(setup: Setup, steps: int, interval: int, transport: Any) -> str:
    """The standard fp16 AMP loop, watched; returns the run's id."""
    os.environ["AMPWATCH_LAYER_NORM_INTERVAL"] = str(interval)  # (read by init())
    model, optimizer = setup.model, setup.optimizer
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("foresight", transport=transport) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(steps):
            if setup.before is not None:
                setup.before(step)
            inputs = setup.batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(*inputs[0]) if isinstance(inputs[0], tuple) else model(inputs[0])
            loss = setup.loss_of(out.float(), inputs, step)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    return run.id


def judge(scenario: Scenario, seed: int, healthy: bool, events: list[dict[str, Any]], seconds: float) -> Outcome:
    """What the run's events say: the indicator's first warning after the onset, the first failure, false warnings."""
    warnings = [e for e in events if "indicator" in e["details"]]
    kinds = FAILURES[scenario.indicator]
    failures = [e for e in events if e["type"] in kinds and e["severity"] != "info" and "indicator" not in e["details"]]
    onset = math.inf if healthy else scenario.onset
    false = [f"{e['details']['indicator']}@{e['step']}" for e in warnings if e["step"] < onset]
    mine = [e for e in warnings if e["details"]["indicator"] == scenario.indicator and e["step"] >= onset]
    first = mine[0] if mine else None
    failure = failures[0] if failures else None
    return Outcome(
        scenario,
        seed,
        healthy,
        first["step"] if first else None,
        first["details"].get("layer") if first else None,
        failure["step"] if failure else None,
        failure["type"] if failure else None,
        false,
        seconds,
    )


# -- the table ------------------------------------------------------------------------------------------------------


def run_one(scenario: Scenario, seed: int, healthy: bool) -> Outcome:
    memory = MemoryTransport()
    start = time.perf_counter()
    run_id = train(scenario.build(seed, healthy), scenario.steps, scenario.interval, memory)
    return judge(scenario, seed, healthy, memory.events(run_id), time.perf_counter() - start)


def _cell(value: Any) -> str:
    return "-" if value is None or value == [] else ",".join(value) if isinstance(value, list) else str(value)


COLUMNS = (
    ("indicator", 12),
    ("scenario", 40),
    ("model", 5),
    ("optimizer", 10),
    ("int", 3),
    ("seed", 4),
    ("onset", 5),
    ("warned", 6),
    ("layer", 10),
    ("failure", 7),
    ("event", 14),
    ("lead", 5),
    ("false warnings", 14),
    ("s", 5),
)


def _row(cells: list[Any]) -> str:
    return " ".join(
        f"{_cell(c):<{w}}" if i in (0, 1, 2, 3, 8, 10, 12) else f"{_cell(c):>{w}}"
        for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS))
    )


def print_outcome(o: Outcome) -> None:
    s = o.scenario
    name = f"{'(healthy) ' if o.healthy else ''}{s.name}"
    print(
        _row(
            [
                s.indicator,
                name,
                s.model,
                s.optimizer,
                s.interval,
                o.seed,
                None if o.healthy else s.onset,
                o.warning,
                o.warned_layer,
                o.failure,
                o.failure_type,
                o.lead,
                o.false_warnings,
                f"{o.seconds:.1f}",
            ]
        ),
        flush=True,
    )


def summary(outcomes: list[Outcome], indicators: list[str]) -> bool:
    """Print the summary lines; whether the target is met."""
    met = True
    for indicator in indicators:
        failing = [o for o in outcomes if o.scenario.indicator == indicator and not o.healthy]
        failed = [o for o in failing if o.failure is not None]
        leads = [o.lead for o in failed if o.lead is not None]
        missed = [o for o in failed if o.lead is None or o.lead < 0]
        unfailed = len(failing) - len(failed)
        least = min(leads) if leads else None
        ok = bool(failed) and least is not None and least >= TARGET_LEAD and len(leads) == len(failed)
        met = met and ok
        print(
            f"{indicator}: {len(failed)} failing runs, warned before the failure in {len(failed) - len(missed)}; "
            f"minimum lead {_cell(least)} steps (median {_cell(sorted(leads)[len(leads) // 2] if leads else None)}) "
            f"vs the {TARGET_LEAD}-step target: {'met' if ok else 'NOT met'}"
            + (f"; {unfailed} faulty run(s) did not fail within their steps" if unfailed else "")
        )
    false = sum(len(o.false_warnings) for o in outcomes)
    healthy = sum(o.healthy for o in outcomes)
    broke = [o for o in outcomes if o.healthy and o.failure is not None]
    print(
        f"false warnings: {false} ({healthy} healthy runs, and the failing runs before their onset): "
        f"{'met' if not false else 'NOT met'}" + (f"; {len(broke)} healthy run(s) had a failure event" if broke else "")
    )
    return met and not false


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=6, help="seeds per scenario (default 6)")
    parser.add_argument("--quick", action="store_true", help="one seed of the first scenario of each indicator")
    parser.add_argument("--only", choices=(RANGE, UPDATE, LAG), help="one indicator's scenarios")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # (tiny models: a second thread only adds contention)
    logging.getLogger("ampwatch").setLevel(logging.CRITICAL + 1)  # (the diagnosis' messages: the table says it)
    indicators = [i for i in (RANGE, UPDATE, LAG) if args.only in (None, i)]
    scenarios = [s for s in SCENARIOS if s.indicator in indicators]
    if args.quick:
        scenarios = [next(s for s in scenarios if s.indicator == i) for i in indicators]
    started = time.perf_counter()
    print(_row([name for name, _ in COLUMNS]))
    outcomes: list[Outcome] = []
    for scenario in scenarios:
        for seed in range(1 if args.quick else args.seeds):
            for healthy in (False, True) if scenario.failing else (True,):
                outcomes.append(run_one(scenario, seed, healthy))
                print_outcome(outcomes[-1])
    print(f"{len(outcomes)} runs in {time.perf_counter() - started:.0f} s")
    return 0 if summary(outcomes, indicators) else 1


if __name__ == "__main__":
    sys.exit(main())
