"""What the agent-overhead benchmark compares: ampwatch, TensorBoard and wandb logging from the loop."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from _step import ORIGINAL_CLIP_GRAD_NORM, Trainer, Variant


# -- conditions -----------------------------------------------------------------------------
class Condition:
    """Something that logs from the loop: `start` gives the step variant, `stop` ends it. `threads` are the
    threads it started in this process (its writer, its sender): its background CPU is theirs."""

    name = "none"
    note = ""
    threads: frozenset[threading.Thread] = frozenset()

    def start(self, trainer: Trainer) -> Variant:
        return trainer.plain

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass


class Ampwatch(Condition):
    """One run watching its own GradScaler (on the shared model and optimizer) for the whole benchmark, as a
    training run lasts: each block ends with a flush, so the block's background CPU includes delivering its
    steps. What a run costs once (init and watch, finish) is timed apart: it is not a per-step cost."""

    def __init__(
        self, name: str, server_url: str, log_loss: bool = False, disabled: bool = False, own_norm: bool = False
    ) -> None:
        self.name, self.server_url, self.log_loss, self.disabled = name, server_url, log_loss, disabled
        self.own_norm = (
            own_norm  # the loop calls a clip_grad_norm_ imported before watch(): the agent takes its own norm
        )
        self.run: Any = None
        self.scaler: Any = None
        self.run_ids: list[str] = []
        self.setup_s = self.finish_s = float("nan")

    def start(self, trainer: Trainer) -> Variant:
        import torch

        import ampwatch

        if self.run is None:
            started = time.perf_counter()
            self.scaler = torch.amp.GradScaler("cpu")
            with _env(AMPWATCH_MODE="disabled" if self.disabled else "online"), new_threads() as spawned:
                self.run = ampwatch.init(project="bench", name=f"overhead-{self.name}", url=self.server_url)
            self.threads = frozenset(spawned)
            self.run.watch(model=trainer.model, optimizer=trainer.optimizer, scaler=self.scaler)
            self.setup_s = time.perf_counter() - started
        self.scaler.load_state_dict(trainer.scaler.state_dict())  # both halves of a pair skip alike
        run = self.run
        after = (lambda step, scaler, loss, norm, scale_before: run.log({"loss": loss})) if self.log_loss else None
        return Variant(self.scaler, after, clip=ORIGINAL_CLIP_GRAD_NORM if self.own_norm else None)

    def stop(self) -> None:
        if self.run is not None and self.run._worker is not None:  # (private: the benchmark waits for the delivery)
            self.run._worker.flush(60)

    def close(self) -> None:
        if self.run is not None:
            started = time.perf_counter()
            self.run.finish()  # unhooks the scaler and delivers what is left
            self.finish_s = time.perf_counter() - started
            self.run_ids.append(self.run.id)
            self.run = None


class TensorBoard(Condition):
    name = "tensorboard"

    def __init__(self, logdir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(logdir)

    def start(self, trainer: Trainer) -> Variant:
        writer = self.writer

        def after(step: int, scaler: Any, loss: Any, norm: Any, scale_before: float) -> None:
            scale_after = scaler.get_scale()
            writer.add_scalar("loss", loss.item(), step)
            writer.add_scalar("scale", scale_before, step)
            writer.add_scalar("skipped", float(scale_after < scale_before), step)
            writer.add_scalar("grad_norm", norm.item(), step)

        return Variant(trainer.scaler, after, read_scale=True, clip=ORIGINAL_CLIP_GRAD_NORM)

    def stop(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Wandb(Condition):
    name = "wandb"
    note = "wandb's own service process is not counted in 'background'"

    def __init__(self, directory: str) -> None:
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project="ampwatch-bench", mode="offline", dir=directory)

    def start(self, trainer: Trainer) -> Variant:
        run = self.run

        def after(step: int, scaler: Any, loss: Any, norm: Any, scale_before: float) -> None:
            scale_after = scaler.get_scale()
            values = {
                "loss": loss.item(),
                "scale": scale_before,
                "skipped": float(scale_after < scale_before),
                "grad_norm": norm.item(),
            }
            run.log(values, step=step)

        return Variant(trainer.scaler, after, read_scale=True, clip=ORIGINAL_CLIP_GRAD_NORM)

    def close(self) -> None:
        self.run.finish()


@contextlib.contextmanager
def new_threads() -> Iterator[set[threading.Thread]]:
    """The threads started in this process during the block (filled in when it ends)."""
    before, started = set(threading.enumerate()), set()
    yield started
    started.update(set(threading.enumerate()) - before)


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_conditions(names: list[str], server_url: str, tmp: str) -> tuple[list[Condition], list[str]]:
    """The conditions that can run here, and notes on those that cannot."""
    conditions: list[Condition] = [Condition()]
    notes: list[str] = []
    for name in names:
        if name == "none":
            continue
        if name in ("ampwatch", "ampwatch+log", "ampwatch-off", "ampwatch-own-norm"):
            conditions.append(
                Ampwatch(
                    name,
                    server_url,
                    log_loss=name == "ampwatch+log",
                    disabled=name == "ampwatch-off",
                    own_norm=name == "ampwatch-own-norm",
                )
            )
        elif name in ("tensorboard", "wandb"):
            if importlib.util.find_spec(name) is None:
                notes.append(f"{name} row skipped: the {name} package is not installed (pip install {name})")
                continue
            try:
                with new_threads() as started:
                    condition = (
                        TensorBoard(os.path.join(tmp, "tb"))
                        if name == "tensorboard"
                        else Wandb(os.path.join(tmp, "wandb"))
                    )
                condition.threads = frozenset(started)
                conditions.append(condition)
            except Exception as error:  # a broken optional install is a note, not a failed benchmark
                notes.append(f"{name} row skipped: it failed to start ({error!r})")
        else:
            notes.append(f"unknown condition {name!r} ignored")
    return conditions, notes
