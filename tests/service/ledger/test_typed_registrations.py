"""Datasets, tasks and batches answer typed values (``datasets.DatasetAnswer``,
``batches.TaskAnswer``, ``batches.BatchesCreated``): fields for in-process callers, one ``to_json``
for the edge. A key stores that wire form, and a replay answers the stored answer verbatim
(whatever server version wrote it) with its typed fields read from it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select, update

from service.db.models import IdempotencyKey
from service.db.session import Database
from service.ledger import batches, datasets

BUDGET = {"rule": "sequential", "epsilon": "1", "delta": "0.5", "accountant": "basic"}


def _stored(ledger: Database, key: str) -> dict[str, Any]:
    with ledger.session(readonly=True) as session:
        response: dict[str, Any] = session.scalar(
            select(IdempotencyKey.response).where(IdempotencyKey.key == key)
        )
    return response


def _rewrite(ledger: Database, key: str, response: dict[str, Any]) -> None:
    with ledger.session() as session:
        session.execute(update(IdempotencyKey).where(IdempotencyKey.key == key).values(response=response))


def test_registrations_are_typed_and_their_replays_equal_the_first_answers(ledger: Database) -> None:
    dataset = datasets.create_dataset(ledger, "t1", name="d", budget=BUDGET, idempotency_key="d-1")
    assert isinstance(dataset.created_at, datetime) and dataset.archived_at is None
    assert (dataset.records, dataset.warnings, dataset.budget["epsilon"]) == (0, (), "1")
    assert _stored(ledger, "d-1") == dataset.to_json()
    again = datasets.create_dataset(ledger, "t1", name="d", budget=BUDGET, idempotency_key="d-1")
    assert again == dataset and again.to_json() == dataset.to_json()

    task = batches.create_task(ledger, "t1", dataset.id, name="t", idempotency_key="t-1")
    assert (task.dataset_id, task.name) == (dataset.id, "t")
    assert batches.create_task(ledger, "t1", dataset.id, name="t", idempotency_key="t-1") == task
    assert batches.list_tasks(ledger, "t1", dataset.id).data == (task,)

    sent = [{"name": "b0", "records": ["a", "b"]}, {"name": "b1", "records": ["c"]}]
    made = batches.create_batches(ledger, "t1", dataset.id, task.id, batches=sent, idempotency_key="b-1")
    assert [(b.name, b.size, b.task_id) for b in made.data] == [("b0", 2, task.id), ("b1", 1, task.id)]
    assert _stored(ledger, "b-1") == made.to_json()
    replayed = batches.create_batches(ledger, "t1", dataset.id, task.id, batches=sent, idempotency_key="b-1")
    assert replayed == made and replayed.to_json() == made.to_json()

    # three records under delta 0.5: delta >= 1/N is warned of, typed
    (warning,) = datasets.get_dataset(ledger, "t1", dataset.id).warnings
    assert (warning.code, warning.field) == ("delta_not_below_one_over_n", "budget.delta")


def test_a_replay_answers_an_older_servers_stored_answer_verbatim(ledger: Database) -> None:
    first = datasets.create_dataset(ledger, "t1", name="d", budget=BUDGET, idempotency_key="d-1")
    older = first.to_json()
    for newer in ("records", "warnings", "archived_at", "data_source"):  # fields added since
        del older[newer]
    older["note"] = "written by an older server"
    _rewrite(ledger, "d-1", older)
    again = datasets.create_dataset(ledger, "t1", name="d", budget=BUDGET, idempotency_key="d-1")
    assert again.to_json() == older  # the stored bytes, not this server's shape
    assert (again.id, again.created_at, again.records, again.warnings) == (first.id, first.created_at, 0, ())
