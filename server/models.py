"""The database schema. Alembic migrations in `ampwatch.migrations` must match it (a test checks).

`points.value` is NULL exactly when the value is NaN: SQLite turns a NaN float into NULL on its own,
so the meaning is made explicit and the same on Postgres. ±Infinity are stored as themselves.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Double,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import DateTime


class Base(DeclarativeBase):
    type_annotation_map = {datetime: DateTime(timezone=True), dict[str, Any]: JSON}


class Project(Base):
    __tablename__ = "projects"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime]


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16))
    health: Mapped[str] = mapped_column(String(16))
    config: Mapped[dict[str, Any]]
    environment: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(index=True)
    last_seen_at: Mapped[datetime] = mapped_column(index=True)
    finished_at: Mapped[datetime | None]
    last_step: Mapped[int | None] = mapped_column(BigInteger)
    # Vitals kept at ingest (see ampwatch.server.vitals): rank 0's skip rate over its last steps, latest scale.
    skip_rate: Mapped[float | None] = mapped_column(Double)
    scale: Mapped[float | None] = mapped_column(Double)  # NULL with a scale_step: the scale is NaN
    scale_step: Mapped[int | None] = mapped_column(BigInteger)  # NULL: no scale yet
    # A stop asked of the run (see ampwatch.server.stopping): pending while stop_requested_at is set and the run has
    # not ended; who and why stay once it ended `stopped`.
    stop_requested_at: Mapped[datetime | None]
    stop_by: Mapped[str | None] = mapped_column(String(200))
    stop_reason: Mapped[str | None] = mapped_column(Text)
    # The id of the run's latest critical numerics event (any rank; not a crash or stall): batch replies name it.
    critical_event_id: Mapped[int | None] = mapped_column(BigInteger)
    # The run's pace (the highest agent step of its latest batch, steps per second, the weight of that average) and,
    # for a stop asked of a run of several ranks, the step every rank stops after (see ampwatch.server.stopping).
    pace_step: Mapped[int | None] = mapped_column(BigInteger)
    step_rate: Mapped[float | None] = mapped_column(Double)
    step_rate_weight: Mapped[float | None] = mapped_column(Double)
    stop_at_step: Mapped[int | None] = mapped_column(BigInteger)
    # For a run of several ranks: the step every rank stops after on its first critical numerics event, for agents
    # started with `stop_on=("critical",)` (see ampwatch.server.stopping).
    critical_at_step: Mapped[int | None] = mapped_column(BigInteger)


class Series(Base):
    __tablename__ = "series"
    __table_args__ = (UniqueConstraint("run_id", "name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))


# Rows whose value is NaN (NULL) or beyond ±1e308 (±Infinity, and the rare finite giant): charts keep every
# non-finite point, and this small partial index finds them without scanning the series.
NONFINITE_POINT = text("value IS NULL OR value > 1e308 OR value < -1e308")


class Point(Base):
    __tablename__ = "points"
    __table_args__ = (
        Index(
            "ix_points_nonfinite",
            "series_id",
            "rank",
            "step",
            sqlite_where=NONFINITE_POINT,
            postgresql_where=NONFINITE_POINT,
        ),
        # Postgres: one partition per block of a run's series ids (see ampwatch.server.partitions)
        {"sqlite_with_rowid": False, "postgresql_partition_by": "RANGE (series_id)"},
    )
    series_id: Mapped[int] = mapped_column(ForeignKey("series.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    value: Mapped[float | None] = mapped_column(Double)  # NULL means NaN, see the module docstring


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_step", "run_id", "step"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(BigInteger)
    rank: Mapped[int] = mapped_column(Integer)
    type: Mapped[str] = mapped_column(String(32))
    severity: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text)
    details: Mapped[dict[str, Any]]
    time: Mapped[datetime]


class Batch(Base):
    """One row per accepted agent batch: a re-sent batch finds its row and is not stored again."""

    __tablename__ = "batches"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    received_at: Mapped[datetime]


# -- alerts: rules, alert state, flips (state changes), channels, deliveries (attempts), silences -------
# Each alert is one (rule, run, rank) episode; "rank" is -1 when the rule does not split by rank.
ACTIVE_ALERT = text("state IN ('pending', 'firing')")


class AlertRule(Base):
    """What makes an alert: an event type, or a threshold on a series aggregated over a window of steps."""

    __tablename__ = "alert_rules"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    kind: Mapped[str] = mapped_column(String(16))  # event | event_rate | threshold
    severity: Mapped[str] = mapped_column(String(16))
    event_type: Mapped[str | None] = mapped_column(String(32))
    min_event_severity: Mapped[str] = mapped_column(String(16))
    series: Mapped[str | None] = mapped_column(String(200))
    aggregation: Mapped[str | None] = mapped_column(String(16))
    op: Mapped[str | None] = mapped_column(String(2))
    threshold: Mapped[float | None] = mapped_column(Double)
    window_steps: Mapped[int | None] = mapped_column(Integer)
    ignore_steps: Mapped[int] = mapped_column(BigInteger)
    for_steps: Mapped[int] = mapped_column(BigInteger)
    for_s: Mapped[float] = mapped_column(Double)
    keep_firing_for_s: Mapped[float] = mapped_column(Double)
    repeat_interval_s: Mapped[float | None] = mapped_column(Double)
    per_rank: Mapped[bool] = mapped_column(Boolean)
    inhibits: Mapped[bool] = mapped_column(Boolean)
    project: Mapped[str | None] = mapped_column(String(200))  # None: every project
    enabled: Mapped[bool] = mapped_column(Boolean)
    source: Mapped[str] = mapped_column(String(16))  # builtin | api | file
    description: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class Alert(Base):
    __tablename__ = "alerts"
    __table_args__ = (
        Index("ix_alerts_run_state", "run_id", "state"),
        Index("ix_alerts_updated_at", "updated_at"),  # the runs stream looks for alerts changed lately
        # At most one active alert per (rule, run, rank), whichever process tries to open it.
        Index(
            "ux_alerts_active",
            "rule",
            "run_id",
            "rank",
            unique=True,
            sqlite_where=ACTIVE_ALERT,
            postgresql_where=ACTIVE_ALERT,
        ),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rule: Mapped[str] = mapped_column(String(100))
    severity: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))  # pending | firing | resolved
    started_at: Mapped[datetime]
    resolved_at: Mapped[datetime | None]
    summary: Mapped[str] = mapped_column(Text)
    rule_id: Mapped[int | None] = mapped_column(ForeignKey("alert_rules.id", ondelete="SET NULL"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    step: Mapped[int | None] = mapped_column(BigInteger)  # where it started
    last_step: Mapped[int | None] = mapped_column(BigInteger)  # where the condition was last seen true
    count: Mapped[int] = mapped_column(Integer)  # occurrences folded into this alert
    fired_at: Mapped[datetime | None]
    cleared_at: Mapped[datetime | None]  # the condition is false since (for keep_firing_for)
    last_notified_at: Mapped[datetime | None]
    updated_at: Mapped[datetime]
    details: Mapped[dict[str, Any]]


class AlertFlip(Base):
    """One state change of an alert (or a reminder); the notifications it caused are its deliveries."""

    __tablename__ = "alert_flips"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    alert_id: Mapped[int] = mapped_column(ForeignKey("alerts.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime]
    old_state: Mapped[str | None] = mapped_column(String(16))
    new_state: Mapped[str] = mapped_column(String(16))
    step: Mapped[int | None] = mapped_column(BigInteger)
    reason: Mapped[str] = mapped_column(Text)
    suppressed: Mapped[str | None] = mapped_column(Text)  # why nobody was notified (silence, inhibition)


class AlertChannel(Base):
    __tablename__ = "alert_channels"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    kind: Mapped[str] = mapped_column(String(16))  # webhook | slack | email
    target: Mapped[str] = mapped_column(Text)  # a URL, or comma-separated e-mail addresses
    config: Mapped[dict[str, Any]]  # non-secret settings (SMTP host, port, STARTTLS, user, sender)
    secret: Mapped[str | None] = mapped_column(Text)  # the SMTP password: never shown by the API
    project: Mapped[str | None] = mapped_column(String(200))
    min_severity: Mapped[str] = mapped_column(String(16))
    enabled: Mapped[bool] = mapped_column(Boolean)
    source: Mapped[str] = mapped_column(String(16))  # api | env | file
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class AlertDelivery(Base):
    """One attempt to notify one channel of one flip, with its outcome; a retry is a new row."""

    __tablename__ = "alert_deliveries"
    __table_args__ = (Index("ix_alert_deliveries_due", "status", "due_at"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    flip_id: Mapped[int | None] = mapped_column(ForeignKey("alert_flips.id", ondelete="CASCADE"), index=True)
    channel_id: Mapped[int] = mapped_column(ForeignKey("alert_channels.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))  # queued | sending | delivered | retried | failed | superseded
    due_at: Mapped[datetime]
    created_at: Mapped[datetime]
    claimed_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    response_status: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)


class AlertSilence(Base):
    """No notifications for matching alerts (a run, a project, optionally one rule) until `ends_at`."""

    __tablename__ = "alert_silences"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    project: Mapped[str | None] = mapped_column(String(200))
    run_id: Mapped[str | None] = mapped_column(String(64))
    rule: Mapped[str | None] = mapped_column(String(100))
    starts_at: Mapped[datetime]
    ends_at: Mapped[datetime] = mapped_column(index=True)
    comment: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime]


class RunLiveness(Base):
    """What the server needs to tell a hung or dead run from a slow one, and its evaluation lease."""

    __tablename__ = "run_liveness"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    last_step: Mapped[int | None] = mapped_column(BigInteger)
    last_step_at: Mapped[datetime | None]  # when last_step last advanced
    step_time_s: Mapped[float | None] = mapped_column(Double)  # moving average of seconds per step
    calibrated_step: Mapped[int | None] = mapped_column(BigInteger)  # the start-up calibration ended here
    detected: Mapped[str | None] = mapped_column(String(16))  # crashed | stalled, when the server decided it
    evaluated_at: Mapped[datetime | None]  # runs.last_seen_at as of the last windowed evaluation
    lease_until: Mapped[datetime | None]  # a process is evaluating this run until then


class ApiToken(Base):
    """A bearer token: `ingest` (agents, optionally one project), `read` (dashboard and read API) or `admin`.

    Only a SHA-256 of the secret is stored: tokens are 256-bit random, so a slow hash would add nothing.
    """

    __tablename__ = "api_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    role: Mapped[str] = mapped_column(String(16))
    project: Mapped[str | None] = mapped_column(String(200))
    secret_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]


# -- live dashboard: rollups of long series and the per-run feed of stored points -----------------------
BLOCK_STEPS = 64  # steps per rollup block: a block is steps [block * 64, block * 64 + 63]


class PointBlock(Base):
    """The finite extremes of one block of BLOCK_STEPS steps of a series, kept at ingest in the points'
    transaction, so that a long series is charted from a few thousand rows instead of a million points.
    A block whose points are all NaN or ±Infinity has no row (those points are read through their own index)."""

    __tablename__ = "point_blocks"
    __table_args__ = ({"sqlite_with_rowid": False},)
    series_id: Mapped[int] = mapped_column(ForeignKey("series.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    block: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    min_step: Mapped[int] = mapped_column(BigInteger)  # the earliest step holding the block's least finite value
    min_value: Mapped[float] = mapped_column(Double)
    max_step: Mapped[int] = mapped_column(BigInteger)
    max_value: Mapped[float] = mapped_column(Double)
    last_step: Mapped[int] = mapped_column(
        BigInteger
    )  # the block's last finite point: a write at or before it may replace one


class PointFeed(Base):
    """One row per stored batch that had points, numbered per run in commit order (the number is taken under
    the run row's lock, just before commit): a live stream sends the steps of the rows it has not seen."""

    __tablename__ = "point_feed"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    position: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer)
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
