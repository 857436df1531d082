"""Dry-run quotes: what a charge *would* cost on a dataset's batches, nothing held or written.

``POST /v1/datasets/{id}/quote`` answers the cost the ledger would certify for an event on the
named batches (or tasks), or on a fresh batch of the dataset when none are named, under the
dataset's own budget: the same rule, accountant, grid and δ split a reservation meets
(``accountant.rules.reserve`` on the batches' current states). Clients calibrate to it — a DP-SGD
run's σ chosen so that the *dataset's* price fits what is left, not a price computed on another
accountant's grid (Opacus's RDP, dp-accounting's PLD), which a Rényi filter with a δ split can
exceed.

A quote is advisory: the states may change before a reservation arrives, and the reservation
decides. It prices exactly like a reservation, so it is bounded and metered the same way
(``service.ledger.pricing``), and it reads only the tenant's own dataset (another tenant's is
``NotFound``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

from accountant import rules
from accountant.errors import AccountantError
from accountant.events import DpEvent
from accountant.exact import ZERO, to_text
from accountant.rules import BatchState, Budget, Charge, PriceMemo
from service.db.session import Database
from service.ledger import pricing
from service.ledger.errors import InvalidInput, NotFound
from service.ledger.spending import requests
from service.ledger.spending.decisions import rule_error
from service.ledger.spending.requests import parse_event
from service.ledger.spending.store import batch_cost_json, batch_states, dataset_budget

FRESH_BATCH = "(new batch)"


def quote(
    db: Database,
    tenant_id: str,
    dataset_id: str,
    *,
    event_json: object,
    batch_ids: Sequence[str] | None = None,
    task_ids: Sequence[str] | None = None,
    noise_commitment: str | None = None,
    policy: pricing.Policy | None = None,
) -> dict[str, Any]:
    """``{dataset_id, admitted, cost: {epsilon, delta}, batches: [{id, epsilon, delta,
    naive_epsilon, level?, replay?}], refused}``: ``cost`` is the maximum over the batches (what a
    reservation would hold), or the refused charge's ``requested`` cost; ``refused`` is ``None``
    or ``{code, message, batch_id, requested?, remaining?}`` (the 409 a reservation would get).

    Raises ``InvalidInput`` (bad event, ids, or pricing above ``policy.max_work``) and
    ``NotFound`` (dataset, batch or task; also another tenant's)."""
    if batch_ids is not None and task_ids is not None:
        raise InvalidInput("batches", "give at most one of batches or tasks.")
    charge = requests.charge(parse_event(event_json), noise_commitment)
    budget = _own_budget(db, tenant_id, dataset_id)
    states = _states(db, dataset_id, batch_ids, task_ids)
    return _priced(dataset_id, budget, charge, states, policy or pricing.DEFAULT_POLICY)


def price_function(
    db: Database, tenant_id: str, dataset_id: str, task_ids: Sequence[str]
) -> Callable[[DpEvent], Decimal]:
    """``event -> ε`` a reservation on every batch of ``task_ids`` would be charged (``quote``'s
    ``cost``; by task, so that a dataset of more than ``MAX_IDS_PER_REQUEST`` batches is priced), for
    a calibration that prices many events: the budget and the batches' states are read once, on
    the first call, and reused (the reservation decides on the states it reads under the lock)."""
    loaded: list[tuple[Budget, list[tuple[str, BatchState]]]] = []

    def price(event: DpEvent) -> Decimal:
        if not loaded:
            budget = _own_budget(db, tenant_id, dataset_id)
            loaded.append((budget, _states(db, dataset_id, None, task_ids)))
        budget, states = loaded[0]
        answer = _priced(dataset_id, budget, requests.charge(event, None), states, pricing.DEFAULT_POLICY)
        return Decimal(answer["cost"]["epsilon"])

    return price


def _own_budget(db: Database, tenant_id: str, dataset_id: str) -> Budget:
    tenant, budget = dataset_budget(db, dataset_id)
    if tenant != tenant_id:
        raise NotFound("dataset", dataset_id)
    return budget


def _states(
    db: Database, dataset_id: str, batch_ids: Sequence[str] | None, task_ids: Sequence[str] | None
) -> list[tuple[str, BatchState]]:
    """The named batches' (or the tasks' batches') states, sorted by id; none named: a new batch."""
    if batch_ids is None and task_ids is None:
        return [(FRESH_BATCH, BatchState.empty())]
    selector = "batches" if batch_ids is not None else "tasks"
    ids = requests.ids(batch_ids if batch_ids is not None else task_ids, selector)
    of_batch, states = batch_states(db, dataset_id, selector, ids)
    found = {batch_id: states[state_id] for batch_id, state_id in of_batch.items()}
    if selector == "batches":
        missing = [i for i in ids if i not in found]
        if missing:
            raise NotFound("batch", missing[0])
    elif not found:
        raise NotFound("task", ids[0])
    return sorted(found.items())


def _priced(
    dataset_id: str,
    budget: Budget,
    charge: Charge,
    states: Sequence[tuple[str, BatchState]],
    policy: pricing.Policy,
) -> dict[str, Any]:
    units = pricing.check_work(budget, [charge.event], policy.max_work)
    answers: list[dict[str, Any]] = []
    refused: dict[str, Any] | None = None
    epsilon, delta = ZERO, ZERO
    with policy.metered(units), rules.pricing(PriceMemo(budget)):
        for batch_id, state in states:
            try:
                cost = rules.reserve(budget, state, charge).cost
            except AccountantError as exc:
                error = rule_error(exc, batch_id)
                if not isinstance(exc, rules.BudgetExceeded | rules.ChargeRefused):
                    raise error from exc
                refused = {"code": error.code, "message": error.message, **error.details}
                if isinstance(exc, rules.BudgetExceeded):
                    epsilon = max(epsilon, Decimal(exc.requested["epsilon"]))
                    delta = max(delta, Decimal(exc.requested["delta"]))
                continue
            answers.append(batch_cost_json(batch_id, cost))
            epsilon, delta = max(epsilon, cost.epsilon), max(delta, cost.delta)
    return {
        "dataset_id": dataset_id,
        "admitted": refused is None,
        "cost": {"epsilon": to_text(epsilon), "delta": to_text(delta)},
        "batches": answers,
        "refused": refused,
    }


__all__ = ["FRESH_BATCH", "price_function", "quote"]
