"""Empirical privacy auditing in one training run: an ε **lower** bound from canary guesses.

Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run" (arXiv:2305.08846;
NeurIPS 2023). The auditor owns m canaries; each is included in the training data independently
with probability 1/2 (Sᵢ ∈ {−1, +1} uniform). After one run it scores every canary, guesses
Tᵢ ∈ {−1, 0, +1} ("out", abstain, "in") — the k₊ highest scores "in", the k₋ lowest "out", the
rest abstain — and counts r = k₊ + k₋ guesses and v = #{i : Tᵢ = Sᵢ ≠ 0} correct ones.

Their main theorem: if the training run is (ε, δ)-DP in each canary, then for every v,

    P[correct ≥ v]  ≤  P[Binomial(r, q_ε) ≥ v]  +  2mδ · max_{i=1..v} P[v − i ≤ Binomial(r, q_ε) < v] / i

with q_ε = e^ε / (1 + e^ε), the accuracy of ε-DP randomized response (for δ = 0 this is the
stochastic domination of the number of correct guesses by Binomial(r, q_ε); the second term is
their δ > 0 extension). The right-hand side is the p-value of the null hypothesis "(ε, δ)-DP"
(``p_value``); ``epsilon_lower_bound`` returns the largest ε the observed v rejects at
significance β, i.e. the run is *not* (ε, δ)-DP for that ε with confidence 1 − β. This is the
computation the paper gives as code in its appendix (a p-value and a bisection over ε); the
paper's text is not among the project's papers, so this module follows that published
computation, and the tests check it against scipy's exact binomial test, against the
definition summed in exact rationals, and by simulating ε-DP randomized response.

Two soundness choices the paper leaves to the auditor:

* The ε returned is one whose p-value was computed and found < β. Rejecting (ε, δ)-DP rejects
  every ε′ < ε too ((ε′, δ)-DP implies (ε, δ)-DP), so the bound is valid even where the δ term
  makes the p-value non-monotone in ε.
* Choosing (k₊, k₋) after seeing the scores is a multiple comparison: ``audit`` tries a fixed
  list of guess counts, each at significance β / (its length) (Bonferroni), and reports the best
  bound — valid at confidence 1 − β overall.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from accountant.errors import InvalidArgumentError

_BISECTION_STEPS = 40  # the paper's code uses 30; 40 halvings of [0, ε_max] reach ~1e-11


def randomized_response_accuracy(epsilon: float) -> float:
    """q_ε = e^ε / (1 + e^ε): the probability that ε-DP randomized response answers correctly,
    the best accuracy any guess about one ε-DP canary can have."""
    return float(1.0 / (1.0 + math.exp(-epsilon)))


def _check_counts(m: int, r: int, v: int) -> None:
    for name, value in (("canaries", m), ("guesses", r), ("correct", v)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise InvalidArgumentError(name, f"must be an integer >= 0. Found {value!r}.")
    if not v <= r <= m:
        raise InvalidArgumentError(
            "correct", f"must satisfy correct <= guesses <= canaries. Found {v}, {r}, {m}."
        )


def _check_delta(delta: float) -> None:
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not 0 <= delta <= 1:
        raise InvalidArgumentError("delta", f"must be in [0, 1]. Found {delta!r}.")


def _check_significance(significance: float) -> None:
    if (
        isinstance(significance, bool)
        or not isinstance(significance, int | float)
        or not 0 < significance < 1
    ):
        raise InvalidArgumentError("confidence", f"must be in (0, 1). Found 1 - {significance!r}.")


def p_value(*, canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """The probability of ≥ ``correct`` right guesses out of ``guesses`` under the null hypothesis
    that the run is (``epsilon``, ``delta``)-DP in each of ``canaries`` canaries (the main
    theorem's bound, module docstring); capped at 1."""
    m, r, v = canaries, guesses, correct
    _check_counts(m, r, v)
    _check_delta(delta)
    if not math.isfinite(epsilon) or epsilon < 0:
        raise InvalidArgumentError("epsilon", f"must be finite and >= 0. Found {epsilon!r}.")
    # scipy.stats is imported here, not at the top: the API imports this module (model cards
    # quote audits) and scipy.stats with scipy.optimize adds ~1.5 s to every `ledger` start.
    from scipy import stats

    q = randomized_response_accuracy(epsilon)
    tail = float(stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) ≥ v]
    if delta == 0 or v == 0:
        return min(tail, 1.0)
    # P[v − i ≤ Binomial(r, q) < v] for i = 1..v: partial sums of the pmf below v, downwards.
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)
    alpha = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(tail + 2 * m * delta * alpha, 1.0)


