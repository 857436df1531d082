"""``GET /v1/audit/verify``: walk the audit log's hash chains end to end (any scope).

Without ``dataset_id`` every chain is checked (the global chain of tenants and keys, and each
dataset's ledger chain); with it, that dataset's chain only (another tenant's dataset is 404).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.api import PREFIX
from service.api.deps import DatabaseDep, ViewerDep
from service.api.schemas import AuditVerification, ErrorBody
from service.ledger import audit, datasets

router = APIRouter(prefix=PREFIX, tags=["audit"])


@router.get(
    "/audit/verify",
    response_model=AuditVerification,
    responses={
        401: {"model": ErrorBody, "description": "missing, unknown or revoked API key"},
        404: {"model": ErrorBody, "description": "unknown dataset, or another tenant's"},
    },
    summary="Check the audit log's hash chains; `first_broken` names the first broken entry",
)
def verify(principal: ViewerDep, db: DatabaseDep, dataset_id: str | None = None) -> dict[str, Any]:
    if dataset_id is not None:
        datasets.get_dataset(db, principal.tenant_id, dataset_id)  # NotFound for a foreign id
    return audit.verify(db, dataset_id=dataset_id)
