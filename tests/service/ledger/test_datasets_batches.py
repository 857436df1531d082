"""Datasets, tasks and batches: budgets validated, tenants isolated, batches disjoint."""

from __future__ import annotations

import hashlib
import hmac
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from service.db.models import Batch, BatchRecord, Dataset
from service.db.session import Database
from service.ledger import audit, batches, datasets
from service.ledger.errors import BatchOverlap, IdempotencyConflict, InvalidInput, NotFound

BUDGET = {"rule": "sequential", "epsilon": 1.0, "delta": 1e-5, "accountant": "basic"}


def test_create_get_list_dataset(ledger: Database) -> None:
    created = datasets.create_dataset(ledger, "t1", name="mnist", budget=BUDGET)
    assert created.budget["epsilon"] == "1" and created.budget["rule"] == "sequential"
    assert datasets.get_dataset(ledger, "t1", created.id) == created
    assert datasets.list_datasets(ledger, "t1").to_json() == {"data": [created.to_json()], "count": 1}
    with pytest.raises(NotFound):
        datasets.get_dataset(ledger, "t2", created.id)
    assert datasets.list_datasets(ledger, "t2").count == 0


@pytest.mark.parametrize(
    ("budget", "field"),
    [
        ({**BUDGET, "epsilon": float("nan")}, "budget.epsilon"),
        ({**BUDGET, "epsilon": float("inf")}, "budget.epsilon"),
        ({**BUDGET, "epsilon": -1}, "budget.epsilon"),
        ({**BUDGET, "delta": 1.0}, "budget.delta"),
        ({**BUDGET, "rule": "magic"}, "budget.rule"),
        ({**BUDGET, "accountant": "guess"}, "budget.accountant"),
        ({k: v for k, v in BUDGET.items() if k != "delta"}, "budget.delta"),
        ({**BUDGET, "extra": 1}, "budget.extra"),
        ({**BUDGET, "accountant": "prv"}, "budget.plan"),
        (
            {**BUDGET, "accountant": "prv", "plan": [{"kind": "gaussian", "noise_multiplier": -1}]},
            "budget.plan[0].noise_multiplier",
        ),
    ],
)
def test_invalid_budget_names_the_field(ledger: Database, budget: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidInput) as info:
        datasets.create_dataset(ledger, "t1", name="d", budget=budget)
    assert info.value.field == field
    assert datasets.list_datasets(ledger, "t1").count == 0


def test_idempotent_dataset_creation(ledger: Database) -> None:
    first = datasets.create_dataset(ledger, "t1", name="d", budget=BUDGET, idempotency_key="k1")
    again = datasets.create_dataset(ledger, "t1", name="d", budget=BUDGET, idempotency_key="k1")
    assert first == again and first.to_json() == again.to_json()
    assert datasets.list_datasets(ledger, "t1").count == 1
    with pytest.raises(IdempotencyConflict):
        datasets.create_dataset(ledger, "t1", name="other", budget=BUDGET, idempotency_key="k1")
    # keys are per tenant
    other = datasets.create_dataset(ledger, "t2", name="d", budget=BUDGET, idempotency_key="k1")
    assert other.id != first.id


