"""Server settings: AMPWATCH_* environment variables, overridden by CLI flags."""

from __future__ import annotations

from typing import Literal

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Everything `create_app()` needs; nothing is read from the environment anywhere else."""

    model_config = SettingsConfigDict(env_prefix="AMPWATCH_", extra="ignore")

    database_url: str = "sqlite:///ampwatch.db"
    host: str = "127.0.0.1"
    port: int = 8600
    public_url: str | None = None
    insecure: bool = False  # allow a non-loopback address with no access token configured
    max_body_bytes: int = 32 * 1024 * 1024
    max_batch_points: int = 1_000_000
    # Alerts. Empty strings mean "not set" (an environment variable can be set to nothing).
    alert_webhook_url: str = ""
    alert_rules_file: str = ""
    alert_eval_interval_s: float = 1.0
    alert_delivery_timeout_s: float = 10.0
    alert_url_scope: Literal["private", "public", "loopback"] = "private"
    alert_group_wait_s: float = 0.0
    heartbeat_timeout_s: float = 60.0
    stall_min_s: float = 300.0
    stall_factor: float = 20.0
    # Live streams (see ampwatch.server.fanout) and the access-token cache.
    stream_poll_s: float = 0.2  # a run's poller looks this often when not woken by a commit
    stream_runs_poll_s: float = 0.5  # the runs list's poller
    stream_lifetime_s: float = 30.0  # then a stream ends and its browser reconnects from its Last-Event-ID
    stream_queue: int = 64  # messages a slow client may lag behind before it is dropped (and resumes)
    delete_chunk_rows: int = 20_000  # rows a transaction of deleting or pruning runs removes at most (about)
    token_refresh_s: float = 5.0  # tokens are re-read this often: a new or revoked token counts within it

    @property
    def base_url(self) -> str:
        """Where people reach the dashboard; used in links the server hands out."""
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")
