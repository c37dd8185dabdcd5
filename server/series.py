"""Series reads done in SQL: exact points, per-bucket extremes of long series, non-finite points, heatmaps.

A long series is charted from per-bucket extremes. When a bucket spans at least a block of BLOCK_STEPS
steps, the extremes come from `point_blocks`, the finite minimum and maximum of every block kept at ingest
(`update_blocks`): a 1M-step series is about 16 000 rows. Narrower buckets (a zoomed chart) are read from the
points themselves: for every bucket one correlated subquery walks that slice of the `(series_id, rank, step)`
primary key and returns the step of its maximum, another the step of its minimum. Either way non-finite
points come from the partial index `ix_points_nonfinite`, so every one of them is kept.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sqlalchemy import Engine, bindparam, select, text
from sqlalchemy.orm import Session

from ampwatch.server import models
from ampwatch.server.models import BLOCK_STEPS
from ampwatch.server.values import to_json_cells

Points = tuple[list[int], list[float | None]]
PARALLEL_STEPS = 200_000  # longer ranges are split in two halves read on two connections at once
_NONFINITE = "(value IS NULL OR value > 1e308 OR value < -1e308)"  # the predicate of ix_points_nonfinite
# Buckets of :w steps from :lo to :hi as b(lo, last), `last` inclusive: each is one range of the primary key. (Written
# so that no sum passes :hi: steps go up to the largest BIGINT, and one past it overflows on Postgres.)
_BUCKETS = {
    "sqlite": "WITH RECURSIVE b(lo, last) AS (SELECT :lo, :lo + min(:w - 1, :hi - :lo)"
    " UNION ALL SELECT last + 1, last + 1 + min(:w - 1, :hi - last - 1) FROM b WHERE last < :hi)",
    "postgresql": "WITH b AS (SELECT g.lo, g.lo + LEAST(CAST(:w AS bigint) - 1, CAST(:hi AS bigint) - g.lo) AS last"
    " FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint), CAST(:w AS bigint)) AS g(lo))",
}
_RANGE = "series_id = :sid AND rank = :rank AND step >= b.lo AND step <= b.last"

# SQLite: a bare column next to a single max() (or min()) comes from the row holding that extreme.
_EXTREMES_SQLITE = text(f"""{_BUCKETS["sqlite"]}
SELECT (SELECT step FROM (SELECT step, max(value) FROM points WHERE {_RANGE})),
       (SELECT step FROM (SELECT step, min(value) FROM points WHERE {_RANGE}))
FROM b""")
# Postgres has no bare columns: one pass finds each bucket's extremes, a short seek finds their steps.
_EXTREMES_POSTGRES = text(f"""{_BUCKETS["postgresql"]}, e AS (
  SELECT b.lo, b.last, m.mx, m.mn
  FROM b, LATERAL (SELECT max(value) AS mx, min(value) AS mn FROM points WHERE {_RANGE}) AS m
)
SELECT (SELECT step FROM points WHERE {_RANGE.replace("b.", "e.")} AND value = e.mx LIMIT 1),
       (SELECT step FROM points WHERE {_RANGE.replace("b.", "e.")} AND value = e.mn LIMIT 1)
