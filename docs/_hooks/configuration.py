"""MkDocs hook: the configuration reference, generated from the settings objects and the command's parser.

docs/configuration.md holds the marker `<!-- generated: configuration -->`; the build replaces it with tables
read from `ampwatch._settings.AgentSettings`, `ampwatch.server.Settings` and `ampwatch._cli._parser()`, so
names, defaults and flags cannot drift from the code. A setting's meaning is its own where it has one (a server
field's `Field(description=...)`, an agent field's `metadata={"doc": ...}`), else it is written here, in MEANINGS:
a setting or environment variable with neither fails the build (and tests/test_packaging.py).

`python docs/_hooks/configuration.py` prints the generated Markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

MARKER = "<!-- generated: configuration -->"
ROOT = Path(__file__).resolve().parents[2]

# What each setting means. Keys are environment variables; agent settings that no variable sets are keyed
# `AgentSettings.<field>`. Defaults and flags are read from the code, never written here.
MEANINGS: dict[str, str] = {
    # agent
    "AMPWATCH_URL": "the server",
    "AMPWATCH_TOKEN": "sent as `Authorization: Bearer …`",
    "AMPWATCH_PROJECT": "project when `init()` is given none",
    "AMPWATCH_MODE": "`online` sends as it trains; `offline` only writes the spool (upload later with "
    "`ampwatch sync`); `disabled` records nothing. An invalid value does not raise: `init()` logs the problem "
    "and returns a run that records nothing",
    "AMPWATCH_FLUSH_INTERVAL_S": "how often the background thread sends (lower: fresher charts, more CPU per step; "
    "at least 0.01)",
    "AMPWATCH_FINISH_TIMEOUT_S": "how long `finish()` waits for the last batches to be delivered (also on SIGTERM)",
    "AMPWATCH_SPOOL_MAX_BYTES": "spool size cap; past it batches are held in memory (up to 10 000), then dropped "
    "and counted",
    "AMPWATCH_MAX_PENDING_RECORDS": "steps and logged values waiting for the sender; past it they are dropped, "
    "counted, logged at `finish()` and reported as the series `dropped_records` (flushes, statuses and events are "
    "never dropped)",
    "AMPWATCH_HEARTBEAT_INTERVAL_S": "an empty batch is sent when nothing else was for this long, so the server can "
    "tell a hung run from a dead one",
    "AMPWATCH_LAYER_NORM_INTERVAL": "steps between per-layer gradient norms (`grad_norm/<module>`)",
    "AMPWATCH_PARAM_CHECK_INTERVAL": "steps between parameter-finiteness checks (`param_norm`); every step while a "
    "NaN is being traced",
    "AgentSettings.request_timeout_s": "seconds one HTTP request to the server may take before it is retried later",
    "AgentSettings.max_batch_points": "most points in one batch the agent sends (more are split across batches)",
    "AMPWATCH_SPOOL_DIR": "where batches wait until the server acknowledges them (default `~/.cache/ampwatch/spool`)",
    "AMPWATCH_RUN_ID": "use this run id (1-64 letters, digits, `-`, `_`) instead of a generated one: a relaunch "
    "under it (a resumed run) adds to the run's series and shows it running again",
    # server
    "AMPWATCH_DATABASE_URL": "`sqlite:///path.db` or `postgresql+psycopg://user:pass@host/db`",
    "AMPWATCH_HOST": "address to bind",
    "AMPWATCH_PORT": "port",
    "AMPWATCH_PUBLIC_URL": "base of the links the server hands out (`url` in the API, alerts, and the agent's "
    "`Run.url` once its run has registered: until then it is built from `AMPWATCH_URL`); default "
    "`http://HOST:PORT`",
    "AMPWATCH_INSECURE": "allow a non-loopback `--host` with no access token (something else must guard the "
    "network; requests must still name a loopback host or the host of `AMPWATCH_PUBLIC_URL`)",
    "AMPWATCH_STREAM_POLL_S": "how often a run's shared stream poller reads the database when no commit of this "
    "process (or, on Postgres, a NOTIFY from another replica) woke it",
    "AMPWATCH_STREAM_RUNS_POLL_S": "the same for the runs list's poller",
    "AMPWATCH_STREAM_LIFETIME_S": "a live stream ends after this long and the browser reconnects from its "
    "`Last-Event-ID` (so a load balancer spreads long-lived streams over the replicas)",
    "AMPWATCH_STREAM_QUEUE": "messages a slow client may lag behind before it is dropped; it resumes from its "
    "`Last-Event-ID`, and never stalls the other clients",
    "AMPWATCH_DELETE_CHUNK_ROWS": "rows one transaction of deleting or pruning runs removes at most (about): ingest "
    "of other runs goes on between them",
    "AMPWATCH_TOKEN_REFRESH_S": "access tokens are re-read this often: a new or revoked token counts within it",
    "AMPWATCH_MAX_BODY_BYTES": "larger request bodies get 413 before they are parsed",
    "AMPWATCH_MAX_BATCH_POINTS": "larger batches get 413",
    "AMPWATCH_ALERT_WEBHOOK_URL": "adds a generic webhook channel with no other configuration (empty = unset)",
    "AMPWATCH_ALERT_RULES_FILE": "YAML or JSON file of `rules:` and `channels:` upserted by name at start-up; a "
    "broken file stops the server with the reason (see [Alerts](alerts.md))",
    "AMPWATCH_ALERT_EVAL_INTERVAL_S": "how often windowed rules, stalls and crashes are evaluated",
    "AMPWATCH_ALERT_DELIVERY_TIMEOUT_S": "per-attempt timeout of a notification",
    "AMPWATCH_ALERT_URL_SCOPE": "where notifications may go: `private` (public, private-network and loopback "
    "addresses), `public` (public only), `loopback` (this machine only, no DNS lookup). Link-local/metadata "
    "(169.254.0.0/16, fe80::/10), unspecified, multicast and reserved addresses are always refused",
    "AMPWATCH_ALERT_GROUP_WAIT_S": "a run's notifications to one channel due within this many seconds of the first "
    "go out as one message",
    "AMPWATCH_HEARTBEAT_TIMEOUT_S": "no batch for this long and no `finish()`: the run is `crashed`",
    "AMPWATCH_STALL_MIN_S": "with `AMPWATCH_STALL_FACTOR`: heartbeats but no new step for max(this, factor × usual "
    "step time) is `stalled`",
    "AMPWATCH_STALL_FACTOR": "see `AMPWATCH_STALL_MIN_S`",
}


def _sources(*folders: str) -> str:
    return "".join(p.read_text() for folder in folders for p in sorted((ROOT / folder).rglob("*.py")))


def _meaning(key: str) -> str:
    if key not in MEANINGS:
        raise LookupError(f"{key} has no meaning in docs/_hooks/configuration.py MEANINGS: document it there")
    return MEANINGS[key]


def _code(value: Any) -> str:
    if value is None or value == "":
        return "—"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def agent_table() -> str:
    """Agent settings: `AgentSettings`' fields, and the other AMPWATCH_* variables the agent reads."""
    from ampwatch._settings import AgentSettings

    sources = _sources("agent")
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    internal = ["| `AgentSettings` field | default | meaning |", "|---|---|---|"]
    seen = set()
    for field in dataclasses.fields(AgentSettings):
        default = field.default if field.default is not dataclasses.MISSING else None
        variable = f"AMPWATCH_{field.name.upper()}"
        doc = field.metadata.get("doc")  # a field may carry its own: field(default=..., metadata={"doc": "..."})
        if variable in sources:
            seen.add(variable)
            rows.append(f"| `{variable}` | {_code(default)} | {_cell(doc or _meaning(variable))} |")
        else:
            meaning = doc or _meaning(f"AgentSettings.{field.name}")
            internal.append(f"| `{field.name}` | {_code(default)} | {_cell(meaning)} |")
    server = _server_variables()
    for variable in sorted(set(re.findall(r"AMPWATCH_[A-Z_]+", sources)) - seen - server):
        rows.append(f"| `{variable}` | — | {_cell(_meaning(variable))} |")
    text = "\n".join(rows)
    if len(internal) > 2:
        text += "\n\nSet by no variable (fixed for every run):\n\n" + "\n".join(internal)
    return text


