"""`ampwatch.init()` and the `Run` it returns: the agent's whole public surface."""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import math
import os
import platform
import re
import secrets
import socket
import sys
import time
import traceback
import weakref
from types import TracebackType
from typing import Any

from ampwatch._diagnose import Diagnosis
from ampwatch._guard import guarded, warn_once
from ampwatch._settings import AgentSettings
from ampwatch._watch import Recorder
from ampwatch._worker import EVENT, STATUS, VALUES, Worker

log = logging.getLogger("ampwatch")
_UNFINISHED: "weakref.WeakSet[Run]" = weakref.WeakSet()
MAX_NAME = 200  # the server's limit on project, run and series names
MAX_STEP = 2**63


class Run:
    """One training run. Every method is safe to call from the training loop: it never raises."""

    def __init__(
        self,
        settings: AgentSettings,
        name: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        disabled = settings.mode == "disabled"  # the fallback of a failed init(): nothing here may raise
        self.rank, self.world_size = (0, 1) if disabled else _rank_and_world_size()
        self.id = secrets.token_hex(8) if disabled else _run_id(settings.project, name, self.world_size)
        self.project = str(settings.project)[:MAX_NAME]
        self.name = str(name)[:MAX_NAME] if name else f"run-{self.id[:6]}"
        self.url: str | None = f"{settings.url}/runs/{self.id}"
        self._settings = settings
        self._finished = False
        self._worker: Worker | None = None
        self._recorder = Recorder(
            self._record,
            rank=self.rank,
            layer_interval=settings.layer_norm_interval,
            param_interval=settings.param_check_interval,
        )
        if settings.mode == "disabled":
            self.url = None
            return
        doc = {
            "project": self.project,
            "name": self.name,
            "config": _jsonable(config or {}),
            "environment": _environment(self.world_size),
        }
        self._worker = Worker(settings, self.id, doc, self.rank)
        self._worker.diagnosis = Diagnosis(self._recorder, self.rank)
        self._worker.start()
        _UNFINISHED.add(self)

    def __repr__(self) -> str:
        return f"<ampwatch.Run {self.project}/{self.name} id={self.id}>"

    # -- public API -----------------------------------------------------------------------
    def watch(self, model: Any = None, optimizer: Any = None, scaler: Any = None) -> "Run":
        """Record loss, scale, skipped steps and gradient norms from now on, with no other code."""
        if self._worker is not None:  # a disabled run does not even hook: it costs nothing
            guarded(self._recorder.watch, model, optimizer, scaler)
        return self

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Record values at the current step (or `step`); 0-d tensors are read later, off this thread."""
        guarded(self._log, metrics, step)

    def finish(self) -> None:
        """Mark the run finished and deliver what is left (waits at most `AMPWATCH_FINISH_TIMEOUT_S`)."""
        guarded(self._finish, "finished", None)

    def __enter__(self) -> "Run":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if _is_failure(exc):
            guarded(self._finish, "crashed", exc)
        else:
            guarded(self._finish, "finished", None)
        return False  # the exception, if any, propagates unchanged

    # -- internals ------------------------------------------------------------------------
    def _record(self, entry: tuple) -> None:
        if self._worker is not None:
            self._worker.record(entry)

    def _log(self, metrics: dict[str, Any], step: int | None) -> None:
        step = self._recorder.step if step is None else int(step)
        if not 0 <= step < MAX_STEP:  # the server would refuse the whole batch it travels in
            warn_once("log-step", "ampwatch: steps must be in [0, 2**63), got %r; ignored", step)
            return
        names: list[str] = []
        floats: list[float] = []
        for name, value in metrics.items():
            if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
                warn_once("log-name", "ampwatch: metric names must be strings of 1-%d characters, got %r", MAX_NAME, name)
            elif isinstance(value, (int, float)):
                names.append(name)
                floats.append(float(value))
            elif getattr(value, "numel", None) is not None and value.numel() == 1:
                # A copy (asynchronous on a GPU): the tensor is read later, and accumulators change in place.
                self._record((VALUES, step, (name,), value.detach().clone()))
                self._recorder.user_logged(step, (name,))
            else:
                warn_once("log-" + name, "ampwatch: %r is not a number or a 1-element tensor; ignored", name)
        if names:
            self._record((VALUES, step, tuple(names), tuple(floats)))
            self._recorder.user_logged(step, tuple(names))

    def _finish(self, status: str, exc: BaseException | None) -> None:
        if self._finished:
            return
        self._finished = True
        _UNFINISHED.discard(self)
        self._recorder.unwatch()
        if exc is not None:
            self._record((EVENT, self._recorder.step, _crash_event(self._recorder.step, self.rank, exc)))
        self._record((STATUS, status))
        delivered = self._worker is None or self._worker.close(self._settings.finish_timeout_s)
        if not delivered and self._settings.mode == "online":  # offline runs deliver nothing, by design
            log.warning("ampwatch: could not deliver everything to %s before finish()", self._settings.url)


def init(
    project: str | None = None,
    name: str | None = None,
    *,
    url: str | None = None,
    token: str | None = None,
    config: dict[str, Any] | None = None,
) -> Run:
    """Start a run. Never raises: on any problem it logs and returns a run that records nothing."""
    try:
        return Run(AgentSettings.resolve(project=project, url=url, token=token), name, config)
    except Exception:
        log.exception("ampwatch: init() failed; this run will not be recorded")
        return Run(AgentSettings(mode="disabled", project=project or "default"), name)


@atexit.register
def _finish_at_exit() -> None:
    """A script that never called finish(): finished if it ended cleanly, crashed if an exception killed it."""
    exc = getattr(sys, "last_value", None)  # set by the interpreter for an uncaught exception
    for run in list(_UNFINISHED):
        guarded(run._finish, "crashed" if _is_failure(exc) else "finished", exc if _is_failure(exc) else None)


def _is_failure(exc: BaseException | None) -> bool:
    """Ctrl-C and a clean `sys.exit()` end a run; anything else escaping the loop crashed it."""
    if exc is None or isinstance(exc, KeyboardInterrupt):
        return False
    return not (isinstance(exc, SystemExit) and exc.code in (0, None))


def _crash_event(step: int, rank: int, exc: BaseException) -> dict[str, Any]:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "step": step,
        "rank": rank,
        "type": "run_crashed",
        "severity": "critical",
        "message": f"The training loop raised {type(exc).__name__}: {exc}"[:2000],
        "details": {"exception": type(exc).__name__, "traceback": text[-20000:]},
        "time": time.time(),
    }


def _rank_and_world_size() -> tuple[int, int]:
    """From an initialized process group (local calls, no collective), else torchrun's environment."""
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        warn_once("rank", "ampwatch: RANK / WORLD_SIZE are not integers; recording as rank 0 of 1")
        return 0, 1


def _run_id(project: str, name: str | None, world_size: int) -> str:
    """Random for one process. The ranks of one distributed launch derive the same id from what they
    share (torchrun's run id and rendezvous address), so they report into one run without talking."""
    explicit = os.environ.get("AMPWATCH_RUN_ID")
    if explicit:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", explicit):
            raise ValueError(f"AMPWATCH_RUN_ID must be 1-64 letters, digits, '-' or '_', not {explicit!r}")
        return explicit
    if world_size <= 1:
        return secrets.token_hex(8)
    shared = [project, name or "", os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("MASTER_ADDR", ""),
              os.environ.get("MASTER_PORT", "")]  # fmt: skip
    return hashlib.sha256("\0".join(shared).encode()).hexdigest()[:16]


def _environment(world_size: int) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "argv": sys.argv[:20],
        "world_size": world_size,
    }
    torch = sys.modules.get("torch")  # the user's torch, if loaded; never imported here
    if torch is not None:
        env["torch"] = getattr(torch, "__version__", "?")
        cuda = getattr(torch, "cuda", None)
        env["cuda"] = bool(cuda and cuda.is_available())
    return env


def _jsonable(value: Any) -> Any:
    """Config values that JSON cannot carry become strings; non-finite floats keep their spelling."""

    def fix(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, dict):
            return {str(k): fix(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [fix(x) for x in v]
        return v

    return json.loads(json.dumps(fix(value), default=str))
