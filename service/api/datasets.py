"""Datasets, tasks and batches: ``/v1/datasets``.

Creating is ``admin``; reading is any scope. Another tenant's dataset answers 404 (the ledger
looks every id up within the caller's tenant). An admin declares the next plan segment of a
sequential ``prv`` budget (``POST /v1/datasets/{id}/plan-segments``,
``service.ledger.plan_segments``). A dataset's data source is an admin's too: set
when the dataset is created (``data_source``) or later (``PUT /v1/datasets/{id}/data-source``),
checked against the server's data roots for the caller's tenant (``LEDGER_DATA_ROOTS``).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Query, Request

from service.api import PREFIX
from service.api.deps import AdminDep, DatabaseDep, IdempotencyKeyDep, ViewerDep
from service.api.ratelimit import RATE_LIMITED, PricingRates
from service.api.schemas import (
    BatchesCreate,
    BatchesPublic,
    DatasetCreate,
    DatasetPublic,
    DatasetsPublic,
    DataSourceSet,
    ErrorBody,
    PlanSegmentCreate,
    PlanSegmentPublic,
    QuoteCreate,
    QuotePublic,
    TaskBatchesPublic,
    TaskCreate,
    TaskPublic,
    TasksPublic,
)
from service.contract.data_roots import DataRoots
from service.ledger import batches, datasets, plan_segments, quotes
from service.settings import Settings

router = APIRouter(prefix=PREFIX, tags=["datasets"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing, unknown or revoked API key"},
    403: {"model": ErrorBody, "description": "the key's scope does not allow this call"},
    404: {"model": ErrorBody, "description": "unknown id, or another tenant's"},
    422: {"model": ErrorBody, "description": "invalid input; `field` names it"},
}


@router.post(
    "/datasets",
    status_code=201,
    response_model=DatasetPublic,
    responses=_ERRORS,
    summary="Create a dataset with its privacy budget",
)
def create_dataset(
    body: DatasetCreate,
    principal: AdminDep,
    db: DatabaseDep,
    request: Request,
    idempotency_key: IdempotencyKeyDep = None,
) -> dict[str, Any]:
    return datasets.create_dataset(
        db,
        principal.tenant_id,
        name=body.name,
        budget=body.budget.model_dump(mode="json", exclude_none=True),
        data_source=body.data_source,
        data_roots=_data_roots(request),
        idempotency_key=idempotency_key,
    ).to_json()


def _data_roots(request: Request) -> DataRoots:
    settings: Settings = request.app.state.settings
    return DataRoots.of(settings)


@router.put(
    "/datasets/{dataset_id}/data-source",
    response_model=DatasetPublic,
    responses=_ERRORS,
    summary="Set, replace or remove (null) the dataset's data source (admin; audited)",
    description="The records every job on this dataset reads: a `builtin:` source, or a "
    "`file:///absolute/path` (.npz, .csv) that must be a regular file of at most "
    "`LEDGER_MAX_SOURCE_BYTES` under a data root the operator configured for the caller's tenant "
    "(`LEDGER_DATA_ROOTS`): otherwise 422 naming `data_source`. The worker checks the file again "
    "when it reads it. A change is appended to the dataset's audit chain "
    "(`dataset.data_source_set`); setting the current source again changes nothing.",
)
def set_data_source(
    dataset_id: str,
    body: DataSourceSet,
    principal: AdminDep,
    db: DatabaseDep,
    request: Request,
    idempotency_key: IdempotencyKeyDep = None,
) -> dict[str, Any]:
    return datasets.set_data_source(
        db,
        principal.tenant_id,
        dataset_id,
        data_source=body.data_source,
        data_roots=_data_roots(request),
        idempotency_key=idempotency_key,
    ).to_json()


@router.get(
    "/datasets",
    response_model=DatasetsPublic,
    responses=_ERRORS,
    summary="List datasets (or find one by name: ?name=)",
)
def list_datasets(
    principal: ViewerDep,
    db: DatabaseDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    name: Annotated[
        str | None,
        Query(
            max_length=200,
            description="only the dataset of this name, archived or not (names are unique per tenant)",
        ),
    ] = None,
    archived: Annotated[
        Literal["false", "true", "all"],
        Query(description="`false`: active datasets only (default); `true`: archived only; `all`"),
    ] = "false",
) -> dict[str, Any]:
    return datasets.list_datasets(
        db, principal.tenant_id, limit=limit, offset=offset, name=name, archived=archived
    ).to_json()


_ARCHIVE_ERRORS: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    409: {
        "model": ErrorBody,
        "description": "`dataset_in_use`: a reservation of the dataset is open, or a job is queued "
        "or running; nothing changes",
    },
}


@router.post(
    "/datasets/{dataset_id}/archive",
    response_model=DatasetPublic,
    responses=_ARCHIVE_ERRORS,
    summary="Archive the dataset: it takes no new work; its history stays (admin; audited)",
    description="A dataset is archived, never deleted: its audit chain is its history and its "
    "certificates keep verifying (`ledger check`, audit exports). Any dataset may be archived, "
    "charged or not: archiving only refuses — new reservations, plan segments, jobs, quotes, tasks "
    "and batches get 409 `dataset_archived` naming it — and never frees budget or changes spend. "
    "Hidden from `GET /v1/datasets` unless `?archived=true` (or `all`); still readable by id. "
    "Appended to the audit chain (`dataset.archived`); archiving an archived dataset changes "
    "nothing.",
)
def archive_dataset(
    dataset_id: str, principal: AdminDep, db: DatabaseDep, idempotency_key: IdempotencyKeyDep = None
) -> dict[str, Any]:
    return datasets.set_archived(
        db, principal.tenant_id, dataset_id, archived=True, idempotency_key=idempotency_key
    ).to_json()


@router.post(
    "/datasets/{dataset_id}/unarchive",
    response_model=DatasetPublic,
    responses=_ARCHIVE_ERRORS,
    summary="Make an archived dataset active again, exactly as it was (admin; audited)",
    description="Appended to the audit chain (`dataset.unarchived`); unarchiving an active "
    "dataset changes nothing.",
)
def unarchive_dataset(
    dataset_id: str, principal: AdminDep, db: DatabaseDep, idempotency_key: IdempotencyKeyDep = None
) -> dict[str, Any]:
    return datasets.set_archived(
        db, principal.tenant_id, dataset_id, archived=False, idempotency_key=idempotency_key
    ).to_json()


@router.get(
    "/datasets/{dataset_id}",
    response_model=DatasetPublic,
    responses=_ERRORS,
    summary="Get a dataset and its budget",
)
def get_dataset(dataset_id: str, principal: ViewerDep, db: DatabaseDep) -> dict[str, Any]:
    return datasets.get_dataset(db, principal.tenant_id, dataset_id).to_json()


@router.post(
    "/datasets/{dataset_id}/tasks",
    status_code=201,
    response_model=TaskPublic,
    responses=_ERRORS,
    summary="Register a task of the dataset",
    description="A dataset holds at most 10 000 tasks: one more is a 409 `conflict` with reason "
    "`too_many_tasks`.",
)
def create_task(
    dataset_id: str,
    body: TaskCreate,
    principal: AdminDep,
    db: DatabaseDep,
    idempotency_key: IdempotencyKeyDep = None,
) -> dict[str, Any]:
    return batches.create_task(
        db, principal.tenant_id, dataset_id, name=body.name, idempotency_key=idempotency_key
    ).to_json()


_DELETE_ERRORS: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    409: {
        "model": ErrorBody,
        "description": "`charged`: a batch was charged or is held (naming it; spend is never "
        "undone), or `dataset_in_use`: a job of the dataset is queued or running",
    },
}


@router.delete(
    "/datasets/{dataset_id}/tasks/{task_id}",
    responses=_DELETE_ERRORS,
    summary="Delete a task nothing was ever charged on (with its batches and records; audited)",
)
def delete_task(
    dataset_id: str,
    task_id: str,
    principal: AdminDep,
    db: DatabaseDep,
    idempotency_key: IdempotencyKeyDep = None,
) -> dict[str, Any]:
    return batches.delete_task(
        db, principal.tenant_id, dataset_id, task_id, idempotency_key=idempotency_key
    ).to_json()


@router.delete(
    "/datasets/{dataset_id}/tasks/{task_id}/batches/{batch_id}",
    responses=_DELETE_ERRORS,
    summary="Delete a batch nothing was ever charged on (with its records; audited)",
)
def delete_batch(
    dataset_id: str,
    task_id: str,
    batch_id: str,
    principal: AdminDep,
    db: DatabaseDep,
    idempotency_key: IdempotencyKeyDep = None,
) -> dict[str, Any]:
    return batches.delete_batch(
        db, principal.tenant_id, dataset_id, task_id, batch_id, idempotency_key=idempotency_key
    ).to_json()


@router.get(
    "/datasets/{dataset_id}/tasks",
    response_model=TasksPublic,
    responses=_ERRORS,
    summary="List the dataset's tasks, page by page",
    description="Oldest first; `limit` (default 100, at most 1000) from `offset`; `count` is every "
    "task of the dataset (at most 10 000 a dataset).",
)
def list_tasks(
    dataset_id: str,
    principal: ViewerDep,
    db: DatabaseDep,
    limit: Annotated[int, Query(ge=1, le=batches.MAX_TASK_PAGE)] = batches.DEFAULT_TASK_PAGE,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
) -> dict[str, Any]:
    return batches.list_tasks(db, principal.tenant_id, dataset_id, limit=limit, offset=offset).to_json()


@router.post(
    "/datasets/{dataset_id}/tasks/{task_id}/batches",
    status_code=201,
    response_model=BatchesPublic,
    responses={
        **_ERRORS,
        409: {
            "model": ErrorBody,
            "description": "`batch_overlap`: `record_id` names the first "
            "record already in a batch of this dataset",
        },
    },
    summary="Create fixed, disjoint batches of a task (immutable once created)",
)
def create_batches(
    dataset_id: str,
    task_id: str,
    body: BatchesCreate,
    principal: AdminDep,
    db: DatabaseDep,
    idempotency_key: IdempotencyKeyDep = None,
) -> dict[str, Any]:
    return batches.create_batches(
        db,
        principal.tenant_id,
        dataset_id,
        task_id,
        batches=[batch.model_dump(mode="json") for batch in body.batches],
        idempotency_key=idempotency_key,
    ).to_json()


@router.get(
    "/datasets/{dataset_id}/tasks/{task_id}/batches",
    response_model=TaskBatchesPublic,
    responses=_ERRORS,
    summary="List a task's batches with their spend, page by page",
    description="In position order, `limit` batches (default 1000, at most 10 000) whose "
    "`position` is above `after` (the `next` of the previous page; omitted: from the first). "
    "`next` is null on the last page; `count` is every batch of the task.",
)
def list_batches(
    dataset_id: str,
    task_id: str,
    principal: ViewerDep,
    db: DatabaseDep,
    after: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    limit: Annotated[int, Query(ge=1, le=batches.MAX_BATCH_PAGE)] = batches.DEFAULT_BATCH_PAGE,
) -> dict[str, Any]:
    page = batches.task_batches(db, principal.tenant_id, dataset_id, task_id, after=after, limit=limit)
    return page.to_json()


@router.post(
    "/datasets/{dataset_id}/quote",
    response_model=QuotePublic,
    responses={**_ERRORS, **RATE_LIMITED},
    summary="What a charge would cost on this dataset (dry run: nothing held)",
    description="Prices `event` on exactly one target — `batches`, `tasks`, or `new_batch: true` "
    "(a new, empty batch) — under the dataset's own budget, exactly as a reservation would, and "
    "holds nothing. Priced once per state class (batches in one state cost the same): `classes` "
    "lists each class's batch count, a sample `batch_id`, its cost and whether it is admitted, "
    "`limit` at a time from `offset` (`next_offset`); `totals` counts batches and classes. "
    "`admitted` says whether a reservation would be admitted now; `refused` carries the 409 it "
    "would get (`budget_exceeded` with `requested` and `remaining`). Calibrate noise to `cost`: it "
    "is what this dataset charges, which a Rényi filter's δ split can make larger than another "
    "accountant's figure. Metered by its work (the event's, plus the budget's orders per class; "
    "`LEDGER_MAX_PRICING_WORK`, 429) and priced in the pricing threads. `accountants` is "
    "informational: what the event would cost as the first charge on a new batch of a budget "
    "with this rule, epsilon and delta under each accountant (`basic`, `rdp`, `prv` — on "
    "`sequential` a declared plan of the event alone — and `tight`), and which one this "
    "dataset's budget `uses`; the budget never changes accountant.",
)
async def quote(
    dataset_id: str, body: QuoteCreate, principal: ViewerDep, db: DatabaseDep, request: Request
) -> dict[str, Any]:
    rates: PricingRates = request.app.state.pricing
    policy = rates.policy(principal.tenant_id)
    run = functools.partial(
        quotes.quote,
        db,
        principal.tenant_id,
        dataset_id,
        event=body.parsed_event,
        batch_ids=None if body.batches is None else [str(i) for i in body.batches],
        task_ids=None if body.tasks is None else [str(i) for i in body.tasks],
        new_batch=body.new_batch is True,
        noise_commitment=body.noise_commitment,
        policy=policy,
        limit=body.limit,
        offset=body.offset,
        accountants=body.accountants,
    )
    # In the pricing threads, never the threads every other route runs in (a tenant's quotes
    # cannot slow another tenant's reads).
    answer = await anyio.to_thread.run_sync(run, limiter=policy.limiter)
    return answer.to_json()


@router.post(
    "/datasets/{dataset_id}/plan-segments",
    status_code=201,
    response_model=PlanSegmentPublic,
    responses={
        **_ERRORS,
        **RATE_LIMITED,
        409: {
            "model": ErrorBody,
            "description": "`plan_step_pending`: a reservation of the dataset is open; nothing changes",
        },
    },
    summary="Declare the next plan segment of a sequential prv budget (admin; audited)",
    description="Prices `plan` with PRV at `delta`, a share of the budget's delta, and makes it the "
    "open segment: reservations then run its entries in order. Segments compose by basic "
    "composition, valid when each is chosen after seeing what earlier ones released (Rogers, Roth, "
    "Ullman & Vadhan 2016, Thm. 3.6): refused (422 naming `plan` or `delta`) unless the segments' "
    "epsilons and deltas sum to at most the budget's. Declaring closes the open segment: every "
    "batch that ran any of it is charged its whole epsilon and delta.",
)
async def declare_plan_segment(
    dataset_id: str,
    body: PlanSegmentCreate,
    principal: AdminDep,
    request: Request,
    idempotency_key: IdempotencyKeyDep = None,
) -> dict[str, Any]:
    rates: PricingRates = request.app.state.pricing
    plan_segments.check_plan_size(body.plan)  # its message quotes the body as sent
    declared = await plan_segments.declare_segment_async(
        request.app.state.database,
        principal.tenant_id,
        dataset_id,
        plan=body.parsed_plan,
        delta=str(body.delta),
        idempotency_key=idempotency_key,
        policy=rates.policy(principal.tenant_id),
    )
    return declared.to_json()