FROM e""")


def _dialect(session: Session) -> str:
    return session.get_bind().dialect.name


def bounds(session: Session, *, series_id: int, rank: int) -> tuple[int, int] | None:
    """The first and last step of a series, by two index seeks; None when it has no points."""
    row = session.execute(
        text(
            "SELECT (SELECT min(step) FROM points WHERE series_id = :sid AND rank = :rank),"
            " (SELECT max(step) FROM points WHERE series_id = :sid AND rank = :rank)"
        ),
        {"sid": series_id, "rank": rank},
    ).one()
    return None if row[0] is None else (row[0], row[1])


def read_range(session: Session, *, series_id: int, rank: int, lo: int, hi: int) -> Points:
    """Every point with lo <= step <= hi, in step order."""
    rows = session.execute(
        text(
            "SELECT step, value FROM points WHERE series_id = :sid AND rank = :rank AND step >= :lo AND step <= :hi"
            " ORDER BY step"
        ),
        {"sid": series_id, "rank": rank, "lo": lo, "hi": hi},
    ).all()
    return [r[0] for r in rows], [r[1] for r in rows]


def read_series(
    session: Session,
    *,
    series_id: int,
    rank: int,
    start: int | None = None,
    end: int | None = None,
    max_points: int | None = None,
) -> Points:
    """Points of one series in [start, end]; with `max_points`, when the range holds more points than that,
    per-bucket min and max, the first and the last point, and every non-finite point on top (so at most
    `max_points` finite points)."""
    span = bounds(session, series_id=series_id, rank=rank)
    if span is None:
        return [], []
    lo, hi = max(span[0], start if start is not None else span[0]), min(span[1], end if end is not None else span[1])
    if lo > hi:
        return [], []
    if (
        max_points is None
        or hi - lo + 1 <= max_points
        or _count(session, series_id, rank, lo, hi, max_points + 1) <= max_points
    ):
        return read_range(session, series_id=series_id, rank=rank, lo=lo, hi=hi)
    return _downsample(session, series_id, rank, lo, hi, max_points)


def _count(session: Session, series_id: int, rank: int, lo: int, hi: int, limit: int) -> int:
    """How many points lo <= step <= hi, counted no further than `limit` (a short walk of the primary key: a
    sparse series with a dense burst spans more steps than it has points)."""
    return session.execute(
        text(
            "SELECT count(*) FROM (SELECT 1 FROM points"
            " WHERE series_id = :sid AND rank = :rank AND step >= :lo AND step <= :hi LIMIT :limit) AS p"
        ),
        {"sid": series_id, "rank": rank, "lo": lo, "hi": hi, "limit": limit},
    ).scalar_one()


def _downsample(session: Session, series_id: int, rank: int, lo: int, hi: int, max_points: int) -> Points:
    buckets = max(1, (max_points - 2) // 2)
    width = -(-(hi - lo + 1) // buckets)
    if width >= BLOCK_STEPS:
        kept = _from_blocks(session, series_id, rank, lo, hi, buckets)
        kept.update(_values_at(session, series_id, rank, _ends(session, series_id, rank, lo, hi)))
    else:
        kept = _from_points(session, series_id, rank, lo, hi, width)
    kept.update(nonfinite(session, series_ids=[series_id], rank=rank, lo=lo, hi=hi).get(series_id, {}))
    order = sorted(kept)
    return order, [kept[s] for s in order]


def _from_points(session: Session, series_id: int, rank: int, lo: int, hi: int, width: int) -> dict[int, float | None]:
    """Each bucket's extremes, the first and the last point, read from the points (buckets of `width` from `lo`)."""
    params = {"sid": series_id, "rank": rank, "lo": lo, "hi": hi, "w": width}
    chosen = _extremes(session, params)
    chosen.update(_ends(session, series_id, rank, lo, hi))
    kept = _values_at(session, series_id, rank, chosen)
    # A bucket whose extreme is ±Infinity still shows its finite extremes: look those up in that bucket only.
    for step in [s for s, v in kept.items() if v is not None and math.isinf(v)]:
        first = lo + (step - lo) // width * width
        kept.update(_finite_extremes(session, series_id, rank, first, min(hi, first + width - 1)))
    return kept


