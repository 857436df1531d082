"""Plan segments on a sequential ``prv`` budget: each segment priced by PRV at its δ share
(checked against prv-accountant itself), segments composed by the basic-composition filter,
a closed segment charged in full, and what a client may not do (δ shares beyond δ, a segment on
another budget, one declared while an entry is open, a closed segment run again)."""

from __future__ import annotations

import warnings
from decimal import Decimal

import pytest
from prv_accountant import PRVAccountant
from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism

from accountant import events as ev
from accountant import rules as R
from accountant.certificates import BatchSet, ClassRecord, batch_set_hash, content_hash, issue, verify
from accountant.errors import InvalidArgumentError
from accountant.exact import exact_add, exact_sub
from accountant.rules import BatchState, Budget, Charge
from accountant.rules.sequential import PARALLEL_OVER_BATCHES, THEOREMS

warnings.filterwarnings("ignore", module="prv_accountant")

DELTA = Decimal("1e-5")
SHARE = Decimal("5e-6")

ONE_BATCH = BatchSet(1, batch_set_hash([("b", 0)]))


def dpsgd(q: float, sigma: float, steps: int) -> ev.DpEvent:
    return ev.SelfComposedEvent(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), steps)


# The user trial's shape: one DP-SGD run declared as the plan, then the rest of ε = 2 spent.
FIRST = dpsgd(0.01, 1.1, 500)
SECOND = dpsgd(0.01, 1.5, 300)


def prv_library_epsilon(q: float, sigma: float, steps: int, delta: float) -> tuple[float, float]:
    """(lower, upper) of prv-accountant's own PRVAccountant (eps_error 0.01)."""
    accountant = PRVAccountant(
        PoissonSubsampledGaussianMechanism(q, sigma),
        max_self_compositions=steps,
        eps_error=0.01,
        delta_error=1e-9,
    )
    lower, _, upper = accountant.compute_epsilon(delta, steps)
    return lower, upper


def budget_with_share() -> Budget:
    return Budget.create(
        rule="sequential", epsilon=2, delta=DELTA, accountant="prv", plan=[FIRST], plan_delta=SHARE
    )


def run(budget: Budget, state: BatchState, event: ev.DpEvent) -> BatchState:
    admission = R.reserve(budget, state, Charge(event))
    return R.commit(budget, admission.state, Charge(event), admission.cost, None).state


def _legacy(budget: Budget) -> Budget:
    """``budget`` as one stored before issue 25 §4: no ``plan_pricing`` (its plans priced by PRV)."""
    stored = budget.to_json()
    stored.pop("plan_pricing")
    stored.pop("plan_epsilon")
    for segment in stored.get("segments", []):
        segment["epsilon"] = "0"  # recomputed below (not trusted)
    return Budget.from_json(stored, trust_plan_epsilon=False)


def test_each_segment_is_priced_at_its_delta_share_tight_now_and_by_prv_when_stored_before() -> None:
    """A new budget prices every declared plan by the tight engine (issue 25 §4): within
    prv-accountant's own [lower, upper]; a budget stored before keeps its PRV price (its upper
    bound, to the mesh error), and each re-verifies under what it recorded."""
    budget = budget_with_share()
    grown = budget.with_segment([SECOND], SHARE)
    (segment,) = grown.segments
    assert budget.plan_pricing == R.PLAN_PRICING and budget.plan_epsilon is not None
    assert (segment.plan, segment.delta) == ((SECOND,), SHARE)
    first = prv_library_epsilon(0.01, 1.1, 500, float(SHARE))
    second = prv_library_epsilon(0.01, 1.5, 300, float(SHARE))
    assert first[0] <= float(budget.plan_epsilon) <= first[1]
    assert second[0] <= float(segment.epsilon) <= second[1]
    old = _legacy(budget).with_segment([SECOND], SHARE)
    assert old.plan_pricing is None and old.plan_epsilon is not None
    assert first[0] <= float(old.plan_epsilon) == pytest.approx(first[1], abs=5e-3)
    assert second[0] <= float(old.segments[0].epsilon) == pytest.approx(second[1], abs=5e-3)
    assert budget.plan_epsilon < old.plan_epsilon and segment.epsilon < old.segments[0].epsilon
    for b in (grown, old):
        assert Budget.from_json(b.to_json(), trust_plan_epsilon=False) == b


