"""Server settings: AMPWATCH_* environment variables, overridden by CLI flags."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Everything `create_app()` needs; nothing is read from the environment anywhere else."""

    model_config = SettingsConfigDict(env_prefix="AMPWATCH_", extra="ignore")

    database_url: str = "sqlite:///ampwatch.db"
    host: str = "127.0.0.1"
    port: int = 8600
    public_url: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    max_batch_points: int = 1_000_000

    @property
    def base_url(self) -> str:
        """Where people reach the dashboard; used in links the server hands out."""
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")
