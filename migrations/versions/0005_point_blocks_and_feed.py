"""point_blocks (finite extremes per block of 64 steps, for charting long series) and point_feed (stored
batches numbered per run in commit order, for live streams); point_blocks is filled from existing points

Revision ID: 0005
Revises: 0004
"""

import math

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# The same statement as ampwatch.server.rollups.REBUILD_BLOCKS as of this revision, over every series.
_BACKFILL = """
INSERT INTO point_blocks (series_id, rank, block, min_step, min_value, max_step, max_value, last_step)
SELECT DISTINCT series_id, rank, step / 64,
       first_value(step) OVER lo, first_value(value) OVER lo, first_value(step) OVER hi, first_value(value) OVER hi,
       max(step) OVER b
FROM points
WHERE value > :ninf AND value < :inf
WINDOW b AS (PARTITION BY series_id, rank, step / 64),
       lo AS (PARTITION BY series_id, rank, step / 64 ORDER BY value, step),
       hi AS (PARTITION BY series_id, rank, step / 64 ORDER BY value DESC, step)
"""


def upgrade() -> None:
    op.create_table(
        "point_blocks",
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("block", sa.BigInteger(), nullable=False),
        sa.Column("min_step", sa.BigInteger(), nullable=False),
        sa.Column("min_value", sa.Double(), nullable=False),
        sa.Column("max_step", sa.BigInteger(), nullable=False),
        sa.Column("max_value", sa.Double(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["series_id"], ["series.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("series_id", "rank", "block"),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "point_feed",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("position", sa.BigInteger(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "position"),
    )
    op.execute(sa.text(_BACKFILL).bindparams(inf=math.inf, ninf=-math.inf))


def downgrade() -> None:
    op.drop_table("point_feed")
    op.drop_table("point_blocks")
