"""`point_blocks`, kept at ingest: the finite minimum and maximum of every block of BLOCK_STEPS steps of a
series and rank, updated in the batch's own transaction and exact when batches arrive out of order, are
replayed or replace values. `series` reads them for long ranges."""

from __future__ import annotations

import bisect
import math

from sqlalchemy import text
from sqlalchemy.orm import Session

from ampwatch.server.db import IDS_PER_QUERY
from ampwatch.server.models import BLOCK_STEPS

_FINITE = "value > :ninf AND value < :inf"
REBUILD_BLOCKS = text(f"""
INSERT INTO point_blocks (series_id, rank, block, min_step, min_value, max_step, max_value, last_step)
SELECT DISTINCT series_id, rank, step / {BLOCK_STEPS},
       first_value(step) OVER lo, first_value(value) OVER lo, first_value(step) OVER hi, first_value(value) OVER hi,
       max(step) OVER b
FROM points
WHERE series_id = :sid AND rank = :rank AND step >= :first AND step <= :last AND {_FINITE}
WINDOW b AS (PARTITION BY series_id, rank, step / {BLOCK_STEPS}),
       lo AS (PARTITION BY series_id, rank, step / {BLOCK_STEPS} ORDER BY value, step),
       hi AS (PARTITION BY series_id, rank, step / {BLOCK_STEPS} ORDER BY value DESC, step)""")
_UPSERT_BLOCK = (
    "INSERT INTO point_blocks (series_id, rank, block, min_step, min_value, max_step, max_value, last_step)"
    " VALUES ({0}, {0}, {0}, {0}, {0}, {0}, {0}, {0})"
    " ON CONFLICT (series_id, rank, block) DO UPDATE SET min_step = excluded.min_step, min_value = excluded.min_value,"
    " max_step = excluded.max_step, max_value = excluded.max_value, last_step = excluded.last_step"
)
_DROP_BLOCK = text("DELETE FROM point_blocks WHERE series_id = :sid AND rank = :rank AND block = :block")
_INF = {"inf": math.inf, "ninf": -math.inf}


