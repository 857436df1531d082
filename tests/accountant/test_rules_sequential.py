"""Sequential rule: budgets, exact sums, progressive commits, cancel, the filter and the plan."""

from __future__ import annotations

import importlib.util
import json
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accountant import events as ev
from accountant import rules as R
from accountant.errors import InvalidArgumentError, UnsupportedEventError

HAS_RDP = importlib.util.find_spec("accountant.rdp") is not None
needs_rdp = pytest.mark.skipif(not HAS_RDP, reason="accountant.rdp is not written yet")

BASIC = R.Budget.create(rule="sequential", epsilon=1.0, delta=1e-5, accountant="basic")


def pure(eps: float) -> R.Charge:
    return R.Charge(ev.PureDpEvent(eps))


def run(budget: R.Budget, state: R.BatchState, charge: R.Charge) -> R.BatchState:
    """Reserve and commit the whole charge."""
    admission = R.reserve(budget, state, charge)
    return R.commit(budget, admission.state, charge, admission.cost, None).state


# --- Budget.create ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rule": "serial"}, "budget.rule"),
        ({"accountant": "moments"}, "budget.accountant"),
        ({"epsilon": float("nan")}, "budget.epsilon"),
        ({"epsilon": float("inf")}, "budget.epsilon"),
        ({"epsilon": 0}, "budget.epsilon"),
        ({"epsilon": -1}, "budget.epsilon"),
        ({"epsilon": True}, "budget.epsilon"),
        ({"delta": 1}, "budget.delta"),
        ({"delta": -1e-9}, "budget.delta"),
        ({"delta": "x"}, "budget.delta"),
        ({"orders": [2.0]}, "budget.orders"),
        ({"geometric": {"first": 0.1}}, "budget.geometric"),
        ({"plan": [ev.PureDpEvent(0.1)]}, "budget.plan"),
        ({"accountant": "rdp", "delta": 0}, "budget.delta"),
        ({"accountant": "rdp", "orders": [0.5]}, "budget.orders[0]"),
        ({"accountant": "rdp", "epsilon": "1e-9"}, "budget.epsilon"),
        ({"accountant": "prv"}, "budget.plan"),
        ({"rule": "lifelong", "accountant": "prv"}, "budget.accountant"),
        ({"rule": "geometric", "accountant": "prv"}, "budget.accountant"),
    ],
)
def test_create_refuses_bad_budgets_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"rule": "sequential", "epsilon": 1.0, "delta": 1e-5, "accountant": "basic"}
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError) as info:
        R.Budget.create(**args)  # type: ignore[arg-type]
    assert info.value.field == field


def test_supported_combinations() -> None:
    for rule in R.RULES:
        for accountant in R.ACCOUNTANTS:
            if accountant not in R.SUPPORTED[rule]:
                continue
            if accountant == "prv" and rule == "sequential":
                continue  # needs a plan: tested below
            if accountant == "rdp" and not HAS_RDP and rule in ("sequential", "lifelong"):
                pass  # the filter itself needs no RDP computation
            budget = R.Budget.create(rule=rule, epsilon=2, delta=1e-6, accountant=accountant)
            assert R.Budget.from_json(json.loads(json.dumps(budget.to_json()))) == budget


def test_numbers_are_taken_as_written() -> None:
    budget = R.Budget.create(rule="sequential", epsilon=0.1, delta="1e-6", accountant="basic")
    assert budget.epsilon == Decimal("0.1")
    assert budget.delta == Decimal("1e-6")
    assert budget.to_json()["epsilon"] == "0.1"


# --- exact sums ---------------------------------------------------------------------------------


def test_100_charges_of_001_fill_one_exactly() -> None:
    budget = R.Budget.create(rule="sequential", epsilon=1.0, delta=0, accountant="basic")
    state = R.BatchState.empty()
    for _ in range(100):
        state = run(budget, state, pure(0.01))
    assert state.epsilon_spent == Decimal(1)
    assert state.epsilon_held == 0
    assert R.remaining(budget, state).to_json() == {"epsilon": "0", "delta": "0"}
    with pytest.raises(R.BudgetExceeded) as info:
        R.reserve(budget, state, pure(0.01))
    assert info.value.requested.to_json() == {"epsilon": "0.01", "delta": "0"}
    assert info.value.remaining.to_json() == {"epsilon": "0", "delta": "0"}


