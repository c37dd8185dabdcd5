"""What the agent and the server agree on, and the records the agent's two threads hand each other.

Standard library only: the agent imports it, and so does the server (`ampwatch.server.schemas`), so event
types, severities, name limits and the batch format are written down once, here.

The wire format, version 1 (`API_PREFIX`): a run registers with `PUT {API_PREFIX}/runs/{run_id}` and a JSON
document (project, name, config, environment), then delivers batches with `POST {API_PREFIX}/runs/{run_id}/batches`:

    {"format": 1, "rank": int, "seq": int, "points": {name: {"steps": packed "q", "values": packed "d"}},
     "events": [{"step", "rank", "type", "severity", "message", "details", "time"}, ...], "status": str | None}

`format` is the batch's format version (`BATCH_FORMAT`; a body without it is version 1, as older agents send it):
a server answers a version it does not know with a 422 naming the ones it takes (`BATCH_FORMATS`), and stores
nothing of that batch. `seq` numbers the batches of one (run, rank): the server stores each (run, rank, seq) once,
so a batch may be sent again after a lost reply. Series travel packed (see `packed`): exact, NaN and infinities
included.
"""

from __future__ import annotations

import array
import base64
import math
import sys
import time
from typing import Any

API_VERSION = 1
API_PREFIX = f"/api/v{API_VERSION}"
BATCH_FORMAT = 1  # the format version of the batches this agent sends
BATCH_FORMATS = (1,)  # the versions the server takes (one it does not know: a 422 that names these)

EVENT_TYPES = (
    "skipped_step",
    "scale_collapse",
    "nonfinite_loss",
    "nonfinite_grad",
    "nonfinite_param",
    "grad_spike",
    "loss_spike",
    "scaler_misuse",
    "amp_config",
    "run_crashed",
    "run_stalled",
    "checkpoint",
    "ranks_desync",
    "leading_indicator",
    "run_stopped",
)
SEVERITIES = ("info", "warning", "critical")
SENT_STATUSES = ("running", "finished", "crashed", "stopped")  # a batch's `status` (the server adds "stalled")
MAX_NAME = 200  # the server's limit on project, run and series names
MAX_STEP = 2**63  # steps are in [0, MAX_STEP): the server stores them as signed 64-bit integers
DROPPED = "dropped_records"  # the series of how many records and batches a rank lost so far, in total
DROPPED_PREFIX = DROPPED + "/"  # ... and per reason: `dropped_records/<reason>`


def run_path(run_id: str) -> str:
    """Where a run registers."""
    return f"{API_PREFIX}/runs/{run_id}"


def batches_path(run_id: str) -> str:
    """Where a run's batches go."""
    return f"{API_PREFIX}/runs/{run_id}/batches"


def packed(numbers: list[Any], code: str) -> str:
    """A series' steps (`code` "q": int64) or values ("d": float64) as a batch carries them: base64 of their
    little-endian bytes. Exact, NaN and infinities included, and over 10x cheaper to write than JSON numbers."""
    data = array.array(code, numbers)
    if sys.byteorder == "big":
        data.byteswap()
    return base64.b64encode(data).decode("ascii")


def batch_document(
    rank: int,
    seq: int,
    points: dict[str, tuple[list[int], list[float]]],
    events: list[dict[str, Any]],
    status: str | None,
) -> dict[str, Any]:
    """One batch as the server takes it (see the module's docstring)."""
    body: dict[str, dict[str, str]] = {}
    last_steps, last_packed = None, ""
    for name, (steps, values) in points.items():
        if steps != last_steps:  # (the standard series of a step share their steps: packed once)
            last_steps, last_packed = steps, packed(steps, "q")
        body[name] = {"steps": last_packed, "values": packed(values, "d")}
    return {"format": BATCH_FORMAT, "rank": rank, "seq": seq, "points": body, "events": events, "status": status}


def pow2(value: float) -> str:
    """A loss scale as people read it: 2^16, or the number when it is not a power of two."""
    if value > 0 and math.isfinite(value) and math.log2(value).is_integer():
        return f"2^{int(math.log2(value))}"
    return f"{value:g}"


