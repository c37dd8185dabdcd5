"""a stop asked of a run: when, by whom and why (the run then ends with the status `stopped`); the id of the run's
latest critical numerics event, backfilled from its events

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# The same definition as ampwatch.server.stopping as of this revision.
_BACKFILL = (
    "UPDATE runs SET critical_event_id = (SELECT max(id) FROM events WHERE events.run_id = runs.id"
    " AND severity = 'critical' AND type NOT IN ('run_crashed', 'run_stalled', 'run_stopped'))"
)


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("stop_requested_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("stop_by", sa.String(200), nullable=True))
        batch.add_column(sa.Column("stop_reason", sa.Text(), nullable=True))
        batch.add_column(sa.Column("critical_event_id", sa.BigInteger(), nullable=True))
    op.execute(sa.text(_BACKFILL))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("critical_event_id")
        batch.drop_column("stop_reason")
        batch.drop_column("stop_by")
        batch.drop_column("stop_requested_at")
