"""GradScaler's skipped steps and its loss scale: start-up calibration, streaks of skips, a scale collapse (a streak
too long, or a scale below the floor), and steps applied again after a streak (what the NaN before it was).

Owns the calibration, the streak, the collapse and the scales of recent steps; `observe` takes each step with
GradScaler's record, and the other parts read `calibrating` and `applied_scale` and call `nan_reported`."""

from __future__ import annotations

import math
from collections import deque

from ampwatch._context import Context, Event, Series
from ampwatch._protocol import pow2
from ampwatch._trends import Trends


class Skips:
    """Skipped steps and the loss scale. `calibrating` (start-up calibration goes on) and `applied_scale` (the loss
    scale of the last step GradScaler applied) are read by the other parts and written here only."""

    def __init__(self, context: Context, trends: Trends) -> None:
        self._context = context
        self._trends = trends  # (the divergence before a collapse or a NaN streak is what it says)
        self.t = context.thresholds
        self.calibrating = True
        self.applied_scale = math.inf
        self._calibration_skips = 0
        self._calibration_start: float | None = None
        self._streak = 0
        self._streak_start_scale = 0.0
        self._collapsed = False
        self._stepped = False  # a step was applied: a skip streak after one is no start-up calibration
        self._below_floor = False  # a scale below the floor was reported; until it is back above
        self._recent: deque[int] = deque()  # skipped steps of the last `window` steps
        self._nan_alarm: int | None = None  # the step of a NaN-gradient event in this skip streak

    def nan_reported(self, step: int) -> None:
        """A NaN-gradient event at `step` left open whether a lower scale stops the NaN: said when steps are applied
        again (the first such event of a streak)."""
        if self._nan_alarm is None:
            self._nan_alarm = step

    def was_skipped(self, step: int) -> bool:
        """Whether `step` is one of the skipped steps of the last `window` steps."""
        return step in self._recent

    def calm(self, skipped: Series | None) -> bool:
        """Whether no streak or scale below the floor goes on, and a batch's skipped flags (where it has GradScaler's
        record) cannot start one: none is set, and start-up calibration is over."""
        return not (self._streak or self._below_floor or (skipped and (self.calibrating or any(skipped[1]))))

    def absorb(self, scale: Series | None) -> None:
        """Take a calm batch's steps at once (every one applied; see `calm`) and its loss scales, if it has them."""
        self._stepped = True
        if scale:
            self.applied_scale = scale[1][-1]

    def observe(
        self,
        step: int,
        skipped: bool,
        scale: float,
        loss: float | None,
        norm: float | None,
        params_bad: bool,
        out: list[Event],
    ) -> None:
        """A step with GradScaler's record: whether it `skipped` and its loss `scale`; its `loss` and `norm` where
        recorded, and whether the parameters are known to be non-finite (`params_bad`, said in a collapse)."""
        if not skipped:
            if self.calibrating and step >= self.t.calibration_steps:
                self.calibrating = False
                if self._calibration_skips:
                    out.append(
                        self._context.event(
                            step,
                            "skipped_step",
                            "info",
                            f"Start-up calibration: {self._calibration_skips} skipped step(s) while GradScaler "
                            f"searched for its loss scale ({pow2(self._calibration_start or scale)} at the first "
                            f"skip, {pow2(scale)} now). This is normal.",
                            {"calibration": True, "skips": self._calibration_skips, "scale": scale},
                        )
                    )
            elif self._nan_alarm is not None:  # the evidence the NaN-gradient event could not have yet
                overflow = self._streak_start_scale > self.applied_scale  # (they began only once the scale had grown)
                diverged = self._trends.diverged_at(step)
                why = (
                    f"came after {diverged}: the updates diverged, most likely from too high a learning rate, until "
                    "the values overflowed. Lower the learning rate (or warm it up longer)."
                    if diverged
                    else "stopped once the scale was lower, so they were most likely fp16 overflow (gradients or "
                    "activations too large for fp16 at the higher scale; inf - inf is NaN) rather than an operation "
                    "that makes NaN. If they come back at this scale or lower, look for one that does on some batches "
                    "(sqrt, log, a division by 0); if the scale keeps having to fall, for activations that keep "
                    "growing (bf16 has the range of fp32)."
                    if overflow
                    else f"began at loss scale {pow2(self._streak_start_scale)}, a scale steps had been applied at, so "
                    "not because the scale had grown too high: most likely an operation that makes NaN on some batches "
                    "(look for sqrt, log, pow or a norm of zero, or a division by a value that can be 0), or a batch "
                    "whose gradients are too large for fp16. If they come back, the NaN-origin probe names where."
                )
                out.append(
                    self._context.event(
                        step,
                        "skipped_step",
                        "info",
                        f"Steps are applied again at step {step} after {self._streak} skipped; loss scale "
                        f"{pow2(scale)}. The NaN gradients reported at step {self._nan_alarm} {why}",
                        {
                            "recovered": True,
                            "streak": self._streak,
                            "scale": scale,
                            "overflow": overflow,
                            "nonfinite_grad_step": self._nan_alarm,
                        },
                    )
                )
            elif self._streak >= self.t.warn_streak and not self.calibrating:
                out.append(
                    self._context.event(
                        step,
                        "skipped_step",
                        "info",
                        f"Steps are applied again at step {step} after {self._streak} skipped; loss scale "
                        f"{pow2(scale)}.",
                        {"recovered": True, "streak": self._streak, "scale": scale},
                    )
                )
            self._streak, self._collapsed, self._nan_alarm = 0, False, None
            self._below_floor = self._below_floor and scale < self.t.scale_floor
            self._stepped, self.applied_scale = True, scale
            return
        if self._streak == 0:
            self._streak_start_scale = scale
        self._streak += 1
        recent = self._recent
        recent.append(step)
        while recent[0] <= step - self.t.window:
            recent.popleft()
        # Still skipping when calibration should be long over, or NaN gradients with a finite loss at a scale steps were
        # applied at (calibration only searches downwards from too high a scale): not calibration.
        nan_again = (
            self._stepped
            and scale <= self.applied_scale
            and norm is not None
            and math.isnan(norm)
            and (loss is None or math.isfinite(loss))
        )
        if self.calibrating and (step >= self.t.calibration_steps or nan_again):
            self.calibrating = False
        if self.calibrating and (loss is None or math.isfinite(loss)):  # (a NaN loss is a bad batch, told as such)
            self._calibration_skips += 1
            self._calibration_start = self._calibration_start or scale
        # A healthy start-up calibration skips the first steps, many in a row from a high initial scale, but never to
        # below the floor. Outside a streak, below the floor counts from skips that keep coming back: one overflow of
        # gradients too large for fp16 is no collapse.
        below = (
            scale / 2 < self.t.scale_floor
            and not self._below_floor
            and (self._streak > 1 or len(recent) >= self.t.warn_streak)
        )
        streak = self._streak >= self.t.collapse_streak and (self._stepped or not self.calibrating)
        if (below or streak) and not self._collapsed:
            self._collapsed, self._below_floor = True, self._below_floor or below
            if self._streak > 1:
                what = (
                    f"{self._streak} consecutive skipped steps, scale {pow2(self._streak_start_scale)} → "
                    f"{pow2(scale / 2)}. Every step is being thrown away"
                )
            else:  # skips that come back again and again, each halving the scale
                what = (
                    f"the scale fell to {pow2(scale / 2)} at step {step}, below {self.t.scale_floor:g}, after skips "
                    f"that keep coming back ({len(recent)} in the last {self.t.window} steps)"
                )
            out.append(
                self._context.event(
                    step,
                    "scale_collapse",
                    "critical",
                    f"Loss scale collapse: {what}: the gradients overflow or are NaN at any scale. "
                    f"{self._param_note(params_bad)}{self._collapse_advice(step)}",
                    {"streak": self._streak, "scale_before": self._streak_start_scale, "scale_after": scale / 2},
                )
            )
        elif self.calibrating or self._collapsed or self._below_floor:
            return  # (below the floor, the scale_collapse event said it: no skip is normal scaling there)
        elif self._streak == 1 and loss is not None and not math.isfinite(loss):
            return  # the nonfinite_loss event says it all
        elif self._streak == 1:
            kind = "NaN" if norm is not None and math.isnan(norm) else "inf"
            out.append(
                self._context.event(
                    step,
                    "skipped_step",
                    "info",
                    f"Step {step} skipped: {kind} in the scaled gradients; loss scale {pow2(scale)} → "
                    f"{pow2(scale / 2)}. "
                    "Occasional skips are normal dynamic loss scaling.",
                    {"scale_before": scale, "scale_after": scale / 2},
                )
            )
        elif self._streak == self.t.warn_streak:
            out.append(
                self._context.event(
                    step,
                    "skipped_step",
                    "warning",
                    f"{self._streak} consecutive skipped steps (loss scale now {pow2(scale / 2)}): more than fp16 "
                    "overflow usually causes. Watch for a scale collapse.",
                    {"streak": self._streak, "scale_after": scale / 2},
                )
            )

    def _collapse_advice(self, step: int) -> str:
        """What to do about a collapse: the divergence before it, or what the origin named, if it was; else values fp16
        cannot hold."""
        diverged = self._trends.diverged_at(step)
        if diverged:
            return f"Before it, {diverged}: most likely too high a learning rate. Lower it (or warm it up longer)."
        module, phase = self._context.origin or ("", "")
        if phase == "backward":
            return (
                f"The NaN-origin event named the backward of `{module}`: an operation there makes NaN at any scale "
                "(sqrt, log, pow or a norm at 0), which bf16 does not fix: guard it (an epsilon, a clamp)."
            )
        if module == "(input batch)":
            return (
                "The NaN-origin event named the input batch: a data problem, which bf16 does not fix: check the data "
                "pipeline."
            )
        return "Check the data and the model for values fp16 cannot hold (use bf16, or find the layer that overflows)."

    @staticmethod
    def _param_note(params_bad: bool) -> str:
        """Said while the parameters are known to be non-finite: that, not the data, is the cause."""
        return (
            "The parameters are already non-finite (see the nonfinite_param event), so every step will be. "
            if params_bad
            else ""
        )
