"""Non-finite losses, gradients and parameters, and the episode they make. Without a GradScaler nothing skips a step
whose gradients are non-finite: the optimizer writes them into the parameters, and from then on every loss, gradient
and module output is non-finite because of that step. The episode's first step and what went non-finite there (the
loss, the gradients under a finite loss, or the gradients of a step with no loss recorded) is what later events name
as the cause.

Owns the episode, the runs of non-finite losses and NaN gradients, the last loss and whether the parameters went
non-finite; takes every recorded loss, gradient norm and parameter norm, and answers `applied` and `params_bad`."""

from __future__ import annotations

import math
from collections import deque

from ampwatch._context import Columns, Context, Event, Series
from ampwatch._protocol import pow2, spell
from ampwatch._skips import Skips
from ampwatch._trends import Trends

NO_LOSS_AFTER = 100  # steps with a gradient norm and no loss, without a scaler, before the run is told it records none


class NonFinite:
    """Non-finite values. Reads `Skips.calibrating` and `Skips.applied_scale` and tells `Skips.nan_reported` (a NaN
    under a scaler is an overflow or not by what the scale does next); the wording of its causes asks `Trends`."""

    def __init__(self, context: Context, trends: Trends, skips: Skips) -> None:
        self._context = context
        self._trends = trends
        self._skips = skips
        self.t = context.thresholds
        self._episode: tuple[int, str] | None = None  # (first step, "loss" or "gradients") of an episode going on
        self._param_bad = False  # the parameters are non-finite (said once, until a finite norm)
        self._nonfinite_loss = False  # the last loss judged was non-finite (said once per run of them)
        # (step, loss) of the last loss (one logged before its step's optimizer step comes a batch early)
        self._last_loss: tuple[int, float] | None = None
        self._nan_grad_streak = 0
        self._nan_steps: deque[int] = deque()  # recent steps with NaN gradients and a finite loss (GradScaler skipped)
        self._loss_seen = False  # a loss was recorded (or the run was told it records none)
        self._norm_steps = 0  # steps with a gradient norm before that

    @property
    def params_bad(self) -> bool:
        """Whether the parameters are known to be non-finite (until a finite gradient norm says otherwise)."""
        return self._param_bad

    def logged_loss(self, step: int, loss: float, out: list[Event]) -> None:
        """A loss the user logged at a step of a scaler run without GradScaler's record of that step, not known to be
        skipped (see `Analyzer._logged`): kept as the step's loss, judged only if non-finite."""
        self._last_loss = (step, loss)
        if not math.isfinite(loss):
            self.loss(step, loss, None, None, out)

    def absorb(self, loss: Series | None, norms: bool, params: bool) -> None:
        """Take a calm batch at once (every value finite): its losses, and whether it has gradient and parameter
        norms."""
        if loss:
            self._nonfinite_loss = False
            self._last_loss = (loss[0][-1], loss[1][-1])
        if norms:
            self._nan_grad_streak = 0
            self._finite_norm()
        if params:
            self._param_bad = False

    def loss(self, step: int, loss: float, scale: float | None, skipped: float | None, out: list[Event]) -> None:
        """The loss of a step (with its loss `scale` and `skipped` flag, where recorded; a `skipped` of None: a loss
        the user logged, see `logged_loss`): a nonfinite_loss event into `out`, once per run of them."""
        self._last_loss = (step, loss)
        if math.isfinite(loss):
            self._nonfinite_loss = False
            return
        self._went_bad(step, "loss")
        if self._nonfinite_loss:
            return
        self._nonfinite_loss = True
        applied = self.applied(step)
        what = "NaN" if math.isnan(loss) else ("+Inf" if loss > 0 else "-Inf")
        if skipped:
            fate = (
                f"GradScaler skipped the step (loss scale {pow2(scale or 0)} → {pow2((scale or 0) / 2)}), so this step "
                "did not change the parameters."
            )
        elif not self._context.scaled:
            fate = "There is no GradScaler to skip the step: the optimizer may now write NaN into the parameters."
        elif skipped is None:  # a value the user logged (see logged_loss)
            fate = (
                "GradScaler skips a step whose loss is non-finite (its gradients are too), so that step most likely "
                "did not change the parameters."
            )
        else:
            fate = (
                f"Yet GradScaler applied step {step}, so its gradients were finite: this loss is most likely another "
                "step's (the step passed to run.log counts otherwise than the agent, which counts optimizer steps from "
                "0), or a part of it no parameter depends on is non-finite."
            )
        diverged = self._trends.diverged_at(step)
        why = (
            "the parameters are non-finite"
            if self._param_bad
            else f"most likely the parameters: {applied}"
            if applied
            else f"the updates diverged before it: {diverged}; most likely too high a learning rate"
            if diverged
            else "a bad batch, or a layer that overflows"
        )
        out.append(
            self._context.event(
                step,
                "nonfinite_loss",
                "critical",
                f"{what} loss at step {step}: the forward pass produced a non-finite value ({why}). {fate}",
                {
                    "loss": spell(loss),
                    "scale": scale,
                    "skipped": bool(skipped),
                    "grad_norm_trend": self._trends.trend(),
                },
            )
        )

    def grad(self, step: int, norm: float, loss: float | None, scale: float | None, out: list[Event]) -> None:
        """The gradient norm of a step (with its `loss` and its loss `scale`, where recorded): a nonfinite_grad event
        into `out` where non-finite gradients are news (see below)."""
        scaled = scale is not None
        if math.isfinite(norm):
            self._nan_grad_streak = 0
            self._finite_norm()
            return
        if loss is None and self._last_loss is not None and self._last_loss[0] == step:
            loss = self._last_loss[1]  # (logged before its step's optimizer step, it came a batch early)
        self._went_bad(step, "gradients" if loss is not None else "gradients, no loss")
        if loss is not None and not math.isfinite(loss):
            return  # the nonfinite_loss event said it
        if scaled and not math.isnan(norm):
            return  # inf is an ordinary fp16 overflow
        # (counted in start-up calibration too, where an overflow can make NaN, inf - inf, but not reported there)
        self._nan_grad_streak += 1
        if scaled and self._skips.calibrating:
            return
        kind = "NaN" if math.isnan(norm) else "Inf"
        # With a scaler, one NaN skip can still be an overflow; NaN that survives the halved scale is not, nor NaN that
        # keeps coming back on single steps after the scale was lowered.
        first, critical_at = (2, self.t.warn_streak) if scaled else (1, 1)
        recurring = False
        if scaled:
            nan_steps = self._nan_steps
            # (only at a scale no higher than the last applied step's: the NaN of an overflow after the scale grew is
            # not; scale is a float on scaled runs, the only ones that get here)
            if scale <= self._skips.applied_scale:  # type: ignore[operator]
                nan_steps.append(step)
            while nan_steps and nan_steps[0] <= step - self.t.window:
                nan_steps.popleft()
            recurring = self._nan_grad_streak == 1 and len(nan_steps) == self.t.warn_streak and nan_steps[-1] == step
        if self._nan_grad_streak not in (first, critical_at) and not recurring:
            return
        severity = "critical" if self._nan_grad_streak >= critical_at else "warning"
        if loss is None:
            cause = (
                f"No loss was recorded at this step, so the forward pass may have made the {kind}, or else the "
                "backward pass: "
            )
        else:
            cause = f"The loss is finite, so the backward pass made the {kind}: "
        look = "look for sqrt, log, pow or a norm of zero, or a division by a value that can be 0"
        diverged = self._trends.diverged_at(step)
        if diverged:  # (not an operation that makes NaN: the values grew until they overflowed)
            cause = (
                f"Before it, {diverged}: the updates diverged, most likely from too high a learning rate, until the "
                "values overflowed. Lower the learning rate (or warm it up longer); clip_grad_norm_ with a finite "
                "max_norm caps each update."
            )
        elif recurring:
            cause += (
                f"it came back at a scale steps were applied at, so most likely an operation makes NaN on some batches "
                f"({look}), or the gradients keep growing past what fp16 holds."
            )
        elif scaled:  # which of the two, only a lower scale tells (see Skips.observe)
            self._skips.nan_reported(step)
            cause += (
                "either it overflows fp16 at this scale (inf - inf is NaN), which stops once GradScaler has lowered "
                f"the scale enough, or an operation in it makes NaN at any scale: {look}."
            )
        else:
            cause += look + (
                ", or gradients too large for their dtype (clip them, or lower the learning rate)."
                if kind == "Inf"
                else "."
            )
        fate = (
            " GradScaler skipped the step." if scaled else " No GradScaler skipped it: the parameters may be NaN next."
        )
        if recurring:
            count = f"{len(nan_steps)} steps in the last {self.t.window} ({', '.join(map(str, nan_steps))})"
        else:
            count = f"{self._nan_grad_streak} steps in a row" if self._nan_grad_streak > 1 else f"step {step}"
        loss_note = "with a finite loss" if loss is not None else "(no loss recorded)"
        out.append(
            self._context.event(
                step,
                "nonfinite_grad",
                severity,
                f"{kind} gradients at {count} {loss_note}. {cause}{fate}",
                {
                    "streak": self._nan_grad_streak,
                    "loss": spell(loss) if loss is not None else None,
                    "grad_norm": spell(norm),
                },
            )
        )

    # -- the episode and the parameters -------------------------------------------------------------------------------
    def _went_bad(self, step: int, what: str) -> None:
        """`what` ("loss", "gradients" or "gradients, no loss") was non-finite at `step`; an episode begins there
        unless one is going on."""
        if self._episode is None:
            self._episode = (step, what)

    def _finite_norm(self) -> None:
        """A finite gradient norm: every gradient was finite, so were the parameters (after a restored checkpoint
        too)."""
        self._episode = None
        self._param_bad = False

    def applied(self, step: int) -> str | None:
        """Without a scaler, while an episode that began before `step` goes on: what its first step wrote into the
        parameters, said as a cause."""
        episode = self._episode
        if self._context.scaled or episode is None or episode[0] >= step:
            return None
        under = {"loss": "from a non-finite loss", "gradients": "under a finite loss"}.get(
            episode[1], "no loss recorded"
        )
        return (
            f"the optimizer applied step {episode[0]}'s non-finite gradients ({under}), with no GradScaler to skip "
            "the step"
        )

    def params(self, step: int, param_norm: float, out: list[Event]) -> None:
        """The parameters' norm after a step's update: a nonfinite_param event into `out` when they went non-finite."""
        if math.isfinite(param_norm):
            self._param_bad = False
            return
        if self._param_bad:
            return
        self._param_bad = True
        episode = self._episode
        if not self._context.scaled and episode is not None:
            said = self._trends.diverged  # (said for the episode's first step: see Trends.diverged_at)
            diverged = said[1] if said and said[0] == episode[0] else None
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
                "batch, not from them). Restore the last good checkpoint, and skip the update when the loss is "
                "non-finite."
            )
        else:
            restore = "Not a benign fp16 overflow: restore" if self._context.scaled else "Restore"
            how = f"{restore} the last good checkpoint, and lower the learning rate or find the layer that overflows."
        out.append(
            self._context.event(
                step,
                "nonfinite_param",
                "critical",
                f"The parameters are non-finite at step {step}: the run cannot recover. {how}",
                {"param_norm": spell(param_norm), "grad_norm_trend": self._trends.trend()},
            )
        )

    def check_loss_recorded(self, columns: Columns, out: list[Event]) -> None:
        """Without a scaler the agent sees the loss only where the loop logs it: say once if a run records none."""
        if self._loss_seen or self._context.scaled or "skipped" in columns:
            return
        if "loss" in columns:
            self._loss_seen = True
            return
        self._norm_steps += len(columns["grad_norm"][0]) if "grad_norm" in columns else 0
        if self._norm_steps >= NO_LOSS_AFTER:
            self._loss_seen = True  # (said once)
            out.append(
                self._context.event(
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
