"""Pessimistic privacy loss distributions of many distinct mechanisms, composed in one pass.

What for
--------
The tight engine (``accountant.prv.tight_epsilon``) prices a composition fixed before it runs.
dp-accounting composes distinct PLDs one convolution at a time and builds a subsampled
Gaussian's PLD point by point in Python (200 distinct DP-SGD entries: ~6 s of CPU); PRV needs a
mesh ∝ 1/√N (Gopi et al. 2021, Thm. 5.5), several times finer than the PLD's. Since pricing
version 5 a composition of more than ``prv.PLD_MAX_DISTINCT`` distinct mechanisms is priced here:

1. **Each distinct mechanism's PLD** is dp-accounting's pessimistic connect-the-dots PLD
   (Doroshenko, Ghazi, Kamath, Kumar & Manurangsi 2022, Algorithm 1: its hockey-stick curve is
   ≥ the mechanism's everywhere; mass beyond its truncation sits at +∞), both directions of
   add-or-remove adjacency, on value grid h. For the (subsampled) Gaussian the hockey-stick
   values at the grid's ε are computed vectorised (``_gaussian_deltas``: dp-accounting's
   ``get_delta_for_epsilon`` with its per-point inverse privacy loss in closed form, same
   formulas; the test checks them against dp-accounting's); the pmf is then dp-accounting's
   ``create_pmf_pessimistic_connect_dots_fixed_gap``. Laplace and pure/approximate DP: dp-accounting's
   own constructors. Cached per (mechanism, h).
2. **Composition**: dominating pairs compose (the PLD of a composition is the convolution of the
   PLDs; a pessimistic PLD of each part gives a pessimistic PLD of the whole: Doroshenko et al.
   2022, Sec. 2). The finite parts are convolved by ONE product of FFTs of length n (Fᵢ^{nᵢ}
   for a mechanism repeated nᵢ times), on a window [a, a + n) of the composed loss chosen by a
   Chernoff bound on the discrete PLDs themselves: P(S ≥ s) ≤ exp(K(λ) − λs), P(S ≤ s) ≤
   exp(K(−λ) + λs), K(λ) = Σ nᵢ log Σⱼ pᵢⱼ e^{λℓᵢⱼ}, so at most τ of mass lies on each side
   outside the window. The circular FFT folds that mass into the window (never removes any).
3. **What is paid in δ** (never in the user's favour): δ_true(ε) = P∞ + Σ p(ℓ)(1 − e^{ε−ℓ})₊
   is at most the window's δ(ε) + 2τ (the folded-out mass, each term's weight ≤ 1) + the FFT
   round-off, estimated as ``prv`` estimates it (4·n·max|negative entry|). ε is the window's
   ε at δ − 2τ − round-off, the worse direction, 4 ulps up.

Deterministic: the same components, grid and δ give the same float on the same platform.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt
import scipy.fft
from scipy.special import log_ndtr, ndtr, ndtri

if TYPE_CHECKING:
    from accountant.prv.variables import Prv

FloatArray = npt.NDArray[np.float64]

MAX_WINDOW: Final = 2**22
"""The most points the composed window may take (beyond: None, the caller's fallback answers)."""
MAX_WORK: Final = 2 * 10**9
"""Distinct PLDs × window points: the FFT work a client's event may ask for."""
_TAIL_SHARE: Final = 1e-4
"""τ, the mass allowed outside the window on each side, as a share of δ rounded down to a power
of 10 (so nearby δ, a geometric rule's levels, reuse one composition)."""
_LAMBDAS: Final = tuple(2.0 ** (k / 2) for k in range(-8, 15))
"""Chernoff parameters tried (1/16 … 128); those with λ times the grid's spread above 300 are
skipped (e^{λℓ} relative to its largest value stays above e^{−300}: nothing underflows)."""
_LOG_MASS_TRUNCATION: Final = -50.0
"""dp-accounting's default truncation of the noise (its ``from_gaussian_mechanism``): the mass
cut off is put at +∞ by the connect-the-dots construction."""


# ---------------------------------------------------------------------------------------------
# One mechanism's pessimistic PLD (both directions)
# ---------------------------------------------------------------------------------------------


class _Pmf:
    """A dense pmf on the grid (lower + j)·h, its finite mass and its mass at +∞."""

    __slots__ = ("infinity", "lower", "probs")

    def __init__(self, lower: int, probs: FloatArray, infinity: float) -> None:
        self.lower = lower
        self.probs = probs
        self.infinity = infinity


def _dense(pmf: Any) -> _Pmf:
    dense = pmf.to_dense_pmf()
    probs = np.asarray(dense._probs, dtype=np.float64)
    return _Pmf(int(dense._lower_loss), probs, float(dense._infinity_mass))


def _log_a_exp_b_plus_c(a: float, b: FloatArray, c: float) -> FloatArray:
    """log(a·e^b + c) for a > 0 > c, elementwise (dp-accounting's ``log_a_times_exp_b_plus_c``)."""
    d = b + np.log(a)
    with np.errstate(divide="ignore", invalid="ignore"):
        out: FloatArray = d + np.log1p(-np.exp(np.log(-c) - d))
    at_zero = b == 0
    if np.any(at_zero):
        out[at_zero] = np.log(a + c)
    return out


def _gaussian_pmf(sigma: float, q: float, add: bool, h: float) -> _Pmf | None:
    """dp-accounting's pessimistic connect-the-dots pmf of the (Poisson-subsampled) Gaussian
    mechanism, sensitivity 1, in one direction (``from_gaussian_mechanism`` with its defaults:
    ``GaussianPrivacyLoss`` truncated at log mass −50, ``create_pmf_pessimistic_connect_dots_fixed_gap``),
    the same formulas evaluated on whole arrays with ``scipy.special`` instead of point by point
    through ``scipy.stats`` (``tests/accountant/test_pld.py`` compares the two). None where
    dp-accounting would refuse the hockey-stick values (not non-increasing)."""
    from dp_accounting.pld import common
    from dp_accounting.pld.pld_pmf import _DELTA_DIFF_TOLERANCE

    s2 = sigma**2

    def loss_remove(x: float) -> float:  # GaussianPrivacyLoss._privacy_loss_remove
        unsampled = (-0.5 - x) / s2
        return unsampled if q == 1.0 else float(common.log_a_times_exp_b_plus_c(q, unsampled, 1 - q))

    def privacy_loss(x: float) -> float:
        return -loss_remove(-x) if add else loss_remove(x)

    # privacy_loss_tail and connect_dots_bounds
    lower_x = float(ndtri(0.5 * math.exp(_LOG_MASS_TRUNCATION))) * sigma
    upper_x = -lower_x
    if add:
        upper_x += 1
    else:
        lower_x -= 1
    upper = math.ceil(privacy_loss(lower_x) / h)
    lower = math.floor(privacy_loss(upper_x) / h)
    epsilons = np.arange(lower, upper + 1) * h

    # AdditiveNoisePrivacyLoss.get_delta_for_epsilon, the inverse privacy loss vectorised
    deltas = np.zeros_like(epsilons, dtype=float)
    boundary: float | None = None
    if q == 1.0:
        inverse = np.full_like(epsilons, True, dtype=bool)
    elif add:
        boundary = -math.log(1 - q)
        inverse = epsilons < -math.log1p(-q)
    else:
        boundary = math.log(1 - q)
        inverse = epsilons > math.log1p(-q)
        deltas[~inverse] = -np.expm1(epsilons[~inverse])
    eps = epsilons[inverse]
    if q == 1.0:
        unsampled = eps
    elif add:
        unsampled = -_log_a_exp_b_plus_c(1 / q, -eps, 1 - 1 / q)
    else:
        unsampled = _log_a_exp_b_plus_c(1 / q, eps, 1 - 1 / q)
    x = -0.5 - unsampled * s2
    if add:
        x = 1 + x
    if boundary is not None:  # dp-accounting's math.isclose branch: the inverse at ∓∞
        near = np.abs(eps - boundary) <= 1e-9 * np.maximum(np.abs(eps), abs(boundary))
        x[near] = -math.inf if add else math.inf
    z = x / sigma
    if add:
        upper_cdf = ndtr(z)
        lower_log_cdf = (
            log_ndtr((x - 1) / sigma)
            if q == 1.0
            else np.logaddexp(np.log1p(-q) + log_ndtr(z), np.log(q) + log_ndtr((x - 1) / sigma))
        )
    else:
        upper_cdf = ndtr((x + 1) / sigma) if q == 1.0 else (1 - q) * ndtr(z) + q * ndtr((x + 1) / sigma)
        lower_log_cdf = log_ndtr(z)
    deltas[inverse] = upper_cdf - np.exp(eps + lower_log_cdf)
    deltas = np.clip(deltas, 0, 1)

    # create_pmf_pessimistic_connect_dots_fixed_gap (Doroshenko et al. 2022, Algorithm 1)
    if upper == lower:
        return _Pmf(lower, np.array([1 - deltas[0]]), float(deltas[0]))
    diffs = np.diff(deltas)
    if np.any(diffs > _DELTA_DIFF_TOLERANCE):
        return None
    deltas = np.minimum.accumulate(deltas)
    diffs = np.diff(deltas)
    probs = np.zeros_like(deltas)
    probs[0] = 1 - deltas[0] + diffs[0] / math.expm1(h)
    probs[1:-1] = (diffs[1:] - diffs[:-1] * math.exp(h)) / math.expm1(h)
    probs[-1] = diffs[-1] / math.expm1(-h)
    return _Pmf(lower, np.maximum(0.0, probs), float(deltas[-1]))


def gaussian_pld(sigma: float, q: float, h: float) -> Any:
    """dp-accounting's ``from_gaussian_mechanism(sigma, sampling_prob=q,
    value_discretization_interval=h)`` (pessimistic, connect-the-dots, add-or-remove), the same
    object bit for bit, built from ``_gaussian_pmf`` (vectorised) through dp-accounting's own
    ``create_pmf``; None where dp-accounting would refuse the hockey-stick values."""
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

    def pmf(add: bool) -> Any:
        one = _gaussian_pmf(sigma, q, add, h)
        if one is None:
            return None
        losses = np.arange(one.lower, one.lower + one.probs.size)  # dp-accounting's keys: numpy ints
        return pld_pmf.create_pmf(dict(zip(losses, one.probs, strict=True)), h, one.infinity, True)

    remove = pmf(False)
    if remove is None:
        return None
    if q == 1.0:
        return PrivacyLossDistribution(remove)
    add = pmf(True)
    return None if add is None else PrivacyLossDistribution(remove, add)


@lru_cache(maxsize=256)  # ~80 kB per mechanism typically (at most ~1 MB: prv's size guards)
def mechanism_pmfs(prv: Prv, h: float) -> tuple[_Pmf, _Pmf] | None:
    """(remove, add) pessimistic pmfs of one mechanism on grid h (the same object twice when the
    PLD is symmetric); None for a mechanism with no PLD here."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from dp_accounting.pld.common import DifferentialPrivacyParameters

    from accountant.prv.variables import GaussianPrv, LaplacePrv, PureDpPrv, SubsampledGaussianPrv

    if isinstance(prv, GaussianPrv):
        one = _gaussian_pmf(prv.noise_multiplier, 1.0, False, h)
        return None if one is None else (one, one)
    if isinstance(prv, SubsampledGaussianPrv):
        q, sigma = prv.sampling_probability, prv.noise_multiplier
        remove, add = _gaussian_pmf(sigma, q, False, h), _gaussian_pmf(sigma, q, True, h)
        return None if remove is None or add is None else (remove, add)
    if isinstance(prv, LaplacePrv):
        dist = pld_lib.from_laplace_mechanism(
            prv.scale, value_discretization_interval=h, pessimistic_estimate=True
        )
    elif isinstance(prv, PureDpPrv):
        dist = pld_lib.from_privacy_parameters(
            DifferentialPrivacyParameters(prv.epsilon, prv.delta), value_discretization_interval=h
        )
    else:
        return None
    remove = _dense(dist._pmf_remove)
    return (remove, remove) if dist._symmetric else (remove, _dense(dist._pmf_add))


# ---------------------------------------------------------------------------------------------
# Composition of one direction
# ---------------------------------------------------------------------------------------------


def _log_mgf(pmfs: list[tuple[_Pmf, int]], h: float, lambdas: FloatArray) -> FloatArray:
    """K(λ) = Σ nᵢ log Σⱼ pᵢⱼ e^{λℓᵢⱼ} of the composition, for each λ (+∞ where a term underflows:
    that λ then bounds nothing)."""
    lo = min(p.lower for p, _ in pmfs)
    hi = max(p.lower + p.probs.size - 1 for p, _ in pmfs)
    losses = np.arange(lo, hi + 1, dtype=np.float64) * h
    shift = np.maximum(lambdas * losses[0], lambdas * losses[-1])  # the largest λℓ on the grid
    table = np.exp(lambdas[:, None] * losses[None, :] - shift[:, None])  # in [e^-300, 1]
    total = np.zeros_like(lambdas)
    for pmf, count in pmfs:
        start = pmf.lower - lo
        sums = table[:, start : start + pmf.probs.size] @ pmf.probs
        # Rounded up: the products' round-off (relative, ≤ m·2⁻⁵³) and terms lost to underflow.
        sums = sums * (1.0 + 1e-9) + pmf.probs.size * np.finfo(np.float64).tiny
        with np.errstate(divide="ignore"):
            total += count * (np.log(sums) + shift)
    total[~np.isfinite(total)] = math.inf
    return total


def _window(pmfs: list[tuple[_Pmf, int]], h: float, tau: float) -> tuple[int, int]:
    """[a, b] (grid indices of the composed loss) with at most τ of its mass above b and at most
    τ below a (Chernoff), clamped to the composed support."""
    support_lo = sum(count * p.lower for p, count in pmfs)
    support_hi = sum(count * (p.lower + p.probs.size - 1) for p, count in pmfs)
    spread = (max(p.lower + p.probs.size for p, _ in pmfs) - min(p.lower for p, _ in pmfs)) * h
    lambdas = np.array([x for x in _LAMBDAS if x * spread <= 300.0], dtype=np.float64)
    if lambdas.size == 0:
        return support_lo, support_hi
    log_tau = math.log(tau)
    up = _log_mgf(pmfs, h, lambdas)
    down = _log_mgf(pmfs, h, -lambdas)
    hi_loss = float(np.min((up - log_tau) / lambdas))
    lo_loss = float(np.max((log_tau - down) / lambdas))
    b = support_hi if not math.isfinite(hi_loss) else min(support_hi, math.ceil(hi_loss / h))
    a = support_lo if not math.isfinite(lo_loss) else max(support_lo, math.floor(lo_loss / h))
    return a, max(a, b)


def _fast_length(size: int) -> int:
    from accountant.prv.domain import fast_length as fast

    return fast(max(2, size))


def _compose_direction(
    pmfs: list[tuple[_Pmf, int]], h: float, tau: float
) -> tuple[int, FloatArray, float, float] | None:
    """(lower index, window pmf, mass at +∞, δ to pay) of one direction's composition."""
    a, b = _window(pmfs, h, tau)
    n = _fast_length(b - a + 1)
    if n > MAX_WINDOW or n * len(pmfs) > MAX_WORK:
        return None
    by_count: dict[int, npt.NDArray[np.complex128]] = {}
    rows = max(1, min(len(pmfs), 2**23 // n))
    batch = np.zeros((rows, n), dtype=np.float64)
    for first in range(0, len(pmfs), rows):
        chunk = pmfs[first : first + rows]
        for row, (pmf, _) in enumerate(chunk):
            probs = pmf.probs
            if probs.size > n:  # fold circularly: a circular convolution of folded inputs is the fold
                probs = np.pad(probs, (0, -probs.size % n)).reshape(-1, n).sum(axis=0)
            batch[row, : probs.size] = probs
        factors = scipy.fft.rfft(batch[: len(chunk)], axis=-1, workers=1)
        batch[: len(chunk)] = 0.0
        for row, (_, count) in enumerate(chunk):
            group = by_count.get(count)
            if group is None:
                by_count[count] = factors[row].copy()
            else:
                group *= factors[row]
    spectrum: npt.NDArray[np.complex128] | None = None
    for count, group in by_count.items():
        if count > 1:
            np.power(group, count, out=group)
        spectrum = group if spectrum is None else spectrum * group
    assert spectrum is not None
    raw = scipy.fft.irfft(spectrum, n)
    # Each pmf sits at its own lower index: raw[j] holds the composed loss at index
    # Σ nᵢ·lowerᵢ + J with J ≡ j (mod n); the window starts at J = a − Σ nᵢ·lowerᵢ.
    base = sum(count * p.lower for p, count in pmfs)
    window = np.roll(raw, -((a - base) % n))
    negative = float(-window.min()) if window.min() < 0 else 0.0
    noise = max(negative, np.finfo(np.float64).eps * float(window.max()) * 1e-3)
    window = np.maximum(window, 0.0)
    log_finite = math.fsum(count * math.log1p(-p.infinity) for p, count in pmfs if p.infinity > 0)
    infinity = -math.expm1(log_finite)
    return a, window, infinity, 2 * tau + 4.0 * n * noise


@lru_cache(maxsize=8)  # windows of ~20 000 points typically (at most MAX_WINDOW)
def _composed(
    components: tuple[tuple[Prv, int], ...], h: float, tau: float
) -> tuple[tuple[int, FloatArray, float, float], ...] | None:
    """Both directions' compositions (one when every PLD is symmetric); None where a mechanism
    has no PLD or the window is too large."""
    pmfs = []
    for prv, count in components:
        pair = mechanism_pmfs(prv, h)
        if pair is None:
            return None
        pmfs.append((pair, count))
    directions = [[(pair[0], n) for pair, n in pmfs]]
    if any(pair[1] is not pair[0] for pair, _ in pmfs):
        directions.append([(pair[1], n) for pair, n in pmfs])
    out = []
    for direction in directions:
        composed = _compose_direction(direction, h, tau)
        if composed is None:
            return None
        out.append(composed)
    return tuple(out)


def composed_epsilon(components: dict[Prv, int], delta: float, h: float) -> float | None:
    """An upper bound on ε(δ) of the composition ``components`` (mechanism → count) by pessimistic
    PLDs on value grid ``h``, or None where it cannot answer (a mechanism without a PLD here, a
    window too large, a δ below what truncation and round-off cost)."""
    from dp_accounting.pld.pld_pmf import DensePLDPmf

    if not 0 < delta < 1:
        return None
    tau = 10.0 ** math.floor(math.log10(delta)) * _TAIL_SHARE
    composed = _composed(tuple(components.items()), h, tau)
    if composed is None:
        return None
    worst = 0.0
    for lower, window, infinity, slack in composed:
        target = delta - slack
        if not target > infinity:
            return None
        eps = float(DensePLDPmf(h, lower, window, infinity, True).get_epsilon_for_delta(target))
        if not math.isfinite(eps) or eps < 0:
            return None
        worst = max(worst, eps)
    for _ in range(4):  # the grid's values are multiples of h; 4 ulps for the float arithmetic
        worst = math.nextafter(worst, math.inf)
    return worst


__all__ = ["MAX_WINDOW", "composed_epsilon", "gaussian_pld", "mechanism_pmfs"]
