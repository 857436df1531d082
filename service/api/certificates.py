"""Spend and certificates: ``/v1/datasets/{id}/spend``, ``/v1/datasets/{id}/certificates``,
``/v1/certificates/{id}``. Reads: any scope."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from service.api import PREFIX
from service.api.deps import DatabaseDep, ViewerDep
from service.api.responses import documented, json_answer
from service.api.schemas import CertificatePublic, CertificatesPublic, ErrorBody, SpendPublic
from service.ledger import certificates, spent

router = APIRouter(prefix=PREFIX, tags=["spend and certificates"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing, unknown or revoked API key"},
    404: {"model": ErrorBody, "description": "unknown id, or another tenant's"},
}


@router.get(
    "/datasets/{dataset_id}/spend",
    response_model=None,
    responses={200: documented(SpendPublic, "the dataset's spend"), **_ERRORS},
    summary="What the dataset has spent (from aggregates; never a scan of charges)",
)
def get_spend(dataset_id: str, principal: ViewerDep, db: DatabaseDep) -> JSONResponse:
    # the fast JSON path, as reserve and commit (service.api.responses): a dashboard polls it,
    # and its answer grows with the dataset's tasks
    return json_answer(spent.get_spend(db, principal.tenant_id, dataset_id).to_json())


@router.get(
    "/datasets/{dataset_id}/certificates",
    response_model=CertificatesPublic,
    responses=_ERRORS,
    summary="The dataset's certificates, oldest first",
)
def list_certificates(
    dataset_id: str,
    principal: ViewerDep,
    db: DatabaseDep,
    limit: Annotated[int, Query(ge=1, le=certificates.MAX_PAGE)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
) -> dict[str, Any]:
    return certificates.list_certificates(db, principal.tenant_id, dataset_id, limit=limit, offset=offset)


@router.get(
    "/certificates/{certificate_id}",
    response_model=CertificatePublic,
    responses=_ERRORS,
    summary="One certificate, re-verifiable offline by accountant.certificates.verify",
)
def get_certificate(certificate_id: str, principal: ViewerDep, db: DatabaseDep) -> dict[str, Any]:
    return certificates.get_certificate(db, principal.tenant_id, certificate_id)
