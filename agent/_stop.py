"""Stopping a run on request: `run.should_stop`, and `ampwatch.StopRequested` where `init(stop_on=...)` asks for it.

The sender thread learns of a stop from the server's reply to a batch (`stop`: an admin asked; `critical`: the run
has a critical event, diagnosed on any rank or by the server) or from the diagnosis of its own batch (a critical
event), and writes it to the mailbox: `stop`, what the run was told (by whom, why), and `stop_raise`, raise at the
next step's end. The training thread reads `stop_raise` once per step (one attribute of the mailbox) and, when set,
`stop_here` raises StopRequested, once. Nothing is raised unless `stop_on` names what happened.
"""

from __future__ import annotations

import logging
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

    def __init__(self, mailbox: Any, stop_on: frozenset[str]) -> None:
        self.mailbox = mailbox
        self.stop_on = stop_on
        self.critical_seen = -1  # server critical events up to this id are an earlier launch's (see `registered`)
        self.armed = False  # the raise was asked for (once)

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
            self._told("request", by, None if reason is None else str(reason))
        critical = reply.get("critical")
        if isinstance(critical, dict) and isinstance(critical.get("id"), int) and critical["id"] > self.critical_seen:
            self.critical_seen = critical["id"]
            self.critical(critical, where=f" (rank {critical.get('rank')}, told by the server)")

    def critical(self, event: dict[str, Any], where: str = "") -> None:
        """A critical event of this run's: a stop, where `stop_on` has "critical"."""
        if "critical" in self.stop_on and event.get("type") not in NOT_NUMERICS:
            message = str(event.get("message", ""))[:500]
            self._told(
                "critical", "ampwatch", f"critical {event.get('type')} at step {event.get('step')}{where}: {message}"
            )

    def _told(self, trigger: str, by: str, reason: str | None) -> None:
        """The first stop told sets `should_stop`; the first told of a trigger in `stop_on` also arms the raise (a
        request first, where only "critical" raises, then a critical event: that one raises, and says so)."""
        mailbox = self.mailbox
        told = {"trigger": trigger, "by": by, "reason": reason}
        if mailbox.stop is None:
            mailbox.stop = told
            log.warning("ampwatch: this run was asked to stop, by %s%s", by, f": {reason}" if reason else "")
        if trigger in self.stop_on and not self.armed:
            self.armed = True
            mailbox.stop = told  # (what the raise says; written before the flag the training thread reads)
            mailbox.stop_raise = True


def stop_here(rec: Any) -> None:
    """The training thread, where a step ended (its record made; see `ampwatch._steady.StepEnd._end_step`): raise
    StopRequested, once. With an enabled GradScaler the step ends inside its `update()`, before GradScaler's own: that
    update is done here first (its wrapper then does not), so the scale and the scaler's state are the step's end
    as without ampwatch, and the full hooks are back for any step the loop still runs."""
    mailbox = rec.mailbox
    mailbox.stop_raise = False
    told = mailbox.stop or {}
    scaler = rec._scaler
    if scaler is not None and scaler._enabled:
        type(scaler).update(scaler)  # (the class's own: the agent's wrappers live in the instance)
    rec.current.end_optimizer_work()  # (what the rest of the step's end would have let go)
    rec._plain_until = 0
    rec._leave_steady()
    by, reason, step = told.get("by"), told.get("reason"), rec.step - 1
    raise StopRequested(
        f"ampwatch: the run was asked to stop by {by}" + (f": {reason}" if reason else "") + f" (after step {step})",
        by=by,
        reason=reason,
        step=step,
    )