def rebuild_blocks(session: Session, *, series_id: int, rank: int, first: int = 0, last: int = 2**63 - 1) -> None:
    """Recompute the blocks holding steps first..last (whole blocks) from the points."""
    lo, hi = first // BLOCK_STEPS * BLOCK_STEPS, min(last // BLOCK_STEPS * BLOCK_STEPS + BLOCK_STEPS - 1, 2**63 - 1)
    session.execute(
        text("DELETE FROM point_blocks WHERE series_id = :sid AND rank = :rank AND block >= :lo AND block <= :hi"),
        {"sid": series_id, "rank": rank, "lo": lo // BLOCK_STEPS, "hi": hi // BLOCK_STEPS},
    )
    session.execute(REBUILD_BLOCKS, {"sid": series_id, "rank": rank, "first": lo, "last": hi, **_INF})


def update_blocks(session: Session, *, rank: int, written: dict[int, tuple[list[int], list[float | None]]]) -> None:
    """Keep `point_blocks` right after the points `written` ({series id: (steps, values)}, NaN as None) were
    upserted in this transaction. Points after a block's last finite point (a run going on) fold into its
    extremes; a block where a point may have been replaced (a user's value over the agent's, an earlier step
    arriving late) is recomputed from its points. A replayed batch is never stored twice (see `batches`)."""
    touched = {}
    for sid, (steps, values) in written.items():
        touched.update(_batch_blocks(sid, steps, values))
    if not touched:
        return
    known = _known_blocks(session, rank, list(touched))
    merged, stale = [], []
    for (sid, block), (first_step, extremes) in touched.items():
        old = known.get((sid, block))
        if old is not None and first_step <= old[4]:
            stale.append({"sid": sid, "rank": rank, "block": block})
        elif extremes is not None:
            merged.append((sid, rank, block, *(_fold(old, extremes) if old is not None else extremes)))
    if merged:
        connection = session.connection()
        connection.exec_driver_sql(
            _UPSERT_BLOCK.format("%s" if connection.dialect.name == "postgresql" else "?"), merged
        )
    if stale:
        session.execute(_DROP_BLOCK, stale)
        params = [
            {
                "sid": b["sid"],
                "rank": rank,
                "first": b["block"] * BLOCK_STEPS,
                "last": b["block"] * BLOCK_STEPS + BLOCK_STEPS - 1,
                **_INF,
            }
            for b in stale
        ]
        session.execute(REBUILD_BLOCKS, params)


Extremes = tuple[int, float, int, float, int]  # min step, min value, max step, max value, last finite step


def _batch_blocks(
    sid: int, steps: list[int], values: list[float | None]
) -> dict[tuple[int, int], tuple[int, Extremes | None]]:
    """Per block the batch touches: its first step there, and the extremes of its finite values there."""
    if len(set(steps)) < len(steps) or steps != sorted(steps):
        last = dict(zip(steps, values))  # a step given twice keeps its last value, as the upsert does
        steps = sorted(last)
        values = [last[s] for s in steps]
    out: dict[tuple[int, int], tuple[int, Extremes | None]] = {}
    i, n = 0, len(steps)
    while i < n:
        block = steps[i] // BLOCK_STEPS
        j = bisect.bisect_left(steps, (block + 1) * BLOCK_STEPS, i)
        out[(sid, block)] = (steps[i], _extremes_in(steps[i:j], values[i:j]))
        i = j
    return out


def _extremes_in(steps: list[int], values: list[float | None]) -> Extremes | None:
    """The finite extremes of points in step order (the earliest step of a tie); None when none is finite."""
    if None in values or math.inf in values or -math.inf in values:
        kept = [(s, v) for s, v in zip(steps, values) if v is not None and -math.inf < v < math.inf]
        if not kept:
            return None
        steps, values = [s for s, _ in kept], [v for _, v in kept]
    # (no None is left: it was filtered out just above)
    low, high = min(values), max(values)  # type: ignore[type-var]
    # (no None is left: it was filtered out just above)
    return (steps[values.index(low)], low, steps[values.index(high)], high, steps[-1])  # type: ignore[return-value]


def _known_blocks(session: Session, rank: int, keys: list[tuple[int, int]]) -> dict[tuple[int, int], Extremes]:
    """The stored rows of these (series id, block) keys; on Postgres locked until commit. One query over the
    blocks' span when it is short (a batch of consecutive steps), one per series otherwise. Sent to the driver
    as is: this runs for every batch, and building the statement would cost more than running it."""
    connection = session.connection()
    mark, lock = ("%s", " FOR UPDATE") if connection.dialect.name == "postgresql" else ("?", "")
    per_series: dict[int, list[int]] = {}
    for sid, block in keys:
        per_series.setdefault(sid, []).append(block)
    blocks, sids = [b for _, b in keys], list(per_series)
    spans = (
        [(sids[i : i + IDS_PER_QUERY], min(blocks), max(blocks)) for i in range(0, len(sids), IDS_PER_QUERY)]
        if (max(blocks) - min(blocks) < 64)
        else [([sid], min(bs), max(bs)) for sid, bs in per_series.items()]
    )
    wanted = set(keys)
    out: dict[tuple[int, int], Extremes] = {}
    for sids, lo, hi in spans:
        sql = (
            "SELECT series_id, block, min_step, min_value, max_step, max_value, last_step FROM point_blocks"
            f" WHERE series_id IN ({', '.join([mark] * len(sids))}) AND rank = {mark}"
            f" AND block >= {mark} AND block <= {mark}{lock}"
        )
        for row in connection.exec_driver_sql(sql, (*sids, rank, lo, hi)):
            if (row[0], row[1]) in wanted:
                out[(row[0], row[1])] = tuple(row[2:])
    return out


def _fold(old: Extremes, new: Extremes) -> Extremes:
    low = min((old[1], old[0]), (new[1], new[0]))
    high = min((-old[3], old[2]), (-new[3], new[2]))
    return (low[1], low[0], high[1], -high[0], max(old[4], new[4]))
