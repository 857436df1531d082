"""The job queue's API operations: ``create_job`` (``queued``), ``get_job``, ``list_jobs``,
``cancel_job``.

Cancel. A queued job is cancelled at once. A running one gets ``cancel_requested_at``; the
worker holding it sees that on its next heartbeat, stops, aborts the rest of the reservation
and finishes the job ``cancelled``. If that worker is gone, the next claim (after the lease
expires) does the same.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import func, select
from sqlalchemy.orm import Session, defer

from accountant.exact import to_text
from accountant.rules import BatchState
from service.contract import job_params
from service.db.base import utcnow
from service.db.models import Batch, BatchStateRow, Dataset, Job, Release, Tenant
from service.db.session import Database
from service.ledger import audit, idempotency
from service.ledger.datasets import can_be_id, load_dataset, refuse_archived
from service.ledger.errors import ChargeRefused, Conflict, InvalidInput, NotFound
from service.ledger.jobs.answers import (
    MAX_LISTED_VERSIONS,
    JobAnswer,
    JobDetail,
    JobsPage,
    answer_one,
    select_jobs,
    versions_of,
)
from service.ledger.jobs.params import (
    DEFAULT_LIMITS,
    SET_SOURCE,
    JobLimits,
    check_algorithm,
    check_document,
    check_json_text,
    check_params,
    default_model_name,
    shown,
)
from service.ledger.spending.store import EFFECTIVE_STATE

TERMINAL: Final = frozenset({"succeeded", "failed", "cancelled"})


ACTIVE: Final = ("queued", "running")


DEFAULT_MAX_ATTEMPTS: Final = 3


MAX_PAGE: Final = 100


class ModelNameTaken(Conflict):
    """The job's model name belongs to another dataset (its versions would interleave)."""

    code = "model_name_taken"


class TooManyQueuedJobs(Conflict):
    """The tenant already has ``LEDGER_MAX_QUEUED_JOBS_PER_TENANT`` jobs queued."""

    code = "too_many_queued_jobs"


def _load_job(session: Session, tenant_id: str, job_id: str) -> Job:
    row = (
        session.execute(
            select(Job).where(Job.id == job_id, Job.tenant_id == tenant_id).options(defer(Job.params))
        ).scalar_one_or_none()
        if can_be_id(job_id)
        else None
    )
    if row is None:
        raise NotFound("job", job_id)
    return row


def _check_dataset_can_train(session: Session, dataset: Dataset) -> None:
    """A job on ``dataset`` could run: it has a data source and batches (422 ``dataset_id``)."""
    if dataset.data_source is None:
        raise InvalidInput(
            "dataset_id",
            f"dataset {dataset.id!r} has no data source: {SET_SOURCE}, then queue the job.",
        )
    if session.scalar(select(Batch.id).where(Batch.dataset_id == dataset.id).limit(1)) is None:
        raise InvalidInput(
            "dataset_id",
            f"dataset {dataset.id!r} has no batches to train on: register its tasks' batches "
            "(POST /v1/datasets/{id}/tasks/{task_id}/batches), then queue the job.",
        )


def _check_batch_size(session: Session, dataset: Dataset, parsed: Any) -> None:
    """422 naming the param when the trainer's params refuse the dataset's largest batch
    (``check_batch_size``: a run whose noise would leave the model at chance, e.g. L2DP-ML)."""
    check = getattr(parsed, "check_batch_size", None)
    if check is None:
        return
    largest = session.scalar(select(func.max(Batch.size)).where(Batch.dataset_id == dataset.id))
    try:
        check(int(largest or 0))
    except job_params.InvalidParamsError as exc:
        raise InvalidInput(exc.field, exc.message) from None


def _check_delta_is_the_budgets(dataset: Dataset, algorithm: str, document: Mapping[str, Any]) -> None:
    """422 ``params.delta`` when a job names a δ other than its budget's (issue 28 §5): the ledger
    certifies every charge at the budget's δ, so a σ calibrated at another δ would be reported at
    one and certified at the other. Absent, the worker uses the budget's. Not for
    ``dp_sgd_audit``, whose ``delta`` is the δ its one-run audit states its bounds at (its charge
    is certified at the budget's δ all the same)."""
    if algorithm == "dp_sgd_audit":
        return
    delta = document.get("delta")
    if delta is None or isinstance(delta, bool) or not isinstance(delta, int | float):
        return  # absent, or the params check names what is wrong with it
    budget_delta = Decimal(str(dataset.budget["delta"]))
    if Decimal(repr(float(delta))) != budget_delta:
        raise InvalidInput(
            "params.delta",
            f"must be the dataset's budget delta, {to_text(budget_delta)}, at which the ledger "
            f"certifies every charge (or be left out to use it). Found {delta!r}.",
        )