def test_the_user_trial_a_used_up_plan_and_its_leftover_spent_by_a_second_segment() -> None:
    budget = budget_with_share()
    assert budget.plan_epsilon is not None
    state = run(budget, BatchState.empty(), FIRST)
    assert state.epsilon_spent == budget.plan_epsilon and state.delta_spent == SHARE
    with pytest.raises(R.ChargeRefused) as info:  # the plan is used up
        R.reserve(budget, state, Charge(SECOND))
    assert info.value.code == "outside_plan" and "declare a new plan segment" in str(info.value)
    leftover = exact_sub(budget.epsilon, budget.plan_epsilon)
    assert leftover > Decimal("0.4")

    grown = budget.with_segment([SECOND], DELTA - SHARE)
    segment = grown.segments[0]
    assert segment.epsilon <= leftover
    state = run(grown, R.close_segment(budget, state), SECOND)
    # Basic composition of the two segments' (εᵢ, δᵢ): nothing less, and within the budget.
    assert state.epsilon_spent == exact_add(budget.plan_epsilon, segment.epsilon) <= budget.epsilon
    assert state.delta_spent == DELTA
    assert R.within_budget(grown, state)
    assert R.remaining(grown, state).to_json()["epsilon"] == str(exact_sub(leftover, segment.epsilon))


def test_a_closed_segment_is_charged_in_full_on_batches_that_ran_any_of_it_and_never_runs_again() -> None:
    half = dpsgd(0.01, 1.1, 250)
    budget = Budget.create(
        rule="sequential", epsilon=2, delta=DELTA, accountant="prv", plan=[half, half], plan_delta=SHARE
    )
    assert budget.plan_epsilon is not None
    ran_prefix = run(budget, BatchState.empty(), half)
    # Pricing version 3: the whole segment from its first entry, since where it stops may depend on
    # what it released; the certificates of versions 1-2 replay the prefix's PRV ε.
    assert ran_prefix.epsilon_spent == budget.plan_epsilon and ran_prefix.delta_spent == SHARE
    with R.pricing_version(2):
        assert run(budget, BatchState.empty(), half).epsilon_spent < budget.plan_epsilon
    untouched = BatchState.empty()
    closed = R.close_segment(budget, ran_prefix)
    # Where the segment stopped may depend on what it released: the whole segment is charged.
    assert closed.epsilon_spent == budget.plan_epsilon and closed.delta_spent == SHARE
    assert closed.plan_closed == (0,) and closed.plan_position == 0
    assert closed.naive_epsilon >= closed.epsilon_spent  # the naive figure is never below the spend
    assert R.close_segment(budget, untouched) == untouched  # ran none of it: charged nothing

    grown = budget.with_segment([SECOND], SHARE)
    with pytest.raises(R.ChargeRefused) as info:  # the closed segment's second entry
        R.reserve(grown, closed, Charge(half))
    assert info.value.code == "outside_plan" and "plan segment 1" in str(info.value)
    fresh = run(grown, untouched, SECOND)
    assert fresh.epsilon_spent == grown.segments[0].epsilon  # segment 0 costs a batch that skipped it 0


def test_delta_shares_beyond_delta_epsilon_beyond_the_budget_and_other_budgets_are_refused() -> None:
    budget = budget_with_share()
    for delta in ("6e-6", "0", "-1e-6", "nan"):
        with pytest.raises(InvalidArgumentError) as info:
            budget.with_segment([SECOND], delta)
        assert info.value.field == "delta", delta
    grown = budget.with_segment([SECOND], "2.5e-6")
    with pytest.raises(InvalidArgumentError) as info:  # 5e-6 + 2.5e-6 + 3e-6 > 1e-5
        grown.with_segment([SECOND], "3e-6")
    assert info.value.field == "delta"
    with pytest.raises(InvalidArgumentError) as info:
        budget.with_segment([dpsgd(0.01, 0.8, 2000)], SHARE)  # its PRV ε does not fit what is left
    assert info.value.field == "plan" and "more than budget.epsilon" in info.value.message
    with pytest.raises(InvalidArgumentError) as info:
        budget.with_segment([], SHARE)
    assert info.value.field == "plan"
    # A budget created before segments prices its plan at the whole δ: nothing is left for one.
    whole = Budget.create(rule="sequential", epsilon=2, delta=DELTA, accountant="prv", plan=[FIRST])
    with pytest.raises(InvalidArgumentError) as info:
        whole.with_segment([SECOND], "1e-7")
    assert info.value.field == "delta"
    for other in (
        Budget.create(rule="sequential", epsilon=2, delta=DELTA, accountant="rdp"),
        Budget.create(rule="parallel", epsilon=2, delta=DELTA, accountant="prv"),
    ):
        with pytest.raises(InvalidArgumentError) as info:
            other.with_segment([SECOND], SHARE)
        assert info.value.field == "plan"
        with pytest.raises(InvalidArgumentError):
            R.close_segment(other, BatchState.empty())
    with pytest.raises(InvalidArgumentError) as info:
        Budget.create(
            rule="sequential", epsilon=2, delta=DELTA, accountant="prv", plan=[FIRST], plan_delta="2e-5"
        )
    assert info.value.field == "budget.plan_delta"


