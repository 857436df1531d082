"""The naive figure's price of one charge (docs/ARCHITECTURE.md, "The naive figure"): what the
charge would cost as the batch's only charge, converted the way the budget converts its spend.
Above ``prices`` and ``tight`` (the union budgets' own naive price), which it dispatches to.
"""

from __future__ import annotations

from decimal import Decimal

from accountant.events import DpEvent
from accountant.rules.budget import Budget, renyi_filter
from accountant.rules.memo import active_pricing
from accountant.rules.prices import fresh_price, rdp_charge
from accountant.rules.tight import naive_price as union_naive_price


def naive_price(budget: Budget, event: DpEvent) -> Decimal:
    """The ε ``event`` would cost as the batch's only charge, converted the way the budget
    converts its spend: the Rényi filter's own ``epsilon_of`` (its grid and δ split) for a filter
    budget, else ``fresh_price``. ``naive_sequential_epsilon`` adds these up; with the same
    conversion a single release's naive figure equals the ledger's charge (never below it)."""
    if budget.uses_union:
        return union_naive_price(budget, event)
    if budget.uses_filter and active_pricing() >= 2:
        assert budget.orders is not None
        return renyi_filter(budget).epsilon_of(rdp_charge(event, budget.orders))
    return fresh_price(budget, event)[0]


__all__ = ["naive_price"]
