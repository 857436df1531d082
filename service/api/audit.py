"""``GET /v1/audit/verify``: walk the caller tenant's audit hash chains end to end (any scope).

Without ``dataset_id`` every dataset chain *of the caller's tenant* is checked; with it, that
dataset's chain only (another tenant's dataset is 404). Other tenants' chains and the global
chain (tenants and keys of every tenant) are not walked: their entry count and their breaks are
not a tenant's to read. The operator's walk of everything is ``ledger verify``, which reads the
database directly (``service.ledger.audit.verify``).

With ``dataset_id`` the answer also holds ``head`` ``{chain_seq, hash, signature}``: the head the
walk reached, signed by the server's key (``service.verification.signing``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service import server_secrets
from service.api import PREFIX
from service.api.deps import DatabaseDep, ViewerDep
from service.api.schemas import AuditVerification, ErrorBody
from service.ledger import audit, datasets
from service.verification import signing

router = APIRouter(prefix=PREFIX, tags=["audit"])


@router.get(
    "/audit/verify",
    response_model=AuditVerification,
    responses={
        401: {"model": ErrorBody, "description": "missing, unknown or revoked API key"},
        404: {"model": ErrorBody, "description": "unknown dataset, or another tenant's"},
    },
    summary="Check the caller tenant's audit hash chains; `first_broken` names the first broken entry",
    description="Walks the dataset chains of the key's tenant (or the one `dataset_id` names) from "
    "the genesis hash to their heads; `entries` counts those chains' entries only. Other tenants' "
    "chains and the global chain of tenant and key events are the operator's to check "
    "(`ledger verify`). With `dataset_id`, `head` is the head walked to, signed by the server "
    "(`GET /.well-known/privacy-ledger/signing-keys`).",
)
def verify(principal: ViewerDep, db: DatabaseDep, dataset_id: str | None = None) -> dict[str, Any]:
    if dataset_id is not None:
        datasets.get_dataset(db, principal.tenant_id, dataset_id)  # NotFound for a foreign id
    checked = audit.verify_tenant(db, principal.tenant_id, dataset_id=dataset_id)
    answer = checked.to_json()
    if dataset_id is not None and checked.head is not None:
        key = server_secrets.signing_keys(db).active
        answer["head"] = signing.signed_head(dataset_id, *checked.head, key)
    return answer