def test_a_segment_cannot_close_while_an_entry_is_reserved() -> None:
    budget = budget_with_share()
    held = R.reserve(budget, BatchState.empty(), Charge(FIRST)).state
    with pytest.raises(R.ChargeRefused) as info:
        R.close_segment(budget, held)
    assert info.value.code == "plan_step_pending"


def test_certificates_name_the_theorem_and_the_segments_and_recompute_them() -> None:
    budget = budget_with_share()
    first = run(budget, BatchState.empty(), FIRST)
    grown = budget.with_segment([SECOND], SHARE)
    start = R.close_segment(budget, first)
    admission = R.reserve(grown, start, Charge(SECOND))
    settled = R.commit(grown, admission.state, Charge(SECOND), admission.cost, None)
    cert = issue(
        budget=grown,
        charge=Charge(SECOND),
        batch_set=ONE_BATCH,
        classes=[
            ClassRecord(0, 1, start, admission.cost, admission.state, None, settled.state, settled.committed)
        ],
        reservation_id="r",
        release={"model": "m", "version": 2},
    )
    assert "Rogers, Roth, Ullman & Vadhan 2016, Thm. 3.6" in cert["theorem"]
    assert cert["inputs"]["budget"]["segments"][0]["delta"] == "0.000005"
    assert verify(cert).ok, verify(cert).reason

    lied = {**cert, "inputs": {**cert["inputs"], "budget": {**cert["inputs"]["budget"]}}}
    lied["inputs"]["budget"]["segments"] = [{**cert["inputs"]["budget"]["segments"][0], "epsilon": "0.1"}]
    lied["hash"] = content_hash(lied)
    assert not verify(lied).ok  # the segment's ε is recomputed by PRV, not trusted
    greedy = {**cert, "inputs": {**cert["inputs"], "budget": {**cert["inputs"]["budget"]}}}
    greedy["inputs"]["budget"]["segments"] = [{**cert["inputs"]["budget"]["segments"][0], "delta": "0.00001"}]
    greedy["hash"] = content_hash(greedy)
    assert not verify(greedy).ok  # δ shares summing beyond δ


def test_a_certificate_on_a_budget_priced_by_prv_verifies_and_cannot_be_relabelled_tight() -> None:
    """A budget stored before issue 25 §4 keeps pricing its plan by PRV, and its certificates
    recompute that price; the same budget relabelled ``plan_pricing: tight-2`` with its PRV
    ``plan_epsilon`` does not verify (the tight price is recomputed and differs). The theorem
    names the engine."""
    for budget in (_legacy(budget_with_share()), budget_with_share()):
        start = BatchState.empty()
        admission = R.reserve(budget, start, Charge(FIRST))
        settled = R.commit(budget, admission.state, Charge(FIRST), admission.cost, None)
        cert = issue(
            budget=budget,
            charge=Charge(FIRST),
            batch_set=ONE_BATCH,
            classes=[
                ClassRecord(
                    0, 1, start, admission.cost, admission.state, None, settled.state, settled.committed
                )
            ],
            reservation_id="r",
            release={"model": "m", "version": 1},
        )
        assert verify(cert).ok, verify(cert).reason
        tight = budget.plan_pricing is not None
        assert ("pessimistic privacy loss distribution" in cert["theorem"]) == tight
        if not tight:
            relabelled = {**cert, "inputs": {**cert["inputs"], "budget": {**cert["inputs"]["budget"]}}}
            relabelled["inputs"]["budget"]["plan_pricing"] = R.PLAN_PRICING
            relabelled["hash"] = content_hash(relabelled)
            assert not verify(relabelled).ok