def block_buckets(lo: int, hi: int, buckets: int) -> list[tuple[int, int]]:
    """The buckets charted from blocks: consecutive whole blocks (the range's own ends cut the first and the
    last), as even as whole blocks allow, at most `buckets` of them; (first step, last step) each."""
    first, count = lo // BLOCK_STEPS, hi // BLOCK_STEPS - lo // BLOCK_STEPS + 1
    k = min(buckets, count)
    starts = [first + -(-j * count // k) for j in range(k)] + [first + count]
    return [(max(lo, a * BLOCK_STEPS), min(hi, b * BLOCK_STEPS - 1)) for a, b in zip(starts, starts[1:])]


def _from_blocks(
    session: Session, series_id: int, rank: int, lo: int, hi: int, buckets: int
) -> dict[int, float | None]:
    """Each bucket's finite extremes from `point_blocks`; the blocks the range cuts are read from the points."""
    first, count = lo // BLOCK_STEPS, hi // BLOCK_STEPS - lo // BLOCK_STEPS + 1
    k = min(buckets, count)
    best: dict[int, list[Any]] = {}  # bucket -> [min step, min value, max step, max value]

    def widen(block: int, step: int, value: float) -> None:
        cell = best.setdefault((block - first) * k // count, [step, value, step, value])
        if value < cell[1]:
            cell[0], cell[1] = step, value
        if value > cell[3]:
            cell[2], cell[3] = step, value

    inner = (-(-lo // BLOCK_STEPS), (hi + 1) // BLOCK_STEPS - 1)  # blocks wholly inside [lo, hi]
    rows = session.execute(_BLOCKS, {"sid": series_id, "rank": rank, "lo": inner[0], "hi": inner[1]})
    for block, min_step, min_value, max_step, max_value in rows:
        widen(block, min_step, min_value)
        widen(block, max_step, max_value)
    edges = {(lo, min(hi, (first + 1) * BLOCK_STEPS - 1)), (max(lo, (hi // BLOCK_STEPS) * BLOCK_STEPS), hi)}
    for a, b in edges:
        if a // BLOCK_STEPS < inner[0] or b // BLOCK_STEPS > inner[1]:
            for step, value in _finite_extremes(session, series_id, rank, a, b).items():
                # (_finite_extremes reads finite values only, never None)
                widen(step // BLOCK_STEPS, step, value)  # type: ignore[arg-type]
    return {s: v for cell in best.values() for s, v in ((cell[0], cell[1]), (cell[2], cell[3]))}


_BLOCKS = text(
    "SELECT block, min_step, min_value, max_step, max_value FROM point_blocks"
    " WHERE series_id = :sid AND rank = :rank AND block >= :lo AND block <= :hi"
)


def _extremes(session: Session, params: dict[str, int]) -> set[int]:
    """Steps of every bucket's minimum and maximum; a long range is read in two halves concurrently."""
    lo, hi, width = params["lo"], params["hi"], params["w"]
    bind = session.get_bind()
    engine = bind if isinstance(bind, Engine) else bind.engine
    if hi - lo < PARALLEL_STEPS or engine.url.database in (None, "", ":memory:"):
        return _extremes_of(session, params)
    mid = lo + (hi - lo + 1) // width // 2 * width  # on a bucket boundary
    with ThreadPoolExecutor(1) as pool, Session(engine) as other:
        upper = pool.submit(_extremes_of, other, {**params, "lo": mid})
        return _extremes_of(session, {**params, "hi": mid - 1}) | upper.result()


def _extremes_of(session: Session, params: dict[str, int]) -> set[int]:
    query = _EXTREMES_SQLITE
    if _dialect(session) == "postgresql":
        query = _EXTREMES_POSTGRES
        session.execute(text("SET LOCAL jit = off"))  # compiling this plan costs more than running it
    return {s for row in session.execute(query, params) for s in row if s is not None}


def _ends(session: Session, series_id: int, rank: int, lo: int, hi: int) -> list[int]:
    row = session.execute(
        text(
            "SELECT (SELECT min(step) FROM points WHERE series_id = :sid AND rank = :rank AND step >= :lo),"
            " (SELECT max(step) FROM points WHERE series_id = :sid AND rank = :rank AND step <= :hi)"
        ),
        {"sid": series_id, "rank": rank, "lo": lo, "hi": hi},
    ).one()
    return [s for s in row if s is not None]


def _values_at(session: Session, series_id: int, rank: int, steps: Iterable[int]) -> dict[int, float | None]:
    query = text("SELECT step, value FROM points WHERE series_id = :sid AND rank = :rank AND step IN :steps")
    query = query.bindparams(bindparam("steps", expanding=True))
    wanted = sorted(steps)
    return dict(session.execute(query, {"sid": series_id, "rank": rank, "steps": wanted}).all()) if wanted else {}


def _finite_extremes(session: Session, series_id: int, rank: int, lo: int, hi: int) -> dict[int, float | None]:
    out: dict[int, float | None] = {}
    for order in ("DESC", "ASC"):
        row = session.execute(
            text(
                "SELECT step, value FROM points WHERE series_id = :sid AND rank = :rank AND step >= :lo AND step <= :hi"
                f" AND value < :inf AND value > :ninf ORDER BY value {order} LIMIT 1"
            ),
            {"sid": series_id, "rank": rank, "lo": lo, "hi": hi, "inf": math.inf, "ninf": -math.inf},
        ).first()
        if row is not None:
            out[row[0]] = row[1]
    return out


def nonfinite(
    session: Session, *, series_ids: list[int], rank: int, lo: int, hi: int
) -> dict[int, dict[int, float | None]]:
    """Per series, every NaN (None) and ±Infinity point in [lo, hi], found through `ix_points_nonfinite`."""
    if not series_ids:
        return {}
    hint = " INDEXED BY ix_points_nonfinite" if _dialect(session) == "sqlite" else ""
    query = text(
        f"SELECT series_id, step, value FROM points{hint} WHERE series_id IN :ids AND rank = :rank"
        f" AND step >= :lo AND step <= :hi AND {_NONFINITE}"
    ).bindparams(bindparam("ids", expanding=True))
    out: dict[int, dict[int, float | None]] = {}
    for sid, step, value in session.execute(query, {"ids": series_ids, "rank": rank, "lo": lo, "hi": hi}):
        if value is None or not math.isfinite(value):  # a finite value beyond 1e308 is not special
            out.setdefault(sid, {})[step] = value
    return out


def points_between(
    session: Session, *, run_id: str, rank: int, lo: int, hi: int, limit: int
) -> list[tuple[str, int, float | None]]:
    """(series name, step, value) of every point of the run with lo <= step <= hi, in step order, at most
    `limit`: one primary-key range per series, so a live stream pays for what is new only."""
    names = dict(
        session.execute(select(models.Series.id, models.Series.name).where(models.Series.run_id == run_id)).all()
    )
    if not names:
        return []
    # The ids named (not joined): Postgres then opens the run's partitions of points only (see partitions).
    rows = session.execute(
        text(
            "SELECT series_id, step, value FROM points WHERE series_id IN :ids AND rank = :rank"
            " AND step >= :lo AND step <= :hi ORDER BY step LIMIT :limit"
        ).bindparams(bindparam("ids", expanding=True)),
        {"ids": list(names), "rank": rank, "lo": lo, "hi": hi, "limit": limit},
    )
    return sorted(((names[sid], st, v) for sid, st, v in rows), key=lambda r: (r[1], r[0]))


def bucket_max(
    session: Session, *, series_ids: list[int], rank: int, lo: int, hi: int, width: int
) -> dict[int, list[float | None]]:
    """Per series, the largest value of each bucket of `width` steps from `lo` (None where a bucket is empty)."""
    query = text(
        f"{_BUCKETS[_dialect(session)]}"
        f" SELECT b.lo, (SELECT max(value) FROM points WHERE {_RANGE}) FROM b ORDER BY b.lo"
    )
    out: dict[int, list[float | None]] = {}
    for sid in series_ids:
        rows = session.execute(query, {"sid": sid, "rank": rank, "lo": lo, "hi": hi, "w": width})
        out[sid] = [r[1] for r in rows]
    return out


def natural_key(name: str) -> list[Any]:
    """Sort key that puts `blocks.2` before `blocks.10`."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def grid(
    session: Session, *, layers: list[tuple[str, int]], rank: int, columns: int, start: int | None, end: int | None
) -> dict[str, Any]:
    """(label, series id) pairs as a layer × step grid of about `columns` buckets: per cell the largest value,
    or the non-finite one ('NaN' before 'Infinity' before '-Infinity'); null where a layer has no point.
    Cells as wide as a block or wider are whole blocks, read from `point_blocks` (the grid's `steps` and
    `width` say where each cell starts and how wide it is)."""
    spans = [s for s in (bounds(session, series_id=i, rank=rank) for _, i in layers) if s]
    lo = max([min(s[0] for s in spans)] + ([start] if start is not None else [])) if spans else 0
    hi = min([max(s[1] for s in spans)] + ([end] if end is not None else [])) if spans else -1
    if lo > hi:
        return {"layers": [], "steps": [], "width": 1, "values": []}
    width = max(1, -(-(hi - lo + 1) // columns))
    ids = [i for _, i in layers]
    if width >= BLOCK_STEPS:
        width = -(-width // BLOCK_STEPS) * BLOCK_STEPS
        lo, hi = lo // BLOCK_STEPS * BLOCK_STEPS, hi // BLOCK_STEPS * BLOCK_STEPS + BLOCK_STEPS - 1
        cells = _block_max(session, ids, rank, lo, hi, width)
    else:
        cells = bucket_max(session, series_ids=ids, rank=rank, lo=lo, hi=hi, width=width)
    for sid, points in nonfinite(session, series_ids=ids, rank=rank, lo=lo, hi=hi).items():
        for step, value in points.items():
            row, k = cells[sid], (step - lo) // width
            row[k] = _worse(row[k], value)
    return {
        "layers": [name for name, _ in layers],
        "steps": list(range(lo, hi + 1, width)),
        "width": width,
        "values": [to_json_cells(cells[i]) for i in ids],
    }


def _block_max(
    session: Session, ids: list[int], rank: int, lo: int, hi: int, width: int
) -> dict[int, list[float | None]]:
    """Per series, the largest finite value of each cell of `width` steps (whole blocks) from `lo`."""
    query = text(
        "SELECT series_id, block, max_value FROM point_blocks WHERE series_id IN :ids AND rank = :rank"
        " AND block >= :lo AND block <= :hi"
    ).bindparams(bindparam("ids", expanding=True))
    out: dict[int, list[float | None]] = {i: [None] * -(-(hi - lo + 1) // width) for i in ids}
    params = {"ids": ids, "rank": rank, "lo": lo // BLOCK_STEPS, "hi": hi // BLOCK_STEPS}
    for sid, block, value in session.execute(query, params):
        row, k = out[sid], (block * BLOCK_STEPS - lo) // width
        row[k] = value if row[k] is None or value > row[k] else row[k]
    return out


def _worse(cell: float | None, value: float | None) -> float:
    """The cell a non-finite point leaves: NaN outranks +Infinity, which outranks -Infinity and any number."""
    point = math.nan if value is None else value
    return point if cell is None or _badness(point) >= _badness(cell) else cell


def _badness(value: float) -> int:
    return 3 if math.isnan(value) else 2 if value == math.inf else 1 if value == -math.inf else 0
