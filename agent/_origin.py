"""Where a NaN came from: after a non-finite event, hook every leaf module for a few steps.

The next occurrence names the first module whose output (forward) or output gradient (backward) went
non-finite. Each hook adds one `isfinite().all()` per module on the device, read on the sender thread;
nothing is replayed (replaying consumes RNG and moves BatchNorm statistics).
"""

from __future__ import annotations

from typing import Any

from ampwatch._guard import guarded

INPUT = "(input batch)"
MAX_FLAGS = 10_000  # forwards without an optimizer step (evaluation) must not grow the lists forever


def _first_float_tensor(value: Any) -> Any:
    if getattr(value, "is_floating_point", None) is not None:
        return value if value.is_floating_point() else None
    if isinstance(value, (tuple, list)):
        return next((t for t in map(_first_float_tensor, value) if t is not None), None)
    if isinstance(value, dict):
        return next((t for t in map(_first_float_tensor, value.values()) if t is not None), None)
    return None


class OriginProbe:
    """Forward and output-gradient hooks on a model's leaf modules, present only while armed."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._handles: list[Any] = []
        self.forward: list[tuple[str, Any]] = []
        self.backward: list[tuple[str, Any]] = []
        self.steps_left = 0
        self.armed = False  # a plain attribute: the recorder reads it every step

    def arm(self, steps: int) -> None:
        """Hook every leaf module (and the model's input) for the next `steps` iterations."""
        if self.armed:
            self.steps_left = steps
            return
        self.steps_left = steps
        self.armed = True
        self._handles.append(self._model.register_forward_pre_hook(self._on_input))
        for name, module in self._model.named_modules():
            if name and not any(True for _ in module.children()):
                self._handles.append(module.register_forward_hook(self._hook_for(name)))

    def disarm(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.armed = False
        self.forward.clear()
        self.backward.clear()

    def take(self) -> tuple[list[str], list[Any], list[str], list[Any]]:
        """This iteration's flags (True = non-finite), in forward order and in backward order."""
        fwd, bwd = self.forward, self.backward
        self.forward, self.backward = [], []
        return [n for n, _ in fwd], [f for _, f in fwd], [n for n, _ in bwd], [f for _, f in bwd]

    def _on_input(self, module: Any, args: Any) -> None:
        guarded(self._flag, self.forward, INPUT, _first_float_tensor(args))

    def _hook_for(self, name: str) -> Any:
        def on_output(module: Any, args: Any, output: Any) -> None:
            guarded(self._on_output, name, _first_float_tensor(output))

        return on_output

    def _on_output(self, name: str, tensor: Any) -> None:
        self._flag(self.forward, name, tensor)
        if tensor is not None and tensor.requires_grad:
            tensor.register_hook(lambda grad: guarded(self._flag, self.backward, name, grad))

    @staticmethod
    def _flag(flags: list[tuple[str, Any]], name: str, tensor: Any) -> None:
        """True (on the device) where `tensor` holds a NaN or an Inf; sparse or nested tensors fail into the guard."""
        if tensor is not None and len(flags) < MAX_FLAGS:
            flags.append((name, ~tensor.detach().isfinite().all()))
