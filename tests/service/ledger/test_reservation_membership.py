"""A reservation's batch list is the batches it covered when it was made, forever (issue 26).

A reservation of whole compact tasks records one ``reservation_tasks`` row per task (its batches
up to the last position it read), and its paged batch list expands that row into the task's
*current* batches. Whatever later happens to the task — batches added to it, batches of it
deleted (possible once a full refund left them empty), the task deleted, a deleted last position
taken again by a new batch — the list must still name exactly the batches the reservation
covered, in their classes, so that its ``batch_set`` (and a certificate's, checked offline by
``check_batch_set``) proves them. Run on SQLite and PostgreSQL.
"""

from __future__ import annotations

from decimal import Decimal

import pytest
from sqlalchemy import func, select

from accountant.certificates import batch_set_hash, check_batch_set, verify
from service.db.models import ReservationBatch, ReservationTask
from service.db.session import Database
from service.ledger import batches, certificates, reservations
from service.ledger.errors import InvalidInput
from service.ledger.reservations import Ran, parse_event
from service.ledger.spending import decisions
from tests.service.ledger.conftest import Layout, MakeDataset

BUDGET = {"rule": "sequential", "epsilon": "10", "delta": "0", "accountant": "basic"}
EVENT = {"kind": "pure_dp", "epsilon": 0.1}


def _listed(ledger: Database, reservation_id: str) -> list[tuple[str, int]]:
    return reservations.all_batches(ledger, "t1", reservation_id)


def _assert_lists(ledger: Database, reservation_id: str, covered: list[str]) -> None:
    """The list names ``covered`` (class 0), and matches the reservation's own batch set."""
    listed = _listed(ledger, reservation_id)
    page = reservations.list_batches(ledger, "t1", reservation_id)
    assert sorted(b for b, _ in listed) == sorted(covered)
    assert {c for _, c in listed} == {0}
    assert page.count == len(listed) and page.batch_set == batch_set_hash(listed)


def _add(ledger: Database, ds: Layout, task: int, names: list[str]) -> list[str]:
    created = batches.create_batches(
        ledger,
        "t1",
        ds.id,
        ds.tasks[task],
        batches=[{"name": n, "records": [f"{n}-{i}" for i in range(2)]} for n in names],
    )
    return [row.id for row in created.data]


def _whole_task_rows(ledger: Database, reservation_id: str) -> tuple[int, int]:
    """``(reservation_tasks rows, reservation_batches rows)`` of a reservation."""
    tasks = (
        select(func.count())
        .select_from(ReservationTask)
        .where(ReservationTask.reservation_id == reservation_id)
    )
    rows = (
        select(func.count())
        .select_from(ReservationBatch)
        .where(ReservationBatch.reservation_id == reservation_id)
    )
    return ledger.read_all(tasks)[0][0], ledger.read_all(rows)[0][0]


def test_a_refunded_whole_task_reservation_lists_its_batches_after_they_are_deleted(
    ledger: Database, make_dataset: MakeDataset
) -> None:
    """Refunded in full (``Ran(None)``: no data read), a whole-task reservation leaves its
    batches empty, so they may be deleted; its list still names them — a middle batch, the
    last one (whose position a new batch then takes), and then the whole task."""
    ds = make_dataset(BUDGET, tasks=(4, 2))
    held = reservations.reserve(ledger, "t1", ds.id, event=parse_event(EVENT), task_ids=ds.tasks)
    assert _whole_task_rows(ledger, held.id) == (2, 0)  # born compact: one row per task
    covered = ds.all_batches
    _assert_lists(ledger, held.id, covered)
    reservations.abort(ledger, "t1", held.id, ran=Ran(None))
    # A later refunded reservation of the first task only: both must keep their lists.
    later = reservations.reserve(ledger, "t1", ds.id, event=parse_event(EVENT), task_ids=[ds.tasks[0]])
    reservations.abort(ledger, "t1", later.id, ran=Ran(None))

    batches.delete_batch(ledger, "t1", ds.id, ds.tasks[0], ds.batches[0][1])  # a middle batch
    _assert_lists(ledger, held.id, covered)
    _assert_lists(ledger, later.id, ds.batches[0])
    batches.delete_batch(ledger, "t1", ds.id, ds.tasks[0], ds.batches[0][3])  # the last one
    (reused,) = _add(ledger, ds, 0, ["takes-the-last-position"])
    position = batches.task_batches(ledger, "t1", ds.id, ds.tasks[0]).data[-1].position
    assert position == 3  # the deleted batch's position, taken again
    _assert_lists(ledger, held.id, covered)
    _assert_lists(ledger, later.id, ds.batches[0])
    batches.delete_task(ledger, "t1", ds.id, ds.tasks[1])
    _assert_lists(ledger, held.id, covered)
    # A new reservation of what is left covers what is there now, and nothing deleted.
    now = reservations.reserve(ledger, "t1", ds.id, event=parse_event(EVENT), task_ids=[ds.tasks[0]])
    _assert_lists(ledger, now.id, [ds.batches[0][0], ds.batches[0][2], reused])