def test_batches_are_disjoint_and_overlap_names_the_record(ledger: Database) -> None:
    ds = datasets.create_dataset(ledger, "t1", name="d", budget=BUDGET).id
    task = batches.create_task(ledger, "t1", ds, name="task-1")
    created = batches.create_batches(
        ledger,
        "t1",
        ds,
        task.id,
        batches=[{"name": "b0", "records": ["a", "b", 3]}, {"name": "b1", "records": ["c"]}],
    )
    assert [(b.name, b.size) for b in created.data] == [("b0", 3), ("b1", 1)]
    with pytest.raises(BatchOverlap) as info:
        batches.create_batches(
            ledger, "t1", ds, task.id, batches=[{"name": "b2", "records": ["x", "y", "3", "c"]}]
        )
    assert info.value.record_id == "3"  # the first shared record, as the client gave it
    with pytest.raises(BatchOverlap) as info:
        batches.create_batches(ledger, "t1", ds, task.id, batches=[{"name": "b3", "records": ["z", "z"]}])
    assert info.value.record_id == "z"
    assert batches.count_records(ledger, ds) == 4  # refused calls stored nothing
    assert batches.list_batches(ledger, "t1", ds).count == 2
    # Another dataset may hold the same record ids; only hashes are stored.
    ds2 = datasets.create_dataset(ledger, "t1", name="d2", budget=BUDGET).id
    task2 = batches.create_task(ledger, "t1", ds2, name="task-1")
    batches.create_batches(ledger, "t1", ds2, task2.id, batches=[{"name": "b0", "records": ["a"]}])
    with ledger.session(readonly=True) as session:
        stored = session.scalars(select(BatchRecord.record_hash)).all()
        assert all(b"a" != bytes(h) and len(h) == 32 for h in stored)
    assert audit.verify(ledger).ok


def test_concurrent_overlapping_batches_one_wins(ledger: Database) -> None:
    ds = datasets.create_dataset(ledger, "t1", name="d", budget=BUDGET).id
    task = batches.create_task(ledger, "t1", ds, name="task-1").id
    results: list[object] = []

    def create(i: int) -> None:
        try:
            batches.create_batches(
                ledger, "t1", ds, task, batches=[{"name": f"b{i}", "records": [f"own-{i}", "shared"]}]
            )
            results.append("ok")
        except BatchOverlap as exc:
            results.append(exc.record_id)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results, key=str) == ["ok"] + ["shared"] * 5


def test_batch_input_errors_name_the_field(ledger: Database) -> None:
    ds = datasets.create_dataset(ledger, "t1", name="d", budget=BUDGET).id
    task = batches.create_task(ledger, "t1", ds, name="task-1").id
    cases = [
        ([], "batches"),
        ([{"name": "", "records": ["a"]}], "batches[0].name"),
        ([{"name": "b", "records": []}], "batches[0].records"),
        ([{"name": "b", "records": ["a", True]}], "batches[0].records[1]"),
        ([{"name": "b", "records": ["a", {"x": 1}]}], "batches[0].records[1]"),
    ]
    for payload, field in cases:
        with pytest.raises(InvalidInput) as info:
            batches.create_batches(ledger, "t1", ds, task, batches=payload)
        assert info.value.field == field
    with pytest.raises(NotFound):
        batches.create_batches(ledger, "t1", ds, "task_nope", batches=[{"name": "b", "records": ["a"]}])
    with pytest.raises(NotFound):
        batches.create_batches(ledger, "t2", ds, task, batches=[{"name": "b", "records": ["a"]}])
    with pytest.raises(NotFound):
        batches.create_task(ledger, "t2", ds, name="x")


@settings(max_examples=200, deadline=None)
@given(
    salt=st.binary(min_size=0, max_size=100),
    keys=st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=20),
)
def test_record_hashes_keyed_once_equal_hmac_sha256(salt: bytes, keys: list[str]) -> None:
    """The creation path's hashes (one keyed HMAC copied per record) are HMAC-SHA256 exactly, as
    the worker's gate recomputes them one at a time (``record_hash``): salts shorter and longer
    than SHA-256's 64-byte block, any text."""
    expected = [hmac.new(salt, k.encode(), hashlib.sha256).digest() for k in keys]
    assert batches.record_hashes(salt, keys) == expected
    assert [batches.record_hash(salt, k) for k in keys] == expected


