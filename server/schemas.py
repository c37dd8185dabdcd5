"""Request and response bodies of the HTTP API."""

from __future__ import annotations

import array
import base64
import binascii
import json
import sys
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from ampwatch._protocol import BATCH_FORMATS, EVENT_TYPES, SEVERITIES
from ampwatch.server.db import utc

# (a Literal built from the protocol's tuple: one list, not two; mypy wants literals spelled out)
EventType = Literal[EVENT_TYPES]  # type: ignore[valid-type]  # (the agent's list: ampwatch._protocol)
Severity = Literal[SEVERITIES]  # type: ignore[valid-type]
RunStatus = Literal["running", "finished", "crashed", "stalled", "stopped"]
Health = Literal["ok", "warning", "critical"]


def _strict_json(value: dict[str, Any]) -> dict[str, Any]:
    """JSON columns cannot hold NaN on Postgres: non-finite numbers must arrive as strings. Nor NUL characters:
    those become U+FFFD, as in free text (see `_text`)."""
    try:
        encoded = json.dumps(value, allow_nan=False)
    except ValueError as error:
        raise ValueError("non-finite numbers must be sent as the strings 'NaN', 'Infinity', '-Infinity'") from error
    return _without_nul(value) if "\\u0000" in encoded else value


def _without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, dict):
        return {_text(k): _without_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_nul(v) for v in value]
    return value


def _text(value: str) -> str:
    """Free text (an event's message, often an exception's) as Postgres can store it: a NUL becomes U+FFFD. (A
    batch the database refuses would be retried forever, holding up every batch after it.)"""
    return value.replace("\x00", "\ufffd")


def _name(value: str) -> str:
    if "\x00" in value:
        raise ValueError("names cannot contain NUL characters")
    return value


JsonObject = Annotated[dict[str, Any], AfterValidator(_strict_json)]
MAX_INT = 2**31 - 1  # INTEGER columns (rank, row ids)
MAX_BIGINT = 2**63 - 1  # BIGINT columns (steps, batch sequence numbers)
Step = Annotated[int, Field(ge=0, le=MAX_BIGINT)]
Rank = Annotated[int, Field(ge=0, le=MAX_INT)]
Name = Annotated[str, Field(min_length=1, max_length=200), AfterValidator(_name)]
Text = Annotated[str, AfterValidator(_text)]


class RunIn(BaseModel):
    """Registers a run (idempotent: the agent picks the id and may send this again)."""

    model_config = ConfigDict(extra="forbid")
    project: Name
    name: Name
    config: JsonObject = {}
    environment: JsonObject = {}


