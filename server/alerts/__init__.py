"""Alerting: rules → alert lifecycle → channels.

- `on_batch` runs inside the ingest transaction: event rules fire there (lowest latency) and the alert and
  its queued notifications commit with the batch.
- `AlertService` runs in the background of each server process: crashed and stalled runs, windowed rules,
  clearing, reminders, and delivery with retries. Several processes can share one Postgres: every state
  change and every delivery is claimed in the database, so each happens once.
- `prepare` seeds the built-in rules and the channels from the environment and the config file.

This module is the package's public face: the API routers and the pages import what they need from here
(rules, channels, silences, the alerts board, test notifications), never from its private modules.
Channel kinds are defined in one place, `_channels.py` (and their schema in `schemas.py`).
"""

from __future__ import annotations

from pydantic import ValidationError
from sqlalchemy.orm import Session

from ampwatch.server.alerts._admin import (
    Conflict,
    alert_detail,
    channel_out,
    check_destination,
    configure_env_webhook,
    create_silence,
    delete_rule,
    expire_silence,
    list_channels,
    list_rules,
    list_silences,
    rule_out,
    save_channel,
    save_rule,
    silence_out,
    update_channel,
    update_rule,
)
from ampwatch.server.alerts._board import AlertRow, alert_rows, condition, since
from ampwatch.server.alerts._config import ConfigError, load_config_file
from ampwatch.server.alerts._deliver import send_test
from ampwatch.server.alerts._desync import compare_params
from ampwatch.server.alerts._ingest import on_batch
from ampwatch.server.alerts._ranks import compare_ranks
from ampwatch.server.alerts._rules import seed_builtins
from ampwatch.server.alerts._service import AlertService
from ampwatch.server.alerts._targets import TargetError, scope_of
from ampwatch.server.alerts.schemas import explain
from ampwatch.server.settings import Settings

__all__ = [
    "AlertRow",
    "AlertService",
    "ConfigError",
    "Conflict",
    "TargetError",
    "alert_detail",
    "alert_rows",
    "channel_out",
    "check_destination",
    "compare_params",
    "compare_ranks",
    "condition",
    "create_silence",
    "delete_rule",
    "expire_silence",
    "list_channels",
    "list_rules",
    "list_silences",
    "on_batch",
    "prepare",
    "rule_out",
    "save_channel",
    "save_rule",
    "scope_of",
    "send_test",
    "silence_out",
    "since",
    "update_channel",
    "update_rule",
]


def prepare(session: Session, settings: Settings) -> None:
    """Built-in rules, the `AMPWATCH_ALERT_WEBHOOK_URL` channel, and `AMPWATCH_ALERT_RULES_FILE`; idempotent."""
    seed_builtins(session)
    try:
        configure_env_webhook(session, settings.alert_webhook_url.strip())
    except ValidationError as error:  # explained without the URL, which may hold a token
        raise ConfigError(f"AMPWATCH_ALERT_WEBHOOK_URL: {explain(error)}") from None
    if settings.alert_rules_file.strip():
        load_config_file(session, settings.alert_rules_file.strip())
