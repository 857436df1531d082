"""``GET /v1/datasets/{id}/audit``: a dataset's audit chain, entry by entry (any scope).

``GET /v1/audit/verify`` answers whether the chains are intact; this route hands out the entries
themselves, so that ``ledger export`` can bundle a dataset's chain and ``ledger check --bundle``
can recompute every hash offline (``service.verification.audit_chain.entry_hash``) and tie each certificate to
the ``reservation.committed`` entry that recorded its content hash.

Answer::

    {dataset_id, head: {chain_seq, hash, signature}, data: [entry, ...], count, next_after}

``head`` is the chain head stored on the dataset row, read first in the same read transaction,
with the server's signature of ``(dataset_id, chain_seq, hash)`` (``service.verification.signing``): a
bundle's head is the server's statement, which a chain rewritten elsewhere cannot reproduce;
entries appended after it are left out, so a page never runs past its head. An entry is
``{seq, chain, chain_seq, event_type, tenant_id, dataset_id, payload, prev_hash, hash,
created_at}`` with ``created_at`` in exactly the form its hash covers (``…T…​.ffffffZ``). Pages
are ordered by ``chain_seq``: ``after`` is the last ``chain_seq`` already read (0 for the start),
``next_after`` the value to pass for the next page (``null`` at the head).
"""

from __future__ import annotations

from typing import Annotated, Any, Final

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from sqlalchemy import select

from accountant.canonical import timestamp
from service import server_secrets
from service.api import PREFIX
from service.api.deps import DatabaseDep, ViewerDep
from service.api.schemas import AuditEntriesPublic, ErrorBody
from service.db.models import AuditEntry
from service.db.session import Database
from service.ledger.datasets import load_dataset
from service.verification import signing

MAX_PAGE: Final = 5000

router = APIRouter(prefix=PREFIX, tags=["audit"])


def chain_page(db: Database, tenant_id: str, dataset_id: str, *, after: int, limit: int) -> dict[str, Any]:
    """One page of the dataset's chain, up to its head (another tenant's dataset: ``NotFound``),
    the head signed by the server's active key."""
    key = server_secrets.signing_keys(db).active
    with db.session(readonly=True) as session:
        dataset = load_dataset(session, tenant_id, dataset_id)
        head_seq, head_hash = dataset.audit_seq, dataset.audit_hash
        rows = session.scalars(
            select(AuditEntry)
            .where(
                AuditEntry.chain == dataset_id,
                AuditEntry.chain_seq > after,
                AuditEntry.chain_seq <= head_seq,
            )
            .order_by(AuditEntry.chain_seq)
            .limit(limit)
        ).all()
        data = [
            {
                "seq": row.seq,
                "chain": row.chain,
                "chain_seq": row.chain_seq,
                "event_type": row.event_type,
                "tenant_id": row.tenant_id,
                "dataset_id": row.dataset_id,
                "payload": row.payload,
                "prev_hash": row.prev_hash,
                "hash": row.hash,
                "created_at": timestamp(row.created_at),
            }
            for row in rows
        ]
        last: int = rows[-1].chain_seq if rows else after
    return {
        "dataset_id": dataset_id,
        "head": signing.signed_head(dataset_id, head_seq, head_hash, key),
        "data": data,
        "count": len(data),
        "next_after": last if data and last < head_seq else None,
    }


@router.get(
    "/datasets/{dataset_id}/audit",
    response_model=AuditEntriesPublic,
    # json.dumps, not pydantic's JSON writer: a payload's floats keep their bytes (1e-05, not 0.00001)
    response_class=JSONResponse,
    responses={
        200: {"description": "a page of the chain, up to its signed head"},
        401: {"model": ErrorBody, "description": "missing, unknown or revoked API key"},
        404: {"model": ErrorBody, "description": "unknown dataset, or another tenant's"},
        422: {"model": ErrorBody, "description": "invalid input; `field` names it"},
    },
    summary="The dataset's audit chain entries, oldest first, up to its head",
)
def list_audit_entries(
    dataset_id: str,
    principal: ViewerDep,
    db: DatabaseDep,
    after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 1000,
) -> dict[str, Any]:
    return chain_page(db, principal.tenant_id, dataset_id, after=after, limit=limit)
