"""The background sender: turns records from the training thread into batches and delivers them.

The training thread only appends tuples to a deque (atomic under the GIL, never blocks). This thread
wakes every `flush_interval_s`, reads the records' tensors (CPU values directly, device scalars in one
non-blocking copy per device), hands the records back for the training thread to free (see `free_read`),
and sends batches in order. Failures are retried with backoff; the training loop never waits on any of it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import operator
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from ampwatch._guard import report, warn_once
from ampwatch._host import to_host
from ampwatch._losses import BUFFER_FULL, SPOOL_FULL, UNREADABLE, Losses
from ampwatch._outbox import Outbox
from ampwatch._protocol import (
    DATA_KINDS,
    EVENT,
    FLUSH,
    KIND,
    ORIGIN,
    STATUS,
    STEP,
    STEP_KINDS,
    VALUES,
    batch_document,
)
from ampwatch._settings import AgentSettings
from ampwatch._spool import Spool, default_root
from ampwatch._steps import Points, StepDecoder, lean_tensors, step_tensors
from ampwatch._transport import HttpTransport, Transport

log = logging.getLogger("ampwatch")

_KIND = operator.itemgetter(KIND)
STEPS_PER_PASS = 512  # step records decoded in one pass (a batch can exceed `max_batch_points` by one pass)
KEEP_READ = 8  # lists of records read by the sender, kept for the training thread to free (see `free_read`), at most
FAST_RECORDS = 1024  # step records appended without the checks of `Worker.record` in a row, at most (a power of 2)


Flags = list[tuple[str, float]]  # (module, 1.0 if its output or output gradient was non-finite), in call order


_LIVE: weakref.WeakSet[Worker] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) inherits the deques but not the threads: it starts its own
    sender only if it records something itself."""
    for worker in list(_LIVE):
        worker._forget_thread()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Diagnoser(Protocol):
    """Turns host values into events (see `ampwatch._origin.Diagnosis`)."""

    def observe_columns(self, columns: dict[str, tuple[list[int], list[float]]]) -> list[dict[str, Any]]: ...

    def origin(self, step: int, arming: int, forward: Flags, backward: Flags) -> list[dict[str, Any]]: ...


