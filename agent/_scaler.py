"""What the agent hooks in torch: the watched GradScaler, and `torch.nn.utils.clip_grad_norm_`.

The scaler instance gets wrappers of its methods in its own `__dict__`, next to the run's Recorder; its
class stays what it was (`type(scaler) is torch.amp.GradScaler` still holds while it is watched).
GradScaler's own exceptions pass through unchanged; pickling, deep copies and `state_dict` behave as
for the plain scaler, and `detach` removes the wrappers. They run four times per training step, so
they are kept flat: one dict read, an inline guard, and the class's own method.

While a run watches, `torch.nn.utils.clip_grad_norm_` is wrapped too: the total norm it returns
(after `unscale_`: the true norm) is handed to the Recorder, which then need not compute its own. Its
arguments and result pass through untouched; code that imported the function before `watch` keeps the
original, and the agent then simply computes the norm itself. Without an enabled scaler no `unscale_` says
when the gradients are final, so the moment just before a clip changes them is hooked instead: torch's
`clip_grad._clip_grads_with_norm_` (which every `clip_grad_norm_` calls, however it was imported), and
`clip_grad_value_` (see BEFORE).
"""

from __future__ import annotations

import copyreg
import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

from ampwatch import _misuse
from ampwatch._guard import guarded, report

RECORDER = "_ampwatch_recorder"  # the instance attribute holding the Recorder; never pickled
SETTERS = ("load_state_dict", "set_growth_factor", "set_backoff_factor", "set_growth_interval")
# What GradScaler raises on misuse (a fused optimizer stepped after unscale_ before backward: AttributeError; fp16
# parameters: ValueError)
MISUSE_ERRORS = (AssertionError, RuntimeError, AttributeError, ValueError)
HOOKED = ("scale", "unscale_", "step", "update", "__reduce_ex__", *SETTERS)  # the wrappers' names in the instance dict


def attach(scaler: Any, recorder: Any) -> None:
    """Route `scaler`'s scale/unscale_/step/update through `recorder` (another recorder's lean-path hooks,
    if any are in place, make way for the full wrappers)."""
    state = scaler.__dict__
    if state.get(RECORDER) is not recorder:
        state.update(_wrappers(scaler, state))
    state[RECORDER] = recorder


def detach(scaler: Any, recorder: Any) -> None:
    """Undo `attach`, if `recorder` is still the one attached."""
    state = scaler.__dict__
    if state.get(RECORDER) is recorder:
        for name in (RECORDER, *HOOKED):
            state.pop(name, None)


