"""The ledger's tables as SQLAlchemy 2.0 typed models.

The schema is created and changed only by the Alembic migrations in ``alembic/versions``; a test
(``tests/migrations``) checks that these models and the migrations agree on both databases.

Aggregates live next to what they aggregate and are updated in the spend transaction that
changes them (``service.ledger.reservations``): a batch row names its ``BatchState`` (the
per-batch history under the dataset's rule; one ``batch_states`` row per distinct state) and
carries the numbers read from it; a task row carries the
maximum over its batches; the dataset row — the *ledger head*, locked by every spend — carries the
maximum over all batches. Reads never scan charges.

Record ids are stored only as salted hashes (HMAC-SHA256 with a per-dataset salt) under a
unique constraint per dataset, so overlapping batches are refused by the database itself.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from service.db.base import Base, BigId

ID = String(40)
NAME = String(200)
HASH = String(64)
DATA_SOURCE_LENGTH = 2000  # characters of a dataset's data source URI
ZERO = text("'0'")
GENESIS = text("'" + "0" * 64 + "'")

SCOPES = ("admin", "trainer", "viewer")
RESERVATION_STATUSES = ("reserved", "committed", "aborted", "expired")


class Tenant(Base):
    """A tenant: its id is a short slug (``default``, ``team-a``)."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime]


class ApiKey(Base):
    """An API key: only a hash of the key is stored, never the key.

    ``hash_scheme`` ``hmac-sha256``: ``key_hash`` is HMAC-SHA256 under the server's key-hash
    secret (``service.server_secrets``), whose public ``secret_id`` is stored with it; a database
    dump alone lets nobody test a guess. ``sha256``: a key stored before that change, plain
    SHA-256, rehashed with HMAC at its first successful use. ``prefix`` is what a human needs to
    tell keys apart (``pl_`` and 4 characters), never enough to narrow a guess.
    """

    __tablename__ = "api_keys"
    __table_args__ = (
        CheckConstraint("scope IN ('admin', 'trainer', 'viewer')", name="scope"),
        CheckConstraint("hash_scheme IN ('sha256', 'hmac-sha256')", name="hash_scheme"),
    )

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    key_hash: Mapped[str] = mapped_column(HASH, unique=True)
    hash_scheme: Mapped[str] = mapped_column(String(16), server_default=text("'sha256'"))
    secret_id: Mapped[str | None] = mapped_column(String(16))
    prefix: Mapped[str] = mapped_column(String(16))
    scope: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]


def _next_dataset_key(context: Any) -> int:
    """A new dataset's ``key``: the next value of ``datasets_key_seq`` on PostgreSQL (concurrent
    creations); on SQLite, whose write transactions are serial, the largest key + 1."""
    if context.dialect.name == "postgresql":
        statement = text("SELECT nextval('datasets_key_seq')")
    else:
        statement = text("SELECT coalesce(max(key), 0) + 1 FROM datasets")
    return int(context.connection.scalar(statement))


