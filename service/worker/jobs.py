"""Training jobs: the one module that does all database work for them.

A job is created ``queued`` (``create_job``), *claimed* by one worker with a lease (``claim``),
kept by heartbeats (``heartbeat``), and ended by the worker that holds the lease (``finish``):
``succeeded``, ``failed`` or ``cancelled``. A worker that shuts down hands its job back
(``release``: ``queued`` again).

Claim — one statement (procrastinate's shape):

* PostgreSQL: ``UPDATE jobs SET status = 'running', lease_owner = …, attempts = attempts + 1 …
  WHERE id = (SELECT id FROM jobs WHERE status = 'queued' OR (status = 'running' AND
  lease_expires_at < now) ORDER BY created_at, id LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING …``.
  Concurrent claimers skip the row another one has locked, and the row's lock is held until the
  claim commits, so one job is never handed to two workers.
* SQLite: the same statement inside ``BEGIN IMMEDIATE`` (``Database.session``): the write lock
  is taken before the row is chosen, so claims are serialised.

Leases. A lease is ``(lease_owner, attempts)``: every later write by the worker (``heartbeat``,
``record_reservation``, ``record_progress``, ``finish``) is conditional on both and on the job
still being ``running``; when another worker has re-claimed the job (after this lease expired),
the write matches no row and raises ``LeaseLost``, and the worker stops. A ``running`` job whose
lease expired is claimable again with ``attempts + 1``; the worker that claims an attempt past
``max_attempts`` fails the job instead of running it (``service.worker.gate``).

Cancel. A queued job is cancelled at once. A running one gets ``cancel_requested_at``; the
worker holding it sees that on its next heartbeat, stops, aborts the rest of the reservation
and finishes the job ``cancelled``. If that worker is gone, the next claim (after the lease
expires) does the same.

Job params. ``params`` is the job's whole document. Two keys belong to the job, not to the
trainer: ``data_source`` (required: the URI the worker loads after the reservation is granted,
``service.worker.data``) and ``model_name`` (optional: the registry name its versions are
published under; default ``<algorithm>-<dataset id>``). The rest are the trainer's params and
are validated by the trainer when the job runs (the trainer's validation imports torch, which
the API process does not load); an invalid one fails the job with the field named.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from accountant.exact import to_text
from service.db.base import utcnow
from service.db.models import Job, ModelVersion
from service.db.session import Database
from service.ledger import audit, idempotency
from service.ledger.datasets import load_dataset
from service.ledger.errors import Conflict, InvalidInput, NotFound
from service.worker.algorithms import TRAINERS

ALGORITHMS: Final = tuple(TRAINERS)
"""Algorithms a job can run (``service.worker.algorithms``)."""
JOB_KEYS: Final = ("data_source", "model_name")
"""Keys of ``params`` read by the job itself; the others are the trainer's."""
TERMINAL: Final = frozenset({"succeeded", "failed", "cancelled"})
DEFAULT_MAX_ATTEMPTS: Final = 3
MAX_PAGE: Final = 1000
MAX_PARAMS_KEYS: Final = 200
MAX_URI_LENGTH: Final = 2000
MODEL_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


class LeaseLost(Exception):
    """The job is no longer this worker's: re-claimed by another worker, or already finished."""

    def __init__(self, job_id: str, worker_id: str) -> None:
        super().__init__(f"worker {worker_id!r} no longer holds the lease of job {job_id!r}.")
        self.job_id = job_id
        self.worker_id = worker_id


@dataclass(frozen=True)
class Lease:
    """A claim: the job's id and the (owner, attempt) every later write is conditional on."""

    job_id: str
    worker_id: str
    attempt: int
    expires_at: datetime


@dataclass(frozen=True)
class ClaimedJob:
    """What a worker needs to run a claimed job."""

    lease: Lease
    tenant_id: str
    dataset_id: str
    algorithm: str
    params: dict[str, Any]
    model_name: str
    max_attempts: int
    reservation_id: str | None
    cancel_requested: bool

    @property
    def id(self) -> str:
        return self.lease.job_id

    @property
    def attempt(self) -> int:
        return self.lease.attempt