def test_held_reservations_count_against_the_budget() -> None:
    budget = R.Budget.create(rule="sequential", epsilon=1.0, delta=0, accountant="basic")
    state = R.BatchState.empty()
    held = []
    for _ in range(100):
        admission = R.reserve(budget, state, pure(0.01))
        state = admission.state
        held.append(admission.cost)
    assert state.epsilon_held == 1 and state.epsilon_spent == 0
    with pytest.raises(R.BudgetExceeded):
        R.reserve(budget, state, pure(0.01))
    state = R.cancel(budget, state, held[0], None)
    state = R.reserve(budget, state, pure(0.01)).state


def test_approximate_dp_sums_delta_exactly() -> None:
    state = R.BatchState.empty()
    for _ in range(10):
        state = run(BASIC, state, R.Charge(ev.ApproxDpEvent(0.05, 1e-6)))
    assert state.delta_spent == Decimal("1e-5")
    assert state.epsilon_spent == Decimal("0.5")
    with pytest.raises(R.BudgetExceeded) as info:
        R.reserve(BASIC, state, R.Charge(ev.ApproxDpEvent(0.0, 1e-7)))
    assert info.value.remaining.to_json()["delta"] == "0"


def test_composed_and_self_composed_costs_are_exact() -> None:
    event = ev.ComposedEvent((ev.SelfComposedEvent(ev.PureDpEvent(0.01), 30), ev.LaplaceEvent(10.0)))
    cost = R.reserve(BASIC, R.BatchState.empty(), R.Charge(event)).cost
    assert cost.epsilon == Decimal("0.4")
    assert cost.naive_epsilon == Decimal("0.4")


def test_float_formulas_are_rounded_up() -> None:
    event = ev.FunctionalMechanismL2DPEvent(
        epsilon1=0.1, epsilon2=0.05, input_dim=10, hidden_units=4, output_hidden_units=2,
        batch_size=1000, theta1_norm_bound=1.0,
    )  # fmt: skip
    from accountant.basic import epsilon_delta

    budget = R.Budget.create(rule="sequential", epsilon=10, delta=0, accountant="basic")
    cost = R.reserve(budget, R.BatchState.empty(), R.Charge(event)).cost
    assert cost.epsilon >= Decimal(epsilon_delta(event)[0])
    assert len(cost.epsilon.as_tuple().digits) <= 18


def test_unsupported_and_non_private_events() -> None:
    with pytest.raises(UnsupportedEventError):
        R.reserve(BASIC, R.BatchState.empty(), R.Charge(ev.GaussianEvent(1.0)))
    with pytest.raises(R.BudgetExceeded) as info:
        R.reserve(BASIC, R.BatchState.empty(), R.Charge(ev.NonPrivateEvent()))
    assert info.value.requested.to_json()["epsilon"] == "Infinity"
    state = run(BASIC, R.BatchState.empty(), R.Charge(ev.NoOpEvent()))
    assert state.epsilon_spent == 0 and state.reads == 1


decimal_charges = st.lists(
    st.decimals(min_value="0.01", max_value="0.5", places=2).map(float), min_size=1, max_size=60
)


@settings(max_examples=60, deadline=None)
@given(charges=decimal_charges)
def test_budget_sums_are_exact(charges: list[float]) -> None:
    """A charge is admitted iff the exact decimal sum still fits; the spend is that sum."""
    budget = R.Budget.create(rule="sequential", epsilon="2.5", delta=0, accountant="basic")
    state = R.BatchState.empty()
    total = Decimal(0)
    for eps in charges:
        fits = total + Decimal(repr(eps)) <= Decimal("2.5")
        try:
            state = run(budget, state, pure(eps))
        except R.BudgetExceeded:
            assert not fits
        else:
            assert fits
            total += Decimal(repr(eps))
        assert state.epsilon_spent == total
        assert state.naive_epsilon == total
    assert R.dataset_epsilon(budget, [state]) == total


