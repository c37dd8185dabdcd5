"""Hooks into GradScaler and the optimizer that record each step's standard series.

On the training thread this is a handful of asynchronous tensor ops and one deque append per step;
values reach the host on the sender thread, so no host-device sync is ever added here. GradScaler's
own exceptions pass through unchanged, with a diagnosis recorded on the side.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ampwatch import _scaler
from ampwatch._arming import ProbeArming
from ampwatch._cadence import Cadence
from ampwatch._clip import ClipTracking
from ampwatch._guard import Hook, guarded, warn_once
from ampwatch._indicators import Indicators
from ampwatch._mailbox import Mailbox
from ampwatch._misuse import (
    SILENT_UNSCALED,
    Misuses,
    clipped_scaled,
    forward_config_problem,
    watch_config_problems,
)
from ampwatch._origin import OriginProbe, module_names
from ampwatch._protocol import EVENT
from ampwatch._protocol import event as protocol_event
from ampwatch._step_end import StepEnd
from ampwatch._step_state import StepState
from ampwatch._steps import CLIP_TOTAL

log = logging.getLogger("ampwatch")
STANDARD = frozenset({"loss", "scale", "skipped", "grad_norm", "lr", "param_norm"})


class Recorder(StepEnd):
    """The run's hooks on the training thread: what is watched, the step counter, and the plan of the steps ahead.

    Owner: the training thread. What the current step has recorded so far is `current` (`ampwatch._step_state`);
    what the sender is told goes through `mailbox` (`ampwatch._mailbox`). The methods the scaler wrappers call
    (`on_scale`, `on_unscaled`, `on_clipped`, `before_step`, `before_update`) run every step: they keep references
    and build one tuple (on the steps between planned ones, lean wrappers do their work instead: see
    `ampwatch._step_end`). Other modules read the watched objects through `optimizers`, `scaler` and `model`.
    """

    # Slots, the ones every step reads first: next to each other in memory. Timed in place, the hooks' cost is
    # mostly memory they touch, and a dict of fifty attributes spreads them over many more cache lines.
    __slots__ = (
        "step",
        "current",
        "_append",
        "_plain_until",
        "mailbox",
        "_record",
        "_lean_optimizer",
        "_full_hooks",
        "rank",
        "cadence",
        "reanchor",
        "_user_step",
        "_user_names",
        "_norm_logged_at",
        "clip",
        "_tensor",
        "_foreach_norm",
        "_hooks",
        "_scaler",
        "_optimizers",
        "_model",
        "_module_of",
        "_layer_names",
        "_probe",
        "_arming",
        "_probing",
        "_layers_due",
        "_ever_scaled",
        "misuses",
        "_first_forward_hook",
        "_ran_on",
        "_torch",
        "_step_hooks",
        "_woke_at",
        "_indicators",
    )

    def __init__(
        self, record: Callable[[tuple], Any], *, rank: int = 0, layer_interval: int = 50, param_interval: int = 50
    ) -> None:
        self._record = record  # may return the buffer's append, for the next step records (see RecordBuffer.append)
        self._append: Callable[[tuple], None] | None = None
        self.rank = rank
        self.step = 0
        self.cadence = Cadence(layer_interval, param_interval)  # which steps do more (see ampwatch._cadence)
        self.mailbox = Mailbox()  # word to and from the sender thread (see ampwatch._mailbox)
        self.reanchor = True  # the scale must be copied from the device at the next update()
        self._plain_until = 0  # steps before this one are plain (see `_plan`), unless the probe is asked to arm
        self._lean_optimizer: Any = None  # the optimizer of the lean path, while its lean hooks are in place
        self._full_hooks: Any = None  # and the scaler's wrappers they replaced, and the lean ones
        self._ran_on: set[Any] = set()  # the optimizers whose post-step hook says whether their step ran (once each)
        self.current = StepState()  # what the current step has recorded so far (see ampwatch._step_state)
        # what the user logged under standard names
        self._user_step = -1
        self._user_names: set[str] = set()
        self._norm_logged_at = (-3, -3)  # the last two steps the user logged `grad_norm` at
        self.clip = ClipTracking(self.mailbox)  # whether clip_grad_norm_'s norm is the step's (see ampwatch._clip)
        # what is watched
        self._tensor: type[Any] = type(None)  # torch.Tensor and torch._foreach_norm once watching
        self._foreach_norm: Any = None  # (called only while watching: see watch())
        self._torch: Any = None
        self._hooks: list[Any] = []
        self._step_hooks: tuple[Any, ...] = ()  # the optimizer's step hooks that count steps without an enabled scaler
        self._scaler: Any = None
        self._optimizers: list[Any] = []
        self._model: Any = None
        self._module_of: dict[int, str] = {}
        self._layer_names: dict[tuple[int, ...], tuple[str, ...]] = {}
        self._probe: OriginProbe | None = None
        self._arming = ProbeArming(self.mailbox, record, self.warn_config)  # when the probe arms (ampwatch._arming)
        self._probing = False  # the probe is armed (a copy of its flag, read every step)
        self._layers_due = False  # the current iteration takes per-layer norms
        self._ever_scaled = False
        self.misuses = Misuses()  # the misuses said so far (see ampwatch._misuse)
        self._first_forward_hook: Any = None
        self._woke_at = 0.0  # (time.monotonic() of the last)
        self._indicators: Indicators | None = None  # the leading indicators' hooks (see ampwatch._indicators)

    # -- what is watched (read-only outside this class) -------------------------------------
    @property
    def optimizers(self) -> list[Any]:
        """The watched optimizers (unwrapped), in the order given; the first one's steps are the run's."""
        return self._optimizers

    @property
    def scaler(self) -> Any:
        """The watched GradScaler, or None."""
        return self._scaler

    @property
    def model(self) -> Any:
        """The watched model, or None."""
        return self._model

    # -- what the user logged --------------------------------------------------------------
    def user_logged(self, step: int, names: tuple[str, ...]) -> None:
        """A standard name the user logs at a step replaces the agent's own value there."""
        for name in names:
            if name in STANDARD:  # (other names logged at other steps, a sample count, leave these be)
                if step != self._user_step:
                    self._user_step, self._user_names = step, set()
                self._leave_lean()
                self._user_names.add(name)
                if name == "grad_norm" and step > self._norm_logged_at[1]:
                    self._norm_logged_at = (self._norm_logged_at[1], step)

    # -- attaching ------------------------------------------------------------------------
    def watch(self, model: Any, optimizer: Any, scaler: Any) -> None:
        """Hook the scaler when it is enabled, else count steps through the optimizer."""
        import torch

        self._tensor, self._foreach_norm, self._torch = torch.Tensor, _scaler.float32_norms(torch), torch
        wrapped = (
            list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer] if optimizer is not None else []
        )
        optimizers = [_unwrap(o) for o in wrapped]
        self._optimizers = optimizers or self._optimizers  # (a later watch of only a model or a scaler keeps them)
        self.mailbox.optimizers = list(self._optimizers)  # (for the diagnosis: whether a scheduler steps them)
        if model is not None:
            if self._first_forward_hook is not None:  # (a model watched again: the hooks on the last one go)
                self._first_forward_hook.remove()
            if self._probe is not None:
                self._probe.disarm()
            self._model = model
            self._module_of = module_names(model)
            self._probe = OriginProbe(model)
            self._layers_due = self.cadence.layers_due(self.step, False, True)
            if self._indicators is not None:
                self._indicators.disarm()
            self._indicators = Indicators(
                model,
                lambda: self._optimizers,
                lambda: self._module_of,
                self.cadence.layer_interval,
                self._record,
                self.mailbox,
                self._foreach_norm,
            )
            self._indicators.arm_for(self.step)
            # On a module that holds parameters, not the model itself: a forward wrapped in autocast (Accelerate's)
            # has it on only once that forward runs, after the model's own pre-hooks. Parameters that train: a frozen
            # backbone may only ever run under no_grad.
            first = next(
                (m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))), model
            )
            if self._probe.hookable:
                self._first_forward_hook = first.register_forward_pre_hook(Hook(self._first_forward))
            else:
                warn_once(
                    "scripted",
                    "ampwatch: a TorchScript model takes no hooks: its steps, loss, scale and norms are recorded, but "
                    "not where a NaN came from, nor checks of its forward's autocast",
                )
        if scaler is not None:
            _scaler.attach(scaler, self)
            self._scaler = scaler
            self.reanchor = True  # the shadow copies this scaler's scale and rule at its next update()
        # Steps are counted by an enabled scaler's update() or else by the first optimizer's step, never both: decided
        # again whenever watch() changes either (they may come in separate calls, in any order).
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = ()
        first = self._optimizers[0] if self._optimizers else None
        if first is not None and (self._scaler is None or not self._scaler.is_enabled()):
            self._step_hooks = (
                first.register_step_pre_hook(self._before_optimizer_step),
                first.register_step_post_hook(self._after_optimizer_step),
            )
        if self._step_hooks or self._scaler is not None and self._scaler.is_enabled():
            _scaler.listen_to_clipping(
                self, before=bool(self._step_hooks)
            )  # (no enabled scaler: the norm before a clip)
        for listened in self._optimizers if self._scaler is not None and self._scaler.is_enabled() else ():
            self._listen_ran(listened)  # (whether its step ran tells a skipped step without a host read)
        for problem in watch_config_problems(wrapped, scaler):
            self.warn_config(*problem)
        self._plain_until = 0  # what is due is planned again from the next step
        self._leave_lean()

    def unwatch(self) -> None:
        """Remove every hook; the scaler is its own class again."""
        self._leave_lean()
        for handle in [*self._hooks, *self._step_hooks, self._first_forward_hook]:
            if handle is not None:
                handle.remove()
        self._hooks.clear()
        self._step_hooks = ()
        self._ran_on.clear()
        if self._probe is not None:
            self._probe.disarm()
            self._probing = False
        if self._indicators is not None:
            self._indicators.disarm()
        if self._scaler is not None:
            _scaler.detach(self._scaler, self)
        _scaler.stop_listening(self)

    def _first_forward(self, module: Any, args: Any) -> None:
        """Configuration checks that need the forward's autocast state; run once, at the first forward that trains
        (an evaluation pass under no_grad before training may well run without autocast). Not inside a forward that
        torch.compile traces: this would break its graph there, and the compiled model would compute differently."""
        torch = self._torch
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        if self._first_forward_hook is not None:
            self._first_forward_hook.remove()
            self._first_forward_hook = None
        problem = guarded(forward_config_problem, module, self._scaler)
        if problem is not None:
            self.warn_config(*problem)

    # -- scaler path (every step: keep it lean) ----------------------------------------------
    def on_scale(self, outputs: Any) -> None:
        """The loss is the tensor handed to `scaler.scale()`, summed over micro-batches."""
        cur = self.current
        cur.scale_calls += 1
        self._ever_scaled = True
        if isinstance(outputs, self._tensor) and outputs.numel() == 1:
            # `.data`: a view of the value without the graph, as detach() gives, at half its cost on the thread
            # (no dispatch); the agent only ever reads it.
            cur.add_loss(outputs.data, cur.loss is not None and _scaler.grads_dropped(self._optimizers))

    def on_unscaled(self, optimizer: Any, scale: Any = None) -> None:
        """Per-parameter gradient norms, one op: right after `unscale_` (true, not yet clipped gradients), before a
        clip without a scaler, or in a fused step with the device `scale` they are still multiplied by."""
        cur, key = self.current, id(optimizer)
        if key in cur.normed:
            return
        cur.normed.add(key)
        cur.unscaled = optimizer if scale is None else None
        if self._layers_due:  # every `layer_interval` steps, and every step while probing (for the heatmap)
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            modules = self._modules(params)
        elif self.clip.trusted and scale is None and self.clip.still_covers(optimizer):
            cur.deferred = optimizer  # clip_grad_norm_ is about to compute it: take its result
            return
        elif self._norm_logged_at[1] >= self.step - 1 and self._norm_logged_at[0] == self._norm_logged_at[1] - 1:
            return  # the user logs the norm at every step: theirs is recorded, none is computed here
        else:
            grads = [g for group in optimizer.param_groups for p in group["params"] if (g := p.grad) is not None]
            modules = None
        if grads:
            try:
                norms = self._foreach_norm(grads)
            except RuntimeError:  # sparse gradients (an Embedding(sparse=True)): _foreach_norm has no kernel for them
                norm = self._torch.linalg.vector_norm
                norms = [norm(g.coalesce().values() if g.is_sparse else g) for g in grads]
            cur.add_norms((norms, scale is not None, modules))
            if (
                modules is not None
                and scale is None
                and grads[0].__class__ is not self._tensor
                and hasattr(grads[0], "placements")
            ):
                # FSDP2's sharded gradients: these norms are this rank's shard's; a clip's is whole
                cur.deferred = optimizer

    def on_clipped(self, parameters: Any, args: tuple, kwargs: dict[str, Any], total: Any) -> None:
        """`clip_grad_norm_` returned `total`: after this run's `unscale_` and over its optimizer's parameters,
        that is the step's gradient norm, recorded as the clip returned it on every step (and the next steps' norm is
        left to it too)."""
        cur = self.current
        optimizer = cur.unscaled
        if optimizer is None:  # not between this run's unscale_ and step (before unscale_, after scale())
            if cur.scale_calls and "clip_before_unscale" not in self.misuses.told:
                guarded(clipped_scaled, self, parameters, args, kwargs)
            return
        ids = (id(parameters),) if isinstance(parameters, self._tensor) else tuple(map(id, parameters))
        groups = optimizer.param_groups
        max_norm = args[0] if args else kwargs.get("max_norm")  # (a number only: comparing tensors would sync)
        max_norm = float(max_norm) if isinstance(max_norm, (int, float)) else None  # (the diagnosis reads it)
        seen = (ids, args[1] if len(args) > 1 else kwargs.get("norm_type", 2.0), len(groups), max_norm)
        self.clip.judge(optimizer, parameters, seen)
        if cur.deferred is optimizer:
            if self.clip.trusted or seen[1] == 2.0 and self.clip.covers_gradients(optimizer, ids):
                cur.deferred = None
                if cur.norm is None:
                    cur.norm = total
                elif cur.norm.__class__ is list and total.__class__ is not self._tensor:  # (a DTensor: see on_unscaled)
                    cur.norm.append(([total], False, CLIP_TOTAL))
                else:
                    cur.add_norms(([total], False, None))
            elif not self.clip.param_ids(optimizer).isdisjoint(ids):
                cur.deferred = None  # another clip changed these gradients: this step's norm is lost
        elif (
            cur.norm.__class__ is list
            and len(cur.norm) == 1
            and len(cur.normed) == 1
            and not cur.norm[0][1]
            and (self.clip.trusted or seen[1] == 2.0 and self.clip.covers_gradients(optimizer, ids))
        ):
            # Only this optimizer's norms were taken, before the clip (per-layer norms are due, or the clip was not
            # judged yet): the clip's total is the step's norm, the same value to the last digit as on other steps.
            cur.norm.append(([total], False, CLIP_TOTAL))

    def before_step(self, scaler: Any, optimizer: Any) -> None:
        """Remember the stage for diagnosis; fused optimizers unscale in their kernel: norm of grads / scale."""
        cur = self.current
        if cur.deferred is optimizer:
            self._settle_deferred()
        cur.unscaled = None
        states = getattr(scaler, "_per_optimizer_states", None)  # (a disabled scaler may have none of its state)
        state = states.get(id(optimizer)) if states else None
        cur.stage_before = state["stage"] if state else None
        cur.last_optimizer = optimizer
        cur.skip_seen = cur.skip_seen or cur.ran is False  # (an earlier optimizer's step of this iteration did not run)
        cur.ran = False if optimizer in self._ran_on else None  # (True once its post-step hook fires)
        if not scaler._enabled:
            return
        if (
            cur.scale_calls == 0
            and self._ever_scaled
            and "unscaled_backward" not in self.misuses.told
            and any(p.grad is not None for group in optimizer.param_groups for p in group["params"])
        ):
            what, cause = "backward() without scaler.scale()", "unscaled_backward"
            self.misuse(what, cause, SILENT_UNSCALED, "warning", {}, once=True)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            self.on_unscaled(optimizer, scaler._scale)

    def _settle_deferred(self) -> None:
        """No clip came after all (before step(), or unscale_ ran inside it): the gradients are as unscale_ left
        them."""
        cur = self.current
        optimizer, cur.deferred = cur.deferred, None
        self.clip.forget()
        cur.normed.discard(id(optimizer))
        self.on_unscaled(optimizer)

    def before_update(self, scaler: Any, scale_set_by_hand: bool = False) -> None:
        """The iteration ends: keep found_inf (update() discards it), copy the scale when the shadow needs an
        anchor, and record the step."""
        if self.current.deferred is not None:  # step() called unscale_ itself, after before_step()
            self._settle_deferred()
        found: Any = None  # (one tensor in the usual case: no list is built; a disabled scaler has none)
        for state in getattr(scaler, "_per_optimizer_states", {}).values():
            for flag in state["found_inf_per_device"].values():
                found = flag if found is None else [*found, flag] if found.__class__ is list else [found, flag]
        if found is not None and scaler._scale is not None:
            rule = None
            if self.step >= self._plain_until and (self.reanchor or self.cadence.anchor_due(self.step)):
                self.current.anchor = (scaler._scale.clone(), scaler._growth_tracker.clone())
                rule = (scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval)
                self.reanchor = False
            self._finish_step(found, rule)
        if scale_set_by_hand:
            self.request_anchor()

    def request_anchor(self) -> None:
        """Something outside update() changed the scale or its rule: copy both at the next update()."""
        self.reanchor = True
        self._plain_until = 0
        self._leave_lean()

    # -- optimizer path (no scaler, or a disabled one) -------------------------------------
    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # A closure (Lightning, LBFGS) computes the gradients inside step(): the norm after it.
        # (`args[0]` is the optimizer.)
        if (args[1] if len(args) > 1 else kwargs.get("closure")) is None:
            guarded(self.on_unscaled, optimizer)

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        guarded(self.on_unscaled, optimizer)  # no-op unless step() ran a closure
        guarded(self._finish_step, None, None)

    # -- shared ---------------------------------------------------------------------------
    def _modules(self, params: list[Any]) -> tuple[str, ...]:
        """The module of each parameter, cached per parameter set."""
        key = tuple(map(id, params))
        if key not in self._layer_names:
            if len(self._layer_names) >= 16:  # the parameter set keeps changing (MoE, layer drop): start over
                self._layer_names.clear()
            if any(id(p) not in self._module_of for p in params):  # parameters were replaced: look again
                self._module_of = module_names(self._model)
            self._layer_names[key] = tuple(self._module_of.get(id(p), "(unnamed)") for p in params)
        return self._layer_names[key]

    def warn_config(self, message: str, details: dict[str, Any]) -> None:
        """Record an `amp_config` warning at the current step."""
        self._record((EVENT, self.step, self._event("amp_config", "warning", message, details)))

    def misuse(
        self, what: str, cause: str, explanation: str, severity: str, details: dict[str, Any], once: bool = False
    ) -> None:
        """Record a `scaler_misuse` event at the current step and log it; `once`: its cause is said for good."""
        if once:
            self.misuses.told.add(cause)
        message = f"{what} at step {self.step}. {explanation}"
        log.error("ampwatch: %s", message)
        self._record((EVENT, self.step, self._event("scaler_misuse", severity, message, {"cause": cause, **details})))

    def _event(self, kind: str, severity: str, message: str, details: dict[str, Any]) -> dict[str, Any]:
        return protocol_event(self.step, self.rank, kind, severity, message, details)


def _unwrap(optimizer: Any) -> Any:
    """The optimizer a wrapper (Accelerate's `AcceleratedOptimizer`) delegates to: only its step hooks fire."""
    while hasattr(getattr(optimizer, "optimizer", None), "param_groups"):
        optimizer = optimizer.optimizer
    return optimizer
