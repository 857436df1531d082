"""Geometric rule: levels first·ratioᵏ, best fit, total ≤ first/(1−ratio) ≤ ε for any horizon."""

from __future__ import annotations

import itertools
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accountant import events as ev
from accountant import rules as R
from accountant.errors import InvalidArgumentError
from accountant.exact import exact_add, exact_sub, exact_sum
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
    assert info.value.requested.to_json() == {"epsilon": "0.5", "delta": "0"}
    assert info.value.remaining.to_json() == {"epsilon": "0.25", "delta": "0"}
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


def test_a_geometric_level_prices_its_charge_by_the_tight_epsilon_at_its_delta_share() -> None:
    """Issue 25 §2: a level's ε′ is the event's tight ε at δ_k (one charge, no filter): the
    audit's (q 0.001235, σ 8.609, 18 steps) was 2.07x PRV on ``rdp``; now it is
    ``prices.tight_epsilon`` at the level's δ, ≤ 1.02x dp-accounting's pessimistic PLD there."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    from accountant.rules.prices import tight_epsilon

    budget = R.Budget.create(rule="geometric", epsilon=0.02, delta=1e-6, accountant="rdp")
    event = ev.SelfComposedEvent(ev.PoissonSampledEvent(0.001235, ev.GaussianEvent(8.609)), 18)
    _, cost = run(budget, R.BatchState.empty(), R.Charge(event))
    assert budget.geometric is not None and cost.level is not None
    level_delta = budget.geometric.level_delta(budget.delta, cost.level)
    assert cost.delta == level_delta
    assert cost.naive_epsilon == tight_epsilon(event, level_delta)
    pld = (
        PLDAccountant(value_discretization_interval=1e-5)
        .compose(
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(0.001235, dp_accounting.GaussianDpEvent(8.609)), 18
            )
        )
        .get_epsilon(float(level_delta))
    )
    assert cost.naive_epsilon <= Decimal(1.02 * pld)


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


# ---------------------------------------------------------------------------------------------
# Sub-budgets (Thm. 7's sliding window: one ε/3 level and two series ε/6, ε/12, ...)
# ---------------------------------------------------------------------------------------------

SLIDING = R.Budget.create(
    rule="geometric", epsilon=1, delta=0, accountant="basic", geometric={"single": "0.375", "copies": 2}
)


def test_sub_budgets_order_their_levels_by_allowance_and_keep_the_bound() -> None:
    schedule = SLIDING.geometric
    assert schedule is not None
    # first defaults to (ε − single)(1 − ratio)/copies = 0.625·0.5/2
    assert schedule.first == Decimal("0.15625") and schedule.ratio == Decimal("0.5")
    allowances = [schedule.allowance(k) for k in range(7)]
    assert allowances == [Decimal(x) for x in ("0.375", "0.15625", "0.15625", "0.078125", "0.078125",
                                                "0.0390625", "0.0390625")]  # fmt: skip
    assert schedule.infinite_horizon_bound() == 1
    assert schedule.to_json() == {"first": "0.15625", "ratio": "0.5", "copies": 2, "single": "0.375"}
    assert R.Budget.from_json(SLIDING.to_json()) == SLIDING
    # The plain series keeps its old JSON (stored budgets and certificates do not change).
    assert BUDGET.geometric is not None and BUDGET.geometric.to_json() == {"first": "0.5", "ratio": "0.5"}


def test_sub_budgets_are_validated_exactly() -> None:
    def create(geometric: dict[str, object]) -> R.Budget:
        return R.Budget.create(rule="geometric", epsilon=1, delta=0, accountant="basic", geometric=geometric)

    create({"single": "0.4", "copies": 2, "first": "0.15"})  # 0.4 + 2·0.3 = 1
    for bad, field in (
        ({"single": "0.4", "copies": 2, "first": "0.1500000000000000001"}, "budget.geometric.first"),
        ({"single": "0.1", "first": "0.2"}, "budget.geometric.single"),  # below first: not monotone
        ({"single": "1.5"}, "budget.geometric.single"),
        ({"copies": 0}, "budget.geometric.copies"),
        ({"copies": True}, "budget.geometric.copies"),
        ({"copies": R.MAX_GEOMETRIC_COPIES + 1}, "budget.geometric.copies"),
    ):
        with pytest.raises(InvalidArgumentError) as info:
            create(bad)
        assert info.value.field == field, bad


def test_two_charges_of_one_size_take_the_two_copies_then_are_refused() -> None:
    state, cost = run(SLIDING, R.BatchState.empty(), pure(0.375))
    assert cost.level == 0
    state, cost = run(SLIDING, state, pure(0.15625))
    assert cost.level == 2  # best fit: the deeper of the two equal levels first
    state, cost = run(SLIDING, state, pure(0.078125))
    assert cost.level == 4
    state, cost = run(SLIDING, state, pure(0.15625))
    assert cost.level == 1
    with pytest.raises(R.BudgetExceeded):  # a third charge of that size finds no free level
        R.reserve(SLIDING, state, pure(0.15625))
    assert state.epsilon_spent == Decimal("0.375") + 2 * Decimal("0.15625") + Decimal("0.078125")
    assert R.within_budget(SLIDING, state)
    assert "single=0.375" in R.theorem(SLIDING) and "2 series" in R.theorem(SLIDING)


def test_the_plain_series_cannot_hold_the_sliding_windows_two_chains() -> None:
    # ε/3 (base) and two ε/6 charges: the default series ε/2, ε/4, ... has one level of each size.
    state, _ = run(BUDGET, R.BatchState.empty(), pure(1 / 3))
    state, _ = run(BUDGET, state, pure(1 / 6))
    with pytest.raises(R.BudgetExceeded):
        R.reserve(BUDGET, state, pure(1 / 6))


def test_sub_budget_delta_shares_sum_to_at_most_delta() -> None:
    budget = R.Budget.create(
        rule="geometric", epsilon=1, delta="1e-5", accountant="rdp", geometric={"single": "0.4", "copies": 2}
    )
    schedule = budget.geometric
    assert schedule is not None
    shares = [schedule.level_delta(budget.delta, k) for k in range(R.MAX_GEOMETRIC_LEVEL + 1)]
    assert all(a >= b for a, b in itertools.pairwise(shares))  # monotone, so best fit stays valid
    assert shares[0] == Decimal("4e-6") and shares[1] == shares[2]
    assert exact_sum(shares) <= budget.delta