class Dataset(Base):
    """A dataset, its budget, and the ledger head: the row every spend locks.

    ``ledger_version`` counts the spend transactions; ``epsilon_spent`` / ``delta_spent`` /
    ``naive_epsilon`` are the maxima over the dataset's batches (parallel composition over
    disjoint batches); ``epsilon_held`` is the sum of the open reservations' uncommitted ε, an
    upper bound on what any batch holds. ``audit_seq`` / ``audit_hash`` are the head of the
    dataset's audit chain.
    """

    __tablename__ = "datasets"
    # A name is unique within its tenant (``uq_datasets_tenant_id_name``): a name can stand for
    # the dataset (issue 28 §6).
    __table_args__ = (Index(None, "tenant_id", "created_at"), UniqueConstraint("tenant_id", "name"))

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    key: Mapped[int] = mapped_column(BigInteger, default=_next_dataset_key, unique=True)
    """The dataset's integer surrogate key, given at creation: ``batch_records`` names the
    dataset by it. ``id`` stays the public name."""
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(NAME)
    rule: Mapped[str] = mapped_column(String(16))
    accountant: Mapped[str] = mapped_column(String(16))
    budget: Mapped[dict[str, Any]]
    epsilon_budget: Mapped[Decimal]
    delta_budget: Mapped[Decimal]
    record_salt: Mapped[bytes] = mapped_column(LargeBinary)
    ledger_version: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    epsilon_spent: Mapped[Decimal] = mapped_column(server_default=ZERO)
    delta_spent: Mapped[Decimal] = mapped_column(server_default=ZERO)
    naive_epsilon: Mapped[Decimal] = mapped_column(server_default=ZERO)
    epsilon_held: Mapped[Decimal] = mapped_column(server_default=ZERO)
    reservations_open: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    charges_committed: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    audit_seq: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    audit_hash: Mapped[str] = mapped_column(HASH, server_default=GENESIS)
    last_release: Mapped[dict[str, Any] | None]
    last_release_at: Mapped[datetime | None]
    plan_segments: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    """How many plan segments a sequential ``prv`` budget has declared since it was created (its
    ``budget`` lists them); read with the ledger head, so a process whose cached budget lists fewer
    reads the budget again (``service.ledger.spending.store.Work.open``)."""
    data_source: Mapped[str | None] = mapped_column(String(DATA_SOURCE_LENGTH))
    """The URI the worker reads the dataset's records from (``builtin:…`` or a ``file://`` path
    under one of the tenant's data roots), set by an admin; ``NULL``: no job can run yet. A job
    never names a source of its own (``service.contract.data_sources``, DESIGN-NOTES 8)."""
    next_batch_key: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    """The ``key`` the dataset's next batch gets: batch creation takes a run of keys from it
    under the dataset's lock (a deleted batch's key is never given again)."""
    priced_before_v3: Mapped[bool] = mapped_column(Boolean, server_default=false())
    """Whether the dataset may hold charges priced before pricing version 3, whose stored spend
    can be a prefix of what ran (``service.ledger.spent``: only then does the spend read derive
    the guarantee from its batches). Set for every dataset that existed when migration
    ``5d2a8c4e1f63`` ran; a dataset created since never holds such a charge."""
    archived_at: Mapped[datetime | None]
    """When an admin archived the dataset (``NULL``: active). An archived dataset refuses new
    work and keeps its ledger, certificates and audit chain (``service.ledger.datasets``)."""
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class Task(Base):
    """A task of a dataset; ``epsilon_spent`` is the maximum over its batches.

    ``state_id``: when set, the task is *compact*: every one of its batches is in that state
    (their own ``Batch.state_id`` is ``NULL``), so a charge on the whole task rewrites this one
    pointer; ``NULL``: each batch names its own state (docs/ARCHITECTURE.md, "What a charge
    touches")."""

    __tablename__ = "tasks"
    __table_args__ = (Index(None, "dataset_id", "created_at"),)

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"))
    name: Mapped[str] = mapped_column(NAME)
    epsilon_spent: Mapped[Decimal] = mapped_column(server_default=ZERO)
    delta_spent: Mapped[Decimal] = mapped_column(server_default=ZERO)
    naive_epsilon: Mapped[Decimal] = mapped_column(server_default=ZERO)
    state_id: Mapped[str | None] = mapped_column(ID)
    created_at: Mapped[datetime]


class BatchStateRow(Base):
    """One distinct per-batch ledger state (``BatchState``) of a dataset, stored once.

    Content-addressed: ``id`` is ``"bs_"`` + SHA-256 of the dataset id and the state's canonical
    JSON (``service.ledger.spending.classes.state_id``), so batches that have had the same charges
    share one row, and a charge is decided once per distinct state it touches
    (docs/ARCHITECTURE.md, "Batch state classes"). Rows are immutable; a batch moves to another
    state by changing its ``state_id``.
    """

    __tablename__ = "batch_states"

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"), index=True)
    state: Mapped[dict[str, Any]]
    created_at: Mapped[datetime]


class Batch(Base):
    """An immutable, fixed batch of records; ``state_id`` names its ledger state (a
    ``BatchStateRow``), or is ``NULL`` while its task is compact (``Task.state_id`` names it).

    ``position``: its place among the task's batches (0, 1, ...), in the order they were given.
    A charge rewrites ``state_id`` and nothing else, so the row is kept narrow: ``state_id`` is
    neither indexed nor a checked foreign key (the spend transaction writes it from a state it
    has just stored, under the dataset's lock), and on PostgreSQL half of each page is left free
    so that a move is a heap-only update in place (design note 30).
    """

    __tablename__ = "batches"
    __table_args__ = (UniqueConstraint("task_id", "position"), {"postgresql_with": {"fillfactor": 50}})

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"), index=True)
    key: Mapped[int] = mapped_column(BigInteger)
    """The batch's integer key within its dataset (from ``datasets.next_batch_key``): its
    records' ``batch_key``. Unique per dataset by construction (given out under the dataset's
    lock), so not indexed."""
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id"))
    position: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(NAME)
    size: Mapped[int] = mapped_column(Integer)
    state_id: Mapped[str | None] = mapped_column(ID)
    created_at: Mapped[datetime]


