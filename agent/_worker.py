"""The background sender: turns records from the training thread into batches and delivers them.

The training thread only appends tuples to a deque (atomic under the GIL, never blocks). This thread
wakes every `flush_interval_s`, moves device scalars to the host in one copy, and sends batches in
order. Failures are retried with backoff; the training loop never waits on any of it.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import threading
import time
from typing import Any, Protocol

from ampwatch._settings import AgentSettings
from ampwatch._transport import Transport, encode_value

log = logging.getLogger("ampwatch")

# Record kinds appended by the training thread.
VALUES, EVENT, STATUS, FLUSH, ORIGIN = "v", "e", "s", "f", "o"


Flags = list[tuple[str, float]]  # (module, 1.0 if its output or output gradient was non-finite), in call order


class Diagnoser(Protocol):
    """Turns host values into events (see `ampwatch._diagnose.Diagnosis`)."""

    def observe(self, step: int, values: dict[str, float]) -> list[dict[str, Any]]: ...

    def origin(self, step: int, arming: int, forward: Flags, backward: Flags) -> list[dict[str, Any]]: ...


def _derived(name: str, value: float) -> float:
    """`skipped` is recorded as the raw found_inf sum: any inf found means the step was skipped."""
    return (1.0 if value > 0 else 0.0) if name == "skipped" else value


class Worker:
    """One daemon thread per run that owns all I/O."""

    def __init__(self, settings: AgentSettings, run_id: str, run_doc: dict[str, Any], rank: int) -> None:
        self._settings = settings
        self._run_path = f"/api/v1/runs/{run_id}"
        self._run_doc = run_doc
        self._rank = rank
        self._transport = Transport(settings.url, settings.token, settings.request_timeout_s)
        self.records: collections.deque[tuple] = collections.deque()
        self.diagnosis: Diagnoser | None = None
        self.dropped = 0
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._seq = 0
        self._outbox: collections.deque[tuple[int, dict[str, Any]]] = collections.deque()
        self._waiters: list[tuple[int, threading.Event]] = []
        self._registered = False
        self._retry_at = 0.0
        self._failures = 0
        self._last_batch_at = 0.0

    # -- training thread side -------------------------------------------------------------
    def record(self, entry: tuple) -> None:
        """Append a record without blocking; past the cap, count it as dropped."""
        if self._pid != os.getpid():
            self._start()
        if len(self.records) >= self._settings.max_pending_records:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("ampwatch: the record buffer is full, dropping records (counted)")
            return
        self.records.append(entry)

    def start(self) -> None:
        """Start sending now: the run registers and heartbeats before its first step."""
        if self._pid != os.getpid():
            self._start()

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything recorded so far was delivered; False on timeout."""
        done = threading.Event()
        self.record((FLUSH, done))
        self._wake.set()
        return done.wait(timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Flush, then stop the thread."""
        delivered = self.flush(timeout_s)
        self._stop = True
        self._wake.set()
        return delivered

    def _start(self) -> None:
        # A forked child (DataLoader worker) inherits the deque but not the thread: start afresh.
        self._pid = os.getpid()
        self.records.clear()
        self._thread = threading.Thread(target=self._loop, name="ampwatch-sender", daemon=True)
        self._thread.start()

    # -- sender thread side ---------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._wake.wait(self._settings.flush_interval_s)
            self._wake.clear()
            try:
                self._absorb(self._drain())
                self._heartbeat()
                self._deliver()
            except Exception:  # never let the thread die: a dead sender loses everything after
                log.exception("ampwatch: sender error")
            if self._stop and not self.records:
                return

    def _drain(self) -> list[tuple]:
        entries = []
        records = self.records
        while records:
            entries.append(records.popleft())
        return entries

    def _absorb(self, entries: list[tuple]) -> None:
        """Turn records into batches in the outbox; flush markers wait for what precedes them."""
        chunk: list[tuple] = []
        for entry in entries:
            if entry[0] == FLUSH:
                self._seal(chunk)
                chunk = []
                self._waiters.append((self._seq, entry[1]))
            else:
                chunk.append(entry)
        self._seal(chunk)
        self._release_waiters()

    def _seal(self, entries: list[tuple]) -> None:
        if not entries:
            return
        tensors: list[Any] = []
        for e in entries:
            if e[0] == VALUES and not isinstance(e[3], tuple):
                tensors.append(e[3])
            elif e[0] == ORIGIN:
                tensors.extend(t for t in (e[4], e[6]) if t is not None)
        host = _to_host(tensors)
        points: dict[str, tuple[list[int], list[Any]]] = {}
        events: list[dict[str, Any]] = []
        status = None
        count = 0
        for entry in entries:
            kind = entry[0]
            if kind == VALUES:
                _, step, names, value = entry
                values = value if isinstance(value, tuple) else [next(host) for _ in names]
                named = {n: _derived(n, float(v)) for n, v in zip(names, values)}
                for name, v in named.items():
                    steps, vals = points.setdefault(name, ([], []))
                    steps.append(step)
                    vals.append(encode_value(v))
                count += len(named)
                if self.diagnosis is not None:
                    events.extend(self.diagnosis.observe(step, named))
            elif kind == ORIGIN:
                _, step, arming, fwd_names, fwd, bwd_names, bwd = entry
                forward = [(n, next(host)) for n in fwd_names] if fwd is not None else []
                backward = [(n, next(host)) for n in bwd_names] if bwd is not None else []
                if self.diagnosis is not None:
                    events.extend(self.diagnosis.origin(step, arming, forward, backward))
            elif kind == EVENT:
                events.append(entry[2])
            elif kind == STATUS:
                status = entry[1]
            if count >= self._settings.max_batch_points:
                self._enqueue(points, events, None)
                points, events, count = {}, [], 0
        self._enqueue(points, events, status)

    def _heartbeat(self) -> None:
        """An empty batch when nothing else was sent for a while: the server tells hung from dead by it."""
        if not self._outbox and time.monotonic() - self._last_batch_at >= self._settings.heartbeat_interval_s:
            self._enqueue({}, [], None, heartbeat=True)

    def _enqueue(self, points: dict, events: list, status: str | None, heartbeat: bool = False) -> None:
        if not points and not events and status is None and not heartbeat:
            return
        self._last_batch_at = time.monotonic()
        self._seq += 1
        doc = {
            "rank": self._rank,
            "seq": self._seq,
            "points": {n: {"steps": s, "values": v} for n, (s, v) in points.items()},
            "events": events,
            "status": status,
        }
        self._outbox.append((self._seq, doc))

    def _deliver(self) -> None:
        while self._outbox and time.monotonic() >= self._retry_at:
            if not self._registered:
                if not self._attempt("PUT", self._run_path, self._run_doc):
                    return
                self._registered = True
            seq, doc = self._outbox[0]
            reply = self._transport.send("POST", self._run_path + "/batches", doc)
            if reply.status == 404:  # the server does not know the run (new database): register again
                self._registered = False
                continue
            if not reply.ok and reply.retryable:
                self._backoff(reply.retry_after_s)
                return
            if not reply.ok:
                log.error("ampwatch: batch %d rejected (%d): %s", seq, reply.status, reply.body[:500])
            self._failures = 0
            self._outbox.popleft()
            self._release_waiters()

    def _attempt(self, method: str, path: str, doc: dict[str, Any]) -> bool:
        reply = self._transport.send(method, path, doc)
        if reply.ok:
            self._failures = 0
            return True
        if reply.retryable:
            self._backoff(reply.retry_after_s)
        else:
            log.error("ampwatch: %s %s rejected (%d): %s", method, path, reply.status, reply.body[:500])
            self._backoff(None)
        return False

    def _backoff(self, retry_after_s: float | None) -> None:
        self._failures += 1
        if self._failures == 1:
            log.warning("ampwatch: server %s unreachable, will retry", self._settings.url)
        delay = min(30.0, 0.25 * 2 ** min(self._failures, 8)) * random.uniform(0.5, 1.0)
        self._retry_at = time.monotonic() + (retry_after_s if retry_after_s is not None else delay)

    def _release_waiters(self) -> None:
        pending = self._outbox[0][0] if self._outbox else self._seq + 1
        for seq, done in [w for w in self._waiters if w[0] < pending]:
            done.set()
        self._waiters = [w for w in self._waiters if w[0] >= pending]


def _to_host(tensors: list[Any]) -> Any:
    """Copy all device scalars to the host at once (off the training thread) and iterate them."""
    if not tensors:
        return iter(())
    import torch  # only reached when the user logged tensors, so torch is there

    by_device: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    flat: list[float] = [0.0] * sum(t.numel() for t in tensors)
    offsets = [0]
    for t in tensors:
        offsets.append(offsets[-1] + t.numel())
    for device, idx in by_device.items():
        values = torch.cat([tensors[i].detach().reshape(-1).float() for i in idx])
        if device.type == "cuda":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            while not copied.query():  # poll: never a blocking synchronize
                time.sleep(0.001)
            values = host
        it = iter(values.tolist())
        for i in idx:
            for j in range(offsets[i], offsets[i + 1]):
                flat[j] = next(it)
    return iter(flat)
