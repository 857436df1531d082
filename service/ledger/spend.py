"""Spend: what a dataset has spent, read from aggregates only (never a scan of charges).

The spend transactions (``service.ledger.reservations``) keep, on the dataset row, the maxima
over its disjoint batches of the committed spend under the rule, of δ, and of the naive
sequential ε, plus the open holds; on each task row the maxima over its batches. This read is
two indexed queries whatever the number of charges.

Answer (numbers are decimal strings — exact, as stored; never binary floats)::

    {dataset_id, rule, accountant, epsilon_budget, delta_budget,
     epsilon_spent, delta_spent, epsilon_remaining, naive_sequential_epsilon,
     epsilon_held, reservations_open, charges_committed, ledger_version, last_release,
     guarantee: {epsilon, delta, covers}, epsilon_spent_is,
     geometric?: {first, ratio, infinite_horizon_bound},
     tasks: [{id, name, epsilon_spent, delta_spent, naive_sequential_epsilon}]}

``guarantee`` is the (ε, δ)-DP guarantee of everything released from the dataset so far, valid
under adaptive stopping (``accountant.statements.spend_guarantee``): for a Rényi filter the
filter's budget once anything ran, whose ``epsilon_spent`` is its progress — a budget share, not
a guarantee (``epsilon_spent_is`` says which it is).

``epsilon_remaining`` is ``epsilon_budget − epsilon_spent`` (the most-spent batch's headroom;
what one more charge may cost also depends on the rule, e.g. geometric levels, and on open
holds). ``epsilon_held`` is the sum of the open reservations' uncommitted ε.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from accountant.exact import ZERO, exact_sub, to_text
from accountant.statements import spend_guarantee, spend_meaning
from service.db.models import Dataset, Task
from service.db.session import Database
from service.ledger.datasets import budget_of, can_be_id
from service.ledger.dp_statement import covers
from service.ledger.errors import NotFound


def get_spend(db: Database, tenant_id: str, dataset_id: str) -> dict[str, Any]:
    """The dataset's spend from its aggregates (another tenant's dataset is ``NotFound``)."""
    with db.session(readonly=True) as session:
        row = session.get(Dataset, dataset_id) if can_be_id(dataset_id) else None
        if row is None or row.tenant_id != tenant_id:
            raise NotFound("dataset", dataset_id)
        tasks = session.execute(
            select(Task.id, Task.name, Task.epsilon_spent, Task.delta_spent, Task.naive_epsilon)
            .where(Task.dataset_id == dataset_id)
            .order_by(Task.created_at, Task.id)
        ).all()
    answer: dict[str, Any] = {
        "dataset_id": row.id,
        "rule": row.rule,
        "accountant": row.accountant,
        "epsilon_budget": to_text(row.epsilon_budget),
        "delta_budget": to_text(row.delta_budget),
        "epsilon_spent": to_text(row.epsilon_spent),
        "delta_spent": to_text(row.delta_spent),
        "epsilon_remaining": to_text(max(ZERO, exact_sub(row.epsilon_budget, row.epsilon_spent))),
        "naive_sequential_epsilon": to_text(row.naive_epsilon),
        "epsilon_held": to_text(row.epsilon_held),
        "reservations_open": row.reservations_open,
        "charges_committed": row.charges_committed,
        "ledger_version": row.ledger_version,
        "last_release": row.last_release,
        "tasks": [
            {
                "id": t.id,
                "name": t.name,
                "epsilon_spent": to_text(t.epsilon_spent),
                "delta_spent": to_text(t.delta_spent),
                "naive_sequential_epsilon": to_text(t.naive_epsilon),
            }
            for t in tasks
        ],
    }
    budget = budget_of(row)
    eps, dlt = spend_guarantee(budget, row.epsilon_spent, row.delta_spent)
    answer["guarantee"] = {"epsilon": to_text(eps), "delta": to_text(dlt), "covers": covers(budget)}
    answer["epsilon_spent_is"] = spend_meaning(budget)
    schedule = budget.geometric
    if schedule is not None:
        answer["geometric"] = {
            **schedule.to_json(),
            "infinite_horizon_bound": to_text(schedule.infinite_horizon_bound()),
        }
    return answer


__all__ = ["get_spend"]
