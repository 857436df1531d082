"""A Rényi filter placed for its budget (``accountant.rdp_filter.placed_grid``), issue 13 §3.

Typical DP-SGD runs calibrated near the budget (dp-accounting RDP ε = 7.5 on an ε = 8, δ = 1e-5
budget) are certified within 1.10× of dp-accounting's RDP ε at the median and never below it;
every run is certified tighter than on the fixed 20-order grid with equal δ shares. The filter
stays a valid filter: fixed orders and weights summing to at most 1.
"""

from __future__ import annotations

import statistics
from decimal import Decimal

import pytest

from accountant import events as ev
from accountant.rdp_filter import DEFAULT_FILTER_ORDERS, RenyiFilter, check_weights, placed_grid
from accountant.rules import Budget, renyi_filter
from accountant.rules.prices import rdp_charge
from tests.service.api.test_tight_charges import _dpa_epsilon, calibrated_sigma

RUNS = [
    (0.004, 1250),
    (0.004, 5000),
    (0.01, 2000),
    (0.01, 5000),
    (0.02, 500),
    (0.05, 1000),
    (0.1, 1000),
    (0.002, 500),
]


def _event(q: float, sigma: float, steps: int) -> ev.DpEvent:
    return ev.SelfComposedEvent(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), steps)


@pytest.mark.slow
def test_runs_near_the_budget_are_certified_within_ten_percent() -> None:
    budget = Budget.create(rule="sequential", epsilon=8, delta="1e-5", accountant="rdp")
    assert budget.delta_weights is not None
    placed = renyi_filter(budget)
    fixed = RenyiFilter(epsilon=8, delta="1e-5", orders=DEFAULT_FILTER_ORDERS)
    ratios = []
    for q, steps in RUNS:
        sigma = calibrated_sigma(q, steps, 7.5, 1e-5)
        reference = _dpa_epsilon(q, sigma, steps, 1e-5)
        event = _event(q, sigma, steps)
        ours = float(placed.epsilon_of(rdp_charge(event, placed.orders)))
        before = float(fixed.epsilon_of(rdp_charge(event, fixed.orders)))
        assert reference * (1 - 1e-9) <= ours < before
        ratios.append(ours / reference)
    assert statistics.median(ratios) <= 1.10
    assert max(ratios) <= 1.12


@pytest.mark.parametrize(
    ("epsilon", "delta"), [("0.1", "1e-6"), ("1", "1e-5"), ("8", "1e-7"), ("1000", "1e-5")]
)
def test_placed_grids_are_valid_filters(epsilon: str, delta: str) -> None:
    orders, weights = placed_grid(Decimal(epsilon), Decimal(delta))
    assert list(orders) == sorted(set(orders)) and all(1 < a <= 2**20 for a in orders)
    assert check_weights(weights, len(orders)) == weights and sum(weights) <= 1
    f = RenyiFilter(epsilon=epsilon, delta=delta, orders=orders, weights=weights)
    # Each active order's δ share is its weight renormalised over the active set: they sum to ≤ δ.
    assert sum(d for d, on in zip(f.delta_shares, f.active, strict=True) if on) <= float(delta)
    assert any(f.active)


def test_stored_budgets_without_weights_keep_equal_shares() -> None:
    """A budget stored before placement (orders, no weights) rebuilds the same filter as before."""
    old = Budget.from_json(
        {
            "rule": "sequential",
            "epsilon": "1",
            "delta": "1e-5",
            "accountant": "rdp",
            "orders": list(DEFAULT_FILTER_ORDERS),
        }
    )
    assert old.delta_weights is None
    f = renyi_filter(old)
    assert f.allowance == RenyiFilter(epsilon="1", delta="1e-5", orders=DEFAULT_FILTER_ORDERS).allowance
    assert len({d for d, on in zip(f.delta_shares, f.active, strict=True) if on}) == 1


def test_weights_are_validated_naming_the_field() -> None:
    from accountant.errors import InvalidArgumentError

    base = {"rule": "sequential", "epsilon": "1", "delta": "1e-5", "accountant": "rdp", "orders": [2.0, 4.0]}
    for weights, field in [
        (["0.6", "0.6"], "budget.delta_weights"),
        (["0.5"], "budget.delta_weights"),
        (["0", "0.5"], "budget.delta_weights[0]"),
        (["x", "0.5"], "budget.delta_weights[0]"),
    ]:
        with pytest.raises(InvalidArgumentError) as refused:
            Budget.from_json({**base, "delta_weights": weights})
        assert refused.value.field == field
    with pytest.raises(InvalidArgumentError) as refused:
        Budget.from_json({**base, "accountant": "rdp", "rule": "parallel", "delta_weights": ["0.5", "0.5"]})
    assert refused.value.field == "budget.delta_weights"


def test_a_partial_run_reported_high_still_leaves_the_capacity() -> None:
    """Two identical runs whose composition is 90% of the budget by dp-accounting: the first is
    reported above its plain ε (a progress value), yet both are admitted, and the certified total
    is within 1.10× of the plain ε of what ran."""
    from accountant import rules as R

    q, steps = 0.01, 1000
    sigma = calibrated_sigma(q, 2 * steps, 7.2, 1e-5)  # the pair as one run of 2·steps
    budget = Budget.create(rule="sequential", epsilon=8, delta="1e-5", accountant="rdp")
    state = R.BatchState.empty()
    run = _event(q, sigma, steps)
    for _ in range(2):
        admission = R.reserve(budget, state, R.Charge(run))
        state = R.commit(budget, admission.state, R.Charge(run), admission.cost, None).state
    plain_total = _dpa_epsilon(q, sigma, 2 * steps, 1e-5)
    assert plain_total * (1 - 1e-9) <= float(state.epsilon_spent) <= 1.10 * plain_total
    assert float(state.epsilon_spent) <= 8
