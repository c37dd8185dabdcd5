"""PyTorch Lightning integration: one callback that watches a `Trainer.fit`.

    import ampwatch
    from ampwatch.lightning import AmpwatchCallback

    trainer = lightning.Trainer(..., callbacks=[AmpwatchCallback(project="llm", name="exp-12")])

or with a run started before (`AmpwatchCallback(run)`), where Lightning starts no processes of its own (one device,
or a launch by torchrun).

Imported only by Lightning users: `import ampwatch` never loads this module (nor Lightning).
Works with the `lightning` package and with the older `pytorch_lightning` one.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from ampwatch import Run
from ampwatch import init as init_run
from ampwatch._integration import Integration, guarded

try:
    from lightning.pytorch import Callback
except ImportError:
    try:
        # (the older package's Callback stands in for the newer one's)
        from pytorch_lightning import Callback  # type: ignore[assignment]
    except ImportError as error:
        raise ImportError("ampwatch.lightning needs Lightning: pip install lightning") from error

__all__ = ["AmpwatchCallback"]
log = logging.getLogger("ampwatch")
SPLIT = (
    "The run was started before Lightning started its {world} processes (strategy ddp launched by Lightning), so "
    "each of them reports as rank 0 into a run of its own. Let the callback start it when the fit sets up, once the "
    "processes know their ranks: AmpwatchCallback(project=..., name=...) instead of "
    "AmpwatchCallback(ampwatch.init(...))."
)


class AmpwatchCallback(Callback):
    """Watches the fit's module, optimizers and its precision plugin's GradScaler with `run`; without one, with a run it
    starts itself when the fit sets up (`init`: `ampwatch.init`'s arguments): by then Lightning's DDP processes know
    their ranks, so they report into one run.

    With `finish=True` (the default) the run is finished when the fit ends, and marked crashed when it
    raises; pass `finish=False` to keep it open (several fits, or logging after the fit) and finish it yourself.

    Every checkpoint the trainer saves (`ModelCheckpoint`, `trainer.save_checkpoint`) is recorded with its path
    (`run.checkpoint()`, on global rank 0), for the rollback plan; and once the run is asked to stop
    (`run.should_stop`) the fit stops after the current batch (`trainer.should_stop`).
    """

    def __init__(self, run: Run | None = None, *, finish: bool = True, **init: Any) -> None:
        super().__init__()
        if run is not None and init:
            raise TypeError("AmpwatchCallback takes a run, or ampwatch.init()'s arguments to start one, not both")
        inspect.signature(init_run).bind(**init)  # a misspelt argument fails here, not in the fit
        self.run = run
        self.finish = finish
        self._init = init
        self._feed = False  # True when the agent cannot see loss and norms by itself: no enabled GradScaler
        self._feed_loss = False  # and the fit has one optimizer (with several, which backward is whose it cannot tell)
        self._integration: Integration | None = None  # (set with _feed)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """After Lightning's strategy has set up its processes (and their process group)."""
        guarded(self._record_checkpoints, trainer)
        if self.run is None:
            self.run = init_run(**self._init)
        elif (self.run.world_size, self.run.rank) != (trainer.world_size, trainer.global_rank) and Integration(
            self.run
        ).recording:
            message = SPLIT.format(world=trainer.world_size)
            log.warning("ampwatch: %s", message)
            Integration(self.run).config_warning(
                message, {"check": "run_before_ddp", "global_rank": trainer.global_rank}
            )

    def _record_checkpoints(self, trainer: Any) -> None:
        """Wrap the trainer's own `save_checkpoint` (the instance's, once): a checkpoint is recorded once its file is
        written, with the path it was written to (Lightning's `on_save_checkpoint` comes before, without it)."""
        if "save_checkpoint" in vars(trainer):
            return
        save = trainer.save_checkpoint

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            result = save(*args, **kwargs)
            if self.run is not None and trainer.is_global_zero:
                path = args[0] if args else kwargs.get("filepath")
                self.run.checkpoint(path=None if path is None else str(path))
            return result

        # (functions take attributes; mypy's Callable type does not say so)
        save_checkpoint.__wrapped__ = save  # type: ignore[attr-defined]
        trainer.save_checkpoint = save_checkpoint

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """A run asked to stop (an admin's "Stop run"; a critical event with `stop_on`) ends the fit after this
        batch."""
        if self.run is not None and self.run.should_stop:
            trainer.should_stop = True

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Optimizers and the precision plugin exist from here on (not yet in `setup`)."""
        guarded(self._watch, trainer, pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """A fit resumed from a checkpoint (`ckpt_path`) continues the run's steps from its restored global step, as
        `ampwatch.init(..., resume_step=)` does (with one optimizer, whose steps the global step counts)."""
        guarded(self._resume, trainer)

    def _resume(self, trainer: Any) -> None:
        if trainer.ckpt_path and len(trainer.optimizers) == 1 and self.run is not None:
            Integration(self.run).resume_at(trainer.global_step)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        """Without a scaler the agent cannot see the loss: hand it the one Lightning backpropagates."""
        if self._feed_loss and self._integration is not None:
            self._integration.feed_loss(loss)  # summed over accumulated micro-batches, as with a scaler

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """After the closure's backward, before Lightning clips: the gradient norm as the model made it."""
        # (with a scaler the norm is taken at unscale_, or in a fused step; steps are the first optimizer's steps)
        integration = self._integration
        if self._feed and integration is not None and integration.is_first_optimizer(optimizer):
            integration.take_grad_norm(optimizer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.finish and self.run is not None:
            self.run.finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.finish and self.run is not None:  # crashed, with the traceback (Ctrl-C too), as `with ampwatch.init()`
            Integration(self.run).finish(exception)

    def _watch(self, trainer: Any, pl_module: Any) -> None:
        run = self.run
        if run is None:  # (setup() starts it: a fit always runs setup first)
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._integration = Integration(run)
        recording = self._integration.recording  # a disabled run hooks nothing and is fed nothing
        self._feed = recording and not (scaler is not None and scaler.is_enabled())
        self._feed_loss = self._feed and len(trainer.optimizers) == 1  # (with several: the README asks to log it)
        run.watch(model=pl_module, optimizer=list(trainer.optimizers) or None, scaler=scaler)
