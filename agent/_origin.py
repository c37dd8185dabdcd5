"""Where a NaN came from: after a non-finite event, hook every leaf module for a few steps.

The next occurrence names the first module whose output (forward) or output gradient (backward) went
non-finite. Each hook adds one `isfinite().all()` per module on the device, read on the sender thread;
nothing is replayed (replaying consumes RNG and moves BatchNorm statistics). `Diagnosis`, the sender's side,
arms the probe after such an event and turns its first hit into an event naming the module.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from ampwatch._capture import Captured
from ampwatch._context import Columns, Event, Thresholds
from ampwatch._diagnose import Analyzer
from ampwatch._guard import Hook, guarded

log = logging.getLogger("ampwatch")

INPUT = "(input batch)"
COMPILED = "(compiled model)"  # the output of torch.compile's wrapper (see `compiled_wrapper`)
ARM_STEPS = 20  # iterations the origin probe stays armed after a non-finite event (at first: see `OriginProbe.arm`)
MAX_ARM_STEPS = 320
QUIET_STEPS, MAX_QUIET_STEPS = (
    200,
    3200,
)  # after an origin is named again, steps whose events arm no probe (see Diagnosis)
MAX_FLAGS = 10_000  # forwards without an optimizer step (evaluation) must not grow the lists forever


def _first_float_tensor(value: Any) -> Any:
    if getattr(value, "is_floating_point", None) is not None:
        return value if value.is_floating_point() else None
    if isinstance(value, (tuple, list)):
        return next((t for t in map(_first_float_tensor, value) if t is not None), None)
    if isinstance(value, dict):
        return next((t for t in map(_first_float_tensor, value.values()) if t is not None), None)
    return None


def compiled_wrapper(model: Any) -> bool:
    """Whether `model` is torch.compile's wrapper (an `OptimizedModule`): the modules inside it run in its graph, where
    hooks added after it was compiled never run (dynamo does not guard on them), while its own hooks run outside."""
    frames = sys.modules.get("torch._dynamo.eval_frame")  # (not imported: nothing was compiled)
    return frames is not None and isinstance(model, getattr(frames, "OptimizedModule", ()))


def wrapped(model: Any) -> list[Any]:
    """`model` and the models that the wrappers around it run, outermost first: torch.compile's (`_orig_mod`),
    DistributedDataParallel's and DataParallel's (`module`), in any order (nanoGPT's DDP of a compiled model)."""
    import torch

    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    chain = [model]
    while True:
        if compiled_wrapper(model):
            model = model._orig_mod
        elif isinstance(model, parallel):
            model = model.module
        else:
            return chain
        chain.append(model)


def module_names(model: Any) -> dict[int, str]:
    """The module of each parameter, by id, named as in the model that wrappers run (no `_orig_mod.` or `module.`), so
    that a run's per-layer series are named the same whether it compiles or not, on one device or with DDP."""
    return {id(p): n.rpartition(".")[0] or "(root)" for n, p in wrapped(model)[-1].named_parameters()}


class OriginProbe:
    """Forward and output-gradient hooks on a model's leaf modules, present only while armed."""

    def __init__(self, model: Any) -> None:
        import torch

        self._model = model
        self.hookable = not isinstance(model, torch.jit.ScriptModule)  # (TorchScript takes no module hooks)
        self._handles: list[Any] = []
        self.forward: list[tuple[str, Any]] = []
        self.backward: list[tuple[str, Any]] = []
        self._passes: list[int] = []  # where each forward pass began in `backward` (accumulated micro-batches)
        self.inputs: dict[int, Any] = {}  # an input flag's index in `forward` -> its forward's Capture.take()
        self.capture: Any = None  # the run's ampwatch._capture.Capture while armed with AMPWATCH_CAPTURE_DIR set
        self.steps_left = 0
        self.window = ARM_STEPS  # how many iterations the last arming lasts
        self.armed = False  # a plain attribute: the recorder reads it every step
        chain = wrapped(model)
        self._inner = chain[-1]  # (its modules are named as per-layer series are: see module_names)
        self.compiled = any(map(compiled_wrapper, chain))
        self.blind_said = False  # whether the recorder said that an armed step's forward did not run the hooks
        # -1 outside a backward pass; inside one, activation checkpointing runs forwards again to recompute activations
        self._graph_task = getattr(torch._C, "_current_graph_task_id", lambda: -1)

    def arm(self, missed: bool = False) -> None:
        """Hook every leaf module (and the model's input) for the next `window` iterations: `ARM_STEPS`, or after an
        arming that `missed` (it ended before the non-finite values came back: a bad batch now and then), twice as many
        as that one, up to `MAX_ARM_STEPS`."""
        self.window = min(2 * self.window, MAX_ARM_STEPS) if missed else ARM_STEPS
        self.steps_left = self.window
        if self.armed or not self.hookable:
            return
        self.armed = True
        self._handles.append(self._model.register_forward_pre_hook(Hook(self._on_input), with_kwargs=True))
        if self.compiled:  # (the modules inside would not run their hooks: the outermost output, outside the graph)
            self._handles.append(self._model.register_forward_hook(self._hook_for(COMPILED)))
            return
        for name, module in self._inner.named_modules():
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
        self._passes.clear()
        self.inputs = {}

    def take(self) -> tuple[list[str], list[Any], list[str], list[Any]]:
        """This iteration's flags (True = non-finite), in forward order and in backward order. In backward order, an
        `INPUT` entry (its flag a copy of the next one's, never read) begins each pass after the first: the
        micro-batches of gradient accumulation each have their own forward and backward."""
        fwd, bwd, starts = self.forward, self.backward, self._passes
        self.forward, self.backward, self._passes = [], [], []
        for at in reversed(sorted(set(starts) - {0, len(bwd)})):
            bwd.insert(at, (INPUT, bwd[at][1]))
        return [n for n, _ in fwd], [f for _, f in fwd], [n for n, _ in bwd], [f for _, f in bwd]

    def take_inputs(self) -> dict[int, Any]:
        """This iteration's copies of the model's inputs (with a capture: see ampwatch._capture), by the index of
        their input flag in `take()`'s forward order."""
        inputs, self.inputs = self.inputs, {}
        return inputs

    def _on_input(self, module: Any, args: Any, kwargs: Any = None) -> None:
        if self._graph_task() != -1:  # (a recomputation: not a pass of its own)
            return
        self._passes.append(len(self.backward))
        at = len(self.forward)
        batch = _first_float_tensor(args)
        if batch is None and kwargs:  # (a model called with keywords, `model(pixel_values=x)`: the batch is there)
            batch = _first_float_tensor(kwargs)
        guarded(self._flag, self.forward, INPUT, batch)
        capture = self.capture
        if capture is not None and len(self.forward) > at:  # (an armed step: copies are taken only then)
            self.inputs[at] = guarded(capture.take, args, kwargs or {})

    def _hook_for(self, name: str) -> Hook:
        def on_output(module: Any, args: Any, output: Any) -> None:
            guarded(self._on_output, name, _first_float_tensor(output))

        return Hook(on_output)

    def _on_output(self, name: str, tensor: Any) -> None:
        if self._graph_task() == -1:  # (a recomputation's outputs were flagged in the forward; their gradients are new)
            self._flag(self.forward, name, tensor)
        # (not on a leaf, such as a Parameter a module returns as it is: a leaf's hooks stay for good)
        if tensor is not None and tensor.requires_grad and tensor.grad_fn is not None:
            tensor.register_hook(lambda grad: guarded(self._flag, self.backward, name, grad))

    @staticmethod
    def _flag(flags: list[tuple[str, Any]], name: str, tensor: Any) -> None:
        """True (on the device) where `tensor` holds a NaN or an Inf; sparse or nested tensors fail into the guard. A
        DTensor (tensor parallelism) is judged by this rank's part: reducing the whole would be a collective, issued by
        a probe that the ranks arm at different steps."""
        if tensor is not None and len(flags) < MAX_FLAGS:
            tensor = tensor.detach()
            local = getattr(tensor, "to_local", None)
            flags.append((name, ~(tensor if local is None else local()).isfinite().all()))


def _scheduled(optimizer: Any) -> bool:
    """Whether a torch LR scheduler was built on `optimizer` (each wraps its `step`, marking the wrapper)."""
    return hasattr(getattr(optimizer, "step", None), "_wrapped_by_lr_sched")


class Diagnosis:
    """The analyzer plus the NaN-origin loop: a non-finite event arms the recorder's probe; the probe's
    first hit names the module (once per arming; the probe stays armed its few steps for the per-layer heatmap).
    Once the same origin is named twice in a row, events of the next `QUIET_STEPS` steps arm no probe (each arming
    costs its steps time, and would most likely name it again); twice as many each time it comes back. (After a first
    naming the probe still arms: another problem, a layer that overflows after a bad batch, gets its own origin.)"""

    _ARMING_TYPES = frozenset({"nonfinite_loss", "nonfinite_grad", "nonfinite_param"})

    def __init__(self, mailbox: Any, rank: int = 0, thresholds: Thresholds | None = None) -> None:
        self.analyzer = Analyzer(rank, thresholds)
        self._mailbox = mailbox  # (ampwatch._mailbox.Mailbox: what the training thread tells, and the probe's requests)
        self._found: set[int] = set()
        self._named: tuple[str, str] | None = None  # the last origin named (module, phase)
        self._quiet = (0, 0, 0)  # the steps [from, until) after it whose events arm no probe, and their count

    def _saved(
        self, step: int, index: int, forward: list[tuple[str, float]], inputs: dict[int, Any], details: dict[str, Any]
    ) -> str:
        """Write the copy of the input whose flag is `forward[index]` (AMPWATCH_CAPTURE_DIR); what the message adds."""
        captured = inputs.get(index)
        micro_batch = sum(1 for name, _ in forward[:index] if name == INPUT)  # (its pass: accumulated micro-batches)
        if isinstance(captured, Captured):
            try:
                path = self._mailbox.capture.write(step, captured, micro_batch)
            except Exception as error:  # (a full disk, a folder not writable: said in the event, never raised)
                reason = f"writing it to {self._mailbox.capture.directory} failed: {error}"
            else:
                details["capture"] = path
                return f" The batch was saved to {path}: torch.load() it to replay it."
        else:
            reason = captured or "the probe could not copy it"
        details["capture_error"] = reason
        return f" The batch was not saved: {reason}."

    def observe_columns(self, columns: Columns) -> list[Event]:
        """Events for a batch's series; critical ones are also logged, so a user without a server sees them."""
        mailbox, context = self._mailbox, self.analyzer.context  # (the Context's fields this writes: see there)
        context.clipping, context.max_norm = mailbox.clipping, mailbox.max_norm
        context.scheduler = any(map(_scheduled, mailbox.optimizers))
        self.analyzer.leading.fp16 = mailbox.fp16_layers
        events = self.analyzer.observe_columns(columns)
        start, end, _ = self._quiet
        arming = [e["step"] for e in events if e["type"] in self._ARMING_TYPES and not start <= e["step"] < end]
        if arming:
            self._mailbox.arm_step = max(arming)
            self._mailbox.arm_request = True
        for event in events:
            if event["severity"] == "critical":
                log.error("ampwatch: %s", event["message"])
        return events

    def origin(
        self,
        step: int,
        arming: int,
        forward: list[tuple[str, float]],
        backward: list[tuple[str, float]],
        inputs: dict[int, Any] | None = None,
    ) -> list[Event]:
        """An event naming the first module whose output, else output gradient, went non-finite; one naming the input
        batch names the file its copy was saved to (`inputs`, by input flag: see ampwatch._capture), if it was."""
        if arming in self._found:
            return []
        first_fwd = next(((i, n) for i, (n, bad) in enumerate(forward) if bad), None)
        first_bwd = next(((i, n) for i, (n, bad) in enumerate(backward) if bad and n != INPUT), None)
        if first_fwd is None and first_bwd is None:
            return []
        self._found.add(arming)
        self._mailbox.origin_found = arming
        if first_fwd is not None:
            index, module = first_fwd
            if module == INPUT:
                message = (
                    f"Origin of the non-finite values at step {step}: the input batch itself contains NaN/Inf, "
                    "before any layer ran. A data problem, not the model: check the data pipeline."
                )
            elif module == COMPILED:
                message = (
                    f"Origin of the non-finite values at step {step}: the input batch was finite and the output of "
                    "the compiled model was not, so one of its modules made them. torch.compile runs them in one "
                    "graph, which the agent does not hook (that would recompile the model, stall the loop and could "
                    "change how it computes). To name the module, run the steps from the last checkpoint without "
                    "torch.compile, watched: the probe names it there."
                )
            else:
                start = next((i for i in range(index, -1, -1) if forward[i][0] == INPUT), -1) + 1  # (its own pass)
                end = next((i for i in range(index, len(forward)) if forward[i][0] == INPUT), len(forward))
                modules = [n for n, _ in forward[start:end]]
                before = modules[modules.index(module) - 1] if modules.index(module) > 0 else None
                between = f"between `{before}` and `{module}`" if before else f"before `{module}`"
                message = (
                    f"Origin of the non-finite values at step {step}: first non-finite output: `{module}` "
                    f"(forward, module {modules.index(module) + 1} of {len(modules)} in call order). Either "
                    f"`{module}` made them, or it received them from an operation outside any module {between} (a "
                    "functional call in a parent's forward, such as a softmax over a fully masked row, a log of 0 "
                    "or a division by 0): every module's output before it was finite."
                )
                applied = self.analyzer.nonfinite.applied(step)
                if applied:  # (the parameters, not the data, made them: the first step's origin cannot be traced now)
                    message = (
                        f"At step {step} the first non-finite output is `{module}`'s, most likely because its "
                        f"parameters are non-finite: {applied}. Where that step's values came from can no longer "
                        "be traced: restore a good checkpoint, and the probe names it when it happens again."
                    )
            diverged = self.analyzer.trends.recent_divergence(step)
            if diverged and module != INPUT:
                message += (
                    f" Before it, {diverged}: most likely the updates diverged (too high a learning rate) and "
                    "the values outgrew what the dtype holds there, rather than an operation that makes NaN."
                )
            details = {"origin": module, "phase": "forward", "order": [n for n, _ in forward]}
            if module == INPUT and self._mailbox.capture is not None:
                message += self._saved(step, index, forward, inputs or {}, details)
            kind = "nonfinite_loss"
        else:
            # Output gradients arrive in backward order: the first non-finite one was made by the backward of the
            # module processed just before it, or of functional code between the two (for the very first, by the loss).
            # (first_bwd is not None here: the branch is taken only when first_fwd is None and one of them is not)
            index, received = first_bwd  # type: ignore[misc]
            module = backward[index - 1][0] if index > 0 else INPUT
            diverged = self.analyzer.trends.recent_divergence(step)  # (if it did, no operation to blame)
            if module != INPUT:  # (else the first of its pass: the loss made it)
                example = (
                    "a functional call in a parent's forward"
                    if diverged is not None
                    else ("a functional call such as torch.sqrt in a parent's forward")
                )
                where = (
                    f"in the backward of `{module}`, or of an operation outside any module between `{received}` and "
                    f"`{module}` ({example}): the gradient `{module}` "
                    f"received was finite and the one passed on to `{received}` was not"
                )
            else:
                module = "(loss)"
                where = (
                    f"in the loss computation: the gradient of the last module's output (`{received}`) is already "
                    "non-finite (if this step's loss is non-finite too, the loss's forward made it: a log of 0, a "
                    "division by 0)"
                )
            if diverged is not None:
                look = (
                    f" Before it, {diverged}: most likely the updates diverged (too high a learning rate) and the "
                    "gradients outgrew what the dtype holds there. Lower the learning rate."
                )
            else:
                look = " Look there for sqrt, log, pow or a norm at 0" + (
                    " (or, if steps come back at a lower loss scale, for values too large for fp16)."
                    if self.analyzer.context.scaled
                    else "."
                )
            message = (
                f"Origin of the non-finite gradients at step {step}: they first appear {where}, while every module's "
                f"output was finite.{look}"
            )
            details = {"origin": module, "phase": "backward", "order": [n for n, _ in backward if n != INPUT]}
            kind = "nonfinite_grad"
        named, length = (module, str(details["phase"])), 0
        if named == self._named:  # the same origin twice in a row: it keeps coming back from there
            length = min(2 * self._quiet[2], MAX_QUIET_STEPS) if self._quiet[2] else QUIET_STEPS
        self._named, self._quiet = named, (step, step + length, length)
        log.error("ampwatch: %s", message)
        return [self.analyzer.event(step, kind, "critical", message, details)]
