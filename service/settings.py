"""The service's configuration: one settings class, environment variables prefixed ``LEDGER_``.

``LEDGER_DATABASE_URL``, ``LEDGER_BOOTSTRAP_ADMIN_KEY``, ``LEDGER_ARTIFACT_DIR``,
``LEDGER_RESERVATION_TTL_S`` are the names DESIGN.md fixes; the rest are operational limits.
Secrets have no usable default: without ``LEDGER_BOOTSTRAP_ADMIN_KEY`` no key exists until
``ledger serve`` (first start) or ``ledger keys create`` makes one and prints it once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# A bootstrap key is a bearer secret: refuse ones short enough to guess.
MIN_KEY_LENGTH: Final = 24


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LEDGER_", extra="ignore", frozen=True)

    database_url: str = "sqlite:///./ledger.db"
    """SQLAlchemy URL: ``sqlite:///path`` (embedded default) or ``postgresql+psycopg://...``."""

    bootstrap_admin_key: SecretStr | None = None
    """At start-up this key is made to exist as an ``admin`` key of tenant ``default``."""

    artifact_dir: Path = Path("./artifacts")
    """Where released model artifacts are stored."""

    reservation_ttl_s: float = Field(default=3600.0, gt=0)
    """A reservation neither committed nor aborted within this many seconds expires."""

    expiry_sweep_interval_s: float = Field(default=5.0, gt=0)
    """How often the background sweep expires reservations past their TTL."""

    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    """Request bodies above this size are refused with 413 before they are parsed."""

    db_pool_size: int = Field(default=20, gt=0)
    db_max_overflow: int = Field(default=20, ge=0)
    """Database connections kept open per process, and how many more may open under load.
    Every request uses one briefly (its key lookup) and every spend one more: a pool smaller than
    the concurrent requests makes connections open and close under load."""

    http_threads: int = Field(default=64, gt=0)
    """Threads that run the (synchronous) ledger operations of concurrent requests."""

    auth_cache_ttl_s: float = Field(default=0.0, ge=0, le=300)
    """Seconds a process may reuse a successful API key lookup. 0 (default): every request
    looks its key up, so a revoked key stops working at once. Above 0 the lookup (a database
    round trip on every request) is saved, and a revoked key can keep working for up to this long
    in a process that used it just before."""

    @field_validator("bootstrap_admin_key", mode="before")
    @classmethod
    def _empty_key_is_none(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @field_validator("bootstrap_admin_key")
    @classmethod
    def _key_long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_KEY_LENGTH:
            raise ValueError(f"LEDGER_BOOTSTRAP_ADMIN_KEY must be at least {MIN_KEY_LENGTH} characters.")
        return value