# --- progressive commits, cancel --------------------------------------------------------------

RUN = ev.SelfComposedEvent(ev.PureDpEvent(0.001), 500)


def steps(n: int) -> ev.DpEvent:
    return ev.SelfComposedEvent(ev.PureDpEvent(0.001), n)


def test_progressive_commit_moves_hold_to_spend_and_cancel_returns_the_rest() -> None:
    charge = R.Charge(RUN)
    start = run(BASIC, R.BatchState.empty(), pure(0.2))
    admission = R.reserve(BASIC, start, charge)
    assert admission.cost.epsilon == Decimal("0.5")
    first = R.commit(BASIC, admission.state, charge, admission.cost, None, steps(100))
    assert first.committed.epsilon == Decimal("0.1")
    assert first.state.epsilon_spent == Decimal("0.3")
    assert first.state.epsilon_held == Decimal("0.4")
    second = R.commit(BASIC, first.state, charge, admission.cost, first.committed, steps(300))
    assert second.committed.epsilon == Decimal("0.3")
    assert second.state.epsilon_spent == Decimal("0.5")
    # An earlier checkpoint committed again never takes spend back.
    again = R.commit(BASIC, second.state, charge, admission.cost, second.committed, steps(200))
    assert again.committed.epsilon == Decimal("0.3")
    assert again.state == second.state
    closed = R.cancel(BASIC, again.state, admission.cost, again.committed)
    assert closed.epsilon_spent == Decimal("0.5")
    assert closed.epsilon_held == 0
    assert closed.reads == 2  # something was committed: the read stays


def test_a_commit_reports_the_reserved_run_cut_short_never_another_event() -> None:
    """More steps than reserved, or any other event — even one that costs less — is refused: the
    ledger would otherwise price an event chosen after the reservation (issue 13 §1)."""
    charge = R.Charge(RUN)
    admission = R.reserve(BASIC, R.BatchState.empty(), charge)
    for other in (steps(501), ev.PureDpEvent(0.6), ev.PureDpEvent(0.25), ev.LaplaceEvent(100.0)):
        with pytest.raises(R.ChargeRefused) as info:
            R.commit(BASIC, admission.state, charge, admission.cost, None, other)
        assert info.value.code == "commit_not_prefix"
    assert R.commit(
        BASIC, admission.state, charge, admission.cost, None, steps(250)
    ).committed.epsilon == Decimal("0.25")


def test_each_commit_extends_the_one_before() -> None:
    charge = R.Charge(RUN)
    admission = R.reserve(BASIC, R.BatchState.empty(), charge)
    first = R.commit(BASIC, admission.state, charge, admission.cost, None, steps(300))
    with pytest.raises(R.ChargeRefused) as info:  # an earlier checkpoint is not further along
        R.commit(BASIC, first.state, charge, admission.cost, first.committed, steps(200), steps(300))
    assert info.value.code == "commit_does_not_extend"
    later = R.commit(BASIC, first.state, charge, admission.cost, first.committed, steps(400), steps(300))
    assert later.committed.epsilon == Decimal("0.4")
    whole = R.commit(BASIC, later.state, charge, admission.cost, later.committed, None, steps(400))
    assert whole.committed.epsilon == Decimal("0.5")


def test_is_prefix() -> None:
    from accountant.rules.bookkeeping import is_prefix

    g = ev.GaussianEvent(1.0)
    assert is_prefix(ev.SelfComposedEvent(g, 3), ev.SelfComposedEvent(g, 5))
    assert not is_prefix(ev.SelfComposedEvent(g, 6), ev.SelfComposedEvent(g, 5))
    assert is_prefix(g, ev.SelfComposedEvent(g, 5))
    assert is_prefix(ev.ComposedEvent((g, g)), ev.SelfComposedEvent(g, 2))
    assert is_prefix(ev.ComposedEvent((g,)), ev.ComposedEvent((g, ev.LaplaceEvent(1.0))))
    assert not is_prefix(ev.LaplaceEvent(1.0), ev.ComposedEvent((g, ev.LaplaceEvent(1.0))))
    assert is_prefix(ev.NoOpEvent(), g)