def _server_variables() -> set[str]:
    from ampwatch.server import Settings

    return {f"AMPWATCH_{name.upper()}" for name in Settings.model_fields}


def _server_flags() -> dict[str, str]:
    """`ampwatch server`'s flags by the variable their help names ('... or AMPWATCH_HOST')."""
    from ampwatch._cli import _parser

    flags: dict[str, str] = {}
    for action in _parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for action2 in action.choices["server"]._actions:
                for variable in re.findall(r"AMPWATCH_[A-Z_]+", action2.help or ""):
                    flags[variable] = action2.option_strings[0]
    return flags


def server_table() -> str:
    """Server settings: `ampwatch.server.Settings`' fields, with the `ampwatch server` flag that overrides each."""
    from ampwatch.server import Settings

    flags = _server_flags()
    rows = ["| variable | flag | default | meaning |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        variable = f"AMPWATCH_{name.upper()}"
        flag = f"`{flags[variable]}`" if variable in flags else "—"
        default = "off" if field.default is False else _code(field.default)
        rows.append(f"| `{variable}` | {flag} | {default} | {_cell(field.description or _meaning(variable))} |")
    server_sources = _sources("server", "web")
    agent = set(re.findall(r"AMPWATCH_[A-Z_]+", _sources("agent")))  # (named in messages: the agent's table has them)
    others = sorted(set(re.findall(r"AMPWATCH_[A-Z_]+", server_sources)) - _server_variables() - agent)
    for variable in others:
        rows.append(f"| `{variable}` | — | — | {_cell(_meaning(variable))} |")
    return "\n".join(rows)


def cli_reference() -> str:
    """Every `ampwatch` command with its arguments, from the parser itself."""
    from ampwatch._cli import _parser

    lines: list[str] = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if not isinstance(action, argparse._SubParsersAction):
                continue
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                command = f"ampwatch {path}{name}"
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    walk(sub, f"{path}{name} ")
                    continue
                lines.append(f"`{command}` — {helps.get(name) or ''}\n")
                for arg in sub._actions:
                    if arg.help == argparse.SUPPRESS or "-h" in arg.option_strings:
                        continue
                    label = ", ".join(arg.option_strings) or arg.dest.upper()
                    if arg.option_strings and arg.nargs != 0:
                        label += " " + (
                            "{" + ",".join(arg.choices) + "}" if arg.choices else arg.metavar or arg.dest.upper()
                        )
                    lines.append(f"- `{label}`: {arg.help or ''}")
                lines.append("")

    walk(_parser(), "")
    return "\n".join(lines).rstrip() + "\n"


def render() -> str:
    """The generated part of docs/configuration.md."""
    return (
        "## Agent\n\nEnvironment variables; arguments to `ampwatch.init()` (`project`, `url`, `token`) win.\n\n"
        + agent_table()
        + "\n\n## Server\n\nEnvironment variables; `ampwatch server`'s flags win.\n\n"
        + server_table()
        + "\n\n## Command line\n\nEvery command and flag, as `ampwatch COMMAND --help` prints them.\n\n"
        + cli_reference()
    )


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """MkDocs event: fill the marker of the configuration page."""
    if MARKER not in markdown:
        return markdown
    try:
        import ampwatch.server  # noqa: F401
    except ImportError as error:
        raise SystemExit(
            f"the configuration page is generated from the installed ampwatch ({error}): run mkdocs from the "
            'environment where `pip install -e ".[dev]"` installed it'
        ) from error
    return markdown.replace(MARKER, render())


if __name__ == "__main__":
    print(render())
