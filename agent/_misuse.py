"""Misused mixed precision: why GradScaler raised (each cause told apart by a cheap signature, taken while
the error is being caught, then re-raised unchanged), and configuration mistakes that raise nothing.
Every finding comes with its fix. The functions here take the run's Recorder (`ampwatch._watch`) and read it
through its public surface: the watched objects, the current step (`Recorder.current`), `Recorder.misuse` to record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

Problem = tuple[str, dict[str, Any]]  # (message with the fix, details) of an `amp_config` event


class Misuses:
    """What a run has said about misuse. Owner: the training thread (the Recorder holds one, as `misuses`)."""

    __slots__ = ("told", "last_error")

    def __init__(self) -> None:
        self.told: set[str] = set()  # the causes of misuses that raise nothing: each is said once per run
        self.last_error = 0  # id() of the last GradScaler error diagnosed (nested wrappers see one error twice)


@dataclass(frozen=True)
class Signature:
    """What the agent could see when the error was raised."""

    message: str  # str(error)
    stage: str  # the optimizer's GradScaler stage before step(): READY, UNSCALED or STEPPED
    params_with_grad: int  # of this optimizer's parameters
    replaced_params: int | None  # optimizer parameters not in the model, shaped like a model parameter
    # the optimizer does not hold: the model's parameters were swapped for new ones (None: no model)
    model_has_grads: bool | None  # whether any model parameter has a gradient (None: no model)
    scaled_this_iteration: bool  # scaler.scale() was called since the last update()

    @classmethod
    def taken(
        cls, error: BaseException, params: list[Any], model: Any, stage: str, scaled: bool, others: Any = ()
    ) -> Signature:
        """The signature of `error`, raised for the optimizer holding `params` (`model`: the watched one or None;
        `others`: the other watched optimizers)."""
        return cls(
            message=str(error),
            stage=stage,
            params_with_grad=sum(p.grad is not None for p in params),
            replaced_params=_replaced(params, model, others) if model is not None else None,
            model_has_grads=any(p.grad is not None for p in model.parameters()) if model is not None else None,
            scaled_this_iteration=scaled,
        )


def classify(sig: Signature) -> tuple[str, str] | None:
    """(cause, explanation with the fix) for a GradScaler misuse, or None for any other error."""
    if (
        "already been called" in sig.message and "since the last update" in sig.message
    ):  # (unscale_'s says "on this optimizer")
        call = "unscale_" if "unscale_" in sig.message else "step"
        return ("unscale_twice" if call == "unscale_" else "step_twice"), (
            f"scaler.{call}(optimizer) was called twice for one optimizer before scaler.update(). "
            f"Fix: call {call} once per optimizer per iteration, then scaler.update()."
        )
    if "Attempting to unscale FP16 gradients" in sig.message:
        return "fp16_parameters", (
            "The optimizer's parameters, and so their gradients, are fp16 (model.half(), or a model loaded with "
            "torch_dtype=torch.float16): GradScaler does not unscale fp16 gradients, as fp16 weights lose the small "
            "updates mixed precision exists to keep. Fix: keep the parameters in fp32 and run the forward under "
            "torch.autocast(device, dtype=torch.float16); or train in bf16 without a GradScaler."
        )
    if "but _scale is None" in sig.message:
        return "no_scale_yet", (
            "GradScaler was used before its first scaler.scale() call: unscale_, step or update ran before any "
            "scaled backward. Fix: scaler.scale(loss).backward() first, then unscale_/step/update."
        )
    # (a fused optimizer stepped after unscale_ found no gradients: it gets 0, not a found_inf tensor, and fails on it)
    fused = sig.stage == "UNSCALED" and "'int' object has no attribute 'device'" in sig.message
    if "No inf checks were recorded" not in sig.message and not fused:
        return None
    if sig.stage == "UNSCALED" and sig.params_with_grad > 0:
        return "unscale_before_backward", (
            "scaler.unscale_(optimizer) ran before backward(): it found no gradients to check, and the gradients "
            "backward made afterwards were never checked. Fix: call unscale_ after scaler.scale(loss).backward() "
            "and before clipping."
        )
    if sig.replaced_params:
        return "parameters_replaced", (
            f"{sig.replaced_params} of this optimizer's parameters are no longer in the model: they were replaced "
            "after the optimizer was built (load_state_dict(assign=True), wrapping or moving the model after "
            "creating the optimizer). Fix: build the optimizer after the model has its final parameters."
        )
    if not sig.scaled_this_iteration:
        return "leftover_step", (
            "scaler.step() was called with no scaler.scale(loss).backward() since the last update(): an extra "
            "'leftover' step, typical at the end of a gradient-accumulation loop. Fix: step only after a backward, "
            "e.g. when (i + 1) % accumulation_steps == 0, and handle the last partial accumulation explicitly."
        )
    if sig.model_has_grads:
        return "wrong_optimizer_or_frozen", (
            "The backward reached other parameters but none of this optimizer's: it holds frozen or unused "
            "parameters, or the wrong optimizer is being stepped (a GAN stepping one optimizer after the other "
            "network's loss). Fix: step the optimizer whose parameters the loss depends on; leave out optimizers "
            "whose parameters are all frozen."
        )
    return "gradients_missing", (
        "scaler.scale(loss).backward() ran, yet no parameter of this optimizer has a gradient: zero_grad() ran "
        "between backward and step, or the loss is detached from the parameters (computed under no_grad, "
        ".detach(), or rebuilt from .item()). Fix: zero the gradients before the forward or after step(), and "
        "make sure the loss depends on the parameters."
    )


SILENT_UNSCALED = (
    "backward() ran without scaler.scale(loss) although earlier steps used it: the gradients are divided by the loss "
    "scale (a norm of 0.2 becomes 3e-6) and the model stops learning, silently. Fix: scaler.scale(loss).backward()."
)
CLIPPED_SCALED = (
    "clip_grad_norm_ ran on the scaled gradients, before scaler.unscale_(optimizer): max_norm applied to gradients "
    "multiplied by the loss scale (2^16 at first), so nearly every step is clipped, and once step() unscales them the "
    "update is the scale's factor too small: the model barely learns, silently. "
    "Fix: scaler.unscale_(optimizer), then clip_grad_norm_, then scaler.step(optimizer)."
)
CLIPPED_SCALED_NORM = (
    "clip_grad_norm_ ran on the scaled gradients, before scaler.unscale_(optimizer): with max_norm=inf it changes "
    "nothing, but the norm it returns is multiplied by the loss scale (a norm you log from it is off by that factor; "
    "the agent's grad_norm is the unscaled one). Fix: scaler.unscale_(optimizer) before clip_grad_norm_."
)
DIRECT_STEP = (
    "optimizer.step() ran on the gradients of a scaled loss without scaler.step(optimizer): it applied them multiplied "
    "by the loss scale (2^16 at first), and would apply inf/NaN ones instead of skipping the step; nor are steps "
    "counted, as scaler.update() counts them. Fix: scaler.step(optimizer) in place of optimizer.step(), then "
    "scaler.update(). (An optimizer whose own loss is not scaled: leave it out of watch().)"
)
NO_SCALER_STEP = (
    "scaler.update() ran with no scaler.step(optimizer) or unscale_ since scaler.scale(): the loop steps the optimizer "
    "itself (optimizer.step()), or calls update() after every micro-batch of gradient accumulation. "
    "Fix: scaler.step(optimizer), then scaler.update(), once per optimizer step."
)


def stepped_directly(rec: Any, optimizer: Any) -> None:
    """`optimizer`'s step ran outside scaler.step() after this iteration's scale(), its gradients not unscaled (said
    once per run, on the Recorder `rec`)."""
    scaler = rec.scaler
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    if scaler is not None and scaler._enabled and (state is None or state["stage"].name == "READY"):
        what = "optimizer.step() without scaler.step(optimizer)"
        rec.misuse(what, "direct_step", DIRECT_STEP, "critical", {}, once=True)


def diagnose(rec: Any, optimizer: Any, error: BaseException) -> None:
    """GradScaler raised (for `optimizer`, None when update() did): record the likely cause and its fix on the Recorder
    `rec` (the error itself propagates)."""
    said, step = rec.misuses, rec.current
    if id(error) == said.last_error:
        return
    if optimizer is None and step.scale_calls and not getattr(rec.scaler, "_per_optimizer_states", True):
        said.last_error = id(error)  # (update() after scale() with no step or unscale_ of any optimizer in between)
        rec.misuse(
            f"{type(error).__name__}: {error}", "no_scaler_step", NO_SCALER_STEP, "critical", {"error": str(error)}
        )
        return
    optimizer = optimizer if optimizer is not None else step.last_optimizer
    if optimizer is None:
        return
    said.last_error = id(error)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stage = step.stage_before
    others = [o for o in rec.optimizers if o is not optimizer]
    stage_name = stage.name if stage is not None else "READY"
    signature = Signature.taken(error, params, rec.model, stage_name, step.scale_calls > 0, others)
    found = classify(signature)
    if found is not None:
        cause, explanation = found
        details = {
            "cause": cause,
            "error": str(error),
            "stage": signature.stage,
            "params_with_grad": signature.params_with_grad,
            "replaced_params": signature.replaced_params,
        }
        rec.misuse(f"{type(error).__name__}: {error}", cause, explanation, "critical", details)


def clipped_scaled(rec: Any, parameters: Any, args: tuple, kwargs: dict[str, Any]) -> None:
    """`clip_grad_norm_` ran after this iteration's scale() and before its unscale_ for an optimizer of the parameters
    it clipped: it clipped the scaled gradients (said once per run, on the Recorder `rec`)."""
    import torch

    scaler = rec.scaler
    if scaler is None or not scaler._enabled:
        return
    states = getattr(scaler, "_per_optimizer_states", {})
    ids = {id(parameters)} if isinstance(parameters, torch.Tensor) else set(map(id, parameters))
    for optimizer in rec.optimizers:
        state = states.get(id(optimizer))  # (none yet, or READY: not unscaled in this iteration)
        if (state is None or state["stage"].name == "READY") and not rec.clip.param_ids(optimizer).isdisjoint(ids):
            max_norm = args[0] if args else kwargs.get("max_norm")
            number = isinstance(max_norm, (int, float))  # (a tensor is not read: a host read)
            details = {"max_norm": str(max_norm) if number else None}
            norm_only = isinstance(max_norm, (int, float)) and math.isinf(max_norm)
            message = CLIPPED_SCALED_NORM if norm_only else CLIPPED_SCALED
            what = "clip_grad_norm_ before scaler.unscale_(optimizer)"
            rec.misuse(what, "clip_before_unscale", message, "warning", details, once=True)
            return


CLIP_NONFINITE = (
    "Under an enabled GradScaler, gradients that overflow fp16 are normal now and then (at start-up, and after the "
    "scale grows): GradScaler skips those steps and lowers the scale, but clip_grad_norm_(..., "
    "error_if_nonfinite=True) raises first and stops the run. Fix: drop error_if_nonfinite=True; NaN/Inf that are not "
    "overflow are reported as nonfinite_grad."
)


def clip_raised(rec: Any, error: BaseException) -> None:
    """`clip_grad_norm_` raised `error`: its error_if_nonfinite under an enabled GradScaler (said once per run, on
    `rec`)."""
    scaler = rec.scaler
    if (
        scaler is not None
        and scaler._enabled
        and "cannot be clipped" in str(error)
        and "clip_nonfinite" not in rec.misuses.told
    ):
        what = "clip_grad_norm_(error_if_nonfinite=True) raised"
        rec.misuse(what, "clip_nonfinite", CLIP_NONFINITE, "critical", {"error": str(error)}, once=True)


# -- configuration mistakes (amp_config) --------------------------------------------------------
def watch_config_problems(optimizers: list[Any], scaler: Any) -> list[Problem]:
    """What `watch()` can already tell: anomaly mode left on; HF Accelerate's fp16 on the CPU."""
    import torch

    problems: list[Problem] = []
    if scaler is None and any(map(_accelerate_fp16_on_cpu, optimizers)):
        problems.append(
            (
                "HF Accelerate was asked for mixed_precision='fp16' on the CPU, where it builds no "
                "GradScaler and no fp16 autocast: this run trains in full fp32 precision. Use "
                "mixed_precision='bf16' on the CPU, or a GPU for fp16.",
                {"check": "accelerate_fp16_on_cpu", "device": "cpu"},
            )
        )
    if torch.is_anomaly_enabled():
        problems.append(
            (
                "Anomaly detection (torch.autograd.detect_anomaly / set_detect_anomaly) is on: training runs "
                "2-2.6x slower and a normal GradScaler skip becomes a crash. Turn it off outside debugging.",
                {"check": "anomaly_mode"},
            )
        )
    return problems


