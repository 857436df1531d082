"""One-run auditing (``accountant.privacy_audit``): the p-value and ε lower bound of Steinke, Nasr &
Jagielski 2023, checked against scipy's exact binomial test, against the theorem's bound summed
in exact rationals, against the closed form of the all-correct case, and for soundness by
simulating ε-DP randomized response (the mechanism the bound is tight for)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from accountant import privacy_audit
from accountant.errors import InvalidArgumentError


def _p_value_exact(m: int, r: int, v: int, epsilon: float, delta: Fraction) -> Fraction:
    """The main theorem's bound, term by term in rationals (q rounded once to a Fraction)."""
    q = Fraction(math.exp(epsilon)) / (1 + Fraction(math.exp(epsilon)))

    def pmf(k: int) -> Fraction:
        return math.comb(r, k) * q**k * (1 - q) ** (r - k)

    tail = sum((pmf(k) for k in range(v, r + 1)), Fraction(0))
    alpha = max(
        (sum((pmf(k) for k in range(v - i, v)), Fraction(0)) / i for i in range(1, v + 1)),
        default=Fraction(0),
    )
    return min(tail + 2 * m * delta * alpha, Fraction(1))


@pytest.mark.parametrize(("r", "v", "epsilon"), [(10, 10, 1.0), (50, 40, 0.5), (200, 130, 0.2), (7, 0, 3.0)])
def test_with_delta_zero_the_p_value_is_the_exact_binomial_test(r: int, v: int, epsilon: float) -> None:
    q = 1 / (1 + math.exp(-epsilon))
    expected = stats.binomtest(v, r, q, alternative="greater").pvalue
    got = privacy_audit.p_value(canaries=1000, guesses=r, correct=v, epsilon=epsilon, delta=0.0)
    assert got == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    ("m", "r", "v", "epsilon", "delta"),
    [
        (40, 20, 18, 1.0, "1e-3"),
        (100, 30, 25, 2.0, "1e-5"),
        (12, 12, 9, 0.3, "0.01"),
        (500, 60, 60, 4.0, "1e-6"),
    ],
)
def test_the_delta_term_matches_the_theorem_summed_in_rationals(
    m: int, r: int, v: int, epsilon: float, delta: str
) -> None:
    exact = _p_value_exact(m, r, v, epsilon, Fraction(delta))
    got = privacy_audit.p_value(canaries=m, guesses=r, correct=v, epsilon=epsilon, delta=float(delta))
    assert got == pytest.approx(float(exact), rel=1e-9)
    assert got > privacy_audit.p_value(canaries=m, guesses=r, correct=v, epsilon=epsilon, delta=0.0)


@pytest.mark.parametrize(("r", "confidence"), [(10, 0.95), (100, 0.95), (1000, 0.99)])
def test_all_guesses_right_gives_the_closed_form(r: int, confidence: float) -> None:
    """r of r right, δ = 0: q_ε^r = β, so ε = log(q/(1 − q)) with q = β^(1/r) — the largest
    bound r guesses can give (the paper's idealised case)."""
    q = (1 - confidence) ** (1 / r)
    expected = math.log(q / (1 - q))
    got = privacy_audit.epsilon_lower_bound(
        canaries=r, guesses=r, correct=r, delta=0.0, confidence=confidence
    )
    assert got == pytest.approx(expected, abs=1e-8)
    # the bound returned is one that was rejected, never more
    assert privacy_audit.p_value(canaries=r, guesses=r, correct=r, epsilon=got, delta=0.0) < 1 - confidence


def test_the_bound_grows_with_correct_guesses_and_shrinks_with_delta_and_confidence() -> None:
    def bound(v: int, delta: float = 1e-5, confidence: float = 0.95, m: int = 1000) -> float:
        return privacy_audit.epsilon_lower_bound(
            canaries=m, guesses=200, correct=v, delta=delta, confidence=confidence
        )

    assert bound(100) == 0.0  # half right: nothing rejected
    assert 0 < bound(140) < bound(170) < bound(200)
    assert bound(170, delta=1e-3) < bound(170, delta=1e-5)
    assert bound(170, confidence=0.999) < bound(170)
    assert bound(170, m=10**6) < bound(170, m=1000)  # the δ term is 2mδ·α


