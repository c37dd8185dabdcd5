"""Postgres: points partitioned by RANGE of series_id, one partition per block of 256 series ids owned by one run
(deleting a run truncates and drops its partitions). The existing points table becomes the partition
`points_legacy` of every series id in use, as it is: nothing is copied or renumbered, its runs are deleted row
by row as before, and it is dropped once the last of them is gone. SQLite is left as it is.

Revision ID: 0007
Revises: 0006
"""

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# As ampwatch.server.partitions as of this revision.
BLOCK = 256
SEQUENCE = "points_partition_seq"
LEGACY = "points_legacy"
NONFINITE = sa.text("value IS NULL OR value > 1e308 OR value < -1e308")


def _points_table(name: str, **partitioning: Any) -> None:
    op.create_table(
        name,
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("value", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(["series_id"], ["series.id"], name=f"{name}_series_id_fkey", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("series_id", "rank", "step", name=f"{name}_pkey"),
        **partitioning,
    )
    op.create_index(
        "ix_points_nonfinite" if name == "points" else f"ix_{name}_nonfinite",
        name,
        ["series_id", "rank", "step"],
        postgresql_where=NONFINITE,
    )


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    top = bind.scalar(sa.text("SELECT max(id) FROM series"))
    op.execute(f"ALTER TABLE points RENAME TO {LEGACY}")
    op.execute(f"ALTER INDEX points_pkey RENAME TO {LEGACY}_pkey")
    op.execute(f"ALTER INDEX ix_points_nonfinite RENAME TO ix_{LEGACY}_nonfinite")
    op.execute(f"ALTER TABLE {LEGACY} RENAME CONSTRAINT points_series_id_fkey TO {LEGACY}_series_id_fkey")
    _points_table("points", postgresql_partition_by="RANGE (series_id)")
    if top is None:  # no series yet: nothing to keep
        op.drop_table(LEGACY)
        first = 1
    else:  # every id in use, and the rest of its block, stays in the old table
        first = top // BLOCK + 1
        op.execute(f"ALTER TABLE points ATTACH PARTITION {LEGACY} FOR VALUES FROM (MINVALUE) TO ({first * BLOCK})")
    op.execute(f"CREATE SEQUENCE {SEQUENCE} START WITH {first}")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    _points_table("points_unpartitioned")
    op.execute("INSERT INTO points_unpartitioned SELECT series_id, rank, step, value FROM points")
    op.drop_table("points")  # (and its partitions)
    op.execute("ALTER TABLE points_unpartitioned RENAME TO points")
    op.execute("ALTER INDEX points_unpartitioned_pkey RENAME TO points_pkey")
    op.execute("ALTER INDEX ix_points_unpartitioned_nonfinite RENAME TO ix_points_nonfinite")
    op.execute("ALTER TABLE points RENAME CONSTRAINT points_unpartitioned_series_id_fkey TO points_series_id_fkey")
    op.execute(f"DROP SEQUENCE {SEQUENCE}")
