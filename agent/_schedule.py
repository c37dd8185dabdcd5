"""An LR scheduler stepped on the steps GradScaler skipped: the schedule then runs ahead of the optimizer.

Owns the last two steps' skipped flags and the learning rates read; `skipped` takes each step with GradScaler's
record, `check` each learning rate, and `Context.scheduler` says whether a scheduler object steps the LR at all."""

from __future__ import annotations

from ampwatch._context import Context, Event

SCHEDULE_AHEAD = 0.01  # share of the steps a scheduler may advance on skipped ones before that is a warning


class Schedule:
    """The scheduler check: said once per run."""

    def __init__(self, context: Context) -> None:
        self._context = context
        self._skipped_at: dict[int, bool] = {}  # the last two steps -> skipped after start-up calibration
        self._last_lr: float | None = None  # the learning rate of the last step read
        self._lr_from: int | None = None  # the first step whose learning rate was read
        self._ahead = 0  # of them, steps after a skip (not calibration's) at which a scheduler changed the LR
        self._reported = False

    def skipped(self, step: int, skipped: bool) -> None:
        """Whether GradScaler skipped `step` (a start-up calibration skip counts as not: it is no schedule's problem,
        whatever steps the LR, it is a handful of steps)."""
        self._skipped_at[step] = skipped
        if len(self._skipped_at) > 2:  # the last two steps are all the check reads
            del self._skipped_at[next(iter(self._skipped_at))]

    def calm(self) -> bool:
        """Whether neither of the last two steps was skipped: a batch's learning rates cannot say anything then."""
        return not any(self._skipped_at.values())

    def absorb(self, steps: list[int] | None, lr: float | None) -> None:
        """Take a calm batch at once: its `steps` with GradScaler's record (none skipped), its last learning rate."""
        if steps is not None:
            self._skipped_at = {step: False for step in steps[-2:]}
        if lr is not None:
            self._last_lr = lr

    def check(self, step: int, lr: float, out: list[Event]) -> None:
        """The learning rate `lr` iteration `step` used: an amp_config warning into `out` once the schedule has run
        ahead of the optimizer."""
        # The lr read at step k is the one iteration k used; a change from k-1 happened after iteration k-1. Only an LR
        # scheduler object is judged: a loop that computes the LR from its iteration number (nanoGPT) means to. Said
        # once the schedule has run ahead by more than SCHEDULE_AHEAD of the steps: a healthy fp16 run's occasional
        # overflow skip puts it one step ahead in hundreds or thousands (Lightning steps its schedulers on skipped
        # steps too), nothing to change.
        # (the lr is not in every step's columns: the steps are counted from the first one read)
        self._lr_from = step if self._lr_from is None else self._lr_from
        steps = step - self._lr_from + 1
        ahead = (
            self._context.scheduler
            and self._last_lr is not None
            and self._skipped_at.get(step - 1)
            and lr != self._last_lr
        )
        self._ahead += bool(ahead)
        if ahead and self._ahead > SCHEDULE_AHEAD * steps and not self._reported:
            self._reported = True
            out.append(
                self._context.event(
                    step,
                    "amp_config",
                    "warning",
                    f"The learning rate changed ({self._last_lr:.6g} → {lr:.6g}) after step {step - 1}, which "
                    "GradScaler skipped: the scheduler advances on skipped steps, so the schedule runs ahead of the "
                    f"optimizer ({self._ahead} of {steps} steps so far). Step the "
                    "scheduler only when the optimizer stepped.",
                    {"lr_before": self._last_lr, "lr_after": lr, "steps_ahead": self._ahead},
                )
            )
        self._last_lr = lr
