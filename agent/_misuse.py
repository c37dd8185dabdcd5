"""Why GradScaler raised: each cause of a misuse told apart by a cheap signature, with its fix.

Taken while the error is being caught (then it is re-raised unchanged); see AMP_NOTES.md.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def classify(sig: Signature) -> tuple[str, str] | None:
    """(cause, explanation with the fix) for a GradScaler misuse, or None for any other error."""
    if "already been called since the last update" in sig.message:
        call = "unscale_" if "unscale_" in sig.message else "step"
        return ("unscale_twice" if call == "unscale_" else "step_twice"), (
            f"scaler.{call}(optimizer) was called twice for one optimizer before scaler.update(). "
            f"Fix: call {call} once per optimizer per iteration, then scaler.update()."
        )
    if "but _scale is None" in sig.message:
        return "no_scale_yet", (
            "GradScaler was used before its first scaler.scale() call: unscale_, step or update ran before any "
            "scaled backward. Fix: scaler.scale(loss).backward() first, then unscale_/step/update."
        )
    if "No inf checks were recorded" not in sig.message:
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
    "backward() ran without scaler.scale(loss) although earlier steps used it: the gradients are divided by the "
    "loss scale (a norm of 0.2 becomes 3e-6) and the model stops learning, silently. "
    "Fix: scaler.scale(loss).backward()."
)
