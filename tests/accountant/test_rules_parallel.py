"""Parallel rule: one read per batch (assumption S2 enforced); the dataset's ε is the max."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accountant import events as ev
from accountant import rules as R
from accountant.errors import InvalidArgumentError

BUDGET = R.Budget.create(rule="parallel", epsilon=1.0, delta=1e-5, accountant="basic")
DPSGD = ev.SelfComposedEvent(ev.PoissonSampledEvent(0.01, ev.GaussianEvent(1.1)), 1000)


def run(budget: R.Budget, state: R.BatchState, charge: R.Charge) -> R.BatchState:
    admission = R.reserve(budget, state, charge)
    return R.commit(budget, admission.state, charge, admission.cost, None).state


def test_second_read_of_a_batch_is_refused() -> None:
    state = run(BUDGET, R.BatchState.empty(), R.Charge(ev.PureDpEvent(0.1)))
    with pytest.raises(R.ChargeRefused) as info:
        R.reserve(BUDGET, state, R.Charge(ev.PureDpEvent(0.1)))
    assert info.value.code == "batch_already_read"
    assert R.remaining(BUDGET, state).to_json() == {"epsilon": "0", "delta": "0"}
    # Even a held, uncommitted reservation occupies the batch.
    held = R.reserve(BUDGET, R.BatchState.empty(), R.Charge(ev.PureDpEvent(0.1))).state
    with pytest.raises(R.ChargeRefused):
        R.reserve(BUDGET, held, R.Charge(ev.NoOpEvent()))


def test_cancel_with_nothing_committed_frees_the_read() -> None:
    empty = R.BatchState.empty()
    admission = R.reserve(BUDGET, empty, R.Charge(ev.PureDpEvent(0.4)))
    assert R.cancel(BUDGET, admission.state, admission.cost, None) == empty
    # After a partial commit the batch has been released from: it stays read.
    charge = R.Charge(ev.SelfComposedEvent(ev.PureDpEvent(0.1), 4))
    admission = R.reserve(BUDGET, empty, charge)
    part = ev.SelfComposedEvent(ev.PureDpEvent(0.1), 1)
    settled = R.commit(BUDGET, admission.state, charge, admission.cost, None, part)
    closed = R.cancel(BUDGET, settled.state, admission.cost, settled.committed)
    assert closed.epsilon_spent == Decimal("0.1") and closed.epsilon_held == 0
    with pytest.raises(R.ChargeRefused):
        R.reserve(BUDGET, closed, R.Charge(ev.PureDpEvent(0.1)))


def test_a_charge_above_the_budget_is_refused() -> None:
    with pytest.raises(R.BudgetExceeded) as info:
        R.reserve(BUDGET, R.BatchState.empty(), R.Charge(ev.PureDpEvent(1.5)))
    assert info.value.requested.to_json()["epsilon"] == "1.5"
    assert info.value.remaining.to_json() == {"epsilon": "1", "delta": "0.00001"}
    exact = run(BUDGET, R.BatchState.empty(), R.Charge(ev.PureDpEvent(1.0)))
    assert exact.epsilon_spent == 1


def test_one_dp_sgd_run_is_one_reservation_with_checkpoint_commits() -> None:
    budget = R.Budget.create(rule="parallel", epsilon=8.0, delta=1e-5, accountant="rdp")
    charge = R.Charge(DPSGD)
    admission = R.reserve(budget, R.BatchState.empty(), charge)
    state, before = admission.state, None
    for steps in (250, 500, 1000):
        part = ev.SelfComposedEvent(ev.PoissonSampledEvent(0.01, ev.GaussianEvent(1.1)), steps)
        settled = R.commit(budget, state, charge, admission.cost, before, part)
        assert settled.committed.epsilon <= admission.cost.epsilon
        assert before is None or settled.committed.epsilon >= before.epsilon
        state, before = settled.state, settled.committed
    assert state.epsilon_spent == admission.cost.epsilon
    assert state.epsilon_held == 0
    assert state.delta_spent == budget.delta


def test_parallel_prv_costs_the_single_event_by_its_upper_bound() -> None:
    budget = R.Budget.create(rule="parallel", epsilon=8.0, delta=1e-5, accountant="prv")
    rdp_budget = R.Budget.create(rule="parallel", epsilon=8.0, delta=1e-5, accountant="rdp")
    prv_cost = R.reserve(budget, R.BatchState.empty(), R.Charge(DPSGD)).cost
    rdp_cost = R.reserve(rdp_budget, R.BatchState.empty(), R.Charge(DPSGD)).cost
    assert 0 < prv_cost.epsilon <= rdp_cost.epsilon  # PRV is the tighter bound
    assert "McSherry" in R.theorem(budget) and "S2" in R.theorem(budget)


def test_a_parallel_charge_costs_its_tight_epsilon_whatever_the_accountant() -> None:
    """Issue 25 §2 (pricing version 4): one charge needs no filter, so on ``rdp`` and ``prv``
    budgets alike it costs the event's tight ε — the audit's (q 0.001235, σ 8.609, 18 steps,
    δ 1e-7) was 0.0112 on ``rdp`` (5.2x dp-accounting's PLD); now ≤ 1.02x dp-accounting's
    pessimistic PLD on a fine grid, and above its optimistic (lower) PLD."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant, privacy_loss_distribution

    event = ev.SelfComposedEvent(ev.PoissonSampledEvent(0.001235, ev.GaussianEvent(8.609)), 18)
    pld = (
        PLDAccountant(value_discretization_interval=1e-5)
        .compose(
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(0.001235, dp_accounting.GaussianDpEvent(8.609)), 18
            )
        )
        .get_epsilon(1e-7)
    )
    # dp-accounting's optimistic PLD: a lower bound on the true ε (sound at this small ε).
    lower = (
        privacy_loss_distribution.from_gaussian_mechanism(
            8.609, sampling_prob=0.001235, value_discretization_interval=1e-5, pessimistic_estimate=False
        )
        .self_compose(18)
        .get_epsilon_for_delta(1e-7)
    )
    costs = {}
    for accountant in ("rdp", "prv"):
        budget = R.Budget.create(rule="parallel", epsilon=1.0, delta=1e-7, accountant=accountant)
        costs[accountant] = R.reserve(budget, R.BatchState.empty(), R.Charge(event)).cost
        assert lower <= costs[accountant].epsilon <= Decimal(1.02 * pld)
        assert costs[accountant].delta == Decimal("1e-7")
    assert costs["rdp"] == costs["prv"]
    # A lone Gaussian costs its exact ε (Balle & Wang 2018), not RDP's 7.6x.
    budget = R.Budget.create(rule="parallel", epsilon=1.0, delta=1e-10, accountant="rdp")
    lone = R.reserve(budget, R.BatchState.empty(), R.Charge(ev.GaussianEvent(1e4))).cost.epsilon
    assert Decimal("0.00044249") < lone < Decimal("0.00044250")
    # Under pricing version 3 the same charge is priced as before (stored certificates replay).
    with R.pricing_version(3):
        old = R.reserve(budget, R.BatchState.empty(), R.Charge(ev.GaussianEvent(1e4))).cost.epsilon
    assert old > 7 * lone


