"""alerts: rules, alert state, flips, channels, deliveries, silences, run liveness

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "alert_channels",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("secret", sa.Text(), nullable=True),
        sa.Column("project", sa.String(length=200), nullable=True),
        sa.Column("min_severity", sa.String(length=16), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "alert_rules",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("event_type", sa.String(length=32), nullable=True),
        sa.Column("min_event_severity", sa.String(length=16), nullable=False),
        sa.Column("series", sa.String(length=200), nullable=True),
        sa.Column("aggregation", sa.String(length=16), nullable=True),
        sa.Column("op", sa.String(length=2), nullable=True),
        sa.Column("threshold", sa.Double(), nullable=True),
        sa.Column("window_steps", sa.Integer(), nullable=True),
        sa.Column("ignore_steps", sa.BigInteger(), nullable=False),
        sa.Column("for_steps", sa.BigInteger(), nullable=False),
        sa.Column("for_s", sa.Double(), nullable=False),
        sa.Column("keep_firing_for_s", sa.Double(), nullable=False),
        sa.Column("repeat_interval_s", sa.Double(), nullable=True),
        sa.Column("per_rank", sa.Boolean(), nullable=False),
        sa.Column("inhibits", sa.Boolean(), nullable=False),
        sa.Column("project", sa.String(length=200), nullable=True),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "alert_silences",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project", sa.String(length=200), nullable=True),
        sa.Column("run_id", sa.String(length=64), nullable=True),
        sa.Column("rule", sa.String(length=100), nullable=True),
        sa.Column("starts_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ends_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("comment", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("alert_silences", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_alert_silences_ends_at"), ["ends_at"], unique=False)

    op.create_table(
        "run_liveness",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=True),
        sa.Column("last_step_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("step_time_s", sa.Double(), nullable=True),
        sa.Column("calibrated_step", sa.BigInteger(), nullable=True),
        sa.Column("detected", sa.String(length=16), nullable=True),
        sa.Column("evaluated_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id"),
    )
    op.create_table(
        "alert_flips",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("alert_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("old_state", sa.String(length=16), nullable=True),
        sa.Column("new_state", sa.String(length=16), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("suppressed", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["alert_id"], ["alerts.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("alert_flips", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_alert_flips_alert_id"), ["alert_id"], unique=False)

    op.create_table(
        "alert_deliveries",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("flip_id", sa.Integer(), nullable=True),
        sa.Column("channel_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("response_status", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["channel_id"], ["alert_channels.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["flip_id"], ["alert_flips.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("alert_deliveries", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_alert_deliveries_channel_id"), ["channel_id"], unique=False)
        batch_op.create_index("ix_alert_deliveries_due", ["status", "due_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_alert_deliveries_flip_id"), ["flip_id"], unique=False)

    with op.batch_alter_table("alerts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("rule_id", sa.Integer(), nullable=True))
        # Rows from before this revision (none were ever written) get harmless defaults.
        batch_op.add_column(sa.Column("rank", sa.Integer(), nullable=False, server_default="-1"))
        batch_op.add_column(sa.Column("step", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("last_step", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("count", sa.Integer(), nullable=False, server_default="1"))
        batch_op.add_column(sa.Column("fired_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("cleared_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("last_notified_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(
            sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now())
        )
        batch_op.add_column(sa.Column("details", sa.JSON(), nullable=False, server_default="{}"))
        batch_op.create_index(batch_op.f("ix_alerts_rule_id"), ["rule_id"], unique=False)
        batch_op.create_index(
            "ux_alerts_active",
            ["rule", "run_id", "rank"],
            unique=True,
            sqlite_where=sa.text("state IN ('pending', 'firing')"),
            postgresql_where=sa.text("state IN ('pending', 'firing')"),
        )
        batch_op.create_foreign_key("fk_alerts_rule_id", "alert_rules", ["rule_id"], ["id"], ondelete="SET NULL")


def downgrade() -> None:
    with op.batch_alter_table("alerts", schema=None) as batch_op:
        batch_op.drop_constraint("fk_alerts_rule_id", type_="foreignkey")
        batch_op.drop_index(
            "ux_alerts_active",
            sqlite_where=sa.text("state IN ('pending', 'firing')"),
            postgresql_where=sa.text("state IN ('pending', 'firing')"),
        )
        batch_op.drop_index(batch_op.f("ix_alerts_rule_id"))
        batch_op.drop_column("details")
        batch_op.drop_column("updated_at")
        batch_op.drop_column("last_notified_at")
        batch_op.drop_column("cleared_at")
        batch_op.drop_column("fired_at")
        batch_op.drop_column("count")
        batch_op.drop_column("last_step")
        batch_op.drop_column("step")
        batch_op.drop_column("rank")
        batch_op.drop_column("rule_id")

    with op.batch_alter_table("alert_deliveries", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_alert_deliveries_flip_id"))
        batch_op.drop_index("ix_alert_deliveries_due")
        batch_op.drop_index(batch_op.f("ix_alert_deliveries_channel_id"))

    op.drop_table("alert_deliveries")
    with op.batch_alter_table("alert_flips", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_alert_flips_alert_id"))

    op.drop_table("alert_flips")
    op.drop_table("run_liveness")
    with op.batch_alter_table("alert_silences", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_alert_silences_ends_at"))

    op.drop_table("alert_silences")
    op.drop_table("alert_rules")
    op.drop_table("alert_channels")
