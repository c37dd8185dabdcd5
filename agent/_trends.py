"""The loss's and the gradient norm's trends: spikes against their rolling medians (from the first steps, by a warm-up
rule), a divergence (their climb over recent steps, at the step's learning rate), and the norm's recent trend.

Owns the medians, the spike flags, the runs of high values, the recent finite values and the last divergence said.
Takes finite values only (`loss`, `norm`, a calm batch's `absorb`); the other parts ask it `diverged_at`,
`recent_divergence` and `trend` for their events' wording."""

from __future__ import annotations

from collections import deque

from ampwatch._context import Context, Event, Series
from ampwatch._median import RollingMedian

WARMUP_FROM = 2  # finite values before spikes are judged at all (before `Thresholds.warmup`, by the warm-up rule)
DIVERGENCE_GAP = 10  # steps after the last finite value of a climb within which an event is told as that divergence
MAX_DIVERGED_STEPS = 100  # a divergence is said by non-finite events this many steps after the last one it explained
HISTORY = 30  # recent finite values a divergence is looked for in (and the trend taken over)
LOSS, NORM = "loss", "grad_norm"


class Trends:
    """Spikes and divergence of the loss and the gradient norm. `diverged` is (step, how) of the last divergence that
    explained a non-finite value (see `diverged_at`): the others read it, only `diverged_at` writes it."""

    def __init__(self, context: Context) -> None:
        self._context = context
        self.t = context.thresholds
        self._factor = {LOSS: self.t.loss_spike_factor, NORM: self.t.spike_factor}
        self._median = {LOSS: RollingMedian(self.t.window), NORM: RollingMedian(self.t.window)}
        self._spiking = {LOSS: False, NORM: False}  # a spike was said and the value is not back down yet
        self._high = {LOSS: 0, NORM: 0}  # consecutive values at `factor` times their median or more
        # (step, value) of recent finite losses, and of the norms of recent applied steps
        self._history: dict[str, deque[tuple[int, float]]] = {LOSS: deque(maxlen=HISTORY), NORM: deque(maxlen=HISTORY)}
        self.diverged: tuple[int, str] | None = None

    def loss(self, step: int, value: float, out: list[Event]) -> None:
        """A finite loss at `step`: a loss_spike event into `out` if it spikes."""
        self._history[LOSS].append((step, value))
        self._spike(step, LOSS, value, out)

    def norm(self, step: int, value: float, out: list[Event]) -> None:
        """The finite gradient norm of a step the optimizer applied: a grad_spike event into `out` if it spikes."""
        self._history[NORM].append((step, value))
        self._spike(step, NORM, value, out)

    def calm(self, loss: Series | None, norm: Series | None) -> bool:
        """Whether no spike is going on and none of a batch's finite losses and norms (of applied steps), taken in
        step order, can start one."""
        if self._spiking[LOSS] or self._spiking[NORM]:
            return False
        if loss and not self._median[LOSS].stays_below(loss[1], self._factor[LOSS]):
            return False
        return not norm or self._median[NORM].stays_below(norm[1], self._factor[NORM])

    def absorb(self, loss: Series | None, norm: Series | None) -> None:
        """Take a calm batch's series (see `calm`) at once: the state that `loss` and `norm` step by step reach."""
        for name, series in ((LOSS, loss), (NORM, norm)):
            if series:
                self._high[name] = 0
                self._history[name].extend(zip(series[0][-HISTORY:], series[1][-HISTORY:]))
                self._median[name].extend(series[1])

    def diverged_at(self, step: int) -> str | None:
        """The climb before a non-finite value at `step` (see `_divergence`), kept for the NaN-origin event that comes a
        few steps later; else the one said at most `MAX_DIVERGED_STEPS` before."""
        diverged = self._divergence(step)
        if diverged:
            self.diverged = (step, diverged)
        elif self.diverged and step - self.diverged[0] > MAX_DIVERGED_STEPS:
            self.diverged = None
        return diverged or (self.diverged[1] if self.diverged else None)

    def recent_divergence(self, step: int) -> str | None:
        """The divergence said last, if at most `MAX_DIVERGED_STEPS` before `step` (for the NaN-origin event)."""
        said = self.diverged
        return said[1] if said is not None and step - said[0] <= MAX_DIVERGED_STEPS else None

    def trend(self) -> dict[str, float] | None:
        """The gradient norm's recent values in short (said in the details of non-finite events)."""
        if not self._history[NORM]:
            return None
        recent = [value for _, value in self._history[NORM]]
        return {"last": recent[-1], "min": min(recent), "max": max(recent), "steps": len(recent)}

    def _spike(self, step: int, name: str, value: float, out: list[Event]) -> None:
        median, factor, spiking = self._median[name], self._factor[name], self._spiking[name]
        if len(median) >= self.t.warmup:
            # `factor` times the usual high end (the 90th percentile), which is the median for a steady series: noisy
            # ones (small batches) reach several times their median now and then, but not for `spike_steps` in a row,
            # as a divergence does (whose high end keeps up with it). Around or below 0 (a log-likelihood), twice
            # `factor` interquartile ranges above the median. A loss's high end is its 90th percentile times how far its
            # 99th is from the median (for a steady loss about 1): a small-batch loss near 0 (a classifier that has
            # converged) is now and then a single hard example, hundreds of times its median and several times its 90th
            # percentile; and a run of high values is one at `factor` times its 90th percentile. (Once reported, a spike
            # is over when the value is back below half `factor` at the usual end.)
            mid, spread = median.value(), median.spread()
            above = (value - mid) / spread if spread > 0 else 0.0
            usual = (
                median.quantile(0.9) if name == LOSS and mid > 0 else mid
            )  # (what a run of high values is high above)
            high = self._high[name] = self._high[name] + 1 if mid > 0 and value >= factor * usual else 0
            level = (
                above / 2 if mid <= 0 else value / mid if high >= self.t.spike_steps else value / median.quantile(0.9)
            )
            tail = median.quantile(0.99) / mid if name == LOSS and mid > 0 and high < self.t.spike_steps else 1.0
            if level >= factor * tail and not spiking:
                how = (
                    f"{value / mid:.0f}× its median"
                    if mid > 0
                    else f"{above:.0f} interquartile ranges above its median"
                )
                run = f", {high} steps in a row at {factor:g}× or more" if high >= self.t.spike_steps else ""
                self._spike_event(
                    step, name, value, mid, spread, f"{how} over the last {len(median)} steps ({mid:.4g}){run}", out
                )
                spiking = True
            elif level < factor / 2:
                spiking = False
        elif len(median) >= WARMUP_FROM:
            # Warm-up: too few values for a high end, so against the lower median of the values so far, at `factor`
            # squared (100× for the gradient norm, 25× for the loss): a healthy start moves by a few times, a learning
            # rate that blows the run up multiplies the norm by that within a few steps.
            low = median.lower()
            if low > 0 and value >= factor**2 * low and not spiking:
                how = (
                    f"{value / low:.0f}× its median over the first {len(median)} steps ({low:.4g}; before "
                    f"{self.t.warmup} steps a spike is {factor**2:g}× or more)"
                )
                self._spike_event(step, name, value, low, median.spread(), how, out)
                spiking = True
            elif low > 0 and value < factor * low:
                spiking = False
        self._spiking[name] = spiking
        median.add(value)

    def _spike_event(
        self, step: int, name: str, value: float, mid: float, spread: float, how: str, out: list[Event]
    ) -> None:
        """A grad_spike or loss_spike event: `value` at `step` is `how` high above its usual `mid`."""
        kind = "grad_spike" if name == NORM else "loss_spike"
        what = "Gradient norm" if name == NORM else "Loss"
        lr = self._context.lr
        diverged = self._divergence(step)
        if diverged:  # (a learning rate too high multiplies the norm step after step: that, not a batch)
            hint = (
                f" {diverged[0].upper()}{diverged[1:]}: the updates diverge, most likely from too high a learning "
                "rate. Lower it (or warm it up longer); clip_grad_norm_ with a finite max_norm caps each update."
            )
        elif name == LOSS:
            hint = " Check the batch and the learning rate" + (f" ({lr:.3g})." if lr is not None else ".")
        else:  # (with a scaler, an explosion is told apart from an overflow, which GradScaler skips)
            hint = " No step was skipped: this is an explosion, not an fp16 overflow." if self._context.scaled else ""
            hint += self._clip_hint(value)
            hint += f" The learning rate is {lr:.3g}." if lr is not None else ""
        out.append(
            self._context.event(
                step,
                kind,
                "warning",
                f"{what} {value:.4g} at step {step} is {how}.{hint}",
                {name: value, "median": mid, "ratio": value / mid if mid > 0 else None, "spread": spread, "lr": lr},
            )
        )

    def _divergence(self, step: int) -> str | None:
        """Whether the gradient norm or the loss climbed to `factor` squared times its recent low (100× for the norm,
        25× for the loss), the value before the last already `factor` times it (a climb over steps, not one bad batch),
        ending at most `DIVERGENCE_GAP` steps before `step`: how much, in how many steps, at what learning rate."""
        parts = []
        for label, name in (("gradient norm", NORM), ("loss", LOSS)):
            history, factor = self._history[name], self._factor[name]
            if len(history) < 2 or step - history[-1][0] > DIVERGENCE_GAP:
                continue
            (last_step, last), before = history[-1], history[-2][1]
            low_step, low = min(history, key=lambda point: point[1])
            if 0 < low and low_step < last_step and last >= factor**2 * low and before >= factor * low:
                parts.append(
                    f"the {label} grew {last / low:.2g}× in {last_step - low_step} steps (from {low:.3g} at step "
                    f"{low_step} to {last:.3g} at step {last_step})"
                )
        if not parts:
            return None
        lr = self._context.lr
        return " and ".join(parts) + (f" while the learning rate was {lr:.3g}" if lr is not None else "")

    def _clip_hint(self, norm: float) -> str:
        """What the loop's clip did to a spiking update: only a max_norm below the norm cut it down (a clip with
        max_norm=inf, or one above the norm, only measures it)."""
        max_norm = self._context.max_norm
        if not self._context.clipping:
            return " Clip gradients or lower the learning rate."
        if max_norm is None:  # (a tensor max_norm: not read, that would sync)
            return (
                " The loop calls clip_grad_norm_: if its max_norm is below this norm, this update was cut down to it; "
                "if it comes back, lower the learning rate or look at the batches it comes on."
            )
        if norm > max_norm:
            return (
                f" The loop clips (clip_grad_norm_, max_norm {max_norm:g}), so this update was cut down to "
                f"{max_norm:g}; "
                "if it comes back, lower the learning rate or look at the batches it comes on."
            )
        return (
            f" The loop's clip_grad_norm_ (max_norm {max_norm:g}) only measured this norm, it did not cut the update "
            "down: clip with a lower max_norm or lower the learning rate."
        )
