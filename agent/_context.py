"""What the analyzer's parts (`_trends`, `_skips`, `_nonfinite`, `_schedule`) are given and do not own: the
thresholds, the event maker, and the facts of the run and of the step being judged, in one `Context` that the
Analyzer (`ampwatch._diagnose`) makes and hands each part. Each field has one writer, named beside it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Event = dict[str, Any]
Series = tuple[list[int], list[float]]  # (steps, values) of one series, as a batch holds them
Columns = dict[str, Series]  # series name -> its steps and values
EventMaker = Callable[[int, str, str, str, dict[str, Any]], Event]  # (step, type, severity, message, details)


@dataclass(frozen=True)
class Thresholds:
    """When a pattern becomes an event: one threshold per failure signature, each saying what it counts."""

    scale_floor: float = 1.0  # PyTorch's docs: a scale below 1 means something is wrong
    collapse_streak: int = 10  # consecutive skips that are a collapse whatever the scale
    warn_streak: int = 3  # consecutive skips after calibration worth a warning
    spike_factor: float = 10.0  # grad norm this many times its rolling 90th percentile (see Trends._spike)
    loss_spike_factor: float = 5.0
    spike_steps: int = 5  # steps in a row at the factor times the median that are a spike too (a steady divergence)
    window: int = 200  # rolling median window (steps)
    warmup: int = 20  # finite values needed before spikes are judged
    calibration_steps: int = 50  # skips before this step (outside a collapse) are start-up calibration


@dataclass
class Context:
    """Read by every part of the analyzer; written only where each field says."""

    thresholds: Thresholds  # fixed
    event: EventMaker  # fixed: the Analyzer's `event`, which every part's events go through
    scaled: bool = False  # the Analyzer: a GradScaler record (a step's skipped flag) was seen, this run has a scaler
    lr: float | None = None  # the Analyzer: the learning rate of the step being judged (the last one recorded)
    origin: tuple[str, str] | None = None  # the Analyzer's `event`: (module, phase) of the last NaN origin named
    # From the training thread, through the mailbox, written by `ampwatch._origin.Diagnosis` before each batch:
    clipping: bool = False  # the loop calls clip_grad_norm_
    max_norm: float | None = None  # and the max_norm it passes, where that is a number
    scheduler: bool = False  # an LR scheduler object wraps a watched optimizer's step
