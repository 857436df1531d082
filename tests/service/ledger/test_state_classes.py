"""Batch state classes against a row-per-batch oracle.

The ledger decides a charge once per distinct state and moves batches between states with one
statement per state (docs/ARCHITECTURE.md, "Batch state classes"). The oracle keeps one
``BatchState`` per batch and calls ``accountant.rules`` once per batch, as the ledger did before.
Any sequence of reserves (on random subsets of batches, or on whole tasks), progressive and final
commits and aborts must give both the same verdicts (admitted, or refused with the same code) and,
after every step, the same state on every batch — on SQLite and PostgreSQL. The second test makes
every whole-task charge over more than two batches read its tasks as compact tasks (the task holds
the state of all its batches: ``Task.state_id``) and adds batches to tasks between charges, so
whole-task charges, per-batch charges and new batches of a compact task interleave.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from accountant import events as ev
from accountant import rules
from accountant.certificates import check_batch_set, verify
from accountant.errors import AccountantError
from service.db.models import Batch, BatchStateRow, ReservationBatch, Task
from service.db.session import Database
from service.ledger import batches, reservations
from service.ledger.errors import LedgerError
from service.ledger.reservations import parse_event
from service.ledger.spending import store
from tests.service.ledger.conftest import MakeDataset

BUDGETS = {
    "sequential": {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"},
    "parallel": {"rule": "parallel", "epsilon": "1", "delta": "0", "accountant": "basic"},
    "geometric": {"rule": "geometric", "epsilon": "1", "delta": "0", "accountant": "basic"},
    "lifelong": {"rule": "lifelong", "epsilon": "1", "delta": "0", "accountant": "basic"},
}
TASKS = (3, 2, 3)  # batches per task: 8 batches

# One step: ("reserve", batch subset mask or task index, epsilon index, commitment index),
# ("commit", reservation index, partial), ("abort", reservation index).
steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("reserve"),
            st.one_of(st.integers(1, 2 ** sum(TASKS) - 1), st.integers(-len(TASKS), -1)),
            st.integers(0, 2),
            st.integers(0, 1),
        ),
        st.tuples(st.just("commit"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 7)),
    ),
    min_size=1,
    max_size=10,
)
# The same, with batches added to a task ("add", task index) and whole-task charges favoured,
# after a first charge on the whole first task (3 batches: it becomes compact).
compact_steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("reserve"),
            st.one_of(st.integers(-len(TASKS), -1), st.integers(1, 2 ** sum(TASKS) - 1)),
            st.integers(0, 2),
            st.integers(0, 1),
        ),
        st.tuples(st.just("reserve"), st.integers(-len(TASKS), -1), st.integers(0, 2), st.integers(0, 1)),
        st.tuples(st.just("commit"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 7)),
        st.tuples(st.just("reserve"), st.just(-len(TASKS) - 1), st.integers(0, 2), st.integers(0, 1)),
        st.tuples(st.just("add"), st.integers(0, len(TASKS))),
    ),
    min_size=1,
    max_size=12,
).map(lambda rest: [("reserve", -1, 0, 0), *rest])
# (Task index len(TASKS): a task created empty by the first "add" on it, whose batches are born
# compact; a charge on it before then charges the first task.)
EPSILONS = (0.1, 0.25, 0.4)


@dataclass
class Oracle:
    """One state per batch; one (reserved, committed) per batch of each reservation."""

    budget: rules.Budget
    states: dict[str, rules.BatchState]
    held: dict[str, dict[str, tuple[rules.Cost, rules.Cost | None]]] = field(default_factory=dict)
    charges: dict[str, rules.Charge] = field(default_factory=dict)
    committed_event: dict[str, ev.DpEvent | None] = field(default_factory=dict)

    def refusals(self, batch_ids: list[str], charge: rules.Charge) -> set[str]:
        """The codes the batches refuse ``charge`` with (the ledger names one of them)."""
        codes = set()
        for b in batch_ids:
            try:
                rules.reserve(self.budget, self.states[b], charge)
            except AccountantError as exc:
                codes.add(_code(exc))
        return codes

    def reserve(self, rid: str, batch_ids: list[str], charge: rules.Charge) -> None:
        admitted = {b: rules.reserve(self.budget, self.states[b], charge) for b in batch_ids}
        for b, a in admitted.items():
            self.states[b] = a.state
        self.held[rid] = {b: (a.cost, None) for b, a in admitted.items()}
        self.charges[rid] = charge
        self.committed_event[rid] = None

    def commit(self, rid: str, partial: ev.DpEvent | None) -> None:
        charge, previous = self.charges[rid], self.committed_event[rid]
        settled = {
            b: rules.commit(self.budget, self.states[b], charge, reserved, committed, partial, previous)
            for b, (reserved, committed) in self.held[rid].items()
        }
        for b, s in settled.items():
            self.states[b] = s.state
            self.held[rid][b] = (self.held[rid][b][0], s.committed)
        self.committed_event[rid] = partial

    def cancel(self, rid: str) -> None:
        for b, (reserved, committed) in self.held.pop(rid).items():
            self.states[b] = rules.cancel(self.budget, self.states[b], reserved, committed)


def _code(exc: Exception) -> str:
    if isinstance(exc, rules.BudgetExceeded):
        return "budget_exceeded"
    if isinstance(exc, rules.ChargeRefused):
        return exc.code
    if isinstance(exc, LedgerError):
        return str(exc.to_json().get("reason") or exc.code)
    return type(exc).__name__


def _stored_states(db: Database, dataset_id: str) -> dict[str, rules.BatchState]:
    """Each batch's state: its own pointer, or its compact task's."""
    query = (
        select(Batch.id, BatchStateRow.state)
        .join(BatchStateRow, BatchStateRow.id == store.EFFECTIVE_STATE)
        .where(Batch.dataset_id == dataset_id)
    )
    states = {row.id: rules.BatchState.from_json(row.state) for row in db.read_all(query)}
    # A compact task's batches have no pointer of their own; every other batch has one.
    mixed = (
        select(func.count())
        .select_from(Batch)
        .join(Task, Task.id == Batch.task_id)
        .where(Batch.dataset_id == dataset_id, Task.state_id.is_not(None), Batch.state_id.is_not(None))
    )
    unset = (
        select(func.count())
        .select_from(Batch)
        .join(Task, Task.id == Batch.task_id)
        .where(Batch.dataset_id == dataset_id, Task.state_id.is_(None), Batch.state_id.is_(None))
    )
    assert [db.read_all(mixed)[0][0], db.read_all(unset)[0][0]] == [0, 0]
    return states


@pytest.mark.parametrize("rule", sorted(BUDGETS))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=steps)
def test_any_charges_on_any_subsets_match_one_state_per_batch(
    ledger: Database, make_dataset: MakeDataset, rule: str, plan: list[tuple[Any, ...]]
) -> None:
    _run(ledger, make_dataset, rule, plan)


@pytest.mark.parametrize("rule", sorted(BUDGETS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=compact_steps)
def test_whole_task_charges_on_compact_tasks_match_one_state_per_batch(
    ledger: Database,
    make_dataset: MakeDataset,
    monkeypatch: pytest.MonkeyPatch,
    rule: str,
    plan: list[tuple[Any, ...]],
) -> None:
    monkeypatch.setattr(store, "SMALL_CHARGE", 2)  # a task of 3 batches is charged as a large one
    _run(ledger, make_dataset, rule, plan)


def test_a_whole_task_charge_moves_one_task_pointer(
    ledger: Database, make_dataset: MakeDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A charge on a whole task of more than ``SMALL_CHARGE`` batches in one state makes it
    compact and records one ``reservation_tasks`` row, no ``reservation_batches``; the next one
    moves the task's pointer only; the batch list and its certificate's batch set are the same
    as a row-per-batch reservation's; a per-batch charge and a new batch materialise it."""
    monkeypatch.setattr(store, "SMALL_CHARGE", 2)
    ds = make_dataset(BUDGETS["sequential"], tasks=(3, 1))
    event = {"kind": "pure_dp", "epsilon": 0.1}
    certificates = []
    for version in range(2):
        held = reservations.reserve(ledger, "t1", ds.id, event=parse_event(event), task_ids=[ds.tasks[0]])
        answer = reservations.commit(ledger, "t1", held.id, release={"model": "m", "version": str(version)})
        certificates.append((held.id, answer.to_json()["certificate"]["certificate"]))
    own = (
        select(func.count())
        .select_from(Batch)
        .where(Batch.task_id == ds.tasks[0], Batch.state_id.is_not(None))
    )
    task_state = select(Task.state_id).where(Task.id == ds.tasks[0])
    assert ledger.read_all(own)[0][0] == 0 and ledger.read_all(task_state)[0][0] is not None
    for rid, certificate in certificates:
        listed = reservations.all_batches(ledger, "t1", rid)
        assert sorted(b for b, _ in listed) == sorted(ds.batches[0]) and {c for _, c in listed} == {0}
        assert verify(certificate).ok and check_batch_set(certificate, listed).ok
        assert not ledger.read_all(
            select(func.count()).select_from(ReservationBatch).where(ReservationBatch.reservation_id == rid)
        )[0][0]
    states = _stored_states(ledger, ds.id)
    assert {states[b].epsilon_spent for b in ds.batches[0]} == {Decimal("0.2")}
    # One batch charged alone: the task is materialised, its other batches keep their state.
    held = reservations.reserve(ledger, "t1", ds.id, event=parse_event(event), batch_ids=[ds.batches[0][1]])
    reservations.commit(ledger, "t1", held.id, release={"model": "m", "version": "2"})
    assert ledger.read_all(task_state)[0][0] is None
    states = _stored_states(ledger, ds.id)
    assert [states[b].epsilon_spent for b in ds.batches[0]] == [
        Decimal("0.2"),
        Decimal("0.3"),
        Decimal("0.2"),
    ]
    for rid, certificate in certificates:  # the lists do not depend on how the task is stored
        assert check_batch_set(certificate, reservations.all_batches(ledger, "t1", rid)).ok


