"""The rollback plan: from a run's stored events, the checkpoint to restore and the steps to skip.

A critical event the run cannot train past (`TRIGGERS`: non-finite parameters, a loss-scale collapse, a
divergence told as a critical spike) is part of an *episode*: the leading signs before it (gradient or loss spikes,
warned skipped steps, non-finite values), each within `EPISODE_GAP` steps of the next, are where the trouble
began. (A NaN loss or gradients that a GradScaler skipped are signs, not triggers: the run went on unharmed.)
The plan restores the last checkpoint saved strictly before the episode's first sign and skips every step from
that first sign to the episode's last critical step plus `MARGIN`. Steps are the agent's step numbers: a
checkpoint's step is the number of steps its state has completed (the next step to run), a skipped step is the
index of the step (batch) not to run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.server import models
from ampwatch.server.schemas import EventOut

SIGN_TYPES = (
    "grad_spike",
    "loss_spike",
    "skipped_step",
    "nonfinite_loss",
    "nonfinite_grad",
    "nonfinite_param",
    "scale_collapse",
)
TRIGGERS = ("nonfinite_param", "scale_collapse", "grad_spike", "loss_spike")  # when critical
EPISODE_GAP = 100  # signs further apart than this are separate troubles
MARGIN = 5  # steps skipped after the last critical one: the batches right after a blow-up are suspect too
MAX_SKIP = 10_000  # a plan never lists more steps than this (its range says where it ends)
FORMATS = ("json", "lightning", "megatron")


def event_json(event: models.Event) -> dict[str, Any]:
    """An event as the read API shows it (`GET /api/v1/runs/{id}/events`)."""
    return EventOut.of(event).model_dump(mode="json")


def load(session: Session, run_id: str) -> tuple[list[models.Event], list[models.Event]]:
    """The run's leading signs and criticals (warning or worse), and its checkpoints, each in step order."""
    order = (models.Event.step, models.Event.id)
    signs = session.scalars(
        select(models.Event)
        .where(
            models.Event.run_id == run_id,
            models.Event.type.in_(SIGN_TYPES),
            models.Event.severity.in_(("warning", "critical")),
        )
        .order_by(*order)
    ).all()
    checkpoints = session.scalars(
        select(models.Event).where(models.Event.run_id == run_id, models.Event.type == "checkpoint").order_by(*order)
    ).all()
    return list(signs), list(checkpoints)


def compute(run_id: str, signs: Sequence[models.Event], checkpoints: Sequence[models.Event]) -> dict[str, Any]:
    """The plan for the run's first episode with a trigger; `trouble` is None when there is none."""
    plan: dict[str, Any] = {
        "run_id": run_id,
        "trouble": None,
        "checkpoint": None,
        "skip": None,
        "margin": MARGIN,
        "episode_gap": EPISODE_GAP,
        "summary": "No critical numerics event: nothing to roll back.",
    }
    trigger = next((i for i, e in enumerate(signs) if e.severity == "critical" and e.type in TRIGGERS), None)
    if trigger is None:
        return plan
    start = trigger
    while start > 0 and signs[start].step - signs[start - 1].step <= EPISODE_GAP:
        start -= 1
    end = trigger
    while end + 1 < len(signs) and signs[end + 1].step - signs[end].step <= EPISODE_GAP:
        end += 1
    episode = signs[start : end + 1]
    critical = [e for e in episode if e.severity == "critical"]
    first_step, last_critical = episode[0].step, critical[-1].step
    before = [c for c in checkpoints if c.step < first_step]
    checkpoint = before[-1] if before else None
    to = min(last_critical + MARGIN, first_step + MAX_SKIP - 1)
    plan["trouble"] = {
        "first_step": first_step,
        "first_sign": event_json(episode[0]),
        "critical_step": signs[trigger].step,
        "critical": [event_json(e) for e in critical],
        "signs": len(episode),
    }
    plan["checkpoint"] = (
        None
        if checkpoint is None
        else {"step": checkpoint.step, "rank": checkpoint.rank, "path": (checkpoint.details or {}).get("path")}
    )
    plan["skip"] = {"from": first_step, "to": to, "steps": list(range(first_step, to + 1))}
    restore = (
        "restart from the beginning (no checkpoint was recorded before the trouble)"
        if checkpoint is None
        else f"restore the checkpoint at step {checkpoint.step}"
        + (f" ({plan['checkpoint']['path']})" if plan["checkpoint"]["path"] else "")
    )
    plan["summary"] = (
        f"Trouble began at step {first_step} ({episode[0].type}) before the {signs[trigger].type} at step "
        f"{signs[trigger].step}: {restore}, then skip steps {first_step}-{to}."
    )
    return plan


def brief(plan: dict[str, Any]) -> dict[str, Any] | None:
    """What an alert and its notifications carry of the plan: the summary, the checkpoint, the steps to skip and
    where the whole plan is (`path`, on the server; the run page shows it too). None without trouble."""
    if plan["trouble"] is None:
        return None
    return {
        "summary": plan["summary"],
        "checkpoint": plan["checkpoint"],
        "skip": {"from": plan["skip"]["from"], "to": plan["skip"]["to"]},
        "path": f"/api/v1/runs/{plan['run_id']}/plan",
    }


def lightning_file(plan: dict[str, Any]) -> str:
    """`skip_batches.json` as Lightning's `SpikeDetection` writes it: a JSON list of batch indices, indented by 4."""
    return json.dumps(plan["skip"]["steps"] if plan["skip"] else [], indent=4)


def megatron_file(plan: dict[str, Any]) -> str:
    """Megatron-LM's `--iterations-to-skip` values: iteration numbers separated by spaces, one line."""
    return " ".join(str(s) for s in plan["skip"]["steps"]) + "\n" if plan["skip"] else ""
