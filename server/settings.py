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

    @property
    def base_url(self) -> str:
        """Where people reach the dashboard; used in links the server hands out."""
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")
