"""DeepSpeed integration: watch what a `DeepSpeedEngine` already knows about each optimizer step.

    import ampwatch
    from ampwatch.deepspeed import watch_engine

    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    with ampwatch.init(project="llm", name="exp-12") as run:
        watch_engine(run, engine)
        for batch in loader:
            loss = engine(batch)
            engine.backward(loss)
            engine.step()

Imported only by DeepSpeed users: `import ampwatch` never loads this module (nor DeepSpeed).
"""

from __future__ import annotations

import numbers
from typing import Any

from ampwatch import Run
from ampwatch._integration import Integration, guarded

__all__ = ["watch_engine"]


def watch_engine(run: Run, engine: Any) -> Run:
    """Record, at each optimizer step of `engine` (a `deepspeed.DeepSpeedEngine`): `loss` (the micro-batches'
    losses as `engine.backward` scales them, summed), `skipped` (1 when the engine skipped the update: an fp16
    overflow, or non-finite gradients under bf16), `grad_norm` (`get_global_grad_norm()`, where the engine computes
    it), `lr`, and `scale` (the fp16 loss scale `cur_scale`). Wraps the engine's `backward` and `step` on the
    instance; reads only values the engine already has on the host, or 0-d tensors (read later, off the training
    thread). An engine that scales with a torch GradScaler (`torch_autocast` with fp16, without ZeRO) is watched
    as any GradScaler loop instead: the agent hooks that scaler and the engine's optimizer. Never raises."""
    guarded(_watch_engine, run, engine)
    return run


def _watch_engine(run: Run, engine: Any) -> None:
    scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
    if scaler is not None and hasattr(scaler, "is_enabled") and scaler.is_enabled():
        # (its skips never reach engine.skipped_steps: the GradScaler's own step() skips, the engine is not told)
        run.watch(model=engine.module, optimizer=engine.optimizer, scaler=scaler)
    else:
        _EngineWatch(run, engine).attach()


class _EngineWatch:
    """The engine's step, told to the run."""

    def __init__(self, run: Run, engine: Any) -> None:
        self.run, self.engine = run, engine
        self.loss: Any = None  # the optimizer step's summed micro-batch losses so far (a tensor, never read here)
        self.skipped = 0

    def attach(self) -> None:
        engine = self.engine
        if not Integration(self.run).recording:
            return
        self.run.watch(model=engine.module)
        self.skipped = int(engine.skipped_steps)
        backward, step = engine.backward, engine.step

        def watched_backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
            scaled = backward(loss, *args, **kwargs)  # (divided by the accumulation steps, as the gradients are)
            guarded(self._add, scaled)
            return scaled

        def watched_step(*args: Any, **kwargs: Any) -> Any:
            boundary = guarded(engine.is_gradient_accumulation_boundary)  # (this step() updates the parameters)
            result = step(*args, **kwargs)
            if boundary:
                guarded(self._record)
            return result

        engine.backward, engine.step = watched_backward, watched_step

    def _add(self, loss: Any) -> None:
        loss = loss.detach()
        self.loss = loss if self.loss is None else self.loss + loss

    def _record(self) -> None:
        engine = self.engine
        skipped = int(engine.skipped_steps)
        values: dict[str, Any] = {"skipped": skipped - self.skipped}
        self.skipped = skipped
        if self.loss is not None:
            values["loss"], self.loss = self.loss, None
        norm = engine.get_global_grad_norm()
        if norm is not None:
            values["grad_norm"] = norm
        lr = engine.get_lr()
        if lr:
            values["lr"] = lr[0]
        if engine.fp16_enabled():  # (ZeRO's optimizers hold a cur_scale of 1 under bf16 too: no loss scaling there)
            scale = getattr(engine.optimizer, "cur_scale", None)  # (a Python number)
            if isinstance(scale, numbers.Real):
                values["scale"] = scale
        self.run.log(values, step=int(engine.global_steps) - 1)
