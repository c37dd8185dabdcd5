"""The one place where the training thread and the sender thread leave each other word, besides the records.

Training thread -> sender: the records themselves go through the sender's buffer (`Worker.record`); here,
`wake()` asks the sender to read them now (a skipped step); `clipping` and `max_norm` say whether the loop clips its
gradients and to what (the diagnosis words its advice by them); `optimizers` are the watched ones (the diagnosis
asks whether an LR scheduler steps them).
Sender -> training thread: after a non-finite value, the diagnosis asks for the NaN-origin probe to be armed
(`arm_request`, for the event at step `arm_step`), and says which arming's probe named an origin
(`origin_found`); the training thread acts on them at the end of its next full step (see `ampwatch._steady`).
And `free_read_records()`, the sender's errand that the training thread runs: freeing the records the sender has read.

Each field has one writer, except `arm_request`: the sender sets it, the training thread clears it once it
acted on it (a request set again meanwhile is at worst taken one full step later). Plain attributes, read without
a lock: under the GIL each read or write of one is atomic, and none of them needs to agree with another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Mailbox:
    """What the two threads of a run tell each other (see the module's docstring for who writes what)."""

    __slots__ = (
        "arm_request",
        "arm_step",
        "origin_found",
        "clipping",
        "max_norm",
        "optimizers",
        "wake",
        "free_read_records",
    )

    def __init__(self) -> None:
        self.arm_request = False  # sender: arm the probe (the training thread clears it once handled)
        self.arm_step = -1  # sender: the step of the event the arming is for
        self.origin_found = 0  # sender: the last arming whose probe named an origin
        self.clipping = False  # training thread: the loop clips its gradients (a clip of them was seen)
        self.max_norm: float | None = None  # training thread: the clip's max_norm, where it is a number
        self.optimizers: list[Any] = []  # training thread: the watched optimizers (replaced whole at watch())
        self.wake: Callable[[], Any] | None = None  # the sender's: wakes it (never blocks)
        self.free_read_records: Callable[[], None] | None = None  # the sender's: frees the records it read
