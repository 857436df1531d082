"""Reads come from aggregates: the spend query and every spend transaction run a fixed set of
indexed statements, however many charges the dataset has; the dataset's audit chain detects
tampering with ledger events."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import delete, event, func, select, update

from service.db.models import AuditEntry
from service.db.session import Database
from service.ledger import audit, reservations, spent
from service.ledger.reservations import parse_event
from tests.service.ledger.conftest import MakeDataset

BASIC = {"rule": "sequential", "epsilon": 100.0, "delta": 1e-5, "accountant": "basic"}


@contextmanager
def statements(db: Database) -> Iterator[list[str]]:
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(" ".join(statement.split()).lower())

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(db.engine, "before_cursor_execute", record)


def _charge(db: Database, ds: str, batch_ids: list[str], version: int) -> tuple[list[str], list[str]]:
    with statements(db) as reserve_sql:
        r = reservations.reserve(
            db, "t1", ds, batch_ids=batch_ids, event=parse_event({"kind": "pure_dp", "epsilon": 0.01})
        ).to_json()
    with statements(db) as commit_sql:
        reservations.commit(db, "t1", r["id"], release={"model": "m", "version": version})
    return reserve_sql, commit_sql


def test_spend_reads_aggregates_only(ledger: Database, make_dataset: MakeDataset) -> None:
    ds = make_dataset(BASIC, tasks=[2, 2])
    for i in range(30):
        _charge(ledger, ds.id, ds.batches[i % 2], i)
    with statements(ledger) as sql:
        answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert answer["charges_committed"] == 30 and answer["epsilon_spent"] == "0.15"
    queries = [s for s in sql if s.startswith("select")]
    assert len(queries) == 2  # the dataset row and its tasks
    for table in (
        "reservations",
        "reservation_batches",
        "certificates",
        "releases",
        "batch_records",
        "audit_log",
    ):
        assert not any(f" {table} " in f" {s} " for s in queries), table


def test_spend_transactions_do_not_grow_with_history(ledger: Database, make_dataset: MakeDataset) -> None:
    ds = make_dataset(BASIC, tasks=[1])
    _charge(ledger, ds.id, ds.all_batches, 0)  # the first parses and caches the budget
    first = _charge(ledger, ds.id, ds.all_batches, 1)
    for i in range(2, 40):
        _charge(ledger, ds.id, ds.all_batches, i)
    later = _charge(ledger, ds.id, ds.all_batches, 40)
    # The same statements, whatever the number of earlier charges (no scans of the history).
    assert [s.split(" where")[0] for s in first[0]] == [s.split(" where")[0] for s in later[0]]
    assert [s.split(" where")[0] for s in first[1]] == [s.split(" where")[0] for s in later[1]]
    # The one aggregate is over the reservation's own batches, grouped by class and state.
    assert all(
        "from reservation_batches join batches" in s and "reservation_batches.reservation_id =" in s
        for s in later[0] + later[1]
        if "count(" in s
    )


def test_tampering_with_a_dataset_ledger_is_detected(ledger: Database, make_dataset: MakeDataset) -> None:
    ds = make_dataset(BASIC)
    for i in range(3):
        _charge(ledger, ds.id, ds.all_batches, i)
    assert audit.verify(ledger).ok and audit.verify(ledger, dataset_id=ds.id).ok
    with ledger.session() as session:
        target = session.scalar(
            select(func.min(AuditEntry.seq)).where(
                AuditEntry.chain == ds.id, AuditEntry.event_type == "reservation.committed"
            )
        )
        entry = session.get(AuditEntry, target)
        assert entry is not None
        payload = dict(entry.payload)
        payload["committed"] = {"epsilon": "0", "delta": "0"}
        session.execute(update(AuditEntry).where(AuditEntry.seq == target).values(payload=payload))
    result = audit.verify(ledger)
    assert not result.ok and result.first_broken == target and result.chain == ds.id


def test_deleting_a_dataset_ledger_entry_is_detected(ledger: Database, make_dataset: MakeDataset) -> None:
    ds = make_dataset(BASIC)
    _charge(ledger, ds.id, ds.all_batches, 0)
    with ledger.session() as session:
        last = session.scalar(select(func.max(AuditEntry.seq)).where(AuditEntry.chain == ds.id))
        session.execute(delete(AuditEntry).where(AuditEntry.seq == last))
    result = audit.verify(ledger)
    assert not result.ok and result.chain == ds.id and result.reason == "missing entry"
