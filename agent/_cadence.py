"""The cadence plan: on which steps the Recorder does more than record the step's loss, scale, norm and lr.

Per-layer gradient norms every `layer_interval` steps (with a watched model: the heatmap), a finiteness check of the
parameters every `param_interval` steps, a copy of the device's loss scale every `ANCHOR_EVERY` steps (the sender
shadows the scale from found_inf between copies), and all of them every step while the NaN-origin probe is armed.
The steps in between are plain: the Recorder plans ahead to the next due step and takes its short path until then
(see `ampwatch._step_end`). Pure arithmetic, owned by the training thread.
"""

from __future__ import annotations

from ampwatch._steps import ANCHOR_EVERY


class Cadence:
    """The intervals of one run, and which steps they make due."""

    __slots__ = ("layer_interval", "param_interval")

    def __init__(self, layer_interval: int, param_interval: int) -> None:
        self.layer_interval = layer_interval
        self.param_interval = param_interval

    def layers_due(self, step: int, probing: bool, model_watched: bool) -> bool:
        """Whether `step` takes per-layer norms."""
        return model_watched and (probing or step % self.layer_interval == 0)

    def params_due(self, step: int, probing: bool) -> bool:
        """Whether `step` checks the parameters."""
        return probing or step % self.param_interval == 0

    @staticmethod
    def anchor_due(step: int) -> bool:
        """Whether `step` copies the device's scale (besides whenever something outside update() changed it)."""
        return step % ANCHOR_EVERY == 0

    def next_due(self, step: int, probing: bool, model_watched: bool) -> int:
        """The first step after `step` that does more than the plain path: it checks the parameters, takes per-layer
        norms or anchors the scale; 0 while probing (every step does)."""
        if probing:
            return 0
        until = min(_next_multiple(step, self.param_interval), _next_multiple(step, ANCHOR_EVERY))
        if model_watched:
            until = min(until, _next_multiple(step, self.layer_interval))
        return until


def _next_multiple(step: int, every: int) -> int:
    """The first multiple of `every` after `step`."""
    return (step // every + 1) * every
