"""The batcher: turns the records a chunk holds into batch documents, in order, on the sender thread.

It reads the records' tensors to the host (`ampwatch._host`), decodes step records into the standard series
(`ampwatch._steps`), hands host values to the diagnosis, which answers with events, numbers the batches and
puts them in the outbox. It owns the decoder's state (the shadowed loss scale) and the batch numbers; the
worker calls it from the sender thread, or from finish() after a timeout, under the worker's lock.
"""

from __future__ import annotations

import itertools
import operator
import time
from typing import Any, Protocol

from ampwatch import _resume
from ampwatch._guard import guarded, report, warn_once
from ampwatch._host import to_host
from ampwatch._indicator_values import decode as decode_indicators
from ampwatch._indicator_values import indicator_tensors
from ampwatch._losses import UNREADABLE, Losses
from ampwatch._outbox import Outbox
from ampwatch._protocol import EVENT, INDICATORS, KIND, ORIGIN, STATUS, STEP, STEP_KINDS, VALUES, batch_document
from ampwatch._steps import Points, StepDecoder, lean_tensors, step_tensors

STEPS_PER_PASS = 512  # step records decoded in one pass (a batch can exceed `max_batch_points` by one pass)
_KIND = operator.itemgetter(KIND)
Flags = list[tuple[str, float]]  # (module, 1.0 if its output or output gradient was non-finite), in call order


class Diagnoser(Protocol):
    """Turns host values into events (see `ampwatch._origin.Diagnosis`)."""

    def observe_columns(self, columns: dict[str, tuple[list[int], list[float]]]) -> list[dict[str, Any]]: ...

    def origin(
        self, step: int, arming: int, forward: Flags, backward: Flags, inputs: dict[int, Any] | None
    ) -> list[dict[str, Any]]: ...


