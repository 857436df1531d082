"""Training jobs: ``POST /v1/jobs``, ``GET /v1/jobs``, ``GET /v1/jobs/{id}``,
``POST /v1/jobs/{id}/cancel``.

``trainer`` (or ``admin``) creates and cancels jobs; any scope reads. A job runs on a worker
(``ledger worker``, or the one ``ledger serve`` runs in-process), which reserves the run's cost
before it reads data and commits before it publishes each model version
(``service.worker.gate``). Another tenant's job answers 404.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from service.api import PREFIX
from service.api.deps import DatabaseDep, IdempotencyKeyDep, TrainerDep, ViewerDep
from service.api.responses import documented, json_answer
from service.api.schemas import ErrorBody, JobDetailPublic, JobPublic, JobsPublic
from service.ledger import jobs

router = APIRouter(prefix=PREFIX, tags=["jobs"])

DATASET_ID = r"^[A-Za-z0-9_.-]+$"
"""What a dataset id is made of (``ds_<hex>``): anything else names no dataset."""

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing, unknown or revoked API key"},
    403: {"model": ErrorBody, "description": "the key's scope does not allow this call"},
    404: {"model": ErrorBody, "description": "unknown id, or another tenant's"},
    422: {"model": ErrorBody, "description": "invalid input; `field` names it"},
}


class JobCreate(BaseModel):
    """A job: train ``algorithm`` on the dataset's batches, read from the dataset's own data
    source, with ``params``.

    ``params`` is a typed document, checked when the job is submitted against the algorithm's
    declaration (``service/contract/job_params.py``, the same one the trainer reads): an unknown key, a
    wrong type or a value out of range is a 422 naming ``params.<key>``. ``params.model_name`` is
    the registry name of the job's versions (default ``<algorithm>-<job id>``, e.g.
    ``dp_sgd-job_…``: unique per job; a name another dataset publishes under is 409
    ``model_name_taken``); the others are
    the trainer's (DP-SGD: ``target_epsilon`` — the run's own ε by the tight engine — or
    ``target_budget_epsilon`` — what the dataset charges — or ``noise_multiplier``, with
    ``delta`` defaulting to the budget's; ``epochs`` or ``steps``, ``expected_batch_size``,
    ``checkpoint_every``, ``model``, ...).
    """

    model_config = ConfigDict(extra="forbid")

    dataset_id: str = Field(min_length=1, max_length=64, pattern=DATASET_ID)
    algorithm: str = Field(
        description="the algorithms a worker runs now (others of the contract: a later release)",
        json_schema_extra={"enum": list(jobs.params.ALGORITHMS)},
    )
    params: dict[str, Any] = Field(
        description=(
            "The algorithm's params (unknown, mistyped or out-of-range keys: 422 naming "
            "`params.<key>`) and `model_name`. Standard JSON only: NaN, Infinity (`1e999` reads as "
            "Infinity), lone surrogates and NUL are refused (422 naming the field); at most "
            f"{jobs.params.MAX_PARAMS_BYTES} bytes as JSON, {jobs.params.MAX_PARAMS_DEPTH} levels deep. "
            "`data_source` is refused: the source belongs to the dataset (`PUT "
            "/v1/datasets/{id}/data-source`). An explicit `steps` above `LEDGER_JOB_MAX_STEPS` is "
            "refused; the steps that `epochs` imply are checked by the worker before it reserves. "
            "The dataset is looked up first: an unknown one is a 404 whatever the params."
        ),
        json_schema_extra={
            "maxProperties": jobs.params.MAX_PARAMS_KEYS,
            "not": {"required": ["data_source"]},
            "properties": {
                "model_name": {
                    "description": "The registry name the job's versions are published under "
                    "(`GET /v1/models/{model_name}/versions`). Default: `<algorithm>-<job id>` "
                    "(e.g. `dp_sgd-job_0123…`), unique per job. A name another dataset released "
                    "versions under, or a queued or running job of another dataset will publish "
                    "under, is refused (409 `model_name_taken`).",
                    "anyOf": [
                        {"type": "string", "pattern": "^" + jobs.params.MODEL_NAME.pattern + "$"},
                        {"type": "null"},
                    ],
                },
            },
        },
    )


@router.post(
    "/jobs",
    status_code=201,
    response_model=None,
    responses={
        201: documented(JobPublic, "queued"),
        **_ERRORS,
        409: {
            "model": ErrorBody,
            "description": "`model_name_taken`: another dataset released versions of the model name, "
            "or has a queued or running job that will (its versions would interleave with this job's); "
            "`too_many_queued_jobs`: the tenant has `LEDGER_MAX_QUEUED_JOBS_PER_TENANT` jobs queued",
        },
    },
    summary="Queue a training job",
)
def create_job(
    body: JobCreate,
    principal: TrainerDep,
    db: DatabaseDep,
    request: Request,
    idempotency_key: IdempotencyKeyDep = None,
) -> JSONResponse:
    answer = jobs.queue.create_job(
        db,
        principal.tenant_id,
        dataset_id=body.dataset_id,
        algorithm=body.algorithm,
        params=body.params,
        idempotency_key=idempotency_key,
        limits=jobs.params.JobLimits.of(request.app.state.settings),
    )
    # No response_model: a replay answers the stored answer byte for byte, as whichever server
    # version stored it (``JobAnswer.from_json``), which a model would reorder or refuse.
    # tests/service/api/test_documented_answers.py checks the answer against JobPublic.
    return json_answer(answer.to_json(), 201)


@router.get(
    "/jobs",
    response_model=JobsPublic,
    response_model_exclude_unset=True,
    # json.dumps, not pydantic's JSON writer: the params' and metrics' floats keep their bytes
    response_class=JSONResponse,
    responses={
        200: {
            "description": f"the tenant's jobs, newest first: at most {jobs.queue.MAX_PAGE} a page, "
            f"each with its newest {jobs.answers.MAX_LISTED_VERSIONS} versions (`versions_total` "
            f"counts all) and params of at most {jobs.params.MAX_PARAMS_BYTES} bytes (a row stored "
            "with more by an older version shows `params: null` and `params_omitted`)",
        },
        **_ERRORS,
    },
    summary="List jobs",
)
def list_jobs(
    principal: ViewerDep,
    db: DatabaseDep,
    dataset_id: Annotated[str | None, Query(max_length=64, pattern=DATASET_ID)] = None,
    limit: Annotated[int, Query(ge=1, le=jobs.queue.MAX_PAGE)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
) -> dict[str, Any]:
    return jobs.queue.list_jobs(
        db, principal.tenant_id, dataset_id=dataset_id, limit=limit, offset=offset
    ).to_json()


@router.get(
    "/jobs/{job_id}",
    response_model=JobDetailPublic,
    response_model_exclude_unset=True,
    response_class=JSONResponse,
    responses={200: {"description": "status, progress, ε committed, metrics"}, **_ERRORS},
    summary="Get a job",
)
def get_job(job_id: str, principal: ViewerDep, db: DatabaseDep) -> dict[str, Any]:
    return jobs.queue.get_job(db, principal.tenant_id, job_id).to_json()


@router.post(
    "/jobs/{job_id}/cancel",
    response_model=JobDetailPublic,
    response_model_exclude_unset=True,
    response_class=JSONResponse,
    responses={
        200: {
            "description": "cancelled (queued), or cancel_requested (running: its worker stops at "
            "the next step and aborts the rest of the reservation)",
        },
        **_ERRORS,
        409: {"model": ErrorBody, "description": "the job already succeeded or failed"},
    },
    summary="Cancel a job",
)
def cancel_job(job_id: str, principal: TrainerDep, db: DatabaseDep) -> dict[str, Any]:
    return jobs.queue.cancel_job(db, principal.tenant_id, job_id).to_json()