class BatchRecord(Base):
    """One record of a batch, as HMAC-SHA256(dataset salt, record id); unique per dataset.

    Keyed by integers, not the public text ids: ``dataset_key`` is the dataset's ``key``,
    ``batch_key`` its batch's ``key`` (unique within the dataset). The primary key (dataset_key,
    record_hash) is the overlap check itself and, on SQLite, the table (``WITHOUT ROWID``: one
    B-tree, no row id); the (dataset_key, batch_key) index finds a batch's records for a
    deletion. Written in bulk with its batch, under the dataset's lock, from the keys just
    written: the keys are not checked foreign keys (a check per row was 60% of a record's insert
    on PostgreSQL; design note 30). docs/ARCHITECTURE.md, "Batch records"."""

    __tablename__ = "batch_records"
    __table_args__ = (Index(None, "dataset_key", "batch_key"), {"sqlite_with_rowid": False})

    dataset_key: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    record_hash: Mapped[bytes] = mapped_column(LargeBinary, primary_key=True)
    batch_key: Mapped[int] = mapped_column(BigInteger)


class Reservation(Base):
    """A held charge: ``reserved`` until committed in full, aborted, or expired.

    ``epsilon`` / ``delta`` are the reserved cost (maximum over the batches it reads);
    ``committed_epsilon`` / ``committed_delta`` what progressive commits have turned into spend;
    ``committed_event`` the run so far the last progressive commit reported (the next one must
    extend it; ``accountant.rules.commit``); ``batches`` how many batches it reads and
    ``batch_set`` the commitment to which (``accountant.certificates.batch_set_hash``).
    """

    __tablename__ = "reservations"
    __table_args__ = (
        CheckConstraint("status IN ('reserved', 'committed', 'aborted', 'expired')", name="status"),
        # Only open reservations can expire: small partial indexes for the sweep and for the
        # expiry check inside every spend transaction.
        Index(
            "ix_reservations_open_expires_at",
            "expires_at",
            postgresql_where=text("status = 'reserved'"),
            sqlite_where=text("status = 'reserved'"),
        ),
        Index(
            "ix_reservations_open_dataset_id_expires_at",
            "dataset_id",
            "expires_at",
            postgresql_where=text("status = 'reserved'"),
            sqlite_where=text("status = 'reserved'"),
        ),
    )

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"))
    status: Mapped[str] = mapped_column(String(16))
    event: Mapped[dict[str, Any]]
    noise_commitment: Mapped[str | None] = mapped_column(String(256))
    epsilon: Mapped[Decimal]
    delta: Mapped[Decimal]
    committed_epsilon: Mapped[Decimal] = mapped_column(server_default=ZERO)
    committed_delta: Mapped[Decimal] = mapped_column(server_default=ZERO)
    commits: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    committed_event: Mapped[dict[str, Any] | None]
    # Its classes (the batches it read in one state), in index order: ``{index, state_at_reserve,
    # cost, committed, batches}`` — that state (a certificate input), the reserved ``Cost``, the
    # cumulative committed one, and how many batches. Written and read with the row.
    classes: Mapped[list[Any]] = mapped_column(server_default=text("'[]'"))
    batches: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    batch_set: Mapped[str] = mapped_column(String(80), server_default=text("''"))
    expires_at: Mapped[datetime]
    created_at: Mapped[datetime]
    closed_at: Mapped[datetime | None]


class ReservationBatch(Base):
    """A batch a reservation reads, and its class (``class_index`` in ``Reservation.classes``): one narrow row
    per batch, written by one set-based statement from the batches it selects, in the transaction
    that writes the reservation (so neither key is a checked foreign key: a check per row cost
    three quarters of the insert on PostgreSQL; design note 30)."""

    __tablename__ = "reservation_batches"
    # A reservation class's batches, found without reading the reservation's other classes.
    __table_args__ = (Index(None, "reservation_id", "class_index"),)

    reservation_id: Mapped[str] = mapped_column(ID, primary_key=True)
    batch_id: Mapped[str] = mapped_column(ID, primary_key=True)
    position: Mapped[int] = mapped_column(Integer)
    class_index: Mapped[int] = mapped_column(Integer)


