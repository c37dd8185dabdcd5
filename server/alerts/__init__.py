"""Alerting: rules → alert lifecycle → channels.

- `on_batch` runs inside the ingest transaction: event rules fire there (lowest latency) and the alert and
  its queued notifications commit with the batch.
- `AlertService` runs in the background of each server process: crashed and stalled runs, windowed rules,
  clearing, reminders, and delivery with retries. Several processes can share one Postgres: every state
  change and every delivery is claimed in the database, so each happens once.
- `prepare` seeds the built-in rules and the channels from the environment and the config file.
"""

from __future__ import annotations

from pydantic import ValidationError
from sqlalchemy.orm import Session

from ampwatch.server.alerts._admin import configure_env_webhook
from ampwatch.server.alerts._config import ConfigError, load_config_file
from ampwatch.server.alerts._ingest import on_batch
from ampwatch.server.alerts._ranks import compare_ranks
from ampwatch.server.alerts._rules import seed_builtins
from ampwatch.server.alerts._service import AlertService
from ampwatch.server.alerts.schemas import explain
from ampwatch.server.settings import Settings

__all__ = ["AlertService", "ConfigError", "compare_ranks", "on_batch", "prepare"]


def prepare(session: Session, settings: Settings) -> None:
    """Built-in rules, the `AMPWATCH_ALERT_WEBHOOK_URL` channel, and `AMPWATCH_ALERT_RULES_FILE`; idempotent."""
    seed_builtins(session)
    try:
        configure_env_webhook(session, settings.alert_webhook_url.strip())
    except ValidationError as error:  # explained without the URL, which may hold a token
        raise ConfigError(f"AMPWATCH_ALERT_WEBHOOK_URL: {explain(error)}") from None
    if settings.alert_rules_file.strip():
        load_config_file(session, settings.alert_rules_file.strip())
