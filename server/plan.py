"""The rollback plan: from a run's stored events, the checkpoint to restore and the steps to skip.

A critical event the run cannot train past (`TRIGGERS`: non-finite parameters, a loss-scale collapse, a
divergence told as a critical spike, ranks holding different parameters) is part of an *episode*: the leading signs
before it (gradient or loss spikes, warned skipped steps, non-finite values), each within `EPISODE_GAP` steps of the
next, are where the trouble began. (A NaN loss or gradients that a GradScaler skipped are signs, not triggers: the run
went on unharmed.)
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
    "ranks_desync",
)
# When critical. A desynchronised rank's state (ranks_desync) is corrupt from the first step it differs at: the last
# checkpoint before it is the one to restore, as for parameters gone non-finite.
TRIGGERS = ("nonfinite_param", "scale_collapse", "grad_spike", "loss_spike", "ranks_desync")
EPISODE_GAP = 100  # signs further apart than this are separate troubles
# A leading indicator (an fp16 range headed for overflow, an update ratio or Adam lag jump) warns up to hundreds of
# steps ahead, at the layer-norm interval: one this far before an episode's first sign is where its state went bad.
LEADING_REACH = 2_000
MARGIN = 5  # steps skipped after the last critical one: the batches right after a blow-up are suspect too
MAX_SKIP = 10_000  # a plan never lists more steps than this (its range says where it ends)
FORMATS = ("json", "lightning", "megatron")


def event_json(event: models.Event) -> dict[str, Any]:
    """An event as the read API shows it (`GET /api/v1/runs/{id}/events`), without a plan."""
    return EventOut.of(event).model_dump(mode="json", exclude_unset=True)


def is_trigger(event: models.Event) -> bool:
    """Whether the event can trigger a plan: critical, of a type in `TRIGGERS`."""
    return event.severity == "critical" and event.type in TRIGGERS


def events_out(session: Session, run_id: str, events: Sequence[models.Event]) -> list[EventOut]:
    """The events as the read API and the run stream show them: each plan trigger carries the run's plan in brief
    (`brief`), computed once, and only when one of the events is a trigger (no query otherwise). Dump them with
    `exclude_unset=True`, so that other events have no `plan` key."""
    triggers = any(is_trigger(e) for e in events)
    rollback = brief(compute(run_id, *load(session, run_id))) if triggers else None
    return [EventOut.of(e, rollback if is_trigger(e) else None) for e in events]


def load(session: Session, run_id: str) -> tuple[list[models.Event], list[models.Event], list[models.Event]]:
    """The run's signs and criticals (warning or worse), its checkpoints and its leading indicators' warnings,
    each in step order."""
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
    leading = session.scalars(
        select(models.Event)
        .where(models.Event.run_id == run_id, models.Event.type.in_(("leading_indicator", "amp_config")))
        .order_by(*order)
    ).all()
    return list(signs), list(checkpoints), [e for e in leading if (e.details or {}).get("indicator")]


def compute(
    run_id: str,
    signs: Sequence[models.Event],
    checkpoints: Sequence[models.Event],
    leading: Sequence[models.Event] = (),
) -> dict[str, Any]:
    """The plan for the run's first episode with a trigger; `trouble` is None when there is none. A leading
    indicator's warning within `LEADING_REACH` steps before the episode moves the checkpoint back before it (the
    state was going bad from there); the steps to skip stay the episode's (its batches are the suspect ones)."""
    plan: dict[str, Any] = {
        "run_id": run_id,
        "trouble": None,
        "checkpoint": None,
        "skip": None,
        "margin": MARGIN,
        "episode_gap": EPISODE_GAP,
        "summary": "No critical numerics event: nothing to roll back.",
    }
    trigger = next((i for i, e in enumerate(signs) if is_trigger(e)), None)
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
    warned = next((e for e in leading if first_step - LEADING_REACH <= e.step <= signs[trigger].step), None)
    began = first_step if warned is None else min(first_step, warned.step)
    before = [c for c in checkpoints if c.step < began]
    checkpoint = before[-1] if before else None
    to = min(last_critical + MARGIN, first_step + MAX_SKIP - 1)
    plan["trouble"] = {
        "first_step": first_step,
        "first_sign": event_json(episode[0]),
        "critical_step": signs[trigger].step,
        "critical": [event_json(e) for e in critical],
        "signs": len(episode),
        "began": began,
        "leading": None if warned is None else event_json(warned),
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
    foreseen = "" if warned is None else f"A leading indicator warned at step {warned.step}. "
    plan["summary"] = foreseen + (
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
