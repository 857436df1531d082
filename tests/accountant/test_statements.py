"""Issue 24 §3–4: every number a release states is a valid bound for what it names.

* the guarantee of a release holds under adaptive stopping: a declared plan segment stopped early
  after its loss was seen states the segment's whole ε, never the prefix's; a Rényi filter states
  its budget, never its progress; a parallel checkpoint the whole reserved run;
* the run alone is its own (ε, δ) at the budget's δ by PRV, checked against prv-accountant and
  dp-accounting;
* theorem texts are written from the budget's parameters (no "split equally" for unequal weights);
* people read 4 significant digits rounded toward the safe side.
"""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prv_accountant import PRVAccountant
from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism

from accountant import events as ev
from accountant import rules as R
from accountant.certificates import BatchSet, ClassRecord, batch_set_hash, content_hash, issue, verify
from accountant.rules import BatchState, Budget, Charge
from accountant.rules.prices import fresh_price, prv_epsilon
from accountant.statements import batch_guarantee, run_alone, shown

DELTA = Decimal("1e-5")
ONE_BATCH = BatchSet(1, batch_set_hash([("b", 0)]))


def dpsgd(q: float, sigma: float, steps: int) -> ev.DpEvent:
    return ev.SelfComposedEvent(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), steps)


def _fresh(budget: Budget, event: ev.DpEvent) -> tuple[Decimal, Decimal]:
    return fresh_price(budget, event)


def certify_commit(
    budget: Budget, state: BatchState, charge: Charge, partial: ev.DpEvent | None = None
) -> tuple[dict[str, object], BatchState]:
    """Reserve ``charge`` on one batch, commit it (or the checkpoint ``partial``), certify."""
    admission = R.reserve(budget, state, charge)
    settled = R.commit(budget, admission.state, charge, admission.cost, None, partial)
    record = ClassRecord(0, 1, state, admission.cost, admission.state, None, settled.state, settled.committed)
    cert = issue(
        budget=budget, charge=charge, classes=[record], batch_set=ONE_BATCH, reservation_id="r",
        release={"model": "m", "version": 1}, partial_event=partial, issued_at="2026-11-27T00:00:00Z",
    )  # fmt: skip
    return cert, settled.state


def loss_after(steps: int) -> float:
    """The loss a trainer sees after ``steps`` (a stand-in for what the released model does)."""
    return 2.0 / (1 + steps / 100)


def test_a_segment_stopped_early_after_seeing_its_loss_states_the_whole_segment() -> None:
    """The trainer declares 4 chunks of 100 DP-SGD steps as a plan, checks its loss after each and
    stops once it is below 0.8 — after 2 chunks. The prefix's PRV ε (what was stated before) is
    no guarantee when the stopping depends on the outputs; the segment's whole ε is (the stopped
    run is post-processing of the whole segment). Spend and certificate state the whole ε."""
    chunk = dpsgd(0.01, 1.1, 100)
    budget = Budget.create(
        rule="sequential", epsilon=4, delta=DELTA, accountant="prv", plan=[chunk] * 4, plan_delta=DELTA
    )
    assert budget.plan_epsilon is not None
    state, certificates, ran = BatchState.empty(), [], 0
    while True:
        cert, state = certify_commit(budget, state, Charge(chunk))
        certificates.append(cert)
        ran += 1
        if loss_after(100 * ran) < 0.8:
            break
    assert ran == 2  # stopped early, because of what it saw
    prefix = prv_epsilon((chunk, chunk), DELTA)
    assert prefix < budget.plan_epsilon  # the prefix's ε is smaller: stating it would be unsound
    for cert in certificates:  # every checkpoint states the whole segment
        assert verify(cert).ok
        result = cert["result"]
        assert isinstance(result, dict)
        assert Decimal(result["epsilon"]) == budget.plan_epsilon
        assert result["guarantee"] == {"epsilon": str(budget.plan_epsilon), "delta": "0.00001"}
    assert state.epsilon_spent == budget.plan_epsilon and state.delta_spent == DELTA  # the spend view
    assert batch_guarantee(budget, state) == (budget.plan_epsilon, DELTA)
    # Against prv-accountant for the whole segment (400 steps): never less than its lower bound.
    library = PRVAccountant(
        PoissonSubsampledGaussianMechanism(0.01, 1.1),
        max_self_compositions=400,
        eps_error=0.01,
        delta_error=1e-9,
    )
    lower, _, _ = library.compute_epsilon(float(DELTA), 400)
    assert float(state.epsilon_spent) >= lower


def test_a_checkpoint_inside_a_segment_states_the_whole_segment() -> None:
    run = dpsgd(0.01, 1.1, 400)
    budget = Budget.create(rule="sequential", epsilon=4, delta=DELTA, accountant="prv", plan=[run])
    cert, state = certify_commit(budget, BatchState.empty(), Charge(run), partial=dpsgd(0.01, 1.1, 150))
    assert verify(cert).ok
    assert cert["result"]["guarantee"]["epsilon"] == str(budget.plan_epsilon)  # type: ignore[index]
    assert state.epsilon_spent == budget.plan_epsilon