class Batcher:
    """Records in, numbered batch documents out (into the outbox)."""

    def __init__(self, rank: int, outbox: Outbox, losses: Losses, *, online: bool, max_points: int) -> None:
        self.outbox = outbox
        self.diagnosis: Diagnoser | None = None
        self.read_by: float | None = None  # while finish() batches records: when reading them must have ended
        self.last_batch_at = 0.0
        self._rank = rank
        self._losses = losses
        self._online = online
        self._max_points = max_points
        self._decoder = StepDecoder()
        self._announce = True  # the first batch says the run is running (see `enqueue`)
        # Batches of a relaunch under the same run id must not look like re-sends of the first process's:
        # number them from the launch time (ms), leaving room for 1000 batches per millisecond.
        self.seq = int(time.time() * 1000) * 1000
        self.first_seq = self.seq + 1  # (this launch's first batch)
        # Written through `hold_back`, `stop_holding_back` and `refusal_said` only:
        self.hold_until: int | None = None  # this launch's points at steps up to this one are held back
        self.refusal: dict[str, Any] | None = None  # the event that says so, until a batch has carried it
        self.on_critical: Any = None  # called with each critical event batched (see ampwatch._stop), if set

    def hold_back(self, last_step: int, refusal: dict[str, Any]) -> None:
        """A relaunch that does not resume (see ampwatch._resume): hold back its points at steps up to `last_step`, an
        earlier launch's; `refusal`, the event that says so, goes out with the first batch that holds one back."""
        self.hold_until, self.refusal = last_step, refusal

    def stop_holding_back(self) -> None:
        """The launch resumes after all: its steps are numbered past the stored ones."""
        self.hold_until = self.refusal = None

    def refusal_said(self) -> None:
        """A batch carries the refusal (one queued before the reply came, see ampwatch._resume): it is said once."""
        self.refusal = None

    def restart_in_child(self, outbox: Outbox, losses: Losses) -> None:
        """In a forked child: batches numbered from its own start, into its own outbox; the run's status is the
        parent's to say."""
        self.outbox, self._losses = outbox, losses
        self.seq = int(time.time() * 1000) * 1000
        self._announce = False

    def batch(self, entries: list[tuple]) -> None:
        """Batch a chunk of records (no flush markers among them), in order."""
        if not entries:
            return
        # In order: runs of step records of one kind (lists, decoded column by column), and the other records.
        parts: list[Any] = []
        for kind, group in itertools.groupby(entries, _KIND):
            if kind in STEP_KINDS:
                run = list(group)
                parts += [run[i : i + STEPS_PER_PASS] for i in range(0, len(run), STEPS_PER_PASS)]
            else:
                parts += group
        try:
            host = to_host(_tensors(parts), self.read_by)
        except TimeoutError:
            raise
        except Exception:  # a logged tensor the sender cannot read (run.log refuses those it knows of): drop it alone
            parts = [p for p in parts if self._readable(p)]
            host = to_host(_tensors(parts), self.read_by)
        at = 0
        points: Points = {}
        events: list[dict[str, Any]] = []
        status = None
        count, step = 0, None
        decoder, diagnosis = self._decoder, self.diagnosis
        for part in parts:
            kind = part[0] if part.__class__ is tuple else STEP
            if kind == STEP:
                at = (decoder.decode if part[0][0] == STEP else decoder.decode_lean)(part, host, at, points)
                step = part[-1][1]
                count = sum(len(series[0]) for series in points.values())
            elif kind == VALUES:
                step = part[1]
                if part[3].__class__ is tuple:
                    named = list(zip(part[2], part[3]))
                else:
                    named = [(part[2][0], float(host[at]))]
                    at += 1
                for name, v in named:
                    series = points.get(name)
                    if series is None:
                        series = points[name] = ([], [])
                    series[0].append(step)
                    series[1].append(v)
                count += len(named)
            elif kind == ORIGIN:
                _, origin_step, arming, fwd_names, fwd, bwd_names, bwd, inputs = part
                forward = backward = []
                if fwd is not None:
                    forward, at = list(zip(fwd_names, host[at : at + len(fwd_names)])), at + len(fwd_names)
                if bwd is not None:
                    backward, at = list(zip(bwd_names, host[at : at + len(bwd_names)])), at + len(bwd_names)
                if diagnosis is not None:
                    events.extend(diagnosis.origin(origin_step, arming, forward, backward, inputs))
            elif kind == INDICATORS:
                at = decode_indicators(part, host, at, points)
            elif kind == EVENT:
                events.append(part[2])
            elif kind == STATUS:
                status = part[1]
            if count >= self._max_points:
                self.enqueue(points, events, None)
                points, events, count = {}, [], 0
        if step is not None:  # at the chunk's last step (the buffer was full of data records, so there is one)
            self._report_drops(points, step)
        self.enqueue(points, events, status)

    def _readable(self, part: Any) -> bool:
        """Whether a part's values can be read; if not, it is dropped (counted, and said once), and the rest of its
        chunk goes on: a run's end must never be lost with it."""
        try:
            to_host(_tensors([part]), self.read_by)
            return True
        except Exception as error:
            if part.__class__ is tuple and part[0] == VALUES:
                self._losses.add(UNREADABLE)
                warn_once(
                    "unreadable-" + part[2][0],
                    "ampwatch: a value logged as %r (step %d) cannot be read as a number (%s); dropped, "
                    "and any like it",
                    part[2][0],
                    part[1],
                    error,
                )
            else:  # a record the agent made itself: a bug of ours
                self._losses.add(UNREADABLE, len(part) if part.__class__ is list else 1)
                report(self._readable)
            return False

    def _report_drops(self, points: dict[str, tuple[list[int], list[Any]]], step: int) -> None:
        """Say on the server how much was lost, in total and per reason, as cumulative series at `step`."""
        for name, count in self._losses.unreported().items():
            points[name] = ([step], [count])

    def enqueue(self, points: dict, events: list, status: str | None, heartbeat: bool = False) -> None:
        """One batch of points (host floats, diagnosed here, in one pass over the batch) and events."""
        points = {name: series for name, series in points.items() if series[0]}  # (a pass makes the standard ones)
        if self.hold_until is not None and _resume.held_back(points, self.hold_until):
            events.extend([self.refusal] if self.refusal is not None else [])  # (said once)
            self.refusal_said()
            points = {name: series for name, series in points.items() if series[0]}
        if points and self.diagnosis is not None:
            events.extend(self.diagnosis.observe_columns(points))
        if not points and not events and status is None and not heartbeat:
            return
        if events and self.on_critical is not None:
            for event in events:
                if event.get("severity") == "critical":
                    guarded(self.on_critical, event)
        if self._announce:  # this process's first batch: running (a run id used before, a resumed run, may have ended)
            self._announce, status = False, status or "running"
        self.last_batch_at = time.monotonic()
        self.seq += 1
        self.outbox.add(self.seq, batch_document(self._rank, self.seq, points, events, status), send=self._online)


def _tensors(parts: list[Any]) -> list[Any]:
    """The tensors of a chunk's parts (runs of step records and other records), in the order they are decoded."""
    tensors: list[Any] = []
    for part in parts:
        if part.__class__ is list:
            (step_tensors if part[0][0] == STEP else lean_tensors)(part, tensors)
        elif part[0] == VALUES and part[3].__class__ is not tuple:
            tensors.append(part[3])
        elif part[0] == ORIGIN:
            tensors.extend(t for t in (part[4], part[6]) if t is not None)
        elif part[0] == INDICATORS:
            indicator_tensors(part, tensors)
    return tensors