def spell(value: float) -> float | str:
    """A value as an event's details hold it in JSON (non-finite ones as strings)."""
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


# -- records: what the training thread appends for the sender thread ----------------------------------------------
# Plain tuples (the cheapest object Python builds, on the hot path); the first field is the kind.
KIND = 0

VALUES = "v"  # (VALUES, step, names, values): `values` a tuple of floats, one per name, or one 0-d tensor for names[0]
EVENT = "e"  # (EVENT, step, event): an event document, as the wire format carries it
STATUS = "s"  # (STATUS, status): one of SENT_STATUSES
FLUSH = "f"  # (FLUSH, done, spooled): set the threading.Event `done` once what precedes is delivered (or spooled)
ORIGIN = "o"  # (ORIGIN, step, arming, forward names, forward flags, backward names, backward flags, inputs): what
#               the NaN-origin probe saw at `step` (the flags a tensor each, or None for a pass not watched); inputs,
#               with AMPWATCH_CAPTURE_DIR set, the copies of the model's inputs by input flag (see ampwatch._capture)
INDICATORS = "i"  # (INDICATORS, step, parts): the leading indicators of an interval step, each part (series prefix,
#                   names, tensors, how many values they hold, what decoding needs) (see ampwatch._indicators)

# A step record: (STEP, step, loss, found, norm, total, anchor, rule, lr, params)
#   loss    the detached tensor passed to scaler.scale(), a list of them (summed), or None (no scale() call,
#           or the user logged `loss`)
#   found   GradScaler's found_inf tensor, a list of them (several optimizers or devices), or None without a scaler
#   norm    the total gradient norm (a 0-dim tensor: clip_grad_norm_'s), Groups: per optimizer the `_foreach_norm`
#           of its gradients, whether they were still scaled, and the module of each parameter on per-layer
#           steps (else None; CLIP_TOTAL: clip_grad_norm_'s total, where the per-parameter norms are each rank's
#           shard's, under FSDP2); or None
#   total   False when the user logged `grad_norm` at this step (their value wins; layers are still ours)
#   anchor  copies of the scale and growth tracker before update(), or None
#   rule    (growth factor, backoff factor, growth interval) of the scaler along with an anchor, else None
#   lr      the first parameter group's float learning rate, or None
#   params  per-parameter norms of the parameters (a periodic finiteness check), or None
STEP = "t"
STEP_FIELDS = ("kind", "step", "loss", "found", "norm", "total", "anchor", "rule", "lr", "params")
# A lean step record, which the lean path makes (ampwatch._step_end) for the usual step: (kind, step, loss, found,
# norm, lr), the three a tensor each (the loss one value), the norm clip_grad_norm_'s total; a step record would
# have had the same, with total True and no anchor, rule or params. Of kind LEAN_STEP, found is GradScaler's
# found_inf; of kind APPLIED_STEP, None: the optimizer's step ran (its post-step hook said so), so GradScaler found
# no inf and did not skip it.
LEAN_STEP = "p"
APPLIED_STEP = "r"
LEAN_FIELDS = ("kind", "step", "loss", "found", "norm", "lr")
STEP_AT, LOSS_AT, FOUND_AT = 1, 2, 3  # positions shared by step and lean step records
LEAN_LR_AT = 5
STEP_KINDS = (STEP, LEAN_STEP, APPLIED_STEP)  # decoded a run of one kind at a time (see ampwatch._steps)
# the records a full buffer drops (the others are few, and always kept)
DATA_KINDS = (VALUES, ORIGIN, INDICATORS, *STEP_KINDS)


def event(step: int, rank: int, kind: str, severity: str, message: str, details: dict[str, Any]) -> dict[str, Any]:
    """An event as a batch carries it (the server's EventIn), stamped now."""
    return {
        "step": step,
        "rank": rank,
        "type": kind,
        "severity": severity,
        "message": message,
        "details": details,
        "time": time.time(),
    }
