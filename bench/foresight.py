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
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

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
Batch = tuple[Any, ...]


@dataclass
class Setup:
    """One training run: the model, its optimizer, the batch of each step, the loss, and what changes before a
    step (the learning rate, a loss weight)."""

    model: Any
    optimizer: Any
    batch: Callable[[int], Batch]
    loss_of: Callable[[Any, Batch, int], Any]
    before: Callable[[int], None] | None = None


@dataclass(frozen=True)
class Scenario:
    """A family of failing runs (one per seed) and their healthy counterparts."""

    indicator: str
    name: str
    model: str
    optimizer: str
    interval: int
    steps: int
    onset: int  # the step the fault begins (0: from the start)
    fault: Callable[[Scenario, int, bool], Setup]  # (this, seed, healthy) -> the run, with the fault or fixed
    failing: bool = True  # False: a healthy run only, with a benign change that looks like the fault

    def build(self, seed: int, healthy: bool) -> Setup:
        torch.manual_seed(seed)
        return self.fault(self, seed, healthy)

    def new_model(self) -> nn.Module:
        return {"MLP": mlp, "conv": ConvNet, "block": Block}[self.model]()

    def new_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """From `optimizer`: "Adam 3e-3", "AdamW 3e-4" (weight decay 0.01), "SGD 1e-3", "SGD+m 1e-3" (momentum 0.9)."""
        name, lr = self.optimizer.split()
        if name.startswith("Adam"):
            decay = 0.01 if name == "AdamW" else 0.0
            return (torch.optim.AdamW if name == "AdamW" else torch.optim.Adam)(
                model.parameters(), lr=float(lr), weight_decay=decay
            )
        return torch.optim.SGD(model.parameters(), lr=float(lr), momentum=0.9 if name == "SGD+m" else 0.0)


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


# -- models -------------------------------------------------------------------------------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


