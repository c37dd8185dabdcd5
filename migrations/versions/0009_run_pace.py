"""a run's pace (the highest agent step of its latest batch, its step rate and the weight of that average) and the
step after which every rank of a run of several stops, once a stop was asked (see ampwatch.server.stopping)

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("pace_step", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("step_rate", sa.Double(), nullable=True))
        batch.add_column(sa.Column("step_rate_weight", sa.Double(), nullable=True))
        batch.add_column(sa.Column("stop_at_step", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("stop_at_step")
        batch.drop_column("step_rate_weight")
        batch.drop_column("step_rate")
        batch.drop_column("pace_step")
