"""`ampwatch.init()` and the `Run` it returns: the agent's whole public surface (how a run ends: ampwatch._ending)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import math
import numbers
import os
import platform
import re
import secrets
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ampwatch import _ending, _layout, _resume
from ampwatch._capture import Capture
from ampwatch._ending import RunEnding
from ampwatch._guard import guarded, warn_once
from ampwatch._origin import Diagnosis
from ampwatch._protocol import EVENT, MAX_NAME, MAX_STEP, VALUES
from ampwatch._protocol import event as protocol_event
from ampwatch._settings import AgentSettings
from ampwatch._stop import Stopper, due, triggers
from ampwatch._transport import Transport
from ampwatch._watch import Recorder
from ampwatch._worker import Worker

log = logging.getLogger("ampwatch")
_LAUNCHES = itertools.count()  # init() calls of a distributed process: a sweep's runs get ids of their own


class Run(RunEnding):
    """One training run. Every method is safe to call from the training loop: it never raises."""

    def __init__(
        self,
        settings: AgentSettings,
        name: str | None = None,
        config: Any = None,
        transport: Transport | None = None,
        resume_step: int | None = None,
        stop_on: Any = None,
    ) -> None:
        disabled = settings.mode == "disabled"  # the fallback of a failed init(): nothing here may raise
        self.rank, self.world_size = (0, 1) if disabled else _rank_and_world_size()
        self.id = secrets.token_hex(8) if disabled else _run_id(settings.project, name, self.world_size)
        self.project = str(settings.project)[:MAX_NAME].replace("\x00", "\ufffd")  # (the server refuses NUL in names)
        self.name = str(name)[:MAX_NAME].replace("\x00", "\ufffd") if name else f"run-{self.id[:6]}"
        self.url: str | None = f"{settings.url}/runs/{self.id}"
        self._settings = settings
        self._finished = False
        self._worker: Worker | None = None
        if not disabled:
            doc = {
                "project": self.project,
                "name": self.name,
                "config": _jsonable(_config_dict(config)),
                "environment": _environment(self.world_size, settings.flush_interval_s),
            }
            self._worker = Worker(settings, self.id, doc, self.rank, transport)
        self._recorder = Recorder(
            self._worker.record if self._worker is not None else _discard,  # per step: no hop through the Run
            rank=self.rank,
            layer_interval=settings.layer_norm_interval,
            param_interval=settings.param_check_interval,
        )
        if self._worker is None:
            self.url = None
            return
        self._relaunch_checked = False  # (see _registered)
        self._worker.outbox.on_registered = self._registered
        mailbox = self._recorder.mailbox
        recorder = self._recorder
        self._stopper = Stopper(
            mailbox,
            triggers(stop_on),
            lambda: recorder.step,
            late_wait_s=3 * settings.flush_interval_s + 5.0,
            several=self.world_size > 1,
        )
        self._worker.outbox.on_reply = self._stopper.replied
        self._worker.on_cycle = self._stopper.waited
        self._worker.batcher.on_critical = self._stopper.critical
        mailbox.wake, mailbox.free_read_records = self._worker.wake, self._worker.free_read_records
        self._worker.batcher.diagnosis = Diagnosis(mailbox, self.rank)  # (it writes the probe's requests there)
        mailbox.capture = Capture.of(settings, self.id, self.rank)  # (None unless AMPWATCH_CAPTURE_DIR is set)
        self._resume_step = None if resume_step is None else int(resume_step)  # (kept even where it is no step)
        if self._resume_step is not None:
            self._resume_from(self._resume_step)
        self._worker.start()
        _ending.opened(self)

    def __repr__(self) -> str:
        return f"<ampwatch.Run {self.project}/{self.name} id={self.id}>"

    # -- public API -----------------------------------------------------------------------
    def watch(self, model: Any = None, optimizer: Any = None, scaler: Any = None) -> Run:
        """Record loss, scale, skipped steps and gradient norms from now on, with no other code."""
        if self._finished:
            warn_once(
                "watch-finished", "ampwatch: watch() after finish() is ignored: start a new run with ampwatch.init()"
            )
        elif self._worker is not None:  # a disabled run does not even hook: it costs nothing
            watched = guarded(_watchable, model, optimizer, scaler) or (None, None, None)
            guarded(self._recorder.watch, *watched)
            guarded(_layout.report, self._worker, watched[0])  # (DDP: the server compares the ranks' parameters)
        return self

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Record values at the current step (or `step`); 0-d tensors are read later, off this thread."""
        guarded(self._log, metrics, step)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Block until everything recorded so far is delivered to the server or kept in the spool on disk (from where
        it is retried); True once it is, False if that takes longer than `timeout_s`. Never raises. Not needed before
        `finish()`, which flushes; a disabled or finished run has nothing left to flush (True). A run that has recorded
        nothing yet waits for its first batch, which registers it: once flushed, the server knows the run (to stop it,
        say), unless it could not be reached and the batch waits in the spool."""
        return guarded(self._flush, timeout_s) is True

    def checkpoint(self, step: int | None = None, path: Any = None) -> None:
        """Say that healthy state was saved (at the current step, or `step`; to `path` if given): a `checkpoint`
        event, which the server's rollback plan (`GET /api/v1/runs/{id}/plan`) restores from."""
        guarded(self._checkpoint, step, path)

    @property
    def should_stop(self) -> bool:
        """True once the run was asked to stop (an admin's "Stop run", `ampwatch stop`; or a critical event, where
        `init(stop_on=...)` has "critical"), learned at the agent's next exchange with the server: a loop that checks it
        can save and end. The run then ends `stopped`. In a run of several ranks, it turns true on every rank after the
        same step, which the server fixes (see `ampwatch._stop`). A few attribute reads: cheap at every step."""
        return due(self._recorder.mailbox, self._recorder.step)

    def _registered(self, reply: dict[str, Any]) -> None:
        """The server's own link to the run's page (AMPWATCH_PUBLIC_URL behind a proxy) replaces ours; the reply also
        says which steps an earlier launch under this run id stored (see ampwatch._resume)."""
        stored = reply.get("stored_steps")
        if isinstance(stored, dict) and not self._relaunch_checked:  # (the first reply that says: re-registrations too)
            self._relaunch_checked = True
            guarded(_resume.check_relaunch, self, stored, self._resume_step)
        guarded(self._stopper.registered, reply)
        url = reply.get("url")
        if isinstance(url, str) and url.startswith(("http://", "https://")) and url.endswith("/runs/" + self.id):
            self.url = url

    def _resume_from(self, step: int) -> None:
        """Number this launch's steps from `step` and mark where it resumed (see ampwatch._resume): at init(), or
        later from an integration that restores a checkpoint (`Integration.resume_at`)."""
        record = _resume.resumed(self, step)
        if record is None:
            return
        self._recorder.step, self._resume_step = step, step
        if self._worker is not None:  # (resumed after the registration's reply, as Lightning's restored step is)
            self._worker.batcher.stop_holding_back()
        self._record(record)

    # -- internals ------------------------------------------------------------------------
    def _record(self, entry: tuple) -> None:
        if self._worker is not None:
            self._worker.record(entry)

    def _flush(self, timeout_s: float) -> bool:
        if not isinstance(timeout_s, numbers.Real) or math.isnan(timeout_s):
            warn_once("flush-timeout", "ampwatch: flush()'s timeout_s must be a number of seconds, got %r", timeout_s)
            return False
        if self._worker is None or self._finished:
            return True
        return self._worker.flush(max(0.0, float(timeout_s)), spooled=True)

    def _log(self, metrics: dict[str, Any], step: int | None) -> None:
        if self._finished:
            warn_once("log-finished", "ampwatch: log() after finish() is ignored: start a new run with ampwatch.init()")
            return
        if not isinstance(metrics, dict):
            warn_once(
                "log-metrics",
                "ampwatch: log() takes a dict of names to values, got %s; ignored",
                type(metrics).__name__,
            )
            return
        if step is not None and not isinstance(step, numbers.Integral):
            warn_once("log-step-type", "ampwatch: log()'s step must be an integer, got %r; ignored", step)
            return
        step = self._recorder.step if step is None else int(step)
        if not 0 <= step < MAX_STEP:  # the server would refuse the whole batch it travels in
            warn_once("log-step", "ampwatch: steps must be in [0, 2**63), got %r; ignored", step)
            return
        names: list[str] = []
        floats: list[float] = []
        for name, value in metrics.items():
            if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or "\x00" in name:
                warn_once(
                    "log-name",
                    "ampwatch: metric names must be strings of 1-%d characters without NUL, got %r",
                    MAX_NAME,
                    name,
                )
            elif isinstance(value, (int, float)):
                names.append(name)
                floats.append(float(value))
            elif getattr(value, "numel", None) is not None and _readable_scalar(value):
                # Read later, off this thread: a tensor without autograd history may be an accumulator that
                # changes in place, and a GPU tensor may be a CUDA graph's static output that the next replay
                # overwrites, so those are copied (asynchronously on a GPU); a CPU forward's results are not (but views
                # are: `p[0]` of a parameter the optimizer updates in place has a grad_fn too).
                fresh = (
                    getattr(value, "grad_fn", None) is not None and value.device.type == "cpu" and value._base is None
                )
                value = value.detach() if fresh else value.detach().clone()
                self._record((VALUES, step, (name,), value))
                self._recorder.user_logged(step, (name,))
            elif isinstance(value, numbers.Real) or _numpy_scalar(value):  # NumPy scalars and 0-d arrays, Fractions
                names.append(name)
                floats.append(float(value))
            else:
                warn_once("log-" + name, "ampwatch: %r is not a real number or a 1-element real tensor; ignored", name)
        if names:
            self._record((VALUES, step, tuple(names), tuple(floats)))
            self._recorder.user_logged(step, tuple(names))

    def _checkpoint(self, step: Any, path: Any) -> None:
        at = self._recorder.step if step is None else int(step) if isinstance(step, numbers.Integral) else -1
        if not 0 <= at < MAX_STEP:
            warn_once("checkpoint-step", "ampwatch: checkpoint()'s step must be an integer in [0, 2**63), got %r", step)
            return
        where = None if path is None else str(path).replace("\x00", "\ufffd")[:4000]
        message = f"Checkpoint saved at step {at}" + (f" to {where}" if where else "") + "."
        self._record(
            (
                EVENT,
                at,
                protocol_event(at, self.rank, "checkpoint", "info", message, {"path": where}),
            )
        )


