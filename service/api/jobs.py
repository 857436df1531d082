"""Training jobs: ``POST /v1/jobs``, ``GET /v1/jobs``, ``GET /v1/jobs/{id}``,
``POST /v1/jobs/{id}/cancel``.

``trainer`` (or ``admin``) creates and cancels jobs; any scope reads. A job runs on a worker
(``ledger worker``, or the one ``ledger serve`` runs in-process), which reserves the run's cost
before it reads data and commits before it publishes each model version
(``service.worker.gate``). Another tenant's job answers 404.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from service.api import PREFIX
from service.api.deps import DatabaseDep, IdempotencyKeyDep, TrainerDep, ViewerDep
from service.api.responses import documented, json_answer
from service.api.schemas import ErrorBody
from service.worker import jobs

router = APIRouter(prefix=PREFIX, tags=["jobs"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing, unknown or revoked API key"},
    403: {"model": ErrorBody, "description": "the key's scope does not allow this call"},
    404: {"model": ErrorBody, "description": "unknown id, or another tenant's"},
    422: {"model": ErrorBody, "description": "invalid input; `field` names it"},
}


class JobCreate(BaseModel):
    """A job: train ``algorithm`` on the dataset's batches with ``params``.

    ``params.data_source`` (required) names the records (``builtin:digits``, ``file://….npz``,
    ``file://….csv``, ...); ``params.model_name`` the registry name of its versions (default
    ``<algorithm>-<dataset id>``); the other params are the trainer's (``target_epsilon`` and
    ``delta`` or ``noise_multiplier``, ``epochs`` or ``steps``, ``expected_batch_size``,
    ``checkpoint_every``, ``model``, ...).
    """

    model_config = ConfigDict(extra="forbid")

    dataset_id: str = Field(min_length=1, max_length=64)
    algorithm: str = Field(
        description="the algorithms a worker runs now (others of the contract: a later release)",
        json_schema_extra={"enum": list(jobs.ALGORITHMS)},
    )
    params: dict[str, Any] = Field(
        description="`data_source` (required) and `model_name` are the job's; the rest are the "
        "trainer's, checked when the job runs (a bad one fails the job, naming the field). The "
        "schema's `data_source` is the common shape; the service also takes the other builtins "
        "with their query (`builtin:split-digits?tasks=5`, ...).",
        json_schema_extra={
            "required": ["data_source"],
            "maxProperties": jobs.MAX_PARAMS_KEYS,
            "properties": {
                "data_source": {
                    "type": "string",
                    "maxLength": jobs.MAX_URI_LENGTH,
                    "pattern": r"^(builtin:digits|file://[^?#%\[\]]*[^?#%\[\]/.][^?#%\[\]/]*\.(npz|csv))$",
                },
                "model_name": {
                    "anyOf": [
                        {"type": "string", "pattern": "^" + jobs.MODEL_NAME.pattern + "$"},
                        {"type": "null"},
                    ]
                },
            },
        },
    )

    @field_validator("params")
    @classmethod
    def _data_source_is_a_uri(cls, params: dict[str, Any]) -> dict[str, Any]:
        # urlsplit raises ValueError on a bracket outside an IPv6 host ("file://[x.npz"), which
        # the worker's parse_source lets through (it was answered 500): refuse it here, naming
        # the field, before the job is queued.
        source = params.get("data_source")
        if isinstance(source, str):
            try:
                urlsplit(source)
            except ValueError as exc:
                raise PydanticCustomError(
                    "invalid_event",  # (a message of our own, naming its field)
                    "{message}",
                    {"field": "data_source", "message": f"must be a URI ({exc}). Found {source!r}."},
                ) from None
        return params


class JobProgress(BaseModel):
    step: int
    total: int | None


class JobPublic(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    dataset_id: str
    algorithm: str
    status: str = Field(description="queued | running | succeeded | failed | cancelled")
    progress: JobProgress
    epsilon_committed: str
    metrics: dict[str, Any] | None
    error: dict[str, Any] | None
    versions: list[dict[str, Any]]


class JobsPublic(BaseModel):
    model_config = ConfigDict(extra="allow")

    data: list[JobPublic]
    count: int


@router.post(
    "/jobs",
    status_code=201,
    response_model=None,
    responses={201: documented(JobPublic, "queued"), **_ERRORS},
    summary="Queue a training job",
)
def create_job(
    body: JobCreate,
    principal: TrainerDep,
    db: DatabaseDep,
    idempotency_key: IdempotencyKeyDep = None,
) -> JSONResponse:
    answer = jobs.create_job(
        db,
        principal.tenant_id,
        dataset_id=body.dataset_id,
        algorithm=body.algorithm,
        params=body.params,
        idempotency_key=idempotency_key,
    )
    return json_answer(answer, 201)


@router.get(
    "/jobs",
    response_model=None,
    responses={200: documented(JobsPublic, "the tenant's jobs, newest first"), **_ERRORS},
    summary="List jobs",
)
def list_jobs(
    principal: ViewerDep,
    db: DatabaseDep,
    dataset_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=jobs.MAX_PAGE)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
) -> JSONResponse:
    return json_answer(
        jobs.list_jobs(db, principal.tenant_id, dataset_id=dataset_id, limit=limit, offset=offset)
    )


@router.get(
    "/jobs/{job_id}",
    response_model=None,
    responses={200: documented(JobPublic, "status, progress, ε committed, metrics"), **_ERRORS},
    summary="Get a job",
)
def get_job(job_id: str, principal: ViewerDep, db: DatabaseDep) -> JSONResponse:
    return json_answer(jobs.get_job(db, principal.tenant_id, job_id))


@router.post(
    "/jobs/{job_id}/cancel",
    response_model=None,
    responses={
        200: documented(
            JobPublic,
            "cancelled (queued), or cancel_requested (running: its worker stops at the next "
            "step and aborts the rest of the reservation)",
        ),
        **_ERRORS,
        409: {"model": ErrorBody, "description": "the job already succeeded or failed"},
    },
    summary="Cancel a job",
)
def cancel_job(job_id: str, principal: TrainerDep, db: DatabaseDep) -> JSONResponse:
    return json_answer(jobs.cancel_job(db, principal.tenant_id, job_id))
