"""How a run ends: `finish()`, the end of a `with` block, the process's exit (atexit) and SIGTERM, and what the run
records as it ends (its crash; who stopped it). `Run` (ampwatch._run) takes these methods from `RunEnding`; the runs
not ended yet are held in `UNFINISHED`, so that one the script no longer refers to is still finished at exit."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ampwatch._guard import guarded
from ampwatch._protocol import EVENT, STATUS
from ampwatch._protocol import event as protocol_event
from ampwatch._stop import StopRequested

if TYPE_CHECKING:
    from ampwatch._run import Run
    from ampwatch._settings import AgentSettings
    from ampwatch._watch import Recorder
    from ampwatch._worker import Worker

log = logging.getLogger("ampwatch")
_Ending = TypeVar("_Ending", bound="RunEnding")
UNFINISHED: set[Run] = set()  # (held here: a run the script no longer refers to is still finished at exit)
# A forked child (os.fork, a multiprocessing worker) that exits normally runs the inherited atexit hook:
# the runs it inherited are its parent's, which trains on, so the child must not finish them.
os.register_at_fork(after_in_child=UNFINISHED.clear)


def opened(run: Run) -> None:
    """A run started: finished at exit if the script does not finish it, crashed by SIGTERM."""
    UNFINISHED.add(run)
    _install_sigterm_handler()


class RunEnding:
    """The Run's methods that end it. The attributes annotated here are the Run's (ampwatch._run)."""

    rank: int
    _finished: bool
    _settings: AgentSettings
    _recorder: Recorder
    _worker: Worker | None
    _record: Callable[[tuple], None]

    def finish(self) -> None:
        """Mark the run finished and deliver what is left (waits at most `AMPWATCH_FINISH_TIMEOUT_S`)."""
        guarded(self._finish, "finished", None)

    def __enter__(self: _Ending) -> _Ending:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if _is_failure(exc):
            guarded(self._finish, "crashed", exc)
        elif isinstance(exc, StopRequested):
            guarded(self._finish, "stopped", None)
        else:
            guarded(self._finish, "finished", None)
        return False  # the exception, if any, propagates unchanged

    def _finish(self, status: str, exc: BaseException | None) -> None:
        if self._finished:
            return
        self._finished = True
        UNFINISHED.discard(self)
        told = self._recorder.mailbox.stop
        if told is not None and status in ("finished", "stopped"):  # (a crash stays a crash)
            status = "stopped"
        try:
            self._recorder.unwatch()
            if exc is not None:
                self._record((EVENT, self._recorder.step, _crash_event(self._recorder.step, self.rank, exc)))
            if status == "stopped":
                self._record((EVENT, self._recorder.step, _stopped_event(self._recorder.step, self.rank, told or {})))
        finally:  # (the run is closed whatever went wrong above)
            self._record((STATUS, status))
            delivered = self._worker is None or self._worker.close(self._settings.finish_timeout_s)
        if not delivered and self._settings.mode == "online":  # offline runs deliver nothing, by design
            log.warning("ampwatch: could not deliver everything to %s before finish()", self._settings.url)


@atexit.register
def _finish_at_exit() -> None:
    """A script that never called finish(): finished if it ended cleanly, crashed if an exception killed it."""
    exc = getattr(sys, "last_value", None)  # set by the interpreter for an uncaught exception
    for run in list(UNFINISHED):
        guarded(run._finish, "crashed" if _is_failure(exc) else "finished", exc if _is_failure(exc) else None)


def _is_failure(exc: BaseException | None) -> bool:
    """A clean `sys.exit()` ends a run, and so does the StopRequested it was asked for; anything else escaping the
    loop, Ctrl-C included, cut it short."""
    if exc is None or isinstance(exc, StopRequested):
        return False
    return not (isinstance(exc, SystemExit) and exc.code in (0, None))


class Terminated(BaseException):
    """What a run records as its crash when the process is killed by SIGTERM (never raised)."""


_sigterm: dict[str, Any] = {"previous": None, "pid": 0}  # the handler SIGTERM had before ours; where ours is installed


def _install_sigterm_handler() -> None:
    """On the first run, from the main thread only: SIGTERM marks the open runs crashed and flushes them,
    then is handed on. A handler the user installed first is chained (and then decides the run's fate)."""
    if _sigterm["pid"] == os.getpid() or threading.current_thread() is not threading.main_thread():
        return
    if os.getpid() == 1:  # a container's init: the kernel ignores SIGTERM's default action there, so must we
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous is None or previous == signal.SIG_IGN:  # a handler outside Python (cannot be chained), or ignored
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError, RuntimeError):  # not the main interpreter, or no signals here
        return
    if previous is not _on_sigterm:  # a forked child installs again: it must not chain to itself
        _sigterm["previous"] = previous
    _sigterm["pid"] = os.getpid()


def _on_sigterm(signum: int, frame: Any) -> None:
    """Runs in the main thread between two bytecodes of the training loop."""
    previous = _sigterm["previous"]
    if callable(previous):  # the user's handler: it may checkpoint and carry on, or exit (then `with`/atexit finish)
        try:
            previous(signum, frame)
        except SystemExit as exc:  # atexit is not told the exit code: a run outside `with` learns it here
            if _is_failure(exc) and _sigterm["pid"] == os.getpid():
                for run in list(UNFINISHED):
                    guarded(run._finish, "crashed", exc)
            raise
        return
    if _sigterm["pid"] == os.getpid():  # not in a forked child: its copies of the runs are not its own
        for run in list(UNFINISHED):
            guarded(
                run._finish, "crashed", Terminated(f"the process received SIGTERM (signal {signum}) and was terminated")
            )
    # Die as the process would have without ampwatch: the default action, by the same signal.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _crash_event(step: int, rank: int, exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, Terminated):
        message = f"Terminated at step {step}: {exc} (a scheduler's preemption or time limit, or a kill)."
        details: dict[str, Any] = {"exception": "SIGTERM", "signal": "SIGTERM"}
    elif isinstance(exc, KeyboardInterrupt):
        message = f"Interrupted at step {step}: KeyboardInterrupt (Ctrl-C or SIGINT)."
        details = {"exception": "KeyboardInterrupt", "signal": "SIGINT"}
    else:
        raised = traceback.format_exception_only(type(exc), exc)[-1].strip()  # (safe on any exception: see its test)
        message = f"The training loop raised {raised}"
        details = {"exception": type(exc).__name__}
    if exc.__traceback__ is not None:
        details["traceback"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-20000:]
    return protocol_event(step, rank, "run_crashed", "critical", message[:2000], details)


def _stopped_event(step: int, rank: int, told: dict[str, Any]) -> dict[str, Any]:
    """The run ended after it was asked to stop: by whom and why, on its timeline (and for the server's record)."""
    by, reason = told.get("by") or "the user", told.get("reason")
    message = (f"Stopped at step {step}, as asked by {by}" + (f": {reason}" if reason else "."))[:2000]
    return protocol_event(
        step, rank, "run_stopped", "info", message, {"by": by, "reason": reason, "trigger": told.get("trigger")}
    )
