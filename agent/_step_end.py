"""The end of a step (its record, the NaN-origin probe's flags), and the lean path: the Recorder's work on the
steps between the ones that do more.

A step does more when it takes per-layer norms, checks the parameters, or anchors the scale; `_plan` finds
the next such step (see ampwatch._cadence), and the steps before it are plain: `_finish_step` takes its short
path on them (and the last of them says whether per-layer norms are due next). On plain steps, a loop that clips with
`clip_grad_norm_` after `unscale_` also repeats one pattern: one scale(), unscale_, a clip over the
optimizer's parameters, step, update. For those steps the scaler's wrappers (and the Recorder's clip
listener) are replaced by the lean ones built here: each is the wrapper and the Recorder's method in one
function, checking with an identity or two that its step still has the pattern. If not, it puts the full
wrappers back and calls them, and the Recorder then sees exactly the state it would have left itself. What
is recorded is the same either way (tests/test_lean_path.py); the training thread only does less per step, and
the sender too: a lean step whose optimizer step ran (the optimizer's post-step hook says so) keeps no found_inf
tensor, as GradScaler runs the step only where it found no inf.
Timed in place, what hooks cost is mostly the memory they touch between the training step's own work: hence
one function per hook, and the Recorder's attributes in slots.
"""

from __future__ import annotations

from collections.abc import Callable
from numbers import Real
from operator import is_
from time import monotonic
from typing import Any

from ampwatch import _misuse, _scaler
from ampwatch._buffer import FAST_RECORDS
from ampwatch._guard import guarded, report
from ampwatch._host import note_stream
from ampwatch._protocol import APPLIED_STEP, LEAN_STEP, STEP
from ampwatch._step_state import StepState
from ampwatch._stop import stop_here

LEAN = ("scale", "unscale_", "step", "update")  # the scaler's wrappers the lean path replaces
WAKE_EVERY_S = 0.1  # seconds between two wake-ups of the sender on skipped steps, at least (a collapse skips each)