class ReservationTask(Base):
    """A whole compact task a reservation reads (``Task.state_id``): its batches up to
    ``last_position`` (those it had when reserved; positions are never reused), all in class
    ``class_index``, ``batches`` of them. One row per task instead of one per batch; the batch
    list of a reservation expands it (``service.ledger.reservations.list_reservation_batches``)."""

    __tablename__ = "reservation_tasks"

    reservation_id: Mapped[str] = mapped_column(ID, primary_key=True)
    task_id: Mapped[str] = mapped_column(ID, primary_key=True)
    class_index: Mapped[int] = mapped_column(Integer)
    last_position: Mapped[int] = mapped_column(Integer)
    batches: Mapped[int] = mapped_column(Integer)


class Release(Base):
    """A released model version; a (model, version) pair is released once per tenant."""

    __tablename__ = "releases"
    __table_args__ = (UniqueConstraint("tenant_id", "model", "version"),)

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"))
    reservation_id: Mapped[str] = mapped_column(ForeignKey("reservations.id"))
    model: Mapped[str] = mapped_column(NAME)
    version: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime]


class Certificate(Base):
    """A certificate as issued by ``accountant.certificates`` and its content hash: of a commit
    (its release), or of an aborted or expired reservation (a charge that released nothing)."""

    __tablename__ = "certificates"
    __table_args__ = (Index(None, "dataset_id", "created_at"),)

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"))
    reservation_id: Mapped[str] = mapped_column(ForeignKey("reservations.id"), index=True)
    # ``NULL``: the certificate of an aborted or expired reservation, a charge with no release.
    release_id: Mapped[str | None] = mapped_column(ForeignKey("releases.id"), unique=True)
    body: Mapped[dict[str, Any]]
    content_hash: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime]


class SigningKeyRecord(Base):
    """A key that has signed certificates or audit heads for this database: ``public_key`` (base64
    of the raw 32 bytes; NULL for keys recorded from certificates issued before this table), and
    ``lost_at`` once an admin declared it lost (``service.ledger.signing_custody``)."""

    __tablename__ = "signing_keys"

    key_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    public_key: Mapped[str | None] = mapped_column(String(64))
    first_seen_at: Mapped[datetime]
    lost_at: Mapped[datetime | None]