@dataclass(frozen=True)
class Heartbeat:
    """The answer to a heartbeat: the lease's new expiry and whether a cancel was requested."""

    expires_at: datetime
    cancel_requested: bool


# ---------------------------------------------------------------------------------------------
# Input
# ---------------------------------------------------------------------------------------------


def check_algorithm(algorithm: object) -> str:
    if algorithm in ALGORITHMS:
        assert isinstance(algorithm, str)
        return algorithm
    raise InvalidInput("algorithm", f"must be one of {list(ALGORITHMS)}. Found {algorithm!r}.")


def check_model_name(name: object, field: str = "params.model_name") -> str:
    if not isinstance(name, str) or MODEL_NAME.fullmatch(name) is None:
        raise InvalidInput(
            field,
            "must be 1-200 characters of letters, digits, '.', '_' or '-', starting with a letter "
            f"or digit. Found {name!r}.",
        )
    return name


def default_model_name(algorithm: str, dataset_id: str) -> str:
    return f"{algorithm}-{dataset_id}"


def check_params(params: object) -> dict[str, Any]:
    """The job's params document (job keys checked here; the trainer checks the rest)."""
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise InvalidInput("params", f"must be an object. Found {type(params).__name__}.")
    if len(params) > MAX_PARAMS_KEYS:
        raise InvalidInput("params", f"must have at most {MAX_PARAMS_KEYS} keys. Found {len(params)}.")
    for key in params:
        if not isinstance(key, str):
            raise InvalidInput("params", f"keys must be strings. Found {key!r}.")
    uri = params.get("data_source")
    if uri is None:
        raise InvalidInput(
            "params.data_source",
            "is required: the URI of the dataset's records (file://….npz, file://….csv, "
            "builtin:digits, ...).",
        )
    if not isinstance(uri, str) or len(uri) > MAX_URI_LENGTH:
        raise InvalidInput(
            "params.data_source", f"must be a URI string of at most {MAX_URI_LENGTH} characters."
        )
    from service.worker.data import DataSourceError, parse_source  # numpy only: no torch

    try:
        parse_source(uri)  # validates; reads nothing
    except DataSourceError as exc:
        raise InvalidInput("params.data_source", str(exc)) from None
    if params.get("model_name") is not None:
        check_model_name(params["model_name"])
    return dict(params)


