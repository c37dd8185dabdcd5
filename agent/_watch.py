"""Hooks into GradScaler and the optimizer that record the standard series of each step.

Everything on the training thread is a handful of asynchronous tensor ops and one deque append;
values reach the host on the sender thread, so no host-device sync is ever added here.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from ampwatch._guard import guarded
from ampwatch._worker import VALUES

STANDARD = frozenset({"loss", "scale", "skipped", "grad_norm"})
_WATCHED: "weakref.WeakKeyDictionary[Any, Recorder]" = weakref.WeakKeyDictionary()
_CLASSES: dict[type, type] = {}


class Recorder:
    """Per-run step state: the step counter and what the current iteration has seen so far."""

    def __init__(self, record: Callable[[tuple], None]) -> None:
        self._record = record
        self.step = 0
        self._loss: Any = None
        self._norms: list[Any] = []
        self._normed: set[int] = set()
        self._row: tuple[tuple[str, ...], Any] | None = None
        self._user_step = -1
        self._user_names: set[str] = set()
        self._hooks: list[Any] = []
        self._scaler: Any = None

    # -- what the user logged --------------------------------------------------------------
    def user_logged(self, step: int, names: tuple[str, ...]) -> None:
        """A standard name the user logs at a step replaces the agent's own value there."""
        if step != self._user_step:
            self._user_step, self._user_names = step, set()
        self._user_names.update(n for n in names if n in STANDARD)

    def _mine(self, name: str) -> bool:
        return self._user_step != self.step or name not in self._user_names

    # -- attaching ------------------------------------------------------------------------
    def watch(self, optimizer: Any, scaler: Any) -> None:
        """Hook the scaler when it is enabled, else count steps through the optimizer."""
        if scaler is not None:
            _WATCHED[scaler] = self
            scaler.__class__ = _watched_class(type(scaler))
            self._scaler = scaler
        if optimizer is not None and (scaler is None or not scaler.is_enabled()):
            self._hooks.append(optimizer.register_step_pre_hook(self._before_optimizer_step))
            self._hooks.append(optimizer.register_step_post_hook(self._after_optimizer_step))

    def unwatch(self) -> None:
        """Remove every hook; the scaler is its own class again."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        scaler = self._scaler
        if scaler is not None and _WATCHED.get(scaler) is self:
            del _WATCHED[scaler]
            scaler.__class__ = _plain_class(type(scaler))

    # -- scaler path ----------------------------------------------------------------------
    def on_scale(self, outputs: Any) -> None:
        """The loss is the tensor handed to `scaler.scale()`, summed over micro-batches."""
        if getattr(outputs, "numel", None) is None or outputs.numel() != 1:
            return
        loss = outputs.detach().reshape(())
        self._loss = loss if self._loss is None else self._loss + loss

    def on_unscaled(self, optimizer: Any) -> None:
        """Right after `unscale_` the gradients are true and not yet clipped: take their norm."""
        self._take_norm(optimizer, None)

    def before_step(self, scaler: Any, optimizer: Any) -> None:
        """Fused optimizers unscale inside their kernel: take the norm of scaled grads / scale."""
        if scaler.is_enabled() and getattr(optimizer, "_step_supports_amp_scaling", False):
            self._take_norm(optimizer, scaler._scale)

    def before_update(self, scaler: Any) -> None:
        """Snapshot scale and found_inf before `update()` overwrites them."""
        self._row = None
        if not scaler.is_enabled() or scaler._scale is None:
            return
        scale = scaler._scale
        found = [
            t for state in scaler._per_optimizer_states.values() for t in state["found_inf_per_device"].values()
        ]
        if not found:
            return  # update() is about to raise: nothing to record
        found_inf = found[0] if len(found) == 1 else sum(t.to(scale.device, non_blocking=True) for t in found)
        names, parts = ["scale", "skipped"], [scale, found_inf]
        self._add_common(names, parts)
        self._row = (tuple(names), _stack(parts))

    def after_update(self) -> None:
        """The iteration is over: record it at its step and start the next."""
        if self._row is not None:
            self._record((VALUES, self.step, *self._row))
            self._row = None
            self._next()

    # -- optimizer path (no scaler, or a disabled one) -------------------------------------
    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        guarded(self._take_norm, optimizer, None)

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        guarded(self._record_optimizer_step)

    def _record_optimizer_step(self) -> None:
        names: list[str] = []
        parts: list[Any] = []
        self._add_common(names, parts)
        if parts:
            self._record((VALUES, self.step, tuple(names), _stack(parts)))
        self._next()

    # -- shared ---------------------------------------------------------------------------
    def _add_common(self, names: list[str], parts: list[Any]) -> None:
        if self._loss is not None and self._mine("loss"):
            names.insert(0, "loss")
            parts.insert(0, self._loss)
        if self._norms and self._mine("grad_norm"):
            names.append("grad_norm")
            parts.append(_combine_norms(self._norms))

    def _take_norm(self, optimizer: Any, scale: Any) -> None:
        if id(optimizer) in self._normed:
            return
        self._normed.add(id(optimizer))
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        import torch

        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        self._norms.append(norm if scale is None else norm / scale)

    def _next(self) -> None:
        self.step += 1
        self._loss = None
        self._norms = []
        self._normed.clear()


def _stack(parts: list[Any]) -> Any:
    import torch

    return torch.stack([p.float() for p in parts])


def _combine_norms(norms: list[Any]) -> Any:
    if len(norms) == 1:
        return norms[0]
    import torch

    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))


def _watched_class(base: type) -> type:
    """A subclass of the scaler's own class whose methods report to the run's Recorder."""
    if base in _CLASSES.values():
        return base
    if base not in _CLASSES:
        _CLASSES[base] = type(base.__name__, (base,), dict(_WATCHED_METHODS, __module__=base.__module__))
    return _CLASSES[base]


def _plain_class(cls: type) -> type:
    return next((base for base, watched in _CLASSES.items() if watched is cls), cls)


def _scale(self: Any, outputs: Any) -> Any:
    rec = _WATCHED.get(self)
    if rec is not None:
        guarded(rec.on_scale, outputs)
    return super(type(self), self).scale(outputs)


def _unscale_(self: Any, optimizer: Any) -> None:
    super(type(self), self).unscale_(optimizer)
    rec = _WATCHED.get(self)
    if rec is not None:
        guarded(rec.on_unscaled, optimizer)


def _step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    rec = _WATCHED.get(self)
    if rec is not None:
        guarded(rec.before_step, self, optimizer)
    return super(type(self), self).step(optimizer, *args, **kwargs)


def _update(self: Any, new_scale: Any = None) -> None:
    rec = _WATCHED.get(self)
    if rec is not None:
        guarded(rec.before_update, self)
    super(type(self), self).update(new_scale)
    if rec is not None:
        guarded(rec.after_update)


def _reduce_ex(self: Any, protocol: int) -> Any:
    """Pickle and deep-copy as the plain scaler: the copy is not watched."""
    return (_rebuild, (_plain_class(type(self)), self.__getstate__()))


def _rebuild(cls: type, state: dict[str, Any]) -> Any:
    scaler = cls.__new__(cls)
    scaler.__setstate__(state)
    return scaler


_WATCHED_METHODS = {
    "scale": _scale,
    "unscale_": _unscale_,
    "step": _step,
    "update": _update,
    "__reduce_ex__": _reduce_ex,
}
