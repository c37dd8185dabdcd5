"""Request and response bodies of the alerting API (rules, channels, silences, alert details)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from ampwatch.server.alerts._targets import check_url
from ampwatch.server.schemas import AlertOut, EventType, Severity

Kind = Literal["event", "event_rate", "threshold"]
Aggregation = Literal["mean", "max", "min", "sum", "last", "nonfinite"]
Op = Literal[">", ">=", "<", "<="]
RuleName = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.:-]+$")]
_PATTERNS = {
    "name": "use letters, digits and _ . : - only",
    "to": "is not an e-mail address",
    "host": "is not a host name",
}
_FOR = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(steps?|s|m|h)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


def explain(error: ValidationError | ValueError) -> str:
    """A validation error as a person reads it (`window_steps: Input should be a valid integer`), without
    echoing what was given, which may be a password."""
    if not isinstance(error, ValidationError):
        return str(error)
    parts = []
    for item in error.errors():
        field = next((str(x) for x in reversed(item["loc"]) if isinstance(x, str)), "")
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "string_pattern_mismatch" and field in _PATTERNS:
            message = f"{item['input']!r}: {_PATTERNS[field]}"
        parts.append(f"{field.replace('_', ' ')}: {message}" if field else message)
    return "; ".join(parts)


class RuleFields(BaseModel):
    """Everything a rule can set; `for` accepts "500 steps", "30s", "5m" or "2h"."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    severity: Severity | None = None
    event_type: EventType | None = None
    min_event_severity: Severity | None = None
    series: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    aggregation: Aggregation | None = None
    op: Op | None = None
    threshold: float | None = None
    window_steps: Annotated[int, Field(ge=1, le=100_000)] | None = None
    ignore_steps: Annotated[int, Field(ge=0)] | None = None
    for_steps: Annotated[int, Field(ge=0)] | None = None
    for_s: Annotated[float, Field(ge=0)] | None = None
    for_: str | None = Field(None, alias="for", description='"500 steps", "30s", "5m" or "2h"')
    keep_firing_for_s: Annotated[float, Field(ge=0)] | None = None
    repeat_interval_s: Annotated[float, Field(ge=0)] | None = Field(None, description="0 turns reminders off")
    per_rank: bool | None = None
    inhibits: bool | None = None
    project: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    enabled: bool | None = None
    description: Annotated[str, Field(max_length=2000)] | None = None

    @model_validator(mode="after")
    def _parse_for(self) -> RuleFields:
        if self.for_ is not None:
            match = _FOR.match(self.for_)
            if not match:
                raise ValueError(f"for: {self.for_!r} is not like '500 steps', '30s', '5m' or '2h'")
            number, unit = float(match.group(1)), match.group(2)
            if unit.startswith("step"):
                self.for_steps = int(number)
            else:
                self.for_s = number * _UNIT_S[unit]
            self.for_ = None
        return self

    def values(self) -> dict[str, Any]:
        """The fields that were set, as column values."""
        return self.model_dump(exclude_unset=True, exclude={"for_"})


class RuleIn(RuleFields):
    """A new rule. `event`: an event type occurs. `event_rate`: more than `threshold` events of a type in
    `window_steps`. `threshold`: `aggregation` of `series` over `window_steps` compared with `op threshold`."""

    name: RuleName
    kind: Kind

    @model_validator(mode="after")
    def _complete(self) -> RuleIn:
        needs = {
            "event": ("event_type",),
            "event_rate": ("event_type", "op", "threshold", "window_steps"),
            "threshold": ("series", "op", "threshold"),
        }[self.kind]
        missing = [n for n in needs if getattr(self, n) is None]
        if missing:
            raise ValueError(f"a {self.kind} rule needs {', '.join(missing)}")
        return self


class RuleOut(BaseModel):
    id: int
    name: str
    kind: Kind
    severity: Severity
    event_type: str | None
    min_event_severity: Severity
    series: str | None
    aggregation: str | None
    op: str | None
    threshold: float | None
    window_steps: int | None
    ignore_steps: int
    for_steps: int
    for_s: float
    keep_firing_for_s: float
    repeat_interval_s: float | None
    per_rank: bool
    inhibits: bool
    project: str | None
    enabled: bool
    source: str
    description: str
    created_at: datetime
    updated_at: datetime