operations = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "commit_part", "commit_all", "cancel"]),
        st.integers(min_value=1, max_value=400),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(ops=operations)
def test_reserve_then_cancel_restores_and_commits_never_exceed_reserved(
    ops: list[tuple[str, int]],
) -> None:
    budget = R.Budget.create(rule="sequential", epsilon="3", delta=0, accountant="basic")
    state = R.BatchState.empty()
    open_: list[tuple[R.Cost, R.Cost | None]] = []
    for op, n in ops:
        if op == "reserve":
            try:
                admission = R.reserve(budget, state, R.Charge(RUN))
            except R.BudgetExceeded:
                continue
            assert R.cancel(budget, admission.state, admission.cost, None) == state
            state = admission.state
            open_.append((admission.cost, None))
        elif open_ and op.startswith("commit"):
            reserved, before = open_[-1]
            partial = None if op == "commit_all" else steps(min(n, 500))
            settled = R.commit(budget, state, R.Charge(RUN), reserved, before, partial)
            assert settled.committed.epsilon <= reserved.epsilon
            assert before is None or settled.committed.epsilon >= before.epsilon
            assert settled.state.epsilon_spent >= state.epsilon_spent
            state = settled.state
            open_[-1] = (reserved, settled.committed)
        elif open_ and op == "cancel":
            reserved, committed = open_.pop()
            spent = state.epsilon_spent
            state = R.cancel(budget, state, reserved, committed)
            assert state.epsilon_spent == spent
        assert R.within_budget(budget, state)
        assert state.epsilon_spent + state.epsilon_held <= budget.epsilon
    for reserved, committed in reversed(open_):
        state = R.cancel(budget, state, reserved, committed)
    assert state.epsilon_held == 0


def test_state_and_cost_json_round_trip() -> None:
    admission = R.reserve(BASIC, run(BASIC, R.BatchState.empty(), pure(0.3)), R.Charge(RUN))
    state_json = json.loads(json.dumps(admission.state.to_json()))
    assert R.BatchState.from_json(state_json) == admission.state
    cost_json = json.loads(json.dumps(admission.cost.to_json()))
    assert R.Cost.from_json(cost_json) == admission.cost
    charge = R.Charge(RUN, "c1")
    assert R.Charge.from_json(json.loads(json.dumps(charge.to_json()))) == charge
    with pytest.raises(InvalidArgumentError, match=r"state\.epsilon_spent"):
        R.BatchState.from_json({**state_json, "epsilon_spent": "-1"})
    with pytest.raises(InvalidArgumentError, match="noise_commitment"):
        R.Charge(RUN, "")


def test_dataset_epsilon_is_the_max_over_batches() -> None:
    a = run(BASIC, R.BatchState.empty(), pure(0.3))
    b = run(BASIC, run(BASIC, R.BatchState.empty(), pure(0.2)), pure(0.2))
    assert R.dataset_epsilon(BASIC, [a, b]) == Decimal("0.4")
    assert R.dataset_epsilon(BASIC, []) == 0
    assert R.naive_epsilon([a, b]) == Decimal("0.4")
    assert "Thm. 3.16" in R.theorem(BASIC) and "McSherry" in R.theorem(BASIC)


# --- Rényi filter budgets ------------------------------------------------------------------------


