"""Ranks that disagree on the parameters: under DistributedDataParallel every rank holds the same parameters after
each step, bitwise (the gradients are all-reduced and each rank's optimizer does the same arithmetic), so the agents'
`param_norm` is the same float on every rank at a step. A rank whose value differs from rank 0's holds other
parameters: silent data corruption (a faulty GPU or its memory) or a desynchronised rank (a parameter changed on one
rank only, a step skipped or repeated there).

Compared as batches arrive, like the skipped steps (_ranks.py), and only where the agents said the parameters are
replicated (the run's environment `parallel`, see ampwatch._layout): under FSDP each rank's `param_norm` is its
shard's. Exactly: the values as stored (float64, NaN as NULL, so NaN on both ranks agrees). A batch of rank r > 0 is
compared with rank 0's points at its steps, one of rank 0's with those of ranks 1 to 7. Said once per run, naming the
rank and the first step the comparison found."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.server import models
from ampwatch.server.alerts._db import steps
from ampwatch.server.alerts._ingest import raise_event
from ampwatch.server.alerts._ranks import RANK0_COMPARES
from ampwatch.server.values import to_db, to_json

KIND = "ranks_desync"
P, E = models.Point, models.Event


def compare_params(
    session: Session, *, run: models.Run, rank: int, points: dict[str, Any], series_ids: dict[str, int], stamp: datetime
) -> None:
    """A batch of `rank` brought `points`: compare its `param_norm` with the other ranks' at those steps."""
    series, environment = points.get("param_norm"), run.environment or {}
    world = environment.get("world_size")
    if series is None or not series.steps or environment.get("parallel") != "replicated":
        return
    if not isinstance(world, int) or world < 2:
        return
    others = [0] if rank else list(range(1, min(world, RANK0_COMPARES)))
    mine = {step: to_db(value) for step, value in zip(series.steps, series.values)}
    query = select(P.rank, P.step, P.value).where(
        P.series_id == series_ids["param_norm"], P.rank.in_(others), P.step.between(min(mine), max(mine))
    )
    apart = [
        (step, other, value) for other, step, value in session.execute(query) if step in mine and value != mine[step]
    ]
    if not apart or session.scalar(select(E.id).where(E.run_id == run.id, E.type == KIND).limit(1)) is not None:
        return
    step, other, theirs = min(apart, key=lambda a: (a[0], a[1]))
    odd, odd_value, zero_value = (rank, mine[step], theirs) if rank else (other, theirs, mine[step])
    odd_text, zero_text = to_json([odd_value, zero_value])
    message = (
        f"Ranks disagree on the parameters: at step {steps(step)} rank {odd}'s param_norm is {odd_text} and rank "
        f"0's is {zero_text}. Under DDP every rank holds the same parameters after each step, bitwise, so rank "
        f"{odd} (or rank 0) holds other parameters: silent data corruption (a faulty GPU or its memory: check its ECC "
        "errors, nvidia-smi -q -d ECC) or a desynchronised rank (a parameter changed on one rank only, after DDP was "
        "built: a rank-dependent initialisation or load_state_dict; a step skipped or repeated there). The all-reduce "
        "goes on, so the ranks now train different models. Restore a checkpoint saved before this step and restart; "
        "if it comes back on the same rank, take that device or host out."
    )
    details = {
        "detected_by": "server",
        "rank": odd,
        "reference_rank": 0,
        "param_norm": odd_text,
        "reference_param_norm": zero_text,
    }
    raise_event(
        session,
        run=run,
        kind=KIND,
        severity="critical",
        message=message,
        details=details,
        stamp=stamp,
        step=step,
        rank=odd,
    )
