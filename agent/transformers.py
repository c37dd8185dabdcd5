"""Hugging Face Trainer integration: one callback that watches `Trainer.train()`.

    from ampwatch.transformers import AmpwatchCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[AmpwatchCallback(project="llm", name="exp-12")])

Imported only by Trainer users: `import ampwatch` never loads this module (nor transformers).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from typing import Any

from ampwatch import Run
from ampwatch import init as init_run
from ampwatch._integration import Integration, guarded

try:
    from transformers import TrainerCallback
except ImportError as error:
    raise ImportError("ampwatch.transformers needs transformers: pip install transformers") from error

__all__ = ["AmpwatchCallback"]
log = logging.getLogger("ampwatch")
NO_TRAINER = (
    "AmpwatchCallback found no Trainer calling it: the loss and the gradient norm before the clip are not recorded "
    "(no GradScaler hands them to the agent); log the loss with run.log() to see it."
)


class AmpwatchCallback(TrainerCallback):
    """Watches the Trainer's model, optimizer and Accelerate's GradScaler with `run`; without one, with a run it starts
    itself when the training begins (`init`: `ampwatch.init`'s arguments; `config` defaults to the
    `TrainingArguments`): by then the process group of a `torchrun` launch exists, so every rank reports into one run.

    Without an enabled GradScaler (bf16, fp32, fp16 on the CPU) the loss each micro-batch backpropagates, as
    `training_step` returns it (NaN and Inf included), is handed to the agent and summed over the optimizer step,
    and the gradient norm is taken after the last micro-batch's backward, before the Trainer clips.

    Every checkpoint the Trainer saves is recorded with its folder (`run.checkpoint()`, on the main process), for the
    rollback plan; and once the run is asked to stop (`run.should_stop`) the training stops after the current step
    (`control.should_training_stop`).

    With `finish=True` (the default) the run is finished when the training ends, and marked crashed when `train()`
    raises (given to `Trainer(callbacks=...)`; added later with `add_callback`, a crash that ends the process is
    still marked at exit). Pass `finish=False` to keep the run open and finish it yourself.
    """

    def __init__(self, run: Run | None = None, *, finish: bool = True, **init: Any) -> None:
        if run is not None and init:
            raise TypeError("AmpwatchCallback takes a run, or ampwatch.init()'s arguments to start one, not both")
        inspect.signature(init_run).bind(**init)  # a misspelt argument fails here, not in the training
        self.run = run
        self.finish = finish
        self._init = init
        self._own = run is None  # the callback starts (and restarts, at each train()) the run itself
        self._trainer: Any = None
        self._step_wrapper: Any = None  # what replaces the Trainer's training_step while a training runs

    # -- the Trainer's events ---------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """At the end of `Trainer.__init__`: guard `train()` so that a crash marks the run crashed."""
        guarded(self._attach, _calling_trainer(self))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Model, optimizer and the process group exist from here on; a training resumed from a checkpoint has its
        global step restored, and the run's steps continue from it."""
        guarded(self._begin, args, kwargs.get("model"), kwargs.get("optimizer"))
        if self.run is not None:
            Integration(self.run).resume_at(int(getattr(state, "global_step", 0) or 0))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A run asked to stop (an admin's "Stop run"; a critical event with `stop_on`) ends the training here."""
        if self.run is not None and self.run.should_stop:
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After the Trainer saved a checkpoint: recorded at the run's step, with the folder the Trainer wrote."""
        if self.run is not None and state.is_world_process_zero:
            guarded(_checkpoint, self.run, args, state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._release()
        if self.finish and self.run is not None:
            Integration(self.run).finish()

    # -- internals --------------------------------------------------------------------------------
    def _attach(self, trainer: Any) -> None:
        """Wrap the instance's `train` (not the class's): the run is marked crashed with what it raised."""
        if trainer is None or "train" in vars(trainer):
            return
        self._trainer = trainer
        train = trainer.train

        def guarded_train(*args: Any, **kwargs: Any) -> Any:
            try:
                return train(*args, **kwargs)
            except BaseException as exc:
                self._release()
                if self.finish and self.run is not None:
                    Integration(self.run).finish(exc)  # (a second finish of a finished run does nothing)
                raise

        # (functions take attributes; mypy's Callable type does not say so)
        guarded_train.__wrapped__ = train  # type: ignore[attr-defined]
        trainer.train = guarded_train

    def _begin(self, args: Any, model: Any, optimizer: Any) -> None:
        if self._own:
            init = dict(self._init)
            if "config" not in init:
                init["config"] = guarded(args.to_dict)
            self.run = init_run(**init)
        run = self.run
        if run is None:
            return
        trainer = self._trainer if self._trainer is not None else _calling_trainer(self)
        accelerator = getattr(trainer, "accelerator", None)
        scaler = getattr(accelerator, "scaler", None) if trainer is not None else getattr(optimizer, "scaler", None)
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        integration = Integration(run)
        if not integration.recording or (scaler is not None and scaler.is_enabled()):
            return  # the agent sees loss and norms at scale() and unscale_() by itself
        if trainer is None or accelerator is None:
            integration.config_warning(NO_TRAINER, {"check": "transformers_no_trainer"})
            log.warning("ampwatch: %s", NO_TRAINER)
            return
        self._trainer = trainer
        training_step = trainer.training_step  # (the bound method: a subclass's override included)

        def watched_training_step(*args: Any, **kwargs: Any) -> Any:
            loss = training_step(*args, **kwargs)
            integration.feed_loss(loss)
            if accelerator.sync_gradients:  # the step's last micro-batch: next come the clip and the optimizer step
                integration.take_grad_norm(optimizer)
            return loss

        # (functions take attributes; mypy's Callable type does not say so)
        watched_training_step.__wrapped__ = training_step  # type: ignore[attr-defined]
        trainer.training_step = self._step_wrapper = watched_training_step

    def _release(self) -> None:
        """Give the Trainer back its own `training_step`."""
        trainer, wrapper, self._step_wrapper = self._trainer, self._step_wrapper, None
        if wrapper is not None and vars(trainer).get("training_step") is wrapper:
            del trainer.training_step


def _checkpoint(run: Run, args: Any, state: Any) -> None:
    """The checkpoint the Trainer just saved, at the run's step, with its folder (named as the Trainer names it)."""
    folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
    run.checkpoint(path=folder if os.path.isdir(folder) else None)


def _calling_trainer(callback: AmpwatchCallback) -> Any:
    """The Trainer whose callback handler is calling `callback` now: the `self` of a frame up the stack (callbacks
    are not handed the Trainer). Looked up once or twice per `train()`, never per step."""
    frame = sys._getframe(1)
    for _ in range(12):
        # (a frame walked up stays a frame until the loop checks for None)
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        handler = getattr(owner, "callback_handler", None)
        if callback in getattr(handler, "callbacks", ()) and hasattr(owner, "training_step"):
            return owner
    return None
