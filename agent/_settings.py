"""Agent configuration: explicit arguments first, then AMPWATCH_* environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

DEFAULT_URL = "http://127.0.0.1:8600"
MODES = ("online", "offline", "disabled")


@dataclass(frozen=True)
class AgentSettings:
    """Everything the agent needs to know, resolved once at `init()`."""

    url: str = DEFAULT_URL
    token: str | None = None
    project: str = "default"
    mode: str = "online"
    flush_interval_s: float = 0.5  # the dashboard promises "within a second"; each batch costs its sender ~0.5 ms
    finish_timeout_s: float = 10.0
    request_timeout_s: float = 5.0
    max_pending_records: int = 1_000_000
    max_batch_points: int = 50_000
    heartbeat_interval_s: float = 10.0
    spool_max_bytes: int = 1 << 30
    layer_norm_interval: int = 50
    param_check_interval: int = 50
    capture_dir: str | None = field(
        default=None,
        metadata={
            "doc": "when the NaN-origin probe names the input batch, write the tensors the watched model received in "
            "that forward, and the step, to this folder (`torch.load` the file to replay them; the event names it). "
            "Unset: nothing is copied or written. See [Diagnosis](diagnosis.md#replaying-a-bad-batch)"
        },
    )
    capture_max_bytes: int = field(
        default=256 << 20,
        metadata={
            "doc": "with `AMPWATCH_CAPTURE_DIR`: the most bytes of input copies held at once. A batch larger than "
            "this is not copied, nor one that would take the copies still waiting for the sender past it: the "
            "event then says why no file was written"
        },
    )

    @classmethod
    def resolve(cls, *, project: str | None, url: str | None, token: str | None) -> AgentSettings:
        """Merge explicit arguments with the environment; an unknown mode is an error."""
        env = os.environ
        mode = env.get("AMPWATCH_MODE", "online").strip().lower() or "online"
        if mode not in MODES:
            raise ValueError(f"AMPWATCH_MODE must be one of {', '.join(MODES)}, not {mode!r}")
        return cls(
            url=(url or env.get("AMPWATCH_URL") or DEFAULT_URL).rstrip("/"),
            token=token or env.get("AMPWATCH_TOKEN") or None,
            project=project or env.get("AMPWATCH_PROJECT") or "default",
            mode=mode,
            flush_interval_s=max(
                0.01, float(env.get("AMPWATCH_FLUSH_INTERVAL_S", cls.flush_interval_s))
            ),  # (0: a busy sender)
            finish_timeout_s=min(max(0.0, float(env.get("AMPWATCH_FINISH_TIMEOUT_S", cls.finish_timeout_s))), 86400.0),
            spool_max_bytes=int(env.get("AMPWATCH_SPOOL_MAX_BYTES", cls.spool_max_bytes)),
            max_pending_records=max(1, int(env.get("AMPWATCH_MAX_PENDING_RECORDS", cls.max_pending_records))),
            heartbeat_interval_s=float(env.get("AMPWATCH_HEARTBEAT_INTERVAL_S", cls.heartbeat_interval_s)),
            layer_norm_interval=max(1, int(env.get("AMPWATCH_LAYER_NORM_INTERVAL", cls.layer_norm_interval))),
            param_check_interval=max(1, int(env.get("AMPWATCH_PARAM_CHECK_INTERVAL", cls.param_check_interval))),
            capture_dir=env.get("AMPWATCH_CAPTURE_DIR") or None,
            capture_max_bytes=max(0, int(env.get("AMPWATCH_CAPTURE_MAX_BYTES", cls.capture_max_bytes))),
        )
