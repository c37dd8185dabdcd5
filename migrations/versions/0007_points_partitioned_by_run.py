"""Postgres: points partitioned by RANGE of series_id, one partition per block of 256 series ids owned by one run
(deleting a run truncates and drops its partitions); existing series are renumbered into per-run blocks and
their points and rollups moved along. SQLite is left as it is.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# As ampwatch.server.partitions as of this revision.
BLOCK = 256
SEQUENCE = "points_partition_seq"
NONFINITE = sa.text("value IS NULL OR value > 1e308 OR value < -1e308")

# Each run's series, in id order, take the ids of consecutive new blocks, numbered above every id in use (so the
# renumbering never meets an id not yet moved).
_RENUMBER = f"""
CREATE TEMPORARY TABLE series_renumber ON COMMIT DROP AS
SELECT old_id, (:first + dense_rank() OVER (ORDER BY run_id, local_block) - 1) * {BLOCK} + (rn - 1) % {BLOCK} AS new_id
FROM (SELECT id AS old_id, run_id, row_number() OVER w AS rn, (row_number() OVER w - 1) / {BLOCK} AS local_block
      FROM series WINDOW w AS (PARTITION BY run_id ORDER BY id)) AS s
"""


def _points_table(name: str, **partitioning: str) -> None:
    op.create_table(
        name,
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("value", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("series_id", "rank", "step", name=f"{name}_pkey"),
        **partitioning,
    )


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    op.execute("ALTER TABLE points RENAME TO points_unpartitioned")
    op.execute("ALTER INDEX points_pkey RENAME TO points_unpartitioned_pkey")
    op.execute("ALTER INDEX ix_points_nonfinite RENAME TO ix_points_unpartitioned_nonfinite")
    op.drop_constraint("points_series_id_fkey", "points_unpartitioned", type_="foreignkey")
    op.drop_constraint("point_blocks_series_id_fkey", "point_blocks", type_="foreignkey")

    first = int(bind.scalar(sa.text("SELECT coalesce(max(id), 0) FROM series"))) // BLOCK + 1
    bind.execute(sa.text(_RENUMBER), {"first": first})
    bind.execute(sa.text("UPDATE series SET id = r.new_id FROM series_renumber r WHERE series.id = r.old_id"))
    bind.execute(
        sa.text("UPDATE point_blocks SET series_id = r.new_id FROM series_renumber r WHERE series_id = r.old_id")
    )
    blocks = [int(b) for b in bind.scalars(sa.text(f"SELECT DISTINCT new_id / {BLOCK} FROM series_renumber"))]

    _points_table("points", postgresql_partition_by="RANGE (series_id)")
    op.create_index("ix_points_nonfinite", "points", ["series_id", "rank", "step"], postgresql_where=NONFINITE)
    for block in blocks:
        op.execute(
            f"CREATE TABLE points_p{block} PARTITION OF points FOR VALUES FROM ({block * BLOCK}) TO ({(block + 1) * BLOCK})"
        )
    op.execute(
        "INSERT INTO points (series_id, rank, step, value) SELECT r.new_id, p.rank, p.step, p.value"
        " FROM points_unpartitioned p JOIN series_renumber r ON r.old_id = p.series_id"
    )
    op.drop_table("points_unpartitioned")
    op.create_foreign_key(None, "points", "series", ["series_id"], ["id"], ondelete="CASCADE")
    op.create_foreign_key(None, "point_blocks", "series", ["series_id"], ["id"], ondelete="CASCADE")
    op.execute(f"CREATE SEQUENCE {SEQUENCE} START WITH {max(blocks, default=first - 1) + 1}")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    _points_table("points_unpartitioned")
    op.execute("INSERT INTO points_unpartitioned SELECT series_id, rank, step, value FROM points")
    op.drop_table("points")  # (and its partitions)
    op.execute("ALTER TABLE points_unpartitioned RENAME TO points")
    op.execute("ALTER INDEX points_unpartitioned_pkey RENAME TO points_pkey")
    op.create_index("ix_points_nonfinite", "points", ["series_id", "rank", "step"], postgresql_where=NONFINITE)
    op.create_foreign_key(None, "points", "series", ["series_id"], ["id"], ondelete="CASCADE")
    op.execute(f"DROP SEQUENCE {SEQUENCE}")
