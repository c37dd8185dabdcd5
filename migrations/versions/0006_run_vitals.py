"""run vitals kept at ingest in the run's row (skip rate over the last 1000 steps and latest loss scale, both of
rank 0), backfilled from existing points; indexes on runs.last_seen_at (the runs list sorted by it, the runs
stream's recent changes) and alerts.updated_at (the runs stream's alert changes)

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# The same definitions as ampwatch.server.vitals as of this revision.
_SERIES = "SELECT id FROM series WHERE series.run_id = runs.id AND series.name = '{}'"
_LAST = "(SELECT max(step) FROM points WHERE series_id = ({}) AND rank = 0)"
_BACKFILL = [
    f"UPDATE runs SET scale_step = {_LAST.format(_SERIES.format('scale'))}",
    f"UPDATE runs SET scale = (SELECT value FROM points WHERE series_id = ({_SERIES.format('scale')}) AND rank = 0"
    " AND step = runs.scale_step) WHERE scale_step IS NOT NULL",
    "UPDATE runs SET skip_rate = (SELECT avg(CASE WHEN value <> 0 THEN 1.0 ELSE 0.0 END) FROM points"
    f" WHERE series_id = ({_SERIES.format('skipped')}) AND rank = 0"
    f" AND step > {_LAST.format(_SERIES.format('skipped'))} - 1000)",
]


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("skip_rate", sa.Double(), nullable=True))
        batch.add_column(sa.Column("scale", sa.Double(), nullable=True))
        batch.add_column(sa.Column("scale_step", sa.BigInteger(), nullable=True))
    op.create_index("ix_runs_last_seen_at", "runs", ["last_seen_at"])
    op.create_index("ix_alerts_updated_at", "alerts", ["updated_at"])
    for statement in _BACKFILL:
        op.execute(sa.text(statement))


def downgrade() -> None:
    op.drop_index("ix_alerts_updated_at", "alerts")
    op.drop_index("ix_runs_last_seen_at", "runs")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("scale_step")
        batch.drop_column("scale")
        batch.drop_column("skip_rate")
