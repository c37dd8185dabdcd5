"""Leading indicators, collected on the training thread every `layer_interval` steps and read by the sender.

On an interval step (the steps that take per-layer gradient norms, see `ampwatch._cadence`) three signals are
reduced on the device, one scalar per module or parameter, and handed over as one INDICATORS record:

- `fp16_range/<module>`: the largest absolute value each leaf module output in the step's forward passes, as a
  fraction of fp16's largest finite value (65 504): one `vector_norm(inf)` per module, from forward hooks present
  only during that step;
- `update_ratio/<module>`: ||Δθ|| / ||θ|| of the module's parameters over the optimizer step: a copy of the
  parameters taken in an optimizer pre-step hook (present only during that step), subtracted in place after it;
- `adam_lag/<module>`: for Adam-family optimizers, how far the squared gradients ran ahead of the second moment
  `exp_avg_sq` (bias-corrected) they are divided by, on average over the steps since the last interval step: read
  from how much the moment grew over them (each step multiplies it by beta2 plus (1 - beta2) times that step's lag),
  so every step's gradients count, not one batch's. Over the module (one `_foreach_norm` of `exp_avg_sq`, its sum)
  or, for a module that reads the model's own inputs, over one column of its weight (one input feature) that was
  (nearly) silent at the last interval step, the larger: such a weight's column sums are kept on the device from one
  interval step to the next (one float per input).

No value is read here: the sender copies them with the step's other tensors and decodes them
(`ampwatch._indicator_values`); the diagnosis judges the series (`ampwatch._leading`). Between interval steps nothing
of this is in place.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ampwatch._guard import Hook, guarded, report
from ampwatch._leading import LAG, RANGE, UPDATE
from ampwatch._origin import _first_float_tensor, compiled_wrapper, wrapped
from ampwatch._protocol import INDICATORS

# A column whose second moment is below this share of its weight's mean column's was (nearly) silent: its lag is an
# input that wakes. Active columns lag together when the gradients' scale changes (the layer's own lag says so).
# Only the model's inputs count (the data: a feature that was ~0 and grows has no bound); a hidden unit that revives
# is the optimizer's own doing, and its Adam steps settle as its moment catches up.
DORMANT = 0.01
MAX_VALUES = 10_000  # forwards without an optimizer step (evaluation) must not grow the list forever


class Indicators:
    """The leading indicators of one watched model and its optimizers (owned by the training thread).

    `arm_for(step)` at the end of the step before an interval step puts the hooks in place; `end_of_step(step)` at
    the end of that step takes them away and records what they collected."""

    __slots__ = (
        "interval",
        "active",
        "_record",
        "_mailbox",
        "_optimizers",
        "_module_of",
        "_leaves",
        "_handles",
        "_values",
        "_names",
        "_fp16",
        "_before",
        "_then",
        "_inputs",
        "_readers",
        "_depth",
        "_calls",
        "_torch",
        "_norms",
        "_graph_task",
    )

    def __init__(
        self,
        model: Any,
        optimizers: Callable[[], list[Any]],
        module_of: Callable[[], dict[int, str]],
        interval: int,
        record: Callable[[tuple], Any],
        mailbox: Any,
        norms: Callable[[list[Any]], Any],
    ) -> None:
        import torch

        self._torch = torch
        self.interval = interval
        self.active = False
        self._record, self._mailbox, self._norms = record, mailbox, norms
        self._optimizers, self._module_of = optimizers, module_of
        chain = wrapped(model)
        # A compiled model runs its modules in one graph (hooks added later never run there, and on a model compiled
        # in place each arming would recompile it); TorchScript takes no hooks: no fp16_range for them.
        compiled = any(map(compiled_wrapper, chain)) or any(
            getattr(m, "_compiled_call_impl", None) is not None for m in chain
        )
        inner = chain[-1]
        hookable = not compiled and not isinstance(model, torch.jit.ScriptModule)
        modules = list(inner.named_modules()) if hookable else []
        # Blocks compiled in place one by one (`block.compile()`, as torchtitan does): their leaves are left alone.
        inside = tuple(f"{n}." for n, m in modules if getattr(m, "_compiled_call_impl", None) is not None)
        outside = [(n, m) for n, m in modules if not (inside and f"{n}.".startswith(inside))]
        self._leaves = [(n, m) for n, m in outside if n and not any(True for _ in m.children())]
        # The modules whose outermost call in a forward pass receives the model's inputs: the model and the modules
        # that hold others (a loop may call one itself); a leaf is called inside one of them.
        self._calls = [m for n, m in outside if not n or any(True for _ in m.children())]
        self._handles: list[Any] = []
        self._values: list[Any] = []  # the forward hooks' maxima (0-d float32 tensors), in call order
        self._names: list[str] = []  # and their modules
        self._fp16: set[str] = set()  # modules that output fp16 in this step
        self._before: dict[int, tuple[Any, list[Any], list[Any]]] = {}  # optimizer -> (it, params, copies)
        # Per Adam parameter at the last interval step: its exp_avg_sq summed, per column (2+ dimensions), its step
        self._then: dict[int, tuple[Any, Any, Any]] = {}
        self._inputs: set[int] = set()  # the storages of the float tensors the model received in this call
        self._readers: set[str] = set()  # the leaves seen reading one (or a view of one): the model's inputs' layers
        self._depth = 0  # module calls in progress
        self._graph_task = getattr(torch._C, "_current_graph_task_id", lambda: -1)

    def arm_for(self, step: int) -> None:
        """Put the hooks in place if `step` is an interval step."""
        if self.active or step % self.interval:
            return
        self.active = True
        # Not at step 0: a model compiled after watch() traces its first forward then, and would take the hooks into
        # its graph (recompiling at each arming after); hooks added to it later never run, as for the probe.
        for name, module in self._leaves if step else ():
            self._handles.append(module.register_forward_hook(self._hook_for(name)))
        # The model's inputs: what the outermost call of a forward pass receives (the watched model's, or a
        # submodule's where the loop calls that, as a LightningModule's training_step calls `self.net(x)`).
        enter, leave = Hook(self._guarded_enter), Hook(self._leave)
        for module in self._calls if self._handles else ():
            self._handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
            self._handles.append(module.register_forward_hook(leave, always_call=True))
        for optimizer in self._optimizers():
            if hasattr(optimizer, "register_step_pre_hook"):
                self._handles.append(optimizer.register_step_pre_hook(Hook(self._guarded_before_step)))

    def disarm(self) -> None:
        """Take every hook away; what they collected is dropped."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._values, self._names, self._before = [], [], {}
        self._fp16.clear()
        self._inputs.clear()
        self._depth = 0
        self.active = False

    def end_of_step(self, step: int) -> None:
        """After the optimizer step of an interval step: reduce, record and disarm."""
        if not self.active:
            return
        parts: list[tuple[str, list[str], list[Any], int, Any]] = []
        try:
            torch = self._torch
            with torch.no_grad():
                if self._values:
                    values = self._values
                    try:
                        stacked = [torch.stack(values)]  # one tensor for the sender to read and free
                    except RuntimeError:  # (outputs on several devices)
                        stacked = values
                    parts.append((RANGE, self._names, stacked, len(values), None))
                    fp16 = frozenset(self._fp16)
                    if fp16 != self._mailbox.fp16_layers:
                        self._mailbox.fp16_layers = fp16  # (replaced whole: the sender reads one or the other)
                for optimizer, params, copies in self._before.values():
                    parts.extend(self._after_step(optimizer, params, copies))
        except Exception:  # (never into the loop, nor in the way of the step's end: this step's indicators are lost)
            report(self.end_of_step)
            parts = []
        finally:
            self.disarm()
        if parts:
            self._record((INDICATORS, step, tuple(parts)))

    # -- hooks ---------------------------------------------------------------------------
    def _hook_for(self, name: str) -> Hook:
        def on_output(module: Any, args: Any, output: Any) -> None:
            guarded(self._on_output, name, args, output)

        return Hook(on_output)

    def _guarded_enter(self, module: Any, args: Any, kwargs: Any) -> None:
        self._depth += 1
        if self._depth == 1:
            guarded(self._on_inputs, args, kwargs)

    def _leave(self, module: Any, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def _on_inputs(self, args: Any, kwargs: Any) -> None:
        """A forward pass begins: note the float tensors' storages it was given (the leaves that read them are the
        model's inputs' layers). Only this call's: an earlier micro-batch's input may be freed and its memory hold this
        call's activations. Activation checkpointing's forwards inside the backward are not one."""
        if self._graph_task() != -1:
            return
        self._inputs.clear()
        for value in (*args, *kwargs.values()):
            inner = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
            for tensor in (value, *inner):
                storage = self._storage(tensor)
                if storage is not None and tensor.is_floating_point():
                    self._inputs.add(storage)

    def _storage(self, tensor: Any) -> int | None:
        """Where a dense tensor's memory starts: the same for its views (a slice of the inputs is the inputs)."""
        if not isinstance(tensor, self._torch.Tensor):
            return None
        local = getattr(tensor, "to_local", None)  # (a DTensor: its local shard's)
        tensor = tensor if local is None else local()
        return int(tensor.untyped_storage().data_ptr()) if tensor.layout is self._torch.strided else None

    def _on_output(self, name: str, args: Any, output: Any) -> None:
        torch = self._torch
        # Training forwards only, each once (activation checkpointing runs forwards again inside the backward).
        if len(self._values) >= MAX_VALUES or not torch.is_grad_enabled() or self._graph_task() != -1:
            return
        tensor = _first_float_tensor(output)
        if tensor is not None and tensor.numel():
            tensor = tensor.detach()
            local = getattr(tensor, "to_local", None)  # (a DTensor: this rank's part, no collective)
            tensor = tensor if local is None else local()
            if tensor.dtype is torch.float16:
                self._fp16.add(name)
            self._values.append(torch.linalg.vector_norm(tensor, math.inf, dtype=torch.float32))
            self._names.append(name)
        if name not in self._readers and self._inputs and args and self._storage(args[0]) in self._inputs:
            self._readers.add(name)

    def _guarded_before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        guarded(self._before_step, optimizer)

    def _before_step(self, optimizer: Any) -> None:
        """The optimizer is about to step (so GradScaler found its gradients finite): copy what it updates."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            return
        with self._torch.no_grad():
            copies = list(self._torch._foreach_mul(params, 1.0))
        self._before[id(optimizer)] = (optimizer, params, copies)

    def _after_step(self, optimizer: Any, params: list[Any], copies: list[Any]) -> list[tuple]:
        torch, norms = self._torch, self._norms
        modules = self._modules(params)
        torch._foreach_sub_(copies, params)  # (the copy becomes before - after, in place: no second copy)
        parts: list[tuple] = [(UPDATE, modules, [*norms(copies), *norms(params)], 2 * len(params), None)]
        # Adam's second moment: each parameter's exp_avg_sq summed now and at the last interval step, with the group's
        # beta2 and both step counts (the sender recovers the interval's lag from them, see `_lags`).
        held_by, moments = [], []
        state = optimizer.state
        index = {id(p): i for i, p in enumerate(params)}
        for group in optimizer.param_groups:
            beta = group.get("betas")
            if not isinstance(beta, (tuple, list)) or len(beta) < 2 or not isinstance(beta[1], float):
                continue
            count = None
            for p in group["params"]:
                held = state.get(p) if id(p) in index else None
                if not held or "exp_avg_sq" not in held or p.grad is None or p.grad.is_sparse or p.is_complex():
                    continue
                if count is None:
                    step = held.get("step")
                    count = step.detach().clone() if isinstance(step, torch.Tensor) else float(step or 0)
                held_by.append((p, beta[1], count))
                moments.append(held["exp_avg_sq"])
        if not moments:
            return parts
        names, betas, nows, thens, columns = [], [], [], [], []
        counts: list[Any] = []  # the step counts (floats, or tensors the sender reads), each once
        at: dict[int, int] = {}  # id(count) -> index in counts
        for (p, beta2, count), moment, total in zip(held_by, moments, torch._foreach_norm(moments, 1)):
            reads_inputs = modules[index[id(p)]] in self._readers
            sums = _column_sums(moment) if moment.dim() >= 2 and reads_inputs else None
            previous = self._then.get(id(p))
            self._then[id(p)] = (total, sums, count)
            if previous is None:
                continue
            total_then, sums_then, count_then = previous
            for c in (count, count_then):
                if id(c) not in at:
                    at[id(c)] = len(counts)
                    counts.append(c)
            names.append(modules[index[id(p)]])
            betas.append((beta2, at[id(count)], at[id(count_then)]))
            nows.append(total)
            thens.append(total_then)
            if sums is not None and sums_then is not None and sums.shape == sums_then.shape:
                columns.append((len(names) - 1, _column_growth(torch, sums, sums_then)))
        if names:
            read = [c for c in counts if isinstance(c, torch.Tensor)]
            tensors = [*nows, *thens, *(t for _, t in columns), *read]
            extra = (betas, [c if isinstance(c, float) else None for c in counts], [i for i, _ in columns])
            parts.append((LAG, names, tensors, len(tensors), extra))
        return parts

    def _modules(self, params: list[Any]) -> list[str]:
        module_of = self._module_of()
        return [module_of.get(id(p), "(unnamed)") for p in params]


def _column_sums(moment: Any) -> Any:
    """A weight's exp_avg_sq summed per column (dim 1: its inputs; a convolution's input channels, its kernel summed),
    in float32: a temporary of one float per input."""
    moment = moment.detach().float()
    if moment.dim() > 2:
        moment = moment.flatten(2).sum(2)
    return moment.sum(0)


def _column_growth(torch: Any, now: Any, then: Any) -> Any:
    """The largest growth of a column's second moment (`now` / `then`, the column sums) over the interval, among the
    columns that were (nearly) silent at its start (below `DORMANT` of the mean column): an input that wakes lags in
    its own column while the rest of the layer, summed with it, keeps up. 0 when none was silent; a 0-d float32
    tensor."""
    growth = torch.where(then > 0, now / then, math.inf)
    silent = (then < DORMANT * then.mean()) & (now > 0)
    return torch.where(silent, growth, 0.0).max()