MAX_NAMED_BATCHES: Final = 10


def _check_parallel_batches_unread(session: Session, dataset: Dataset) -> None:
    """409 ``batch_already_read`` when a job would read a batch of a ``parallel`` budget that a
    reservation read already (issue 28 §8): every job reads every task's batches, and the rule
    lets each batch be read once, so the worker would refuse the run. Decided on the distinct
    batch states (a handful), naming up to ``MAX_NAMED_BATCHES`` of the batches."""
    if dataset.budget.get("rule") != "parallel":
        return
    state_ids = session.scalars(
        select(EFFECTIVE_STATE).where(Batch.dataset_id == dataset.id).distinct()
    ).all()
    if not state_ids:
        return
    rows = session.execute(
        select(BatchStateRow.id, BatchStateRow.state).where(BatchStateRow.id.in_(state_ids))
    )
    read = [sid for sid, state in rows if BatchState.from_json(state).reads > 0]
    if not read:
        return
    where = (Batch.dataset_id == dataset.id, EFFECTIVE_STATE.in_(read))
    count = session.scalar(select(func.count()).select_from(Batch).where(*where)) or 0
    named = list(session.scalars(select(Batch.id).where(*where).order_by(Batch.id).limit(MAX_NAMED_BATCHES)))
    refusal = ChargeRefused(
        "batch_already_read",
        f"dataset {dataset.id!r} has a parallel budget and {count} of its batches were read "
        f"already ({', '.join(named)}{', ...' if count > len(named) else ''}); a job reads every "
        "batch of the dataset and the parallel rule (assumption S2) lets each be read once. "
        "Register the new data as new batches of a new dataset (or tasks of one not yet read).",
        batch_id=named[0],
    )
    refusal.details.update(field="dataset_id", batches=named, batches_read=count)
    raise refusal


def _check_model_name_free(session: Session, tenant_id: str, dataset_id: str, model_name: str) -> None:
    """409 ``model_name_taken`` when another dataset released versions of ``model_name`` or has a
    queued or running job that will (module docstring)."""
    released = session.execute(
        select(Release.dataset_id, Release.version)
        .where(Release.tenant_id == tenant_id, Release.model == model_name, Release.dataset_id != dataset_id)
        .limit(1)
    ).first()
    if released is not None:
        raise ModelNameTaken(
            f"model {model_name!r} version {released.version!r} was released from dataset "
            f"{released.dataset_id!r}; this job's versions of {model_name!r} (from dataset "
            f"{dataset_id!r}) would be numbered among them. Choose another params.model_name.",
            reason="model_name_taken",
            model=model_name,
            version=released.version,
            dataset_id=released.dataset_id,
        )
    pending = session.execute(
        select(Job.id, Job.dataset_id)
        .where(
            Job.tenant_id == tenant_id,
            Job.model_name == model_name,
            Job.dataset_id != dataset_id,
            Job.status.in_(ACTIVE),
        )
        .limit(1)
    ).first()
    if pending is not None:
        raise ModelNameTaken(
            f"job {pending.id!r} of dataset {pending.dataset_id!r} will publish versions of model "
            f"{model_name!r}; this job's versions (from dataset {dataset_id!r}) would be numbered "
            "among them. Choose another params.model_name.",
            reason="model_name_taken",
            model=model_name,
            job_id=pending.id,
            dataset_id=pending.dataset_id,
        )


def _check_queue(session: Session, tenant_id: str, limits: JobLimits) -> None:
    queued = session.scalar(
        select(func.count()).select_from(Job).where(Job.tenant_id == tenant_id, Job.status == "queued")
    )
    if (queued or 0) >= limits.max_queued_per_tenant:
        raise TooManyQueuedJobs(
            f"the tenant has {queued} jobs queued, the most it may (LEDGER_MAX_QUEUED_JOBS_PER_TENANT = "
            f"{limits.max_queued_per_tenant}); queue more once some have started, or cancel some.",
            reason="too_many_queued_jobs",
            queued=queued,
            limit=limits.max_queued_per_tenant,
        )


