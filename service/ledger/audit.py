"""The append-only, hash-chained audit log: one entry per ledger event.

Entries form hash chains. Each dataset has its own chain — its ledger — whose head (last
``chain_seq`` and ``hash``) lives on the dataset row that every spend already locks, so appending
costs no extra lock and no extra round trip, and spends on different datasets never serialise on
a global audit lock. Tenant and key events go to the ``global`` chain, whose head is the single
``audit_head`` row (locked by its appends).

Entry ``n`` of a chain stores ``hash_n = SHA-256(canonical JSON of {chain, chain_seq, event_type,
tenant_id, dataset_id, payload, created_at, prev_hash = hash_{n-1}})``; every chain starts from
``GENESIS_HASH``. ``verify`` walks every chain end to end and compares its last entry with its
head: an edited entry fails its own hash; a deleted, inserted or reordered entry breaks the
sequence or the next entry's ``prev_hash``; a deleted tail no longer matches the head. The hash
and the walk are ``service.verification.audit_chain``'s (``check_chain``), which ``ledger check``
runs on an exported chain: this module reads the rows and heads it walks.

Two readings, two audiences: ``verify`` is the operator's (``ledger verify``, reading the database
directly): every chain of every tenant and the global chain. ``verify_tenant`` is the API's
(``GET /v1/audit/verify``): only the caller tenant's dataset chains, so neither another tenant's
entry count nor its breaks (nor its dataset ids) reach a tenant's key. Both answer a frozen
``ChainCheck``, whose ``to_json`` is the wire form.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Final

from sqlalchemy import insert, select, tuple_, update
from sqlalchemy.orm import Session

from service.db.base import utcnow
from service.db.models import AuditEntry, AuditHead, Dataset
from service.db.session import Database
from service.verification.audit_chain import GENESIS_HASH, ChainCheck, check_chain, entry_hash

GLOBAL_CHAIN: Final = "global"
HEAD_ID: Final = 1
_VERIFY_PAGE: Final = 2000


@dataclass(frozen=True)
class AuditEvent:
    """A ledger event to append: ``event_type`` like ``"reservation.committed"``.

    Events with a ``dataset_id`` go to that dataset's chain, the others to the global chain.
    Payloads never contain record ids or keys.
    """

    event_type: str
    payload: Mapping[str, Any]
    tenant_id: str | None = None
    dataset_id: str | None = None

    @property
    def chain(self) -> str:
        return self.dataset_id if self.dataset_id is not None else GLOBAL_CHAIN


def chain_rows(
    chain: str, head_seq: int, head_hash: str, events: Iterable[AuditEvent], now: datetime
) -> tuple[list[dict[str, Any]], int, str]:
    """The rows that append ``events`` to a chain whose head is (``head_seq``, ``head_hash``),
    and the new head. The caller inserts the rows and stores the head in the same transaction,
    holding the head's lock."""
    rows: list[dict[str, Any]] = []
    seq, prev_hash = head_seq, head_hash
    for event in events:
        if event.chain != chain:
            raise ValueError(f"event for chain {event.chain!r} appended to chain {chain!r}")
        seq += 1
        payload = dict(event.payload)
        digest = entry_hash(
            chain=chain,
            chain_seq=seq,
            event_type=event.event_type,
            tenant_id=event.tenant_id,
            dataset_id=event.dataset_id,
            payload=payload,
            created_at=now,
            prev_hash=prev_hash,
        )
        rows.append(
            {
                "chain": chain,
                "chain_seq": seq,
                "event_type": event.event_type,
                "tenant_id": event.tenant_id,
                "dataset_id": event.dataset_id,
                "payload": payload,
                "prev_hash": prev_hash,
                "hash": digest,
                "created_at": now,
            }
        )
        prev_hash = digest
    return rows, seq, prev_hash


def append(session: Session, events: Iterable[AuditEvent], *, now: datetime | None = None) -> None:
    """Append ``events`` to their chains in ``session``'s transaction, locking each chain head.

    Spend transactions, which hold the dataset row already, use ``chain_rows`` directly and
    write the head with their own update of the dataset row.
    """
    at = now or utcnow()
    by_chain: dict[str, list[AuditEvent]] = {}
    for event in events:
        by_chain.setdefault(event.chain, []).append(event)
    locking = session.get_bind().dialect.name != "sqlite"
    for chain, chain_events in by_chain.items():
        if chain == GLOBAL_CHAIN:
            stmt = select(AuditHead.seq, AuditHead.hash).where(AuditHead.id == HEAD_ID)
        else:
            stmt = select(Dataset.audit_seq, Dataset.audit_hash).where(Dataset.id == chain)
        if locking:
            stmt = stmt.with_for_update()
        head_seq, head_hash = session.execute(stmt).one()
        rows, new_seq, new_hash = chain_rows(chain, head_seq, head_hash, chain_events, at)
        session.execute(insert(AuditEntry), rows)
        if chain == GLOBAL_CHAIN:
            session.execute(
                update(AuditHead).where(AuditHead.id == HEAD_ID).values(seq=new_seq, hash=new_hash)
            )
        else:
            session.execute(
                update(Dataset).where(Dataset.id == chain).values(audit_seq=new_seq, audit_hash=new_hash)
            )


