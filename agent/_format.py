"""How the client commands print: aligned tables for people, one JSON document for programs."""

from __future__ import annotations

import json
import sys
from typing import Any


def print_json(document: Any) -> None:
    """`document` on stdout as indented JSON; non-finite values must already be spelled out, as the API does."""
    json.dump(document, sys.stdout, indent=2, allow_nan=False)
    sys.stdout.write("\n")


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """Left-aligned columns, two spaces apart; None shows as `-`."""
    cells = [headers] + [["-" if c is None else str(c).replace("\n", " ") for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def timestamp(value: str | None) -> str | None:
    """An API timestamp to the second, date and time apart (`--json` keeps it whole); None stays None."""
    return value[:19].replace("T", " ") if value else None


def number(value: Any) -> str:
    """A value short: floats to 6 significant digits."""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def plan_text(doc: dict[str, Any]) -> str:
    """The rollback plan for people: its summary, then what began the trouble, what to restore and what to skip."""
    trouble, checkpoint, skip = doc["trouble"], doc["checkpoint"], doc["skip"]
    if trouble is None:
        return doc["summary"] + "\n"
    critical = ", ".join(f"{e['type']} at step {e['step']}" for e in trouble["critical"])
    restore = (
        "-"
        if checkpoint is None
        else f"step {checkpoint['step']}" + (f" ({checkpoint['path']})" if checkpoint["path"] else "")
    )
    fields = [
        ["trouble began", f"step {trouble['first_step']} ({trouble['first_sign']['type']})"],
        ["critical", critical],
        ["restore", restore if checkpoint else "none before the trouble: start over"],
        ["skip steps", f"{skip['from']}-{skip['to']} ({len(skip['steps'])} steps)"],
    ]
    return doc["summary"] + "\n\n" + table(["PLAN", "VALUE"], fields) + "\n"
