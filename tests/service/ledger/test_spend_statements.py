"""The SQL of the common spend, counted: one single-batch pure-ε reserve + commit.

Counted on the real engine (SQLAlchemy's ``before_cursor_execute``), on SQLite and PostgreSQL,
after two spends have warmed the process's caches (budget, key ring, batch states, the dataset's
batches and reservations at its head). The count
fails when it grows: a new statement on this path is a decision (docs/ARCHITECTURE.md, "What a
charge touches", lists them). And no statement of a spend over a task's batches walks the other
batches of its dataset (SQLite's query plans: a charge costs what it touches, not the dataset).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import event, func, select

from accountant.rules import BatchState
from service.db.models import Batch, Task
from service.db.session import Database
from service.ledger import reservations
from service.ledger.reservations import parse_event
from service.ledger.spending.store import state_id
from tests.service.ledger.conftest import MakeDataset

# Reserve: head (+ next expiry); flush: new state, move, reservation (with its classes),
# membership, audit, head. Commit: head; flush: new state, move, reservation (with its classes),
# task maxima, release, certificate, audit, head. The batch, the reservation and its membership
# are known to the process from the spends before (``spending.store.KNOWN``): read on the first
# spend only, or when another process moved the dataset's head.
MOST_STATEMENTS = 16
BUDGET = {"rule": "sequential", "epsilon": "1000", "delta": "0", "accountant": "basic"}
EVENT = {"kind": "pure_dp", "epsilon": 0.001}


@contextmanager
def statements(db: Database) -> Iterator[list[str]]:
    """The statements ``db``'s engine sends in the block (a transaction's BEGIN left out)."""
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if not statement.startswith("BEGIN"):  # SQLite's BEGIN IMMEDIATE; psycopg's is implicit
            seen.append(" ".join(statement.split())[:120])

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(db.engine, "before_cursor_execute", record)


def _spend(db: Database, dataset_id: str, batch_id: str, version: int) -> None:
    held = reservations.reserve(
        db, "t1", dataset_id, event=parse_event(EVENT), batch_ids=[batch_id]
    ).to_json()
    reservations.commit(db, "t1", held["id"], release={"model": "m", "version": version})


def test_one_batch_reserve_and_commit_stays_within_its_statements(
    ledger: Database, make_dataset: MakeDataset
) -> None:
    layout = make_dataset(BUDGET, tasks=[2])
    batch_id = layout.batches[0][0]
    _spend(ledger, layout.id, batch_id, 1)
    _spend(ledger, layout.id, batch_id, 2)
    with statements(ledger) as seen:
        _spend(ledger, layout.id, batch_id, 3)
    listing = "\n".join(seen)
    assert len(seen) <= MOST_STATEMENTS, f"{len(seen)} statements:\n{listing}"
    # Nothing read per state (the process knows them) or for the release (the constraint checks).
    assert not [s for s in seen if s.startswith("SELECT batch_states")], listing
    assert not [s for s in seen if s.startswith("SELECT releases")], listing


def test_a_task_charge_reads_only_its_batches(ledger: Database, make_dataset: MakeDataset) -> None:
    """Every read and update of a reserve + commit over one task's batches is planned through the
    charge's own rows (the batch, task and membership keys), never through the index of the
    dataset's batches or a scan: with a large task beside it, a small charge stays small."""
    if ledger.dialect != "sqlite":
        pytest.skip("SQLite's plans are checked; PostgreSQL plans by its statistics")
    layout = make_dataset(BUDGET, tasks=[3, 2])
    # Born compact (in the empty state); one batch charged alone and aborted materialises the
    # task, so the charge below moves its batches by their own pointers.
    first = [layout.batches[0][0]]
    one = reservations.reserve(ledger, "t1", layout.id, event=parse_event(EVENT), batch_ids=first)
    reservations.abort(ledger, "t1", one.id)
    sent: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, statement: str, parameters: Any, _context: Any, many: bool) -> None:
        if statement.startswith(("SELECT", "UPDATE batches", "INSERT INTO reservation_batches")):
            sent.append((statement, parameters[0] if many else parameters))

    event.listen(ledger.engine, "before_cursor_execute", record)
    try:
        held = reservations.reserve(
            ledger, "t1", layout.id, event=parse_event(EVENT), task_ids=[layout.tasks[0]]
        ).to_json()
        reservations.commit(ledger, "t1", held["id"], release={"model": "m", "version": 1})
    finally:
        event.remove(ledger.engine, "before_cursor_execute", record)
    touching = [
        (q, p) for q, p in sent if "FROM batches" in q or "JOIN batches" in q or "UPDATE batches" in q
    ]
    assert len(touching) >= 4  # the selection, its membership rows, the commit's groups, the moves
    with ledger.engine.connect() as connection:
        for statement, parameters in touching:
            plan = [
                row[-1] for row in connection.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)
            ]
            walks = [step for step in plan if "SCAN batches" in step or "dataset_id" in step]
            assert not walks, f"{statement}\n{plan}"