def _unpacked(code: str) -> Any:
    """Accept a list as is, or a string: base64 of little-endian int64 ("q") or float64 ("d") numbers."""

    def unpack(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            data = array.array(code, base64.b64decode(value, validate=True))
        except (binascii.Error, ValueError) as error:
            raise ValueError(f"a packed series must be base64 of little-endian 8-byte numbers ({error})") from None
        if sys.byteorder == "big":
            data.byteswap()
        return data.tolist()

    return BeforeValidator(unpack)


PACKED = "or base64 of their little-endian {} bytes (what the agent sends: exact, and cheap to write and read)"


class SeriesIn(BaseModel):
    """Points of one series: parallel lists. Values may be numbers or 'NaN', 'Infinity', '-Infinity'."""

    steps: Annotated[list[Step], _unpacked("q"), Field(description="Steps, " + PACKED.format("int64"))]
    values: Annotated[list[float], _unpacked("d"), Field(description="Values, " + PACKED.format("float64"))]

    @model_validator(mode="after")
    def _same_length(self) -> SeriesIn:
        if len(self.steps) != len(self.values):
            raise ValueError(f"steps has {len(self.steps)} items but values has {len(self.values)}")
        return self


class EventIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: Step
    rank: Rank | None = None
    type: EventType
    severity: Severity
    message: Annotated[Text, Field(max_length=20_000)]
    details: JsonObject = {}
    time: float | None = Field(None, ge=0, le=1e11, description="Unix time in seconds; the server's clock when absent.")


class BatchIn(BaseModel):
    """One agent batch. (run, rank, seq) identifies it: a batch sent twice is stored once."""

    model_config = ConfigDict(extra="forbid")
    format: int = Field(1, description="The batch format's version; absent: 1, as older agents send it.")
    rank: Rank = 0
    seq: Annotated[int, Field(ge=1, le=MAX_BIGINT)]
    points: dict[Name, SeriesIn] = {}
    events: Annotated[list[EventIn], Field(max_length=10_000)] = []
    status: Literal["running", "finished", "crashed", "stopped"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_format(cls, body: Any) -> Any:
        """A format this server does not know is said first and alone: its other fields may mean something else."""
        version = body.get("format", 1) if isinstance(body, dict) else 1
        if version.__class__ is not int or version not in BATCH_FORMATS:
            takes = ", ".join(map(str, BATCH_FORMATS))
            raise ValueError(
                f"batch format {version!r} is not one this server takes (it takes format {takes}): "
                "upgrade the ampwatch server to the agent's version, or use an agent that sends these"
            )
        return body


class StopOut(BaseModel):
    """A stop asked of a run: by whom, why, when."""

    by: str = Field(description="Who asked: the admin token's name, or the agent for a stop on a critical event.")
    reason: str | None = None
    requested_at: datetime | None = None
    at_step: int | None = Field(
        default=None,
        description="A run of several ranks: the step every rank stops after (the agents raise StopRequested, and "
        "`should_stop` turns true, once it ran); fixed at the first batch answered after the request. Null for a "
        "single rank, which stops at once.",
    )


class CriticalOut(BaseModel):
    """A critical event of the run (any rank), for an agent started with `stop_on=("critical",)`."""

    id: int
    step: int
    rank: int
    type: str
    message: str
    at_step: int | None = Field(
        default=None,
        description="A run of several ranks: the step every rank stops after on the run's first critical event, "
        "fixed when it arrived (as `StopOut.at_step`). Null for a single rank, which stops at once.",
    )


class BatchOut(BaseModel):
    stored: bool = Field(description="False when this batch had been stored before (a re-send).")
    points: int
    stop: StopOut | None = Field(
        default=None, description="Present while a stop asked with POST /runs/{id}/stop waits for the run to end."
    )
    critical: CriticalOut | None = Field(
        default=None,
        description="The run's latest critical numerics event (any rank; not a crash or a stall), once there is one.",
    )


class RunOut(BaseModel):
    id: str
    project: str
    name: str
    status: RunStatus
    health: Health
    created_at: datetime
    last_seen_at: datetime
    finished_at: datetime | None
    last_step: int | None
    config: dict[str, Any]
    environment: dict[str, Any]
    url: str
    series: list[str] = []
    ranks: list[int] = Field([], description="The ranks that sent batches (GET /runs/{id} only).")
    stored_steps: dict[str, int] = Field(
        default={},
        description="The last step stored per rank (PUT /runs/{id} only): a relaunch that does not resume sees it.",
    )
    skip_rate: float | None = Field(None, description="Share of skipped steps among rank 0's last 1000 steps.")
    scale: float | Literal["NaN", "Infinity", "-Infinity"] | None = Field(None, description="The latest loss scale.")
    stop: StopOut | None = Field(
        default=None,
        description="The stop asked of the run (POST /runs/{id}/stop), or the one it ended `stopped` with.",
    )
    critical_id: int | None = Field(
        default=None,
        description="The id of the run's latest critical event (PUT /runs/{id} only): a relaunch's baseline.",
    )
    firing: int | None = Field(None, description="How many alerts are firing (`GET /runs` only).")
    firing_by_severity: dict[str, int] | None = Field(
        None, description="Firing alerts by severity: critical, warning, info (`GET /runs` only)."
    )


class PlanCheckpointOut(BaseModel):
    step: int = Field(description="The checkpoint's step: the number of steps its state completed.")
    rank: int
    path: str | None


class PlanStepsOut(BaseModel):
    model_config = ConfigDict(serialize_by_alias=True, validate_by_name=True)

    from_: int = Field(alias="from", description="The first step to skip.")
    to: int = Field(description="The last step to skip (inclusive).")


class PlanBriefOut(BaseModel):
    """The rollback plan in brief (`ampwatch.server.plan.brief`), as a plan-triggering event and its alert carry it."""

    summary: str
    checkpoint: PlanCheckpointOut | None = Field(description="The checkpoint to restore; null: start over.")
    skip: PlanStepsOut
    path: str = Field(description="The whole plan: GET this path (`/api/v1/runs/{id}/plan`).")


class EventOut(BaseModel):
    id: int
    step: int
    rank: int
    type: str
    severity: Severity
    message: str
    details: dict[str, Any]
    time: datetime
    plan: PlanBriefOut | None = Field(
        None,
        description="On a plan trigger only (a critical nonfinite_param, scale_collapse, grad_spike, loss_spike or "
        "ranks_desync): the run's rollback plan in brief. Absent on other events.",
    )

    @classmethod
    def of(cls, event: Any, plan: dict[str, Any] | None = None) -> EventOut:
        """An event row (`models.Event`) as the read API, the streams and the plan show it; with `plan` (a brief),
        as a plan trigger. Dump it with `exclude_unset=True`: `plan` is then left out where it was not given."""
        return cls(
            id=event.id, step=event.step, rank=event.rank, type=event.type, severity=event.severity,
            message=event.message, details=event.details, time=utc(event.time),
            **({} if plan is None else {"plan": PlanBriefOut.model_validate(plan)}),
        )  # fmt: skip


class AlertOut(BaseModel):
    id: int
    run_id: str
    rule: str
    severity: Severity
    state: Literal["pending", "firing", "resolved"]
    started_at: datetime
    resolved_at: datetime | None
    summary: str


class PruneIn(BaseModel):
    """Which runs `POST /api/v1/runs/prune` removes: those not heard from for `older_than_s` seconds."""

    older_than_s: float = Field(ge=0, le=1e10, description="Runs last heard from longer ago than this (seconds).")
    project: Name | None = Field(None, description="Only runs of this project; every project when null.")
    dry_run: bool = Field(False, description="List the runs that would go, remove nothing.")


class RemovedRun(BaseModel):
    id: str
    project: str
    name: str
    created_at: datetime


class StopIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: Annotated[Text | None, Field(max_length=2000)] = None


class RunsRemoved(BaseModel):
    runs: list[RemovedRun]
    deleted: bool = Field(description="False on a dry run: the runs are still there.")