class TwoInputs(nn.Module):
    """An MLP on the first 8 features, plus a linear layer on 4 more (a second input stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.extra = nn.Linear(4, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x[:, :8]) + self.extra(x[:, 8:])


class ConvNet(nn.Module):
    """Two convolutions, global average pooling and a linear head, on 6x6 images."""

    def __init__(self, channels: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 8, 3, padding=1)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.act2 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.act2(self.conv2(self.act1(self.conv1(x))))).flatten(1))


class Block(nn.Module):
    """A pre-norm transformer block (causal self-attention, GELU MLP) over 8 token embeddings, mean-pooled into a
    linear head. `covariates`: a linear layer adds that many numeric features per token to the embeddings; `aux`: a
    second head (an auxiliary task)."""

    def __init__(self, covariates: int = 0, aux: bool = False, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(32, width)
        self.pos = nn.Parameter(torch.randn(8, width) * 0.1)
        self.covariates = nn.Linear(covariates, width, bias=False) if covariates else None
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)
        self.head = nn.Linear(width, 1)
        self.aux = nn.Linear(width, 1) if aux else None

    def forward(self, tokens: torch.Tensor, covariates: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        if self.covariates is not None and covariates is not None:
            x = x + self.covariates(covariates)
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        pooled = (x + self.down(self.act(self.up(self.norm2(x))))).mean(1)
        return self.head(pooled) if self.aux is None else torch.cat([self.head(pooled), self.aux(pooled)], 1)


# -- data: batches of 32 (16 images) whose first item is the model's input and second the standardized target -------

Scale = Callable[[int], float]  # a step -> the scale of an input that changes over the run


def _features(teacher: torch.Tensor, noise: float = 0.0, stream: Scale | None = None) -> Callable[[int], Batch]:
    """8 normal features; the target |x @ teacher| / 3 + 1 (with `noise`: x @ teacher plus that much noise).
    `stream`: 4 more features of noise, at that scale (a second input stream)."""

    def batch(step: int) -> Batch:
        x = torch.randn(32, 8)
        target = x @ teacher + noise * torch.randn(32, 1) if noise else (x @ teacher).abs() / 3 + 1
        return (x if stream is None else torch.cat([x, torch.randn(32, 4) * stream(step)], 1)), target

    return batch


def _images(side: Scale | None = None) -> Callable[[int], Batch]:
    """Sparse binary 6x6 images; the target is their count of lit pixels / 10. `side`: a second channel of uniform
    noise at that scale (a second sensor)."""

    def batch(step: int) -> Batch:
        x = (torch.rand(16, 1, 6, 6) < 0.3).float()
        target = x.sum((1, 2, 3)).unsqueeze(1) / 10
        return (x if side is None else torch.cat([x, torch.rand(16, 1, 6, 6) * side(step)], 1)), target

    return batch


def _tokens(covariates: Scale | None = None) -> Callable[[int], Batch]:
    """8 random tokens of 32; the target is their sum / 100, the auxiliary label whether the first is below 16.
    `covariates`: 4 numeric features of noise per token, at that scale, as (tokens, covariates)."""

    def batch(step: int) -> Batch:
        tokens = torch.randint(0, 32, (32, 8))
        target, label = tokens.sum(1, keepdim=True) / 100, (tokens[:, :1] < 16).float()
        if covariates is None:
            return tokens, target, label
        return (tokens, torch.randn(32, 8, 4) * covariates(step)), target, label

    return batch


def _mse(unit: float = 1.0) -> Callable[[torch.Tensor, Batch, int], torch.Tensor]:
    """The mean squared error of the first output, in `unit`s, against the standardized target."""

    def loss_of(out: torch.Tensor, inputs: Batch, step: int) -> torch.Tensor:
        return ((out[:, :1] / unit - inputs[1]) ** 2).mean()

    return loss_of


# -- scenarios ------------------------------------------------------------------------------------------------------

Fault = Callable[[Scenario, int, bool], Setup]
RAW = 5e4  # fp16_range: the unit of raw targets (so they reach ~1e5, past fp16's 65 504)


def _data(model: str, noise: float = 0.0) -> Callable[[int], Batch]:
    """The model's data: features for the MLP (`noise`: see `_features`), images for the conv net, tokens for the
    block."""
    if model == "MLP":
        return _features(torch.randn(8, 1), noise=noise)
    return _images() if model == "conv" else _tokens()


def raw_targets(unit: float) -> Fault:
    """fp16_range: the head outputs targets in `unit`s (healthy: standardized targets)."""

    def fault(s: Scenario, seed: int, healthy: bool) -> Setup:
        model = s.new_model()
        return Setup(model, s.new_optimizer(model), _data(s.model), _mse(1.0 if healthy and s.failing else unit))

    return fault


def schedule(kind: str) -> Fault:
    """update_ratio: a learning-rate schedule that goes wrong at the onset. "restart": a cosine decay to 0 over
    `onset` steps, then a restart at 30x its peak that keeps growing 1 % a step (healthy: a warm restart at the
    peak); "gamma": constant, then multiplied by 1.01 a step (healthy: by 0.99, as meant)."""

    def fault(s: Scenario, seed: int, healthy: bool) -> Setup:
        model = s.new_model()
        optimizer = s.new_optimizer(model)
        peak, onset = optimizer.param_groups[0]["lr"], s.onset

        def factor(step: int) -> float:
            if kind == "restart":
                if step < onset or healthy:
                    return 0.5 * (1 + math.cos(math.pi * (step % onset) / onset))
                return 30 * 1.01 ** (step - onset)
            return 1.0 if step < onset else (0.99 if healthy else 1.01) ** (step - onset)

        def before(step: int) -> None:
            optimizer.param_groups[0]["lr"] = peak * factor(step)

        return Setup(model, optimizer, _data(s.model, noise=0.3), _mse(), before)

    return fault


def waking(growth: float) -> Fault:
    """adam_lag: an input at 1e-3 of a standardized one until the onset, which then grows by `growth` a step up to
    100x it (healthy: standardized from the start): 4 more features for the MLP (`TwoInputs`), a second image
    channel for the conv net, 4 numeric covariates per token for the block."""

    def fault(s: Scenario, seed: int, healthy: bool) -> Setup:
        def scale(step: int) -> float:
            return 1.0 if healthy else min(100.0, 1e-3 * growth ** max(0, step - s.onset))

        if s.model == "MLP":
            model: nn.Module = TwoInputs()
            batch = _features(torch.randn(8, 1), noise=0.1, stream=scale)
        elif s.model == "conv":
            model, batch = ConvNet(2), _images(side=scale)
        else:
            model, batch = Block(covariates=4), _tokens(covariates=scale)
        return Setup(model, s.new_optimizer(model), batch, _mse())

    return fault


def aux_warmup(s: Scenario, seed: int, healthy: bool) -> Setup:
    """A benign change like adam_lag's fault: an auxiliary loss switched on at the onset with a sigmoid warm-up of its
    weight (0.7 % at the onset, half 100 steps later, 99 % 200 steps later)."""
    model = Block(aux=True)

    def loss_of(out: torch.Tensor, inputs: Batch, step: int) -> torch.Tensor:
        weight = 1 / (1 + math.exp(-(step - s.onset - 100) / 20))
        aux = nn.functional.binary_cross_entropy_with_logits(out[:, 1:], inputs[2])
        return ((out[:, :1] - inputs[1]) ** 2).mean() + weight * aux

    return Setup(model, s.new_optimizer(model), _tokens(), loss_of)


RANGE, UPDATE, LAG = "fp16_range", "update_ratio", "adam_lag"
SCENARIOS = [
    Scenario(RANGE, "raw targets ~1e5", "MLP", "Adam 3e-3", 10, 700, 0, raw_targets(RAW)),
    Scenario(RANGE, "raw targets ~1e5", "conv", "Adam 3e-3", 10, 700, 0, raw_targets(RAW)),
    Scenario(RANGE, "raw targets ~1e5", "block", "Adam 3e-3", 10, 700, 0, raw_targets(RAW)),
    Scenario(RANGE, "raw targets ~1e5", "MLP", "Adam 1e-3", 50, 2400, 0, raw_targets(RAW)),
    Scenario(RANGE, "raw targets ~1e3 (fit fp16)", "MLP", "Adam 3e-3", 10, 700, 0, raw_targets(1e3), failing=False),
    Scenario(UPDATE, "lr restart 30x, +1%/step", "MLP", "SGD 1e-3", 10, 800, 400, schedule("restart")),
    Scenario(UPDATE, "lr restart 30x, +1%/step", "MLP", "SGD 1e-3", 50, 800, 400, schedule("restart")),
    Scenario(UPDATE, "lr restart 30x, +1%/step", "block", "AdamW 3e-4", 10, 800, 400, schedule("restart")),
    Scenario(UPDATE, "lr gamma 1.01 (for 0.99)", "MLP", "SGD+m 1e-3", 10, 900, 200, schedule("gamma")),
    Scenario(UPDATE, "lr gamma 1.01 (for 0.99)", "conv", "SGD+m 1e-3", 10, 1100, 200, schedule("gamma")),
    Scenario(LAG, "input stream wakes, +5%/step", "MLP", "Adam 1e-2", 10, 600, 300, waking(1.05)),
    Scenario(LAG, "input stream wakes, +3%/step", "MLP", "Adam 1e-2", 25, 800, 300, waking(1.03)),
    Scenario(LAG, "image channel wakes, +5%/step", "conv", "Adam 1e-2", 10, 600, 300, waking(1.05)),
    Scenario(LAG, "covariates wake, +5%/step", "block", "Adam 1e-3", 10, 700, 300, waking(1.05)),
    Scenario(LAG, "aux loss sigmoid warm-up", "block", "Adam 1e-3", 10, 700, 300, aux_warmup, failing=False),
]


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