def forward_config_problem(module: Any, scaler: Any) -> Problem | None:
    """What the first forward's autocast state tells: a scaler under bf16, autocast on the wrong device, or none."""
    import torch

    device = next((p.device.type for p in module.parameters()), "cpu")
    scaler_on = scaler is not None and scaler.is_enabled()
    on = {
        d for d in ("cuda", "cpu", "xpu", "mps") if torch.amp.is_autocast_available(d) and torch.is_autocast_enabled(d)
    }
    if scaler_on and device in on and torch.get_autocast_dtype(device) == torch.bfloat16:
        return (
            "GradScaler is enabled with bf16 autocast: bf16 has fp32's range and needs no loss scaling; the "
            "scaler only adds work and skips. Build it with enabled=False under bf16 (as nanoGPT does).",
            {"check": "scaler_with_bf16", "device": device},
        )
    if on and device not in on:
        return (
            f"autocast is on for {', '.join(sorted(on))} but the model runs on {device}: its forward runs in "
            f"full precision. Use torch.autocast('{device}', ...).",
            {"check": "autocast_device", "device": device},
        )
    if scaler_on and device not in on:
        return (
            f"GradScaler is enabled but the forward runs without autocast on {device}: there is nothing "
            "to scale. Wrap the forward in torch.autocast, or disable the scaler.",
            {"check": "scaler_without_autocast", "device": device},
        )
    if scaler is not None and not on and getattr(scaler, "_device", None) == "cuda" and not torch.cuda.is_available():
        # (nanoGPT on the CPU: its autocast is a nullcontext there, and torch turns a CUDA GradScaler off without CUDA)
        return (
            f"The GradScaler was built for CUDA, which this machine lacks, so it is off (torch disables it there), and "
            f"the forward runs without autocast on {device}: this run trains in full fp32 precision, whatever dtype "
            f"the script names. For mixed precision on the CPU, wrap the forward in torch.autocast('{device}', "
            f"dtype=torch.bfloat16), or float16 with torch.amp.GradScaler('{device}').",
            {"check": "cuda_scaler_without_cuda", "device": device},
        )
    return None


def _accelerate_fp16_on_cpu(optimizer: Any) -> bool:
    """An Accelerate optimizer whose Accelerator was asked for fp16 on the CPU (it then silently trains in fp32)."""
    state = getattr(optimizer, "accelerator_state", None)
    device = getattr(state, "device", None)
    return (
        getattr(state, "mixed_precision", None) == "fp16"
        and getattr(device, "type", None) == "cpu"
        and getattr(optimizer, "scaler", 0) is None
    )


def _replaced(params: list[Any], model: Any, others: Any = ()) -> int:
    """Optimizer parameters missing from the model that have the shape of a model parameter no optimizer holds:
    the signature of parameters swapped after the optimizer was built (one another optimizer holds is not: a GAN
    stepping its discriminator's optimizer after the generator's backward)."""
    held = {id(p) for p in params}
    owned = held | {id(p) for o in others for g in o.param_groups for p in g["params"]}
    orphans = [tuple(p.shape) for p in model.parameters() if id(p) not in owned]
    in_model = {id(p) for p in model.parameters()}
    count = 0
    for p in params:
        if id(p) not in in_model and tuple(p.shape) in orphans:
            orphans.remove(tuple(p.shape))
            count += 1
    return count
