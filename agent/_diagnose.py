"""Diagnosis on the host, on the sender thread: per-step values in, events a person can act on out.

Nothing here touches a tensor, so none of it costs the training thread anything.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from ampwatch._episodes import Episodes
from ampwatch._episodes import spell as _spell
from ampwatch._leading import Leading
from ampwatch._median import RollingMedian
from ampwatch._protocol import event as protocol_event
from ampwatch._protocol import pow2
from ampwatch._trends import Trends

log = logging.getLogger("ampwatch")
Event = dict[str, Any]
Columns = dict[str, tuple[list[int], list[float]]]  # series name -> (steps, values), as a batch holds them
MAX_DIVERGED_STEPS = 100  # a divergence is said by non-finite events this many steps after the last one it explained
SCHEDULE_AHEAD = 0.01  # share of the steps a scheduler may advance on skipped ones before that is a warning
OBSERVED = ("loss", "scale", "skipped", "grad_norm", "lr", "param_norm")  # what the analyzer reads


@dataclass(frozen=True)
class Thresholds:
    """When a pattern becomes an event: one threshold per failure signature, each saying what it counts."""

    scale_floor: float = 1.0  # PyTorch's docs: a scale below 1 means something is wrong
    collapse_streak: int = 10  # consecutive skips that are a collapse whatever the scale
    warn_streak: int = 3  # consecutive skips after calibration worth a warning
    spike_factor: float = 10.0  # grad norm this many times its rolling 90th percentile (see Analyzer._spike)
    loss_spike_factor: float = 5.0
    spike_steps: int = 5  # steps in a row at the factor times the median that are a spike too (a steady divergence)
    window: int = 200  # rolling median window (steps)
    warmup: int = 20  # finite values needed before spikes are judged
    calibration_steps: int = 50  # skips before this step (outside a collapse) are start-up calibration


class Analyzer(Trends, Episodes):
    """Classifies each step from its standard series and emits events once per episode."""

    def __init__(self, rank: int = 0, thresholds: Thresholds | None = None) -> None:
        self.rank = rank
        self.t = thresholds or Thresholds()
        self.calibrating = True
        self._calibration_skips = 0
        self._calibration_start: float | None = None
        self._streak = 0
        self._streak_start_scale = 0.0
        self._collapsed = False
        self._stepped = False  # a step was applied: a skip streak after one is no start-up calibration
        self._applied_scale = math.inf  # the loss scale of the last step GradScaler applied
        self._below_floor = False  # a scale below the floor was reported; until it is back above
        self._scaled = False  # a GradScaler record (a step's skipped flag) was seen: this run has a scaler
        self._origin: tuple[str, str] | None = None  # (module, phase) of the last NaN origin named (see `event`)
        self.clipping = False  # the loop calls clip_grad_norm_ (the agent's recorder tells; see ampwatch._origin)
        self.max_norm: float | None = None  # and the max_norm it passes, where that is a number
        self._nonfinite_loss = False
        self._nan_grad_streak = 0
        self._skip_steps: deque[int] = deque()  # recent skipped steps
        self._nan_steps: deque[int] = (
            deque()
        )  # recent steps with NaN gradients and a finite loss (GradScaler skipped them)
        self._last_loss: tuple[int, float] | None = (
            None  # (a loss logged before its step's optimizer step comes a batch early)
        )
        self._nan_alarm: int | None = None  # the step of a NaN-gradient event in this skip streak
        self._param_bad = False
        self._episode: tuple[int, str] | None = (
            None  # (first step, "loss" or "gradients") of a non-finite episode going on
        )
        self._loss_seen = False  # a loss was recorded (or the run was told it records none)
        self._norm_steps = 0  # steps with a gradient norm before that
        self._grad_median = RollingMedian(self.t.window)
        self._loss_median = RollingMedian(self.t.window)
        self._grad_spiking = False
        self._loss_spiking = False
        self._high = {"loss": 0, "grad_norm": 0}  # consecutive values at `factor` times their median or more
        self._last_lr: float | None = None  # the learning rate of the last step the scheduler check read
        self._lr: float | None = None  # the learning rate of the step being judged (said in spike and NaN events)
        self.diverged: tuple[int, str] | None = None  # (step, how) of a non-finite value after a divergence
        self.scheduler = False  # an LR scheduler object wraps a watched optimizer's step (see Diagnosis)
        self._skipped_at: dict[int, bool] = {}  # recent steps -> skipped after start-up calibration
        self._scheduler_reported = False
        self._lr_from: int | None = None  # the first step whose learning rate the scheduler check read
        self._ahead = 0  # of them, steps after a skip (not calibration's) at which a scheduler changed the LR
        self._norm_history: deque[tuple[int, float]] = deque(maxlen=30)  # (step, norm) of recent applied steps
        self._loss_history: deque[tuple[int, float]] = deque(maxlen=30)  # (step, loss) of recent finite losses
        self.leading = Leading(self.event)  # the leading indicators' rules (see ampwatch._leading)

    def observe_columns(self, columns: Columns) -> list[Event]:
        """Events for a batch's series. A calm stretch (every value finite, no skipped step, nothing near a spike)
        only moves the state, in bulk; anything else is judged step by step, in step order."""
        standard = {name: columns[name] for name in OBSERVED if name in columns}
        events: list[Event] = self.leading.observe_columns(columns)
        if not self._loss_seen:
            self._check_loss_seen(standard, events)
        if not standard or self._absorb_calm(standard):
            return events
        by_step: dict[int, dict[str, float]] = {}
        for name, (steps, values) in standard.items():
            for step, value in zip(steps, values):
                by_step.setdefault(step, {})[name] = value
        for step in sorted(by_step):
            events.extend(self.observe(step, by_step[step]))
        return events

    def _absorb_calm(self, c: Columns) -> bool:
        """If nothing in these series can raise an event, update the state as `observe` would and say so."""
        skipped, loss, norm, lr = c.get("skipped"), c.get("loss"), c.get("grad_norm"), c.get("lr")
        if (
            self._streak
            or self._grad_spiking
            or self._loss_spiking
            or self._below_floor
            or (skipped and (self.calibrating or any(skipped[1])))
        ):
            return False
        for name in ("loss", "scale", "grad_norm", "param_norm"):  # a sum is finite only if every value is
            if name in c and not math.isfinite(sum(c[name][1])):
                return False
        if (skipped or self._scaled) and not all(  # values the user logged at steps without GradScaler's record
            _within(c[name][0], skipped[0] if skipped else []) for name in ("loss", "grad_norm") if name in c
        ):
            return False
        if lr and any(self._skipped_at.values()):  # a schedule step right after a skipped step: judged one by one
            return False
        if loss and not self._loss_median.stays_below(loss[1], self.t.loss_spike_factor):
            return False
        if norm and not self._grad_median.stays_below(norm[1], self.t.spike_factor):
            return False
        if loss:
            self._high["loss"] = 0
            self._nonfinite_loss = False
            self._last_loss = (loss[0][-1], loss[1][-1])
            self._loss_history.extend(zip(loss[0][-30:], loss[1][-30:]))
            self._loss_median.extend(loss[1])
        if norm:
            self._high["grad_norm"] = 0
            self._nan_grad_streak = 0
            self._finite_norm()
            self._norm_history.extend(zip(norm[0][-30:], norm[1][-30:]))
            self._grad_median.extend(norm[1])
        if skipped:
            self._skipped_at = {step: False for step in skipped[0][-2:]}
            self._stepped = self._scaled = True
            if "scale" in c:
                self._applied_scale = c["scale"][1][-1]
        if "param_norm" in c:
            self._param_bad = False
        if lr:
            self._last_lr = self._lr = lr[1][-1]
        return True

    def observe(self, step: int, values: dict[str, float]) -> list[Event]:
        """Events for one step's values (any subset of loss, scale, skipped, grad_norm, lr, param_norm)."""
        events: list[Event] = []
        loss, scale, norm = values.get("loss"), values.get("scale"), values.get("grad_norm")
        skipped = values.get("skipped")
        self._lr = values.get("lr", self._lr)
        if skipped is None and self._scaled:
            self._logged(step, loss, events)
            loss = norm = None
        if loss is not None:
            self._check_loss(step, loss, scale, skipped, norm, events)
        if skipped is not None and scale is not None:
            self._check_skip(step, bool(skipped), scale, loss, norm, events)
        if norm is not None:
            self._check_grad(step, norm, loss, bool(skipped), scale, events)
        if "param_norm" in values:  # (taken after the optimizer step: the loss and gradients above came before it)
            self._check_params(step, values["param_norm"], events)
        if skipped is not None:
            self._scaled = True
            # (a start-up calibration skip is no schedule's problem: whatever steps the LR, it is a handful of steps)
            self._skipped_at[step] = bool(skipped) and not self.calibrating
            if len(self._skipped_at) > 2:  # the last two steps are all the scheduler check reads
                del self._skipped_at[next(iter(self._skipped_at))]
        if "lr" in values:
            self._check_scheduler(step, values["lr"], events)
        return events

    def _logged(self, step: int, loss: float | None, out: list[Event]) -> None:
        """Values the user logged at a step of a scaler run without GradScaler's record of that step: a copy of what the
        agent recorded itself, arriving after its step was judged (a skip wakes the sender) or at a step numbered
        otherwise (a resumed run's global step), or a loss logged before its optimizer step, arriving a batch early.
        Only a non-finite loss at a step not known to be skipped is judged (GradScaler skips such a step, whatever its
        number); feeding the rest to the medians would mix two orders of steps."""
        if loss is None or step in self._skip_steps:  # (a skipped step was judged with its record)
            return
        self._last_loss = (step, loss)
        if not math.isfinite(loss):
            self._check_loss(step, loss, None, None, None, out)

    # -- skipped steps and the loss scale --------------------------------------------------
    def _check_skip(
        self, step: int, skipped: bool, scale: float, loss: float | None, norm: float | None, out: list[Event]
    ) -> None:
        if not skipped:
            if self.calibrating and step >= self.t.calibration_steps:
                self.calibrating = False
                if self._calibration_skips:
                    out.append(
                        self.event(
                            step,
                            "skipped_step",
                            "info",
                            f"Start-up calibration: {self._calibration_skips} skipped step(s) while GradScaler "
                            "searched for "
                            f"its loss scale ({pow2(self._calibration_start or scale)} at the first skip, "
                            f"{pow2(scale)} now). "
                            "This is normal.",
                            {"calibration": True, "skips": self._calibration_skips, "scale": scale},
                        )
                    )
            elif self._nan_alarm is not None:  # the evidence the NaN-gradient event could not have yet
                overflow = self._streak_start_scale > self._applied_scale  # (they began only once the scale had grown)
                diverged = self._diverged_at(step)
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
                    self.event(
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
                    self.event(
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
            self._stepped, self._applied_scale = True, scale
            return
        if self._streak == 0:
            self._streak_start_scale = scale
        self._streak += 1
        recent = self._skip_steps
        recent.append(step)
        while recent[0] <= step - self.t.window:
            recent.popleft()
        # Still skipping when calibration should be long over, or NaN gradients with a finite loss at a scale steps were
        # applied at (calibration only searches downwards from too high a scale): not calibration.
        nan_again = (
            self._stepped
            and scale <= self._applied_scale
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
                    f"{pow2(scale / 2)}. "
                    "Every step is being thrown away"
                )
            else:  # skips that come back again and again, each halving the scale
                what = (
                    f"the scale fell to {pow2(scale / 2)} at step {step}, below {self.t.scale_floor:g}, after skips "
                    "that keep "
                    f"coming back ({len(recent)} in the last {self.t.window} steps)"
                )
            out.append(
                self.event(
                    step,
                    "scale_collapse",
                    "critical",
                    f"Loss scale collapse: {what}: the gradients overflow or are NaN at any scale. {self._param_note()}"
                    f"{self._collapse_advice(step)}",
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
                self.event(
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
                self.event(
                    step,
                    "skipped_step",
                    "warning",
                    f"{self._streak} consecutive skipped steps (loss scale now {pow2(scale / 2)}): more than fp16 "
                    "overflow usually causes. Watch for a scale collapse.",
                    {"streak": self._streak, "scale_after": scale / 2},
                )
            )

    # -- non-finite values -----------------------------------------------------------------
    def _check_loss(
        self, step: int, loss: float, scale: float | None, skipped: float | None, norm: float | None, out: list[Event]
    ) -> None:
        self._last_loss = (step, loss)
        if math.isfinite(loss):
            self._nonfinite_loss = False
            self._loss_history.append((step, loss))
            self._spike(step, "loss", loss, self._loss_median, self.t.loss_spike_factor, out)
            return
        self._went_bad(step, "loss")
        if self._nonfinite_loss:
            return
        self._nonfinite_loss = True
        applied = self._applied(step)
        what = "NaN" if math.isnan(loss) else ("+Inf" if loss > 0 else "-Inf")
        if skipped:
            fate = (
                f"GradScaler skipped the step (loss scale {pow2(scale or 0)} → {pow2((scale or 0) / 2)}), so this step "
                "did not change the parameters."
            )
        elif not self._scaled:
            fate = "There is no GradScaler to skip the step: the optimizer may now write NaN into the parameters."
        elif skipped is None:  # a value the user logged (see _logged)
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
        diverged = self._diverged_at(step)
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
            self.event(
                step,
                "nonfinite_loss",
                "critical",
                f"{what} loss at step {step}: the forward pass produced a non-finite value ({why}). {fate}",
                {"loss": _spell(loss), "scale": scale, "skipped": bool(skipped), "grad_norm_trend": self._trend()},
            )
        )

    def _check_grad(
        self, step: int, norm: float, loss: float | None, skipped: bool, scale: float | None, out: list[Event]
    ) -> None:
        scaled = scale is not None
        if math.isfinite(norm):
            self._nan_grad_streak = 0
            self._finite_norm()
            if not skipped:
                self._norm_history.append((step, norm))
                self._spike(step, "grad_norm", norm, self._grad_median, self.t.spike_factor, out)
            return
        if loss is None and self._last_loss is not None and self._last_loss[0] == step:
            loss = self._last_loss[1]  # (logged before its step's optimizer step, it came a batch early)
        self._went_bad(step, "gradients" if loss is not None else "gradients, no loss")
        if loss is not None and not math.isfinite(loss):
            return  # the nonfinite_loss event said it
        if scaled and not math.isnan(norm):
            return  # inf is an ordinary fp16 overflow
        self._nan_grad_streak += (
            1  # (counted in start-up calibration too, where an overflow can make NaN, inf - inf, but
        )
        if scaled and self.calibrating:  # not reported there)
            return
        kind = "NaN" if math.isnan(norm) else "Inf"
        # With a scaler, one NaN skip can still be an overflow; NaN that survives the halved scale is not, nor NaN that
        # keeps coming back on single steps after the scale was lowered.
        first, critical_at = (2, self.t.warn_streak) if scaled else (1, 1)
        recurring = False
        if scaled:
            nan_steps = self._nan_steps
            # (only at a scale no higher than the last applied step's: the NaN of an overflow after the scale grew is
            # not)
            # (scale is a float on scaled runs, the only ones that get here)
            if scale <= self._applied_scale:  # type: ignore[operator]
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
        diverged = self._diverged_at(step)
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
        elif scaled:  # which of the two, only a lower scale tells (see _check_skip)
            if self._nan_alarm is None:
                self._nan_alarm = step
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
            self.event(
                step,
                "nonfinite_grad",
                severity,
                f"{kind} gradients at {count} {loss_note}. {cause}{fate}",
                {
                    "streak": self._nan_grad_streak,
                    "loss": _spell(loss) if loss is not None else None,
                    "grad_norm": _spell(norm),
                },
            )
        )

    def _collapse_advice(self, step: int) -> str:
        """What to do about a collapse: the divergence before it, or what the origin named, if it was; else values fp16
        cannot hold."""
        diverged = self._diverged_at(step)
        if diverged:
            return f"Before it, {diverged}: most likely too high a learning rate. Lower it (or warm it up longer)."
        module, phase = self._origin or ("", "")
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

    def _diverged_at(self, step: int) -> str | None:
        """The gradient norm's growth before a non-finite value at `step` (see Trends._divergence), kept for the
        NaN-origin event that comes a few steps later."""
        diverged = self._divergence(step)
        if diverged:
            self.diverged = (step, diverged)
        elif self.diverged and step - self.diverged[0] > MAX_DIVERGED_STEPS:
            self.diverged = None
        return diverged or (self.diverged[1] if self.diverged else None)

    # -- schedules ----------------------------------------------------------------------
    def _check_scheduler(self, step: int, lr: float, out: list[Event]) -> None:
        # The lr read at step k is the one iteration k used; a change from k-1 happened after iteration k-1. Only an LR
        # scheduler object is judged: a loop that computes the LR from its iteration number (nanoGPT) means to. Said
        # once the schedule has run ahead by more than SCHEDULE_AHEAD of the steps: a healthy fp16 run's occasional
        # overflow skip puts it one step ahead in hundreds or thousands (Lightning steps its schedulers on skipped
        # steps too), nothing to change.
        # (the lr is not in every step's columns: the steps are counted from the first one read)
        self._lr_from = step if self._lr_from is None else self._lr_from
        steps = step - self._lr_from + 1
        ahead = self.scheduler and self._last_lr is not None and self._skipped_at.get(step - 1) and lr != self._last_lr
        self._ahead += bool(ahead)
        if ahead and self._ahead > SCHEDULE_AHEAD * steps and not self._scheduler_reported:
            self._scheduler_reported = True
            out.append(
                self.event(
                    step,
                    "amp_config",
                    "warning",
                    f"The learning rate changed ({self._last_lr:.6g} → {lr:.6g}) after step {step - 1}, which "
                    "GradScaler skipped: the scheduler advances on skipped steps, so the schedule runs ahead of the "
                    f"optimizer ({self._ahead} of {steps} steps so far). Step the "
                    "scheduler only when the optimizer stepped.",
                    {"lr_before": self._last_lr, "lr_after": lr, "steps_ahead": self._ahead},
                )
            )
        self._last_lr = lr

    def event(self, step: int, kind: str, severity: str, message: str, details: dict[str, Any]) -> Event:
        """An event as the server takes it. (The NaN-origin probe's events are made here too: a later collapse says
        what its origin means.)"""
        if "origin" in details:
            self._origin = (details["origin"], details["phase"])
        return protocol_event(step, self.rank, kind, severity, message, details)


def _within(steps: list[int], known: list[int]) -> bool:
    """Whether every step of `steps` is one of `known` (usually the very same list)."""
    return steps == known or set(steps) <= set(known)
