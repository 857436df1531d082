"""Lifelong rule: replays of committed noise cost 0; fresh noise composes sequentially."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accountant import events as ev
from accountant import rules as R
from accountant.exact import exact_mul

BUDGET = R.Budget.create(rule="lifelong", epsilon=2.0, delta=0, accountant="basic")
PERTURB = ev.FunctionalMechanismL2DPEvent(
    epsilon1=0.2, epsilon2=0.1, input_dim=50, hidden_units=4, output_hidden_units=2,
    batch_size=100, theta1_norm_bound=1.0,
)  # fmt: skip


def run(budget: R.Budget, state: R.BatchState, charge: R.Charge) -> R.BatchState:
    admission = R.reserve(budget, state, charge)
    return R.commit(budget, admission.state, charge, admission.cost, None).state


def test_twenty_tasks_replaying_the_first_memory_batch_keep_spend_flat() -> None:
    """20 tasks × 2 batches, each perturbed once; the first task's batches replayed at every
    later task: spend stays at one batch's ε while naive grows to 20 × that ε."""
    batches: dict[tuple[int, int], R.BatchState] = {}
    one = None
    for task in range(20):
        for b in range(2):
            charge = R.Charge(PERTURB, f"task{task}-batch{b}")
            batches[(task, b)] = run(BUDGET, R.BatchState.empty(), charge)
            one = batches[(task, b)].epsilon_spent
        if task > 0:
            for b in range(2):
                replay = R.Charge(PERTURB, f"task0-batch{b}")
                batches[(0, b)] = run(BUDGET, batches[(0, b)], replay)
        states = list(batches.values())
        assert R.dataset_epsilon(BUDGET, states) == one
        assert one is not None and R.naive_epsilon(states) == exact_mul(one, Decimal(task + 1))
    assert one is not None and one > 0


def test_same_commitment_different_event_is_a_mismatch() -> None:
    state = run(BUDGET, R.BatchState.empty(), R.Charge(ev.PureDpEvent(0.5), "c"))
    with pytest.raises(R.ChargeRefused) as info:
        R.reserve(BUDGET, state, R.Charge(ev.PureDpEvent(0.4), "c"))
    assert info.value.code == "noise_commitment_mismatch"


def test_replay_of_uncommitted_noise_is_refused() -> None:
    admission = R.reserve(BUDGET, R.BatchState.empty(), R.Charge(ev.PureDpEvent(0.5), "c"))
    with pytest.raises(R.ChargeRefused) as info:
        R.reserve(BUDGET, admission.state, R.Charge(ev.PureDpEvent(0.5), "c"))
    assert info.value.code == "noise_commitment_pending"


def test_fresh_noise_is_a_new_sequential_charge_and_can_exceed() -> None:
    state = run(BUDGET, R.BatchState.empty(), R.Charge(ev.PureDpEvent(1.5), "first"))
    more = run(BUDGET, state, R.Charge(ev.PureDpEvent(0.5), "second"))
    assert more.epsilon_spent == 2
    assert [c.commitment for c in more.noise_commitments] == ["first", "second"]
    with pytest.raises(R.BudgetExceeded):
        R.reserve(BUDGET, more, R.Charge(ev.PureDpEvent(0.1), "third"))
    with pytest.raises(R.BudgetExceeded):
        R.reserve(BUDGET, more, R.Charge(ev.PureDpEvent(0.1)))  # no commitment: fresh too
    replay = run(BUDGET, more, R.Charge(ev.PureDpEvent(0.5), "second"))
    assert replay.epsilon_spent == 2 and replay.naive_epsilon == Decimal("2.5")


def test_cancel_removes_an_unreleased_commitment_and_restores_the_state() -> None:
    empty = R.BatchState.empty()
    admission = R.reserve(BUDGET, empty, R.Charge(ev.PureDpEvent(0.5), "c"))
    assert R.cancel(BUDGET, admission.state, admission.cost, None) == empty
    state = run(BUDGET, empty, R.Charge(ev.PureDpEvent(0.5), "c"))
    replay = R.reserve(BUDGET, state, R.Charge(ev.PureDpEvent(0.5), "c"))
    assert replay.cost.replay and replay.cost.epsilon == 0
    assert R.cancel(BUDGET, replay.state, replay.cost, None) == state


def test_partial_commit_then_abort_leaves_only_the_released_run_replayable() -> None:
    full = ev.SelfComposedEvent(ev.PureDpEvent(0.1), 10)
    part = ev.SelfComposedEvent(ev.PureDpEvent(0.1), 4)
    admission = R.reserve(BUDGET, R.BatchState.empty(), R.Charge(full, "c"))
    settled = R.commit(BUDGET, admission.state, R.Charge(full, "c"), admission.cost, None, part)
    state = R.cancel(BUDGET, settled.state, admission.cost, settled.committed)
    assert state.epsilon_spent == Decimal("0.4") and state.epsilon_held == 0
    assert R.reserve(BUDGET, state, R.Charge(part, "c")).cost.epsilon == 0
    with pytest.raises(R.ChargeRefused):
        R.reserve(BUDGET, state, R.Charge(full, "c"))


def test_lifelong_on_the_renyi_filter() -> None:
    budget = R.Budget.create(rule="lifelong", epsilon=3.0, delta=1e-5, accountant="rdp")
    event = ev.SelfComposedEvent(ev.PoissonSampledEvent(0.02, ev.GaussianEvent(1.5)), 100)
    state = run(budget, R.BatchState.empty(), R.Charge(event, "n"))
    spent = state.epsilon_spent
    for _ in range(10):
        state = run(budget, state, R.Charge(event, "n"))
    assert state.epsilon_spent == spent
    assert state.naive_epsilon > 10 * spent / 2
    assert "L2DP-ML" in R.theorem(budget) and "Feldman" in R.theorem(budget)


@settings(max_examples=40, deadline=None)
@given(
    tasks=st.integers(min_value=1, max_value=30),
    replays=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=30),
    eps=st.decimals(min_value="0.01", max_value="1", places=2).map(float),
)
def test_lifelong_spend_is_independent_of_tasks_and_replays(
    tasks: int, replays: list[int], eps: float
) -> None:
    charge = R.Charge(ev.PureDpEvent(eps), "memory")
    memory = run(BUDGET, R.BatchState.empty(), charge)
    once = memory.epsilon_spent
    count = 1
    for task in range(tasks):
        for _ in range(replays[task % len(replays)]):
            memory = run(BUDGET, memory, charge)
            count += 1
        assert memory.epsilon_spent == once == Decimal(repr(eps))
    assert memory.naive_epsilon == once * count
