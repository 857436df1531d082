"""Datasets, tasks and batches: ``/v1/datasets``.

Creating is ``admin``; reading is any scope. Another tenant's dataset answers 404 (the ledger
looks every id up within the caller's tenant).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from service.api import PREFIX
from service.api.deps import AdminDep, DatabaseDep, IdempotencyKeyDep, ViewerDep
from service.api.schemas import (
    BatchesCreate,
    BatchesPublic,
    DatasetCreate,
    DatasetPublic,
    DatasetsPublic,
    ErrorBody,
    TaskCreate,
    TaskPublic,
    TasksPublic,
)
from service.ledger import batches, datasets

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
    body: DatasetCreate, principal: AdminDep, db: DatabaseDep, idempotency_key: IdempotencyKeyDep = None
) -> dict[str, Any]:
    return datasets.create_dataset(
        db,
        principal.tenant_id,
        name=body.name,
        budget=body.budget.model_dump(mode="json", exclude_none=True),
        idempotency_key=idempotency_key,
    )


@router.get("/datasets", response_model=DatasetsPublic, responses=_ERRORS, summary="List datasets")
def list_datasets(
    principal: ViewerDep,
    db: DatabaseDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
) -> dict[str, Any]:
    return datasets.list_datasets(db, principal.tenant_id, limit=limit, offset=offset)


@router.get(
    "/datasets/{dataset_id}",
    response_model=DatasetPublic,
    responses=_ERRORS,
    summary="Get a dataset and its budget",
)
def get_dataset(dataset_id: str, principal: ViewerDep, db: DatabaseDep) -> dict[str, Any]:
    return datasets.get_dataset(db, principal.tenant_id, dataset_id)


@router.post(
    "/datasets/{dataset_id}/tasks",
    status_code=201,
    response_model=TaskPublic,
    responses=_ERRORS,
    summary="Register a task of the dataset",
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
    )


@router.get(
    "/datasets/{dataset_id}/tasks",
    response_model=TasksPublic,
    responses=_ERRORS,
    summary="List the dataset's tasks",
)
def list_tasks(dataset_id: str, principal: ViewerDep, db: DatabaseDep) -> dict[str, Any]:
    return batches.list_tasks(db, principal.tenant_id, dataset_id)


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
    )


@router.get(
    "/datasets/{dataset_id}/tasks/{task_id}/batches",
    response_model=BatchesPublic,
    responses=_ERRORS,
    summary="List a task's batches with their spend",
)
def list_batches(dataset_id: str, task_id: str, principal: ViewerDep, db: DatabaseDep) -> dict[str, Any]:
    return batches.list_batches(db, principal.tenant_id, dataset_id, task_id=task_id)
