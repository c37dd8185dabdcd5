"""Ranks out of step: data-parallel ranks must skip the same steps, since each rank's GradScaler sees the same
found_inf once the gradients are all-reduced. Ranks that skip different steps check gradients that were not
all-reduced (FSDP's shards under a plain GradScaler, a missing all-reduce), and no longer train the same model.

Checked in the ingest transaction, against the points already stored: a batch of rank r > 0 is compared with rank
0's `skipped` points at the same steps, and one of rank 0 with those of ranks 1 to 7 (a rank past 7 is compared
when its batch comes after rank 0's for those steps). One range read of the primary key per rank compared. Said
once per run, by the server."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.server import models
from ampwatch.server.alerts._db import steps
from ampwatch.server.alerts._ingest import raise_event

CAUSE = "ranks_disagree"
RANK0_COMPARES = 8  # rank 0's batches are compared with ranks 1 to this - 1
P, E = models.Point, models.Event


def compare_ranks(
    session: Session,
    *,
    run: models.Run,
    rank: int,
    world: int,
    skipped: tuple[list[int], list[float]],
    series_id: int,
    stamp: datetime,
) -> None:
    """A batch of `rank` brought `skipped` points (series `series_id`): compare them with the other ranks' at those
    steps."""
    others = [0] if rank else list(range(1, min(world, RANK0_COMPARES)))
    mine = dict(zip(*skipped))
    query = select(P.rank, P.step, P.value).where(
        P.series_id == series_id, P.rank.in_(others), P.step.between(min(skipped[0]), max(skipped[0]))
    )
    apart = [
        (step, other, bool(value))
        for other, step, value in session.execute(query)
        if step in mine and bool(value) != bool(mine[step])
    ]
    if not apart or _raised_before(session, run.id):
        return
    step, other, other_skipped = min(apart)
    skipper, kept = (other, rank) if other_skipped else (rank, other)
    message = (
        f"Ranks disagree on skipped steps: rank {skipper} skipped step {steps(step)} and rank {kept} did not. Each "
        "rank's GradScaler decides on gradients the others did not see, so the ranks no longer train the same model "
        "the same way (and their loss scales drift apart). The gradients are not all-reduced before unscale_: with "
        "FSDP (sharded gradients) use ShardedGradScaler (torch.distributed.fsdp.sharded_grad_scaler), which "
        "all-reduces found_inf; with DDP, check that no_sync() does not cover the micro-batch before the step, and "
        "that every rank runs the same number of steps. (Ranks that train separate models on purpose: give each its "
        "own run, with AMPWATCH_RUN_ID.)"
    )
    details = {"cause": CAUSE, "detected_by": "server", "skipped_by": skipper, "kept_by": kept}
    raise_event(
        session,
        run=run,
        kind="scaler_misuse",
        severity="critical",
        message=message,
        details=details,
        stamp=stamp,
        step=step,
    )


def _raised_before(session: Session, run_id: str) -> bool:
    """Whether this run has the event already (it is raised once per run)."""
    rows = session.scalars(select(E.details).where(E.run_id == run_id, E.type == "scaler_misuse"))
    return any((details or {}).get("cause") == CAUSE for details in rows)