class Worker:
    """One daemon thread per run that owns all I/O."""

    def __init__(
        self,
        settings: AgentSettings,
        run_id: str,
        run_doc: dict[str, Any],
        rank: int,
        transport: Transport | None = None,
    ) -> None:
        self._settings = settings
        self._online = settings.mode == "online"
        self._rank = rank
        self._given_transport = transport  # (`init(transport=...)`; else HTTP to settings.url)
        transport = transport or HttpTransport(settings.url, settings.token, settings.request_timeout_s)
        registration = {"run_id": run_id, "rank": rank, "url": settings.url, "doc": run_doc}
        spool = Spool.create(default_root(), run_id, rank, registration, settings.spool_max_bytes)
        self.losses = Losses()
        self.outbox = Outbox(transport, run_id, run_doc, spool, self.losses)
        self._run_id, self._run_doc = run_id, run_doc
        self.records: collections.deque[tuple] = collections.deque()
        self._max_records = settings.max_pending_records
        self.diagnosis: Diagnoser | None = None
        self._wake = threading.Event()
        self._absorbing = (
            threading.Lock()
        )  # records become batches under it (the sender's work; close()'s after a timeout)
        self._read_by: float | None = None  # while close() batches records: when reading them must have ended
        self._stop = False
        self._thread: threading.Thread | None = None
        # Batches of a relaunch under the same run id must not look like re-sends of the first process's:
        # number them from the launch time (ms), leaving room for 1000 batches per millisecond.
        self._seq = int(time.time() * 1000) * 1000
        self._announce = True  # the first batch says the run is running (see _enqueue)
        self._waiters: list[tuple[int, threading.Event, bool]] = []  # (last batch before, released, spool suffices)
        self._last_batch_at = 0.0
        self._decoder = StepDecoder()
        self.read: collections.deque[list[tuple]] = collections.deque()  # read by the sender, to free (see free_read)

    # -- training thread side -------------------------------------------------------------
    def record(self, entry: tuple) -> Callable[[tuple], None] | None:
        """Append a record without blocking; past the cap, count a data record as dropped (flush markers,
        statuses and events are few and always kept: a run's end must never be lost). While the sender runs
        and `FAST_RECORDS` more records fit, return the buffer's own `append`: the Recorder then appends
        step records with it directly, coming back here every `FAST_RECORDS` steps."""
        if self._thread is None:
            self._start()
        records = self.records
        if len(records) >= self._max_records and entry[0] in DATA_KINDS:
            if self.losses.add(BUFFER_FULL):
                log.warning("ampwatch: the record buffer is full, dropping records (counted)")
            return None
        records.append(entry)
        return records.append if len(records) + FAST_RECORDS < self._max_records else None

    def free_read(self) -> None:
        """On the training thread, every few dozen steps: free the records the sender has read. Freeing a tensor lets go
        of the GIL; on the sender each one handed the GIL to the training thread and waited to have it back (see
        bench/NOTES.md), here nobody waits."""
        read = self.read
        try:
            while read:
                read.popleft()
        except IndexError:  # (the sender let go of the oldest itself meanwhile)
            pass

    def start(self) -> None:
        """Start sending now: the run registers and heartbeats before its first step."""
        if self._thread is None:
            self._start()
            _LIVE.add(self)

    def _forget_thread(self) -> None:
        """In a forked child: none of the parent's records, batches, connection or spool. What the child records goes
        out numbered from its own start, as a relaunch's batches are (the parent's next numbers are the parent's), and
        is not spooled (the folder and its lock are the parent's)."""
        self._thread = None
        self.records.clear()
        self.read.clear()
        self.outbox.close()
        if self.outbox.spool is not None:
            self.outbox.spool.close()  # (the child's copy of the lock's file: the lock stays the parent's)
        transport = self._given_transport or HttpTransport(
            self._settings.url, self._settings.token, self._settings.request_timeout_s
        )
        self.losses = Losses()  # (the parent's losses are the parent's to report)
        self.outbox = Outbox(transport, self._run_id, self._run_doc, None, self.losses)
        self._seq = int(time.time() * 1000) * 1000
        self._announce = False  # (the parent's run: its status is the parent's to say)

    def wake(self) -> None:
        """Read what was recorded now, not at the next flush interval (never blocks)."""
        self._wake.set()

    def flush(self, timeout_s: float, *, spooled: bool = False) -> bool:
        """Wait until everything recorded so far was delivered (`spooled`: or is kept in the spool, from where it
        is retried); False on timeout."""
        done = threading.Event()
        self.record((FLUSH, done, spooled))
        self._wake.set()
        return done.wait(timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Flush, then stop the thread; the spool stays on disk while anything in it is unacknowledged."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        flushed = self.flush(timeout_s)
        delivered = flushed and self._online
        self._stop = True
        self._wake.set()
        if flushed and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(1.0)  # its last steps must not overlap the interpreter's shutdown
        if not flushed and self._absorbing.acquire(timeout=max(0.0, deadline - time.monotonic())):
            # The sender may wait on the server for its request timeout: batch what it has not taken in yet here (values
            # on a device that has not computed them within a second more are lost, and counted).
            entries = self._drain()
            self._read_by = max(deadline, time.monotonic() + 1.0)
            try:
                self._absorb(entries)
            except Exception as error:
                self.losses.add(UNREADABLE, len(entries))
                log.warning(
                    "ampwatch: %d record(s) could not be read at finish (%s): lost (counted)", len(entries), error
                )
            finally:
                self._read_by = None
                self._absorbing.release()
        self.free_read()  # (the sender is done, or waits on the server: it frees what it reads later itself)
        self.outbox.close()
        if not delivered:
            lost = self.outbox.spill()  # to disk; what the spool cannot take is lost with the process: counted
            if lost:
                self.losses.add(SPOOL_FULL, lost)
        if self.losses.total:
            said = ", ".join(f"{reason}: {count}" for reason, count in self.losses.counts.items() if count)
            log.warning("ampwatch: this run dropped %d record(s) and %d batch(es) (%s); the `dropped_records` series "
                        "counts them, `dropped_records/<reason>` per reason", self.dropped, self.outbox.dropped, said)  # fmt: skip
        spool = self.outbox.spool
        if spool is not None and delivered and not len(self.outbox):
            spool.discard()
        elif spool is not None:
            spool.close()
            log.warning("ampwatch: %d batch(es) wait in %s; upload them with: ampwatch sync %s",
                        len(spool.pending()), spool.folder, spool.folder.parent)  # fmt: skip
        return delivered

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ampwatch-sender", daemon=True)
        self._thread.start()

    # -- sender thread side ---------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._wake.wait(self._settings.flush_interval_s)
            self._wake.clear()
            try:
                with self._absorbing:  # (and batch numbers are taken under it: see close())
                    entries = self._drain()
                    self._absorb(entries)
                    if not self._stop:
                        self._keep_read(entries)
                    del entries
                    if not self._stop:
                        self._heartbeat()
                # Only now that the records this thread frees are freed (a tensor's release lets go of the GIL, and a
                # thread taking it back while the interpreter shuts down aborts the whole process) may finish() return.
                self._release_waiters()
                if self._stop and not self.records:  # (what was not delivered is in the outbox: close() spools it)
                    return
                self._deliver()
                if self._online and self.outbox.due:  # a backlog: deliver more at once, taking in new records first
                    self._wake.set()
            except Exception:  # never let the thread die: a dead sender loses everything after
                log.exception("ampwatch: sender error")
            if self._stop and not self.records:
                return

    def _keep_read(self, entries: list[tuple]) -> None:
        """Hand records this thread has read to the training thread, which frees them (see free_read)."""
        if entries:
            if len(self.read) >= KEEP_READ:  # (it does not step: a run that only logs values)
                self.read.popleft()
            self.read.append(entries)

    def _drain(self) -> list[tuple]:
        entries = []
        records = self.records
        while records:
            entries.append(records.popleft())
        return entries

    def _absorb(self, entries: list[tuple]) -> None:
        """Turn records into batches in the outbox; flush markers wait for what precedes them."""
        if FLUSH not in map(_KIND, entries):  # the usual case: one chunk
            self._seal(entries)
            return
        chunk: list[tuple] = []
        for entry in entries:
            if entry[0] == FLUSH:
                self._seal(chunk)
                chunk = []
                self._waiters.append((self._seq, entry[1], entry[2]))
            else:
                chunk.append(entry)
        self._seal(chunk)

    def _seal(self, entries: list[tuple]) -> None:
        if not entries:
            return
        parts: list[
            Any
        ] = []  # in order: runs of step records of one kind (lists, decoded column by column), other records
        for kind, group in itertools.groupby(entries, _KIND):
            if kind in STEP_KINDS:
                run = list(group)
                parts += [run[i : i + STEPS_PER_PASS] for i in range(0, len(run), STEPS_PER_PASS)]
            else:
                parts += group
        try:
            host = to_host(_tensors(parts), self._read_by)
        except TimeoutError:
            raise
        except Exception:  # a logged tensor the sender cannot read (run.log refuses those it knows of): drop it alone
            parts = [p for p in parts if self._readable(p)]
            host = to_host(_tensors(parts), self._read_by)
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
                _, origin_step, arming, fwd_names, fwd, bwd_names, bwd = part
                forward = backward = []
                if fwd is not None:
                    forward, at = list(zip(fwd_names, host[at : at + len(fwd_names)])), at + len(fwd_names)
                if bwd is not None:
                    backward, at = list(zip(bwd_names, host[at : at + len(bwd_names)])), at + len(bwd_names)
                if diagnosis is not None:
                    events.extend(diagnosis.origin(origin_step, arming, forward, backward))
            elif kind == EVENT:
                events.append(part[2])
            elif kind == STATUS:
                status = part[1]
            if count >= self._settings.max_batch_points:
                self._enqueue(points, events, None)
                points, events, count = {}, [], 0
        if step is not None:  # at the chunk's last step (the buffer was full of data records, so there is one)
            self._report_drops(points, step)
        self._enqueue(points, events, status)

    def _readable(self, part: Any) -> bool:
        """Whether a part's values can be read; if not, it is dropped (counted, and said once), and the rest of its
        chunk goes on: a run's end must never be lost with it."""
        try:
            to_host(_tensors([part]), self._read_by)
            return True
        except Exception as error:
            if part.__class__ is tuple and part[0] == VALUES:
                self.losses.add(UNREADABLE)
                warn_once("unreadable-" + part[2][0], "ampwatch: a value logged as %r (step %d) cannot be read as a number "
                          "(%s); dropped, and any like it", part[2][0], part[1], error)  # fmt: skip
            else:  # a record the agent made itself: a bug of ours
                self.losses.add(UNREADABLE, len(part) if part.__class__ is list else 1)
                report(self._readable)
            return False

    def _report_drops(self, points: dict[str, tuple[list[int], list[Any]]], step: int) -> None:
        """Say on the server how much was lost, in total and per reason, as cumulative series at `step`."""
        for name, count in self.losses.unreported().items():
            points[name] = ([step], [count])

    @property
    def dropped(self) -> int:
        """Records lost (buffer full, or unreadable)."""
        return self.losses[BUFFER_FULL] + self.losses[UNREADABLE]

    def _heartbeat(self) -> None:
        """An empty batch when nothing else was sent for a while: the server tells hung from dead by it."""
        due = time.monotonic() - self._last_batch_at >= self._settings.heartbeat_interval_s
        if self._online and not len(self.outbox) and due:
            self._enqueue({}, [], None, heartbeat=True)

    def _enqueue(self, points: dict, events: list, status: str | None, heartbeat: bool = False) -> None:
        """One batch of points (host floats, diagnosed here, in one pass over the batch) and events."""
        points = {name: series for name, series in points.items() if series[0]}  # (a pass makes the standard ones)
        if points and self.diagnosis is not None:
            events.extend(self.diagnosis.observe_columns(points))
        if not points and not events and status is None and not heartbeat:
            return
        if self._announce:  # this process's first batch: running (a run id used before, a resumed run, may have ended)
            self._announce, status = False, status or "running"
        self._last_batch_at = time.monotonic()
        self._seq += 1
        self.outbox.add(self._seq, batch_document(self._rank, self._seq, points, events, status), send=self._online)

    def _deliver(self) -> None:
        if self._online:
            self.outbox.deliver(self._settings.flush_interval_s)  # (a backlog must not keep new records waiting)
        self._release_waiters()

    def _release_waiters(self) -> None:
        """Wake the flushes whose batches are acknowledged (or, for those that accept it, spooled)."""
        if not self._waiters:
            return
        unsent = self._seq + 1  # offline: a batch is done once spooled (or counted as dropped)
        delivered_below = kept_below = unsent
        if self._online:
            first = self.outbox.first_seq
            delivered_below = first if first is not None else unsent
            first_unstored = self.outbox.first_unstored_seq
            kept_below = first_unstored if first_unstored is not None else unsent
        waiting = []
        for waiter in self._waiters:
            seq, done, spooled = waiter
            if seq < (kept_below if spooled else delivered_below):
                done.set()
            else:
                waiting.append(waiter)
        self._waiters = waiting


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
    return tensors