class Smtp(BaseModel):
    """SMTP settings of an e-mail channel. The password is write-only."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    host: Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9.:\[\]_-]+$")]
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    starttls: bool = True
    ssl: bool = False
    username: str | None = None
    password: SecretStr | None = Field(
        None, description="Write-only: never returned.", json_schema_extra={"writeOnly": True}
    )
    sender: str | None = Field(None, alias="from")
    ca_file: str | None = Field(None, description="A CA bundle to verify the server's certificate (a private CA).")


class ChannelFields(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: (
        Annotated[
            str, Field(max_length=2000, description="http(s) with a host, no user:password@ (AMPWATCH_ALERT_URL_SCOPE)")
        ]
        | None
    ) = None
    to: list[Annotated[str, Field(pattern=r"^[^@\s,]+@[^@\s,]+$")]] | None = None
    smtp: Smtp | None = None
    project: str | None = None
    min_severity: Severity | None = None
    enabled: bool | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        return None if url is None else check_url(url)


class ChannelIn(ChannelFields):
    """A new channel: `webhook`, `slack` and `alertmanager` (its base URL) need `url`; `email` needs `to` and `smtp`."""

    name: RuleName
    kind: Literal["webhook", "slack", "email", "alertmanager"]

    @model_validator(mode="after")
    def _complete(self) -> ChannelIn:
        if self.kind == "email" and (not self.to or self.smtp is None):
            raise ValueError("an email channel needs `to` and `smtp`")
        if self.kind != "email" and not self.url:
            raise ValueError(f"a {self.kind} channel needs `url`")
        return self


class ChannelOut(BaseModel):
    id: int
    name: str
    kind: str
    url: str | None = Field(
        description="Scheme and host only: the path and query, where webhook secrets live, are masked."
    )
    to: list[str] | None
    smtp: dict[str, Any] | None = Field(description="Without the password; `password_set` says whether one is stored.")
    project: str | None
    min_severity: Severity
    enabled: bool
    source: str
    last_delivery: dict[str, Any] | None


class SilenceIn(BaseModel):
    """Mute notifications for a run or a project (optionally one rule) until `ends_at` or for `duration_s`."""

    model_config = ConfigDict(extra="forbid")
    run_id: str | None = None
    project: str | None = None
    rule: str | None = None
    ends_at: datetime | None = None
    duration_s: Annotated[float, Field(gt=0, le=10 * 365 * 86400)] | None = None
    comment: Annotated[str, Field(max_length=2000)] = ""

    @model_validator(mode="after")
    def _complete(self) -> SilenceIn:
        if self.run_id is None and self.project is None:
            raise ValueError("a silence needs `run_id` or `project`")
        if (self.ends_at is None) == (self.duration_s is None):
            raise ValueError("give exactly one of `ends_at` and `duration_s`")
        return self


class SilenceOut(BaseModel):
    id: int
    run_id: str | None
    project: str | None
    rule: str | None
    starts_at: datetime
    ends_at: datetime
    comment: str
    active: bool


class DeliveryOut(BaseModel):
    id: int
    channel: str
    attempt: int
    status: str
    due_at: datetime
    finished_at: datetime | None
    response_status: int | None
    error: str | None


class FlipOut(BaseModel):
    id: int
    created_at: datetime
    old_state: str | None
    new_state: str
    step: int | None
    reason: str
    suppressed: str | None
    deliveries: list[DeliveryOut]


class AlertDetailOut(AlertOut):
    state: Literal["pending", "firing", "resolved"]  # a pending alert (waiting out its `for`) has details too
    rank: int | None
    step: int | None
    last_step: int | None
    count: int
    fired_at: datetime | None
    details: dict[str, Any]
    flips: list[FlipOut]


class TestResult(BaseModel):
    ok: bool
    error: str | None
    response_status: int | None
    delivery_id: int
