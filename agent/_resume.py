"""Resuming a run: a relaunch that resumes a checkpoint numbers its steps from where it resumes, and a relaunch under a
run id whose steps are stored that does not say so never overwrites them.

The server's reply to the registration says the last step stored per rank; it comes on the sender thread before
this launch's first batch goes out (registration always precedes it). The functions here decide and word; the Run
(`Run._resume_from`, `Run._registered`) and the batcher (`Batcher.hold_back`) change their own state.
"""

from __future__ import annotations

import array
import base64
import json
import logging
import sys
from typing import Any

from ampwatch._protocol import EVENT
from ampwatch._protocol import event as protocol_event
from ampwatch._transport import encode, packed

log = logging.getLogger("ampwatch")


def resumed(run: Any, resume_step: int) -> tuple | None:
    """The record that marks where this launch resumes (an info event, shown on the run page), or None for a
    `resume_step` that is no step (said in the log; the steps then count from 0)."""
    if resume_step < 0:
        log.warning("ampwatch: resume_step must be a step (0 or more), got %d; steps count from 0", resume_step)
        return None
    message = f"Resumed at step {resume_step}: this launch's steps continue the run's numbering from there."
    return (EVENT, resume_step, _event(run, resume_step, "info", message, {"check": "resumed", "step": resume_step}))


def check_relaunch(run: Any, stored: dict[str, Any], resume_step: int | None) -> None:
    """On the registration's first reply that says which steps are `stored` (the last one per rank): when an earlier
    launch stored steps of this rank and this launch does not resume, hold back this launch's points at those steps
    (they would overwrite them), and say what to pass."""
    last = stored.get(str(run.rank))
    if resume_step is not None or not isinstance(last, int) or run._worker is None:
        return
    message = (
        f"Run {run.id} already holds steps up to {last} of rank {run.rank} from an earlier launch under the same "
        "run id, and this launch records at those steps again (the agent counts from 0): its points there are "
        "held back, not stored over them. If it resumes a checkpoint, pass the step it resumes from: "
        f"ampwatch.init(..., resume_step=N) ({last + 1} continues right after the stored steps); to start a new "
        "run, use another run id (AMPWATCH_RUN_ID)."
    )
    worker, batcher = run._worker, run._worker.batcher
    batcher.hold_back(
        last, _event(run, last, "critical", message, {"check": "relaunch_without_resume", "stored_step": last})
    )

    def rewrite(body: bytes) -> tuple[bytes, bool]:  # (the first batch that holds a point back says why)
        body, held = _held_back(body, last, batcher.refusal)
        if held:
            batcher.refusal_said()
        return body, held

    worker.outbox.rewrite_from(batcher.first_seq, rewrite)


def held_back(points: dict[str, tuple[list[int], list[Any]]], last: int) -> bool:
    """Remove the points at steps up to `last` from a batch's series (in place); whether there were any."""
    held = False
    for name, (steps, values) in list(points.items()):
        if steps and steps[0] <= last:  # (steps ascend within a series)
            keep = [i for i, step in enumerate(steps) if step > last]
            held = True
            points[name] = ([steps[i] for i in keep], [values[i] for i in keep])
    return held


def _held_back(body: bytes, last: int, event: dict[str, Any] | None) -> tuple[bytes, bool]:
    """A queued batch's body without its points at steps up to `last`, and with `event` if it had any; whether it
    had."""
    doc = json.loads(body)
    points = {name: (_unpacked(s["steps"], "q"), _unpacked(s["values"], "d")) for name, s in doc["points"].items()}
    if not held_back(points, last):
        return body, False
    doc["points"] = {
        name: {"steps": packed(steps, "q"), "values": packed(values, "d")}
        for name, (steps, values) in points.items()
        if steps
    }
    doc["events"] = doc.get("events", []) + ([event] if event is not None else [])
    return encode(doc), True


def _unpacked(text: str, code: str) -> list[Any]:
    data = array.array(code, base64.b64decode(text))
    if sys.byteorder == "big":
        data.byteswap()
    return data.tolist()


def _event(run: Any, step: int, severity: str, message: str, details: dict[str, Any]) -> dict[str, Any]:
    return protocol_event(step, run.rank, "amp_config", severity, message, details)
