"""What a framework integration (Lightning, Hugging Face Trainer, DeepSpeed) may ask of a run.

Integrations use this and nothing else of the agent's internals: when those change, only this module changes.
Every method is safe on the training thread: it never raises into the loop and reads nothing from the device.
"""

from __future__ import annotations

from typing import Any

from ampwatch._guard import guarded
from ampwatch._run import Run
from ampwatch._watch import _unwrap

__all__ = [
    "Integration",
    "guarded",
    "unwrap_optimizer",
]  # guarded(fn, *args): fn's result, or None (logged) if it raised


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer a wrapper (Accelerate's `AcceleratedOptimizer`, Lightning's) delegates to: the one whose
    step hooks fire, and the one `run.watch()` keeps."""
    return _unwrap(optimizer)


class Integration:
    """A framework's handle on one run: what it may record, besides `run.watch()` and `run.log()`.

    An integration feeds the agent what it cannot see by itself when no enabled GradScaler is watched: the loss
    (`feed_loss`) and the moment to take the gradient norm before a clip (`take_grad_norm`).
    """

    __slots__ = ("run",)

    def __init__(self, run: Run) -> None:
        self.run = run

    @property
    def recording(self) -> bool:
        """Whether the run records (a disabled run, one whose `init()` failed, hooks nothing and takes nothing)."""
        return self.run._worker is not None

    @property
    def step(self) -> int:
        """The optimizer step the run records at now (its own counter)."""
        return int(self.run._recorder.step)

    def config_warning(self, message: str, details: dict[str, Any]) -> None:
        """Record an `amp_config` warning event at the current step (`details["check"]` names the check)."""
        if self.recording:
            guarded(self.run._recorder.warn_config, message, details)

    def feed_loss(self, loss: Any) -> None:
        """Hand the agent the (detached or not) 1-element loss tensor of one micro-batch, as backpropagated; the
        micro-batches of one optimizer step are summed, as with `scaler.scale()`. Only without an enabled
        GradScaler: with one, the agent sees the loss itself and this would count it twice. No host read."""
        if self.recording:
            guarded(self.run._recorder.on_scale, loss)

    def watched_optimizers(self) -> list[Any]:
        """The optimizers `run.watch()` hooks (unwrapped), in the order given; the first one's steps are the run's."""
        return list(self.run._recorder.optimizers)

    def is_first_optimizer(self, optimizer: Any) -> bool:
        """Whether `optimizer` (or the one it wraps) is the first watched one, whose steps the run counts."""
        optimizers = self.run._recorder.optimizers
        return bool(optimizers) and unwrap_optimizer(optimizer) is optimizers[0]

    def take_grad_norm(self, optimizer: Any) -> None:
        """Take `optimizer`'s gradient norms now: after the last backward of the step, before a clip changes them
        (a clip that follows and covers its parameters gives its total instead). Once per step; without an enabled
        GradScaler only (with one the agent takes them at `unscale_`)."""
        if self.recording:
            guarded(self.run._recorder.on_unscaled, unwrap_optimizer(optimizer))

    def resume_at(self, step: int) -> None:
        """A training restored from a checkpoint at `step`: the run's steps continue from there, as with
        `ampwatch.init(..., resume_step=step)`; unless the user passed `resume_step`, or the run already counted a
        step."""
        run = self.run
        if self.recording and step > 0 and run._resume_step is None and run._recorder.step == 0:
            guarded(run._resume_from, step)

    def finish(self, exc: BaseException | None = None) -> None:
        """Finish the run: crashed with `exc`'s traceback (Ctrl-C too), or finished without one (or a clean
        `SystemExit`), as `with ampwatch.init()` does. A second call does nothing."""
        if exc is None:
            self.run.finish()
        else:
            self.run.__exit__(type(exc), exc, exc.__traceback__)