def _watchable(model: Any, optimizer: Any, scaler: Any) -> tuple[Any, Any, Any]:
    """watch()'s arguments, with any of the wrong kind left out (and said once)."""
    kinds = (
        ("model", "a torch.nn.Module", ("named_parameters", "register_forward_pre_hook")),
        ("optimizer", "a torch.optim.Optimizer (or a list of them)", ("param_groups",)),
        ("scaler", "a GradScaler", ("scale", "is_enabled")),
    )
    kept = []
    for value, (name, kind, needs) in zip((model, optimizer, scaler), kinds):
        items = value if name == "optimizer" and isinstance(value, (list, tuple)) else [value]
        if value is not None and not all(all(hasattr(item, need) for need in needs) for item in items):
            warn_once(
                f"watch-{name}",
                "ampwatch: watch(%s=...) takes %s, got %s; not watched",
                name,
                kind,
                type(value).__name__,
            )
            value = None
        kept.append(value)
    return kept[0], kept[1], kept[2]


def _readable_scalar(tensor: Any) -> bool:
    """A 1-element tensor the sender can read as a real number: dense (strided, not quantized or nested), real,
    with data (not on the meta device)."""
    return (
        tensor.numel() == 1
        and tensor.layout is sys.modules["torch"].strided
        and not (tensor.is_complex() or tensor.is_meta or tensor.is_quantized or tensor.is_nested)
    )