class StepEnd:
    """How the Recorder ends a step and runs the lean path: a part of `ampwatch._watch.Recorder`, whose attributes
    these methods use (one object, the Recorder, for speed: its slots are what every step touches). Owner: the
    training thread."""

    __slots__ = ()
    current: StepState  # (the Recorder's slot, declared here for the type checker)
    _indicators: Any

    def _finish_step(self: Any, found: Any, rule: tuple[float, float, int] | None) -> None:
        """Record this iteration at its step (what the user logged under a standard name wins); `found`: the
        scaler's found_inf tensor, a list of them, or None. Steps before `_plain_until` take the short way."""
        # Full path: before_step set the flag False and the optimizer's post-step hook did not fire: a skipped step.
        cur = self.current
        skipped, cur.ran, cur.skip_seen = cur.ran is False or cur.skip_seen, None, False
        step = self.step
        optimizers = self._optimizers
        lr = optimizers[0].param_groups[0].get("lr") if optimizers else None
        lr = lr if lr.__class__ is float else _real(lr)
        loss, total, params, check = cur.loss, True, None, True
        if self._user_step == step:
            user = self._user_names
            loss = None if "loss" in user else loss
            lr = None if "lr" in user else lr
            total, check = "grad_norm" not in user, "param_norm" not in user
        plain = step < self._plain_until and not self.mailbox.arm_request
        if not plain and self._torch is not None:
            note_stream(self._torch)  # (the sender's CUDA reads wait for this step's stream)
        if not plain and optimizers and check and self.cadence.params_due(step, self._probing):
            with self._torch.no_grad():  # (no graph, and no detached copy of each parameter: ~0.3 us each)
                params = self._foreach_norm([p for o in optimizers for g in o.param_groups for p in g["params"]])
        self._end_step((STEP, step, loss, found, cur.norm, total, cur.anchor, rule, lr, params), step, skipped)
        cur.end_optimizer_work()
        if plain:
            if step + 1 >= self._plain_until:
                self._end_plain(step)
            return
        probe = self._probe
        if probe is not None:
            if self._probing or self.mailbox.arm_request:
                self._probing = self._arming.end_of_step(probe, step)
            self._layers_due = self.cadence.layers_due(step + 1, self._probing, True)
        elif self.mailbox.arm_request:  # (no model is watched: there is nothing to arm)
            self.mailbox.arm_request = False
        indicators = self._indicators
        if indicators is not None:
            indicators.end_of_step(step)
            indicators.arm_for(step + 1)
        self._plain_until = self._plan(step)
        if self._plain_until > step + 1:
            self._enter_lean()

    def _end_step(self: Any, entry: tuple, step: int, wake: bool) -> None:
        """Where every step ends, on the full path and the lean one: its record goes to the sender's buffer (through
        the buffer's own append while it has room, see RecordBuffer.append), the step count moves on, and the step's
        loss and norm are let go (`StepState.end`). `wake`: the step may have been skipped, so the sender reads it
        now."""
        append = self._append
        if append is not None and step & (FAST_RECORDS - 1):
            append(entry)
        else:
            self._append = self._record(entry)
        self.step = step + 1
        if wake:  # (now that its record is in the buffer: the sender's next read must find it)
            self._wake_for_skip()
        self.current.end()
        mailbox = self.mailbox
        free_read_records = mailbox.free_read_records
        if free_read_records is not None:  # at every step: a slow plain stretch must not leave them to the sender
            free_read_records()
        if mailbox.stop_raise:  # (the run was asked to stop, and init(stop_on=...) asked to raise it)
            stop_here(self)

    def _plan(self: Any, step: int) -> int:
        """The first step after `step` whose record needs more than the plain path of `_finish_step` (see
        ampwatch._cadence). (Whatever asks for an anchor, `watch` or `request_anchor`, resets it to 0.)"""
        return self.cadence.next_due(step, self._probing, self._probe is not None)

    def _end_plain(self: Any, step: int) -> None:
        """`step` was the plan's last plain step: the full hooks again, and per-layer norms at the next step if due."""
        self._layers_due = self.cadence.layers_due(step + 1, False, self._probe is not None)
        if self._indicators is not None:
            self._indicators.arm_for(step + 1)
        self._leave_lean()

    def end_plan(self: Any) -> None:
        """Back to the full hooks now, with no plain steps planned ahead: any step the loop still runs is a full one
        (after a stop raised at this step's end)."""
        self._plain_until = 0
        self._leave_lean()

    def _enter_lean(self: Any) -> None:
        """At the end of a full step that planned plain steps ahead: go lean if that step had the pattern."""
        optimizer, scaler = self.current.last_optimizer, self._scaler
        stage = self.current.stage_before
        if (
            optimizer is None
            or scaler is None
            or not scaler._enabled
            or not self.clip.trusted
            or self._probing
            or not self._ever_scaled
            or stage is None
            or stage.name != "UNSCALED"
            or self.clip.params.__class__ is not list
            or not self.clip.params  # (a clip of one tensor, or none)
            # (a standard name logged ahead: the full path sees it)
            or self._user_step >= self.step
            and self._user_names
            or getattr(optimizer, "_step_supports_amp_scaling", False)
            or scaler.__dict__.get(_scaler.RECORDER) is not self
        ):
            return
        self._listen_ran(optimizer)
        self._lean_optimizer = optimizer
        state = scaler.__dict__
        # The lean hooks of the last plan, where they were built for the same objects (the usual case: building them
        # anew, every `param_interval` steps, cost that step ~20 us in place, cold code).
        params, first = self.clip.params, self._optimizers[0] if self._optimizers else None
        key = (scaler, optimizer, first, self.clip.groups, params, params[0], params[-1])
        sizes = (self.clip.seen[2], len(params))
        held = self._full_hooks
        if held is not None and held[3] == sizes and all(map(is_, held[2], key)):
            lean = held[4]
        else:
            lean = _lean_hooks(self, scaler, optimizer)
        self._full_hooks = (state, {name: state[name] for name in LEAN}, key, sizes, lean)
        state.update(lean[0])
        _scaler.route_clipping(self, lean[1])

    def _listen_ran(self: Any, optimizer: Any) -> None:
        """Register the post-step hook that tells whether `optimizer`'s step ran (see `_ran_hook`), once."""
        if optimizer not in self._ran_on and hasattr(optimizer, "register_step_post_hook"):
            self._hooks.append(optimizer.register_step_post_hook(_ran_hook(self)))
            self._ran_on.add(optimizer)

    def _wake_for_skip(self: Any) -> None:
        """A skipped step (its optimizer step did not run): the sender reads it now, not at its next flush, so the
        diagnosis can arm the NaN-origin probe before the next few hundred fast steps have passed."""
        wake = self.mailbox.wake
        if wake is not None and monotonic() >= self._woke_at + WAKE_EVERY_S:
            self._woke_at = monotonic()
            wake()

    def _leave_lean(self: Any) -> None:
        """Back to the full hooks (until the next plan)."""
        if self._lean_optimizer is not None:
            self._lean_optimizer = self.current.ran = None
            state, full = self._full_hooks[:2]
            if state.get(_scaler.RECORDER) is self:  # (else another recorder took the scaler, with its own wrappers)
                state.update(full)
            _scaler.route_clipping(self, self.on_clipped)