def test_a_filter_release_states_the_filter_budget_not_its_progress() -> None:
    """The issue's job: q 0.0445, σ 1.3, 23 steps on a sequential/rdp budget (8, 1e-5)."""
    run = dpsgd(0.0445, 1.3, 23)
    budget = Budget.create(rule="sequential", epsilon=8, delta=DELTA, accountant="rdp")
    cert, _ = certify_commit(budget, BatchState.empty(), Charge(run))
    assert verify(cert).ok
    result = cert["result"]
    assert isinstance(result, dict)
    progress = Decimal(result["epsilon"])
    assert 0 < progress < 8  # the filter's progress: a budget share, no guarantee of anything
    assert result["guarantee"] == {"epsilon": "8", "delta": "0.00001"}
    assert (
        result["budget_share"] == result["charge"] and Decimal(result["budget_share"]["epsilon"]) == progress
    )
    assert batch_guarantee(budget, BatchState.empty()) == (0, 0)  # nothing ran: nothing to guarantee


def test_a_parallel_checkpoint_states_the_whole_reserved_run() -> None:
    run, checkpoint = dpsgd(0.01, 1.1, 500), dpsgd(0.01, 1.1, 200)
    budget = Budget.create(rule="parallel", epsilon=8, delta=DELTA, accountant="rdp")
    cert, state = certify_commit(budget, BatchState.empty(), Charge(run), partial=checkpoint)
    whole, _ = _fresh(budget, run)
    prefix, _ = _fresh(budget, checkpoint)
    assert prefix < whole
    assert state.epsilon_spent == whole and Decimal(cert["result"]["guarantee"]["epsilon"]) == whole  # type: ignore[index]
    basic = Budget.create(rule="parallel", epsilon=8, delta=0, accountant="basic")
    _, kept = certify_commit(basic, BatchState.empty(), Charge(ev.PureDpEvent(0.5)), partial=ev.NoOpEvent())
    assert kept.epsilon_spent == 0  # basic: an exact sum of what ran is a valid odometer


def test_certificates_of_version_2_keep_verifying_and_cannot_borrow_the_new_theorem() -> None:
    budget = Budget.create(rule="sequential", epsilon=8, delta=DELTA, accountant="rdp")
    with R.pricing_version(2):
        cert, _ = certify_commit(budget, BatchState.empty(), Charge(dpsgd(0.0445, 1.3, 23)))
    old = {k: v for k, v in cert.items() if k != "hash"}
    old["version"], old["theorem"] = 2, R.theorem(budget)
    old["result"] = {k: v for k, v in cert["result"].items() if k not in ("guarantee", "budget_share")}  # type: ignore[union-attr]
    old["hash"] = content_hash(old)
    assert verify(old).ok, verify(old).reason
    stated = {**old, "theorem": R.stated_theorem(budget)}
    stated["hash"] = content_hash(stated)
    assert "theorem does not match" in verify(stated).reason
    borrowed = {**cert, "theorem": R.theorem(budget)}  # version 3 citing the fixed text
    borrowed["hash"] = content_hash(borrowed)
    assert not verify(borrowed).ok


def test_the_theorem_states_the_delta_split_the_filter_uses() -> None:
    placed = Budget.create(rule="sequential", epsilon=8, delta=DELTA, accountant="rdp")
    assert placed.delta_weights is not None and len(set(placed.delta_weights)) > 1
    text = R.stated_theorem(placed)
    assert "equally" not in text and "in proportion to the weights" in text
    assert "(epsilon = 8, delta = 0.00001)" in text
    assert "equally" in R.theorem(placed)  # the text of versions 1-2, which this fixes
    grid = Budget.create(
        rule="sequential", epsilon=8, delta=DELTA, accountant="rdp", orders=[2, 4, 8, 16, 32]
    )
    assert "equally (delta_alpha = " in R.stated_theorem(grid)
    segments = Budget.create(
        rule="sequential",
        epsilon=4,
        delta=DELTA,
        accountant="prv",
        plan=[dpsgd(0.01, 1.1, 100)],
        plan_delta="5e-6",
    ).with_segment([ev.PureDpEvent(0.5)], "5e-6")
    text = R.stated_theorem(segments)
    second = (
        f"segment 1: 1 event(s), (epsilon_1, delta_1) <= ({shown(segments.segments[0].epsilon)}, 0.000005)"
    )
    assert second in text and "charged whole" in text
    for rule, accountant in (("parallel", "rdp"), ("lifelong", "basic"), ("geometric", "basic")):
        budget = Budget.create(
            rule=rule, epsilon=2, delta=0 if accountant == "basic" else DELTA, accountant=accountant
        )
        assert "(epsilon = 2, delta = " in R.stated_theorem(budget)