def create_job(
    db: Database,
    tenant_id: str,
    *,
    dataset_id: str,
    algorithm: str,
    params: Mapping[str, Any] | None,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    idempotency_key: str | None = None,
    limits: JobLimits = DEFAULT_LIMITS,
    now: datetime | None = None,
) -> JobAnswer:
    """Queue a job (201). Refused, nothing is stored: ``InvalidInput`` (422) names a bad field —
    the document, a trainer param, a dataset without a source or batches, a ``params.delta``
    other than the budget's; ``NotFound`` an unknown dataset (checked before the params);
    ``ChargeRefused`` (``batch_already_read``) a parallel dataset whose batches were read;
    ``Conflict`` a model name another dataset's (``model_name_taken``) or a full queue
    (``too_many_queued_jobs``)."""
    if not isinstance(dataset_id, str) or not dataset_id or len(dataset_id) > 64:
        raise InvalidInput("dataset_id", f"must be a dataset id. Found {shown(dataset_id)}.")
    check_json_text(dataset_id, "dataset_id")
    algorithm = check_algorithm(algorithm)
    document = check_document(params)
    job_id = f"job_{secrets.token_hex(12)}"
    model_name = document.get("model_name") or default_model_name(algorithm, job_id)

    def body(session: Session, at: datetime) -> idempotency.Outcome[JobAnswer]:
        # One job creation per tenant at a time (SQLite: BEGIN IMMEDIATE already), so the queue
        # count and the model-name check hold until the row is in. FOR NO KEY UPDATE: spends'
        # inserts referencing the tenant (FOR KEY SHARE) do not wait for it.
        session.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update(key_share=True))
        dataset = load_dataset(session, tenant_id, dataset_id)
        # Unknown dataset first (404), then the params (422): an id that names nothing says
        # nothing about its params.
        parsed = check_params(algorithm, document, limits)
        refuse_archived(dataset_id, dataset.archived_at)
        _check_dataset_can_train(session, dataset)
        _check_batch_size(session, dataset, parsed)
        _check_delta_is_the_budgets(dataset, algorithm, document)
        _check_parallel_batches_unread(session, dataset)
        _check_model_name_free(session, tenant_id, dataset_id, model_name)
        _check_queue(session, tenant_id, limits)
        row = Job(
            id=job_id,
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
        return idempotency.Outcome(JobAnswer.of(row), [event])

    return idempotency.execute(
        db,
        tenant_id=tenant_id,
        operation="create_job",
        request={"dataset_id": dataset_id, "algorithm": algorithm, "params": document},
        idempotency_key=idempotency_key,
        body=body,
        replay=JobAnswer.from_json,
        status_code=201,
        now=now,
    )


def get_job(db: Database, tenant_id: str, job_id: str) -> JobDetail:
    """The job (another tenant's answers ``NotFound``), with all its versions."""
    with db.session(readonly=True) as session:
        return answer_one(session, tenant_id, job_id)


def list_jobs(
    db: Database, tenant_id: str, *, dataset_id: str | None = None, limit: int = 100, offset: int = 0
) -> JobsPage:
    """The tenant's jobs, newest first: ``{data, count}`` (page bounds: module docstring)."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidInput("limit", f"must be in [1, {MAX_PAGE}]. Found {limit}.")
    if offset < 0:
        raise InvalidInput("offset", f"must be >= 0. Found {offset}.")
    with db.session(readonly=True) as session:
        where = [Job.tenant_id == tenant_id]
        if dataset_id is not None:
            where.append(Job.dataset_id == dataset_id)
        found = session.execute(
            select_jobs(*where).order_by(Job.created_at.desc(), Job.id).limit(limit).offset(offset)
        ).all()
        count = session.scalar(select(func.count()).select_from(Job).where(*where))
        versions, totals = versions_of(session, [r[0].id for r in found], most=MAX_LISTED_VERSIONS)
        data = tuple(
            JobAnswer.of(
                r[0],
                versions[r[0].id],
                params=r.bounded_params,
                params_bytes=r.params_bytes,
                versions_total=totals[r[0].id],
            )
            for r in found
        )
        return JobsPage(data, count or 0)


def cancel_job(db: Database, tenant_id: str, job_id: str, *, now: datetime | None = None) -> JobDetail:
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
            return answer_one(session, tenant_id, job_id)
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
        return answer_one(session, tenant_id, job_id)


__all__ = [
    "ACTIVE",
    "DEFAULT_MAX_ATTEMPTS",
    "MAX_NAMED_BATCHES",
    "MAX_PAGE",
    "TERMINAL",
    "ModelNameTaken",
    "TooManyQueuedJobs",
    "cancel_job",
    "create_job",
    "get_job",
    "list_jobs",
]