@needs_rdp
def test_rdp_budget_admits_subsampled_gaussian_charges_until_the_filter_says_no() -> None:
    from accountant.rules import renyi_filter
    from accountant.rules.prices import rdp_charge

    budget = R.Budget.create(rule="sequential", epsilon=2.0, delta=1e-5, accountant="rdp")
    f = renyi_filter(budget)
    step = R.Charge(ev.SelfComposedEvent(ev.PoissonSampledEvent(0.01, ev.GaussianEvent(1.0)), 200))
    state = R.BatchState.empty()
    admitted = 0
    for _ in range(200):
        spent = [
            s + h
            for s, h in zip(
                state.rdp_spent or [Decimal(0)] * len(f.orders),
                state.rdp_held or [Decimal(0)] * len(f.orders),
                strict=True,
            )
        ]
        condition = f.admits(spent, rdp_charge(step.event, f.orders))
        try:
            state = run(budget, state, step)
        except R.BudgetExceeded as exc:
            assert not condition
            assert exc.remaining.epsilon >= 0
            break
        assert condition
        admitted += 1
        assert state.epsilon_spent <= budget.epsilon
        assert state.delta_spent == budget.delta
    assert admitted > 1
    assert R.within_budget(budget, state)


@needs_rdp
def test_rdp_reserve_then_cancel_restores_state_exactly() -> None:
    budget = R.Budget.create(rule="sequential", epsilon=2.0, delta=1e-5, accountant="rdp")
    charge = R.Charge(ev.SelfComposedEvent(ev.PoissonSampledEvent(0.02, ev.GaussianEvent(1.2)), 100))
    state = run(budget, R.BatchState.empty(), charge)
    admission = R.reserve(budget, state, charge)
    assert R.cancel(budget, admission.state, admission.cost, None) == state
    assert R.cancel(budget, R.reserve(budget, R.BatchState.empty(), charge).state,
                    admission.cost, None) == R.BatchState.empty()  # fmt: skip
    half = ev.SelfComposedEvent(ev.PoissonSampledEvent(0.02, ev.GaussianEvent(1.2)), 50)
    settled = R.commit(budget, admission.state, charge, admission.cost, None, half)
    assert settled.state.epsilon_spent >= state.epsilon_spent
    closed = R.cancel(budget, settled.state, admission.cost, settled.committed)
    assert closed.rdp_held is None and closed.epsilon_held == 0


# --- declared plan (prv) --------------------------------------------------------------------------

PLAN_STEP = ev.PureDpEvent(0.1)


def test_plan_is_admitted_step_by_step_and_nothing_outside_it() -> None:
    plan = (PLAN_STEP, ev.LaplaceEvent(5.0), PLAN_STEP)
    budget = R.Budget.create(rule="sequential", epsilon=1.0, delta=1e-6, accountant="prv", plan=plan)
    assert budget.plan_epsilon is not None and budget.plan_epsilon <= Decimal(1)
    state = R.BatchState.empty()
    with pytest.raises(R.ChargeRefused) as info:
        R.reserve(budget, state, R.Charge(ev.LaplaceEvent(5.0)))
    assert info.value.code == "outside_plan"
    admission = R.reserve(budget, state, R.Charge(PLAN_STEP))
    with pytest.raises(R.ChargeRefused) as info:
        R.reserve(budget, admission.state, R.Charge(ev.LaplaceEvent(5.0)))
    assert info.value.code == "plan_step_pending"
    assert R.cancel(budget, admission.state, admission.cost, None) == state
    previous = Decimal(0)
    for step in plan:
        state = run(budget, state, R.Charge(step))
        assert previous <= state.epsilon_spent <= budget.plan_epsilon
        previous = state.epsilon_spent
    assert state.plan_position == 3 and not state.plan_open
    with pytest.raises(R.ChargeRefused) as info:
        R.reserve(budget, state, R.Charge(PLAN_STEP))
    assert info.value.code == "outside_plan"
    assert R.within_budget(budget, state)


def test_plan_that_does_not_fit_is_refused_at_creation() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        R.Budget.create(
            rule="sequential", epsilon=0.5, delta=1e-6, accountant="prv",
            plan=[ev.PureDpEvent(0.4), ev.PureDpEvent(0.4)],
        )  # fmt: skip
    assert info.value.field == "budget.plan"


