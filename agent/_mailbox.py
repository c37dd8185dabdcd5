"""The one place where the training thread and the sender thread leave each other word, besides the records.

Training thread -> sender: the records themselves go through the sender's buffer (`Worker.record`); here,
`wake()` asks the sender to read them now (a skipped step); `clipping` and `max_norm` say whether the loop clips its
gradients and to what (the diagnosis words its advice by them); `optimizers` are the watched ones (the diagnosis
asks whether an LR scheduler steps them); `fp16_layers`, the leaf modules whose outputs were fp16 at the last
interval step (the diagnosis warns of an fp16 overflow ahead only for those).
Sender -> training thread: after a non-finite value, the diagnosis asks for the NaN-origin probe to be armed
(`arm_request`, for the event at step `arm_step`), and says which arming's probe named an origin
(`origin_found`); the training thread acts on them at the end of its next full step (see `ampwatch._step_end`).
After a stop asked of the run (see `ampwatch._stop`), `stop` says by whom and why (`run.should_stop`), `stop_at` after
which step it is due (a run of several ranks; None: at once), and `stop_raise` asks the training thread to raise
`ampwatch.StopRequested` at the end of its next step where it is due.
And `free_read_records()`, the sender's errand that the training thread runs: freeing the records the sender has read.
Both: `capture`, set at init and never after (with AMPWATCH_CAPTURE_DIR: see `ampwatch._capture`, which says which
of its fields each thread writes).

Each field has one writer, except `arm_request` and `stop_raise`: the sender sets them, the training thread clears
them once it acted on them (a request set again meanwhile is at worst taken one full step later). Plain attributes,
read without a lock: under the GIL each read or write of one is atomic, and none of them needs to agree with another.
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
        "capture",
        "fp16_layers",
        "stop",
        "stop_at",
        "stop_raise",
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
        self.capture: Any = None  # set once at init: where named input batches go (ampwatch._capture), or None
        self.fp16_layers: frozenset[str] = frozenset()  # training thread: the leaf modules whose outputs are fp16
        self.stop: dict[str, Any] | None = None  # sender: the stop the run was told of (trigger, by, reason)
        self.stop_at: int | None = None  # sender: the step the stop is due after (None: at once); written before `stop`
        self.stop_raise = False  # sender: raise StopRequested at the next step's end (the training thread clears it)
