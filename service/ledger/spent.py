"""What a dataset has spent, read from aggregates only (never a scan of charges) — the read; the
spend transactions that write it are ``service.ledger.spending``.

Typed inside the process: ``spent_of`` reads each dataset's ``Spent`` (``Decimal`` amounts,
datetimes, its guarantee), the one read behind ``get_spend`` (``DatasetSpend``: with its tasks'
``TaskSpent``), the dashboard's summaries and per-batch and history heads (``views``) and the
operator's ``/metrics`` gauges (``every_dataset_spend``); ``to_json`` makes the wire form below
at the edge.

The spend transactions (``service.ledger.reservations``) keep, on the dataset row, the maxima
over its disjoint batches of the committed spend under the rule, of δ, and of the naive
sequential ε, plus the open holds; on each task row the maxima over its batches. This read is
two indexed queries whatever the number of charges.

``DatasetSpend.to_json()`` (numbers are decimal strings — exact, as stored; never binary floats)::

    {dataset_id, rule, accountant, epsilon_budget, delta_budget,
     epsilon_spent, delta_spent, epsilon_remaining, naive_sequential_epsilon,
     epsilon_held, reservations_open, charges_committed, ledger_version, last_release,
     tasks: [{id, name, epsilon_spent, delta_spent, naive_sequential_epsilon,
              guarantee: {epsilon, delta}}],
     guarantee: {epsilon, delta, covers}, epsilon_spent_is,
     geometric?: {first, ratio, copies?, single?, infinite_horizon_bound}}

``guarantee`` is the (ε, δ)-DP guarantee of everything released from the dataset so far, valid
under adaptive stopping (``accountant.statements.spend_guarantee``): for a Rényi filter the
filter's budget once anything ran, whose ``epsilon_spent`` is its progress — a budget share, not
a guarantee (``epsilon_spent_is`` says which it is).

The aggregates alone understate it for data charged before pricing version 3
(``accountant.rules.memo``): a plan segment entered then is stored as its prefix until it
closes, a ``parallel`` progressive commit on ``rdp`` / ``prv`` as its prefix for good. So for
those two rules, on a dataset that existed before version 3 could be ruled out
(``Dataset.priced_before_v3``, set by migration ``5d2a8c4e1f63`` for every dataset then), the
guarantee is also derived the way ``batch_guarantee`` derives a batch's (``stored_guarantees``):
one more query, over the batches whose plan segment is open, or over the committed reservations'
reserved cost (by task: over their batches). Never for a dataset created since, nor for the
other rules: their read is two queries (the dataset row, its task rows), whatever the batches.
Each task carries its own ``guarantee`` the same way.

``epsilon_remaining`` is ``epsilon_budget − epsilon_spent`` (the most-spent batch's headroom;
what one more charge may cost also depends on the rule, e.g. geometric levels, and on open
holds). ``epsilon_held`` is the sum of the open reservations' uncommitted ε.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, NamedTuple

from sqlalchemy import select
from sqlalchemy.orm import Session

from accountant.errors import InvalidArgumentError
from accountant.exact import ZERO, exact_sub, to_text
from accountant.rules import BatchState, Budget
from accountant.statements import batch_guarantee, spend_guarantee, spend_meaning
from service.db.models import Batch, BatchStateRow, Dataset, Reservation, Task
from service.db.session import Database
from service.ledger.datasets import budget_of, load_dataset
from service.ledger.dp_statement import covers
from service.ledger.spending.answers import EpsilonDelta
from service.ledger.spending.store import EFFECTIVE_STATE, reservation_members

Pair = tuple[Decimal, Decimal]


@dataclass(frozen=True, slots=True)
class Spent:
    """What a dataset has spent, as its row (the ledger head) holds it, with the (ε, δ) guarantee
    of everything released from it (``stored_guarantees``): the numbers both the spend read
    (``DatasetSpend``) and the dashboard's summaries (``views.SpendSummary``) answer, made by one
    function (``spent_of``)."""

    dataset_id: str
    tenant_id: str
    name: str
    budget: Budget
    rule: str
    accountant: str
    epsilon_budget: Decimal
    delta_budget: Decimal
    epsilon_spent: Decimal
    delta_spent: Decimal
    naive_sequential_epsilon: Decimal
    epsilon_held: Decimal
    reservations_open: int
    charges_committed: int
    ledger_version: int
    last_release: dict[str, Any] | None
    last_release_at: datetime | None
    created_at: datetime
    archived_at: datetime | None
    guarantee: EpsilonDelta

    @classmethod
    def of(cls, row: Dataset, guarantee: Pair) -> Spent:
        return cls(
            row.id,
            row.tenant_id,
            row.name,
            budget_of(row),
            row.rule,
            row.accountant,
            row.epsilon_budget,
            row.delta_budget,
            row.epsilon_spent,
            row.delta_spent,
            row.naive_epsilon,
            row.epsilon_held,
            row.reservations_open,
            row.charges_committed,
            row.ledger_version,
            row.last_release,
            row.last_release_at,
            row.created_at,
            row.archived_at,
            EpsilonDelta(*guarantee),
        )

    @property
    def epsilon_remaining(self) -> Decimal:
        """The most-spent batch's headroom (module docstring), never below zero."""
        return max(ZERO, exact_sub(self.epsilon_budget, self.epsilon_spent))

    @property
    def epsilon_spent_is(self) -> str:
        """What ``epsilon_spent`` is under the budget: a guarantee, or a filter's progress."""
        return spend_meaning(self.budget)

    def budget_json(self) -> dict[str, str]:
        """The budget and the spend (exact decimal strings): the first numbers of both answers."""
        return {
            "rule": self.rule,
            "accountant": self.accountant,
            "epsilon_budget": to_text(self.epsilon_budget),
            "delta_budget": to_text(self.delta_budget),
            "epsilon_spent": to_text(self.epsilon_spent),
            "delta_spent": to_text(self.delta_spent),
            "epsilon_remaining": to_text(self.epsilon_remaining),
        }


