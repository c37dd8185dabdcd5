"""Part of `ampwatch._diagnose.Analyzer`: spikes of the loss and the gradient norm against their rolling medians,
and the norm's recent trend (said in later events)."""

from __future__ import annotations

from typing import Any

from ampwatch._median import RollingMedian

Event = dict[str, Any]


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
            # percentile; and a run of high values is one at `factor` times its 90th percentile. (Once reported, a spike is
            # over when the value is back below half `factor` at the usual end.)
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
                kind = "grad_spike" if name == "grad_norm" else "loss_spike"
                what = "Gradient norm" if name == "grad_norm" else "Loss"
                if name == "loss":
                    hint = " Check the batch and the learning rate."
                else:  # (with a scaler, an explosion is told apart from an overflow, which GradScaler skips)
                    hint = " No step was skipped: this is an explosion, not an fp16 overflow." if self._scaled else ""
                    hint += self._clip_hint(value)
                how = (
                    f"{value / mid:.0f}× its median"
                    if mid > 0
                    else f"{above:.0f} interquartile ranges above its median"
                )
                run = f", {high} steps in a row at {factor:g}× or more" if high >= self.t.spike_steps else ""
                out.append(self.event(step, kind, "warning",
                    f"{what} {value:.4g} at step {step} is {how} over the last {len(median)} steps ({mid:.4g}){run}.{hint}",
                    {name: value, "median": mid, "ratio": value / mid if mid > 0 else None, "spread": spread}))  # fmt: skip
                spiking = True
            elif level < factor / 2:
                spiking = False
        if name == "grad_norm":
            self._grad_spiking = spiking
        else:
            self._loss_spiking = spiking
        median.add(value)

    def _clip_hint(self: Any, norm: float) -> str:
        """What the loop's clip did to a spiking update: only a max_norm below the norm cut it down (a clip with
        max_norm=inf, or one above the norm, only measures it, as HF's Trainer does to log it)."""
        max_norm = self.max_norm
        if not self.clipping:
            return " Clip gradients or lower the learning rate."
        if max_norm is None:  # (a tensor max_norm: not read, that would sync)
            return (" The loop calls clip_grad_norm_: if its max_norm is below this norm, this update was cut down to it; "
                    "if it comes back, lower the learning rate or look at the batches it comes on.")  # fmt: skip
        if norm > max_norm:
            return (f" The loop clips (clip_grad_norm_, max_norm {max_norm:g}), so this update was cut down to {max_norm:g}; "
                    "if it comes back, lower the learning rate or look at the batches it comes on.")  # fmt: skip
        return (f" The loop's clip_grad_norm_ (max_norm {max_norm:g}) only measured this norm, it did not cut the update "
                "down: clip with a lower max_norm or lower the learning rate.")  # fmt: skip

    def _trend(self: Any) -> dict[str, float] | None:
        if not self._norm_history:
            return None
        recent = list(self._norm_history)
        return {"last": recent[-1], "min": min(recent), "max": max(recent), "steps": len(recent)}