def test_rdp_filter_costs_stay_within_the_reservation_under_concurrent_holds() -> None:
    budget = R.Budget.create(rule="sequential", epsilon=4.0, delta=1e-5, accountant="rdp")
    big = R.Charge(ev.SelfComposedEvent(ev.PoissonSampledEvent(0.02, ev.GaussianEvent(1.2)), 200))
    small = R.Charge(ev.SelfComposedEvent(ev.PoissonSampledEvent(0.01, ev.GaussianEvent(1.5)), 100))
    first = R.reserve(budget, R.BatchState.empty(), big)
    second = R.reserve(budget, first.state, small)
    state = R.cancel(budget, second.state, first.cost, None)
    settled = R.commit(budget, state, small, second.cost, None)
    assert 0 <= settled.committed.epsilon <= second.cost.epsilon
    assert settled.committed.rdp == second.cost.rdp
    assert settled.state.epsilon_held == 0 and settled.state.rdp_held is None
    assert settled.state == run(budget, R.BatchState.empty(), small)


# What "prefix" means, per event kind (``accountant.rules.bookkeeping.is_prefix``): running the
# partial event is the first part of running the reserved one, so its transcript is a prefix of
# the full transcript and its privacy loss can only be smaller (post-processing).
_base = st.one_of(
    st.floats(0.3, 5.0).map(ev.GaussianEvent),
    st.floats(0.5, 5.0).map(ev.LaplaceEvent),
    st.floats(0.01, 1.0).map(ev.PureDpEvent),
    st.tuples(st.floats(0.001, 0.5), st.floats(0.5, 3.0)).map(
        lambda t: ev.PoissonSampledEvent(t[0], ev.GaussianEvent(t[1]))
    ),
)
_run = st.one_of(
    _base,
    st.tuples(_base, st.integers(1, 50)).map(lambda t: ev.SelfComposedEvent(t[0], t[1])),
    st.lists(_base, min_size=1, max_size=5).map(lambda xs: ev.ComposedEvent(tuple(xs))),
)


@st.composite
def _run_and_prefix(draw: st.DrawFn) -> tuple[ev.DpEvent, ev.DpEvent]:
    """A reserved run and one of its prefixes, cut short the ways a trainer cuts a run."""
    run = draw(_run)
    if isinstance(run, ev.SelfComposedEvent):
        k = draw(st.integers(0, run.count))
        return run, draw(st.sampled_from([ev.SelfComposedEvent(run.event, k), run.event if k else run]))
    if isinstance(run, ev.ComposedEvent):
        n = draw(st.integers(1, len(run.events)))
        return run, ev.ComposedEvent(run.events[:n])
    return run, run


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(pair=_run_and_prefix())
def test_a_prefix_is_a_prefix_and_never_costs_more(pair: tuple[ev.DpEvent, ev.DpEvent]) -> None:
    from accountant.rdp import RdpAccountant
    from accountant.rules.bookkeeping import is_prefix

    run, prefix = pair
    assert is_prefix(prefix, run)
    full = RdpAccountant().compose(run).get_epsilon(1e-5).upper
    part = RdpAccountant().compose(prefix).get_epsilon(1e-5).upper
    assert part <= full * (1 + 1e-12)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(run=_run, other=_base, extra=st.integers(1, 5))
def test_more_steps_or_another_mechanism_is_never_a_prefix(
    run: ev.DpEvent, other: ev.DpEvent, extra: int
) -> None:
    from accountant.rules.bookkeeping import is_prefix

    if isinstance(run, ev.SelfComposedEvent):
        assert not is_prefix(ev.SelfComposedEvent(run.event, run.count + extra), run)
    if isinstance(run, ev.ComposedEvent):
        assert not is_prefix(ev.ComposedEvent((*run.events, other)), run)
    if other != run and not (isinstance(run, ev.SelfComposedEvent) and other == run.event):
        if not (isinstance(run, ev.ComposedEvent) and other == run.events[0]):
            assert not is_prefix(other, run)
