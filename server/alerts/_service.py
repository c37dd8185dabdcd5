"""The background half of alerting, started by `create_app`'s lifespan: an evaluator thread (crashed and
stalled runs, windowed rules, clearing, reminders) and a dispatcher thread feeding a small pool of senders.
Nothing here runs on the request path, so neither a slow channel nor a slow evaluation delays ingest."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from ampwatch.server.alerts import _deliver, _evaluate, _liveness
from ampwatch.server.alerts._db import WAKE, now
from ampwatch.server.alerts._targets import scope_of
from ampwatch.server.models import AlertRule, Run
from ampwatch.server.settings import Settings

log = logging.getLogger("ampwatch.alerts")
SENDERS = 4
POLL_S = 0.5  # how often the dispatcher looks for work queued by other processes
STALE_EVERY_S = 30.0


class AlertService:
    """Owns the evaluator and dispatcher threads of one server process."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session]) -> None:
        self.settings = settings
        self.sessions = sessions
        self.scope = scope_of(settings)  # where notifications may go (AMPWATCH_ALERT_URL_SCOPE)
        self.group_wait_s = float(getattr(settings, "alert_group_wait_s", 0.0))  # AMPWATCH_ALERT_GROUP_WAIT_S
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._busy = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._pool: ThreadPoolExecutor | None = None
        self._http: httpx.Client | None = None
        # After a server outage every run looks silent: wait one timeout before calling any run crashed.
        self._crash_checks_from = now() + timedelta(seconds=settings.heartbeat_timeout_s)

    def start(self) -> None:
        """Start the background threads."""
        self._pool = ThreadPoolExecutor(max_workers=SENDERS, thread_name_prefix="ampwatch-notify")
        self._http = httpx.Client(limits=httpx.Limits(max_connections=SENDERS * 4))
        for name, target in (("ampwatch-evaluate", self._evaluate_loop), ("ampwatch-dispatch", self._dispatch_loop)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the threads; a send in flight is abandoned (another process or a restart retries it)."""
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout_s)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._http is not None:
            self._http.close()

    def after_commit(self, session: Session) -> None:
        """Session hook: a transaction that queued deliveries wakes the dispatcher at once."""
        if session.info.pop(WAKE, False):
            self._wake.set()

    # -- evaluator ------------------------------------------------------------------------
    def _evaluate_loop(self) -> None:
        while not self._stop.wait(self.settings.alert_eval_interval_s):
            _guard("evaluation", self.evaluate_once)

    def evaluate_once(self) -> None:
        """One pass: liveness, then every run with new data or open alerts."""
        stamp = now()
        with self.sessions() as session:
            if stamp >= self._crash_checks_from:
                _liveness.detect_crashed(session, self.settings, stamp)
            _liveness.detect_stalled(session, self.settings, stamp)
            session.commit()
            run_ids = _evaluate.runs_to_evaluate(session)
            rules = list(session.scalars(select(AlertRule))) if run_ids else []  # (read once a pass, not once a run)
        for run_id in run_ids:
            if self._stop.is_set():
                return
            _guard(f"evaluation of run {run_id}", functools.partial(self._evaluate_run, run_id, rules))

    def _evaluate_run(self, run_id: str, rules: list[AlertRule]) -> None:
        with self.sessions() as session:
            if not _evaluate.claim(session, run_id, now()):
                return
            try:
                _evaluate.evaluate_run(session, run_id, now(), rules)  # (and gives the lease back)
                session.commit()
            except Exception:
                # The lease goes back, and the run counts as evaluated: a failing run is not retried every pass.
                session.rollback()
                _evaluate.release(session, run_id, session.scalar(select(Run.last_seen_at).where(Run.id == run_id)))
                session.commit()
                raise

    # -- dispatcher -----------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        last_stale = 0.0
        while not self._stop.is_set():
            self._wake.wait(POLL_S)
            self._wake.clear()
            _guard("dispatch", self.dispatch_once)
            if time.monotonic() - last_stale > STALE_EVERY_S:
                last_stale = time.monotonic()
                _guard("stale deliveries", self._recover_stale)

    def dispatch_once(self) -> None:
        """Claim as many due deliveries as there are idle senders and hand them over."""
        with self._lock:
            free = SENDERS - self._busy
        if free <= 0 or self._pool is None:
            return
        with self.sessions() as session:
            claimed = _deliver.claim_due(session, stamp=now(), limit=free, group_wait_s=self.group_wait_s)
        for group in claimed:
            with self._lock:
                self._busy += 1
            self._pool.submit(self._send, group)

    def _send(self, delivery_ids: list[int]) -> None:
        try:
            _guard(
                f"deliveries {delivery_ids}",
                lambda: _deliver.attempt(
                    self.sessions,
                    delivery_ids,
                    base_url=self.settings.base_url,
                    timeout_s=self.settings.alert_delivery_timeout_s,
                    scope=self.scope,
                    http=self._http,
                ),
            )
        finally:
            with self._lock:
                self._busy -= 1
            self._wake.set()  # a sender is free: queued work may be waiting for one

    def _recover_stale(self) -> None:
        with self.sessions() as session:
            _deliver.recover_stale(session, stamp=now(), timeout_s=self.settings.alert_delivery_timeout_s)


def _guard(what: str, work: Callable[[], object]) -> None:
    try:
        work()
    except Exception:  # a background thread that dies stops alerting silently: log and go on
        log.exception("alerts: %s failed", what)
