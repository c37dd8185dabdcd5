"""The runs of bench/foresight.py: the models, their data, the faults each leading indicator is meant to see coming
(and their fixes), and the scenarios that combine them. What a scenario is and what the table makes of it is
foresight.py's to say."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

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
