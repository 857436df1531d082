"""The Rényi privacy filter: it admits a charge iff the filter condition holds.

Condition (accountant.rdp_filter): ∃ active order α with S_α + c_α ≤ B(α), where
B(α) = ε − g(α, δ/|A|) rounded down and g is the improved RDP→DP conversion offset.
dp-accounting (an independent implementation) is the oracle for the conversion and for the RDP
of subsampled-Gaussian charges.
"""

from __future__ import annotations

import math
from decimal import Decimal

import numpy as np
import pytest
from dp_accounting import dp_event  # type: ignore[import-untyped]
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp  # type: ignore[import-untyped]
from hypothesis import given, settings
from hypothesis import strategies as st

from accountant.errors import InvalidArgumentError
from accountant.exact import INFINITY, ZERO
from accountant.rdp_filter import (
    DEFAULT_FILTER_ORDERS,
    RenyiFilter,
    as_charge,
    check_orders,
    conversion_offset,
    rdp_epsilon,
)
from accountant.rules.budget import Budget, renyi_filter

ORDERS = DEFAULT_FILTER_ORDERS
F = RenyiFilter(epsilon="1.0", delta="1e-5", orders=ORDERS)
N = len(ORDERS)
TINY = Decimal("1e-18")


def condition(f: RenyiFilter, spent: list[Decimal], charge: list[Decimal]) -> bool:
    """The filter condition, written out independently of RenyiFilter.admits."""
    if all(c == 0 for c in charge):
        return True
    return any(
        f.active[i] and spent[i] + charge[i] <= f.allowance[i]  # exact: Decimals of ≤ 18 digits
        for i in range(len(f.orders))
    )


def test_default_grid_has_about_twenty_orders_and_some_active() -> None:
    assert 15 <= len(DEFAULT_FILTER_ORDERS) <= 25
    assert any(F.active)
    assert all(b > 0 for b, on in zip(F.allowance, F.active, strict=True) if on)


def test_delta_is_split_over_the_active_orders_and_sums_to_at_most_delta() -> None:
    active = sum(F.active)
    assert F.delta_per_order * active <= 1e-5
    assert F.delta_per_order == pytest.approx(1e-5 / active, rel=1e-12)
    # Active = positive allowance at δ/K for the whole grid K; the others never count.
    grid_delta = 1e-5 / N
    for alpha, on in zip(ORDERS, F.active, strict=True):
        positive = Decimal("1.0") - conversion_offset(alpha, math.nextafter(grid_delta, 0)) > 0
        assert on == positive


def test_allowance_converts_to_at_most_epsilon_by_dp_accounting() -> None:
    """At every active order, (α, B(α))-RDP is (≤ ε, δ_α)-DP by dp-accounting's conversion."""
    for alpha, on, allowance in zip(ORDERS, F.active, F.allowance, strict=True):
        if not on:
            continue
        eps, _ = dpa_rdp.compute_epsilon([alpha], [float(allowance)], F.delta_per_order)
        assert eps <= 1.0
        assert eps == pytest.approx(1.0, abs=1e-9)  # rounding costs almost nothing


def test_improved_conversion_beats_the_classic_one() -> None:
    for alpha in ORDERS:
        classic = math.log(1 / 1e-6) / (alpha - 1)
        assert conversion_offset(alpha, 1e-6) < Decimal(classic)


@pytest.mark.parametrize("index", [i for i, on in enumerate(F.active) if on])
def test_boundary_cases_at_each_active_order(index: int) -> None:
    """Exact equality admits; one unit in the 18th digit more refuses; other orders don't help
    when they are already over."""
    over = [a + 1 for a in F.allowance]  # every order over its allowance
    spent = list(over)
    spent[index] = F.allowance[index] - Decimal("0.25")
    charge = [ZERO] * N
    charge[index] = Decimal("0.25")
    assert condition(F, spent, charge)
    assert F.admits(spent, charge)  # S + c == B exactly
    charge[index] = Decimal("0.25") + TINY
    assert not condition(F, spent, charge)
    assert not F.admits(spent, charge)  # S + c == B + 1e-18
    charge = [Decimal(1)] * N
    charge[index] = Decimal("0.25")
    assert F.admits(spent, charge)  # other orders' charges do not matter