def test_stored_records_are_what_was_sent_and_bad_ids_are_refused(ledger: Database) -> None:
    """The bulk path (ids checked in C, hashes sorted, binary COPY on PostgreSQL) stores exactly
    HMAC-SHA256(salt, id) per record under its own batch; a bad id anywhere in a large request is
    refused naming its field, a repeat naming the record, and nothing is stored."""

    ds = datasets.create_dataset(ledger, "t1", name="bulk", budget=BUDGET).id
    task = batches.create_task(ledger, "t1", ds, name="task-1").id
    sent = [{"name": f"b{i}", "records": [f"r{i}-{j}" for j in range(7)]} for i in range(300)]
    sent.append({"name": "ints", "records": [10**6 + j for j in range(5)]})
    sent.append({"name": "mixed", "records": ["m", 7, "x" * batches.MAX_RECORD_ID_LENGTH]})
    bad_cases = [
        ({"name": "bad", "records": ["ok", ""]}, "batches[302].records[1]"),
        (
            {"name": "bad", "records": ["ok", "x" * (batches.MAX_RECORD_ID_LENGTH + 1)]},
            "batches[302].records[1]",
        ),
        ({"name": "bad", "records": [1, 2, False]}, "batches[302].records[2]"),
        ({"name": "bad", "records": ["a", 1.5]}, "batches[302].records[1]"),
        ({"name": "bad", "records": [None]}, "batches[302].records[0]"),
    ]
    for bad, field in bad_cases:
        with pytest.raises(InvalidInput) as info:
            batches.create_batches(ledger, "t1", ds, task, batches=[*sent, bad])
        assert info.value.field == field
    for repeat, shared in (
        ({"name": "rep", "records": ["new", "r5-3"]}, "r5-3"),
        ({"name": "rep", "records": ["new", "1000002"]}, "1000002"),  # an integer and its text
        ({"name": "rep", "records": [7]}, 7),
    ):
        with pytest.raises(BatchOverlap) as over:
            batches.create_batches(ledger, "t1", ds, task, batches=[*sent, repeat])
        assert over.value.record_id == shared
    assert batches.count_records(ledger, ds) == 0
    created = batches.create_batches(ledger, "t1", ds, task, batches=sent).data
    assert [(b.name, b.size) for b in created] == [(b["name"], len(b["records"])) for b in sent]
    with ledger.session(readonly=True) as session:
        salt = session.get(Dataset, ds).record_salt
        stored = session.execute(  # through the integer keys: batch key -> its batch's id
            select(Batch.id, BatchRecord.record_hash)
            .join(Dataset, Dataset.key == BatchRecord.dataset_key)
            .join(Batch, (Batch.dataset_id == Dataset.id) & (Batch.key == BatchRecord.batch_key))
        ).all()
        assert session.scalar(select(func.count()).select_from(BatchRecord)) == len(stored)
    expected = {
        (made.id, hmac.new(salt, str(record).encode(), hashlib.sha256).digest())
        for made, batch in zip(created, sent, strict=True)
        for record in batch["records"]
    }
    assert {(batch_id, bytes(digest)) for batch_id, digest in stored} == expected
    assert len(stored) == len(expected)
    # the database's own refusal (already stored, not repeated within the request) names it too
    with pytest.raises(BatchOverlap) as over:
        batches.create_batches(
            ledger, "t1", ds, task, batches=[{"name": "again", "records": ["z", "r299-6"]}]
        )
    assert over.value.record_id == "r299-6"
    assert batches.count_records(ledger, ds) == len(expected)
    assert audit.verify(ledger).ok
    # a keyed creation hashes its request: a retry replays the answer, another request is refused
    keyed = [{"name": "k", "records": ["k1", 5]}]
    first = batches.create_batches(ledger, "t1", ds, task, batches=keyed, idempotency_key="kb")
    assert batches.create_batches(ledger, "t1", ds, task, batches=keyed, idempotency_key="kb") == first
    with pytest.raises(IdempotencyConflict):
        batches.create_batches(
            ledger, "t1", ds, task, batches=[{"name": "k", "records": ["k1", 6]}], idempotency_key="kb"
        )
    assert batches.count_records(ledger, ds) == len(expected) + 2