def _discard(entry: tuple) -> None:
    """Where a disabled run's records go."""


def init(
    project: str | None = None,
    name: str | None = None,
    *,
    url: str | None = None,
    token: str | None = None,
    config: Any = None,
    transport: Transport | None = None,
    resume_step: int | None = None,
    stop_on: Any = None,
) -> Run:
    """Start a run (`config`: a dict, an argparse.Namespace, a dataclass or an OmegaConf config). `transport`: what
    delivers batches instead of HTTP to `url` (any object with `ampwatch.Transport`'s `send` and `close`; tests pass
    an in-memory one). `resume_step`: the step a relaunch under the same run id resumes from, where its step
    numbering continues. `stop_on`: "request", "critical" or both (a tuple): raise `ampwatch.StopRequested` at the
    end of the step after the run is asked to stop (an admin's request; a critical event), rather than only turning
    `run.should_stop` true; never by default. Never raises: on any problem it logs and returns a run that records
    nothing."""
    try:
        settings = AgentSettings.resolve(project=project, url=url, token=token)
        return Run(settings, name, config, transport, resume_step, stop_on)
    except Exception:
        log.exception("ampwatch: init() failed; this run will not be recorded")
        return Run(AgentSettings(mode="disabled", project=project or "default"), name)


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
    # (SLURM's job and step ids: tasks that srun starts share them, and no two jobs do, where the address does)
    launch = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_STEP_ID")
    shared = [project, name or "", *(os.environ.get(v, "") for v in launch), str(next(_LAUNCHES))]
    return hashlib.sha256("\0".join(shared).encode()).hexdigest()[:16]


def _environment(world_size: int, flush_interval_s: float) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "argv": sys.argv[:20],
        "world_size": world_size,
        "flush_interval_s": flush_interval_s,  # (the server times a stop of several ranks by it)
    }
    torch = sys.modules.get("torch")  # the user's torch, if loaded; never imported here
    if torch is not None:
        env["torch"] = getattr(torch, "__version__", "?")
        cuda = getattr(torch, "cuda", None)
        env["cuda"] = bool(cuda and cuda.is_available())
    return env


def _config_dict(config: Any) -> dict[str, Any]:
    """A run's config as the dict the server takes: a mapping (OmegaConf's too), an argparse.Namespace or another
    object's attributes, a dataclass; anything else under "value"."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if isinstance(getattr(config, "__dict__", None), dict) and not isinstance(config, type):
        return dict(vars(config))
    return {"value": config}


def _jsonable(value: Any) -> Any:
    """Config values that JSON cannot carry become strings; non-finite floats keep their spelling."""

    def fix(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, Mapping):
            return {str(k): fix(x) for k, x in v.items()}
        if isinstance(v, Sequence) and not isinstance(v, (str, bytes, bytearray)):  # (OmegaConf's ListConfig too)
            return [fix(x) for x in v]
        return v

    return json.loads(json.dumps(fix(value), default=str))


def _numpy_scalar(value: Any) -> bool:
    """A NumPy bool, integer or float of no dimensions (`np.bool_` and 0-d arrays are not `numbers.Real`)."""
    return (
        getattr(getattr(value, "dtype", None), "kind", None) in ("b", "i", "u", "f")
        and getattr(value, "shape", None) == ()
    )
