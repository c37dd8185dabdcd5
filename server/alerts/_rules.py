"""Rules: the built-in defaults that work with zero configuration, seeding them, and matching a run."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import Table, select
from sqlalchemy.orm import Session

from ampwatch.server import models
from ampwatch.server.alerts._db import insert, now

REMINDER_S = 4 * 3600.0  # Alertmanager's default repeat_interval

DEFAULTS: dict[str, Any] = {
    "severity": "warning",
    "event_type": None,
    "min_event_severity": "info",
    "series": None,
    "aggregation": None,
    "op": None,
    "threshold": None,
    "window_steps": None,
    "ignore_steps": 0,
    "for_steps": 0,
    "for_s": 0.0,
    "keep_firing_for_s": 0.0,
    "repeat_interval_s": REMINDER_S,
    "per_rank": False,
    "inhibits": False,
    "project": None,
    "enabled": True,
    "description": "",
}


def _event(name: str, severity: str, description: str, **extra: Any) -> dict[str, Any]:
    return {
        **DEFAULTS,
        "name": name,
        "kind": "event",
        "event_type": name,
        "severity": severity,
        "description": description,
        **extra,
    }


BUILTINS: list[dict[str, Any]] = [
    _event("nonfinite_loss", "critical", "The loss went NaN/Inf."),
    _event("nonfinite_param", "critical", "The parameters are non-finite: the run cannot recover."),
    _event(
        "nonfinite_grad",
        "critical",
        "NaN gradients that survive a halved loss scale (the backward made them).",
        min_event_severity="critical",
    ),
    _event("scale_collapse", "critical", "Every step is skipped and the loss scale keeps falling.", inhibits=True),
    _event(
        "scaler_misuse",
        "critical",
        "GradScaler was used wrongly (crash, or gradients left scaled).",
        min_event_severity="warning",
    ),
    _event("run_crashed", "critical", "The training process died without finish().", inhibits=True),
    _event("ranks_desync", "critical", "DDP ranks hold different parameters (silent corruption or a desynced rank)."),
    {
        **DEFAULTS,
        "name": "skip_rate",
        "kind": "threshold",
        "severity": "warning",
        "series": "skipped",
        "aggregation": "mean",
        "op": ">",
        "threshold": 0.05,
        "window_steps": 200,
        "ignore_steps": 50,
        "description": "More than 5% of the last 200 steps were skipped, start-up calibration excluded.",
    },
    _event("grad_spike", "warning", "The gradient norm jumped far above its median without a skip."),
    _event("loss_spike", "warning", "The loss jumped far above its median."),
    _event(
        "leading_indicator",
        "warning",
        "A layer's update-to-weight ratio or Adam's second-moment lag jumped: a spike or divergence is likely ahead.",
    ),
    _event("run_stalled", "warning", "Heartbeats continue but steps stopped advancing (a hang)."),
]


def seed_builtins(session: Session) -> None:
    """Insert the built-in rules that are missing; a person's edits to them are kept. Safe on replicas."""
    stamp = now()
    rows = [{**rule, "source": "builtin", "created_at": stamp, "updated_at": stamp} for rule in BUILTINS]
    session.execute(
        insert(session, cast(Table, models.AlertRule.__table__)).on_conflict_do_nothing(index_elements=["name"]), rows
    )
    session.commit()


def enabled_rules(session: Session, *, kinds: tuple[str, ...]) -> list[models.AlertRule]:
    """Enabled rules of these kinds, inhibiting (more important) rules first."""
    query = select(models.AlertRule).where(models.AlertRule.enabled, models.AlertRule.kind.in_(kinds))
    return sorted(session.scalars(query), key=lambda r: (not r.inhibits, r.id))


def applies(rule: models.AlertRule, project: str) -> bool:
    """Whether `rule` watches runs of `project`."""
    return rule.project is None or rule.project == project


def project_of(session: Session, run: models.Run) -> str:
    """The name of the run's project."""
    return session.scalar(select(models.Project.name).where(models.Project.id == run.project_id)) or ""