def test_budgets_from_before_segments_serialise_and_cite_as_before() -> None:
    new = Budget.create(rule="sequential", epsilon=2, delta=DELTA, accountant="prv", plan=[FIRST])
    assert new.to_json()["plan_pricing"] == R.PLAN_PRICING
    whole = _legacy(new)
    assert set(whole.to_json()) == {
        "rule",
        "epsilon",
        "delta",
        "accountant",
        "geometric",
        "orders",
        "plan",
        "plan_epsilon",
    }
    assert R.theorem(whole) == THEOREMS["prv"] + PARALLEL_OVER_BATCHES
    assert Budget.from_json(whole.to_json(), trust_plan_epsilon=False) == whole
    grown = budget_with_share().with_segment([SECOND], SHARE)
    assert Budget.from_json(grown.to_json(), trust_plan_epsilon=False) == grown
    stored = grown.to_json()
    stored["segments"][0]["epsilon"] = "0.1"
    with pytest.raises(InvalidArgumentError) as info:
        Budget.from_json(stored, trust_plan_epsilon=False)
    assert info.value.field == "budget.segments[0].epsilon"
    assert "plan_closed" not in BatchState.empty().to_json()


# Issue 24 §6: 100 steps at q = 1e-6 with σ = 0.001 reveal a record with probability
# 1 − (1 − 1e-6)^100 ≈ 1e-4: PRV says ε = 0 at δ = 1e-4, and the run is (0, ≈1e-4)-DP.
NEARLY_FREE = dpsgd(1e-6, 0.001, 100)


def test_an_entry_of_prv_epsilon_zero_is_charged_and_certified_the_segments_delta() -> None:
    budget = Budget.create(
        rule="sequential", epsilon=1, delta=Decimal("1e-4"), accountant="prv", plan=[NEARLY_FREE]
    )
    assert budget.plan_epsilon == 0
    start = BatchState.empty()
    admission = R.reserve(budget, start, Charge(NEARLY_FREE))
    assert (admission.cost.epsilon, admission.cost.delta) == (0, Decimal("1e-4"))
    settled = R.commit(budget, admission.state, Charge(NEARLY_FREE), admission.cost, None)
    assert (settled.state.epsilon_spent, settled.state.delta_spent) == (0, Decimal("1e-4"))
    cert = issue(
        budget=budget,
        charge=Charge(NEARLY_FREE),
        batch_set=ONE_BATCH,
        classes=[
            ClassRecord(0, 1, start, admission.cost, admission.state, None, settled.state, settled.committed)
        ],
        reservation_id="r",
        release={"model": "m", "version": 1},
    )
    assert (cert["result"]["epsilon"], cert["result"]["delta"]) == ("0", "0.0001")
    assert verify(cert).ok, verify(cert).reason

    # What the ledger issued before the fix: the same run certified (0, 0), hash recomputed.
    zero = {"delta": "0"}
    (record,) = cert["inputs"]["classes"]
    understated = {
        **cert,
        "inputs": {
            **cert["inputs"],
            "classes": [
                {
                    **record,
                    "reserved": {**record["reserved"], **zero},
                    "state_before": {**record["state_before"], "delta_held": "0"},
                    "committed": {**record["committed"], **zero},
                    "state_after": {**record["state_after"], "delta_spent": "0"},
                }
            ],
        },
        "result": {**cert["result"], "delta": "0", "charge": {**cert["result"]["charge"], **zero}},
    }
    understated["hash"] = content_hash(understated)
    verdict = verify(understated)
    assert not verdict.ok
    assert "delta" in verdict.reason


def test_every_later_segment_charges_its_delta_with_its_first_entry_too() -> None:
    budget = Budget.create(
        rule="sequential",
        epsilon=2,
        delta=Decimal("3e-4"),
        accountant="prv",
        plan=[FIRST],
        plan_delta=Decimal("1e-4"),
    )
    first = run(budget, BatchState.empty(), FIRST)
    grown = budget.with_segment([NEARLY_FREE], Decimal("1e-4"))
    start = R.close_segment(budget, first)
    second = run(grown, start, NEARLY_FREE)
    assert second.epsilon_spent == first.epsilon_spent
    assert second.delta_spent == Decimal("2e-4")
    assert R.delta_of_what_ran(grown, second) == Decimal("2e-4")