def verify(db: Database, *, dataset_id: str | None = None) -> ChainCheck:
    """The operator's walk (``ledger verify``): every tenant's chains and the global chain (or
    one dataset's; then ``head`` is the head walked to). Never behind an API key: its count and
    its breaks are about every tenant (``verify_tenant`` is the API's)."""
    return _walk(db, dataset_id=dataset_id)


def verify_tenant(db: Database, tenant_id: str, *, dataset_id: str | None = None) -> ChainCheck:
    """The API's walk (``GET /v1/audit/verify``): ``tenant_id``'s dataset chains only (or one of
    them), in the same answer; with ``dataset_id``, ``head`` is the head walked to.

    The global chain (tenants and keys of every tenant) is left out, not filtered: its entries
    chain through other tenants' entries, so checking "this tenant's part" would still report
    other tenants' breaks and its length would still count their events. Another tenant's
    chains are not read at all: neither their entries nor their breaks can reach the answer.
    """
    return _walk(db, dataset_id=dataset_id, tenant_id=tenant_id)


def _entries(
    session: Session, heads: Mapping[str, tuple[int, str]], *, dataset_id: str | None, tenant_id: str | None
) -> Iterator[AuditEntry]:
    """The entries a walk reads, page by page in ``(chain, chain_seq)`` order: the whole log (or
    one dataset's chain) for the operator's walk, each of ``heads``' chains for a tenant's."""
    if tenant_id is None:
        entry_stmt = select(AuditEntry)
        if dataset_id is not None:
            entry_stmt = entry_stmt.where(AuditEntry.chain == dataset_id)
        after: tuple[str, int] = ("", 0)
        while True:
            page = session.scalars(
                entry_stmt.where(tuple_(AuditEntry.chain, AuditEntry.chain_seq) > after)
                .order_by(AuditEntry.chain, AuditEntry.chain_seq)
                .limit(_VERIFY_PAGE)
            ).all()
            if not page:
                return
            after = (page[-1].chain, page[-1].chain_seq)
            yield from page
            session.expunge_all()
    for chain in sorted(heads):
        position = 0
        while True:
            page = session.scalars(
                select(AuditEntry)
                .where(AuditEntry.chain == chain, AuditEntry.chain_seq > position)
                .order_by(AuditEntry.chain_seq)
                .limit(_VERIFY_PAGE)
            ).all()
            if not page:
                break
            position = page[-1].chain_seq
            yield from page
            session.expunge_all()


def _walk(db: Database, *, dataset_id: str | None = None, tenant_id: str | None = None) -> ChainCheck:
    """Walk chains end to end: all of them (``tenant_id`` None, the operator's walk), or only
    ``tenant_id``'s dataset chains; ``dataset_id`` narrows either to that dataset's chain.

    Heads are read first, then only entries up to them, so appends committed meanwhile are
    ignored rather than mistaken for breaks (each head and its entries commit together). The
    whole walk pages through ``(chain, chain_seq)`` and so also finds entries of a chain that has
    no head; a tenant's walk reads each of its chains by the ``(chain, chain_seq)`` index.
    """
    with db.session(readonly=True) as session:
        heads: dict[str, tuple[int, str]] = {}
        dataset_stmt = select(Dataset.id, Dataset.audit_seq, Dataset.audit_hash)
        if dataset_id is not None:
            dataset_stmt = dataset_stmt.where(Dataset.id == dataset_id)
        if tenant_id is not None:
            dataset_stmt = dataset_stmt.where(Dataset.tenant_id == tenant_id)
        elif dataset_id is None:
            global_head = session.execute(
                select(AuditHead.seq, AuditHead.hash).where(AuditHead.id == HEAD_ID)
            ).one()
            heads[GLOBAL_CHAIN] = (global_head.seq, global_head.hash)
        for row in session.execute(dataset_stmt):
            heads[row.id] = (row.audit_seq, row.audit_hash)

        result = check_chain(heads, _entries(session, heads, dataset_id=dataset_id, tenant_id=tenant_id))
    if dataset_id is not None and dataset_id in heads:
        return replace(result, head=heads[dataset_id])
    return result


__all__ = [
    "GENESIS_HASH",
    "GLOBAL_CHAIN",
    "AuditEvent",
    "append",
    "chain_rows",
    "entry_hash",
    "verify",
    "verify_tenant",
]
