"""The watched GradScaler: the instance's class is swapped for a subclass whose methods report to the
run's Recorder. GradScaler's own exceptions pass through unchanged; pickling, deep copies and
`state_dict` behave as for the plain class, and `detach` restores it."""

from __future__ import annotations

import copyreg
import weakref
from typing import Any

from ampwatch._guard import guarded

_WATCHED: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()  # scaler -> Recorder
_CLASSES: dict[type, type] = {}  # plain scaler class -> its watching subclass


def attach(scaler: Any, recorder: Any) -> None:
    """Route `scaler`'s scale/unscale_/step/update through `recorder`."""
    _WATCHED[scaler] = recorder
    scaler.__class__ = _watched_class(type(scaler))


def detach(scaler: Any, recorder: Any) -> None:
    """Undo `attach`, if `recorder` is still the one attached."""
    if _WATCHED.get(scaler) is recorder:
        del _WATCHED[scaler]
        scaler.__class__ = _plain_class(type(scaler))


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
    rec = _WATCHED.get(self)
    try:
        super(type(self), self).unscale_(optimizer)
    except (AssertionError, RuntimeError) as error:
        if rec is not None:
            guarded(rec.on_error, optimizer, error)
        raise
    if rec is not None:
        guarded(rec.on_unscaled, optimizer)


def _step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    rec = _WATCHED.get(self)
    if rec is not None:
        guarded(rec.before_step, self, optimizer)
    try:
        return super(type(self), self).step(optimizer, *args, **kwargs)
    except (AssertionError, RuntimeError) as error:
        if rec is not None:
            guarded(rec.on_error, optimizer, error)
        raise


def _update(self: Any, new_scale: Any = None) -> None:
    rec = _WATCHED.get(self)
    if rec is not None:
        guarded(rec.before_update, self)
    try:
        super(type(self), self).update(new_scale)
    except (AssertionError, RuntimeError) as error:
        if rec is not None:
            guarded(rec.on_error, None, error)
        raise
    if rec is not None:
        guarded(rec.after_update)
        rec.reanchor = rec.reanchor or new_scale is not None  # set by hand: the shadow cannot know it


def _load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
    super(type(self), self).load_state_dict(state_dict)
    rec = _WATCHED.get(self)
    if rec is not None:
        rec.reanchor = True  # a checkpoint's scale: copy it from the device at the next update()


def _reduce_ex(self: Any, protocol: int) -> Any:
    """Pickle and deep-copy as the plain scaler: the copy is not watched, and loading a checkpoint
    that holds it needs no ampwatch."""
    return (copyreg._reconstructor, (_plain_class(type(self)), object, None), self.__getstate__())


_WATCHED_METHODS = {
    "scale": _scale,
    "unscale_": _unscale_,
    "step": _step,
    "update": _update,
    "load_state_dict": _load_state_dict,
    "__reduce_ex__": _reduce_ex,
}
