"""The background sender: one thread per run that takes the training thread's records to the server.

A pipeline of parts, each readable alone:
  buffer    `ampwatch._buffer.RecordBuffer`: the deque the training thread appends tuples to (never blocks),
            bounded by `AMPWATCH_MAX_PENDING_RECORDS`, what does not fit counted; and the records read, to free
  batcher   `ampwatch._batcher.Batcher`: reads the records' tensors, decodes them into series, hands host values
            to the diagnosis (events come back) and numbers the batches
  delivery  `ampwatch._outbox.Outbox`: sends batches in order through the transport, retries with backoff,
            keeps what waits in the spool (`ampwatch._spool`)
This thread wakes every `flush_interval_s` (or when woken), moves the buffer through the batcher into the
outbox, hands the records it read back for the training thread to free (`free_read_records`), and delivers.
The training loop never waits on any of it; `flush()` and `close()` wait for the batches made so far.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ampwatch._batcher import Batcher
from ampwatch._buffer import RecordBuffer
from ampwatch._guard import guarded
from ampwatch._losses import BUFFER_FULL, SPOOL_FULL, UNREADABLE, Losses
from ampwatch._outbox import Outbox
from ampwatch._protocol import FLUSH, KIND
from ampwatch._settings import AgentSettings
from ampwatch._spool import Spool, default_root
from ampwatch._transport import HttpTransport, Transport

log = logging.getLogger("ampwatch")

_KIND = operator.itemgetter(KIND)


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
        self.buffer = RecordBuffer(settings.max_pending_records, self.losses)
        self._wake = threading.Event()
        self._absorbing = (
            threading.Lock()
        )  # records become batches under it (the sender's work; close()'s after a timeout)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._waiters: list[tuple[int, threading.Event, bool]] = []  # (last batch before, released, spool suffices)
        self.on_cycle: Any = None  # called once per sender cycle, after delivery, if set (see ampwatch._stop)
        self.batcher = Batcher(
            rank, self.outbox, self.losses, online=self._online, max_points=settings.max_batch_points
        )

    # -- training thread side -------------------------------------------------------------
    def record(self, entry: tuple) -> Callable[[tuple], None] | None:
        """Start the sender if it is not running, then append a record to the buffer without blocking (see
        `RecordBuffer.append`: it may return the deque's own append, for the next step records)."""
        if self._thread is None:
            self._start()
        return self.buffer.append(entry)

    def free_read_records(self) -> None:
        """On the training thread, every few dozen steps: free the records the sender has read (see
        `RecordBuffer.free_read_records`)."""
        self.buffer.free_read_records()

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
        self.outbox.close()
        if self.outbox.spool is not None:
            self.outbox.spool.close()  # (the child's copy of the lock's file: the lock stays the parent's)
        transport = self._given_transport or HttpTransport(
            self._settings.url, self._settings.token, self._settings.request_timeout_s
        )
        self.losses = Losses()  # (the parent's losses are the parent's to report)
        self.buffer.restart_in_child(self.losses)
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
            entries = self.buffer.drain()
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
                    entries = self.buffer.drain()
                    self._absorb(entries)
                    if not self._stop:
                        self.buffer.keep_read(entries)
                    del entries
                    if not self._stop:
                        self._heartbeat()
                # Only now that the records this thread frees are freed (a tensor's release lets go of the GIL, and a
                # thread taking it back while the interpreter shuts down aborts the whole process) may finish() return.
                self._release_waiters()
                if self._stop and not self.buffer:  # (what was not delivered is in the outbox: close() spools it)
                    return
                self._deliver()
                if self.on_cycle is not None:
                    guarded(self.on_cycle)
                if self._online and self.outbox.due:  # a backlog: deliver more at once, taking in new records first
                    self._wake.set()
            except Exception:  # never let the thread die: a dead sender loses everything after
                log.exception("ampwatch: sender error")
            if self._stop and not self.buffer:
                return

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
                if self._online and self.batcher.seq < self.batcher.first_seq:  # nothing sent yet: the run registers
                    self.batcher.enqueue({}, [], None, heartbeat=True)  # with its first batch, which flush waits for
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