def test_soundness_on_randomized_response() -> None:
    """ε-DP randomized response answers each canary right with probability q_ε exactly: the
    bound at confidence 0.9 may exceed ε in at most 10% of runs (here: binomially within it), and
    with many canaries it comes close to ε (the bound is tight for this mechanism)."""
    rng = np.random.default_rng(17)
    epsilon, m, runs, confidence = 1.0, 400, 300, 0.9
    q = privacy_audit.randomized_response_accuracy(epsilon)
    over = 0
    bounds = []
    for _ in range(runs):
        correct = int(rng.binomial(m, q))
        lower = privacy_audit.epsilon_lower_bound(
            canaries=m, guesses=m, correct=correct, delta=0.0, confidence=confidence
        )
        over += lower > epsilon
        bounds.append(lower)
    assert over <= stats.binom.ppf(0.999, runs, 1 - confidence)
    assert 0.5 * epsilon < float(np.median(bounds)) < epsilon
    many = privacy_audit.epsilon_lower_bound(
        canaries=10**5, guesses=10**5, correct=int(10**5 * q), delta=0.0, confidence=0.95
    )
    assert 0.95 * epsilon < many < epsilon


def test_guesses_take_the_extremes_and_abstain_on_the_rest() -> None:
    scores = np.array([0.5, 3.0, -2.0, 1.0, -1.0, 2.0])
    assert privacy_audit.guesses_from_scores(scores, k_positive=2, k_negative=1).tolist() == [
        0,
        1,
        -1,
        0,
        0,
        1,
    ]
    assert privacy_audit.guesses_from_scores(scores, k_positive=0, k_negative=0).tolist() == [0] * 6
    with pytest.raises(InvalidArgumentError) as info:
        privacy_audit.guesses_from_scores(scores, k_positive=4, k_negative=3)
    assert info.value.field == "guesses"
    with pytest.raises(InvalidArgumentError):
        privacy_audit.guesses_from_scores(np.array([1.0, np.nan]), k_positive=1, k_negative=0)


def test_audit_counts_guesses_and_pays_for_trying_several_counts() -> None:
    rng = np.random.default_rng(3)
    included = rng.random(1000) < 0.5
    scores = np.where(included, 1.0, -1.0) + 0.01 * rng.normal(size=1000)  # perfectly separated
    result = privacy_audit.audit(scores, included, delta=1e-5, confidence=0.95)
    assert result.correct == result.guesses == 500  # the largest default count wins
    assert result.guess_counts_tried == len(privacy_audit.default_guess_counts(1000)) == 5
    single = privacy_audit.epsilon_lower_bound(
        canaries=1000, guesses=500, correct=500, delta=1e-5, confidence=0.95
    )
    shared = privacy_audit.epsilon_lower_bound(
        canaries=1000, guesses=500, correct=500, delta=1e-5, confidence=0.99
    )
    assert result.epsilon_lower == pytest.approx(shared) and result.epsilon_lower < single

    coin = privacy_audit.audit(rng.normal(size=1000), included, delta=1e-5, confidence=0.95)
    assert coin.epsilon_lower < 0.5  # scores that know nothing give (almost) nothing
    with pytest.raises(InvalidArgumentError) as info:
        privacy_audit.audit(scores, included[:10], delta=1e-5, confidence=0.95)
    assert info.value.field == "included"


def test_against_certificate_recomputes_at_the_certified_delta() -> None:
    record = privacy_audit.AuditResult(3.9, 0.95, 1e-5, 1000, 500, 500, 250, 250, 5).to_json()
    fine = privacy_audit.against_certificate(record, epsilon_upper=8.0, delta_upper=1e-5)
    assert fine["consistent"] is True and fine["epsilon_lower"] == pytest.approx(
        privacy_audit.epsilon_lower_bound(
            canaries=1000, guesses=500, correct=500, delta=1e-5, confidence=0.99
        )
    )
    wrong = privacy_audit.against_certificate(record, epsilon_upper=2.0, delta_upper=1e-5)
    assert wrong["consistent"] is False and wrong["epsilon_upper"] == 2.0
    looser = privacy_audit.against_certificate(record, epsilon_upper=8.0, delta_upper=1e-3)
    assert looser["epsilon_lower"] < fine["epsilon_lower"]
    with pytest.raises(InvalidArgumentError) as info:
        privacy_audit.against_certificate({"canaries": 10}, epsilon_upper=1.0, delta_upper=1e-5)
    assert info.value.field == "privacy_audit"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"canaries": 10, "guesses": 11, "correct": 1}, "correct"),
        ({"canaries": 10, "guesses": 5, "correct": -1}, "correct"),
        ({"canaries": 10, "guesses": 5, "correct": 2, "delta": 2.0}, "delta"),
        ({"canaries": 10, "guesses": 5, "correct": 2, "confidence": 1.0}, "confidence"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict[str, float], field: str) -> None:
    args = {"delta": 1e-5, "confidence": 0.95, **kwargs}
    with pytest.raises(InvalidArgumentError) as info:
        privacy_audit.epsilon_lower_bound(**args)  # type: ignore[arg-type]
    assert info.value.field == field