def _lean_hooks(
    rec: Any, scaler: Any, lean_optimizer: Any
) -> tuple[dict[str, Callable[..., Any]], Callable[..., None]]:
    """The lean path's wrappers of `scaler` and its clip listener, for steps of `lean_optimizer` that keep
    the pattern (the state they keep is `rec`'s own, as its full methods would leave it). Their parameters are
    named as GradScaler's: a loop may pass them by keyword."""
    cls = type(scaler)
    base_scale, base_unscale_, base_step, base_update = cls.scale, cls.unscale_, cls.step, cls.update
    tensor, leave, diagnose, mailbox = rec._tensor, rec._leave_lean, _scaler.diagnose_error, rec.mailbox
    cur = rec.current  # (the Recorder's one StepState: emptied in place, never replaced)
    first = rec._optimizers[0] if rec._optimizers else None
    groups, group_count, clipped_params = rec.clip.groups, rec.clip.seen[2], rec.clip.params
    count, first_param, last_param = (
        len(clipped_params),
        clipped_params[0],
        clipped_params[-1],
    )  # (a list: see _enter_lean)

    def scale(outputs: Any) -> Any:
        if cur.loss is None and outputs.__class__ is tensor and (outputs.ndim == 0 or outputs.numel() == 1):
            cur.scale_calls += 1
            cur.loss = outputs.data  # (see on_scale)
            return base_scale(scaler, outputs)
        leave()
        return scaler.scale(outputs)

    def unscale_(optimizer: Any) -> None:
        if (
            optimizer is not lean_optimizer or optimizer.param_groups is not groups or len(groups) != group_count
        ):  # (see ClipTracking.still_covers)
            leave()
            return scaler.unscale_(optimizer)
        try:
            base_unscale_(scaler, optimizer)
        except _scaler.MISUSE_ERRORS as error:
            leave()
            diagnose(rec, optimizer, error)
            raise
        cur.unscaled = cur.deferred = optimizer  # the clip is trusted: its norm is taken (see on_unscaled)
        return None

    def on_clipped(parameters: Any, args: tuple, kwargs: dict[str, Any], total: Any) -> None:
        opt = cur.unscaled
        if opt is None:  # not between this run's unscale_ and step: nothing to do, as in on_clipped
            return
        norm_type = args[1] if len(args) > 1 else kwargs.get("norm_type", 2.0) if kwargs else 2.0
        # The clip the full path trusted, a 2-norm over as many parameters, the same first and last ones (comparing
        # them all costs the step ~1.5 us; the full steps, every `param_interval` at most, compare all their ids).
        if (
            cur.deferred is opt
            and cur.norm is None
            and opt.param_groups is groups
            and len(groups) == group_count
            and norm_type == 2.0
            and parameters.__class__ is list
            and len(parameters) == count
            and parameters[0] is first_param
            and parameters[-1] is last_param
        ):
            cur.deferred = None
            cur.norm = total
        else:
            leave()
            rec.on_clipped(parameters, args, kwargs, total)

    def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        # The stage before step() is UNSCALED (this step's unscale_ came through here), as the full step left it.
        if (
            optimizer is not lean_optimizer
            or cur.unscaled is not optimizer
            or cur.deferred is not None
            or not cur.scale_calls
        ):
            leave()
            return scaler.step(optimizer, *args, **kwargs)
        cur.unscaled = None
        cur.ran = False  # (the optimizer's post-step hook sets True if its step runs in here)
        try:
            result = base_step(scaler, optimizer, *args, **kwargs)
        except _scaler.MISUSE_ERRORS as error:
            leave()
            diagnose(rec, optimizer, error)
            raise
        if cur.ran is False:
            cur.ran = None
        return result

    def update(new_scale: Any = None) -> None:
        lean = False
        ran, cur.ran = cur.ran, None
        try:
            found: Any = None
            count = 1  # found_inf tensors (one per optimizer and device): none needed where the step ran
            if ran is not True:
                count = 0
                for state in scaler._per_optimizer_states.values():
                    for found in state["found_inf_per_device"].values():  # noqa: B007 (the last one is kept)
                        count += 1
            # (a step whose norm or step() did not come, as when a loop unscales, then drops the step: the full path)
            if (
                count == 1
                and new_scale is None
                and not mailbox.arm_request
                and scaler._scale is not None
                and cur.norm is not None
                and cur.unscaled is None
            ):
                # What _finish_step records on a plain step, as a lean record (the user logged no standard name:
                # that left the lean path); the step ends as every step does.
                at = rec.step
                lr = first.param_groups[0].get("lr") if first is not None else None
                lr = lr if lr.__class__ is float else _real(lr)
                rec._end_step(
                    (APPLIED_STEP if found is None else LEAN_STEP, at, cur.loss, found, cur.norm, lr),
                    at,
                    found is not None,
                )
                if at + 1 >= rec._plain_until:
                    rec._end_plain(at)
                lean = True
        except Exception:  # never into the training loop: this step's record is lost, as in the full wrapper
            report(update)
            leave()
            lean = True
        if not lean:
            leave()
            return scaler.update(new_scale)
        try:
            return base_update(scaler, new_scale)
        except _scaler.MISUSE_ERRORS as error:
            leave()
            diagnose(rec, None, error)
            raise

    return {"scale": scale, "unscale_": unscale_, "step": step, "update": update}, on_clipped


def _ran_hook(rec: Any) -> Callable[..., None]:
    """The optimizer's post-step hook: a step() that sees its optimizer step run knows, without reading found_inf,
    that GradScaler found no inf there (it only runs the step then). On the lean path the record then holds one
    tensor fewer for the sender to read and free; on either path, a step that did not run wakes the sender."""

    cur = rec.current

    def ran(optimizer: Any, args: Any, kwargs: Any) -> None:
        if cur.ran is False:  # (only inside a scaler's step(): the flag is None before the iteration's first)
            cur.ran = True
        elif cur.ran is None and cur.scale_calls and "direct_step" not in rec.misuses.told:  # (see stepped_directly)
            guarded(_misuse.stepped_directly, rec, optimizer)

    return ran


def _real(lr: Any) -> float | None:
    """A learning rate that is a number but not a float (an int, a NumPy scalar) as a float; a tensor (reading it would
    be a host read) or anything else: None."""
    return float(lr) if isinstance(lr, Real) and lr.__class__ is not bool else None
