"""Reserve → commit / abort: ``/v1/datasets/{id}/reservations`` and ``/v1/reservations/{id}``.

``trainer`` (or ``admin``) reserves, commits and aborts; any scope reads. Every mutating call
honours ``Idempotency-Key``: a retry returns the first answer and charges nothing more.

Reserve, commit and abort are the hot path. They are coroutines: a request waits for its spend on
the event loop (``reservations.reserve_async`` ...), not in a thread of its own, and the spends
that arrive together run as one group in one worker thread. They read the database, settings and
metrics from ``request.app.state`` rather than through ``DatabaseDep`` / ``MetricsDep``: FastAPI
resolves every dependency of every request anew, which cost these routes more CPU than their
ledger work once the spends were grouped.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from service.api import PREFIX
from service.api.deps import DatabaseDep, IdempotencyKeyDep, TrainerDep, ViewerDep
from service.api.metrics import LedgerMetrics
from service.api.ratelimit import RATE_LIMITED, PricingRates
from service.api.responses import documented, json_answer
from service.api.schemas import (
    CommitPublic,
    CommitRequest,
    ErrorBody,
    ReservationBatchesPublic,
    ReservationCreate,
    ReservationExtend,
    ReservationPublic,
)
from service.ledger import pricing_limits, reservations
from service.ledger.errors import Conflict

router = APIRouter(prefix=PREFIX, tags=["reservations"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing, unknown or revoked API key"},
    403: {"model": ErrorBody, "description": "the key's scope does not allow this call"},
    404: {"model": ErrorBody, "description": "unknown id, or another tenant's"},
    422: {"model": ErrorBody, "description": "invalid input; `field` names it"},
}


def _observe_age(metrics: LedgerMetrics, reservation: reservations.Reservation, outcome: str) -> None:
    at = reservation.created_at
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    metrics.reservation_age.observe(max(0.0, (datetime.now(UTC) - at).total_seconds()), outcome=outcome)


@router.post(
    "/datasets/{dataset_id}/reservations",
    status_code=201,
    response_model=None,
    responses={
        201: documented(ReservationPublic, "held: the cost per batch and when the hold expires"),
        **_ERRORS,
        **RATE_LIMITED,
        409: {
            "model": ErrorBody,
            "description": "`budget_exceeded` (with `remaining` and `requested`), or a charge the "
            "rule refuses (`batch_already_read`, `no_geometric_level`, `outside_plan`, ...); "
            "nothing is held",
        },
    },
    summary="Certify a planned charge and hold it (all batches or none)",
)
async def reserve(
    dataset_id: str,
    body: ReservationCreate,
    principal: TrainerDep,
    request: Request,
    idempotency_key: IdempotencyKeyDep = None,
) -> JSONResponse:
    state = request.app.state
    ttl_s = body.ttl_s if body.ttl_s is not None else state.settings.reservation_ttl_s
    if ttl_s > state.settings.reservation_max_lifetime_s:
        # 409, not 422: a ttl_s the schema allows, above this server's configured lifetime
        raise Conflict(
            f"ttl_s must be at most the maximum lifetime of a reservation on this server, "
            f"{state.settings.reservation_max_lifetime_s:g} s. Found {ttl_s!r}.",
            reason="reservation_lifetime_exceeded",
            field="ttl_s",
            max_lifetime_s=state.settings.reservation_max_lifetime_s,
        )
    answer = await reservations.reserve_async(
        state.database,
        principal.tenant_id,
        dataset_id,
        event=body.parsed_event,
        batch_ids=_ids(body.batches),
        task_ids=_ids(body.tasks),
        noise_commitment=body.noise_commitment,
        idempotency_key=idempotency_key,
        ttl_s=ttl_s,
        policy=_pricing(request, principal.tenant_id),
        release=None if body.release is None else body.release.model_dump(),
    )
    state.metrics.reservations.inc()
    return json_answer(answer.to_json(), 201)


def _pricing(request: Request, tenant_id: str) -> pricing_limits.Policy:
    """The request's pricing bound and the tenant's rate (``service.api.ratelimit``)."""
    rates: PricingRates = request.app.state.pricing
    return rates.policy(tenant_id)


def _ids(ids: list[str | int] | None) -> list[str] | None:
    return None if ids is None else [str(i) for i in ids]


@router.get(
    "/reservations/{reservation_id}",
    response_model=ReservationPublic,
    response_model_exclude_unset=True,
    responses={200: {"description": "the reservation"}, **_ERRORS},
    summary="Get a reservation",
)
def get_reservation(reservation_id: str, principal: ViewerDep, db: DatabaseDep) -> dict[str, Any]:
    return reservations.get_reservation(db, principal.tenant_id, reservation_id).to_json()


@router.get(
    "/reservations/{reservation_id}/batches",
    response_model=ReservationBatchesPublic,
    response_model_exclude_unset=True,
    responses={200: {"description": "a page of the batches, in ascending id order"}, **_ERRORS},
    summary="The batches a reservation reads, with their class, page by page",
)
def list_reservation_batches(
    reservation_id: str,
    principal: ViewerDep,
    db: DatabaseDep,
    after: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=reservations.MAX_BATCH_PAGE)] = 1000,
) -> dict[str, Any]:
    page = reservations.list_batches(db, principal.tenant_id, reservation_id, after=after, limit=limit)
    return page.to_json()


@router.post(
    "/reservations/{reservation_id}/commit",
    response_model=None,
    responses={
        200: documented(CommitPublic, "committed: the stored certificate and the reservation"),
        **_ERRORS,
        **RATE_LIMITED,
        409: {
            "model": ErrorBody,
            "description": "closed or expired reservation, a (model, version) released before, "
            "or a progressive commit costing more than reserved",
        },
    },
    summary="Turn the hold into spend, record the release, return its certificate",
)
async def commit(
    reservation_id: str,
    body: CommitRequest,
    principal: TrainerDep,
    request: Request,
    idempotency_key: IdempotencyKeyDep = None,
) -> JSONResponse:
    metrics: LedgerMetrics = request.app.state.metrics
    answer = await reservations.commit_async(
        request.app.state.database,
        principal.tenant_id,
        reservation_id,
        release=body.release.model_dump(mode="json"),
        event=body.parsed_event,
        idempotency_key=idempotency_key,
        policy=_pricing(request, principal.tenant_id),
    )
    metrics.commits.inc()
    if answer.reservation.commits == 1:
        _observe_age(metrics, answer.reservation, "committed")
    return json_answer(answer.to_json())


@router.post(
    "/reservations/{reservation_id}/abort",
    response_model=None,
    responses={
        200: documented(
            ReservationPublic,
            "aborted: charged the whole reserved event (the data could have been read), with a "
            "certificate of outcome aborted and release null; nothing is returned to the budget",
        ),
        **_ERRORS,
        409: {"model": ErrorBody, "description": "already fully committed"},
    },
    summary="Close the reservation without a release, charging everything reserved",
)
async def abort(
    reservation_id: str,
    principal: TrainerDep,
    request: Request,
    idempotency_key: IdempotencyKeyDep = None,
) -> JSONResponse:
    metrics: LedgerMetrics = request.app.state.metrics
    answer = await reservations.abort_async(
        request.app.state.database, principal.tenant_id, reservation_id, idempotency_key=idempotency_key
    )
    metrics.aborts.inc()
    _observe_age(metrics, answer, "aborted")
    return json_answer(answer.to_json())


@router.post(
    "/reservations/{reservation_id}/extend",
    response_model=ReservationPublic,
    response_model_exclude_unset=True,
    responses={
        200: {"description": "held longer: the reservation with its new `expires_at`"},
        **_ERRORS,
        409: {
            "model": ErrorBody,
            "description": "`reservation_closed` (committed or aborted), `reservation_expired` "
            "(past its time: it expires now, charged everything reserved), or "
            "`reservation_lifetime_exceeded` (with `latest_expires_at`; nothing changes)",
        },
    },
    summary="Hold an open reservation longer (a heartbeat; bounded, audited)",
)
async def extend(
    reservation_id: str,
    body: ReservationExtend,
    principal: TrainerDep,
    request: Request,
    idempotency_key: IdempotencyKeyDep = None,
) -> dict[str, Any]:
    state = request.app.state
    answer = await reservations.extend_async(
        state.database,
        principal.tenant_id,
        reservation_id,
        ttl_s=body.ttl_s,
        max_lifetime_s=state.settings.reservation_max_lifetime_s,
        idempotency_key=idempotency_key,
    )
    return answer.to_json()
