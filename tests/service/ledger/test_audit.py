"""The audit log's hash chain: appends verify; edits, deletions and reorderings are detected."""

from __future__ import annotations

from sqlalchemy import delete, select, text, update

from service.db.models import AuditEntry
from service.db.session import Database
from service.ledger import audit


def _append(db: Database, count: int) -> None:
    for i in range(count):
        with db.session() as session:
            audit.append(
                session,
                [audit.AuditEvent("test.event", {"i": i, "x": 0.1}, tenant_id="t")],
            )


def test_empty_chain_verifies(db: Database) -> None:
    result = audit.verify(db)
    assert result.ok and result.entries == 0 and result.first_broken is None


def test_appended_chain_verifies(db: Database) -> None:
    _append(db, 5)
    with db.session() as session:  # several events in one transaction
        audit.append(session, [audit.AuditEvent("test.batch", {"n": n}) for n in range(3)])
    result = audit.verify(db)
    assert result.ok and result.entries == 8


def test_edited_row_is_detected(db: Database) -> None:
    _append(db, 5)
    with db.session() as session:
        session.execute(update(AuditEntry).where(AuditEntry.seq == 3).values(payload={"i": 99, "x": 0.1}))
    result = audit.verify(db)
    assert not result.ok and result.first_broken == 3


def test_edited_row_with_recomputed_hash_is_detected(db: Database) -> None:
    _append(db, 5)
    with db.session() as session:
        row = session.get(AuditEntry, 2)
        assert row is not None
        row.payload = {"i": 42}
        row.hash = audit.entry_hash(
            chain=row.chain,
            chain_seq=row.chain_seq,
            event_type=row.event_type,
            tenant_id=row.tenant_id,
            dataset_id=row.dataset_id,
            payload=row.payload,
            created_at=row.created_at,
            prev_hash=row.prev_hash,
        )
    result = audit.verify(db)
    assert not result.ok and result.first_broken == 3  # the next row no longer chains
    assert result.reason == "prev_hash does not chain"


def test_deleted_rows_are_detected(db: Database) -> None:
    _append(db, 5)
    with db.session() as session:
        session.execute(delete(AuditEntry).where(AuditEntry.seq == 2))
    result = audit.verify(db)
    assert not result.ok and result.first_broken == 3  # the entry after the gap
    assert (result.chain_seq, result.reason) == (2, "missing entry")


def test_deleted_tail_is_detected(db: Database) -> None:
    _append(db, 5)
    with db.session() as session:
        session.execute(delete(AuditEntry).where(AuditEntry.seq == 5))
    result = audit.verify(db)
    assert not result.ok and result.chain_seq == 5 and result.reason == "missing entry"


def test_reordered_rows_are_detected(db: Database) -> None:
    _append(db, 5)
    with db.session() as session:
        # swap entries 2 and 3 of the chain by renumbering them
        session.execute(update(AuditEntry).where(AuditEntry.seq == 2).values(chain_seq=1000))
        session.execute(update(AuditEntry).where(AuditEntry.seq == 3).values(chain_seq=2))
        session.execute(update(AuditEntry).where(AuditEntry.seq == 2).values(chain_seq=3))
    result = audit.verify(db)
    assert not result.ok and result.first_broken == 3 and result.chain_seq == 2


def test_raw_sql_edit_is_detected(db: Database) -> None:
    _append(db, 3)
    with db.session() as session:
        session.execute(text("UPDATE audit_log SET event_type = 'forged' WHERE seq = 1"))
        assert session.scalar(select(AuditEntry.event_type).where(AuditEntry.seq == 1)) == "forged"
    result = audit.verify(db)
    assert not result.ok and result.first_broken == 1
