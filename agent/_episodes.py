"""Part of `ampwatch._diagnose.Analyzer`: non-finite episodes and the parameters. Without a GradScaler nothing skips
a step whose gradients are non-finite: the optimizer writes them into the parameters, and from then on every loss,
gradient and module output is non-finite because of that step. The episode's first step and what went non-finite
there (the loss, the gradients under a finite loss, or the gradients of a step with no loss recorded) is what later
events name as the cause."""

from __future__ import annotations

import math
from typing import Any

Event = dict[str, Any]
NO_LOSS_AFTER = 100  # steps with a gradient norm and no loss, without a scaler, before the run is told it records none


class Episodes:
    """Part of `ampwatch._diagnose.Analyzer`: its attributes are the Analyzer's."""

    _episode: tuple[int, str] | None  # (declared here for the type checker: the Analyzer sets it)

    def _went_bad(self: Any, step: int, what: str) -> None:
        """`what` ("loss", "gradients" or "gradients, no loss") was non-finite at `step`; an episode begins there
        unless one is going on."""
        if self._episode is None:
            self._episode = (step, what)

    def _finite_norm(self: Any) -> None:
        """A finite gradient norm: every gradient was finite, so were the parameters (after a restored checkpoint
        too)."""
        self._episode = None
        self._param_bad = False

    def _applied(self: Any, step: int) -> str | None:
        """Without a scaler, while an episode that began before `step` goes on: what its first step wrote into the
        parameters, said as a cause."""
        episode = self._episode
        if self._scaled or episode is None or episode[0] >= step:
            return None
        under = {"loss": "from a non-finite loss", "gradients": "under a finite loss"}.get(
            episode[1], "no loss recorded"
        )
        return (
            f"the optimizer applied step {episode[0]}'s non-finite gradients ({under}), with no GradScaler to skip "
            "the step"
        )

    def _check_params(self: Any, step: int, param_norm: float, out: list[Event]) -> None:
        if math.isfinite(param_norm):
            self._param_bad = False
            return
        if self._param_bad:
            return
        self._param_bad = True
        episode = self._episode
        if not self._scaled and episode is not None:
            diverged = self.diverged[1] if self.diverged and self.diverged[0] == episode[0] else None
            made = (
                f"Step {episode[0]}'s non-finite loss ("
                + (
                    f"the updates diverged before it: {diverged}; most likely too high a learning rate"
                    if diverged
                    else "the forward pass made it: a bad batch, or a layer"
                )
                + ") gave non-finite "
                "gradients"
                if episode[1] == "loss"
                else f"Step {episode[0]}'s gradients were non-finite under a finite "
                "loss (the backward pass made them: see the nonfinite_grad event)"
                if episode[1] == "gradients"
                else f"Step {episode[0]}'s gradients were non-finite (no loss is recorded, so the forward or the "
                "backward pass made them: see the nonfinite_grad event)"
            )
            how = (
                f"{made}, and the optimizer wrote them into the parameters: no GradScaler skips such a step. Restore "
                "the last good checkpoint, and skip the update when the gradient norm (the value clip_grad_norm_ "
                "returns) is non-finite."
            )
        elif self._nonfinite_loss and self._last_loss is not None and self._last_loss[0] == step:
            how = (
                f"The optimizer step after step {step}'s non-finite loss wrote it into them (the loss came from the "
                "batch, "
                "not from them). Restore the last good checkpoint, and skip the update when the loss is non-finite."
            )
        else:
            how = (
                f"{'Not a benign fp16 overflow: r' if self._scaled else 'R'}estore the last good checkpoint, and lower "
                "the learning rate or find the layer that overflows."
            )
        out.append(
            self.event(
                step,
                "nonfinite_param",
                "critical",
                f"The parameters are non-finite at step {step}: the run cannot recover. {how}",
                {"param_norm": spell(param_norm), "grad_norm_trend": self._trend()},
            )
        )

    def _param_note(self: Any) -> str:
        """Said in later events while the parameters are known to be non-finite: that, not the data, is the cause."""
        return (
            "The parameters are already non-finite (see the nonfinite_param event), so every step will be. "
            if self._param_bad
            else ""
        )

    def _check_loss_seen(self: Any, columns: dict[str, Any], out: list[Event]) -> None:
        """Without a scaler the agent sees the loss only where the loop logs it: say once if a run records none."""
        if self._loss_seen or self._scaled or "skipped" in columns:
            return
        if "loss" in columns:
            self._loss_seen = True
            return
        self._norm_steps += len(columns["grad_norm"][0]) if "grad_norm" in columns else 0
        if self._norm_steps >= NO_LOSS_AFTER:
            self._loss_seen = True  # (said once)
            out.append(
                self.event(
                    columns["grad_norm"][0][-1],
                    "amp_config",
                    "info",
                    "No loss is recorded: without an enabled GradScaler the agent cannot see it (there is no "
                    "scaler.scale() to read it from), so non-finite losses and loss spikes go unseen. Log it with "
                    'run.log({"loss": loss}) before '
                    "optimizer.step() (after it, pass step=).",
                    {"check": "no_loss"},
                )
            )


def spell(value: float) -> float | str:
    """A value as JSON holds it (non-finite ones as strings)."""
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
