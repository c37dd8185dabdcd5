"""What the current training step has recorded so far, between its first `scaler.scale()` and its record.

Owner: the training thread. Written by the hooks that see the step (the Recorder's methods, the lean hooks of
`ampwatch._step_end`, the clip wrappers of `ampwatch._scaler`) and read by the misuse diagnosis (`ampwatch._misuse`);
the sender never sees this object, only the record built from it. The Recorder holds one for its whole life (the
lean hooks keep a reference to it), so it is emptied in place at the end of each step, never replaced.
"""

from __future__ import annotations

from typing import Any


class StepState:
    """One step's references (tensors are kept, never read: reading one would be a host-device sync).

    `loss` and `norm` stay bare tensors in the usual case and become lists only when a step has several (each object
    a record keeps alive until the sender reads it adds to the garbage collector's work on the training thread).
    """

    __slots__ = (
        "loss",
        "norm",
        "scale_calls",
        "unscaled",
        "deferred",
        "normed",
        "anchor",
        "ran",
        "skip_seen",
        "last_optimizer",
        "stage_before",
        "grad_mark",
    )

    def __init__(self) -> None:
        self.loss: Any = None  # the detached loss handed to scaler.scale(), or a list of them (several calls)
        self.norm: Any = None  # clip_grad_norm_'s total norm, or norm groups (see `add_norms` and ampwatch._steps)
        self.scale_calls = 0  # scaler.scale() calls in this step
        self.unscaled: Any = None  # the optimizer between its unscale_ and step
        self.deferred: Any = None  # the optimizer whose norm waits for clip_grad_norm_'s result
        self.normed: set[int] = set()  # ids of the optimizers whose norms this step took
        self.anchor: tuple[Any, Any] | None = None  # device copies of the scale and growth tracker, when due
        self.ran: bool | None = None  # whether the step's optimizer step ran (None: not known)
        self.skip_seen = False  # the step of one of several optimizers did not run
        # Kept across steps, for the diagnosis of an error GradScaler raises later (update() names no optimizer):
        self.last_optimizer: Any = None  # the optimizer of the last scaler.step()
        self.stage_before: Any = None  # its GradScaler stage before that step()
        self.grad_mark: Any = None  # (weakref to a gradient, its version) when a norm was taken before a clip

    def add_loss(self, loss: Any, stale: bool) -> None:
        """Sum `loss` into the step's (several scale() calls: micro-batches); `stale`: what was held is from an
        iteration the loop dropped without a step, so `loss` starts afresh."""
        held = None if stale else self.loss
        self.loss = loss if held is None else [*held, loss] if held.__class__ is list else [held, loss]

    def add_norms(self, group: tuple[list[Any], bool, Any]) -> None:
        """Add one optimizer's norms (norms, whether still multiplied by the scale, their modules or None)."""
        held = self.norm
        if held is None:
            self.norm = [group]
        elif held.__class__ is list:
            held.append(group)
        else:  # a clip's total norm, and now another optimizer's
            self.norm = [([held], False, None), group]

    def forget_norm(self, optimizer: Any) -> None:
        """The gradients changed since `optimizer`'s norm was taken (the loop dropped that iteration, or a backward
        added to them): the norm is taken again."""
        self.norm = self.unscaled = self.deferred = None
        self.normed.discard(id(optimizer))

    def end_optimizer_work(self) -> None:
        """The step's record is built: what its optimizers' hooks left goes."""
        self.anchor = self.unscaled = self.deferred = None
        self.normed.clear()

    def end(self) -> None:
        """The step's record is in the buffer: the loss and norm are let go for the next step."""
        self.loss = self.norm = None
        self.scale_calls = 0
