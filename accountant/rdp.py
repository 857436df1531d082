"""Rényi differential privacy (RDP) accounting of mechanism events.

An event's RDP *curve* is the vector ``ρ(α)`` over a fixed grid of orders ``α > 1``: the mechanism
is ``(α, ρ(α))``-RDP for every order of the grid (Mironov 2017, Def. 4). Curves of adaptively
composed mechanisms add up order by order (Mironov 2017, Prop. 1), so ``self_composed`` multiplies
a curve by its count (never a loop: counts go up to 10^18) and ``composed`` sums curves. The
ledger converts a curve to an (ε, δ) guarantee with ``rdp_to_epsilon`` / ``rdp_to_delta``.

Which formula for which event
-----------------------------
* ``gaussian`` (L2 sensitivity 1, noise multiplier σ): ``α/(2σ²)`` (Mironov 2017, Prop. 7).
* ``adaptive_gaussian``: AdaDp's per-coordinate noise is as private as a Gaussian with noise
  multiplier σ* whenever ``Σ sᵢ²/σᵢ² ≤ 1/σ*²`` (Xu, Shi, Liu, Zhao & Chen, AdaDp, Lemma 1; the
  event checks the condition), so it is accounted as ``gaussian(σ*)``, sampled or not.
* ``laplace`` (L1 sensitivity 1, scale b, ε = 1/b): the exact curve of Mironov 2017, Prop. 6,
  evaluated in a cancellation-free form (see ``_laplace_rdp``).
* pure ε-DP events (``pure_dp``, ``approx_dp`` with δ = 0, ``l2dp_ml_functional`` with the ε of
  L2DP-ML Thm. 2, ``output_perturbation``): ``min(ε, αε²/2)``. ``ε`` because D_α ≤ D_∞ ≤ ε
  (Rényi divergence is non-decreasing in the order: van Erven & Harremoës 2014, Thm. 3);
  ``αε²/2`` because ε-DP implies (ε²/2)-zCDP (Bun & Steinke 2016, Prop. 3.3).
* ``approx_dp`` with δ > 0: no RDP guarantee follows from (ε, δ)-DP; ``UnsupportedEventError``.
* ``no_op``: 0. ``non_private``: ∞ (not an error).
* ``poisson_sampled(gaussian)`` (add/remove-one neighbours): the **exact** RDP of the sampled
  Gaussian mechanism, Mironov, Talwar & Zhang 2019 (arXiv:1908.10530), Sec. 3.3:
  ``ρ(α) = log(A_α)/(α − 1)`` with ``A_α = E_{z∼N(0,σ²)}[(1 − q + q·e^{(2z−1)/(2σ²)})^α]``.
  Integer α: the finite binomial sum, rewritten as
  ``A_α − 1 = Σ_{i=2}^{α} C(α,i) qⁱ (1−q)^{α−i} (e^{i(i−1)/(2σ²)} − 1)``. Every term is ≥ 0, so
  there is no cancellation even for q = 1e-12 or σ = 1e6, where the textbook form loses
  ``A_α − 1`` to rounding (``_log_a_integer``). Fractional α: the two binomial series of Sec. 3.3,
  summed in log space with their signs; their alternating tail (completely monotone magnitudes
  past ⌊α⌋ + 1) is summed by the Cohen–Rodriguez Villegas–Zagier acceleration with its rigorous
  error bound, plus an allowance for rounding (``_log_a_fractional``). That upper bound is exact
  to ~1e-9 relative or better except where ``A_α − 1`` itself is below rounding (tiny q or huge
  σ, ρ < 1e-6 or so); there the convexity bound from the two neighbouring integer orders takes
  over (``(α−1)ρ(α) = log A_α`` is a cumulant generating function, hence convex in α: van Erven &
  Harremoës 2014, Cor. 2; Wang, Balle & Kasiviswanathan 2019, Cor. 10). Both are upper bounds;
  we keep the smaller. Two more valid tightenings are applied to every sampled curve: sampling
  never hurts, so the unsampled ``α/(2σ²)`` caps it (couple the samples of neighbouring
  datasets; Rényi divergence is jointly quasi-convex), and the true curve is non-decreasing in
  α, so an order takes the smallest bound found at any larger order. A composition of Gaussians
  inside the sampled event is one Gaussian with ``σ = (Σ 1/σ_k²)^{-1/2}`` (the same noise on the
  same sample; dp-accounting does the same).
* ``sampled_without_replacement(gaussian)`` (fixed-size batches, replace-one neighbours, dataset
  size public): the bound of Wang, Balle & Kasiviswanathan 2019 (AISTATS; arXiv:1808.00087),
  Thm. 27, at integer orders (``_wor_gaussian_rdp``). As in WBK and dp-accounting, the base
  Gaussian is ``(α, α/(2σ²))``-RDP under *replace-one*, i.e. σ is the noise multiplier relative to
  the replace-one sensitivity (for a sum of gradients clipped to C that sensitivity is 2C). For a
  fractional α we use the value at ⌈α⌉: RDP is non-decreasing in α (van Erven & Harremoës 2014,
  Thm. 3), so that is a valid upper bound (their Cor. 10 interpolation would be slightly
  tighter). The same two tightenings as above apply.
* A sampled event wrapping anything other than Gaussian noise (or ``no_op`` / ``non_private``)
  raises ``UnsupportedEventError`` naming the inner event — amplification by sampling is only
  implemented for Gaussian noise — except at q = 1, where the sampled event is the inner event.

AdaDp (the ``adaptive_gaussian`` paper) and its Theorem 1
---------------------------------------------------------
AdaDp's Theorem 1 / Lemma 7 print, for lots of size L drawn from N records, the per-step bound
``1/(α−1)·log(1 + q²C(α,2)·min{4(e^{1/σ²}−1), 2e^{1/σ²}} + 4Σ_{j≥3} qʲC(α,j)√(B(2⌈j/2⌉)B(2⌊j/2⌋)))``
with ``B(l) = Σᵢ (−1)ⁱ C(l,i) e^{(i−1)i/(2σ²)}``. That is the sampling-*without*-replacement bound
of Wang, Balle & Kasiviswanathan (Thm. 27; the paper cites it as its Lemma 6). On the paper's
worked example (q = 600/60000, σ* = 0.9, T = 1800, δ = 1e-5, classic conversion, α ∈ {2..64})
WBK's Thm. 27 gives ε ≈ 6.42 (at α = 5), not the ≈ 4.0 the paper reports. One literal reading of
B(l) gives ≈ 2.97 at α = 6 (we reproduce it by taking the q²C(α,2) coefficient as 1/σ², i.e.
reading B without its exponential, so that B(2) = 1/σ² and B(l) = 0 for l > 2); that is *below*
the exact Poisson value, so it cannot be a valid bound and would under-report. The paper's ≈ 4.0
is the exact Poisson-subsampled RDP of Mironov, Talwar & Zhang: 4.0153 at α = 6 with integer
orders and the classic conversion. Hence this module accounts AdaDp (and DP-SGD) lots drawn by
Poisson sampling with the exact Poisson formula, and lots of fixed size drawn without replacement
with WBK's Thm. 27 — the event kind says which sampling scheme ran.

RDP → (ε, δ)
------------
``rdp_to_epsilon`` uses by default the improved conversion of Canonne, Kamath & Steinke 2020
(arXiv:2004.00010, Prop. 12) / Balle et al. 2020 (Thm. 21) / Asoodeh et al. 2020 (Eq. 20):
``ε = ρ + log((α−1)/α) − (log δ + log α)/(α−1)``, together with the total-variation bound
``δ(0) ≤ √(1 − e^{−ρ})`` (Bretagnolle–Huber, with KL ≤ D_α). ``conversion="classic"`` is
Mironov 2017, Prop. 3: ``ε = ρ + log(1/δ)/(α−1)``. RDP gives *upper* bounds only: an accountant
built on it has no lower bound on the true ε to offer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt
from scipy import special

from accountant.base import EpsilonBound, PrivacyAccountant, check_delta, check_epsilon
from accountant.errors import InvalidArgumentError, UnsupportedEventError
from accountant.events import (
    MAX_COUNT,
    AdaptiveGaussianEvent,
    ApproxDpEvent,
    ComposedEvent,
    DpEvent,
    FunctionalMechanismL2DPEvent,
    GaussianEvent,
    LaplaceEvent,
    NonPrivateEvent,
    NoOpEvent,
    OutputPerturbationEvent,
    PoissonSampledEvent,
    PureDpEvent,
    SampledWithoutReplacementEvent,
    SelfComposedEvent,
)
from accountant.mechanisms import l2dp_ml_event_epsilon, output_perturbation_event_epsilon

FloatArray = npt.NDArray[np.float64]

NAME: Final = "rdp"

DEFAULT_ORDERS: Final[tuple[float, ...]] = tuple(
    sorted(
        {1 + x / 100.0 for x in range(1, 10)}
        # dp-accounting's RdpAccountant default orders, verbatim:
        | {1 + x / 10.0 for x in range(1, 100)}
        | {float(a) for a in range(11, 64)}
        | {128.0, 256.0, 512.0, 1024.0}
        # Extra integer orders for small-ε regimes (large σ) and between 64 and 1024.
        | {64.0, 80.0, 96.0, 112.0, 160.0, 192.0, 384.0, 768.0, 1536.0, 2048.0, 4096.0}
    )
)
"""Orders used unless told otherwise: a superset of dp-accounting's default RDP orders
(1.1, 1.2, ..., 10.9, 11, ..., 63, 128, 256, 512, 1024), plus 1.01–1.09 for large-ε regimes and
more integer orders up to 4096 for small-ε regimes."""

MAX_ORDER: Final = float(2**20)
"""Largest order accepted: an integer order α costs O(α) work per distinct sampled event."""

MAX_ORDER_WORK: Final = 2**21
"""Largest Σ⌈α⌉ of a grid a *ledger budget* may declare (``accountant.rdp_filter.check_orders``): the
work of one sampled event's curve (≈ 0.25 s at the cap), paid on every charge. A grid of 1000
orders near 2²⁰ would otherwise cost ~10⁹ terms (gigabytes) per charge. The accountant itself
takes any grid its caller chooses (a fine grid of 10⁵ small orders is a published test case)."""

CONVERSIONS: Final = ("improved", "classic")

_TINY: Final = math.ulp(0.0)  # smallest positive float: a positive loss never rounds to 0
_EPS: Final = 2.0**-52
_WBK_MAX_EXACT_ORDER: Final = 256  # forward differences B(l) kept for l ≤ 256 (as dp-accounting)


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------


def _checked_orders(orders: Sequence[float] | FloatArray, field: str = "orders") -> FloatArray:
    values = list(orders)
    if not values:
        raise InvalidArgumentError(field, "must hold at least one order. Found [].")
    for index, value in enumerate(values):
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float | np.integer | np.floating)
            or not math.isfinite(value)
            or not 1 < value <= MAX_ORDER
        ):
            raise InvalidArgumentError(
                f"{field}[{index}]", f"must be finite and in (1, 2^20]. Found {value}."
            )
    return np.asarray(values, dtype=np.float64)


def _checked_curve(rdp: Sequence[float] | FloatArray, orders: FloatArray) -> FloatArray:
    values = np.asarray(list(rdp), dtype=np.float64)
    if values.shape != orders.shape:
        raise InvalidArgumentError(
            "rdp", f"must have one value per order ({orders.size}). Found {values.size}."
        )
    for index, value in enumerate(values.tolist()):
        if math.isnan(value) or value < 0:
            raise InvalidArgumentError(f"rdp[{index}]", f"must be >= 0 and not NaN. Found {value}.")
    return values


def _checked_conversion(conversion: str) -> str:
    if conversion not in CONVERSIONS:
        raise InvalidArgumentError("conversion", f"must be one of {list(CONVERSIONS)}. Found {conversion!r}.")
    return conversion


def _checked_count(count: int) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_COUNT:
        raise InvalidArgumentError("count", f"must be an integer in [0, 10^18]. Found {count!r}.")
    return count


# ---------------------------------------------------------------------------------------------
# Curves of single mechanisms (stateless; keyword-only)
# ---------------------------------------------------------------------------------------------


def _positive(curve: FloatArray) -> FloatArray:
    """A curve known to be > 0: values that underflowed to 0 become the smallest positive float."""
    return np.maximum(curve, _TINY)


def _non_decreasing(curve: FloatArray, orders: FloatArray) -> FloatArray:
    """Tighten upper bounds with the fact that the true RDP is non-decreasing in α (van Erven &
    Harremoës 2014, Thm. 3): a bound at a larger order also bounds every smaller one."""
    by_order = np.argsort(orders, kind="stable")
    tightened = np.empty_like(curve)
    tightened[by_order] = np.minimum.accumulate(curve[by_order][::-1])[::-1]
    return tightened


def _gaussian_rdp(*, noise_multiplier: float, orders: FloatArray) -> FloatArray:
    """Gaussian mechanism, L2 sensitivity 1: ρ(α) = α/(2σ²) (Mironov 2017, Prop. 7)."""
    with np.errstate(over="ignore"):
        # σ·σ, not σ**2: a float σ² beyond the float range is ∞ (ρ = 0), where ** raises
        if noise_multiplier > 1e-150:
            curve = orders / (2.0 * noise_multiplier * noise_multiplier)
        else:
            curve = orders * np.inf
    return _positive(curve)


def _pure_dp_rdp(*, epsilon: float, orders: FloatArray) -> FloatArray:
    """ε-DP ⇒ ρ(α) ≤ min(ε, αε²/2).

    ε: D_α ≤ D_∞ ≤ ε (van Erven & Harremoës 2014, Thm. 3). αε²/2: ε-DP implies (ε²/2)-zCDP
    (Bun & Steinke 2016, Prop. 3.3), i.e. ρ(α) ≤ αε²/2 for every α > 1.
    """
    if epsilon == 0:
        return np.zeros_like(orders)
    with np.errstate(over="ignore"):
        curve = np.minimum(epsilon, orders * (epsilon * epsilon / 2.0))
    return _positive(curve)


def _expm1_minus_x(y: FloatArray) -> FloatArray:
    """e^y − 1 − y without cancellation (Taylor series for |y| < 0.1; it is ≥ 0 for all y)."""
    small = np.abs(y) < 0.1
    ys = np.where(small, y, 0.0)
    series = np.zeros_like(ys)
    term = ys * ys / 2.0
    for k in range(3, 16):  # |y|^15/15! < 1e-27 for |y| < 0.1
        series = series + term
        term = term * ys / k
    with np.errstate(over="ignore"):
        direct = np.expm1(np.where(small, 0.0, y)) - np.where(small, 0.0, y)
    return np.where(small, series, direct)


def _laplace_rdp(*, scale: float, orders: FloatArray) -> FloatArray:
    """Laplace mechanism, L1 sensitivity 1, scale b, ε = 1/b (Mironov 2017, Prop. 6):

        ρ(α) = 1/(α−1) · log( α/(2α−1)·e^{(α−1)ε} + (α−1)/(2α−1)·e^{−αε} ).

    The argument of the log is E[e^{εX}] for X ∈ {α−1, −α} with probabilities
    {α/(2α−1), (α−1)/(2α−1)}, and E[X] = 0. So E[e^{εX}] − 1 = E[e^{εX} − 1 − εX], a sum of
    non-negative terms: ``log1p`` of it is exact to rounding even for ε = 1e-9, where the printed
    form cancels to 0 (or below). For large (α−1)ε the log-sum-exp form is used. Result clamped to
    ``min(ε, αε²/2)``, both valid upper bounds (``_pure_dp_rdp``).
    """
    epsilon = 1.0 / scale
    a = orders
    p = a / (2.0 * a - 1.0)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        hi = (a - 1.0) * epsilon
        lo = -a * epsilon
        mean_excess = p * _expm1_minus_x(np.where(hi < 30.0, hi, 0.0)) + (1.0 - p) * _expm1_minus_x(
            np.where(hi < 30.0, lo, 0.0)
        )
        small_form = np.log1p(mean_excess)
        large_form = np.logaddexp(np.log(p) + hi, np.log1p(-p) + lo)
        cgf = np.where(hi < 30.0, small_form, large_form)
        curve = cgf / (a - 1.0)
    curve = np.minimum(curve, _pure_dp_rdp(epsilon=epsilon, orders=orders))
    return _positive(curve)


def _log_expm1_of_log(log_y: FloatArray) -> FloatArray:
    """log(e^y − 1) given log y, with no underflow for tiny y nor overflow for large y."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        y = np.exp(log_y)
        tiny = log_y + y / 2.0  # log(y(1 + y/2 + ...)); exact to rounding for y < e^-20
        moderate = np.log(np.expm1(np.minimum(y, 40.0)))
        large = y + np.log1p(-np.exp(-y))
    return np.where(log_y < -20.0, tiny, np.where(y < 40.0, moderate, large))