def spent_of(session: Session, rows: Sequence[Dataset]) -> list[Spent]:
    """What each dataset of ``rows`` has spent: the one read behind the spend of a dataset, the
    dashboard's summaries and its per-batch and history heads."""
    guarantees = stored_guarantees(session, rows)
    return [Spent.of(r, guarantees[r.id]) for r in rows]


def every_dataset_spend(db: Database) -> list[Spent]:
    """What every tenant's datasets have spent (the operator's ``/metrics``, never a tenant's
    answer; ``tenant_id`` says whose), one query on the ledger heads."""
    with db.session(readonly=True) as session:
        rows = session.scalars(select(Dataset).order_by(Dataset.tenant_id, Dataset.id)).all()
        return spent_of(session, rows)


@dataclass(frozen=True, slots=True)
class TaskSpent:
    """What a task has spent: the maxima over its batches, and its own guarantee."""

    id: str
    name: str
    epsilon_spent: Decimal
    delta_spent: Decimal
    naive_sequential_epsilon: Decimal
    guarantee: EpsilonDelta

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "epsilon_spent": to_text(self.epsilon_spent),
            "delta_spent": to_text(self.delta_spent),
            "naive_sequential_epsilon": to_text(self.naive_sequential_epsilon),
            "guarantee": self.guarantee.to_json(),
        }


@dataclass(frozen=True, slots=True)
class DatasetSpend:
    """``get_spend``'s answer: the dataset's ``spent`` and its tasks' (registration order)."""

    spent: Spent
    tasks: tuple[TaskSpent, ...]

    def to_json(self) -> dict[str, Any]:
        spent = self.spent
        budget = spent.budget
        answer: dict[str, Any] = {
            "dataset_id": spent.dataset_id,
            **spent.budget_json(),
            "naive_sequential_epsilon": to_text(spent.naive_sequential_epsilon),
            "epsilon_held": to_text(spent.epsilon_held),
            "reservations_open": spent.reservations_open,
            "charges_committed": spent.charges_committed,
            "ledger_version": spent.ledger_version,
            "last_release": spent.last_release,
            "tasks": [t.to_json() for t in self.tasks],
            "guarantee": {**spent.guarantee.to_json(), "covers": covers(budget)},
            "epsilon_spent_is": spent.epsilon_spent_is,
        }
        schedule = budget.geometric
        if schedule is not None:
            answer["geometric"] = {
                **schedule.to_json(),
                "infinite_horizon_bound": to_text(schedule.infinite_horizon_bound()),
            }
        return answer


def get_spend(db: Database, tenant_id: str, dataset_id: str) -> DatasetSpend:
    """The dataset's spend from its aggregates (another tenant's dataset is ``NotFound``)."""
    with db.session(readonly=True) as session:
        row = load_dataset(session, tenant_id, dataset_id)
        tasks = session.execute(
            select(Task.id, Task.name, Task.epsilon_spent, Task.delta_spent, Task.naive_epsilon)
            .where(Task.dataset_id == dataset_id)
            .order_by(Task.created_at, Task.id)
        ).all()
        (spent,) = spent_of(session, [row])
        by_task = _derived(session, [row], by_task=True)
    budget = spent.budget
    return DatasetSpend(
        spent,
        tuple(
            TaskSpent(
                t.id,
                t.name,
                t.epsilon_spent,
                t.delta_spent,
                t.naive_epsilon,
                EpsilonDelta(
                    *max_pair(spend_guarantee(budget, t.epsilon_spent, t.delta_spent), by_task.get(t.id))
                ),
            )
            for t in tasks
        ),
    )


