"""The one guard between the training loop and the agent: log, never raise."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ampwatch")
_reported: set[str] = set()


def guarded(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call `fn`; an exception is logged once per function and swallowed (None is returned)."""
    try:
        return fn(*args, **kwargs)
    except Exception:
        report(fn)
        return None


def report(fn: Callable[..., Any]) -> None:
    """Log the exception being handled, once per function (for hot paths that inline `guarded`)."""
    key = getattr(fn, "__qualname__", repr(fn))
    if key not in _reported:
        _reported.add(key)
        log.exception("ampwatch: internal error in %s (training continues)", key)


def warn_once(key: str, message: str, *args: Any) -> None:
    """Log a warning about the user's input once per key."""
    if key not in _reported:
        _reported.add(key)
        log.warning(message, *args)


class Hook:
    """A hook the agent puts on the user's model or tensors. A copy of the model (an EMA's `copy.deepcopy`,
    `torch.save` of the whole module) gets an inert one instead: the agent's state must not travel with it
    (it holds locks and files), and the copy is not watched."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any] | None) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        fn = self.fn
        return None if fn is None else fn(*args)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Hook, (None,))

    def __deepcopy__(self, memo: dict[int, Any]) -> Hook:
        return Hook(None)
