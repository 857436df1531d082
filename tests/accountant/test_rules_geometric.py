"""Geometric rule: levels first·ratioᵏ, best fit, total ≤ first/(1−ratio) ≤ ε for any horizon."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accountant import events as ev
from accountant import rules as R
from accountant.base import InvalidArgumentError
from accountant.exact import exact_add, exact_sub
from accountant.rules import geometric

BUDGET = R.Budget.create(rule="geometric", epsilon=1, delta=0, accountant="basic")


def pure(eps: float) -> R.Charge:
    return R.Charge(ev.PureDpEvent(eps))


def run(budget: R.Budget, state: R.BatchState, charge: R.Charge) -> tuple[R.BatchState, R.Cost]:
    admission = R.reserve(budget, state, charge)
    settled = R.commit(budget, admission.state, charge, admission.cost, None)
    return settled.state, settled.committed


def test_defaults_and_the_exact_infinite_horizon_check() -> None:
    assert BUDGET.geometric == R.GeometricSchedule(Decimal("0.5"), Decimal("0.5"))
    assert BUDGET.geometric.infinite_horizon_bound() == 1
    R.Budget.create(rule="geometric", epsilon=1, delta=0, accountant="basic",
                    geometric={"first": "0.9", "ratio": "0.1"})  # fmt: skip
    with pytest.raises(InvalidArgumentError) as info:
        R.Budget.create(rule="geometric", epsilon=1, delta=0, accountant="basic",
                        geometric={"first": "0.9000000000000000001", "ratio": "0.1"})  # fmt: skip
    assert info.value.field == "budget.geometric.first"
    for bad in ({"ratio": 1}, {"ratio": 0}, {"first": 0}, {"first": "nan"}):
        with pytest.raises(InvalidArgumentError, match=r"budget\.geometric"):
            R.Budget.create(rule="geometric", epsilon=1, delta=0, accountant="basic", geometric=bad)


def test_forty_levels_of_one_block_each_meet_their_level_exactly() -> None:
    state = R.BatchState.empty()
    for k in range(40):
        state, cost = run(BUDGET, state, pure(0.5 ** (k + 1)))
        assert cost.level == k
        assert cost.epsilon == Decimal(0.5 ** (k + 1))  # the level's allowance, exactly
    assert state.levels == tuple(range(40))
    assert state.epsilon_spent == exact_sub(Decimal(1), Decimal(0.5**40))
    assert state.epsilon_spent <= 1
    assert state.naive_epsilon == state.epsilon_spent


def test_a_used_level_and_a_charge_above_first_are_refused() -> None:
    state, _ = run(BUDGET, R.BatchState.empty(), pure(0.5))
    with pytest.raises(R.BudgetExceeded) as info:
        R.reserve(BUDGET, state, pure(0.5))
    assert info.value.requested == {"epsilon": "0.5", "delta": "0"}
    assert info.value.remaining == {"epsilon": "0.25", "delta": "0"}
    with pytest.raises(R.BudgetExceeded):
        R.reserve(BUDGET, R.BatchState.empty(), pure(0.6))


def test_best_fit_takes_the_smallest_covering_free_level() -> None:
    state, cost = run(BUDGET, R.BatchState.empty(), pure(0.1))
    assert cost.level == 2 and cost.epsilon == Decimal("0.125")  # 0.0625 < 0.1 ≤ 0.125
    assert cost.naive_epsilon == Decimal("0.1")
    state, cost = run(BUDGET, state, pure(0.1))
    assert cost.level == 1  # level 2 is used: the next larger free one
    state, cost = run(BUDGET, state, pure(0.05))
    assert cost.level == 3
    assert state.epsilon_spent == Decimal("0.125") + Decimal("0.25") + Decimal("0.0625")
    assert state.naive_epsilon == Decimal("0.25")


def test_cancel_frees_the_level() -> None:
    empty = R.BatchState.empty()
    admission = R.reserve(BUDGET, empty, pure(0.3))
    assert admission.state.levels == (0,)
    assert R.cancel(BUDGET, admission.state, admission.cost, None) == empty


def test_tiny_charges_use_deep_levels_and_zero_charges_none() -> None:
    state, cost = run(BUDGET, R.BatchState.empty(), pure(1e-200))
    assert cost.level is not None and 600 < cost.level <= R.MAX_GEOMETRIC_LEVEL
    state, cost = run(BUDGET, state, R.Charge(ev.NoOpEvent()))
    assert cost.level is None and cost.epsilon == 0
    assert R.within_budget(BUDGET, state)


def test_level_search_is_logarithmic_plus_levels_used() -> None:
    calls = 0

    def fits(level: int) -> bool:
        nonlocal calls
        calls += 1
        return level <= 700

    used = set(range(650, 701))
    assert geometric.best_fit(fits, used) == 649
    assert calls <= 2 + 11 + 1 + 51  # fits(0), fits(max), binary search, walk over used


def test_geometric_on_rdp_splits_delta_over_levels() -> None:
    budget = R.Budget.create(rule="geometric", epsilon=2, delta=1e-5, accountant="rdp")
    event = ev.SelfComposedEvent(ev.PoissonSampledEvent(0.01, ev.GaussianEvent(2.0)), 100)
    state = R.BatchState.empty()
    levels = []
    for _ in range(6):
        try:
            state, cost = run(budget, state, R.Charge(event))
        except R.BudgetExceeded:
            break
        levels.append(cost.level)
        assert cost.naive_epsilon <= cost.epsilon
        assert budget.geometric is not None
        assert cost.delta == budget.geometric.level_delta(budget.delta, cost.level)  # type: ignore[arg-type]
    assert len(set(levels)) == len(levels) >= 2
    assert state.delta_spent <= budget.delta
    assert state.epsilon_spent <= budget.epsilon
    assert "infinite horizon" in R.theorem(budget)


streams = st.lists(
    st.one_of(
        st.floats(min_value=1e-12, max_value=0.6),
        st.sampled_from([0.5 ** (k + 1) for k in range(50)]),
    ),
    min_size=1,
    max_size=400,
)


@settings(max_examples=40, deadline=None)
@given(
    stream=streams,
    ratio=st.sampled_from(["0.5", "0.25", "0.9", "0.1"]),
    epsilon=st.sampled_from(["1", "0.3", "2.5"]),
)
def test_total_never_exceeds_epsilon_for_any_horizon(stream: list[float], ratio: str, epsilon: str) -> None:
    first = Decimal(epsilon) * (1 - Decimal(ratio))
    budget = R.Budget.create(
        rule="geometric", epsilon=epsilon, delta=0, accountant="basic",
        geometric={"first": str(first), "ratio": ratio},
    )  # fmt: skip
    assert budget.geometric is not None
    state = R.BatchState.empty()
    naive = Decimal(0)
    for eps in stream:
        try:
            state, cost = run(budget, state, pure(eps))
        except R.BudgetExceeded:
            continue
        naive = exact_add(naive, cost.naive_epsilon)
        assert cost.level is not None and cost.naive_epsilon <= cost.epsilon
        assert state.epsilon_spent <= budget.geometric.infinite_horizon_bound() <= budget.epsilon
    assert len(set(state.levels)) == len(state.levels)
    assert state.naive_epsilon == naive
    assert R.within_budget(budget, state)
