"""The alerting config file (`AMPWATCH_ALERT_RULES_FILE`), YAML or JSON, loaded at start-up:

    rules:
      - {name: loss_high, kind: threshold, series: loss, aggregation: mean, window_steps: 50, op: ">", threshold: 8,
         for: 200 steps}
    channels:
      - {name: oncall, kind: slack, url: "https://hooks.slack.com/services/..."}

Entries replace the rules and channels of the same name; what the API created under other names is kept."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from ampwatch.server.alerts._admin import Conflict, save_channel, save_rule
from ampwatch.server.alerts.schemas import ChannelIn, RuleIn, explain


class ConfigError(ValueError):
    """The config file cannot be read or does not describe valid rules and channels."""


def load_config_file(session: Session, path: str) -> tuple[int, int]:
    """Upsert the file's rules and channels; how many of each."""
    document = _read(Path(path))
    try:
        rules = [RuleIn.model_validate(r) for r in document.get("rules") or []]
        channels = [ChannelIn.model_validate(c) for c in document.get("channels") or []]
    except ValidationError as error:  # explained without the values given: the file may hold passwords
        raise ConfigError(f"{path}: {explain(error)}") from None
    try:
        for rule in rules:
            save_rule(session, body=rule, source="file")
        for channel in channels:
            save_channel(session, body=channel, source="file")
    except Conflict as error:
        raise ConfigError(f"{path}: {error}") from error
    return len(rules), len(channels)


def _read(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read the alert config file {path}: {error}") from error
    if path.suffix.lower() == ".json":
        try:
            document = json.loads(raw)
        except ValueError as error:
            raise ConfigError(f"{path} is not valid JSON: {error}") from error
    else:
        try:
            import yaml
        except ImportError as error:
            raise ConfigError(f"{path} is YAML but PyYAML is not installed; install it or use a .json file") from error
        try:
            document = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            raise ConfigError(f"{path} is not valid YAML: {error}") from error
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: expected a mapping with `rules` and `channels`")
    return document
