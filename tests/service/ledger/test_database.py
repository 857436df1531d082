"""The database layer: SQLite write transactions lock at BEGIN, exact decimals, UTC times,
constraint violations translated to domain errors."""

from __future__ import annotations

import sqlite3
import threading
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from sqlalchemy import select, text, update

from service.db.models import Dataset, Tenant
from service.db.session import Database, lock_ledger_head
from service.ledger.errors import Conflict


def _dataset(now: datetime, epsilon: Decimal) -> Dataset:
    return Dataset(
        id="ds_1",
        tenant_id="t",
        name="d",
        rule="sequential",
        accountant="basic",
        budget={},
        epsilon_budget=epsilon,
        delta_budget=Decimal("1E-10"),
        record_salt=b"s" * 32,
        created_at=now,
        updated_at=now,
    )


@pytest.mark.parametrize("backend", ["sqlite"])
def test_sqlite_pragmas_and_begin_immediate(db: Database) -> None:
    with db.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    # A write session holds the write lock from BEGIN on, before it writes anything.
    with db.session() as session:
        session.execute(text("SELECT 1"))
        other = sqlite3.connect(db.url.database or "", timeout=0.05, isolation_level=None)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("BEGIN IMMEDIATE")
        other.close()
    # A read session does not block writers.
    with db.session(readonly=True) as session:
        session.execute(text("SELECT count(*) FROM tenants"))
        other = sqlite3.connect(db.url.database or "", timeout=0.05, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
        other.close()


def test_exact_decimals_and_utc_round_trip(db: Database) -> None:
    now = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    epsilon = Decimal("0.100000000000000000000000000000000001")
    with db.session() as session:
        session.add(Tenant(id="t", created_at=now))
        session.flush()
        row = _dataset(now, epsilon)
        row.epsilon_spent = Decimal("Infinity")
        session.add(row)
    with db.session(readonly=True) as session:
        row = session.get_one(Dataset, "ds_1")
        assert row.epsilon_budget == epsilon and str(row.epsilon_budget) == str(epsilon)
        assert row.epsilon_spent == Decimal("Infinity")
        assert row.delta_budget == Decimal("1E-10")
        assert row.created_at == now and row.created_at.tzinfo is not None
        later = session.scalar(select(Dataset.id).where(Dataset.created_at < now + timedelta(microseconds=1)))
        assert later == "ds_1"


def test_unique_violation_becomes_domain_error(db: Database) -> None:
    now = datetime.now(UTC)
    with db.session() as session:
        session.add(Tenant(id="t", created_at=now))
    with pytest.raises(Conflict) as info, db.session() as session:
        session.add(Tenant(id="t", created_at=now))
    assert info.value.reason == "tenant_exists"
    assert info.value.__cause__ is not None


def test_ledger_head_lock_serialises_spends(db: Database) -> None:
    """Two transactions incrementing the head's version concurrently never lose an update."""
    now = datetime.now(UTC)
    with db.session() as session:
        session.add(Tenant(id="t", created_at=now))
        session.flush()
        session.add(_dataset(now, Decimal(1)))

    def bump() -> None:
        for _ in range(10):
            with db.session() as session:
                head = lock_ledger_head(session.connection(), "ds_1")
                assert head is not None
                version = head.ledger_version
                time.sleep(0.001)
                session.execute(
                    update(Dataset).where(Dataset.id == "ds_1").values(ledger_version=version + 1)
                )

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with db.session(readonly=True) as session:
        assert session.get_one(Dataset, "ds_1").ledger_version == 40