def test_the_run_alone_is_its_prv_upper_bound_at_the_budget_delta() -> None:
    """The issue's run alone is about 1.03 (PLD), 1.30 by RDP: the statement says ≈ 1.042, never
    below prv-accountant's lower bound, and tighter than RDP."""
    import dp_accounting

    run = dpsgd(0.0445, 1.3, 23)
    alone = run_alone(run, DELTA)
    assert alone["accountant"] == "prv (upper bound)" and alone["delta"] == "0.00001"
    library = PRVAccountant(
        PoissonSubsampledGaussianMechanism(0.0445, 1.3),
        max_self_compositions=23,
        eps_error=0.01,
        delta_error=1e-9,
    )
    lower, _, _ = library.compute_epsilon(1e-5, 23)
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.0445, dp_accounting.GaussianDpEvent(1.3)), 23
        )
    )
    assert lower <= float(alone["epsilon"]) < rdp.get_epsilon(1e-5)
    assert shown(alone["epsilon"]) == "1.042"
    assert run_alone(ev.PureDpEvent(0.25), Decimal(0)) == {
        "epsilon": "0.25",
        "delta": "0",
        "accountant": "basic (exact)",
    }
    assert run_alone(run, Decimal(0))["epsilon"] == "Infinity"  # no Gaussian run is (ε, 0)-DP


@pytest.mark.parametrize(
    ("value", "way", "text"),
    [
        ("0.49980000000000001", "up", "0.4999"),
        ("0.4998", "up", "0.4998"),
        ("1.04191179380027777", "up", "1.042"),
        ("1.04191179380027777", "down", "1.041"),
        ("9.9996", "up", "10"),
        ("7.5002", "down", "7.5"),
        ("0.00001", "up", "0.00001"),
        ("9.9912e-7", "up", "9.992e-7"),
        ("123456", "up", "123500"),
        ("Infinity", "up", "inf"),
        ("0", "down", "0"),
    ],
)
def test_shown_numbers_have_4_digits_rounded_toward_the_safe_side(value: str, way: str, text: str) -> None:
    assert shown(value, way) == text  # type: ignore[arg-type]


@given(
    value=st.decimals(min_value=Decimal("1e-12"), max_value=Decimal("1e12"), allow_nan=False, places=None),
    way=st.sampled_from(["up", "down"]),
)
def test_shown_is_a_bound_on_the_side_it_rounds_to(value: Decimal, way: str) -> None:
    text = shown(value, way)  # type: ignore[arg-type]
    assert (Decimal(text) >= value) if way == "up" else (Decimal(text) <= value)
    assert len(Decimal(text).normalize().as_tuple().digits) <= 4


@pytest.mark.parametrize(
    ("sigma", "count"), [(2.0, 10), (1.0, 1), (50.0, 1), pytest.param(0.8, 200, marks=pytest.mark.slow)]
)
def test_a_lone_gaussian_run_states_its_exact_epsilon(sigma: float, count: int) -> None:
    """Balle & Wang 2018, Thm. 8 (the analytic Gaussian): within prv-accountant's bounds for the
    same run, and no larger than the PRV upper bound the ledger would state otherwise."""
    from prv_accountant.privacy_random_variables import GaussianMechanism

    event = ev.SelfComposedEvent(ev.GaussianEvent(sigma), count) if count > 1 else ev.GaussianEvent(sigma)
    alone = run_alone(event, DELTA)
    assert alone["accountant"] == "exact (analytic Gaussian)"
    library = PRVAccountant(
        GaussianMechanism(sigma), max_self_compositions=count, eps_error=0.01, delta_error=1e-10
    )
    lower, _, upper = library.compute_epsilon(float(DELTA), count)
    assert lower <= float(alone["epsilon"]) <= upper
    assert Decimal(alone["epsilon"]) <= prv_epsilon((event,), DELTA)


def test_adaptively_chosen_basic_charges_state_their_sum_at_the_budget_delta() -> None:
    """Basic composition is a privacy odometer for the realised Σεᵢ with a δ fixed in advance that
    bounds Σδᵢ on every path (Rogers, Roth, Ullman & Vadhan 2016): the budget's δ, not the δ the
    charges so far happened to use."""
    budget = Budget.create(rule="sequential", epsilon=1, delta=DELTA, accountant="basic")
    cert, state = certify_commit(budget, BatchState.empty(), Charge(ev.PureDpEvent(0.3)))
    assert state.delta_spent == 0 and batch_guarantee(budget, state) == (Decimal("0.3"), DELTA)
    assert cert["result"]["guarantee"] == {"epsilon": "0.3", "delta": "0.00001"}  # type: ignore[index]
    pure = Budget.create(rule="sequential", epsilon=1, delta=0, accountant="basic")
    _, state = certify_commit(pure, BatchState.empty(), Charge(ev.PureDpEvent(0.3)))
    assert batch_guarantee(pure, state) == (Decimal("0.3"), 0)
    parallel = Budget.create(rule="parallel", epsilon=1, delta=DELTA, accountant="basic")
    _, state = certify_commit(parallel, BatchState.empty(), Charge(ev.PureDpEvent(0.3)))
    assert batch_guarantee(parallel, state) == (Decimal("0.3"), 0)  # one charge, fixed in advance
