"""The database schema. Alembic migrations in `ampwatch.migrations` must match it (a test checks).

`points.value` is NULL exactly when the value is NaN: SQLite turns a NaN float into NULL on its own,
so the meaning is made explicit and the same on Postgres. ±Infinity are stored as themselves.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Double, ForeignKey, Index, Integer, String, Text, UniqueConstraint
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
    last_seen_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    last_step: Mapped[int | None] = mapped_column(BigInteger)


class Series(Base):
    __tablename__ = "series"
    __table_args__ = (UniqueConstraint("run_id", "name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))


class Point(Base):
    __tablename__ = "points"
    __table_args__ = {"sqlite_with_rowid": False}
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


class Alert(Base):
    __tablename__ = "alerts"
    __table_args__ = (Index("ix_alerts_run_state", "run_id", "state"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rule: Mapped[str] = mapped_column(String(100))
    severity: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[datetime]
    resolved_at: Mapped[datetime | None]
    summary: Mapped[str] = mapped_column(Text)
