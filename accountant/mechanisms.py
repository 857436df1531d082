"""The papers' privacy formulas, one function each, every one citing the theorem it implements.

Pure functions of the mechanism parameters; no state. Numbers that a ledger compares with a budget
(the ε of a mechanism) are computed in exact rational arithmetic (``fractions.Fraction``: every
float is a dyadic rational, and the formulas below are sums, products and quotients) and then
rounded *up* to the next float, so float error can never grant extra privacy loss (docs/ARCHITECTURE.md,
"Numerical safety"). Noise scales are rounded the other way: up, too, since more noise never hurts
privacy. Sampling probabilities are rounded *down* (sampling less never hurts privacy).

Papers (``../shared/papers``):

* ``lifelong-dp-l2dp-ml.txt`` — Phan et al., "Lifelong DP / L2DP-ML": Theorem 2; and the
  functional mechanism proper (Zhang et al. 2012) on its output layer's Taylor objective.
* ``continual-sliding-window-release.txt`` — continual and multi-resolution release: Lemma .1
  (Wu et al. 2017), Algorithm 6 (lines 1, 5, 6), Algorithm 7 (line 3), Algorithm 8 (line 11),
  Theorem 3 (and its proof).
* ``adadp-adaptive-noise.txt`` — AdaDp (Xu et al.): Lemma 1.
* Chaudhuri, Monteleoni & Sarwate (2011), "Differentially private empirical risk minimization",
  Algorithm 1 / Theorem 6: output perturbation with noise density ∝ exp(−‖ν‖₂/b).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Final

import numpy as np
import numpy.typing as npt
from scipy.special import log_ndtr

from accountant.errors import InvalidArgumentError
from accountant.events import (
    FunctionalMechanismEvent,
    FunctionalMechanismL2DPEvent,
    OutputPerturbationEvent,
    lemma1_holds,
)

# ---------------------------------------------------------------------------------------------
# Rounding and validation
# ---------------------------------------------------------------------------------------------


def float_up(value: Fraction) -> float:
    """The smallest float >= ``value`` (``inf`` above the float range)."""
    try:
        result = float(value)
    except OverflowError:
        return math.inf
    if Fraction(result) < value:
        result = math.nextafter(result, math.inf)
    return result


def _positive(field_name: str, value: float) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgumentError(field_name, f"must be finite and > 0. Found {value!r}.")
    if value <= 0:
        raise InvalidArgumentError(field_name, f"must be finite and > 0. Found {value!r}.")
    return Fraction(value)


def _count(field_name: str, value: int, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(field_name, f"must be an integer >= {minimum}. Found {value!r}.")
    return value


# ---------------------------------------------------------------------------------------------
# L2DP-ML (lifelong-dp-l2dp-ml.txt)
# ---------------------------------------------------------------------------------------------


def l2dp_ml_epsilon(
    *,
    epsilon1: float,
    epsilon2: float,
    input_dim: int,
    hidden_units: int,
    batch_size: int,
    theta1_norm_bound: float,
    analysis: str = "paper",
) -> float:
    """Pure ε of one L2DP-ML batch perturbation: Phan et al., Lifelong DP, **Theorem 2**.

    ε = ε1 + ε1/γx + ε1/γ + ε2, with (Section "L2DP-ML", Alg. 1 line 2, Alg. 2)

    * Δ_R = d·(|h1| + 2), the sensitivity bound of the auto-encoder's polynomial objective R̃
      (d = ``input_dim``, |h1| = ``hidden_units``);
    * γx = Δ_R / |B| (Lemma 2 of Phan et al. 2020: the input perturbation x̄ = x + χ1/|B| makes
      the batch (ε1/γx)-DP), |B| = ``batch_size``, the fixed disjoint batch of Alg. 2;
    * γ = 2Δ_R / (|B|·‖θ̄1‖₁,₁) (Lemma 3 of Phan et al. 2020: h̄ = θ̄1ᵀx̄ + 2χ2/|B| is
      (ε1/γ)-DP), ‖θ̄1‖₁,₁ = ``theta1_norm_bound``, the bound on θ1's maximum column 1-norm that
      the trainer enforces. The guarantee holds only under that bound.

    ε2 is the output layer's budget (its sensitivity 2|hπ| sets the noise, not ε). The value is
    computed exactly and rounded up to the next float.

    ``analysis="sound"`` replaces the input term ε1/γx by d·ε1/γx = ε1|B|/(|h1| + 2)
    (docs/DESIGN-NOTES.md note 21). x̄_r = x_r + χ1_r/|B| adds Laplace noise of scale
    b = Δ_R/(ε1|B|) to each coordinate; ε1/γx = ε1|B|/Δ_R = 1/b is the Laplace bound for an ℓ1
    sensitivity of 1 (the paper's "Lemma 2 of Phan et al. 2020"), but two records of [0, 1]^d
    differ by up to d in ℓ1, so one record's x̄_r is (d/b)-DP and no better (the Laplace bound is
    attained at the corners). That bound holds for an *independent* χ1_r per record under
    replace-one neighbours; with Alg. 2's single shared χ1 (``"paper"``) the batch's x̄ publishes
    x_r − x_s exactly and has no finite ε, so ``"paper"`` is the paper's claim, not a bound.
    """
    if analysis not in ("paper", "sound"):
        raise InvalidArgumentError("analysis", f"must be 'paper' or 'sound'. Found {analysis!r}.")
    eps1 = _positive("epsilon1", epsilon1)
    eps2 = _positive("epsilon2", epsilon2)
    d = _count("input_dim", input_dim)
    h1 = _count("hidden_units", hidden_units)
    batch = _count("batch_size", batch_size)
    theta = _positive("theta1_norm_bound", theta1_norm_bound)
    delta_r = Fraction(d * (h1 + 2))
    gamma_x = delta_r / batch
    gamma = 2 * delta_r / (batch * theta)
    input_term = eps1 / gamma_x if analysis == "paper" else d * eps1 / gamma_x
    return float_up(eps1 + input_term + eps1 / gamma + eps2)


def functional_mechanism_l2_sensitivity(*, feature_bound: float) -> float:
    """L2 sensitivity of one batch's coefficient vector (Σφφᵀ, Σφyᵀ) under replace-one
    neighbours, features ‖φ‖₂ ≤ B = ``feature_bound`` and one-hot labels (docs/ACCOUNTING.md, "The
    functional mechanism of the lifelong learner"; Zhang et al. 2012, Alg. 1, with the L2 norm of
    the Gaussian mechanism, Dwork & Roth 2014, Thm. A.1).

    Replacing (φ, y) by (φ', y') moves the vector by D with, for a = ‖φ‖², b = ‖φ'‖², c = φᵀφ',
    ‖D‖² = a² + b² − 2c² + a + b − 2c·[y = y'], largest at a = b = B² and y = y':

    * B² ≥ ½: c = −½ (feasible: |c| ≤ B²), Δ₂² = 2B⁴ + 2B² + ½ = 2(B² + ½)², Δ₂ = √2·(B² + ½);
    * B² < ½: c = −B² (antipodal features), Δ₂² = 4B², Δ₂ = 2B.

    Both are attained (``tests/worker/test_functional_mechanism.py`` brute-forces neighbouring
    batches). The square is exact; the root is rounded up."""
    bound = _positive("feature_bound", feature_bound)
    b2 = bound * bound
    square = 2 * (b2 + Fraction(1, 2)) ** 2 if b2 >= Fraction(1, 2) else 4 * b2
    root = math.sqrt(float_up(square))
    while Fraction(root) ** 2 < square:
        root = math.nextafter(root, math.inf)
    return root


def functional_mechanism_noise_stddev(event: FunctionalMechanismEvent) -> float:
    """The standard deviation σ·Δ₂ the trainer adds to each coefficient of ``event``'s batch
    (``functional_mechanism_l2_sensitivity``), rounded up: more noise never costs privacy."""
    sensitivity = functional_mechanism_l2_sensitivity(feature_bound=event.feature_bound)
    return float_up(Fraction(event.noise_multiplier) * Fraction(sensitivity))


# ---------------------------------------------------------------------------------------------
# Output perturbation (PSGD / PBERM; continual-sliding-window-release.txt)
# ---------------------------------------------------------------------------------------------


def output_perturbation_l2_sensitivity(
    *, lipschitz: float, regularization: float, dataset_size: int
) -> float:
    """L2 sensitivity 2L/(λn) of the minimiser of a λ-strongly convex regularised ERM.

    Chaudhuri, Monteleoni & Sarwate (2011), Corollary 8; Wu et al. (2017), cited as Lemma .1 of
    continual-sliding-window-release.txt (noise scale Δε = 2L/(λBε) gives ε-DP for a dataset of
    size B). L = ``lipschitz`` (of the loss), λ = ``regularization``, n = ``dataset_size`` — the
    number the ERM objective is *normalised by*. Rounded up.
    """
    lip = _positive("lipschitz", lipschitz)
    lam = _positive("regularization", regularization)
    n = _count("dataset_size", dataset_size)
    return float_up(2 * lip / (lam * n))


def output_perturbation_epsilon(*, l2_sensitivity: float, noise_scale: float) -> float:
    """Pure ε = Δ₂ / b of output perturbation with noise density ∝ exp(−‖ν‖₂/b).

    Chaudhuri, Monteleoni & Sarwate (2011), Theorem 6 (output perturbation, Algorithm 1): for
    outputs θ, θ′ with ‖θ − θ′‖₂ ≤ Δ₂ the density ratio is exp((‖ν′‖₂ − ‖ν‖₂)/b) ≤ exp(Δ₂/b) by the
    triangle inequality. ‖ν‖₂ ~ Gamma(d, b) and its direction is uniform
    (``sample_output_perturbation_noise``). Rounded up.
    """
    sens = _positive("l2_sensitivity", l2_sensitivity)
    scale = _positive("noise_scale", noise_scale)
    return float_up(sens / scale)


def l2dp_ml_event_epsilon(event: FunctionalMechanismL2DPEvent) -> float:
    """The ε a ``FunctionalMechanismL2DPEvent`` costs: ``l2dp_ml_epsilon`` (L2DP-ML, Theorem 2)
    of the event's parameters, rounded up to a float by the formula itself."""
    return l2dp_ml_epsilon(
        epsilon1=event.epsilon1,
        epsilon2=event.epsilon2,
        input_dim=event.input_dim,
        hidden_units=event.hidden_units,
        batch_size=event.batch_size,
        theta1_norm_bound=event.theta1_norm_bound,
        analysis=event.charged_analysis,
    )


def l2dp_ml_analysis_text(event: FunctionalMechanismL2DPEvent) -> str:
    """Which analysis of L2DP-ML Thm. 2 the event is charged under, in words (certificates)."""
    if event.charged_analysis == "sound":
        return (
            "L2DP-ML Thm. 2 with the input term re-derived (analysis 'sound'): "
            "eps1 + d*eps1/gamma_x + eps1/gamma + eps2, independent input noise per record, "
            "replace-one neighbours (docs/DESIGN-NOTES.md note 21)"
        )
    return (
        "L2DP-ML Thm. 2 as printed (analysis 'paper'"
        + ("" if event.analysis is not None else ", the meaning of an event without 'analysis'")
        + "): eps1 + eps1/gamma_x + eps1/gamma + eps2, one shared input-noise vector per batch; "
        "the paper's claim, optimistic (docs/DESIGN-NOTES.md note 21)"
    )


def output_perturbation_event_epsilon(event: OutputPerturbationEvent) -> float:
    """The ε an ``OutputPerturbationEvent`` costs: max(declared ε, Δ₂/b) for b = ``noise_scale``.

    The trainer draws noise with the float scale b = fl(Δ₂/ε) (``event.noise_scale``); when that
    division rounds down, Δ₂/b exceeds the declared ε by an ulp, and the ledger charges the larger
    value (Chaudhuri et al. 2011, Theorem 6).
    """
    return max(
        float(event.epsilon),
        output_perturbation_epsilon(l2_sensitivity=event.l2_sensitivity, noise_scale=event.noise_scale),
    )


def sample_output_perturbation_noise(
    *, rng: np.random.Generator, dimension: int, noise_scale: float, size: int | None = None
) -> npt.NDArray[np.float64]:
    """Draw ν ∈ ℝᵈ with density ∝ exp(−‖ν‖₂/b): Chaudhuri et al. (2011), Algorithm 1, step 2.

    The norm is drawn from Gamma(shape=d, scale=b) and the direction uniformly on the sphere
    (a normalised standard Gaussian). Per-coordinate Laplace noise calibrated to an L2
    sensitivity is *not* ε-DP, which is why the trainer must use this sampler.
    ``size`` draws ``size`` vectors (shape ``(size, d)``); ``None`` draws one (shape ``(d,)``).
    """
    d = _count("dimension", dimension)
    b = float(_positive("noise_scale", noise_scale))
    shape: tuple[int, ...] = (d,) if size is None else (_count("size", size), d)
    direction = rng.standard_normal(shape)
    norms = np.linalg.norm(direction, axis=-1, keepdims=True)
    # A standard Gaussian vector is 0 with probability 0; guard the division anyway.
    direction = direction / np.where(norms == 0.0, 1.0, norms)
    radius = rng.gamma(shape=d, scale=b, size=(*shape[:-1], 1))
    result: npt.NDArray[np.float64] = direction * radius
    return result


def continual_release_noise_scale(
    *, lipschitz: float, regularization: float, level: int, block_size: int, epsilon: float
) -> float:
    """Noise scale 4L/(λ·2ᵏ·B·ε) of level k of multi-resolution / continual release.

    continual-sliding-window-release.txt, **Algorithm 6, lines 1 and 6** (sensitivity constant
    C = Δε = 4L/(λ2ᵏBε), passed to PSGD) and **Algorithm 7, line 3** (PBERM, with 2ʲb₀ in place
    of 2ᵏB, as called from Algorithm 8, line 12). With the ERM sensitivity 2L/(λ·2ᵏB) of a dataset
    of size 2ᵏB (Lemma .1) this scale gives ε/2-DP per call (proof of Theorem 3); the sampling of
    ``continual_release_sampling_probability`` then amplifies that to ε/(2·2ᵏ).

    Use it as the scale b of noise with density ∝ exp(−‖ν‖₂/b) (``OutputPerturbationEvent``), not as
    a per-coordinate Laplace scale. Rounded up (more noise never costs privacy).
    """
    lip = _positive("lipschitz", lipschitz)
    lam = _positive("regularization", regularization)
    k = _count("level", level, minimum=0)
    block = _count("block_size", block_size)
    eps = _positive("epsilon", epsilon)
    return float_up(4 * lip / (lam * (2**k) * block * eps))


def continual_release_sampling_probability(*, epsilon: float, level: int) -> float:
    """Sampling probability (e^{ε/(2·2ᵏ)} − 1)/(e^{ε/2} − 1) of level k.

    continual-sliding-window-release.txt, **Algorithm 6, line 5** (multi-resolution release with
    sampling) and **Algorithm 8, line 11** (continual release, level j). Amplification by
    subsampling (Balle, Barthe & Gaboardi 2018, Thm. 8/9: an ε′-DP mechanism run on a sample taken
    with probability p is ln(1 + p(e^{ε′} − 1))-DP) turns the ε/2 of one PSGD/PBERM call into exactly
    ε/(2·2ᵏ) with this p, so the levels form the geometric series ε/2 + ε/4 + … ≤ ε of Theorem 3.

    Caveat the paper leaves implicit: the PSGD/PBERM objective on the sample must stay normalised
    by the un-sampled size 2ᵏB (so its sensitivity stays 2L/(λ·2ᵏB)); normalising by the sample's
    own size would raise the sensitivity and void the ε/2 premise.

    Rounded *down* (a smaller sampling probability never costs privacy). Computed with ``expm1``,
    accurate for tiny ε/2ᵏ.
    """
    eps = float(_positive("epsilon", epsilon))
    k = _count("level", level, minimum=0)
    if k == 0:
        return 1.0
    # p = exp(log(e^a − 1) − log(e^b − 1)), a = ε/(2·2ᵏ), b = ε/2: no overflow for any finite ε.
    value = math.exp(_log_expm1(eps / (2.0 * 2.0**k)) - _log_expm1(eps / 2.0))
    # log, expm1 and exp each carry about an ulp of error (relative to a result of moderate
    # magnitude); step down well beyond that.
    for _ in range(16):
        value = math.nextafter(value, 0.0)
    return max(0.0, min(1.0, value))


def _log_expm1(x: float) -> float:
    """log(e^x − 1) for x > 0, accurate for tiny and huge x."""
    if x > 30.0:
        return x + math.log1p(-math.exp(-x))
    return math.log(math.expm1(x))


def continual_release_level_epsilon(*, epsilon: float, level: int) -> float:
    """ε/(2·2ᵏ): the privacy cost of one sampled call at level k (proof of Theorem 3, Alg. 6).

    continual-sliding-window-release.txt, proof of Theorem 3 (and Theorem 5 for Algorithm 8):
    "A¹_samp satisfies ε/(2·2ᵏ)-differential privacy"; summed over levels k = 0, 1, … the geometric
    series stays ≤ ε. Exact (a power-of-two division), rounded up.
    """
    eps = _positive("epsilon", epsilon)
    k = _count("level", level, minimum=0)
    return float_up(eps / (2 * 2**k))


def amplified_pure_epsilon(*, epsilon: float, sampling_probability: float) -> float:
    """ln(1 + p(e^ε − 1)): privacy amplification of a pure ε-DP mechanism by subsampling.

    Balle, Barthe & Gaboardi (2018), Theorem 8 (Poisson sampling, add/remove adjacency) and
    Theorem 9 (sampling without replacement, substitution); the step used in the proof of
    Theorem 3 of continual-sliding-window-release.txt. Rounded up (a few ulps).
    """
    eps = float(_positive("epsilon", epsilon))
    p = float(_positive("sampling_probability", sampling_probability))
    if p > 1:
        raise InvalidArgumentError("sampling_probability", f"must be in (0, 1]. Found {p!r}.")
    if eps > 700:
        # ln(1 + p(e^ε − 1)) = ε + ln(p + (1 − p)e^{−ε}) for large ε.
        value = eps + math.log(p + (1 - p) * math.exp(-eps))
    else:
        value = math.log1p(p * math.expm1(eps))
    for _ in range(4):
        value = math.nextafter(value, math.inf)
    return min(value, math.nextafter(eps, math.inf)) if p < 1 else eps


# ---------------------------------------------------------------------------------------------
# The analytic Gaussian mechanism (Balle & Wang 2018)
# ---------------------------------------------------------------------------------------------

# δ(ε) is computed to ~1e-11 relative (log_ndtr and expm1 are accurate to a few ulps; the
# difference below loses at most −log10|x| digits, x ≥ 1e-5 where it matters). The search aims at
# a δ this much smaller, so float error cannot put the answer below the true ε.
_ANALYTIC_DELTA_MARGIN: Final = 1e-6
_ANALYTIC_STEPS: Final = 200


def analytic_gaussian_delta(*, noise_multiplier: float, epsilon: float) -> float:
    """δ(ε) of the Gaussian mechanism with L2 sensitivity 1 and noise σ = ``noise_multiplier``.

    Balle & Wang (2018), "Improving the Gaussian mechanism for differential privacy", Theorem 8
    (the mechanism is (ε, δ)-DP iff this holds; it is the exact privacy curve):

        δ(ε) = Φ(1/(2σ) − εσ) − e^ε Φ(−1/(2σ) − εσ).

    Computed in log space, log δ = log Φ(a) + log(1 − e^{ε + log Φ(b) − log Φ(a)}), so neither the
    tails nor the difference of two nearly equal terms lose it (σ = 10⁴, δ = 1e-10).
    """
    sigma, eps = float(noise_multiplier), float(epsilon)
    a, b = 0.5 / sigma - eps * sigma, -0.5 / sigma - eps * sigma
    log_a, log_b = float(log_ndtr(a)), float(log_ndtr(b))
    x = eps + log_b - log_a
    if x >= 0:  # only where rounding makes the two terms meet: δ = 0 to within float error
        return 0.0
    return math.exp(log_a + math.log(-math.expm1(x)))


def analytic_gaussian_epsilon(*, noise_multiplier: float, delta: float) -> float:
    """The smallest ε with δ(ε) ≤ ``delta`` for the Gaussian mechanism (Balle & Wang 2018, Thm. 8;
    ``analytic_gaussian_delta``), never below the true value.

    δ(ε) is decreasing in ε; bisection on ε for δ(ε) ≤ (1 − 1e-6)·δ (the margin covers float
    error in δ(ε)), keeping the upper end: the returned ε has a computed δ below the target, so
    its true δ is below ``delta`` and the true ε is at most the value returned. The answer is then
    raised 4 ulps. A composition of Gaussians with σᵢ is one Gaussian with σ = (Σ σᵢ⁻²)^(−1/2)
    (its privacy loss is normal: Dong, Roth & Su 2022, Cor. 3.3), so this is also the exact ε of
    any Gaussian-only composition.
    """
    sigma = float(_positive("noise_multiplier", noise_multiplier))
    target = float(delta)
    if not 0 < target < 1:
        raise InvalidArgumentError("delta", f"must be in (0, 1). Found {delta!r}.")
    goal = target * (1 - _ANALYTIC_DELTA_MARGIN)

    def fits(eps: float) -> bool:
        return analytic_gaussian_delta(noise_multiplier=sigma, epsilon=eps) <= goal

    if fits(0.0):
        return 0.0
    hi = max(1e-300, 1.0 / sigma)
    while not fits(hi):
        hi *= 2.0
        if not math.isfinite(hi):
            return math.inf
    lo = 0.0
    for _ in range(_ANALYTIC_STEPS):
        mid = (lo + hi) / 2
        if mid <= lo or mid >= hi:
            break
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    for _ in range(4):
        hi = math.nextafter(hi, math.inf)
    return hi


# ---------------------------------------------------------------------------------------------
# AdaDp (adadp-adaptive-noise.txt)
# ---------------------------------------------------------------------------------------------


def satisfies_lemma1(
    sensitivities: Sequence[float] | npt.NDArray[np.float64],
    noise_stddevs: Sequence[float] | npt.NDArray[np.float64],
    noise_multiplier: float,
) -> bool:
    """AdaDp **Lemma 1**: per-coordinate noise σᵢ is as private as N(0, σ*²) iff Σ sᵢ²/σᵢ² ≤ 1/σ*².

    Xu et al., "AdaDp", Lemma 1 (adadp-adaptive-noise.txt): if f has L2 sensitivity ≤ 1 and
    f + N(0, σ*²I) is (ε, δ)-DP, then f′ + Z′ with zᵢ ~ N(0, σᵢ²) and per-coordinate sensitivities
    sᵢ is (ε, δ)-DP whenever Σᵢ sᵢ²/σᵢ² ≤ 1/σ*² (its privacy loss is Gaussian with variance
    Σ sᵢ²/σᵢ²). The test is exact: decided in floating point when clearly on one side and redone
    in rational arithmetic within a 1e-9 relative margin of the boundary, so a vector that violates
    the lemma by one ulp is refused.
    """
    sigma_star = _positive("noise_multiplier", noise_multiplier)
    s = np.asarray(sensitivities, dtype=np.float64)
    sd = np.asarray(noise_stddevs, dtype=np.float64)
    if s.ndim != 1 or sd.ndim != 1 or s.shape != sd.shape:
        raise InvalidArgumentError(
            "noise_stddevs",
            f"must be a vector of the length of sensitivities ({s.shape}). Found {sd.shape}.",
        )
    if not np.all(np.isfinite(s)) or np.any(s < 0):
        i = int(np.flatnonzero(~np.isfinite(s) | (s < 0))[0])
        raise InvalidArgumentError(f"sensitivities[{i}]", f"must be finite and >= 0. Found {float(s[i])!r}.")
    if not np.all(np.isfinite(sd)) or np.any(sd <= 0):
        i = int(np.flatnonzero(~np.isfinite(sd) | (sd <= 0))[0])
        raise InvalidArgumentError(f"noise_stddevs[{i}]", f"must be finite and > 0. Found {float(sd[i])!r}.")
    # The event's own check (long double, exact at the boundary and beyond the float range).
    holds, _, _ = lemma1_holds(s.tolist(), sd.tolist(), float(sigma_star))
    return holds


__all__ = [
    "amplified_pure_epsilon",
    "analytic_gaussian_delta",
    "analytic_gaussian_epsilon",
    "continual_release_level_epsilon",
    "continual_release_noise_scale",
    "continual_release_sampling_probability",
    "float_up",
    "functional_mechanism_l2_sensitivity",
    "functional_mechanism_noise_stddev",
    "l2dp_ml_analysis_text",
    "l2dp_ml_epsilon",
    "l2dp_ml_event_epsilon",
    "output_perturbation_epsilon",
    "output_perturbation_event_epsilon",
    "output_perturbation_l2_sensitivity",
    "sample_output_perturbation_noise",
    "satisfies_lemma1",
]
