"""Batch state classes against a row-per-batch oracle.

The ledger decides a charge once per distinct state and moves batches between states with one
statement per state (docs/ARCHITECTURE.md, "Batch state classes"). The oracle keeps one
``BatchState`` per batch and calls ``accountant.rules`` once per batch, as the ledger did before.
Any sequence of reserves (on random subsets of batches, or on whole tasks), progressive and final
commits and aborts must give both the same verdicts (admitted, or refused with the same code) and,
after every step, the same state on every batch — on SQLite and PostgreSQL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from accountant import events as ev
from accountant import rules
from accountant.certificates import check_batch_set, verify
from accountant.errors import AccountantError
from service.db.models import Batch, BatchStateRow
from service.db.session import Database
from service.ledger import reservations
from service.ledger.errors import LedgerError
from service.ledger.reservations import parse_event
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
    query = (
        select(Batch.id, BatchStateRow.state)
        .join(BatchStateRow, BatchStateRow.id == Batch.state_id)
        .where(Batch.dataset_id == dataset_id)
    )
    return {row.id: rules.BatchState.from_json(row.state) for row in db.read_all(query)}


@pytest.mark.parametrize("rule", sorted(BUDGETS))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=steps)
def test_any_charges_on_any_subsets_match_one_state_per_batch(
    ledger: Database, make_dataset: MakeDataset, rule: str, plan: list[tuple[Any, ...]]
) -> None:
    ds = make_dataset(BUDGETS[rule], tasks=TASKS)
    budget = rules.Budget.from_json(ledger_budget(ledger, ds.id))
    oracle = Oracle(budget, {b: rules.BatchState.empty() for b in ds.all_batches})
    opened: list[str] = []
    version = 0
    for step in plan:
        if step[0] == "reserve":
            _, selector, e, c = step
            event = {"kind": "pure_dp", "epsilon": EPSILONS[e]}
            commitment = f"noise-{c}" if rule == "lifelong" else None
            if selector < 0:
                task = -selector - 1
                chosen, kwargs = ds.batches[task], {"task_ids": [ds.tasks[task]]}
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
    spend = max((s.epsilon_spent for s in oracle.states.values()), default=Decimal(0))
    assert Decimal(reservations_spend(ledger, ds.id)) == spend


def ledger_budget(db: Database, dataset_id: str) -> dict[str, Any]:
    from service.ledger import datasets

    return dict(datasets.get_dataset(db, "t1", dataset_id)["budget"])


def reservations_spend(db: Database, dataset_id: str) -> str:
    from service.ledger import spend

    return str(spend.get_spend(db, "t1", dataset_id)["epsilon_spent"])