def _run(ledger: Database, make_dataset: MakeDataset, rule: str, plan: list[tuple[Any, ...]]) -> bool:
    """Run ``plan`` on the ledger and the oracle, comparing after every step; whether a task
    was ever compact."""
    ds = make_dataset(BUDGETS[rule], tasks=TASKS)
    task_batches = [list(b) for b in ds.batches]
    tasks = list(ds.tasks)
    empty = store.state_id(ds.id, rules.BatchState.empty())
    every = list(ds.all_batches)
    compacted = False
    budget = rules.Budget.from_json(ledger_budget(ledger, ds.id))
    oracle = Oracle(budget, {b: rules.BatchState.empty() for b in ds.all_batches})
    opened: list[str] = []
    version = 0
    for step in plan:
        if step[0] == "add":
            if step[1] == len(tasks):  # a new, empty task
                tasks.append(batches.create_task(ledger, "t1", ds.id, name=f"added-{len(tasks)}").id)
                task_batches.append([])
            task = tasks[step[1]]
            before = ledger.read_all(select(Task.state_id).where(Task.id == task))[0][0]
            empty_before = before == empty or not task_batches[step[1]]
            made = batches.create_batches(
                ledger,
                "t1",
                ds.id,
                task,
                batches=[{"name": f"added-{len(every)}", "records": [f"added-{len(every)}"]}],
            )
            for b in made.data:
                task_batches[step[1]].append(b.id)
                every.append(b.id)
                oracle.states[b.id] = rules.BatchState.empty()
            # Born compact into a task with no batches or compact in the empty state; else
            # every batch of the task has its own pointer (materialised, or as before).
            after = ledger.read_all(select(Task.state_id).where(Task.id == task))[0][0]
            assert after == (empty if empty_before else None), step
        elif step[0] == "reserve":
            _, selector, e, c = step
            event = {"kind": "pure_dp", "epsilon": EPSILONS[e]}
            commitment = f"noise-{c}" if rule == "lifelong" else None
            if selector < 0:
                task = -selector - 1 if -selector - 1 < len(tasks) else 0
                chosen, kwargs = list(task_batches[task]), {"task_ids": [tasks[task]]}
            else:
                chosen = [b for i, b in enumerate(ds.all_batches) if selector >> i & 1]
                kwargs = {"batch_ids": chosen}
            charge = rules.Charge(ev.from_json(event), commitment)
            refused = oracle.refusals(chosen, charge)
            rid_oracle = f"pending-{len(opened)}"
            if not refused:
                oracle.reserve(rid_oracle, chosen, charge)
            try:
                answer = reservations.reserve(
                    ledger, "t1", ds.id, event=parse_event(event), noise_commitment=commitment, **kwargs
                ).to_json()
            except LedgerError as exc:
                assert _code(exc) in refused, (step, refused, exc.to_json())
            else:
                assert not refused, (step, refused)
                oracle.held[answer["id"]] = oracle.held.pop(rid_oracle)
                oracle.charges[answer["id"]] = oracle.charges.pop(rid_oracle)
                oracle.committed_event[answer["id"]] = oracle.committed_event.pop(rid_oracle)
                opened.append(answer["id"])
                assert answer["batches"]["count"] == len(chosen)
                assert sorted(b for b, _ in reservations.all_batches(ledger, "t1", answer["id"])) == sorted(
                    chosen
                )
        elif opened:
            rid = opened[step[1] % len(opened)]
            if step[0] == "commit":
                partial = None
                if step[2]:  # a progressive commit: the reserved event itself, as the run so far
                    partial = oracle.charges[rid].event
                version += 1
                expected = None
                try:
                    snapshot = (dict(oracle.states), {b: v for b, v in oracle.held[rid].items()})
                    oracle.commit(rid, partial)
                    if partial is None:
                        oracle.held.pop(rid)
                except AccountantError as exc:
                    oracle.states, oracle.held[rid] = snapshot
                    expected = _code(exc)
                except KeyError:
                    expected = "reservation_closed"
                try:
                    answer = reservations.commit(
                        ledger,
                        "t1",
                        rid,
                        release={"model": f"m-{ds.id}", "version": str(version)},
                        event=partial,
                    ).to_json()
                except LedgerError as exc:
                    assert expected == _code(exc), (step, expected, exc.to_json())
                else:
                    assert expected is None, (step, expected)
                    certificate = answer["certificate"]["certificate"]
                    assert verify(certificate).ok
                    assert check_batch_set(certificate, reservations.all_batches(ledger, "t1", rid)).ok
            else:
                closed = rid not in oracle.held
                try:
                    reservations.abort(ledger, "t1", rid)
                except LedgerError as exc:
                    assert closed, exc.to_json()
                else:
                    if not closed:  # an abort charges the whole reserved event (issue 24 §2)
                        oracle.commit(rid, None)
                        oracle.held.pop(rid)
        assert _stored_states(ledger, ds.id) == oracle.states, step
        compacted = compacted or bool(
            ledger.read_all(select(Task.id).where(Task.dataset_id == ds.id, Task.state_id.is_not(None)))
        )
    spend = max((s.epsilon_spent for s in oracle.states.values()), default=Decimal(0))
    assert Decimal(reservations_spend(ledger, ds.id)) == spend
    return compacted


def ledger_budget(db: Database, dataset_id: str) -> dict[str, Any]:
    from service.ledger import datasets

    return dict(datasets.get_dataset(db, "t1", dataset_id).budget)


def reservations_spend(db: Database, dataset_id: str) -> str:
    from service.ledger import spent

    return str(spent.get_spend(db, "t1", dataset_id).to_json()["epsilon_spent"])
