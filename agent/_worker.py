"""The background sender: one thread per run that takes the training thread's records to the server.

A pipeline of parts, each readable alone:
  buffer    `Worker.records`, a deque the training thread appends tuples to (atomic under the GIL, never
            blocks), bounded by `AMPWATCH_MAX_PENDING_RECORDS`; what does not fit is counted (`ampwatch._losses`)
  batcher   `ampwatch._batcher.Batcher`: reads the records' tensors, decodes them into series, hands host values
            to the diagnosis (events come back) and numbers the batches
  delivery  `ampwatch._outbox.Outbox`: sends batches in order through the transport, retries with backoff,
            keeps what waits in the spool (`ampwatch._spool`)
This thread wakes every `flush_interval_s` (or when woken), moves the buffer through the batcher into the
outbox, hands the records it read back for the training thread to free (see `free_read_records`), and delivers.
The training loop never waits on any of it; `flush()` and `close()` wait for the batches made so far.
"""

from __future__ import annotations

import collections
import logging
import operator
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ampwatch._batcher import Batcher
from ampwatch._losses import BUFFER_FULL, SPOOL_FULL, UNREADABLE, Losses
from ampwatch._outbox import Outbox
from ampwatch._protocol import DATA_KINDS, FLUSH, KIND
from ampwatch._settings import AgentSettings
from ampwatch._spool import Spool, default_root
from ampwatch._transport import HttpTransport, Transport

log = logging.getLogger("ampwatch")

_KIND = operator.itemgetter(KIND)
KEEP_READ = (
    8  # lists of records read by the sender, kept for the training thread to free (see `free_read_records`), at most
)
FAST_RECORDS = 1024  # step records appended without the checks of `Worker.record` in a row, at most (a power of 2)


_LIVE: weakref.WeakSet[Worker] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) inherits the deques but not the threads: it starts its own
    sender only if it records something itself."""
    for worker in list(_LIVE):
        worker._forget_thread()


os.register_at_fork(after_in_child=_after_fork_in_child)


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
        self._wake = threading.Event()
        self._absorbing = (
            threading.Lock()
        )  # records become batches under it (the sender's work; close()'s after a timeout)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._waiters: list[tuple[int, threading.Event, bool]] = []  # (last batch before, released, spool suffices)
        self.batcher = Batcher(
            rank, self.outbox, self.losses, online=self._online, max_points=settings.max_batch_points
        )
        self.read: collections.deque[list[tuple]] = (
            collections.deque()
        )  # read by the sender, to free (see free_read_records)

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

    def free_read_records(self) -> None:
        """On the training thread, every few dozen steps: free the records the sender has read. Freeing a tensor lets go
        of the GIL; on the sender each one handed the GIL to the training thread and waited to have it back (see
        bench/NOTES.md), here nobody waits."""
        read = self.read
        try:
            while read:
                read.popleft()
        except IndexError:  # (the sender let go of the oldest itself meanwhile)
            pass

    def update_environment(self, **values: Any) -> None:
        """Say more about the run than init() knew (ampwatch._layout): the run registers again with it, before its
        next batch. Training thread."""
        environment = self._run_doc["environment"]
        if any(environment.get(key) != value for key, value in values.items()):
            environment.update(values)  # (the document a forked child's outbox registers with too)
            self.outbox.register_again(self._run_doc)

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
        self.batcher.restart_in_child(self.outbox, self.losses)

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
            self.batcher.read_by = max(deadline, time.monotonic() + 1.0)
            try:
                self._absorb(entries)
            except Exception as error:
                self.losses.add(UNREADABLE, len(entries))
                log.warning(
                    "ampwatch: %d record(s) could not be read at finish (%s): lost (counted)", len(entries), error
                )
            finally:
                self.batcher.read_by = None
                self._absorbing.release()
        self.free_read_records()  # (the sender is done, or waits on the server: it frees what it reads later itself)
        self.outbox.close()
        if not delivered:
            lost = self.outbox.spill()  # to disk; what the spool cannot take is lost with the process: counted
            if lost:
                self.losses.add(SPOOL_FULL, lost)
        if self.losses.total:
            said = ", ".join(f"{reason}: {count}" for reason, count in self.losses.counts.items() if count)
            log.warning(
                "ampwatch: this run dropped %d record(s) and %d batch(es) (%s); the `dropped_records` series "
                "counts them, `dropped_records/<reason>` per reason",
                self.dropped,
                self.outbox.dropped,
                said,
            )
        spool = self.outbox.spool
        if spool is not None and delivered and not len(self.outbox):
            spool.discard()
        elif spool is not None:
            spool.close()
            log.warning(
                "ampwatch: %d batch(es) wait in %s; upload them with: ampwatch sync %s",
                len(spool.pending()),
                spool.folder,
                spool.folder.parent,
            )
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
        """Hand records this thread has read to the training thread, which frees them (see free_read_records)."""
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
        """Turn records into batches in the outbox; a flush marker waits for the batches made of what precedes it."""
        if FLUSH not in map(_KIND, entries):  # the usual case: one chunk
            self.batcher.batch(entries)
            return
        chunk: list[tuple] = []
        for entry in entries:
            if entry[0] == FLUSH:
                self.batcher.batch(chunk)
                chunk = []
                self._waiters.append((self.batcher.seq, entry[1], entry[2]))
            else:
                chunk.append(entry)
        self.batcher.batch(chunk)

    @property
    def dropped(self) -> int:
        """Records lost (buffer full, or unreadable)."""
        return self.losses[BUFFER_FULL] + self.losses[UNREADABLE]

    def _heartbeat(self) -> None:
        """An empty batch when nothing else was sent for a while: the server tells hung from dead by it."""
        due = time.monotonic() - self.batcher.last_batch_at >= self._settings.heartbeat_interval_s
        if self._online and not len(self.outbox) and due:
            self.batcher.enqueue({}, [], None, heartbeat=True)

    def _deliver(self) -> None:
        if self._online:
            self.outbox.deliver(self._settings.flush_interval_s)  # (a backlog must not keep new records waiting)
        self._release_waiters()

    def _release_waiters(self) -> None:
        """Wake the flushes whose batches are acknowledged (or, for those that accept it, spooled)."""
        if not self._waiters:
            return
        unsent = self.batcher.seq + 1  # offline: a batch is done once spooled (or counted as dropped)
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