@pytest.mark.parametrize("outcome", ["reserved", "committed", "aborted", "refunded", "expired"])
def test_batches_added_to_a_task_after_a_whole_task_reservation_are_not_listed(
    ledger: Database, make_dataset: MakeDataset, outcome: str
) -> None:
    """New batches of a task a reservation read whole are not in its list, whatever became of
    the reservation; its certificate (if any) re-verifies against the list, and a reservation
    still open then commits only what it covered."""
    ds = make_dataset(BUDGET, tasks=(3,))
    held = reservations.reserve(ledger, "t1", ds.id, event=parse_event(EVENT), task_ids=ds.tasks, ttl_s=60)
    if outcome == "committed":
        reservations.commit(ledger, "t1", held.id, release={"model": "m", "version": "1"})
    elif outcome in ("aborted", "refunded"):
        reservations.abort(ledger, "t1", held.id, ran=Ran(None) if outcome == "refunded" else None)
    elif outcome == "expired":
        reservations.expire_due(ledger, now=held.expires_at + (held.expires_at - held.created_at))
    added = _add(ledger, ds, 0, ["new-1", "new-2"])
    _assert_lists(ledger, held.id, ds.batches[0])
    if outcome == "refunded":  # the refunded batches may go; the list stays
        batches.delete_batch(ledger, "t1", ds.id, ds.tasks[0], ds.batches[0][2])
        batches.delete_batch(ledger, "t1", ds.id, ds.tasks[0], added[1])
        _add(ledger, ds, 0, ["new-3"])
        _assert_lists(ledger, held.id, ds.batches[0])
    if outcome == "reserved":  # still open: the commit moves what it covered, no more
        reservations.commit(ledger, "t1", held.id, release={"model": "m", "version": "1"})
        pages = batches.task_batches(ledger, "t1", ds.id, ds.tasks[0]).data
        spent = {b.id: b.spend.epsilon_spent for b in pages}
        assert {spent[b] for b in ds.batches[0]} == {Decimal("0.1")} and {spent[b] for b in added} == {0}
        _assert_lists(ledger, held.id, ds.batches[0])
    issued = certificates.list_certificates(ledger, "t1", ds.id)["data"]
    assert len(issued) == (0 if outcome == "refunded" else 1)
    for stored in issued:  # what ``ledger check`` runs on an exported bundle's batch_sets
        assert stored["reservation_id"] == held.id
        certificate = stored["certificate"]
        assert verify(certificate).ok and check_batch_set(certificate, _listed(ledger, held.id)).ok


def test_whole_compact_tasks_with_no_batches_or_too_many_are_refused(
    ledger: Database, make_dataset: MakeDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass over whole compact tasks (their ids only) refuses, changing nothing, tasks
    whose batches were all deleted and tasks over more batches than a reservation may read."""
    ds = make_dataset(BUDGET, tasks=(2, 3))
    for batch_id in ds.batches[0]:
        batches.delete_batch(ledger, "t1", ds.id, ds.tasks[0], batch_id)
    with pytest.raises(InvalidInput, match="no batches") as refused:
        reservations.reserve(ledger, "t1", ds.id, event=parse_event(EVENT), task_ids=[ds.tasks[0]])
    assert refused.value.field == "tasks"
    monkeypatch.setattr(decisions, "MAX_BATCHES_PER_RESERVATION", 2)
    with pytest.raises(InvalidInput, match="more than 2 batches"):
        reservations.reserve(ledger, "t1", ds.id, event=parse_event(EVENT), task_ids=[ds.tasks[1]])
    monkeypatch.setattr(decisions, "MAX_BATCHES_PER_RESERVATION", 3)
    held = reservations.reserve(ledger, "t1", ds.id, event=parse_event(EVENT), task_ids=ds.tasks)
    _assert_lists(ledger, held.id, ds.batches[1])