def epsilon_lower_bound(
    *, canaries: int, guesses: int, correct: int, delta: float, confidence: float
) -> float:
    """The largest ε (to ~1e-9) at which ``correct`` right guesses out of ``guesses`` reject
    (ε, δ)-DP at significance β = 1 − ``confidence``; 0 when even ε = 0 is not rejected.

    Bisection as in the paper's code, keeping the invariant p_value(ε_lo) < β, and returning
    ε_lo (a rejected ε; module docstring)."""
    significance = 1.0 - confidence
    _check_significance(significance)

    def rejected(epsilon: float) -> bool:
        return (
            p_value(canaries=canaries, guesses=guesses, correct=correct, epsilon=epsilon, delta=delta)
            < significance
        )

    if not rejected(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while rejected(hi):  # v ≤ r keeps this finite: as ε → ∞, P[Binomial(r, q) ≥ v] → 1
        lo, hi = hi, 2 * hi
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2
        if rejected(mid):
            lo = mid
        else:
            hi = mid
    return lo


def guesses_from_scores(scores: npt.ArrayLike, *, k_positive: int, k_negative: int) -> npt.NDArray[np.int8]:
    """Tᵢ: +1 ("included") for the ``k_positive`` highest scores, −1 for the ``k_negative``
    lowest, 0 (abstain) for the rest; ties broken by canary index (the order is fixed before the
    inclusions are drawn, so it carries no information about them)."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or not np.all(np.isfinite(s)):
        raise InvalidArgumentError("scores", "must be a 1-d array of finite numbers.")
    m = len(s)
    if k_positive < 0 or k_negative < 0 or k_positive + k_negative > m:
        raise InvalidArgumentError(
            "guesses", f"k_positive + k_negative must be in [0, {m}]. Found {k_positive} + {k_negative}."
        )
    order = np.argsort(s, kind="stable")  # ascending
    guesses = np.zeros(m, dtype=np.int8)
    guesses[order[:k_negative]] = -1
    if k_positive:
        guesses[order[m - k_positive :]] = 1
    return guesses


@dataclass(frozen=True, slots=True)
class AuditResult:
    """One audit: ``epsilon_lower`` holds with probability ≥ ``confidence`` (over the canaries'
    inclusion) for the (ε, ``delta``) claim; ``guesses`` (r) and ``correct`` (v) are those of the
    guess counts ``k_positive`` / ``k_negative`` that gave the bound."""

    epsilon_lower: float
    confidence: float
    delta: float
    canaries: int
    guesses: int
    correct: int
    k_positive: int
    k_negative: int
    guess_counts_tried: int

    def to_json(self) -> dict[str, float | int]:
        return {
            "epsilon_lower": self.epsilon_lower,
            "confidence": self.confidence,
            "delta": self.delta,
            "canaries": self.canaries,
            "guesses": self.guesses,
            "correct": self.correct,
            "k_positive": self.k_positive,
            "k_negative": self.k_negative,
            "guess_counts_tried": self.guess_counts_tried,
        }


DEFAULT_GUESS_FRACTIONS: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.5)
"""Guess on this fraction of the canaries, half "in" (the highest scores) and half "out" (the
lowest); fixed in advance, so trying all of them costs only a Bonferroni factor."""


def default_guess_counts(canaries: int) -> list[tuple[int, int]]:
    """(k₊, k₋) for each of ``DEFAULT_GUESS_FRACTIONS``: k₊ = k₋ = max(1, ⌊f·m/2⌋), distinct."""
    counts: list[tuple[int, int]] = []
    for fraction in DEFAULT_GUESS_FRACTIONS:
        k = max(1, int(fraction * canaries / 2))
        if 2 * k <= canaries and (k, k) not in counts:
            counts.append((k, k))
    return counts


def audit(
    scores: npt.ArrayLike,
    included: npt.ArrayLike,
    *,
    delta: float,
    confidence: float,
    guess_counts: Sequence[tuple[int, int]] | None = None,
) -> AuditResult:
    """The one-run audit of canaries with ``scores`` (higher: more likely included) whose true
    inclusion was ``included`` (booleans): guess with each (k₊, k₋) of ``guess_counts``
    (default ``default_guess_counts``), bound ε at significance β / len(guess_counts) each, and
    return the best (module docstring: Bonferroni)."""
    s = np.asarray(scores, dtype=np.float64)
    truth = np.asarray(included, dtype=bool)
    if truth.shape != s.shape:
        raise InvalidArgumentError(
            "included", f"must have one entry per score. Found {truth.shape} for {s.shape}."
        )
    m = len(s)
    counts = list(guess_counts) if guess_counts is not None else default_guess_counts(m)
    if not counts:
        raise InvalidArgumentError(
            "guess_counts", f"must list at least one (k_positive, k_negative). Found {counts}."
        )
    _check_significance(1.0 - confidence)
    per_count_confidence = 1.0 - (1.0 - confidence) / len(counts)
    sign = np.where(truth, 1, -1)
    best: AuditResult | None = None
    for k_positive, k_negative in counts:
        t = guesses_from_scores(s, k_positive=k_positive, k_negative=k_negative)
        r = int(np.count_nonzero(t))
        v = int(np.count_nonzero(t == sign))
        bound = epsilon_lower_bound(
            canaries=m, guesses=r, correct=v, delta=delta, confidence=per_count_confidence
        )
        if best is None or bound > best.epsilon_lower:
            best = AuditResult(bound, confidence, delta, m, r, v, k_positive, k_negative, len(counts))
    assert best is not None
    return best


def against_certificate(
    record: Mapping[str, Any], *, epsilon_upper: float, delta_upper: float
) -> dict[str, Any]:
    """An audit record (``AuditResult.to_json``) beside the certified (ε, δ) upper bound of the
    same run: the lower bound recomputed at the certificate's δ from the record's counts (an audit
    run at another δ tests another claim), and whether it stays at or below the certified ε.

    ``consistent`` false means the run is, with confidence ``confidence``, *not* as private as
    certified: the training code or the accounting is wrong. The recomputation uses the guess
    count the record reports at its Bonferroni share of β, which is valid whichever count it is."""
    try:
        m, r, v = int(record["canaries"]), int(record["guesses"]), int(record["correct"])
        confidence = float(record["confidence"])
        tried = int(record.get("guess_counts_tried", 1))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgumentError("privacy_audit", f"is not an audit record: {exc!r}.") from None
    if tried < 1:
        raise InvalidArgumentError("privacy_audit.guess_counts_tried", f"must be >= 1. Found {tried}.")
    _check_significance(1.0 - confidence)
    lower = epsilon_lower_bound(
        canaries=m, guesses=r, correct=v, delta=delta_upper, confidence=1.0 - (1.0 - confidence) / tried
    )
    return {
        "epsilon_lower": lower,
        "epsilon_upper": epsilon_upper,
        "delta": delta_upper,
        "confidence": confidence,
        "consistent": lower <= epsilon_upper,
    }


__all__ = [
    "DEFAULT_GUESS_FRACTIONS",
    "AuditResult",
    "against_certificate",
    "audit",
    "default_guess_counts",
    "epsilon_lower_bound",
    "guesses_from_scores",
    "p_value",
    "randomized_response_accuracy",
]