def test_inactive_orders_never_admit() -> None:
    inactive = [i for i, on in enumerate(F.active) if not on]
    assert inactive
    spent = [a + 1 for a in F.allowance]
    for i in inactive:
        spent[i] = ZERO
    charge = [ZERO] * N
    for i in inactive:
        charge[i] = Decimal("1e-30")
    assert not F.admits(spent, [c if c else Decimal(1) for c in charge])
    # An inactive order's own allowance may even be positive at δ/|A| (it was not at δ/K).
    assert not F.fits([F.allowance[i] if i in inactive else a + 1 for i, a in enumerate(F.allowance)])


def test_zero_charge_is_admitted_even_when_full_and_infinite_never() -> None:
    full = [a + 1 for a in F.allowance]
    assert F.admits(full, [ZERO] * N)
    assert not F.admits([ZERO] * N, [INFINITY] * N)
    assert not F.fits(full)
    assert F.fits([ZERO] * N)


def test_epsilon_of_is_zero_for_no_spend_monotone_and_within_epsilon_when_it_fits() -> None:
    assert F.epsilon_of([ZERO] * N) == 0
    small = [Decimal("0.01")] * N
    larger = [Decimal("0.02")] * N
    assert F.epsilon_of(small) <= F.epsilon_of(larger)
    assert F.epsilon_of(list(F.allowance)) <= F.epsilon
    assert F.epsilon_of([a + 1 for a in F.allowance]) > F.epsilon


def test_validation_names_the_field() -> None:
    with pytest.raises(InvalidArgumentError, match="delta"):
        RenyiFilter(epsilon=1, delta=0, orders=ORDERS)
    with pytest.raises(InvalidArgumentError, match="epsilon"):
        RenyiFilter(epsilon="nan", delta=1e-5, orders=ORDERS)
    with pytest.raises(InvalidArgumentError, match="no order"):
        RenyiFilter(epsilon="1e-6", delta=1e-5, orders=ORDERS)
    with pytest.raises(InvalidArgumentError, match=r"orders\[0\]"):
        check_orders([1.0, 2.0])
    with pytest.raises(InvalidArgumentError, match="repeat"):
        check_orders([2.0, 2.0])
    with pytest.raises(InvalidArgumentError, match="spent"):
        F.admits([ZERO], [ZERO] * N)
    with pytest.raises(InvalidArgumentError, match="rdp"):
        as_charge([float("nan")])


decimals = st.decimals(min_value=0, max_value=3, places=6, allow_nan=False, allow_infinity=False)


@settings(max_examples=100, deadline=None)
@given(spent=st.lists(decimals, min_size=N, max_size=N), charge=st.lists(decimals, min_size=N, max_size=N))
def test_admits_iff_condition(spent: list[Decimal], charge: list[Decimal]) -> None:
    assert F.admits(spent, charge) == condition(F, spent, charge)


def _subsampled_gaussian_rdp(q: float, sigma: float, steps: int) -> list[float]:
    """RDP of `steps` Poisson-subsampled Gaussian steps, by dp-accounting (the oracle)."""
    accountant = dpa_rdp.RdpAccountant(list(ORDERS))
    event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
    accountant.compose(event, steps)
    return [float(v) for v in np.asarray(accountant.rdp)]


charges = st.tuples(
    st.floats(min_value=0.001, max_value=0.1),  # sampling probability
    st.floats(min_value=0.7, max_value=3.0),  # noise multiplier
    st.integers(min_value=1, max_value=3000),  # steps
)