def max_pair(a: Pair, b: Pair | None) -> Pair:
    """The componentwise maximum of two (ε, δ) guarantees of disjoint parts (McSherry 2009,
    Thm. 4); ``b`` may be absent."""
    return a if b is None else (max(a[0], b[0]), max(a[1], b[1]))


def _understated(budget: Budget) -> bool:
    """Whether this rule's stored spend may be a prefix (data charged before pricing version 3)."""
    return (budget.rule == "sequential" and budget.accountant == "prv") or (
        budget.rule == "parallel" and budget.accountant != "basic"
    )


def _derived(session: Session, rows: Sequence[Dataset], *, by_task: bool = False) -> dict[str, Pair]:
    """Per dataset (or per task), the maximum over its batches of ``batch_guarantee`` where the
    stored spend may be a prefix: the batches with an open plan segment (``sequential`` /
    ``prv``: the whole open segment), the batches of committed reservations (``parallel`` on
    ``rdp`` / ``prv``: the whole reserved run). Empty for every other rule, and for a dataset
    created after pricing version 3 (``Dataset.priced_before_v3``: its stored spend is the whole
    run's): no query."""
    budgets = {r.id: budget_of(r) for r in rows if r.priced_before_v3}
    plans = [i for i, b in budgets.items() if _understated(b) and b.rule == "sequential"]
    runs = [i for i, b in budgets.items() if _understated(b) and b.rule == "parallel"]
    found: dict[str, Pair] = {}
    if plans:
        for dataset_id, task_id, state_json in session.execute(
            select(Batch.dataset_id, Batch.task_id, BatchStateRow.state)
            .join(BatchStateRow, BatchStateRow.id == EFFECTIVE_STATE)
            .where(Batch.dataset_id.in_(plans), BatchStateRow.state["plan_position"].as_integer() > 0)
        ):
            try:
                state = BatchState.from_json(state_json)
            except InvalidArgumentError:  # a state the ledger did not write: not interpreted
                continue
            key = task_id if by_task else dataset_id
            found[key] = max_pair(batch_guarantee(budgets[dataset_id], state), found.get(key))
    if runs:
        # Exact decimals are text on SQLite, so the maxima are taken here, not by SQL's max().
        key_column = Batch.task_id if by_task else Reservation.dataset_id
        query = (
            select(key_column, Reservation.epsilon, Reservation.delta)
            .where(Reservation.dataset_id.in_(runs), Reservation.commits > 0)
            .distinct()
        )
        if by_task:
            members = reservation_members()
            query = query.join(members, members.c.reservation_id == Reservation.id).join(
                Batch, Batch.id == members.c.batch_id
            )
        for key, eps, dlt in session.execute(query):
            found[key] = max_pair((eps, dlt), found.get(key))
    return found


def stored_guarantees(session: Session, rows: Sequence[Dataset]) -> dict[str, Pair]:
    """The (ε, δ) guarantee of everything released from each dataset of ``rows``: from its
    aggregates (``spend_guarantee``), and where those may hold a prefix charged before pricing
    version 3, at least the batches' own guarantees (``_derived``; module docstring)."""
    derived = _derived(session, rows)
    return {
        r.id: max_pair(spend_guarantee(budget_of(r), r.epsilon_spent, r.delta_spent), derived.get(r.id))
        for r in rows
    }


class ReservedCost(NamedTuple):
    """The (ε, δ) a reservation row reserved (``accountant.statements.Reserved``)."""

    epsilon: Decimal
    delta: Decimal


def reserved_of_batches(session: Session, batch_ids: Sequence[str]) -> dict[str, ReservedCost]:
    """The largest reserved cost of a committed reservation on each batch (``batch_guarantee``'s
    ``reserved`` for a ``parallel`` batch: the whole run its one charge reserved)."""
    if not batch_ids:
        return {}
    found: dict[str, ReservedCost] = {}
    members = reservation_members()
    for batch_id, eps, dlt in session.execute(
        select(members.c.batch_id, Reservation.epsilon, Reservation.delta)
        .join(Reservation, Reservation.id == members.c.reservation_id)
        .where(members.c.batch_id.in_(batch_ids), Reservation.commits > 0)
    ):
        known = found.get(batch_id, ReservedCost(eps, dlt))
        found[batch_id] = ReservedCost(max(eps, known.epsilon), max(dlt, known.delta))
    return found


__all__ = [
    "DatasetSpend",
    "Spent",
    "TaskSpent",
    "every_dataset_spend",
    "get_spend",
    "max_pair",
    "reserved_of_batches",
    "spent_of",
    "stored_guarantees",
]
