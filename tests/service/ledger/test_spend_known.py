"""What a process knows of a dataset's spend rows (``spending.store.KNOWN``) is used only while
the dataset's head is where it was when learned: another process's spend, a deletion, or a
spend of this process in another engine moves the head, and the next spend reads the database.

Two ``Database`` objects on one database stand for two API processes (each engine has its own
entry). Each test fails if a stale entry were trusted: a charge past the budget admitted, a
reservation committed twice, a deleted batch charged.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine

from service.db.session import Database
from service.ledger import batches, reservations
from service.ledger.errors import BudgetExceeded, Conflict, NotFound
from service.ledger.reservations import parse_event
from service.ledger.spending.store import Known, KnownDatasets, Learned
from service.ledger.spent import get_spend
from tests.service.ledger.conftest import MakeDataset

EVENT = {"kind": "pure_dp", "epsilon": 0.001}


def _budget(epsilon: str) -> dict[str, str]:
    return {"rule": "sequential", "epsilon": epsilon, "delta": "0", "accountant": "basic"}


@pytest.fixture
def other(ledger: Database) -> Iterator[Database]:
    """A second engine on the same database: another process, as far as caches go."""
    database = Database(ledger.engine.url, pool_size=2, max_overflow=2)
    try:
        yield database
    finally:
        database.dispose()


def _spend(db: Database, dataset_id: str, batch_id: str, version: int) -> None:
    held = reservations.reserve(
        db, "t1", dataset_id, event=parse_event(EVENT), batch_ids=[batch_id]
    ).to_json()
    reservations.commit(db, "t1", held["id"], release={"model": "m", "version": version})


def test_a_spend_by_another_process_is_seen(
    ledger: Database, other: Database, make_dataset: MakeDataset
) -> None:
    layout = make_dataset(_budget("0.0035"), tasks=[1])
    batch_id = layout.batches[0][0]
    _spend(ledger, layout.id, batch_id, 1)
    _spend(ledger, layout.id, batch_id, 2)  # this process knows the batch, its task, its reservations
    _spend(other, layout.id, batch_id, 3)  # 0.003 spent: a fourth 0.001 does not fit 0.0035
    with pytest.raises(BudgetExceeded):
        reservations.reserve(ledger, "t1", layout.id, event=parse_event(EVENT), batch_ids=[batch_id])
    spend = get_spend(ledger, "t1", layout.id).to_json()
    assert spend["charges_committed"] == 3
    assert spend["tasks"][0]["epsilon_spent"] == "0.003"


def test_a_reservation_committed_by_another_process_is_not_committed_again(
    ledger: Database, other: Database, make_dataset: MakeDataset
) -> None:
    layout = make_dataset(_budget("1"), tasks=[1])
    batch_id = layout.batches[0][0]
    _spend(ledger, layout.id, batch_id, 1)
    held = reservations.reserve(
        ledger, "t1", layout.id, event=parse_event(EVENT), batch_ids=[batch_id]
    ).to_json()
    reservations.commit(other, "t1", held["id"], release={"model": "m", "version": 2})
    with pytest.raises(Conflict) as refused:  # this process knew it open: the head says otherwise
        reservations.commit(ledger, "t1", held["id"], release={"model": "m", "version": 3})
    assert refused.value.reason == "reservation_closed"
    spend = get_spend(ledger, "t1", layout.id).to_json()
    assert (spend["charges_committed"], spend["epsilon_spent"]) == (2, "0.002")


@pytest.mark.parametrize("deleter", ["this", "other"])
def test_a_deleted_batch_is_not_charged(
    ledger: Database, other: Database, make_dataset: MakeDataset, deleter: str
) -> None:
    layout = make_dataset(_budget("0.0015"), tasks=[2])
    [kept, doomed] = layout.batches[0]
    with pytest.raises(BudgetExceeded):  # read (and known) in a committed transaction, never charged
        reservations.reserve(
            ledger,
            "t1",
            layout.id,
            event=parse_event({"kind": "pure_dp", "epsilon": 0.002}),
            batch_ids=[doomed],
        )
    _spend(ledger, layout.id, kept, 1)
    batches.delete_batch(ledger if deleter == "this" else other, "t1", layout.id, layout.tasks[0], doomed)
    with pytest.raises(NotFound) as missing:
        reservations.reserve(ledger, "t1", layout.id, event=parse_event(EVENT), batch_ids=[doomed])
    assert missing.value.args and doomed in str(missing.value)


def test_what_a_process_knows_is_bounded() -> None:
    """The least recently used dataset is forgotten first; an entry alone above the bound is
    emptied; a transaction that committed after another opened the dataset adds nothing."""
    engine = create_engine("sqlite://")
    known = KnownDatasets(rows=3)

    def learn(dataset_id: str, batches: int, entry: Known | None = None) -> Known:
        entry = entry or known.at(engine, dataset_id, (0, 0, ""))
        learned = Learned({f"b{i}": ("s", "t") for i in range(batches)}, {}, [], {})
        known.learn(engine, dataset_id, entry, entry.mark, (1, 1, dataset_id), learned)
        return entry

    a = learn("a", 2)
    b = learn("b", 2)  # 4 rows > 3: "a" goes
    assert known.at(engine, "a", (1, 1, "a")) is not a and len(b.batches) == 2
    c = learn("c", 4)  # alone above the bound once "a" (empty now) and "b" are gone
    assert not c.batches and known.at(engine, "c", (1, 1, "c")) is c
    stale = known.at(engine, "d", (0, 0, ""))
    fresh = known.at(engine, "d", (5, 5, "x"))  # another transaction opened "d" at a newer mark
    known.learn(engine, "d", stale, (0, 0, ""), (1, 1, ""), Learned({"b": ("s", "t")}, {}, [], {}))
    assert not fresh.batches and known.at(engine, "d", (5, 5, "x")) is fresh
    engine.dispose()
