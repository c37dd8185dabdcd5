"""Part of `ampwatch._diagnose.Analyzer`: spikes of the loss and the gradient norm against their rolling medians
(from the first steps, by a warm-up rule), a divergence (their climb over recent steps, at the recorded learning
rate), and the norm's recent trend (said in later events)."""

from __future__ import annotations

from typing import Any

from ampwatch._median import RollingMedian

Event = dict[str, Any]
WARMUP_FROM = 2  # finite values before spikes are judged at all (before `Thresholds.warmup`, by the warm-up rule)
DIVERGENCE_GAP = 10  # steps after the last finite value of a climb within which an event is told as that divergence


class Trends:
    """Part of `ampwatch._diagnose.Analyzer`: its attributes are the Analyzer's."""

    def _spike(
        self: Any, step: int, name: str, value: float, median: RollingMedian, factor: float, out: list[Event]
    ) -> None:
        spiking = name == "grad_norm" and self._grad_spiking or name == "loss" and self._loss_spiking
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
                median.quantile(0.9) if name == "loss" and mid > 0 else mid
            )  # (what a run of high values is high above)
            high = self._high[name] = self._high[name] + 1 if mid > 0 and value >= factor * usual else 0
            level = (
                above / 2 if mid <= 0 else value / mid if high >= self.t.spike_steps else value / median.quantile(0.9)
            )
            tail = median.quantile(0.99) / mid if name == "loss" and mid > 0 and high < self.t.spike_steps else 1.0
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
        if name == "grad_norm":
            self._grad_spiking = spiking
        else:
            self._loss_spiking = spiking
        median.add(value)

    def _spike_event(
        self: Any, step: int, name: str, value: float, mid: float, spread: float, how: str, out: list[Event]
    ) -> None:
        """A grad_spike or loss_spike event: `value` at `step` is `how` high above its usual `mid`."""
        kind = "grad_spike" if name == "grad_norm" else "loss_spike"
        what = "Gradient norm" if name == "grad_norm" else "Loss"
        lr = self._lr
        diverged = self._divergence(step)
        if diverged:  # (a learning rate too high multiplies the norm step after step: that, not a batch)
            hint = (
                f" {diverged[0].upper()}{diverged[1:]}: the updates diverge, most likely from too high a learning "
                "rate. Lower it (or warm it up longer); clip_grad_norm_ with a finite max_norm caps each update."
            )
        elif name == "loss":
            hint = " Check the batch and the learning rate" + (f" ({lr:.3g})." if lr is not None else ".")
        else:  # (with a scaler, an explosion is told apart from an overflow, which GradScaler skips)
            hint = " No step was skipped: this is an explosion, not an fp16 overflow." if self._scaled else ""
            hint += self._clip_hint(value)
            hint += f" The learning rate is {lr:.3g}." if lr is not None else ""
        out.append(
            self.event(
                step,
                kind,
                "warning",
                f"{what} {value:.4g} at step {step} is {how}.{hint}",
                {name: value, "median": mid, "ratio": value / mid if mid > 0 else None, "spread": spread, "lr": lr},
            )
        )

    def _divergence(self: Any, step: int) -> str | None:
        """Whether the gradient norm or the loss climbed to `factor` squared times its recent low (100× for the norm,
        25× for the loss), the value before the last already `factor` times it (a climb over steps, not one bad batch),
        ending at most `DIVERGENCE_GAP` steps before `step`: how much, in how many steps, at what learning rate."""
        parts = []
        for name, history, factor in (
            ("gradient norm", self._norm_history, self.t.spike_factor),
            ("loss", self._loss_history, self.t.loss_spike_factor),
        ):
            if len(history) < 2 or step - history[-1][0] > DIVERGENCE_GAP:
                continue
            (last_step, last), before = history[-1], history[-2][1]
            low_step, low = min(history, key=lambda point: point[1])
            if 0 < low and low_step < last_step and last >= factor**2 * low and before >= factor * low:
                parts.append(
                    f"the {name} grew {last / low:.2g}× in {last_step - low_step} steps (from {low:.3g} at step "
                    f"{low_step} to {last:.3g} at step {last_step})"
                )
        if not parts:
            return None
        return " and ".join(parts) + (f" while the learning rate was {self._lr:.3g}" if self._lr is not None else "")

    def _clip_hint(self: Any, norm: float) -> str:
        """What the loop's clip did to a spiking update: only a max_norm below the norm cut it down (a clip with
        max_norm=inf, or one above the norm, only measures it)."""
        max_norm = self.max_norm
        if not self.clipping:
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

    def _trend(self: Any) -> dict[str, float] | None:
        if not self._norm_history:
            return None
        recent = [value for _, value in self._norm_history]
        return {"last": recent[-1], "min": min(recent), "max": max(recent), "steps": len(recent)}
