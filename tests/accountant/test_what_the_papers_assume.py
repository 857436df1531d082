"""What the papers assume (issue 13 §4; docs/DESIGN-NOTES.md note 21).

* L2DP-ML Thm. 2's input term ε1/γx is the Laplace bound for an ℓ1 sensitivity of 1; a record of
  [0, 1]^d moves by d. The ``"sound"`` analysis charges d·ε1/γx, checked here against a direct
  computation of the privacy loss on a worst-case pair of neighbouring batches.
* Add/remove (Poisson) and replace-one (sampling without replacement) events never compose on
  one batch, nor inside one event.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from scipy import stats

from accountant import events as ev
from accountant import mechanisms as mech
from accountant import rules as R
from accountant.certificates import BatchSet, ClassRecord, batch_set_hash, content_hash, issue, verify
from accountant.errors import InvalidArgumentError

D, H1, BATCH, EPS1, EPS2, BOUND = 64, 4, 72, 2.0, 1.0, 2.0

ONE_BATCH = BatchSet(1, batch_set_hash([("b", 0)]))


def l2dp(analysis: str | None) -> ev.FunctionalMechanismL2DPEvent:
    return ev.FunctionalMechanismL2DPEvent(EPS1, EPS2, D, H1, H1, BATCH, BOUND, analysis=analysis)


def input_scale() -> float:
    """Per-coordinate Laplace scale of χ1/|B|: Δ_R/(ε1|B|) (Alg. 2 line 1–2, the worker's)."""
    return D * (H1 + 2) / (EPS1 * BATCH)


def batch_log_density(x_bar: np.ndarray, x: np.ndarray, b: float) -> np.ndarray:
    """log p(x̄ | X) with an *independent* Lap(b) draw per record and coordinate; rows summed."""
    return np.asarray(stats.laplace.logpdf(x_bar, loc=x[None], scale=b).sum(axis=(-2, -1)))


# -- L2DP-ML: the input term --------------------------------------------------------------------


def test_sound_input_term_is_the_privacy_loss_on_a_worst_case_pair_of_batches() -> None:
    """Neighbouring batches X, X′ (replace-one) differ in one record: all zeros vs all ones, the
    farthest two points of [0, 1]^d (ℓ1 distance d). The largest log-density ratio of the whole
    perturbed batch, found numerically, is d/b: the sound term. The paper's is 1/b, d times less."""
    b = input_scale()
    rng = np.random.default_rng(0)
    n = 5
    x = rng.uniform(0.0, 1.0, (n, D))
    x_prime = x.copy()
    x[2], x_prime[2] = 0.0, 1.0
    # Outputs: random ones, and the corner below both (where every coordinate's ratio is e^{1/b}).
    outputs = x[None] + rng.laplace(0.0, b, (2000, n, D))
    outputs[0, 2] = -5.0
    loss = batch_log_density(outputs, x, b) - batch_log_density(outputs, x_prime, b)
    worst = float(np.max(np.abs(loss)))
    assert worst <= D / b * (1 + 1e-9)
    assert worst == pytest.approx(D / b, rel=1e-9)  # attained: no smaller ε is valid

    sound, paper = mech.l2dp_ml_event_epsilon(l2dp("sound")), mech.l2dp_ml_event_epsilon(l2dp("paper"))
    rest = EPS1 + EPS1 * BATCH * BOUND / (2 * D * (H1 + 2)) + EPS2  # ε1 + ε1/γ + ε2
    assert sound == pytest.approx(rest + worst, rel=1e-12)
    assert paper == pytest.approx(rest + 1 / b, rel=1e-12)
    assert sound - rest == pytest.approx(EPS1 * BATCH / (H1 + 2), rel=1e-12)  # the audit's term
    assert paper < sound and (sound - rest) == pytest.approx(D * (paper - rest), rel=1e-12)


def test_with_one_shared_noise_vector_the_batch_publishes_differences_exactly() -> None:
    """Alg. 2 as printed (``"paper"``): x̄_r = x_r + χ1/|B| with one χ1 for the batch. Whatever
    the noise, x̄_r − x̄_s = x_r − x_s, so two neighbouring batches give outputs on disjoint sets
    (probability 1 vs 0): no finite ε, and Thm. 2's post-processing step has nothing to stand on."""
    b = input_scale()
    rng = np.random.default_rng(1)
    x = rng.uniform(0.0, 1.0, (4, D))
    x_prime = x.copy()
    x_prime[2] = 1.0 - x[2]
    for _ in range(100):
        chi = rng.laplace(0.0, b, D)
        out, out_prime = x + chi, x_prime + chi
        assert np.allclose(out[2] - out[0], x[2] - x[0], atol=1e-12)
        assert np.allclose(out_prime[2] - out_prime[0], x_prime[2] - x_prime[0], atol=1e-12)
    assert not np.allclose(x[2] - x[0], x_prime[2] - x_prime[0])


@pytest.mark.parametrize("d", [1, 2, 17, 300])
def test_paper_term_is_at_most_the_sound_one_and_equal_only_in_one_dimension(d: int) -> None:
    kwargs: dict[str, Any] = dict(
        epsilon1=0.7, epsilon2=0.3, input_dim=d, hidden_units=5, batch_size=33, theta1_norm_bound=1.5
    )
    paper = mech.l2dp_ml_epsilon(**kwargs)
    sound = mech.l2dp_ml_epsilon(**kwargs, analysis="sound")
    exact = Fraction(0.7) * (1 + Fraction(33, 5 + 2) + Fraction(33) * Fraction(1.5) / (2 * d * 7)) + Fraction(
        0.3
    )
    assert sound >= exact and math.nextafter(sound, 0) < exact  # exact, rounded up once
    assert paper <= sound and (paper == sound) == (d == 1)
    with pytest.raises(InvalidArgumentError, match="analysis"):
        mech.l2dp_ml_epsilon(**kwargs, analysis="tight")


STORED = {
    "kind": "l2dp_ml_functional",
    "epsilon1": 2.0,
    "epsilon2": 1.0,
    "input_dim": 64,
    "hidden_units": 4,
    "output_hidden_units": 4,
    "batch_size": 72,
    "theta1_norm_bound": 2.0,
}


def test_an_event_stored_without_analysis_parses_and_prices_as_before() -> None:
    event = ev.from_json(STORED)
    assert isinstance(event, ev.FunctionalMechanismL2DPEvent)
    assert event.analysis is None and event.charged_analysis == "paper"
    assert ev.to_json(event) == STORED  # so its fingerprint is unchanged
    assert R.event_fingerprint(event) == R.event_fingerprint(ev.from_json(ev.to_json(event)))
    assert mech.l2dp_ml_event_epsilon(event) == mech.l2dp_ml_event_epsilon(l2dp("paper"))
    assert R.event_fingerprint(event) != R.event_fingerprint(l2dp("paper"))  # spelled differently
    for analysis in ("paper", "sound"):
        assert ev.from_json({**STORED, "analysis": analysis}) == l2dp(analysis)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"analysis": "tight"}, "event.analysis"),
        ({"analysis": 1}, "event.analysis"),
        ({"analysis": "sound", "analyses": "sound"}, "event.analyses"),
    ],
)
def test_analysis_must_be_known_and_unknown_fields_stay_refused(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(ev.EventValidationError) as info:
        ev.from_json({**STORED, **extra})
    assert info.value.field == field
    nested = {"kind": "self_composed", "count": 2, "event": {**STORED, **extra}}
    with pytest.raises(ev.EventValidationError) as info:
        ev.from_json(nested)
    assert info.value.field == "event.event" + field[len("event") :]


def _certificate(charge: R.Charge) -> dict[str, Any]:
    budget = R.Budget.create(rule="lifelong", epsilon=1000.0, delta=0.0, accountant="basic")
    state = R.BatchState.empty()
    admission = R.reserve(budget, state, charge)
    settled = R.commit(budget, admission.state, charge, admission.cost, None)
    record = ClassRecord(0, 1, state, admission.cost, admission.state, None, settled.state, settled.committed)
    return issue(
        budget=budget,
        charge=charge,
        classes=[record],
        batch_set=ONE_BATCH,
        reservation_id="r",
        release={"v": 1},
    )


def test_the_certificate_names_the_analysis_charged() -> None:
    for analysis, words in (("sound", "analysis 'sound'"), ("paper", "analysis 'paper'"), (None, "without")):
        cert = _certificate(R.Charge(l2dp(analysis), "c"))
        assert len(cert["analyses"]) == 1 and words in cert["analyses"][0]
        # issue 24 §5: the numbers re-derive, but Thm. 2 as printed is not a valid bound
        result = verify(cert)
        assert result.ok is result.valid_bound is (analysis == "sound"), result
        assert analysis == "sound" or "is not a valid bound" in result.reason
        forged = {**cert, "analyses": _certificate(R.Charge(l2dp("sound"), "c"))["analyses"]}
        forged["hash"] = content_hash(forged)
        assert analysis == "sound" or not verify(forged).ok
    plain = _certificate(R.Charge(ev.PureDpEvent(1.0)))
    assert "analyses" not in plain and verify(plain).ok


# -- neighbouring relations ---------------------------------------------------------------------

POISSON = ev.SelfComposedEvent(ev.PoissonSampledEvent(0.01, ev.GaussianEvent(1.0)), 10)
WITHOUT_REPLACEMENT = ev.SelfComposedEvent(
    ev.SampledWithoutReplacementEvent(60, 6000, ev.GaussianEvent(1.0)), 10
)
RDP_BUDGETS = [
    R.Budget.create(rule=rule, epsilon=50.0, delta=1e-5, accountant="rdp")
    for rule in ("sequential", "lifelong")
]


def test_relations_of_events() -> None:
    assert ev.neighbouring_relations(POISSON) == {ev.ADD_REMOVE: "poisson_sampled"}
    assert ev.neighbouring_relations(WITHOUT_REPLACEMENT) == {ev.REPLACE_ONE: "sampled_without_replacement"}
    assert ev.neighbouring_relations(l2dp("sound")) == {ev.REPLACE_ONE: "l2dp_ml_functional"}
    assert ev.neighbouring_relations(ev.OutputPerturbationEvent(0.1, 1.0)) == {
        ev.REPLACE_ONE: "output_perturbation"
    }
    for neutral in (ev.GaussianEvent(1.0), ev.LaplaceEvent(1.0), ev.PureDpEvent(1.0), ev.NoOpEvent()):
        assert ev.neighbouring_relations(neutral) == {}
    assert len(ev.neighbouring_relations(ev.ComposedEvent((POISSON, WITHOUT_REPLACEMENT)))) == 2


@pytest.mark.parametrize("budget", RDP_BUDGETS, ids=lambda b: b.rule)
@pytest.mark.parametrize(
    ("first", "second"), [(POISSON, WITHOUT_REPLACEMENT), (WITHOUT_REPLACEMENT, POISSON)]
)
def test_one_batch_never_composes_two_relations(
    budget: R.Budget, first: ev.DpEvent, second: ev.DpEvent
) -> None:
    admission = R.reserve(budget, R.BatchState.empty(), R.Charge(first, "a"))
    state = R.commit(budget, admission.state, R.Charge(first, "a"), admission.cost, None).state
    assert state.neighbouring_relation == next(iter(ev.neighbouring_relations(first)))
    state = R.BatchState.from_json(state.to_json())  # the relation is stored with the batch
    with pytest.raises(R.ChargeRefused) as info:
        R.reserve(budget, state, R.Charge(second, "b"))
    assert info.value.code == "mixed_neighbouring_relations"
    assert "add/remove" in info.value.message and "replace-one" in info.value.message
    # The same relation and neutral events still compose.
    for more in (first, ev.GaussianEvent(20.0)):
        assert (
            R.reserve(budget, state, R.Charge(more, "c")).state.neighbouring_relation
            == state.neighbouring_relation
        )


@pytest.mark.parametrize("budget", RDP_BUDGETS, ids=lambda b: b.rule)
def test_one_event_mixing_relations_is_refused_at_pricing(budget: R.Budget) -> None:
    mixed = ev.ComposedEvent((POISSON, ev.GaussianEvent(3.0), WITHOUT_REPLACEMENT))
    with pytest.raises(R.ChargeRefused) as info:
        R.reserve(budget, R.BatchState.empty(), R.Charge(mixed))
    assert info.value.code == "mixed_neighbouring_relations"
    assert "'poisson_sampled'" in info.value.message and "'sampled_without_replacement'" in info.value.message


def test_an_l2dp_batch_is_replace_one() -> None:
    budget = RDP_BUDGETS[1]  # lifelong
    state = R.reserve(budget, R.BatchState.empty(), R.Charge(l2dp("sound"), "c")).state
    assert state.neighbouring_relation == ev.REPLACE_ONE
    with pytest.raises(R.ChargeRefused, match="poisson_sampled"):
        R.reserve(budget, state, R.Charge(POISSON, "d"))
    assert (
        R.reserve(budget, state, R.Charge(WITHOUT_REPLACEMENT, "d")).state.neighbouring_relation
        == ev.REPLACE_ONE
    )


def test_a_neutral_charge_leaves_the_relation_open_and_aborts_free_it() -> None:
    budget = RDP_BUDGETS[0]
    state = R.reserve(budget, R.BatchState.empty(), R.Charge(ev.GaussianEvent(5.0))).state
    assert state.neighbouring_relation is None and "neighbouring_relation" not in state.to_json()
    held = R.reserve(budget, state, R.Charge(POISSON))
    assert held.state.neighbouring_relation == ev.ADD_REMOVE
    # Another reservation is still on the batch: the relation stays (conservative).
    assert R.cancel(budget, held.state, held.cost, None).neighbouring_relation == ev.ADD_REMOVE
    alone = R.reserve(budget, R.BatchState.empty(), R.Charge(POISSON))
    assert R.cancel(budget, alone.state, alone.cost, None) == R.BatchState.empty()


def test_a_state_stored_before_the_field_reads_without_relation() -> None:
    old = R.BatchState.empty().to_json()
    assert "neighbouring_relation" not in old
    assert R.BatchState.from_json(old).neighbouring_relation is None
    with pytest.raises(InvalidArgumentError, match=r"state\.neighbouring_relation"):
        R.BatchState.from_json({**old, "neighbouring_relation": "bounded"})
