"""a stop asked of a run: when, by whom and why (the run then ends with the status `stopped`)

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("stop_requested_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("stop_by", sa.String(200), nullable=True))
        batch.add_column(sa.Column("stop_reason", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("stop_reason")
        batch.drop_column("stop_by")
        batch.drop_column("stop_requested_at")
