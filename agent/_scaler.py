"""What the agent hooks in torch: the watched GradScaler, and `torch.nn.utils.clip_grad_norm_`.

The scaler instance's class is swapped for a subclass whose methods report to the run's Recorder, kept
on the instance itself. GradScaler's own exceptions pass through unchanged; pickling, deep copies and
`state_dict` behave as for the plain class, and `detach` restores it. These wrappers run four times per
training step, so they are kept flat: one attribute read, an inline guard, and the base method.

While a run watches a scaler, `torch.nn.utils.clip_grad_norm_` is wrapped too: the total norm it returns
(after `unscale_`: the true norm) is handed to the Recorder, which then need not compute its own. Its
arguments and result pass through untouched; code that imported the function before `watch` keeps the
original, and the agent then simply computes the norm itself.
"""

from __future__ import annotations

import copyreg
import functools
import sys
from typing import Any

from ampwatch._guard import report

RECORDER = "_ampwatch_recorder"  # the instance attribute holding the Recorder; never pickled
_CLASSES: dict[type, type] = {}  # plain scaler class -> its watching subclass


def attach(scaler: Any, recorder: Any) -> None:
    """Route `scaler`'s scale/unscale_/step/update through `recorder`."""
    scaler.__dict__[RECORDER] = recorder
    scaler.__class__ = _watched_class(type(scaler))


def detach(scaler: Any, recorder: Any) -> None:
    """Undo `attach`, if `recorder` is still the one attached."""
    if scaler.__dict__.get(RECORDER) is recorder:
        del scaler.__dict__[RECORDER]
        scaler.__class__ = _plain_class(type(scaler))


def _watched_class(base: type) -> type:
    """A subclass of the scaler's own class whose methods report to the run's Recorder."""
    if base in _CLASSES.values():
        return base
    if base not in _CLASSES:
        _CLASSES[base] = type(base.__name__, (base,), dict(_watched_methods(base), __module__=base.__module__))
    return _CLASSES[base]


def _plain_class(cls: type) -> type:
    return next((base for base, watched in _CLASSES.items() if watched is cls), cls)


def _watched_methods(base: type) -> dict[str, Any]:
    """The wrappers, calling `base`'s own methods directly (cheaper than `super()` four times a step)."""
    base_scale, base_unscale_, base_step, base_update = base.scale, base.unscale_, base.step, base.update  # type: ignore[attr-defined]

    def scale(self: Any, outputs: Any) -> Any:
        rec = self.__dict__.get(RECORDER)
        if rec is not None:
            try:
                rec.on_scale(outputs)
            except Exception:
                report(rec.on_scale)
        return base_scale(self, outputs)

    def unscale_(self: Any, optimizer: Any) -> None:
        rec = self.__dict__.get(RECORDER)
        try:
            base_unscale_(self, optimizer)
        except (AssertionError, RuntimeError) as error:
            _on_error(rec, optimizer, error)
            raise
        if rec is not None:
            try:
                rec.on_unscaled(optimizer)
            except Exception:
                report(rec.on_unscaled)

    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        rec = self.__dict__.get(RECORDER)
        if rec is not None:
            try:
                rec.before_step(self, optimizer)
            except Exception:
                report(rec.before_step)
        try:
            return base_step(self, optimizer, *args, **kwargs)
        except (AssertionError, RuntimeError) as error:
            _on_error(rec, optimizer, error)
            raise

    def update(self: Any, new_scale: Any = None) -> None:
        rec = self.__dict__.get(RECORDER)
        if rec is not None:
            try:
                rec.before_update(self, new_scale is not None)  # a scale set by hand: the shadow cannot know it
            except Exception:
                report(rec.before_update)
        try:
            base_update(self, new_scale)
        except (AssertionError, RuntimeError) as error:
            _on_error(rec, None, error)
            raise

    def reanchoring(name: str) -> Any:
        """`load_state_dict` and the growth-rule setters: the shadow copies scale and rule again at the next update()."""
        method = getattr(base, name)

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = method(self, *args, **kwargs)
            rec = self.__dict__.get(RECORDER)
            if rec is not None:
                rec.reanchor = True
            return result

        return functools.update_wrapper(wrapper, method)

    setters = ("load_state_dict", "set_growth_factor", "set_backoff_factor", "set_growth_interval")
    return {"scale": scale, "unscale_": unscale_, "step": step, "update": update, "__reduce_ex__": _reduce_ex,
            **{name: reanchoring(name) for name in setters}}  # fmt: skip


def _on_error(rec: Any, optimizer: Any, error: BaseException) -> None:
    if rec is not None:
        try:
            rec.on_error(optimizer, error)
        except Exception:
            report(rec.on_error)


def _reduce_ex(self: Any, protocol: int) -> Any:
    """Pickle and deep-copy as the plain scaler: the copy is not watched, and loading a checkpoint
    that holds it needs no ampwatch."""
    state = self.__getstate__()
    state.pop(RECORDER, None)
    return (copyreg._reconstructor, (_plain_class(type(self)), object, None), state)


# -- clip_grad_norm_ --------------------------------------------------------------------------
_clip_listeners: list[Any] = []  # Recorders that want the norms clip_grad_norm_ returns
_clip_original: Any = None
_Tensor: Any = None  # torch.Tensor, once a run listens


def listen_to_clipping(recorder: Any) -> None:
    """From now on, `recorder.on_clipped` sees each call of `torch.nn.utils.clip_grad_norm_`."""
    global _clip_original, _Tensor
    import torch.nn.utils
    import torch.nn.utils.clip_grad

    if recorder in _clip_listeners:
        return
    _Tensor = torch.Tensor
    current = torch.nn.utils.clip_grad_norm_
    if current is not _clip_grad_norm_:
        _clip_original = current
        functools.update_wrapper(_clip_grad_norm_, current)
        torch.nn.utils.clip_grad_norm_ = _clip_grad_norm_
        if torch.nn.utils.clip_grad.clip_grad_norm_ is current:
            torch.nn.utils.clip_grad.clip_grad_norm_ = _clip_grad_norm_
    _clip_listeners.append(recorder)


def stop_listening(recorder: Any) -> None:
    """Undo `listen_to_clipping`; the last listener puts the original function back (if still ours there)."""
    if recorder not in _clip_listeners:  # (never imports torch: this runs at exit too)
        return
    _clip_listeners.remove(recorder)
    if not _clip_listeners:
        for name in ("torch.nn.utils", "torch.nn.utils.clip_grad"):
            module = sys.modules.get(name)
            if getattr(module, "clip_grad_norm_", None) is _clip_grad_norm_:
                module.clip_grad_norm_ = _clip_original  # type: ignore[union-attr]


def _clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
    listeners = _clip_listeners
    if listeners and not isinstance(parameters, _Tensor):
        parameters = list(parameters)  # as clip_grad_norm_ does itself: a generator can be read only once
    total = _clip_original(parameters, *args, **kwargs)
    for rec in listeners:
        try:
            rec.on_clipped(parameters, args, kwargs, total)
        except Exception:
            report(rec.on_clipped)
    return total