class IdempotencyKey(Base):
    """The first answer to a mutating request made with an ``Idempotency-Key``."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (UniqueConstraint("tenant_id", "key"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    key: Mapped[str] = mapped_column(String(255))
    operation: Mapped[str] = mapped_column(String(64))
    request_hash: Mapped[str] = mapped_column(HASH)
    response: Mapped[dict[str, Any]]
    status_code: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime]


class MeterBucket(Base):
    """One tenant's bucket of a metered resource, shared by every API process on the database
    (``service.ledger.meters``): ``tokens`` seconds left at ``at_s`` (Unix time, seconds), refilled
    at the configured rate up to the configured depth when next read."""

    __tablename__ = "meter_buckets"

    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    meter: Mapped[str] = mapped_column(String(32), primary_key=True)
    tokens: Mapped[float] = mapped_column(Double)
    at_s: Mapped[float] = mapped_column(Double)


class AuditEntry(Base):
    """One ledger event in the append-only audit log.

    Entries form hash chains: one chain per dataset (``chain`` = the dataset id, its head kept
    on the dataset row, which every spend locks anyway) and one ``global`` chain for tenants and
    keys (its head in ``audit_head``). ``hash`` covers the entry and ``prev_hash``, the hash of
    the previous entry of the same chain. ``seq`` orders all entries globally.
    """

    __tablename__ = "audit_log"
    __table_args__ = (UniqueConstraint("chain", "chain_seq"),)

    seq: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    chain: Mapped[str] = mapped_column(String(64))
    chain_seq: Mapped[int] = mapped_column(BigInteger)
    event_type: Mapped[str] = mapped_column(String(64))
    tenant_id: Mapped[str | None] = mapped_column(String(64))
    dataset_id: Mapped[str | None] = mapped_column(ID)
    payload: Mapped[dict[str, Any]]
    prev_hash: Mapped[str] = mapped_column(HASH)
    hash: Mapped[str] = mapped_column(HASH)
    created_at: Mapped[datetime]


class AuditHead(Base):
    """The head of the ``global`` audit chain (one row, ``id = 1``): last ``seq`` and ``hash``.

    Appends lock it; ``verify`` compares the chain's last entry with it, which detects a deleted
    tail. Dataset chains keep their heads on the dataset row (``audit_seq``, ``audit_hash``).
    """

    __tablename__ = "audit_head"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(BigInteger)
    hash: Mapped[str] = mapped_column(HASH)


JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")


class Job(Base):
    """A training job (``service.ledger.jobs`` does all database work for jobs).

    A worker *claims* a job with a lease (``lease_owner``, ``lease_expires_at``) and keeps it by
    heartbeating; a ``running`` job whose lease expired is claimable again (``attempts`` + 1, up
    to ``max_attempts``). ``reservation_id``: the ledger reservation of the current attempt;
    ``epsilon_committed`` / ``delta_committed``: what its commits have turned into spend.
    ``cancel_requested_at``: a cancel of a running job, acted on by the worker that holds it.
    """

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint("status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')", name="status"),
        Index(None, "tenant_id", "created_at"),
        # The claim's scan: queued jobs and running ones (lease expiry is checked on those).
        Index(None, "status", "created_at"),
        # The fair claim's "when did this tenant last get a job" (max over the tenant's jobs).
        Index(None, "tenant_id", "claimed_at"),
        # Submit time: is the model name another dataset's?
        Index(None, "tenant_id", "model_name"),
    )

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"))
    algorithm: Mapped[str] = mapped_column(String(32))
    params: Mapped[dict[str, Any]]
    model_name: Mapped[str] = mapped_column(NAME)
    status: Mapped[str] = mapped_column(String(16))
    plan: Mapped[dict[str, Any] | None]
    progress_step: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    progress_total: Mapped[int | None] = mapped_column(Integer)
    epsilon_committed: Mapped[Decimal] = mapped_column(server_default=ZERO)
    delta_committed: Mapped[Decimal] = mapped_column(server_default=ZERO)
    metrics: Mapped[dict[str, Any] | None]
    # {"every", "points"}: the released iterates' metrics, step by step (service.ledger.jobs)
    metric_history: Mapped[dict[str, Any] | None]
    error: Mapped[dict[str, Any] | None]
    reservation_id: Mapped[str | None] = mapped_column(ForeignKey("reservations.id"))
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    max_attempts: Mapped[int] = mapped_column(Integer)
    cancel_requested_at: Mapped[datetime | None]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    claimed_at: Mapped[datetime | None]
    """The latest claim (``started_at`` is the first): tenants take turns by it."""
    finished_at: Mapped[datetime | None]


class ModelVersion(Base):
    """A published model version: immutable, and only ever inserted after the ledger committed
    its release, so every row has a committed certificate (``certificate_id``, unique).
    ``job_id`` and ``step`` are ``NULL`` for a version trained outside the service and registered
    against its release's certificate (``model_registry.register_external``)."""

    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("tenant_id", "name", "version"),)

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(NAME)
    version: Mapped[int] = mapped_column(Integer)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"), index=True)
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"))
    certificate_id: Mapped[str] = mapped_column(ForeignKey("certificates.id"), unique=True)
    step: Mapped[int | None] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]]
    artifact_path: Mapped[str] = mapped_column(String(1000))
    artifact_sha256: Mapped[str] = mapped_column(HASH)
    artifact_bytes: Mapped[int] = mapped_column(BigInteger)
    artifact_format: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime]
    # The architecture and preprocessing (``service.training.dp_sgd.DpSgdTrainer.model_spec``;
    # an external version: ``{"kind": "external", "architecture", "preprocessing"}``, free text);
    # NULL for versions published before it was recorded and for staged trainers' models.
    model_spec: Mapped[dict[str, Any] | None]


__all__ = [
    "JOB_STATUSES",
    "RESERVATION_STATUSES",
    "SCOPES",
    "ApiKey",
    "AuditEntry",
    "AuditHead",
    "Base",
    "Batch",
    "BatchRecord",
    "Certificate",
    "Dataset",
    "IdempotencyKey",
    "Job",
    "ModelVersion",
    "Release",
    "Reservation",
    "ReservationBatch",
    "ReservationTask",
    "SigningKeyRecord",
    "Task",
    "Tenant",
]
