"""The service's configuration: one settings class, environment variables prefixed ``LEDGER_``.

``LEDGER_DATABASE_URL``, ``LEDGER_BOOTSTRAP_ADMIN_KEY``, ``LEDGER_ARTIFACT_DIR``,
``LEDGER_RESERVATION_TTL_S`` are the names the original design fixed (docs/ARCHITECTURE.md,
"Configuration and command line"); the rest are operational limits.

**Where state lives** (issue 28 §3): one folder, ``LEDGER_HOME`` (``ledger --home DIR``),
default ``$XDG_DATA_HOME/privacy-ledger`` (``~/.local/share/privacy-ledger``), never the
current directory. It holds the embedded database (``ledger.db``), the released artifacts
(``artifacts/``) and the server secrets (``key-hash.secret``, ``signing-key.pem``) unless
``LEDGER_DATABASE_URL``, ``LEDGER_ARTIFACT_DIR`` or ``LEDGER_SECRETS_DIR`` say otherwise.
Secrets have no usable default: without ``LEDGER_BOOTSTRAP_ADMIN_KEY`` no key exists until
``ledger serve`` (first start) or ``ledger keys create`` makes one and prints it once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# A bootstrap key is a bearer secret: refuse ones short enough to guess.
MIN_KEY_LENGTH: Final = 24
# The key-hash secret is an HMAC key (service.server_secrets): at least 32 characters.
MIN_SECRET_LENGTH: Final = 32


DATABASE_FILE: Final = "ledger.db"
ARTIFACTS_FOLDER: Final = "artifacts"


def default_home() -> Path:
    """``LEDGER_HOME`` unset: ``$XDG_DATA_HOME/privacy-ledger`` (``~/.local/share/privacy-ledger``),
    where a user's data of an application is expected (XDG Base Directory), the same folder in
    every working directory."""
    data_home = os.environ.get("XDG_DATA_HOME", "").strip()
    base = Path(data_home) if data_home else Path.home() / ".local" / "share"
    return base / "privacy-ledger"


def ledger_home() -> Path:
    """The ledger's home: ``LEDGER_HOME`` (absolute), else ``default_home()``."""
    text = os.environ.get("LEDGER_HOME", "").strip()
    return Path(text).expanduser().resolve() if text else default_home()


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LEDGER_", extra="ignore", frozen=True)

    home: Path = Field(default_factory=ledger_home)
    """The folder of the ledger's state (module docstring): the default database, artifacts and
    secrets live here. ``LEDGER_HOME`` or ``ledger --home DIR``."""

    database_url: str = ""
    """SQLAlchemy URL: ``sqlite:///path`` or ``postgresql+psycopg://...``. Default: the embedded
    SQLite file ``ledger.db`` in ``home``."""

    bootstrap_admin_key: SecretStr | None = None
    """At start-up this key is made to exist as an ``admin`` key of tenant ``default``."""

    artifact_dir: Path = Path(ARTIFACTS_FOLDER)
    """Where released model artifacts are stored. Default: ``artifacts/`` in ``home``."""

    reservation_ttl_s: float = Field(default=3600.0, gt=0)
    """A reservation neither committed nor aborted within this many seconds expires."""

    reservation_max_lifetime_s: float = Field(default=7 * 24 * 3600.0, gt=0, le=30 * 24 * 3600.0)
    """How long a reservation may be held from its creation, extensions included
    (``POST /v1/reservations/{id}/extend``): a hold renewed by a heartbeat still ends. A
    reservation's ``ttl_s`` above it is refused (422)."""

    expiry_sweep_interval_s: float = Field(default=5.0, gt=0)
    """How often the background sweep expires reservations past their TTL."""

    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    """Request bodies above this size are refused with 413 before they are parsed."""

    max_artifact_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    """A model artifact uploaded for a version trained outside the service
    (``PUT /v1/models/{name}/versions/{version}``) larger than this is refused with 413; the
    upload is streamed to disk, never held in memory."""

    job_max_steps: int = Field(default=1_000_000, gt=0)
    """Training steps one job may take (DP-SGD steps; a staged job: the sum over its stages).
    Known from the params and the ledger's batches before anything is reserved: the worker fails a
    longer job then (``too_many_steps``); ``POST /v1/jobs`` refuses an explicit ``params.steps``
    above it (422)."""

    job_max_wall_s: float = Field(default=86_400.0, gt=0)
    """Seconds one attempt of a job may run on a worker: past it the worker stops the job at its
    next step, aborts the rest of its reservation and fails it (``wall_time_exceeded``)."""

    max_queued_jobs_per_tenant: int = Field(default=100, gt=0)
    """Jobs a tenant may have queued at once; ``POST /v1/jobs`` beyond it answers 409
    ``too_many_queued_jobs``. Workers also take tenants in turn (``service.ledger.jobs.leases.claim``)."""

    max_pricing_work: int = Field(default=20_000, gt=0)
    """Pricing work one request may ask for: its event nodes × the budget's orders (``rdp``), × 1
    (``basic``) or × 100 (``prv``); above it a reservation, a commit's event or a server-side
    certificate verification is refused with a 422 naming the field (``service.ledger.pricing_limits``).
    The default prices in at most about 1.5 s."""

    pricing_cpu_s_per_s: float = Field(default=0.5, gt=0)
    """CPU seconds of pricing per second that one tenant's requests may use in one API process
    (``service.api.ratelimit``); beyond it (and its burst) a request is refused with 429 and
    ``Retry-After``. Repeated events are cached and cost microseconds."""

    pricing_burst_s: float = Field(default=5.0, gt=0)
    """How many CPU seconds of pricing a tenant may use at once (its bucket's depth)."""

    rate_limits: Literal["auto", "database", "process"] = "auto"
    """Where each tenant's pricing bucket lives (``service.api.ratelimit``): ``database`` — one
    row in the ledger's database shared by every API process and host, so
    ``pricing_cpu_s_per_s`` holds in total; ``process`` — in each process (N processes allow N
    times the rate); ``auto`` — ``database`` on PostgreSQL, ``process`` on SQLite."""

    pricing_threads: int = Field(default=2, gt=0)
    """Threads that price costly events of concurrent requests (so pricing never takes the
    threads that run spends and the other routes)."""

    db_pool_size: int = Field(default=20, gt=0)
    db_max_overflow: int = Field(default=20, ge=0)
    """Database connections kept open per process, and how many more may open under load.
    Every request uses one briefly (its key lookup) and every spend one more: a pool smaller than
    the concurrent requests makes connections open and close under load."""

    http_threads: int = Field(default=64, gt=0)
    """Threads that run the (synchronous) ledger operations of concurrent requests."""

    data_roots: dict[str, list[str]] = Field(default_factory=dict)
    """Where ``file://`` data sources may live (``service.contract.data_roots.DataRoots``), as JSON:
    ``{"*": ["/srv/data"], "team-a": ["/srv/a"]}``. A tenant with an entry of its own uses only
    its own roots; any other tenant uses the ``"*"`` roots; a file lies in the deepest root that
    contains it, so a tenant's root nested in a shared one stays that tenant's. A JSON list
    (``["/srv/data"]``) is the ``"*"`` entry. Default: none, so only ``builtin:`` sources work.
    The API (which checks a source when an admin sets it) and every worker (which checks it again
    when it reads) need the same roots at the same paths."""

    max_source_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    """A ``file://`` data source larger than this (or, for ``.npz``, whose arrays are) is refused."""

    auth_cache_ttl_s: float = Field(default=0.0, ge=0, le=300)
    """Seconds a process may reuse a successful API key lookup. 0 (default): every request
    looks its key up, so a revoked key stops working at once. Above 0 the lookup (a database
    round trip on every request) is saved, and a revoked key can keep working for up to this long
    in a process that used it just before."""

    key_hash_secret: SecretStr | None = None
    """The HMAC-SHA256 key under which API keys are hashed (``service.server_secrets``), 32+
    characters. Unset: the secret is the file ``key-hash.secret`` in ``secrets_dir``, created
    (0600) on first use. Every process that authenticates or creates keys needs the same one."""

    secrets_dir: Path | None = None
    """Where server secrets live when ``key_hash_secret`` is unset. Default: the SQLite
    database's folder (``home`` for the default database); for a server database (PostgreSQL),
    ``home``. Never inside the database: a dump alone must not let anyone test a guessed key."""

    signing_key: Path | None = None
    """The Ed25519 private key (unencrypted PKCS#8 PEM file) that signs every certificate and
    every audit-chain head the server hands out (``service.verification.signing``). Unset: the file
    ``signing-key.pem`` in ``secrets_dir``, created (0600) on first use (``ledger serve``: at
    start). Set to a file that cannot be read, the server refuses to start. Every process that
    commits needs the same key."""

    signing_keys_retired: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Keys that signed before a rotation and still verify, never sign: each the base64 raw
    public key the well-known route listed, or the path of a PEM file (public or private key); a
    JSON list or comma-separated. Rotate by moving the old ``signing_key`` here and pointing
    ``signing_key`` at a new file: old certificates keep verifying, new ones carry the new key."""

    signing_keys_lost: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Key ids (16 hex characters, as certificates name them) an admin declares lost for good. A
    process refuses to start while the database records a key that signed for it and is neither
    ``signing_key`` nor one of ``signing_keys_retired`` (a lost key file replaced by a new key
    would leave what it signed unverifiable, silently); a key listed here is accepted instead,
    once: it is marked lost and ``signing_key.declared_lost`` is appended to the audit log
    (``service.ledger.signing_custody``). A JSON list or comma-separated."""

    metrics_token: SecretStr | None = None
    """``GET /metrics`` answers only a request with ``Authorization: Bearer <metrics_token>``
    (24+ characters). API keys never read it: its series are operator-level, across tenants."""

    metrics_public: bool = False
    """``GET /metrics`` without any credential (a scrape on a private network)."""

    metrics_dataset_gauges: bool = True
    """``GET /metrics`` carries per-dataset budget gauges (``ledger_dataset_epsilon_*``, labelled
    by tenant and dataset; one read of the dataset heads per scrape). ``false`` drops them."""

    @model_validator(mode="before")
    @classmethod
    def _state_in_home(cls, values: Any) -> Any:
        """The defaults of the database and the artifacts are in ``home`` (never the working
        directory); what is set explicitly stays as it is."""
        if not isinstance(values, dict):
            return values
        home = values.get("home")
        home_path = Path(str(home)).expanduser().resolve() if home not in (None, "") else ledger_home()
        values = {**values, "home": home_path}
        if not str(values.get("database_url") or "").strip():
            values["database_url"] = f"sqlite:///{home_path / DATABASE_FILE}"
        if values.get("artifact_dir") in (None, ""):
            values["artifact_dir"] = home_path / ARTIFACTS_FOLDER
        return values

    @model_validator(mode="after")
    def _ttl_within_lifetime(self) -> Settings:
        if self.reservation_ttl_s > self.reservation_max_lifetime_s:
            raise ValueError(
                f"LEDGER_RESERVATION_TTL_S ({self.reservation_ttl_s:g}) must be at most "
                f"LEDGER_RESERVATION_MAX_LIFETIME_S ({self.reservation_max_lifetime_s:g})."
            )
        return self

    @field_validator("data_roots", mode="before")
    @classmethod
    def _roots_list_is_every_tenant(cls, value: object) -> object:
        if isinstance(value, list | tuple):
            return {"*": list(value)}
        return value

    @field_validator("data_roots")
    @classmethod
    def _roots_are_absolute(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        # A relative root would move with the process's working directory (the finding's host
        # part read relative to it): refuse it at start-up rather than guess.
        for tenant, roots in value.items():
            if not tenant.strip():
                raise ValueError(f"LEDGER_DATA_ROOTS: a tenant key must not be blank. Found {tenant!r}.")
            for root in roots:
                if not root.startswith("/") or "\0" in root:
                    raise ValueError(
                        f"LEDGER_DATA_ROOTS[{tenant!r}]: a root must be an absolute path. Found {root!r}."
                    )
                # the whole host: exactly what the roots exist to prevent ("/srv/.." and "/./" too)
                if not os.path.normpath(root).strip("/") or not os.path.realpath(root).strip("/"):
                    raise ValueError(f"LEDGER_DATA_ROOTS[{tenant!r}]: a root must not be '/'.")
        return value

    @field_validator("signing_keys_retired", "signing_keys_lost", mode="before")
    @classmethod
    def _key_lists(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    return json.loads(text)
                except ValueError as exc:
                    setting = f"LEDGER_{str(info.field_name).upper()}"
                    raise ValueError(f"{setting} is not a JSON list: {exc}") from None
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @field_validator("signing_key", mode="before")
    @classmethod
    def _empty_path_is_none(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            return None
        return value

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

    @field_validator("key_hash_secret", "metrics_token", mode="before")
    @classmethod
    def _empty_secret_is_none(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @field_validator("key_hash_secret")
    @classmethod
    def _secret_long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_SECRET_LENGTH:
            raise ValueError(
                f"LEDGER_KEY_HASH_SECRET must be at least {MIN_SECRET_LENGTH} characters "
                f"(found {len(value.get_secret_value())})."
            )
        return value

    @field_validator("metrics_token")
    @classmethod
    def _token_long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_KEY_LENGTH:
            raise ValueError(
                f"LEDGER_METRICS_TOKEN must be at least {MIN_KEY_LENGTH} characters "
                f"(found {len(value.get_secret_value())})."
            )
        return value
