"""The ~1 ms CPU mixed-precision training step the agent-overhead benchmark measures."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

AfterStep = Callable[[int, Any, Any, Any, float], None]  # (step, scaler, loss, grad norm, scale before)


# -- the training step ----------------------------------------------------------------------
@dataclass
class Variant:
    """How one step runs: which scaler, and what is logged after it."""

    scaler: Any
    after_step: AfterStep | None = None
    read_scale: bool = False  # the logger wants the scale before update(): a host read, as users write it
    # None: `torch.nn.utils.clip_grad_norm_` as the loop finds it at each step (ampwatch wraps it while it watches);
    # the plain step pins the original, so a pair's `none` half never pays for a wrapper installed for the other.
    clip: Callable[..., Any] | None = None


@dataclass
class Trainer:
    model: Any
    optimizer: Any
    scaler: Any
    x: Any
    y: Any
    step_index: int = 0

    def step(self, variant: Variant) -> None:
        import torch

        scaler = variant.scaler
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        scale_before = scaler.get_scale() if variant.read_scale else 0.0
        scaler.scale(loss).backward()
        scaler.unscale_(self.optimizer)
        norm = (variant.clip or torch.nn.utils.clip_grad_norm_)(self.model.parameters(), 1.0)
        scaler.step(self.optimizer)
        scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if variant.after_step is not None:
            variant.after_step(self.step_index, scaler, loss, norm, scale_before)
        self.step_index += 1

    @property
    def plain(self) -> Variant:
        return Variant(self.scaler, clip=ORIGINAL_CLIP_GRAD_NORM)


def _original_clip() -> Callable[..., Any]:
    import torch

    return torch.nn.utils.clip_grad_norm_


ORIGINAL_CLIP_GRAD_NORM = _original_clip()  # read before any run watches a scaler


def build(hidden: int, batch: int, seed: int = 0) -> Trainer:
    """A 3-layer MLP trainer (64 -> hidden -> hidden -> 10)."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, 10),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Trainer(
        model, optimizer, torch.amp.GradScaler("cpu"), torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    )


def time_steps(trainer: Trainer, variant: Variant, steps: int) -> float:
    """Mean wall seconds per step over `steps` consecutive steps."""
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step(variant)
    return (time.perf_counter() - start) / steps


def calibrate(target_s: float, batch: int) -> tuple[int, float]:
    """The MLP width (8..256) whose fastest step time is closest to `target_s`, by bisection."""
    lo, hi = 8, 256
    best = (lo, float("inf"))
    while lo <= hi:
        mid = (lo + hi) // 2
        trainer = build(mid, batch)
        time_steps(trainer, trainer.plain, 30)
        step_s = min(time_steps(trainer, trainer.plain, 40) for _ in range(5))  # min: other load only slows
        if abs(step_s - target_s) < abs(best[1] - target_s):
            best = (mid, step_s)
        lo, hi = (mid + 4, hi) if step_s < target_s else (lo, mid - 4)
    return best
