"""Plain steps and the steady path: what the Recorder does on the steps between the ones that do more.

A step does more when it takes per-layer norms (or precedes one), checks the parameters, or anchors the
scale; `_plan` finds the next such step, and the steps before it are plain: `_finish_step` takes its short
path on them. On plain steps, a loop that clips with `clip_grad_norm_` after `unscale_` also repeats one
pattern: one scale(), unscale_, a clip over the optimizer's parameters, step, update. For those steps the
Recorder's hook methods are replaced, on the instance, by the lean ones here. Each checks with an identity or
two that its step still has that pattern; if not, it leaves the steady path and calls the full method, which
then sees exactly the state it would have left itself. What is recorded is the same either way
(tests/test_steady.py); the training thread only does less per step.
"""

from __future__ import annotations

from operator import is_
from typing import Any

from ampwatch._steps import ANCHOR_EVERY
from ampwatch._worker import FAST_RECORDS, STEP

HOOKS = ("on_scale", "on_unscaled", "on_clipped", "before_step", "before_update")


class Steady:
    """Part of `ampwatch._watch.Recorder`: its attributes are the Recorder's."""

    _steady: Any = None  # the optimizer of the steady loop, while its lean hooks are in place

    def _plan(self: Any, step: int) -> int:
        """The first step after `step` whose record needs more than the plain path of `_finish_step`: a step that
        checks the parameters, takes per-layer norms or precedes one, or anchors the scale; 0 while probing.
        (Whatever asks for an anchor, `watch` or `request_anchor`, resets it to 0 along with `reanchor`.)"""
        if self._probing:
            return 0
        layer = self.layer_interval
        until = min(_next_multiple(step, self.param_interval), _next_multiple(step, ANCHOR_EVERY))
        if self._probe is not None:  # per-layer norms are taken at multiples of `layer_interval` (see on_unscaled)
            until = min(until, _next_multiple(step, layer), _next_multiple(step + 1, layer) - 1)
        return until

    def _enter_steady(self: Any) -> None:
        """At the end of a full step that planned plain steps ahead: go lean if that step had the pattern."""
        optimizer, scaler = self._last_optimizer, self._scaler
        stage = self._stage_before
        if (optimizer is None or scaler is None or not scaler._enabled or not self._clip_trusted or self._probing
                or not self._ever_scaled or stage is None or stage.name != "UNSCALED"
                or getattr(optimizer, "_step_supports_amp_scaling", False)):  # fmt: skip
            return
        self._steady = optimizer
        state = self.__dict__
        for name in HOOKS:
            state[name] = getattr(self, "_steady_" + name)

    def _leave_steady(self: Any) -> None:
        """Back to the full hooks (until the next plan)."""
        if self._steady is not None:
            self._steady = None
            state = self.__dict__
            for name in HOOKS:
                state.pop(name, None)

    def _steady_on_scale(self: Any, outputs: Any) -> None:
        if self._loss is None and isinstance(outputs, self._tensor) and outputs.numel() == 1:
            self._scale_calls += 1
            self._loss = outputs.data  # (see on_scale)
        else:
            self._leave_steady()
            self.on_scale(outputs)

    def _steady_on_unscaled(self: Any, optimizer: Any, scale: Any = None) -> None:
        if optimizer is self._steady and scale is None:
            self._unscaled = self._deferred = optimizer  # the clip is trusted: its norm is taken (see on_unscaled)
        else:
            self._leave_steady()
            self.on_unscaled(optimizer, scale)

    def _steady_on_clipped(self: Any, parameters: Any, args: tuple, kwargs: dict[str, Any], total: Any) -> None:
        optimizer = self._unscaled
        if optimizer is None:  # not between this run's unscale_ and step: nothing to do, as in on_clipped
            return
        groups, same = optimizer.param_groups, self._clip_params
        norm_type = args[1] if len(args) > 1 else kwargs.get("norm_type", 2.0) if kwargs else 2.0
        # The clip the full path trusted: the same parameters (by identity, cheaper than their ids), a 2-norm.
        if (self._deferred is optimizer and self._norm is None and groups is self._clip_groups
                and len(groups) == self._clip_seen[2] and norm_type == 2.0 and parameters.__class__ is list
                and len(parameters) == len(same) and all(map(is_, parameters, same))):  # fmt: skip
            self._deferred = None
            self._norm = total
        else:
            self._leave_steady()
            self.on_clipped(parameters, args, kwargs, total)

    def _steady_before_step(self: Any, scaler: Any, optimizer: Any) -> None:
        # The stage before step() is UNSCALED (this step's unscale_ came through here) and was kept from the full step.
        if optimizer is self._steady and self._unscaled is optimizer and self._deferred is None and self._scale_calls:
            self._unscaled = None
        else:
            self._leave_steady()
            self.before_step(scaler, optimizer)

    def _steady_before_update(self: Any, scaler: Any, scale_set_by_hand: bool = False) -> None:
        found: Any = None
        for state in scaler._per_optimizer_states.values():
            for flag in state["found_inf_per_device"].values():
                found = flag if found is None else [*found, flag] if found.__class__ is list else [found, flag]
        if found is None or scale_set_by_hand or self.arm_request or scaler._scale is None:
            self._leave_steady()
            self.before_update(scaler, scale_set_by_hand)
            return
        # What _finish_step records on a plain step (the user logged no standard name: that left the steady path).
        step = self.step
        optimizers = self._optimizers
        lr = optimizers[0].param_groups[0].get("lr") if optimizers else None
        entry = (STEP, step, self._loss, found, self._norm, True, None, None, lr if lr.__class__ is float else None, None)
        append = self._append
        if append is not None and step & (FAST_RECORDS - 1):
            append(entry)
        else:
            self._append = self._record(entry)
        self.step = step + 1
        self._loss = self._norm = None
        self._scale_calls = 0
        if step + 1 >= self._plain_until:
            self._leave_steady()


def _next_multiple(step: int, every: int) -> int:
    """The first multiple of `every` after `step`."""
    return (step // every + 1) * every
