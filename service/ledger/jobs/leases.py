"""The worker's side of the job queue: a job is *claimed* by one worker with a lease (``claim``),
kept by heartbeats (``heartbeat``), and ended by the worker that holds the lease (``finish``):
``succeeded``, ``failed`` or ``cancelled``. A worker that shuts down hands its job back
(``release``: ``queued`` again).

Claim — one statement (procrastinate's shape), fair between tenants:

* PostgreSQL: ``UPDATE jobs SET status = 'running', lease_owner = …, attempts = attempts + 1,
  claimed_at = now … WHERE id = (SELECT id FROM jobs AS candidate WHERE status = 'queued' OR
  (status = 'running' AND lease_expires_at < now) ORDER BY <running jobs of the candidate's
  tenant>, <the tenant's last claim> NULLS FIRST, created_at, id LIMIT 1 FOR UPDATE OF candidate
  SKIP LOCKED) RETURNING …``. Concurrent claimers skip the row another one has locked, and the
  row's lock is held until the claim commits, so one job is never handed to two workers.
* SQLite: the same statement inside ``BEGIN IMMEDIATE`` (``Database.session``): the write lock
  is taken before the row is chosen, so claims are serialised.

  Tenants take turns: a tenant with fewer jobs running goes first, then the one whose last job
  was claimed longest ago (never: first), then the oldest job. So one tenant's queue of long jobs
  cannot keep another tenant's job waiting behind it: with tenant A's five jobs queued before
  tenant B's one, the second claim is B's. (Two claims racing on PostgreSQL both read the state
  before either commits, so they may both pick the same tenant; the next claim evens it out.)

Leases. A lease is ``(lease_owner, attempts)``: every later write by the worker (``heartbeat``,
``record_reservation``, ``record_progress``, ``finish``) is conditional on both and on the job
still being ``running``; when another worker has re-claimed the job (after this lease expired),
the write matches no row and raises ``LeaseLost``, and the worker stops. A ``running`` job whose
lease expired is claimable again with ``attempts + 1``; the worker that claims an attempt past
``max_attempts`` fails the job instead of running it (``service.worker.gate``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session, aliased

from service.db.base import utcnow
from service.db.models import Job
from service.db.session import Database
from service.ledger import audit
from service.ledger.jobs.queue import TERMINAL


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
    """The answer to a heartbeat: the lease's new expiry, whether a cancel was requested, and the
    attempt's reservation (``None`` before it reserved): the hold the worker keeps alive."""

    expires_at: datetime
    cancel_requested: bool
    reservation_id: str | None = None


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


def _claim_statement(worker_id: str, at: datetime, expires: datetime) -> Any:
    """The fair claim (module docstring): one ``UPDATE … WHERE id = (SELECT … FOR UPDATE SKIP
    LOCKED) RETURNING``, tenants ordered by their running jobs, then by their last claim."""
    candidate = aliased(Job, name="candidate")
    running = aliased(Job, name="running")
    claimed = aliased(Job, name="claimed")
    tenant_running = (
        select(func.count())
        .select_from(running)
        .where(
            running.tenant_id == candidate.tenant_id,
            running.status == "running",
            running.lease_expires_at >= at,
        )
        .scalar_subquery()
    )
    tenant_last_claim = (
        select(func.max(claimed.claimed_at)).where(claimed.tenant_id == candidate.tenant_id).scalar_subquery()
    )
    claimable = (
        select(candidate.id)
        .where(
            or_(
                candidate.status == "queued",
                and_(candidate.status == "running", candidate.lease_expires_at < at),
            )
        )
        .order_by(tenant_running, tenant_last_claim.asc().nulls_first(), candidate.created_at, candidate.id)
        .limit(1)
        # SQLite: FOR UPDATE is omitted; BEGIN IMMEDIATE serialises claims instead.
        .with_for_update(skip_locked=True, of=candidate)
        .scalar_subquery()
    )
    return (
        update(Job)
        .where(Job.id == claimable)
        .values(
            status="running",
            lease_owner=worker_id,
            lease_expires_at=expires,
            heartbeat_at=at,
            attempts=Job.attempts + 1,
            started_at=func.coalesce(Job.started_at, at),
            claimed_at=at,
            updated_at=at,
        )
        .returning(*_CLAIMED_COLUMNS)
    )


def claim(db: Database, worker_id: str, lease_s: float, *, now: datetime | None = None) -> ClaimedJob | None:
    """Claim the next job for ``worker_id`` for ``lease_s`` seconds, tenants taking turns (see the
    module docstring); ``None`` when there is none. One statement, one transaction."""
    at = now or utcnow()
    stmt = _claim_statement(worker_id, at, at + timedelta(seconds=lease_s))
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
            update(Job)
            .where(_held(lease))
            .values(**values)
            .returning(Job.cancel_requested_at, Job.reservation_id)
        ).one_or_none()
    if row is None:
        raise LeaseLost(lease.job_id, lease.worker_id)
    return Heartbeat(expires, row.cancel_requested_at is not None, row.reservation_id)


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
            "metric_history": None,  # an attempt trains from the start: its own curve
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


MAX_HISTORY_POINTS: Final = 200
"""The most points a job's ``metric_history`` keeps: past it, every other older point is
dropped (the first and the newest stay), so the curve keeps its span at a coarser step."""


def record_history(
    db: Database,
    lease: Lease,
    points: Sequence[Mapping[str, Any]],
    *,
    every: int,
    now: datetime | None = None,
) -> None:
    """Append ``points`` (``{"step", <metric>: number, ...}``, in step order) to the job's
    ``metric_history``. The worker calls it only after the ledger committed the steps they
    describe (``service.worker.gate``): nothing here is a statistic of steps whose cost could
    still be returned."""
    if not points:
        return
    with db.session() as session:
        stored = session.scalar(select(Job.metric_history).where(_held(lease)))
    found = stored.get("points") if isinstance(stored, dict) else None
    kept = list(found) if isinstance(found, list) else []
    kept.extend(dict(p) for p in points)
    while len(kept) > MAX_HISTORY_POINTS:
        kept = kept[:-1:2] + kept[-1:]
    _update_held(db, lease, {"metric_history": {"every": every, "points": kept}}, now)


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
    "MAX_HISTORY_POINTS",
    "ClaimedJob",
    "Heartbeat",
    "Lease",
    "LeaseLost",
    "claim",
    "ended_under",
    "finish",
    "heartbeat",
    "lease_is_live",
    "record_history",
    "record_plan",
    "record_progress",
    "record_reservation",
    "release",
]