def _wrappers(scaler: Any, state: dict[str, Any]) -> dict[str, Any]:
    """Functions that report to the Recorder in `state` (the scaler's `__dict__`), then call the scaler's own
    methods (its class's, looked up once)."""
    cls = type(scaler)
    base_scale, base_unscale_, base_step, base_update = cls.scale, cls.unscale_, cls.step, cls.update

    def scale(outputs: Any) -> Any:
        rec = state.get(RECORDER)
        if rec is not None:
            try:
                rec.on_scale(outputs)
            except Exception:
                report(rec.on_scale)
        return base_scale(scaler, outputs)

    def unscale_(optimizer: Any) -> None:
        rec = state.get(RECORDER)
        try:
            base_unscale_(scaler, optimizer)
        except MISUSE_ERRORS as error:
            diagnose_error(rec, optimizer, error)
            raise
        if rec is not None:
            try:
                rec.on_unscaled(optimizer)
            except Exception:
                report(rec.on_unscaled)

    def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        rec = state.get(RECORDER)
        if rec is not None:
            try:
                rec.before_step(scaler, optimizer)
            except Exception:
                report(rec.before_step)
        try:
            return base_step(scaler, optimizer, *args, **kwargs)
        except MISUSE_ERRORS as error:
            diagnose_error(rec, optimizer, error)
            raise

    def update(new_scale: Any = None) -> None:
        rec = state.get(RECORDER)
        if rec is not None:
            try:
                rec.before_update(scaler, new_scale is not None)  # a scale set by hand: the shadow cannot know it
            except Exception:
                report(rec.before_update)
        try:
            base_update(scaler, new_scale)
        except MISUSE_ERRORS as error:
            diagnose_error(rec, None, error)
            raise

    def reanchoring(name: str) -> Any:
        """`load_state_dict` and the growth-rule setters: the shadow copies scale and rule again at the next
        update()."""
        method = getattr(cls, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = method(scaler, *args, **kwargs)
            rec = state.get(RECORDER)
            if rec is not None:
                rec.request_anchor()
            return result

        return functools.update_wrapper(wrapper, method)

    def reduce_ex(protocol: int) -> Any:
        """Pickle and deep-copy as the plain scaler: the copy is not watched, and loading a checkpoint that
        holds it needs no ampwatch."""
        plain = cls.__getstate__(scaler)
        for name in (RECORDER, *HOOKED):
            plain.pop(name, None)
        if protocol >= 2:  # (object's own form for these: torch.load(weights_only=True) allows no other)
            # (typeshed's copyreg leaves out __newobj__ and _reconstructor: hence the two ignores)
            return (copyreg.__newobj__, (cls,), plain)  # type: ignore[attr-defined]
        return (copyreg._reconstructor, (cls, object, None), plain)  # type: ignore[attr-defined]

    hooks = {"scale": scale, "unscale_": unscale_, "step": step, "update": update, "__reduce_ex__": reduce_ex}
    for name, hook in hooks.items():
        if name != "__reduce_ex__":
            functools.update_wrapper(hook, getattr(cls, name))
    return {**hooks, **{name: reanchoring(name) for name in SETTERS}}


def diagnose_error(rec: Any, optimizer: Any, error: BaseException) -> None:
    """GradScaler raised (the caller re-raises): let the Recorder record the likely cause."""
    if rec is not None:
        try:
            _misuse.diagnose(rec, optimizer, error)
        except Exception:
            report(_misuse.diagnose)


# -- clip_grad_norm_ --------------------------------------------------------------------------
_clip_listeners: dict[Any, Any] = {}  # Recorders that want the norms clip_grad_norm_ returns -> what to call with them
_clip_calls: tuple[Any, ...] = ()  # the latter, as the wrapper goes through them
_clip_original: Any = None
_Tensor: Any = None  # torch.Tensor, once a run listens
_before_listeners: set[Any] = set()  # Recorders without an enabled scaler: they take the norm just before a clip
_before: tuple[Any, ...] = ()  # the latter, as the functions below go through them
# What changes gradients, wrapped while a Recorder takes the norm before a clip: clip_grad_norm_'s own second half
# (however clip_grad_norm_ was imported), under its public name too (torchtitan's two-step clip), and value clipping.
BEFORE = (
    ("torch.nn.utils.clip_grad", "_clip_grads_with_norm_"),
    ("torch.nn.utils", "clip_grads_with_norm_"),
    ("torch.nn.utils.clip_grad", "clip_grad_value_"),
    ("torch.nn.utils", "clip_grad_value_"),
)
_before_wrapped: dict[tuple[str, str], tuple[Any, Any]] = {}  # (module, name) -> (torch's function, ours in its place)


def listen_to_clipping(recorder: Any, before: bool = False) -> None:
    """From now on, `recorder.on_clipped` sees each call of `torch.nn.utils.clip_grad_norm_`; with `before`, each
    clip first lets `recorder` take the norm of gradients it is about to change (see `norm_before_clip`)."""
    global _clip_original, _Tensor
    import torch.nn.utils
    import torch.nn.utils.clip_grad as clip_grad

    _Tensor = torch.Tensor
    (_before_listeners.add if before else _before_listeners.discard)(recorder)
    if _before_listeners and not _before_wrapped:
        wrappers: dict[Any, Any] = {}  # (one function under two names: one wrapper)
        for module_name, name in BEFORE:
            module, current = sys.modules[module_name], getattr(sys.modules[module_name], name, None)
            if callable(current):  # (an older torch may lack some: then `_clip_grad_norm_` notifies)
                wrapper = wrappers[current] = wrappers.get(current) or _changes_gradients(current)
                setattr(module, name, wrapper)
                _before_wrapped[(module_name, name)] = (current, wrapper)
    if recorder not in _clip_listeners:
        current = torch.nn.utils.clip_grad_norm_
        if current is not _clip_grad_norm_:
            _clip_original = current
            functools.update_wrapper(_clip_grad_norm_, current)
            torch.nn.utils.clip_grad_norm_ = _clip_grad_norm_
            if clip_grad.clip_grad_norm_ is current:
                clip_grad.clip_grad_norm_ = _clip_grad_norm_
        _clip_listeners[recorder] = recorder.on_clipped
    _listeners_changed()


def route_clipping(recorder: Any, on_clipped: Any) -> None:
    """What `recorder` listens to goes to `on_clipped` (same arguments as `Recorder.on_clipped`) from now on."""
    if recorder in _clip_listeners:
        _clip_listeners[recorder] = on_clipped
        _listeners_changed()


def _listeners_changed() -> None:
    global _clip_calls, _before
    _clip_calls = tuple(_clip_listeners.values())
    _before = tuple(_before_listeners)


def stop_listening(recorder: Any) -> None:
    """Undo `listen_to_clipping`; the last listener puts the original function back (if still ours there)."""
    if recorder not in _clip_listeners:  # (never imports torch: this runs at exit too)
        return
    del _clip_listeners[recorder]
    _before_listeners.discard(recorder)
    _listeners_changed()
    if not _before_listeners:
        for (module_name, name), (original, wrapper) in _before_wrapped.items():
            module = sys.modules.get(module_name)
            if getattr(module, name, None) is wrapper:
                setattr(module, name, original)
        _before_wrapped.clear()
    if not _clip_listeners:
        for name in ("torch.nn.utils", "torch.nn.utils.clip_grad"):
            module = sys.modules.get(name)
            if getattr(module, "clip_grad_norm_", None) is _clip_grad_norm_:
                # (the module is there: it was imported to be patched)
                module.clip_grad_norm_ = _clip_original  # type: ignore[union-attr]


def _clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
    calls = _clip_calls
    if calls and not isinstance(parameters, _Tensor):
        parameters = list(parameters)  # as clip_grad_norm_ does itself: a generator can be read only once
    if _before and ("torch.nn.utils.clip_grad", "_clip_grads_with_norm_") not in _before_wrapped:  # (an older torch)
        _notify_before(parameters)
    try:
        total = _clip_original(parameters, *args, **kwargs)
    except RuntimeError as error:  # (error_if_nonfinite=True)
        for recorder in tuple(_clip_listeners):
            guarded(_misuse.clip_raised, recorder, error)
        raise
    for on_clipped in calls:
        try:
            on_clipped(parameters, args, kwargs, total)
        except Exception:
            report(on_clipped)
    return total


def _changes_gradients(original: Any) -> Any:
    """`original`, a torch function that clips gradients in place, letting the Recorders take their norm first."""

    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if not _before:
            return original(parameters, *args, **kwargs)
        if not isinstance(parameters, _Tensor):
            parameters = list(parameters)  # (a generator can be read only once)
        _notify_before(parameters)
        try:
            return original(parameters, *args, **kwargs)
        finally:
            for (
                recorder
            ) in _before:  # the gradients' version after the clip: a later one means a backward added to them
                step = recorder.current
                mark = step.grad_mark
                grad = mark[0]() if mark is not None else None
                if grad is not None:
                    step.grad_mark = (mark[0], grad._version)

    return functools.update_wrapper(clip, original)


def _notify_before(parameters: Any) -> None:
    for recorder in _before:
        try:
            norm_before_clip(recorder, parameters)
        except Exception:
            report(norm_before_clip)


def norm_before_clip(recorder: Any, parameters: Any) -> None:
    """Without an enabled GradScaler no `unscale_` marks the gradients final: a clip of the first optimizer's
    parameters does, just before it changes them. The Recorder takes their norm now, or leaves it to the clip
    it trusts (`on_clipped` then hands it the result); `optimizer.step()`'s pre-hook finds it taken."""
    optimizers, step = recorder.optimizers, recorder.current
    first = optimizers[0] if optimizers else None
    if first is None:
        return
    grad = next((g for group in first.param_groups for p in group["params"] if (g := p.grad) is not None), None)
    if id(first) in step.normed:
        mark = step.grad_mark
        if mark is None or grad is None or mark[0]() is grad and mark[1] == grad._version:  # the same gradients
            return
        # New gradients since its norm was taken (the loop dropped that iteration without a step, a guard that skips
        # non-finite updates), or a backward added to them (a clip on every accumulated micro-batch): the norm again.
        step.forget_norm(first)
    ids = (id(parameters),) if isinstance(parameters, _Tensor) else map(id, parameters)
    if not recorder.clip.param_ids(first).isdisjoint(ids):
        step.grad_mark = (weakref.ref(grad), grad._version) if grad is not None else None
        recorder.on_unscaled(first)


def grads_dropped(optimizers: list[Any]) -> bool:
    """No watched optimizer holds a gradient: since the last `scale()`, the loop set them to None without a step (it
    dropped that iteration), so the loss held from it is not this iteration's."""
    return bool(optimizers) and all(
        p.grad is None for o in optimizers for group in o.param_groups for p in group["params"]
    )


def float32_norms(torch: Any) -> Callable[[list[Any]], Any]:
    """`torch._foreach_norm` in float32 at least: the norm of fp16 gradients (a `model.half()`) overflows at 65504 while
    none of their elements does (a float64 list keeps its own precision)."""
    foreach_norm, low = torch._foreach_norm, (torch.float16, torch.bfloat16)

    def norms(tensors: list[Any]) -> Any:
        if tensors and tensors[0].dtype in low:
            try:
                return foreach_norm(tensors, 2, dtype=torch.float32)
            except RuntimeError:  # (float64 tensors further on cannot be narrowed: each in its own precision)
                pass
        return foreach_norm(tensors)

    return norms