@functools.lru_cache(maxsize=64)
def _segments(alphas: tuple[int, ...]) -> tuple[npt.NDArray[np.int64], ...]:
    """Flat index arrays for the sums over i = 2..α of every integer α: (α of each term, i of each
    term, start of each α's segment). Depends on the orders only, so it is cached."""
    lengths = np.asarray(alphas, dtype=np.int64) - 1
    starts = np.cumsum(lengths) - lengths
    owner = np.repeat(np.arange(len(alphas)), lengths)
    i = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths) + 2
    return np.asarray(alphas, dtype=np.int64)[owner], i, starts, owner


def _segment_logsumexp(
    terms: FloatArray, starts: npt.NDArray[np.int64], owner: npt.NDArray[np.int64]
) -> FloatArray:
    peak = np.maximum.reduceat(terms, starts)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        scaled = np.where(np.isfinite(terms), np.exp(terms - peak[owner]), 0.0)
        out = peak + np.log(np.add.reduceat(scaled, starts))
    # A term of +∞ (e.g. σ so small that e^{i(i−1)/(2σ²)} overflows even in log space): sum = ∞.
    return np.where(np.isposinf(peak), np.inf, out)


def _log_a_integer(*, q: float, noise_multiplier: float, alphas: npt.NDArray[np.int64]) -> FloatArray:
    """log(A_α − 1) of the Poisson-sampled Gaussian at integer α ≥ 2, 0 < q < 1.

    Mironov, Talwar & Zhang 2019, Sec. 3.3: A_α = Σ_{i=0}^{α} C(α,i) qⁱ(1−q)^{α−i} e^{i(i−1)/(2σ²)}.
    The binomial weights sum to 1 and i(i−1) = 0 for i ∈ {0, 1}, so
    A_α − 1 = Σ_{i=2}^{α} C(α,i) qⁱ(1−q)^{α−i} (e^{i(i−1)/(2σ²)} − 1): every term is ≥ 0 and the sum,
    taken in log space, has no cancellation. ``_rho_from_log_a_minus_1`` turns it into ρ.
    """
    a, i, starts, owner = _segments(tuple(alphas.tolist()))
    k = np.arange(int(alphas.max()) + 1, dtype=np.float64)
    log_factorial = special.gammaln(k + 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_excess = _log_expm1_of_log(
            np.log(k) + np.log(k - 1.0) - math.log(2.0) - 2.0 * math.log(noise_multiplier)
        )
    terms = (
        log_factorial[a]
        - log_factorial[i]
        - log_factorial[a - i]
        + i * math.log(q)
        + (a - i) * math.log1p(-q)
        + log_excess[i]
    )
    return _segment_logsumexp(terms, starts, owner)


def _rho_from_log_a_minus_1(log_a_minus_1: FloatArray, alphas: FloatArray) -> FloatArray:
    """ρ = log(1 + (A−1))/(α−1), from log(A−1), for every magnitude of A − 1.

    For A − 1 < e^-30 we return (A−1)/(α−1) ≥ log1p(A−1)/(α−1): an upper bound exact to 1e-13
    that does not underflow as early as log1p would.
    """
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        x = log_a_minus_1
        log_a = np.where(x > 0.0, x + np.log1p(np.exp(-np.abs(x))), np.log1p(np.exp(np.minimum(x, 0.0))))
        rho = np.where(x < -30.0, np.exp(x - np.log(alphas - 1.0)), log_a / (alphas - 1.0))
    return np.where(np.isposinf(x), np.inf, _positive(rho))


def _alternating_tail_weights(terms: int) -> tuple[FloatArray, float]:
    """Weights wₖ and error factor of Algorithm 1 of Cohen, Rodriguez Villegas & Zagier 2000
    ("Convergence acceleration of alternating series", Experimental Math. 9(1)): for a completely
    monotone sequence aₖ (a Hausdorff moment sequence, aₖ = ∫₀¹ xᵏ dμ with μ ≥ 0), the alternating
    sum S = Σₖ (−1)ᵏaₖ satisfies |S − Σ_{k<n} wₖaₖ| ≤ 2S/(3+√8)ⁿ ≤ 2a₀/(3+√8)ⁿ (their error bound
    for Algorithm 1; S ≤ a₀ for an alternating series with decreasing terms)."""
    d = (3.0 + math.sqrt(8.0)) ** terms
    d = (d + 1.0 / d) / 2.0
    b, c = -1.0, -d
    weights = []
    for k in range(terms):
        c = b - c
        weights.append(c / d)
        b = (k + terms) * (k - terms) * b / ((k + 0.5) * (k + 1.0))
    return np.array(weights, dtype=np.float64), 2.0 / (3.0 + math.sqrt(8.0)) ** terms


_TAIL_TERMS: Final = 28
_TAIL_WEIGHTS, _TAIL_ERROR = _alternating_tail_weights(_TAIL_TERMS)


def _log_a_fractional(*, q: float, noise_multiplier: float, alphas: FloatArray) -> FloatArray:
    """An upper bound, tight to rounding, on log A_α at fractional α > 1, 0 < q < 1, from the
    series of Mironov, Talwar & Zhang 2019, Sec. 3.3.

    With z0 = σ²·log(1/q − 1) + 1/2 (where (1−q)N(0,σ²) = qN(1,σ²)), expanding (1 − q + q·r)^α
    on each side of z0 gives A_α = Σ_{i≥0} C(α,i)(t0ᵢ + t1ᵢ), j = α − i,
        t0ᵢ = qⁱ(1−q)^{α−i} e^{(i²−i)/(2σ²)} Φ((z0−i)/σ),
        t1ᵢ = q^{α−i}(1−q)ⁱ e^{(j²−j)/(2σ²)} Φ((j−z0)/σ).
    Exact algebra turns them into t0ᵢ = K·erfcx(x0/√2)/2 and t1ᵢ = K·erfcx(x1/√2)/2 with
    K = (1−q)^α e^{−z0²/(2σ²)}, x0 = (i−z0)/σ, x1 = (z0−j)/σ; we use that form where the
    Gaussian tail is the small factor (it avoids subtracting two huge exponents at small σ).

    Terms i ≤ ⌊α⌋ are positive and summed directly. From i0 = ⌊α⌋ + 1 on, C(α,i) alternates in
    sign and |C(α,i)| = Γ(α+1)|sin πα|/π · Γ(i−α)/Γ(i+1) is a Beta integral in i, so completely
    monotone; erfcx is a Laplace transform, so erfcx(x0/√2) and erfcx(x1/√2) are completely
    monotone in i too. Their product is, so the tail is an alternating series with completely
    monotone magnitudes, summed by the Cohen–Rodriguez Villegas–Zagier acceleration with its
    rigorous error bound (a few dozen terms instead of thousands for α near 1). We add that
    bound and an allowance for the rounding of every term, so the result is an upper bound.
    """
    sigma = noise_multiplier
    floors = np.floor(alphas)
    size = int(floors.max()) + 1 + _TAIL_TERMS
    a = alphas[:, None]
    i = np.arange(size, dtype=np.float64)[None, :]
    j = a - i
    log_q = math.log(q)
    log_1mq = math.log1p(-q)
    two_var = 2.0 * sigma * sigma
    with np.errstate(all="ignore"):
        z0 = sigma * sigma * (log_1mq - log_q) + 0.5
        log_k = a * log_1mq - z0 * z0 / two_var
        size_k = np.abs(a * log_1mq) + z0 * z0 / two_var
        g_a, g_i, g_j = special.gammaln(a + 1.0), special.gammaln(i + 1.0), special.gammaln(j + 1.0)
        log_binom = g_a - g_i - g_j
        size_binom = np.abs(g_a) + np.abs(g_i) + np.abs(g_j)

        def half(first: FloatArray, second: FloatArray, x: FloatArray) -> tuple[FloatArray, FloatArray]:
            # first: power of q, second: power of 1−q, x: the standardised distance to z0.
            pieces = (first * log_q, second * log_1mq, (first * first - first) / two_var)
            ndtr = special.log_ndtr(-x)
            body = pieces[0] + pieces[1] + pieces[2] + ndtr
            body_size = np.abs(pieces[0]) + np.abs(pieces[1]) + np.abs(pieces[2]) + np.abs(ndtr)
            erfcx = np.log(0.5 * special.erfcx(np.maximum(x, 0.0) / math.sqrt(2.0)))
            tail = log_k + erfcx
            tail_size = size_k + np.abs(erfcx)
            return np.where(x > 0.0, tail, body), np.where(x > 0.0, tail_size, body_size)

        log_t0, size_t0 = half(i, j, (i - z0) / sigma)
        log_t1, size_t1 = half(j, i, (z0 - j) / sigma)
        log_halves = np.logaddexp(log_t0, log_t1)
        log_c = log_binom + log_halves
        # Absolute error of log_c: a few ulps of the magnitudes that were added up, each half
        # weighted by its share of the term.
        share0 = np.exp(log_t0 - log_halves)
        share0 = np.where(np.isnan(share0), 0.5, share0)
        log_error = 8.0 * _EPS * (1.0 + size_binom + share0 * size_t0 + (1.0 - share0) * size_t1)

        rows = np.arange(alphas.size)[:, None]
        head_mask = i <= floors[:, None]
        tail_cols = floors[:, None].astype(np.int64) + 1 + np.arange(_TAIL_TERMS)[None, :]
        peak = np.max(np.where(head_mask, log_c, -np.inf), axis=1)
        peak = np.maximum(peak, np.max(log_c[rows, tail_cols], axis=1))[:, None]
        magnitudes = np.exp(log_c - peak)
        head = np.sum(np.where(head_mask, magnitudes, 0.0), axis=1)
        tail_magnitudes = magnitudes[rows, tail_cols]
        tail = tail_magnitudes @ _TAIL_WEIGHTS
        used = np.where(head_mask, magnitudes, 0.0)
        rounding = np.sum(used * log_error, axis=1) + np.sum(
            tail_magnitudes * (log_error[rows, tail_cols] + 4.0 * _TAIL_TERMS * _EPS), axis=1
        )
        upper = head + tail + _TAIL_ERROR * tail_magnitudes[:, 0] + rounding
        upper = upper * (1.0 + 4.0 * size * _EPS)  # the summations' own rounding
        log_a = peak[:, 0] + np.log(upper)
    valid = np.isfinite(log_a) & (upper > 0)
    return np.where(valid, np.maximum(log_a, 0.0), np.inf)


# Above this many matrix entries (orders × columns), ``_log_a_fractional`` runs per group of
# orders of similar size. Below it, one matrix as always (the same bits as before).
_FRACTIONAL_MATRIX_LIMIT: Final = 2**21


def _log_a_fractional_grouped(*, q: float, noise_multiplier: float, alphas: FloatArray) -> FloatArray:
    """``_log_a_fractional`` in one matrix of (orders × (⌊max α⌋ + 29)) entries when that is small,
    else per group of orders whose ⌊α⌋ share a power of two: a grid holding many small orders and
    one near 2²⁰ then costs about 2·Σ⌈α⌉ entries, not (number of orders) × 2²⁰ (gigabytes)."""
    size = int(np.floor(alphas).max()) + 1 + _TAIL_TERMS
    if alphas.size * size <= _FRACTIONAL_MATRIX_LIMIT:
        return _log_a_fractional(q=q, noise_multiplier=noise_multiplier, alphas=alphas)
    out = np.empty_like(alphas)
    buckets = np.floor(np.log2(np.floor(alphas))).astype(np.int64)
    for bucket in np.unique(buckets):
        rows = np.flatnonzero(buckets == bucket)
        # Rows of one call: as many as fit the limit (at least one), to bound the peak memory.
        per_call = max(1, _FRACTIONAL_MATRIX_LIMIT // (2 ** (int(bucket) + 1) + 1 + _TAIL_TERMS))
        for start in range(0, rows.size, per_call):
            chunk = rows[start : start + per_call]
            out[chunk] = _log_a_fractional(q=q, noise_multiplier=noise_multiplier, alphas=alphas[chunk])
    return out


def _poisson_gaussian_rdp_uncached(
    *, sampling_probability: float, noise_multiplier: float, orders: FloatArray
) -> FloatArray:
    """Exact RDP of the Poisson-sampled Gaussian mechanism (Mironov, Talwar & Zhang 2019, Sec. 3.3)
    at every order; see ``_log_a_integer`` and ``_log_a_fractional``."""
    q, sigma = sampling_probability, noise_multiplier
    if q == 1.0:
        return _gaussian_rdp(noise_multiplier=sigma, orders=orders)
    integral = orders == np.floor(orders)
    # Integer orders needed: the grid's own, and the neighbours of every fractional order.
    fractional = orders[~integral]
    needed = np.unique(
        np.concatenate([orders[integral], np.floor(fractional), np.ceil(fractional)]).astype(np.int64)
    )
    needed = needed[needed >= 2]
    log_a_minus_1 = _log_a_integer(q=q, noise_multiplier=sigma, alphas=needed)
    rho_int = _rho_from_log_a_minus_1(log_a_minus_1, needed.astype(np.float64))
    by_order = dict(zip(needed.tolist(), rho_int.tolist(), strict=True))
    by_order[1] = 0.0

    curve = np.empty_like(orders)
    curve[integral] = [by_order[int(a)] for a in orders[integral]]
    if fractional.size:
        lo = np.floor(fractional)
        hi = lo + 1.0
        t = fractional - lo
        # Convexity of log A_α = (α−1)ρ(α) in α (van Erven & Harremoës 2014, Cor. 2).
        with np.errstate(invalid="ignore"):
            log_a_interp = (1.0 - t) * (lo - 1.0) * np.array([by_order[int(v)] for v in lo]) + t * (
                hi - 1.0
            ) * np.array([by_order[int(v)] for v in hi])
        log_a_interp = np.where(np.isnan(log_a_interp), np.inf, log_a_interp)
        log_a_series = _log_a_fractional_grouped(q=q, noise_multiplier=sigma, alphas=fractional)
        log_a = np.minimum(log_a_series, log_a_interp)
        curve[~integral] = _positive(log_a / (fractional - 1.0))
    # Sampling never hurts: D_α of the sampled mechanism ≤ that of the unsampled one (couple the
    # samples of neighbouring datasets; Rényi divergence is jointly quasi-convex). Only rounding
    # could break this; the clamp keeps it.
    curve = np.minimum(curve, _gaussian_rdp(noise_multiplier=sigma, orders=orders))
    return _non_decreasing(curve, orders)


@functools.lru_cache(maxsize=512)  # ~5 kB per entry with the default orders
def _poisson_gaussian_rdp_cached(
    sampling_probability: float, noise_multiplier: float, orders: tuple[float, ...]
) -> tuple[float, ...]:
    curve = _poisson_gaussian_rdp_uncached(
        sampling_probability=sampling_probability,
        noise_multiplier=noise_multiplier,
        orders=np.asarray(orders, dtype=np.float64),
    )
    return tuple(curve.tolist())


def _poisson_gaussian_rdp(
    *, sampling_probability: float, noise_multiplier: float, orders: FloatArray
) -> FloatArray:
    """Exact RDP of the Poisson-sampled Gaussian mechanism (cached by (q, σ, orders))."""
    return np.asarray(
        _poisson_gaussian_rdp_cached(
            float(sampling_probability), float(noise_multiplier), tuple(orders.tolist())
        ),
        dtype=np.float64,
    )


@functools.cache
def _log_binomial_table(size: int) -> FloatArray:
    """log C(l, i) for 0 ≤ i ≤ l < size (−∞ elsewhere), from exact integers."""
    table = np.full((size, size), -np.inf)
    for order in range(size):
        table[order, : order + 1] = [math.log(math.comb(order, k)) for k in range(order + 1)]
    return table


@functools.lru_cache(maxsize=128)
def _wbk_log_forward_differences(*, noise_multiplier: float) -> FloatArray:
    """log of upper bounds on B(l) = Δˡf(0), f(k) = e^{k(k−1)/(2σ²)}, for l ≤ 256 (used at even l):
    the forward differences of Wang, Balle & Kasiviswanathan 2019, Thm. 27.

    B(l) = Σᵢ (−1)^{l−i} C(l,i) f(i) is summed exactly (``math.fsum``) after scaling by its
    largest term, and an allowance for the rounding of every term (binomials are exact, so it is
    the rounding of the exponent) is added: the value is an upper bound even where the
    alternating sum cancels (large σ). There WBK's other branch, 2e^{(j−1)ε(j)}, takes over.
    """
    size = _WBK_MAX_EXACT_ORDER + 1
    log_binom = _log_binomial_table(size)
    i = np.arange(size, dtype=np.float64)[None, :]
    orders = np.arange(size)[:, None]
    with np.errstate(over="ignore", invalid="ignore"):
        logs = log_binom + i * (i - 1.0) / (2.0 * noise_multiplier * noise_multiplier)
        peak = np.max(logs, axis=1, keepdims=True)
        scaled = np.exp(logs - peak)
        signs = np.where((orders - i) % 2 == 1, -1.0, 1.0)
        allowance = np.sum(
            np.where(np.isfinite(logs), scaled * 8.0 * _EPS * (1.0 + np.abs(logs) + np.abs(peak)), 0.0),
            axis=1,
        )
    out = np.full(size, np.inf)
    for order in range(size):
        if not math.isfinite(float(peak[order, 0])):
            continue
        row = signs[order, : order + 1] * scaled[order, : order + 1]
        exact = math.fsum(row.tolist())
        out[order] = float(peak[order, 0]) + math.log(max(exact, 0.0) + float(allowance[order]))
    out.flags.writeable = False  # cached and shared
    return out


def _wor_gaussian_rdp(*, sampling_fraction: float, noise_multiplier: float, orders: FloatArray) -> FloatArray:
    """RDP of the Gaussian mechanism on a uniformly random subset of fixed size (sampling without
    replacement, replace-one neighbours): Wang, Balle & Kasiviswanathan 2019, Thm. 27,

        ρ(α) ≤ 1/(α−1)·log(1 + q²C(α,2)·min{4(e^{ε(2)}−1), 2e^{ε(2)}}
                          + Σ_{j=3}^{α} qʲC(α,j)·min{4√(B(2⌊j/2⌋)B(2⌈j/2⌉)), 2e^{(j−1)ε(j)}}),

    ε(j) = j/(2σ²), at integer α. For j > 256 only the second branch is used (as in
    dp-accounting; each branch alone bounds the term). RDP is non-decreasing in α (van Erven &
    Harremoës 2014, Thm. 3), so a fractional α takes the value at ⌈α⌉, and every order takes the
    smallest bound found at any order ≥ it. Capped by the unsampled Gaussian's α/(2σ²).
    """
    q, sigma = sampling_fraction, noise_multiplier
    if q == 1.0:
        return _gaussian_rdp(noise_multiplier=sigma, orders=orders)
    ceilings = np.ceil(orders).astype(np.int64)
    alphas = np.unique(ceilings)
    log_b = _wbk_log_forward_differences(noise_multiplier=sigma)
    inv_two_var = 1.0 / (2.0 * sigma * sigma)
    a_int, j_int, starts, owner = _segments(tuple(alphas.tolist()))
    a = a_int.astype(np.float64)
    j = j_int.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        log_binom = special.gammaln(a + 1.0) - special.gammaln(j + 1.0) - special.gammaln(a - j + 1.0)
        cap = math.log(2.0) + (j - 1.0) * j * inv_two_var
        lo = (2 * np.floor(j / 2)).astype(np.int64)
        hi = (2 * np.ceil(j / 2)).astype(np.int64)
        in_table = hi <= _WBK_MAX_EXACT_ORDER
        b_branch = np.full(j.shape, np.inf)
        b_branch[in_table] = math.log(4.0) + 0.5 * (log_b[lo[in_table]] + log_b[hi[in_table]])
        branch = np.minimum(b_branch, cap)
        eps2 = 2.0 * inv_two_var
        first = min(
            math.log(4.0) + float(_log_expm1_of_log(np.array([math.log(eps2)]))[0]),
            math.log(2.0) + eps2,
        )
        branch = np.where(j == 2.0, first, branch)
        terms = j * math.log(q) + log_binom + branch
        log_sum = _segment_logsumexp(terms, starts, owner)
        rho = np.logaddexp(0.0, log_sum) / (alphas - 1.0)
    rho = np.where(np.isnan(rho), np.inf, rho)
    by_order = dict(zip(alphas.tolist(), rho.tolist(), strict=True))
    curve = np.array([by_order[int(c)] for c in ceilings], dtype=np.float64)
    # Sampling never hurts (couple the samples of neighbouring datasets; Rényi divergence is
    # jointly quasi-convex): the unsampled Gaussian's α/(2σ²) bounds the sampled mechanism too.
    curve = np.minimum(curve, _gaussian_rdp(noise_multiplier=sigma, orders=orders))
    return _positive(_non_decreasing(curve, orders))


# ---------------------------------------------------------------------------------------------
# The recursive dispatcher: one code path for the dry run (supports) and the real computation
# ---------------------------------------------------------------------------------------------


def _gaussian_precision(event: DpEvent) -> float:
    """Σ 1/σ² of the Gaussian noise a sampled event wraps (0 for ``no_op``, ∞ for
    ``non_private``): composed Gaussians on the same sample are one Gaussian with
    σ = (Σ 1/σ_k²)^{-1/2}. Raises ``UnsupportedEventError`` naming the innermost other event."""
    if isinstance(event, GaussianEvent | AdaptiveGaussianEvent):
        sigma = event.noise_multiplier
        return 1.0 / (sigma * sigma) if sigma > 1e-150 else math.inf
    if isinstance(event, NoOpEvent):
        return 0.0
    if isinstance(event, NonPrivateEvent):
        return math.inf
    if isinstance(event, SelfComposedEvent):
        inner = _gaussian_precision(event.event)
        return 0.0 if event.count == 0 else event.count * inner
    if isinstance(event, ComposedEvent):
        return math.fsum(_gaussian_precision(e) for e in event.events)
    raise UnsupportedEventError(
        NAME,
        event,
        "RDP amplification by sampling is implemented for Gaussian noise only; the sampled event "
        "must wrap gaussian or adaptive_gaussian events (or compositions of them)",
    )


def _sampled_curve(
    *, precision: float, probability: float, without_replacement: bool, orders: FloatArray, evaluate: bool
) -> FloatArray:
    if not evaluate or precision == 0.0:
        return np.zeros_like(orders)
    if math.isinf(precision):
        return np.full_like(orders, np.inf)
    sigma = 1.0 / math.sqrt(precision)
    if without_replacement:
        return _wor_gaussian_rdp(sampling_fraction=probability, noise_multiplier=sigma, orders=orders)
    return _poisson_gaussian_rdp(sampling_probability=probability, noise_multiplier=sigma, orders=orders)


def _scaled(curve: FloatArray, count: float) -> FloatArray:
    """count·curve with 0·anything = 0 (no NaN from 0·∞) and overflow to +∞ (a valid bound)."""
    if count == 0:
        return np.zeros_like(curve)
    with np.errstate(over="ignore"):
        return np.where(curve == 0.0, 0.0, curve * float(count))


def _dispatch(event: DpEvent, orders: FloatArray, *, evaluate: bool) -> FloatArray:
    """The RDP curve of ``event`` (``evaluate=True``) or, for the dry run, zeros after checking
    that every part of ``event`` is supported. Raises ``UnsupportedEventError``."""
    zeros = np.zeros_like(orders)
    if isinstance(event, NoOpEvent):
        return zeros
    if isinstance(event, NonPrivateEvent):
        return np.full_like(orders, np.inf) if evaluate else zeros
    if isinstance(event, GaussianEvent | AdaptiveGaussianEvent):
        return _gaussian_rdp(noise_multiplier=event.noise_multiplier, orders=orders) if evaluate else zeros
    if isinstance(event, LaplaceEvent):
        return _laplace_rdp(scale=event.scale, orders=orders) if evaluate else zeros
    if isinstance(event, PureDpEvent):
        return _pure_dp_rdp(epsilon=event.epsilon, orders=orders) if evaluate else zeros
    if isinstance(event, OutputPerturbationEvent):
        # Δ₂/b for the float noise scale b the trainer draws with (≥ the declared ε by an ulp
        # when fl(Δ₂/ε) rounds down), as the basic and prv accountants charge it.
        epsilon = output_perturbation_event_epsilon(event)
        return _pure_dp_rdp(epsilon=epsilon, orders=orders) if evaluate else zeros
    if isinstance(event, FunctionalMechanismL2DPEvent):
        return _pure_dp_rdp(epsilon=l2dp_ml_event_epsilon(event), orders=orders) if evaluate else zeros
    if isinstance(event, ApproxDpEvent):
        if event.delta == 0:
            return _pure_dp_rdp(epsilon=event.epsilon, orders=orders) if evaluate else zeros
        raise UnsupportedEventError(
            NAME, event, "no RDP guarantee follows from (epsilon, delta)-DP with delta > 0"
        )
    if isinstance(event, SelfComposedEvent):
        inner = _dispatch(event.event, orders, evaluate=evaluate)
        return _scaled(inner, event.count) if evaluate else zeros
    if isinstance(event, ComposedEvent):
        total = zeros
        for child in event.events:
            total = total + _dispatch(child, orders, evaluate=evaluate)
        return total
    if isinstance(event, PoissonSampledEvent):
        if event.sampling_probability == 1.0:
            return _dispatch(event.event, orders, evaluate=evaluate)
        return _sampled_curve(
            precision=_gaussian_precision(event.event),
            probability=event.sampling_probability,
            without_replacement=False,
            orders=orders,
            evaluate=evaluate,
        )
    if isinstance(event, SampledWithoutReplacementEvent):
        if event.sample_size == event.population_size:
            return _dispatch(event.event, orders, evaluate=evaluate)
        return _sampled_curve(
            precision=_gaussian_precision(event.event),
            probability=event.sample_size / event.population_size,
            without_replacement=True,
            orders=orders,
            evaluate=evaluate,
        )
    raise UnsupportedEventError(NAME, event, "unknown event kind")


def compute_rdp(event: DpEvent, orders: Sequence[float] = DEFAULT_ORDERS) -> FloatArray:
    """The RDP curve ρ(α) of ``event`` at ``orders`` (see the module docstring for the formulas).

    Every entry is ≥ 0 and never NaN; ``inf`` for non-private parts. Raises
    ``UnsupportedEventError`` naming the innermost unsupported event and ``InvalidArgumentError``
    for bad orders.
    """
    grid = _checked_orders(orders)
    return _dispatch(event, grid, evaluate=True)


# ---------------------------------------------------------------------------------------------
# RDP → (ε, δ)
# ---------------------------------------------------------------------------------------------


def rdp_to_epsilon(
    rdp: Sequence[float] | FloatArray,
    orders: Sequence[float] | FloatArray,
    delta: float,
    *,
    conversion: str = "improved",
) -> tuple[float, float]:
    """(ε, best order): the smallest ε over the orders for which the curve implies (ε, δ)-DP.

    ``improved`` (default): ε = ρ + log((α−1)/α) − (log δ + log α)/(α−1) (Canonne, Kamath &
    Steinke 2020, Prop. 12; Balle et al. 2020, Thm. 21), and ε = 0 when δ ≥ √(1 − e^{−ρ})
    (total variation ≤ √(1 − e^{−KL}), Bretagnolle–Huber, with KL ≤ D_α). ``classic``:
    ε = ρ + log(1/δ)/(α−1) (Mironov 2017, Prop. 3). ε is clamped at 0 (a negative value means
    (0, δ)-DP already holds).

    δ = 0: ε = 0 if some order has ρ = 0 (the output distributions coincide), else ∞ — a finite
    grid of orders never certifies pure DP otherwise. If ε = ∞ at every order the first order is
    returned as the "best" one.
    """
    grid = _checked_orders(orders)
    curve = _checked_curve(rdp, grid)
    check_delta(delta)
    _checked_conversion(conversion)
    zero = np.flatnonzero(curve == 0.0)
    if zero.size:
        return 0.0, float(grid[zero[0]])
    if delta == 0:
        return math.inf, float(grid[0])
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if conversion == "classic":
            shift = np.zeros_like(grid)
            tail = math.log(1.0 / delta) / (grid - 1.0)
        else:
            shift = np.log1p(-1.0 / grid)
            tail = -(math.log(delta) + np.log(grid)) / (grid - 1.0)
        eps = curve + shift + tail
        if conversion != "classic":
            total_variation = np.sqrt(-np.expm1(-curve))
            eps = np.where(total_variation <= delta, 0.0, eps)
    eps = np.where(np.isnan(eps), np.inf, eps)
    best = int(np.argmin(eps))
    value = float(eps[best])
    if 0.0 < value < math.inf:
        # Each term is within an ulp or two of its real value and the sum adds one rounding: a
        # margin of 4 ulps of the largest term keeps ε an upper bound even where the terms
        # cancel (ρ = 1e10 and ε = ρ − ln 2 is the nearest float *below* the real one).
        largest = max(abs(float(curve[best])), abs(float(shift[best])), abs(float(tail[best])), value)
        value = value + 4.0 * math.ulp(largest)
    return max(0.0, value), float(grid[best])


def rdp_to_delta(
    rdp: Sequence[float] | FloatArray,
    orders: Sequence[float] | FloatArray,
    epsilon: float,
    *,
    conversion: str = "improved",
) -> tuple[float, float]:
    """(δ, best order): the smallest δ over the orders for which the curve implies (ε, δ)-DP.

    ``improved``: log δ = (α−1)(ρ − ε + log(1 − 1/α)) − log α (Canonne, Kamath & Steinke 2020,
    Prop. 12), and δ ≤ √(1 − e^{−ρ}) (total variation, Bretagnolle–Huber). ``classic``:
    δ = e^{(α−1)(ρ−ε)} (Mironov 2017, Prop. 3). δ is capped at 1; ε = ∞ gives δ = 0.
    """
    grid = _checked_orders(orders)
    curve = _checked_curve(rdp, grid)
    check_epsilon(epsilon)
    _checked_conversion(conversion)
    zero = np.flatnonzero(curve == 0.0)
    if zero.size:
        return 0.0, float(grid[zero[0]])
    if math.isinf(epsilon):
        return 0.0, float(grid[0])
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if conversion == "classic":
            log_delta = (grid - 1.0) * (curve - epsilon)
        else:
            log_delta = (grid - 1.0) * (curve - epsilon + np.log1p(-1.0 / grid)) - np.log(grid)
            log_tv = 0.5 * np.log(-np.expm1(-curve))
            log_delta = np.minimum(log_delta, log_tv)
    log_delta = np.where(np.isnan(log_delta), np.inf, log_delta)
    best = int(np.argmin(log_delta))
    return min(1.0, math.exp(min(float(log_delta[best]), 0.0))), float(grid[best])


# ---------------------------------------------------------------------------------------------
# The accountant
# ---------------------------------------------------------------------------------------------


def log_untouched(event: DpEvent) -> float | None:
    """log P(no step of ``event`` samples a given record) when every mechanism in ``event`` runs
    on a Poisson sample (``no_op`` samples nothing), else ``None``.

    ``self_composed`` multiplies (independent samples per run), ``composed`` adds. The inner
    event of a Poisson sample does not matter: coupling holds for any base mechanism.
    """
    if isinstance(event, NoOpEvent):
        return 0.0
    if isinstance(event, PoissonSampledEvent):
        return math.log1p(-event.sampling_probability) if event.sampling_probability < 1 else -math.inf
    if isinstance(event, SelfComposedEvent):
        inner = log_untouched(event.event)
        if inner is None:
            return None
        return 0.0 if event.count == 0 or inner == 0 else event.count * inner
    if isinstance(event, ComposedEvent):
        parts = [log_untouched(child) for child in event.events]
        if any(p is None for p in parts):
            return None
        return math.fsum(p for p in parts if p is not None)  # −∞ + finite = −∞, never NaN
    return None


def untouched_delta(log_untouched: float) -> float:
    """1 − e^{log_untouched}, rounded up: the δ of the coupling bound (0, 1 − p₀)-DP.

    Coupling (privacy amplification by subsampling, Balle, Barthe & Gaboardi 2018, Thm. 8 with a
    base mechanism that is (∞, 1)-DP; Li, Qardaji & Su 2012): with probability
    p₀ = Π(1 − qᵢ)^{nᵢ} no step samples the record; then the output is distributed exactly as
    without it, so P = p₀·Q + (1 − p₀)·R and |P(S) − Q(S)| ≤ 1 − p₀ for every S (both directions
    of add/remove adjacency). log1p, the products and expm1 are each within a few ulps: a 1e-12
    relative margin covers them (the bound may only grow).
    """
    return min(1.0, -math.expm1(log_untouched) * (1 + 1e-12))


class RdpAccountant(PrivacyAccountant):
    """Sums RDP curves over a fixed grid of orders (Mironov 2017, Prop. 1) and converts to (ε, δ).

    ``get_epsilon`` returns ``EpsilonBound(lower=0, estimate=ε, upper=ε)``: the RDP conversion is
    an upper bound on the true ε and RDP offers no lower bound, so ``lower`` is the trivial 0.
    ``details["order"]`` is the order that gave ε.

    When every composed mechanism runs on a Poisson sample, the composition is also
    (0, 1 − Π(1 − qᵢ)^{nᵢ})-DP by coupling (``untouched_delta``), whatever its RDP curve: for a δ
    at least that, ε = 0 (``details["untouched_delta"]``), and ``get_delta`` never exceeds it.
    Both are valid bounds, so the minimum is (q = 1e-9, σ = 0.01: the curve alone gives ε ≈ 4100
    at δ = 1e-5; the coupling gives 0). RDP curves themselves (and the Rényi filter) are unchanged.
    """

    name = NAME

    def __init__(self, orders: Sequence[float] = DEFAULT_ORDERS, conversion: str = "improved") -> None:
        self._orders = _checked_orders(orders)
        self._conversion = _checked_conversion(conversion)
        self._rdp: FloatArray = np.zeros_like(self._orders)
        # log P(the record is never sampled), or None once a non-sampled mechanism is composed.
        self._log_untouched: float | None = 0.0

    @property
    def orders(self) -> tuple[float, ...]:
        return tuple(self._orders.tolist())

    @property
    def conversion(self) -> str:
        return self._conversion

    @property
    def rdp(self) -> FloatArray:
        """The composed curve so far (a copy)."""
        return self._rdp.copy()

    def supports(self, event: DpEvent) -> bool:
        try:
            _dispatch(event, self._orders, evaluate=False)
        except UnsupportedEventError:
            return False
        return True

    def compose(self, event: DpEvent, count: int = 1) -> RdpAccountant:
        _checked_count(count)
        curve = _dispatch(event, self._orders, evaluate=True)
        self._rdp = self._rdp + _scaled(curve, count)
        if count > 0 and self._log_untouched is not None:
            log_p0 = log_untouched(event)
            if log_p0 is None:
                self._log_untouched = None
            elif log_p0 != 0:
                self._log_untouched = math.fsum((self._log_untouched, count * log_p0))
        return self

    @property
    def untouched_delta(self) -> float | None:
        """The coupling bound's δ (see the class docstring), or None if it does not apply."""
        if self._log_untouched is None or self._log_untouched == 0:
            return None  # nothing sampled, or something not sampled: no coupling bound
        return untouched_delta(self._log_untouched)

    def get_epsilon(self, delta: float) -> EpsilonBound:
        check_delta(delta)
        untouched = self.untouched_delta
        if untouched is not None and delta >= untouched:
            note = (
                f"no step samples the record with probability 1 - {untouched:.3g}, so the "
                f"composition is (0, {untouched:.3g})-DP (subsampling by coupling) and "
                f"delta = {delta:g} covers it: epsilon = 0"
            )
            return EpsilonBound(0.0, 0.0, 0.0, delta, "rdp", note, {"untouched_delta": untouched})
        epsilon, order = rdp_to_epsilon(self._rdp, self._orders, delta, conversion=self._conversion)
        return EpsilonBound(
            lower=0.0,
            estimate=epsilon,
            upper=epsilon,
            delta=delta,
            method="rdp",
            details={"order": order},
        )

    def get_delta(self, epsilon: float) -> float:
        check_epsilon(epsilon)
        delta, _ = rdp_to_delta(self._rdp, self._orders, epsilon, conversion=self._conversion)
        untouched = self.untouched_delta
        return delta if untouched is None else min(delta, untouched)


__all__ = [
    "CONVERSIONS",
    "DEFAULT_ORDERS",
    "MAX_ORDER",
    "MAX_ORDER_WORK",
    "RdpAccountant",
    "compute_rdp",
    "log_untouched",
    "rdp_to_delta",
    "rdp_to_epsilon",
    "untouched_delta",
]
