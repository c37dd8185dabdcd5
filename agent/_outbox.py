"""Ordered, at-least-once delivery of batches; the server stores each (run, rank, seq) once.

A batch that can go out at once (nothing waits before it, no backoff) is sent from memory; any other,
and any the server did not take at the first attempt, is persisted to the spool, sent oldest first, retried
with backoff and jitter while the server is unreachable or overloaded, and removed once acknowledged.
(Writing every batch first would cost the sender a file write and delete per batch for the milliseconds of
its first attempt, a window in which the records not yet batched are just as exposed.)
"""

from __future__ import annotations

import collections
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from ampwatch._guard import guarded
from ampwatch._losses import REJECTED, SPOOL_FULL, SPOOL_LOST, UNENCODABLE, Losses
from ampwatch._protocol import batches_path, run_path
from ampwatch._spool import Spool
from ampwatch._transport import Response, Transport, encode

log = logging.getLogger("ampwatch")
IN_MEMORY = 64  # batches kept in memory besides the spool; the rest are read back from disk
MEMORY_ONLY_CAP = 10_000  # without a usable spool, the most batches held for retry


class Outbox:
    """The batches of one (run, rank) that the server has not acknowledged yet."""

    def __init__(
        self,
        transport: Transport,
        run_id: str,
        run_doc: dict[str, Any],
        spool: Spool | None,
        losses: Losses | None = None,
    ) -> None:
        self._transport = transport
        self.losses = losses if losses is not None else Losses()  # (shared with the run's sender, which reports them)
        self._run_path = run_path(run_id)
        self._batches_path = batches_path(run_id)
        self._run_body = encode(run_doc)
        self.spool = spool
        # (seq, body or None when only the spool holds it, whether the spool holds it)
        self._queue: collections.deque[tuple[int, bytes | None, bool]] = collections.deque()
        self._lock = threading.Lock()  # (the queue changes on the sender thread, and at close() on the caller's)
        self._registered = False
        self._register_again = False  # the training thread's: the run's document changed (see register_again)
        self.on_registered: Any = None  # called with the server's reply to the registration (a dict), if set
        self.on_reply: Any = None  # called with a batch reply that says more than stored (a stop: see ampwatch._stop)
        self.retry_at = 0.0
        self._failures = 0
        if spool is not None:
            self._queue.extend((seq, None, True) for seq in spool.pending())

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def dropped(self) -> int:
        """Batches lost, for any reason."""
        return sum(self.losses[reason] for reason in (SPOOL_FULL, REJECTED, SPOOL_LOST, UNENCODABLE))

    @property
    def refused(self) -> int:
        """Of those, the batches the server refused for good."""
        return self.losses[REJECTED]

    @property
    def first_seq(self) -> int | None:
        """The oldest unacknowledged batch."""
        return self._queue[0][0] if self._queue else None

    @property
    def first_unstored_seq(self) -> int | None:
        """The oldest unacknowledged batch that only memory holds (the spool does not)."""
        with self._lock:
            return next((seq for seq, _, stored in self._queue if not stored), None)

    def add(self, seq: int, doc: dict[str, Any], *, send: bool = True) -> None:
        """Persist a batch and queue it (`send=False`: persist only, for offline mode)."""
        try:
            body = encode(doc)
        except (TypeError, ValueError) as error:  # a bug on our side: sending it again cannot help
            self.losses.add(UNENCODABLE)
            log.error("ampwatch: batch %d could not be encoded (%s); dropped (counted)", seq, error)
            return
        with self._lock:
            at_once = send and not self._queue and time.monotonic() >= self.retry_at
            stored = not at_once and self.spool is not None and self.spool.put(seq, body)
            if not stored and (not send or len(self._queue) >= MEMORY_ONLY_CAP):
                self._drop(
                    SPOOL_FULL, "ampwatch: dropping batches that neither the spool nor memory can hold (counted)"
                )
            elif send:
                self._queue.append((seq, body if not stored or len(self._queue) < IN_MEMORY else None, stored))

    def rewrite_from(self, seq: int, rewrite: Callable[[bytes], tuple[bytes, bool]]) -> bool:
        """Rewrite the queued batches numbered `seq` or later (a relaunch's points that would overwrite a run's are
        taken out of them); whether `rewrite` changed any."""
        changed = False
        with self._lock:  # (a few batches, once: add() on another thread waits for it)
            queue = list(self._queue)
            for index, (number, body, stored) in enumerate(queue):
                body = body if body is not None or number < seq else self._load(number)
                if number < seq or body is None:
                    continue
                body, rewritten = rewrite(body)
                if rewritten:
                    changed = True
                    if stored:
                        # (the spool exists wherever a batch is marked stored: mypy cannot follow that invariant)
                        self.spool.remove(number)  # type: ignore[union-attr]
                    queue[index] = (number, body, False)  # (spilled again, rewritten, if it cannot go out now)
            self._queue = collections.deque(queue)
        return changed

    def spill(self) -> int:
        """Persist the batches only memory holds (they were to go out at once, and have not); how many still are."""
        spool = self.spool
        with self._lock:
            if spool is not None:
                queue = [
                    # (body is bytes for every batch not yet stored: the queue's invariant)
                    (seq, body, stored or spool.put(seq, body))  # type: ignore[arg-type]
                    for seq, body, stored in self._queue
                ]
                self._queue = collections.deque(queue)
            return sum(not stored for _, _, stored in self._queue)

    @property
    def due(self) -> bool:
        """Batches wait and no backoff holds them."""
        return bool(self._queue) and time.monotonic() >= self.retry_at

    def register_again(self, run_doc: dict[str, Any]) -> None:
        """The run's document changed: register it again before the next batch (training thread; the body is in
        place before the flag, which the sender reads first)."""
        self._run_body = encode(run_doc)
        self._register_again = True

    def deliver(self, budget_s: float | None = None) -> bool:
        """Send what is due, in order; False when the server could not take it (retry later). With a budget, stop
        after the batch that used it up (see `due`): the sender has records to take in meanwhile."""
        stop_at = None if budget_s is None else time.monotonic() + budget_s
        registered_now = False
        while self._queue:
            if time.monotonic() < self.retry_at:
                return False
            if self._register_again:  # (cleared before the PUT: a change meanwhile is sent by another)
                self._register_again = self._registered = False
            if not self._registered:
                if not self._send("PUT", self._run_path, self._run_body):
                    return False
                self._registered = registered_now = True
                continue  # (the reply may have rewritten batches: see rewrite_from)
            seq, body, stored = self._queue[0]
            if body is None:
                body = self._load(seq)
                if body is None:
                    self._pop()
                    continue
            reply = self._transport.send("POST", self._batches_path, body)
            if (
                reply.status == 404 and not registered_now
            ):  # the server does not know the run (a new database): register again
                self._registered = False
                continue
            if not reply.ok and (
                reply.retryable or reply.status == 404
            ):  # (404 just after registering: not this server's API)
                self._backoff(reply)
                return False
            rejected = not reply.ok  # (sending it again cannot help: counted, and a spooled one is kept as .bad)
            if rejected:
                self._drop(REJECTED, f"ampwatch: batch {seq} rejected ({reply.status}): {reply.body[:500]}", error=True)
            self._failures = 0
            self._pop()
            if not rejected and self.on_reply is not None and ('"stop"' in reply.body or '"critical"' in reply.body):
                self._replied(reply.body)
            if stored:
                # (stored batches imply a spool)
                (self.spool.set_aside if rejected else self.spool.remove)(seq)  # type: ignore[union-attr]
            if stop_at is not None and time.monotonic() >= stop_at:
                return True
        return True

    def _replied(self, body: str) -> None:
        try:
            doc = json.loads(body)
        except ValueError:
            return
        if isinstance(doc, dict):
            guarded(self.on_reply, doc)

    def _pop(self) -> None:
        with self._lock:
            self._queue.popleft()

    def close(self) -> None:
        """Let go of the server connection (a later delivery opens a new one)."""
        self._transport.close()

    def _load(self, seq: int) -> bytes | None:
        """A spooled batch; an unreadable one (a crash mid-write) is set aside so the rest still flows."""
        try:
            # (only spooled batches are loaded)
            return self.spool.load(seq)  # type: ignore[union-attr]
        except FileNotFoundError:  # `ampwatch sync` delivered it meanwhile (and removed it, as it does)
            # (only spooled batches are loaded)
            if not self.spool.folder.is_dir():  # type: ignore[union-attr]
                self._drop(
                    SPOOL_LOST, "ampwatch: the spool folder was removed: batches waiting there are lost (counted)"
                )
            return None
        except (OSError, ValueError) as error:
            self.losses.add(SPOOL_LOST)
            log.error("ampwatch: spooled batch %d is unreadable (%s); set aside as .bad", seq, error)
            # (only spooled batches are loaded)
            self.spool.set_aside(seq)  # type: ignore[union-attr]
            return None

    def _send(self, method: str, path: str, body: bytes) -> bool:
        reply = self._transport.send(method, path, body)
        if reply.ok:  # (the backoff restarts only once a batch goes through: a front may take this and not those)
            if self.on_registered is not None:
                try:
                    self.on_registered(json.loads(reply.body))
                except (ValueError, TypeError, AttributeError):  # (not the run this server knows: its links stay ours)
                    pass
            return True
        if not reply.retryable:
            hint = " (is AMPWATCH_URL the server's base URL, such as http://host:8600?)" if reply.status == 404 else ""
            log.error("ampwatch: %s %s rejected (%d): %s%s", method, path, reply.status, reply.body[:500], hint)
        self._backoff(reply)
        return False

    def _drop(self, reason: str, message: str, error: bool = False) -> None:
        """A batch is lost: counted per reason (the `dropped_records` series and finish() say so), and said once per
        reason (errors each time)."""
        first = self.losses.add(reason)
        if error:
            log.error(message)
        elif first:
            log.warning(message)

    def _backoff(self, reply: Response) -> None:
        self.spill()
        self._failures += 1
        if self._failures == 1 and reply.refused:
            log.error(
                "ampwatch: the server refused this run's data (%d: %s). It is kept on disk and retried: set "
                "AMPWATCH_TOKEN to an ingest token (`ampwatch token create --role ingest` on the server), or upload it "
                "later with `ampwatch sync --token TOKEN`",
                reply.status,
                reply.body[:300],
            )
        elif self._failures == 1:
            why = reply.body[:300] if reply.status == 0 else f"HTTP {reply.status}"
            log.warning("ampwatch: the server is unreachable or busy (%s); batches are kept and retried", why)
        delay = min(30.0, 0.25 * 2 ** min(self._failures, 8)) * random.uniform(0.5, 1.0)
        self.retry_at = time.monotonic() + (reply.retry_after_s if reply.retry_after_s is not None else delay)
