"""points: partial index on non-finite values (NaN is NULL, ±Infinity beyond ±1e308)

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

NONFINITE_POINT = sa.text("value IS NULL OR value > 1e308 OR value < -1e308")


def upgrade() -> None:
    with op.batch_alter_table("points", schema=None) as batch_op:
        batch_op.create_index(
            "ix_points_nonfinite",
            ["series_id", "rank", "step"],
            unique=False,
            sqlite_where=NONFINITE_POINT,
            postgresql_where=NONFINITE_POINT,
        )


def downgrade() -> None:
    with op.batch_alter_table("points", schema=None) as batch_op:
        batch_op.drop_index("ix_points_nonfinite")
