"""Stopping a run on request: `run.should_stop`, and `ampwatch.StopRequested` where `init(stop_on=...)` asks for it.

The sender thread learns of a stop from the server's reply to a batch (`stop`: an admin asked; `critical`: the run
has a critical event, diagnosed on any rank or by the server) or from the diagnosis of its own batch (a critical
event), and writes it to the mailbox: `stop`, what the run was told (by whom, why), `stop_at`, the step after which
it is due (None: at once), and `stop_raise`, raise at the next step's end where it is due. The training thread reads
`stop_raise` once per step (one attribute of the mailbox) and, when set and due, `stop_here` raises StopRequested,
once. Nothing is raised unless `stop_on` names what happened.

A stop asked of a run of several ranks comes with the step every rank stops after (`at_step`, fixed by the server):
ranks that stopped at different steps would leave the others waiting in their next collective. A rank that learns it
only after running past it (two steps or more: the step after it then ran whole, so its collectives saw every rank
there, and no rank stopped at it) waits for the later step the server fixes once a batch reports a step past it; if
none comes within `late_wait_s`, it stops at once and says so. A stop on a critical event is due at once on a single
rank; in a run of several ranks it waits for the step the server fixes in the same way when the event reaches it
(`critical.at_step` of the reply to the batch that carried it, or to any rank's batch after it): a rank's own
critical event whose step no reply names within `late_wait_s` (a server out of reach) stops it at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ampwatch._guard import warn_once

log = logging.getLogger("ampwatch")
TRIGGERS = ("request", "critical")
NOT_NUMERICS = ("run_crashed", "run_stalled", "run_stopped", "checkpoint")  # no reason to stop a run that lives


class StopRequested(BaseException):
    """Raised at a step's end, from the GradScaler's `update()` (or the optimizer's `step()` without one), when the run
    was asked to stop and `ampwatch.init(stop_on=...)` asked for this: the step's parameter update and the
    scaler's update are complete. A BaseException, as KeyboardInterrupt is, so that a loop's `except Exception`
    does not swallow it. `by`, `reason` and `step` say who stopped the run, why, and after which step."""

    def __init__(self, message: str, *, by: str | None = None, reason: str | None = None, step: int = -1) -> None:
        super().__init__(message)
        self.by, self.reason, self.step = by, reason, step


def triggers(stop_on: Any) -> frozenset[str]:
    """`init(stop_on=...)` as a set of triggers: "request", "critical", a sequence of them, or None (none)."""
    if stop_on is None:
        return frozenset()
    asked = (stop_on,) if isinstance(stop_on, str) else tuple(stop_on)
    kept = frozenset(t for t in asked if t in TRIGGERS)
    if len(kept) != len(set(asked)):
        warn_once(
            "stop-on", "ampwatch: stop_on takes 'request' and/or 'critical', got %r; the rest is ignored", stop_on
        )
    return kept


class Stopper:
    """The sender thread's side: what it learned, to the mailbox (the only writer of `stop`, and of `stop_raise`
    but for the training thread's clearing it once raised)."""

    def __init__(
        self,
        mailbox: Any,
        stop_on: frozenset[str],
        steps: Callable[[], int] = lambda: 0,
        late_wait_s: float = 10.0,
        several: bool = False,
    ) -> None:
        self.mailbox = mailbox
        self.stop_on = stop_on
        self.steps = steps  # the training thread's steps done (the agent's next step), read from the sender
        self.late_wait_s = late_wait_s
        self.several = several  # a run of several ranks: a stop waits for the step the server fixes
        self.critical_seen = -1  # server critical events up to this id are an earlier launch's (see `registered`)
        self.armed = False  # the raise was asked for (once)
        self.late_since: float | None = None  # when this rank learned a stop's step after it had run past it
        self.critical_reason: str | None = None  # the first critical event's, once one stops this rank
        self.critical_since: float | None = None  # when this rank's own critical event began to wait for its step

    def registered(self, reply: dict[str, Any]) -> None:
        """The registration reply: the latest critical event an earlier launch under this run id left is not ours."""
        seen = reply.get("critical_id")
        if isinstance(seen, int):
            self.critical_seen = max(self.critical_seen, seen)

    def replied(self, reply: dict[str, Any]) -> None:
        """A batch reply: a stop an admin asked for, or a critical event of the run's."""
        stop = reply.get("stop")
        if isinstance(stop, dict):
            by = str(stop.get("by") or "an admin")
            reason = stop.get("reason")
            self._stop_at("request", by, None if reason is None else str(reason), _step(stop.get("at_step")))
        critical = reply.get("critical")
        if isinstance(critical, dict) and isinstance(critical.get("id"), int):
            at = _step(critical.get("at_step"))
            if critical["id"] > self.critical_seen:
                self.critical_seen = critical["id"]
                self.critical(critical, where=f" (rank {critical.get('rank')}, told by the server)", at=at, told=True)
            elif self.critical_reason is not None:  # (the same event: its step, maybe moved later)
                self._stop_at("critical", "ampwatch", self.critical_reason, at)

    def critical(self, event: dict[str, Any], where: str = "", at: int | None = None, told: bool = False) -> None:
        """A critical event of this run's (this rank's own, or `told` by the server, with the step every rank stops
        after, `at`): a stop, where `stop_on` has "critical"."""
        if "critical" not in self.stop_on or event.get("type") in NOT_NUMERICS:
            return
        if self.critical_reason is None:
            message = str(event.get("message", ""))[:500]
            self.critical_reason = f"critical {event.get('type')} at step {event.get('step')}{where}: {message}"
        if self.several and not told:  # (the reply to the batch carrying it names the step: see `waited`)
            self.critical_since = self.critical_since or time.monotonic()
            return
        self._stop_at("critical", "ampwatch", self.critical_reason, at)

    def waited(self) -> None:
        """Once per sender cycle: this rank's own critical event, whose step no reply named within `late_wait_s` (a
        server out of reach, or one that fixes none), stops it at once."""
        since = self.critical_since
        if since is None or self.critical_reason is None or time.monotonic() - since < self.late_wait_s:
            return
        self.critical_since = None
        told = self.mailbox.stop
        if told is None or told["trigger"] != "critical":
            log.warning(
                "ampwatch: no reply named the step every rank stops after on a critical event within %.0f s: this "
                "rank stops now, and other ranks may wait for it in their next collective",
                self.late_wait_s,
            )
            self._told("critical", "ampwatch", self.critical_reason)

    def _stop_at(self, trigger: str, by: str, reason: str | None, at: int | None) -> None:
        """A stop (asked for, or on a critical event); `at`: the step every rank of the run stops after (a run of
        several ranks)."""
        mailbox = self.mailbox
        told = mailbox.stop
        if told is not None and told["trigger"] == trigger:  # (told before: only a later step may change it)
            if at is not None and mailbox.stop_at is not None and at > mailbox.stop_at >= self.steps():
                mailbox.stop_at = at  # (not due yet, and the ranks all passed the step before: see the docstring)
            return
        done = self.steps()
        if at is not None and done > at + 1:  # (ran past it: so did every rank, and the server fixes a later one)
            now = time.monotonic()
            if self.late_since is None:
                self.late_since = now
                log.warning(
                    "ampwatch: this rank learned of the stop after step %d, which every rank was to stop after, at "
                    "step %d: waiting for the server to fix a later step",
                    at,
                    done - 1,
                )
            if now - self.late_since < self.late_wait_s:
                return
            log.warning(
                "ampwatch: the server fixed no later step to stop after within %.0f s: this rank stops now, and "
                "other ranks may wait for it in their next collective",
                self.late_wait_s,
            )
            at = None
        self._told(trigger, by, reason, at)

    def _told(self, trigger: str, by: str, reason: str | None, at: int | None = None) -> None:
        """The first stop told sets `should_stop` (due after step `at`, or at once); the first told of a trigger in
        `stop_on` also arms the raise (a request first, where only "critical" raises, then a critical event: that one
        raises, and says so)."""
        mailbox = self.mailbox
        told = {"trigger": trigger, "by": by, "reason": reason}
        if trigger == "critical":
            self.critical_since = None  # (told: nothing left to wait for)
        if mailbox.stop is None:
            mailbox.stop_at = at  # (written before `stop`, which the training thread reads first)
            mailbox.stop = told
            after = f" (every rank stops after step {at})" if at is not None else ""
            log.warning("ampwatch: this run was asked to stop, by %s%s%s", by, f": {reason}" if reason else "", after)
        if trigger in self.stop_on and not self.armed:
            self.armed = True
            mailbox.stop_at = at
            mailbox.stop = told  # (what the raise says; written before the flag the training thread reads)
            mailbox.stop_raise = True


def _step(at: Any) -> int | None:
    return at if at.__class__ is int else None


def due(mailbox: Any, done: int) -> bool:
    """Whether the stop told is due once `done` steps ran (steps 0 to done - 1): `run.should_stop`."""
    if mailbox.stop is None:  # (read before `stop_at`, which the sender writes first)
        return False
    at = mailbox.stop_at
    return at is None or done > at


def stop_here(rec: Any) -> None:
    """The training thread, where a step ended (its record made; see `ampwatch._step_end.StepEnd._end_step`): raise
    StopRequested, once. With an enabled GradScaler the step ends inside its `update()`, before GradScaler's own: that
    update is done here first (its wrapper then does not), so the scale and the scaler's state are the step's end
    as without ampwatch, and the full hooks are back for any step the loop still runs. Not before the step the stop
    is due after (`mailbox.stop_at`): the flag stays set until then."""
    mailbox = rec.mailbox
    at = mailbox.stop_at
    if at is not None and rec.step <= at:
        return
    mailbox.stop_raise = False
    told = mailbox.stop or {}
    scaler = rec.scaler
    if scaler is not None and scaler._enabled:
        type(scaler).update(scaler)  # (the class's own: the agent's wrappers live in the instance)
    rec.current.end_optimizer_work()  # (what the rest of the step's end would have let go)
    rec.end_plan()
    by, reason, step = told.get("by"), told.get("reason"), rec.step - 1
    if at is not None and step > at:
        log.warning(
            "ampwatch: this rank stops after step %d, not after step %d as the other ranks: it learned late", step, at
        )
    raise StopRequested(
        f"ampwatch: the run was asked to stop by {by}" + (f": {reason}" if reason else "") + f" (after step {step})",
        by=by,
        reason=reason,
        step=step,
    )