batch_charges = st.lists(
    st.decimals(min_value="0.01", max_value="1", places=2).map(float), min_size=1, max_size=40
)


@settings(max_examples=80, deadline=None)
@given(charges=batch_charges)
def test_dataset_epsilon_is_the_max_never_the_sum(charges: list[float]) -> None:
    states = [run(BUDGET, R.BatchState.empty(), R.Charge(ev.PureDpEvent(eps))) for eps in charges]
    assert R.dataset_epsilon(BUDGET, states) == max(Decimal(repr(e)) for e in charges)
    if len(charges) > 1:
        assert R.dataset_epsilon(BUDGET, states) < sum(Decimal(repr(e)) for e in charges)
    assert all(R.within_budget(BUDGET, s) for s in states)


@pytest.mark.parametrize(
    "event",
    [ev.NoOpEvent(), ev.SelfComposedEvent(ev.LaplaceEvent(1.0), 0), ev.ComposedEvent((ev.NoOpEvent(),))],
    ids=["no_op", "count_0", "composed_no_op"],
)
def test_a_charge_that_costs_nothing_is_refused_and_leaves_the_batch_unread(event: ev.DpEvent) -> None:
    """Under S2 a batch is read by one charge: a charge of exactly 0 would use up that read while
    releasing nothing (the review's ``self_composed`` with ``count: 0``)."""
    with pytest.raises(InvalidArgumentError) as refused:
        R.reserve(BUDGET, R.BatchState.empty(), R.Charge(event))
    assert refused.value.field == "event" and "costs nothing" in str(refused.value)
    run(BUDGET, R.BatchState.empty(), R.Charge(ev.PureDpEvent(0.5)))  # the batch's one real read