# A reserve + commit over whole compact tasks (``Task.state_id``) the process has passed over:
# reserve: head, tasks, new state, the tasks' pointers, reservation, its task rows, audit, head;
# commit: head, the tasks' pointers and maxima, new state, the tasks' pointers, reservation, task
# maxima, release, certificate, audit, head — whatever the number of batches.
MOST_WHOLE_TASK_STATEMENTS = 18


@pytest.mark.parametrize("batches", [300, 900])
def test_a_whole_compact_task_charge_touches_no_batch_row(
    ledger: Database, make_dataset: MakeDataset, batches: int
) -> None:
    """Once a task is compact and the process knows its batch set, a charge on the whole task
    reads and writes no row of ``batches`` or ``reservation_batches``, in as many statements for
    300 batches as for 900."""
    layout = make_dataset(BUDGET, tasks=[batches])
    task_id = layout.tasks[0]

    def charge(version: int) -> None:
        held = reservations.reserve(ledger, "t1", layout.id, event=parse_event(EVENT), task_ids=[task_id])
        reservations.commit(ledger, "t1", held.id, release={"model": "m", "version": version})

    charge(1)  # the task becomes compact
    charge(2)
    with statements(ledger) as seen:
        charge(3)
    listing = "\n".join(seen)
    assert len(seen) <= MOST_WHOLE_TASK_STATEMENTS, f"{len(seen)} statements:\n{listing}"
    tables = ("FROM batches", "JOIN batches", "UPDATE batches", "INTO batches", "reservation_batches")
    touching = [s for s in seen if any(t in s for t in tables)]
    assert not touching, listing


@pytest.mark.parametrize("batches", [3, 300])
def test_a_fresh_task_first_whole_task_charge_writes_no_batch_row(
    ledger: Database, make_dataset: MakeDataset, batches: int
) -> None:
    """Batches are born compact: a new task's batches have no pointer of their own (the task
    holds the empty state), so even the first charge on the whole task writes no row of
    ``batches`` or ``reservation_batches``: it reads the batch ids once (the batch set) and
    moves the task's pointer."""
    layout = make_dataset(BUDGET, tasks=[batches, 2])
    task_id = layout.tasks[0]
    own = select(func.count()).select_from(Batch).where(Batch.task_id == task_id, Batch.state_id.is_not(None))
    task_state = select(Task.state_id).where(Task.id == task_id)
    empty = state_id(layout.id, BatchState.empty())
    assert ledger.read_all(own)[0][0] == 0 and ledger.read_all(task_state)[0][0] == empty
    with statements(ledger) as seen:
        held = reservations.reserve(ledger, "t1", layout.id, event=parse_event(EVENT), task_ids=[task_id])
        reservations.commit(ledger, "t1", held.id, release={"model": "m", "version": 1})
    listing = "\n".join(seen)
    writes = ("UPDATE batches", "INTO batches", "DELETE FROM batches", "reservation_batches")
    assert not [s for s in seen if any(w in s for w in writes)], listing
    assert ledger.read_all(own)[0][0] == 0 and ledger.read_all(task_state)[0][0] not in (None, empty)
    spent = ledger.read_all(select(Task.epsilon_spent).where(Task.id == task_id))[0][0]
    assert Decimal(spent) == Decimal("0.001")
    listed = reservations.all_batches(ledger, "t1", held.id)
    assert sorted(b for b, _ in listed) == sorted(layout.batches[0])
