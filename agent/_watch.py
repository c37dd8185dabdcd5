"""Hooks into GradScaler and the optimizer that record each step's standard series.

On the training thread this is a handful of asynchronous tensor ops and one deque append per step;
values reach the host on the sender thread, so no host-device sync is ever added here. GradScaler's
own exceptions pass through unchanged, with a diagnosis recorded on the side.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ampwatch import _scaler
from ampwatch._guard import guarded
from ampwatch._misuse import SILENT_UNSCALED, Signature, classify
from ampwatch._origin import OriginProbe
from ampwatch._steps import ANCHOR_EVERY, StepRecord
from ampwatch._worker import EVENT, ORIGIN, STEP

log = logging.getLogger("ampwatch")
STANDARD = frozenset({"loss", "scale", "skipped", "grad_norm", "lr", "param_norm"})
ARM_STEPS = 20  # iterations the origin probe stays armed after a non-finite event


class Recorder:
    """Per-run step state: the step counter and what the current iteration has seen so far."""

    def __init__(self, record: Callable[[tuple], None], *, rank: int = 0, layer_interval: int = 25, param_interval: int = 50) -> None:
        self._record = record
        self.rank = rank
        self.step = 0
        self.layer_interval = layer_interval
        self.param_interval = param_interval
        self.arm_request = False  # set by the sender thread's diagnosis
        self.disarm_request = False
        self._current = StepRecord()
        self._normed: set[int] = set()
        self.reanchor = True  # the scale must be copied from the device at the next update()
        self._user_step = -1
        self._user_names: set[str] = set()
        self._hooks: list[Any] = []
        self._scaler: Any = None
        self._optimizers: list[Any] = []
        self._model: Any = None
        self._module_of: dict[int, str] = {}
        self._layer_names: dict[tuple[int, ...], tuple[str, ...]] = {}
        self._probe: OriginProbe | None = None
        self._arming = 0
        self._scale_calls = 0
        self._ever_scaled = False
        self._silent_reported = False
        self._last_optimizer: Any = None
        self._stage_before = "READY"
        self._first_forward_hook: Any = None
        self._last_error = 0

    # -- what the user logged --------------------------------------------------------------
    def user_logged(self, step: int, names: tuple[str, ...]) -> None:
        """A standard name the user logs at a step replaces the agent's own value there."""
        if step != self._user_step:
            self._user_step, self._user_names = step, set()
        self._user_names.update(n for n in names if n in STANDARD)

    def _mine(self, name: str) -> bool:
        return self._user_step != self.step or name not in self._user_names

    # -- attaching ------------------------------------------------------------------------
    def watch(self, model: Any, optimizer: Any, scaler: Any) -> None:
        """Hook the scaler when it is enabled, else count steps through the optimizer."""
        import torch

        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer] if optimizer is not None else []
        self._optimizers = optimizers = [_unwrap(o) for o in optimizers]
        if model is not None:
            self._model = model
            self._module_of = {id(p): n.rpartition(".")[0] or "(root)" for n, p in model.named_parameters()}
            self._probe = OriginProbe(model)
            self._first_forward_hook = model.register_forward_pre_hook(self._first_forward)
        if scaler is not None:
            _scaler.attach(scaler, self)
            self._scaler = scaler
        if optimizers and (scaler is None or not scaler.is_enabled()):
            self._hooks.append(optimizers[0].register_step_pre_hook(self._before_optimizer_step))
            self._hooks.append(optimizers[0].register_step_post_hook(self._after_optimizer_step))
        if torch.is_anomaly_enabled():
            self._config("Anomaly detection (torch.autograd.detect_anomaly / set_detect_anomaly) is on: training runs "
                         "2-2.6x slower and a normal GradScaler skip becomes a crash. Turn it off outside debugging.",
                         {"check": "anomaly_mode"})  # fmt: skip

    def unwatch(self) -> None:
        """Remove every hook; the scaler is its own class again."""
        for handle in [*self._hooks, self._first_forward_hook]:
            if handle is not None:
                handle.remove()
        self._hooks.clear()
        if self._probe is not None:
            self._probe.disarm()
        if self._scaler is not None:
            _scaler.detach(self._scaler, self)

    def _first_forward(self, module: Any, args: Any) -> None:
        """Configuration checks that need the forward's autocast state; runs once."""
        if self._first_forward_hook is not None:
            self._first_forward_hook.remove()
            self._first_forward_hook = None
        guarded(self._check_forward_config, module)

    def _check_forward_config(self, module: Any) -> None:
        import torch

        device = next((p.device.type for p in module.parameters()), "cpu")
        scaler_on = self._scaler is not None and self._scaler.is_enabled()
        on = {d for d in ("cuda", "cpu", "xpu", "mps") if torch.amp.is_autocast_available(d) and torch.is_autocast_enabled(d)}
        if scaler_on and device in on and torch.get_autocast_dtype(device) == torch.bfloat16:
            self._config("GradScaler is enabled with bf16 autocast: bf16 has fp32's range and needs no loss scaling; the "
                         "scaler only adds work and skips. Build it with enabled=False under bf16 (as nanoGPT does).",
                         {"check": "scaler_with_bf16", "device": device})  # fmt: skip
        elif on and device not in on:
            self._config(f"autocast is on for {', '.join(sorted(on))} but the model runs on {device}: its forward runs in "
                         f"full precision. Use torch.autocast('{device}', ...).", {"check": "autocast_device", "device": device})  # fmt: skip
        elif scaler_on and device not in on:
            self._config(f"GradScaler is enabled but the forward runs without autocast on {device}: there is nothing "
                         "to scale. Wrap the forward in torch.autocast, or disable the scaler.",
                         {"check": "scaler_without_autocast", "device": device})  # fmt: skip

    # -- scaler path ----------------------------------------------------------------------
    def on_scale(self, outputs: Any) -> None:
        """The loss is the tensor handed to `scaler.scale()`, summed over micro-batches."""
        self._scale_calls += 1
        self._ever_scaled = True
        if getattr(outputs, "numel", None) is not None and outputs.numel() == 1:
            self._current.losses.append(outputs.detach())

    def on_unscaled(self, optimizer: Any) -> None:
        """Right after `unscale_` the gradients are true and not yet clipped: take their norm."""
        self._take_norm(optimizer, None)

    def before_step(self, scaler: Any, optimizer: Any) -> None:
        """Remember the stage for diagnosis; fused optimizers unscale in their kernel: norm of grads / scale."""
        state = scaler._per_optimizer_states.get(id(optimizer))
        self._stage_before = state["stage"].name if state else "READY"
        self._last_optimizer = optimizer
        if not scaler.is_enabled():
            return
        if self._scale_calls == 0 and self._ever_scaled and not self._silent_reported and _grads(optimizer):
            self._silent_reported = True
            self._misuse("backward() without scaler.scale()", "unscaled_backward", SILENT_UNSCALED, "warning", {})
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            self._take_norm(optimizer, scaler._scale)

    def on_error(self, optimizer: Any, error: BaseException) -> None:
        """GradScaler raised: record the likely cause and its fix (the error itself propagates)."""
        optimizer = optimizer if optimizer is not None else self._last_optimizer
        if optimizer is None or id(error) == self._last_error:
            return
        self._last_error = id(error)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        model = self._model
        signature = Signature(
            message=str(error),
            stage=self._stage_before,
            params_with_grad=sum(p.grad is not None for p in params),
            replaced_params=_replaced(params, model) if model is not None else None,
            model_has_grads=any(p.grad is not None for p in model.parameters()) if model is not None else None,
            scaled_this_iteration=self._scale_calls > 0,
        )
        found = classify(signature)
        if found is not None:
            cause, explanation = found
            details = {"cause": cause, "error": str(error), "stage": signature.stage,
                       "params_with_grad": signature.params_with_grad, "replaced_params": signature.replaced_params}  # fmt: skip
            self._misuse(f"{type(error).__name__}: {error}", cause, explanation, "critical", details)

    def before_update(self, scaler: Any) -> None:
        """Keep found_inf (update() discards it), and copy the scale when the shadow needs an anchor."""
        record = self._current
        record.found = []
        if not scaler.is_enabled() or scaler._scale is None:
            return
        record.found = [t for state in scaler._per_optimizer_states.values() for t in state["found_inf_per_device"].values()]
        record.rule = (scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval)
        if record.found and (self.reanchor or self.step % ANCHOR_EVERY == 0):
            record.anchor = (scaler._scale.clone(), scaler._growth_tracker.clone())
            self.reanchor = False

    def after_update(self) -> None:
        """The iteration is over: record it at its step and start the next."""
        if self._current.found:
            self._finish_step()

    # -- optimizer path (no scaler, or a disabled one) -------------------------------------
    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # A closure (Lightning, LBFGS) computes the gradients inside step(): take the norm after it.
        if (args[0] if args else kwargs.get("closure")) is None:
            guarded(self._take_norm, optimizer, None)

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        guarded(self._take_norm, optimizer, None)  # no-op unless step() ran a closure
        guarded(self._record_optimizer_step)

    def _record_optimizer_step(self) -> None:
        self._current.found = []
        self._finish_step()

    # -- shared ---------------------------------------------------------------------------
    def _finish_step(self) -> None:
        """Record this iteration at its step (what the user logged under a standard name wins)."""
        record = self._current
        if not self._mine("loss"):
            record.losses = []
        if not self._mine("grad_norm"):
            record.groups = []
        if self._optimizers and (self.step % self.param_interval == 0 or self._probe_armed()):
            import torch

            record.params = torch._foreach_norm([p.detach() for o in self._optimizers for g in o.param_groups for p in g["params"]])
        lr = self._optimizers[0].param_groups[0].get("lr") if self._optimizers else None
        record.lr = lr if isinstance(lr, float) and self._mine("lr") else None
        self._record((STEP, self.step, record))
        self._probe_step()
        self.step += 1
        self._current = StepRecord()
        self._normed.clear()
        self._scale_calls = 0

    def _take_norm(self, optimizer: Any, scale: Any) -> None:
        """Per-parameter gradient norms: one op here, everything else on the sender thread."""
        if id(optimizer) in self._normed:
            return
        self._normed.add(id(optimizer))
        params = _grads(optimizer)
        if not params:
            return
        import torch

        modules = self._modules(params) if self._model is not None and self.step % self.layer_interval == 0 else None
        self._current.groups.append((torch._foreach_norm([p.grad for p in params]), scale is not None, modules))

    def _modules(self, params: list[Any]) -> tuple[str, ...]:
        """The module of each parameter, cached per parameter set."""
        key = tuple(map(id, params))
        if key not in self._layer_names:
            if len(self._layer_names) >= 16:  # the parameter set keeps changing (MoE, layer drop): start over
                self._layer_names.clear()
            if any(id(p) not in self._module_of for p in params):  # parameters were replaced: look again
                self._module_of = {id(p): n.rpartition(".")[0] or "(root)" for n, p in self._model.named_parameters()}
            self._layer_names[key] = tuple(self._module_of.get(id(p), "(unnamed)") for p in params)
        return self._layer_names[key]

    def _probe_armed(self) -> bool:
        return self._probe is not None and self._probe.armed

    def _probe_step(self) -> None:
        probe = self._probe
        if probe is None:
            return
        if probe.armed:
            import torch

            fwd_names, fwd, bwd_names, bwd = probe.take()
            if fwd or bwd:
                flags = (torch.stack(fwd) if fwd else None, torch.stack(bwd) if bwd else None)
                self._record((ORIGIN, self.step, self._arming, fwd_names, flags[0], bwd_names, flags[1]))
            probe.steps_left -= 1
            if probe.steps_left <= 0 or self.disarm_request:
                probe.disarm()
                self.disarm_request = False
        if self.arm_request and not probe.armed:
            self.arm_request = False
            self._arming += 1
            probe.arm(ARM_STEPS)

    def _config(self, message: str, details: dict[str, Any]) -> None:
        self._record((EVENT, self.step, self._event("amp_config", "warning", message, details)))

    def _misuse(self, what: str, cause: str, explanation: str, severity: str, details: dict[str, Any]) -> None:
        message = f"{what} at step {self.step}. {explanation}"
        log.error("ampwatch: %s", message)
        self._record((EVENT, self.step, self._event("scaler_misuse", severity, message, {"cause": cause, **details})))

    def _event(self, kind: str, severity: str, message: str, details: dict[str, Any]) -> dict[str, Any]:
        return {"step": self.step, "rank": self.rank, "type": kind, "severity": severity, "message": message,
                "details": details, "time": time.time()}  # fmt: skip


def _replaced(params: list[Any], model: Any) -> int:
    """Optimizer parameters missing from the model that have the shape of a model parameter the
    optimizer lacks: the signature of parameters swapped after the optimizer was built."""
    held = {id(p) for p in params}
    orphans = [tuple(p.shape) for p in model.parameters() if id(p) not in held]
    in_model = {id(p) for p in model.parameters()}
    count = 0
    for p in params:
        if id(p) not in in_model and tuple(p.shape) in orphans:
            orphans.remove(tuple(p.shape))
            count += 1
    return count


def _unwrap(optimizer: Any) -> Any:
    """The optimizer a wrapper (Accelerate's `AcceleratedOptimizer`) delegates to: only its step hooks fire."""
    while hasattr(getattr(optimizer, "optimizer", None), "param_groups"):
        optimizer = optimizer.optimizer
    return optimizer


def _grads(optimizer: Any) -> list[Any]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
