"""Run vitals: what the runs list shows of each run, kept in the run's own row at ingest.

Status, health, last step, the share of skipped steps among the last SKIP_WINDOW steps and the latest loss
scale (rank 0) are columns of `runs`, written in the ingest transaction under the run row's lock, so a page
of runs is one indexed query whatever their history. Firing alerts are counted per page in one grouped query
(by the `(run_id, state)` index) instead: a counter row would be locked by ingest and by the background
evaluator in opposite orders (run then alert, alert then run) and deadlock.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from ampwatch.server import models
from ampwatch.server.db import IDS_PER_QUERY
from ampwatch.server.values import to_db, to_json

SKIP_WINDOW = 1000  # the skip rate is the share of skipped steps among the run's last this many (rank 0)
SEVERITY_RANK = {"ok": 0, "info": 0, "warning": 1, "critical": 2}
HEALTH = {0: "ok", 1: "warning", 2: "critical"}
SEVERITIES = ("critical", "warning", "info")


def worse_health(current: str, severities: list[str]) -> str:
    """A run's health after events of these severities: the worst ever seen (health never improves)."""
    return HEALTH[max([SEVERITY_RANK[current]] + [SEVERITY_RANK[s] for s in severities])]


def on_points(
    session: Session, run: models.Run, *, rank: int, points: dict[str, Any], series_ids: dict[str, int]
) -> None:
    """Update the run's skip rate and latest scale from a batch's points (`{name: PointsIn}`); rank 0 only."""
    if rank != 0:
        return
    scale = points.get("scale")
    if scale is not None and scale.steps:
        step = max(scale.steps)
        if run.scale_step is None or step >= run.scale_step:
            last = {s: v for s, v in zip(scale.steps, scale.values)}[step]  # (the last value sent for a step wins)
            run.scale_step, run.scale = step, to_db(last)
    if "skipped" in points and points["skipped"].steps:
        run.skip_rate = session.scalar(_SKIP_RATE, {"sid": series_ids["skipped"], "window": SKIP_WINDOW})


# A NaN (NULL) counts as not skipped. Two index range reads of at most SKIP_WINDOW rows.
_SKIP_RATE = text(
    "SELECT avg(CASE WHEN value <> 0 THEN 1.0 ELSE 0.0 END) FROM points WHERE series_id = :sid AND rank = 0"
    " AND step > (SELECT max(step) FROM points WHERE series_id = :sid AND rank = 0) - :window"
)


def scale_json(run: models.Run) -> float | str | None:
    """The latest loss scale as JSON: None when there is none, 'NaN'/'Infinity'/'-Infinity' when not finite."""
    return None if run.scale_step is None else to_json([run.scale])[0]


def firing(session: Session, run_ids: list[str]) -> dict[str, dict[str, int]]:
    """Per run of `run_ids`: its firing alerts by severity (`{"critical": 1}`); one statement."""
    out: dict[str, dict[str, int]] = {r: {} for r in run_ids}
    if not run_ids:
        return out
    A = models.Alert
    for i in range(0, len(run_ids), IDS_PER_QUERY):  # (one statement for any page; the runs stream may ask more)
        query = (
            select(A.run_id, A.severity, func.count())
            .where(A.run_id.in_(run_ids[i : i + IDS_PER_QUERY]), A.state == "firing")
            .group_by(A.run_id, A.severity)
        )
        for run_id, severity, count in session.execute(query):
            out[run_id][severity] = count
    return out


def of(run: models.Run, firing_by_severity: dict[str, int]) -> dict[str, Any]:
    """The vitals a runs list shows beside the run's own fields (the API's and the stream's `skip_rate`, `scale`,
    `firing`, `firing_by_severity`)."""
    return {
        "skip_rate": run.skip_rate,
        "scale": scale_json(run),
        "firing": sum(firing_by_severity.values()),
        "firing_by_severity": {s: firing_by_severity.get(s, 0) for s in SEVERITIES},
    }