@settings(max_examples=25, deadline=None)
@given(stream=st.lists(charges, min_size=1, max_size=25))
def test_subsampled_gaussian_charges_admitted_exactly_while_the_condition_holds(
    stream: list[tuple[float, float, int]],
) -> None:
    f = RenyiFilter(epsilon="3.0", delta="1e-6", orders=ORDERS)
    spent = [ZERO] * N
    for q, sigma, steps in stream:
        charge = list(as_charge(_subsampled_gaussian_rdp(q, sigma, steps)))
        admitted = f.admits(spent, charge)
        assert admitted == condition(f, spent, charge)
        if admitted:
            spent = [s + c for s, c in zip(spent, charge, strict=True)]
        assert f.fits(spent)
        # The guarantee: some active order converts (dp-accounting) to ≤ ε at δ_α.
        if any(s > 0 for s in spent):
            best = min(
                dpa_rdp.compute_epsilon([a], [float(s)], f.delta_per_order)[0]
                for a, s, on in zip(f.orders, spent, f.active, strict=True)
                if on
            )
            assert best <= 3.0 + 1e-12
            assert f.epsilon_of(spent) <= f.epsilon


def test_rdp_epsilon_of_one_event_matches_dp_accounting() -> None:
    rdp = _subsampled_gaussian_rdp(0.01, 1.1, 1000)
    ours = rdp_epsilon(as_charge(rdp), ORDERS, 1e-5)
    theirs, _ = dpa_rdp.compute_epsilon(list(ORDERS), rdp, 1e-5)
    assert float(ours) >= theirs
    assert float(ours) == pytest.approx(theirs, rel=1e-9)
    assert rdp_epsilon([ZERO] * N, ORDERS, 1e-5) == 0
    assert rdp_epsilon(as_charge(rdp), ORDERS, 0.0) == INFINITY


@settings(max_examples=20, deadline=None)
@given(stream=st.lists(charges, min_size=1, max_size=25))
def test_ledger_on_rdp_admits_exactly_while_the_filter_condition_holds(
    stream: list[tuple[float, float, int]],
) -> None:
    """The same through accountant.rules with our own RDP (accountant.rdp) of each event."""
    from accountant import events as ev
    from accountant import rules as R
    from accountant.rules.prices import rdp_charge

    budget = R.Budget.create(rule="sequential", epsilon="3.0", delta="1e-6", accountant="rdp")
    f = R.renyi_filter(budget)
    state = R.BatchState.empty()
    for q, sigma, steps in stream:
        event = ev.SelfComposedEvent(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), steps)
        charge = list(rdp_charge(event, f.orders))
        spent = list(state.rdp_spent or [ZERO] * len(f.orders))
        expected = condition(f, spent, charge)
        try:
            admission = R.reserve(budget, state, R.Charge(event))
        except R.BudgetExceeded:
            assert not expected
            continue
        assert expected
        state = R.commit(budget, admission.state, R.Charge(event), admission.cost, None).state
        assert state.rdp_spent == tuple(s + c for s, c in zip(spent, charge, strict=True))
        assert state.epsilon_spent == f.epsilon_of(state.rdp_spent) <= f.epsilon


def test_a_tight_budget_at_a_tiny_epsilon_builds_its_filter_with_active_shares_within_delta() -> None:
    """Found by schemathesis: a ``tight`` budget (weighted δ shares) at ε = 4.7e-291 leaves only
    its highest orders active, whose weights are small; an inactive order's weight over the
    active set's alone was δ·w/Σ_active w = 3.79 > 1 and the budget was refused as
    "budget.delta must be in (0, 1) ... Found 3.79", naming a δ the client never sent. The
    inactive orders keep their whole-grid share (they admit nothing); the active shares still
    sum to at most δ."""
    delta = Decimal("0.3775557570435009")
    budget = Budget.create(
        rule="sequential", epsilon="4.71554785001199e-291", delta=delta, accountant="tight"
    )
    f = renyi_filter(budget)
    assert budget.delta_weights is not None and 0 < sum(f.active) < len(f.orders)
    assert all(0 < share < 1 for share in f.delta_shares)
    assert Decimal(math.fsum(s for s, on in zip(f.delta_shares, f.active, strict=True) if on)) <= delta
    assert not f.admits([Decimal(0)] * len(f.orders), [Decimal(1)] * len(f.orders))
