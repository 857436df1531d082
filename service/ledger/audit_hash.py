"""The hash of an audit-chain entry: what ``service.ledger.audit`` writes and ``ledger check``
recomputes offline, in a module without a database (a plain install has no SQLAlchemy).

Entry ``n`` of a chain stores ``SHA-256`` of the canonical JSON (``accountant.canonical``) of
``{chain, chain_seq, event_type, tenant_id, dataset_id, payload, created_at, prev_hash}``, with
``created_at`` a hashed timestamp and ``prev_hash`` entry ``n − 1``'s hash (``GENESIS_HASH`` for
the first).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final

from accountant.canonical import sha256_hex, timestamp

GENESIS_HASH: Final = "0" * 64


def entry_hash(
    *,
    chain: str,
    chain_seq: int,
    event_type: str,
    tenant_id: str | None,
    dataset_id: str | None,
    payload: Mapping[str, Any],
    created_at: datetime,
    prev_hash: str,
) -> str:
    document = {
        "chain": chain,
        "chain_seq": chain_seq,
        "event_type": event_type,
        "tenant_id": tenant_id,
        "dataset_id": dataset_id,
        "payload": payload,
        "created_at": timestamp(created_at),
        "prev_hash": prev_hash,
    }
    return sha256_hex(document)


__all__ = ["GENESIS_HASH", "entry_hash"]