def trainer_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The trainer's part of a job's params (without ``JOB_KEYS``)."""
    return {k: v for k, v in params.items() if k not in JOB_KEYS}


# ---------------------------------------------------------------------------------------------
# Answers
# ---------------------------------------------------------------------------------------------


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def job_json(row: Job, versions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "id": row.id,
        "dataset_id": row.dataset_id,
        "algorithm": row.algorithm,
        "params": row.params,
        "model_name": row.model_name,
        "status": row.status,
        "progress": {"step": row.progress_step, "total": row.progress_total},
        "epsilon_committed": to_text(row.epsilon_committed),
        "delta_committed": to_text(row.delta_committed),
        "metrics": row.metrics,
        "error": row.error,
        "reservation_id": row.reservation_id,
        "attempts": row.attempts,
        "max_attempts": row.max_attempts,
        "cancel_requested": row.cancel_requested_at is not None,
        "plan": row.plan,
        "versions": versions if versions is not None else [],
        "created_at": row.created_at.isoformat(),
        "updated_at": row.updated_at.isoformat(),
        "started_at": _iso(row.started_at),
        "finished_at": _iso(row.finished_at),
    }


def _versions_of(session: Session, job_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {j: [] for j in job_ids}
    if not job_ids:
        return out
    rows = session.execute(
        select(ModelVersion.job_id, ModelVersion.name, ModelVersion.version, ModelVersion.step)
        .where(ModelVersion.job_id.in_(job_ids))
        .order_by(ModelVersion.version)
    ).all()
    for r in rows:
        out[r.job_id].append({"name": r.name, "version": r.version, "step": r.step})
    return out


def _load_job(session: Session, tenant_id: str, job_id: str) -> Job:
    row = session.get(Job, job_id) if isinstance(job_id, str) and len(job_id) <= 64 else None
    if row is None or row.tenant_id != tenant_id:
        raise NotFound("job", job_id)
    return row


# ---------------------------------------------------------------------------------------------
# API operations
# ---------------------------------------------------------------------------------------------


def create_job(
    db: Database,
    tenant_id: str,
    *,
    dataset_id: str,
    algorithm: str,
    params: Mapping[str, Any] | None,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    idempotency_key: str | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """Queue a job (201). ``InvalidInput`` names a bad field; ``NotFound`` an unknown dataset."""
    if not isinstance(dataset_id, str) or not dataset_id or len(dataset_id) > 64:
        raise InvalidInput("dataset_id", f"must be a dataset id. Found {dataset_id!r}.")
    algorithm = check_algorithm(algorithm)
    document = check_params(params)
    model_name = document.get("model_name") or default_model_name(algorithm, dataset_id)

    def body(session: Session, at: datetime) -> idempotency.Outcome:
        load_dataset(session, tenant_id, dataset_id)
        row = Job(
            id=f"job_{secrets.token_hex(12)}",
            tenant_id=tenant_id,
            dataset_id=dataset_id,
            algorithm=algorithm,
            params=document,
            model_name=model_name,
            status="queued",
            progress_step=0,
            epsilon_committed=Decimal(0),
            delta_committed=Decimal(0),
            attempts=0,
            max_attempts=max_attempts,
            created_at=at,
            updated_at=at,
        )
        session.add(row)
        session.flush()
        event = audit.AuditEvent(
            "job.created",
            {"job_id": row.id, "algorithm": algorithm, "model_name": model_name},
            tenant_id=tenant_id,
            dataset_id=dataset_id,
        )
        return idempotency.Outcome(job_json(row), [event])

    return idempotency.execute(
        db,
        tenant_id=tenant_id,
        operation="create_job",
        request={"dataset_id": dataset_id, "algorithm": algorithm, "params": document},
        idempotency_key=idempotency_key,
        body=body,
        status_code=201,
        now=now,
    )


def get_job(db: Database, tenant_id: str, job_id: str) -> dict[str, Any]:
    """The job (another tenant's answers ``NotFound``)."""
    with db.session(readonly=True) as session:
        row = _load_job(session, tenant_id, job_id)
        return job_json(row, _versions_of(session, [row.id])[row.id])


def list_jobs(
    db: Database, tenant_id: str, *, dataset_id: str | None = None, limit: int = 100, offset: int = 0
) -> dict[str, Any]:
    """The tenant's jobs, newest first: ``{data, count}``."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidInput("limit", f"must be in [1, {MAX_PAGE}]. Found {limit}.")
    if offset < 0:
        raise InvalidInput("offset", f"must be >= 0. Found {offset}.")
    with db.session(readonly=True) as session:
        where = [Job.tenant_id == tenant_id]
        if dataset_id is not None:
            where.append(Job.dataset_id == dataset_id)
        rows = session.scalars(
            select(Job).where(*where).order_by(Job.created_at.desc(), Job.id).limit(limit).offset(offset)
        ).all()
        count = session.scalar(select(func.count()).select_from(Job).where(*where))
        versions = _versions_of(session, [r.id for r in rows])
        return {"data": [job_json(r, versions[r.id]) for r in rows], "count": count or 0}


def cancel_job(db: Database, tenant_id: str, job_id: str, *, now: datetime | None = None) -> dict[str, Any]:
    """Cancel: a queued job now; a running one when its worker next heartbeats (``cancel_requested``).

    Cancelling a cancelled job answers it unchanged; a succeeded or failed one is a ``Conflict``
    (``job_finished``).
    """
    at = now or utcnow()
    with db.session() as session:
        row = _load_job(session, tenant_id, job_id)
        if row.status in ("succeeded", "failed"):
            raise Conflict(
                f"job {job_id!r} is {row.status}; it cannot be cancelled.",
                reason="job_finished",
                status=row.status,
            )
        if row.status == "cancelled" or row.cancel_requested_at is not None:
            return job_json(row, _versions_of(session, [row.id])[row.id])
        if row.status == "queued":
            row.status = "cancelled"
            row.finished_at = at
            row.lease_owner = row.lease_expires_at = None
        row.cancel_requested_at = at
        row.updated_at = at
        session.flush()
        audit.append(
            session,
            [
                audit.AuditEvent(
                    "job.cancel_requested",
                    {"job_id": row.id, "status": row.status},
                    tenant_id=tenant_id,
                    dataset_id=row.dataset_id,
                )
            ],
            now=at,
        )
        return job_json(row, _versions_of(session, [row.id])[row.id])


# ---------------------------------------------------------------------------------------------
# Worker operations
# ---------------------------------------------------------------------------------------------

_CLAIMED_COLUMNS: Final = (
    Job.id,
    Job.tenant_id,
    Job.dataset_id,
    Job.algorithm,
    Job.params,
    Job.model_name,
    Job.attempts,
    Job.max_attempts,
    Job.reservation_id,
    Job.cancel_requested_at,
    Job.lease_expires_at,
)


def claim(db: Database, worker_id: str, lease_s: float, *, now: datetime | None = None) -> ClaimedJob | None:
    """Claim the oldest claimable job for ``worker_id`` for ``lease_s`` seconds (see the module
    docstring); ``None`` when there is none. One statement, one transaction."""
    at = now or utcnow()
    expires = at + timedelta(seconds=lease_s)
    claimable = (
        select(Job.id)
        .where(or_(Job.status == "queued", and_(Job.status == "running", Job.lease_expires_at < at)))
        .order_by(Job.created_at, Job.id)
        .limit(1)
        .with_for_update(skip_locked=True)  # SQLite: omitted; BEGIN IMMEDIATE serialises instead
        .scalar_subquery()
    )
    stmt = (
        update(Job)
        .where(Job.id == claimable)
        .values(
            status="running",
            lease_owner=worker_id,
            lease_expires_at=expires,
            heartbeat_at=at,
            attempts=Job.attempts + 1,
            started_at=func.coalesce(Job.started_at, at),
            updated_at=at,
        )
        .returning(*_CLAIMED_COLUMNS)
    )
    with db.session() as session:
        row = session.execute(stmt).one_or_none()
    if row is None:
        return None
    return ClaimedJob(
        lease=Lease(row.id, worker_id, row.attempts, row.lease_expires_at),
        tenant_id=row.tenant_id,
        dataset_id=row.dataset_id,
        algorithm=row.algorithm,
        params=dict(row.params),
        model_name=row.model_name,
        max_attempts=row.max_attempts,
        reservation_id=row.reservation_id,
        cancel_requested=row.cancel_requested_at is not None,
    )


def _held(lease: Lease) -> Any:
    return and_(
        Job.id == lease.job_id,
        Job.lease_owner == lease.worker_id,
        Job.attempts == lease.attempt,
        Job.status == "running",
    )


def heartbeat(
    db: Database,
    lease: Lease,
    lease_s: float,
    *,
    progress_step: int | None = None,
    now: datetime | None = None,
) -> Heartbeat:
    """Extend the lease by ``lease_s`` from now (and record the progress); ``LeaseLost`` if the
    job is no longer this lease's."""
    at = now or utcnow()
    expires = at + timedelta(seconds=lease_s)
    values: dict[str, Any] = {"lease_expires_at": expires, "heartbeat_at": at, "updated_at": at}
    if progress_step is not None:
        values["progress_step"] = progress_step
    with db.session() as session:
        row = session.execute(
            update(Job).where(_held(lease)).values(**values).returning(Job.cancel_requested_at)
        ).one_or_none()
    if row is None:
        raise LeaseLost(lease.job_id, lease.worker_id)
    return Heartbeat(expires, row.cancel_requested_at is not None)


def _update_held(db: Database, lease: Lease, values: dict[str, Any], now: datetime | None) -> None:
    values = {**values, "updated_at": now or utcnow()}
    with db.session() as session:
        done = session.execute(update(Job).where(_held(lease)).values(**values).returning(Job.id)).first()
    if done is None:
        raise LeaseLost(lease.job_id, lease.worker_id)


def record_plan(
    db: Database, lease: Lease, *, plan: dict[str, Any], total_steps: int, now: datetime | None = None
) -> None:
    """The attempt's training plan (computed before any data is read) and its step count."""
    _update_held(
        db,
        lease,
        {
            "plan": plan,
            "progress_total": total_steps,
            "progress_step": 0,
            "epsilon_committed": Decimal(0),
            "delta_committed": Decimal(0),
        },
        now,
    )


def record_reservation(
    db: Database, lease: Lease, reservation_id: str, *, now: datetime | None = None
) -> None:
    """The ledger reservation of this attempt (so a later attempt can abort what it holds)."""
    _update_held(db, lease, {"reservation_id": reservation_id}, now)


def record_progress(
    db: Database,
    lease: Lease,
    *,
    step: int,
    epsilon_committed: Decimal | None = None,
    delta_committed: Decimal | None = None,
    metrics: Mapping[str, Any] | None = None,
    now: datetime | None = None,
) -> None:
    values: dict[str, Any] = {"progress_step": step}
    if epsilon_committed is not None:
        values["epsilon_committed"] = epsilon_committed
    if delta_committed is not None:
        values["delta_committed"] = delta_committed
    if metrics is not None:
        values["metrics"] = dict(metrics)
    _update_held(db, lease, values, now)


def finish(
    db: Database,
    lease: Lease,
    status: str,
    *,
    metrics: Mapping[str, Any] | None = None,
    error: Mapping[str, Any] | None = None,
    now: datetime | None = None,
) -> None:
    """End the job (``succeeded``, ``failed`` or ``cancelled``) and drop the lease."""
    if status not in TERMINAL:
        raise ValueError(f"status must be one of {sorted(TERMINAL)}. Found {status!r}.")
    at = now or utcnow()
    values: dict[str, Any] = {
        "status": status,
        "finished_at": at,
        "lease_owner": None,
        "lease_expires_at": None,
        "updated_at": at,
    }
    if metrics is not None:
        values["metrics"] = dict(metrics)
    if error is not None:
        values["error"] = dict(error)
    with db.session() as session:
        row = session.execute(
            update(Job).where(_held(lease)).values(**values).returning(Job.tenant_id, Job.dataset_id)
        ).one_or_none()
        if row is None:
            raise LeaseLost(lease.job_id, lease.worker_id)
        audit.append(
            session,
            [
                audit.AuditEvent(
                    "job.finished",
                    {"job_id": lease.job_id, "status": status, "attempt": lease.attempt},
                    tenant_id=row.tenant_id,
                    dataset_id=row.dataset_id,
                )
            ],
            now=at,
        )


def ended_under(db: Database, lease: Lease) -> bool:
    """Whether the job left ``running`` under this lease (finished or handed back by its own
    worker, no later claim): a heartbeat that races the end of its job is not a lost lease."""
    with db.session(readonly=True) as session:
        row = session.execute(select(Job.status, Job.attempts).where(Job.id == lease.job_id)).one_or_none()
    return row is not None and row.status != "running" and row.attempts == lease.attempt


def release(db: Database, lease: Lease, *, now: datetime | None = None) -> None:
    """Hand the job back (the worker is shutting down): ``queued`` again, lease dropped.

    The attempt counts: a job that keeps being handed back ends ``failed`` after
    ``max_attempts`` like one whose worker crashed.
    """
    _update_held(db, lease, {"status": "queued", "lease_owner": None, "lease_expires_at": None}, now)


def lease_is_live(session: Session, job_id: str, at: datetime) -> bool:
    """Whether some worker holds an unexpired lease on the job (for the staging sweep)."""
    row = session.execute(select(Job.status, Job.lease_expires_at).where(Job.id == job_id)).one_or_none()
    if row is None:
        return False
    return bool(row.status == "running" and row.lease_expires_at is not None and row.lease_expires_at >= at)


__all__ = [
    "ALGORITHMS",
    "DEFAULT_MAX_ATTEMPTS",
    "JOB_KEYS",
    "ClaimedJob",
    "Heartbeat",
    "Lease",
    "LeaseLost",
    "cancel_job",
    "check_algorithm",
    "check_model_name",
    "check_params",
    "claim",
    "create_job",
    "default_model_name",
    "ended_under",
    "finish",
    "get_job",
    "heartbeat",
    "job_json",
    "lease_is_live",
    "list_jobs",
    "record_plan",
    "record_progress",
    "record_reservation",
    "release",
    "trainer_params",
]
